"""The data-probe objective for MDM-OC's CMA-ES coefficients in the daemon.

MDM-OC (METHODS.md, "mdm_oc") chooses all coefficients α jointly with CMA-ES; the engine streams
each candidate θ(α) = θ₀ + Σᵢ αᵢ·Δᵢ⊥ from the stored orthogonal deltas (no checkpoint is written).
This module scores a candidate with the daemon's data probes — each registered task's accuracy
through its own head, and the general sentence-similarity probe — on one resident copy of the
encoder whose parameters are overwritten tensor by tensor.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from ..datasteps.text import (
    load_head,
    load_model,
    load_tokenizer,
    read_labelled_jsonl,
    read_scored_pairs,
    sts_spearman,
    task_accuracy,
)
from .probes import ProbeError, SentenceSimilarityProbe, TaskProbeSpec

log = logging.getLogger(__name__)


class ProbeObjective:
    """objective(α, weights) -> loss = −(task_weight·mean task accuracy + general_weight·STS) / 100.

    Args:
        base: θ₀ as a Hugging Face encoder folder (the module the candidates are loaded into).
        tasks: the task probes (earlier accepted experts' and the candidate's own).
        general: the configured sentence-similarity probe, or None.
        tokenizer: folder holding the tokenizer.
        task_weight / general_weight: weights of the two terms.
        examples_per_task: the first N rows of each task probe.
        general_pairs: the first N pairs of the sentence-similarity data.
        device: torch device of the forward passes.
        on_eval: called after each evaluation with (α, score dict) — logging, heartbeats.

    Attributes:
        evaluations: list of (α, {"score", "acc.<task>"..., "sts"}) in call order.

    Raises:
        ProbeError: no task probe and no general probe (nothing to optimise), a malformed probe,
            or a candidate tensor the encoder does not have.
    """

    def __init__(self, base: Path, tasks: list[TaskProbeSpec], general: SentenceSimilarityProbe | None, *,
                 tokenizer: Path, task_weight: float = 1.0, general_weight: float = 1.0,
                 examples_per_task: int = 64, general_pairs: int = 200, device: str = "cpu",
                 on_eval: Callable[[np.ndarray, dict[str, float]], None] | None = None):
        if not (tasks and task_weight > 0) and not (general is not None and general_weight > 0):
            raise ProbeError("the CMA-ES objective needs a task probe or a sentence_similarity probe")
        self.device = torch.device(device)
        self.tok = load_tokenizer(tokenizer)
        self.model = load_model(base, "encoder", self.device, reuse=False)  # its parameters are overwritten
        self.params = dict(self.model.state_dict(keep_vars=False))
        self.task_weight, self.general_weight = task_weight, general_weight
        self.tasks = []
        for spec in tasks:
            w, b = load_head(spec.head, spec.task)
            rows = read_labelled_jsonl(spec.data, examples_per_task)
            self.tasks.append((spec, w, b, rows))
        self.pairs = read_scored_pairs(general.data, general_pairs) if general is not None and general_weight > 0 else []
        self.max_length = general.max_length if general is not None else 128
        self.on_eval = on_eval
        self.evaluations: list[tuple[list[float], dict[str, float]]] = []

    def _target(self, name: str) -> torch.Tensor:
        t = self.params.get(name)
        if t is None and "." in name:
            t = self.params.get(name.partition(".")[2])
        if t is None:
            raise ProbeError(f"candidate tensor {name!r} is not a parameter of {type(self.model).__name__}")
        return t

    @torch.no_grad()
    def load(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Copy a streamed candidate into the resident encoder, one tensor at a time (integer
        tensors, e.g. ``position_ids``, are θ₀'s in every candidate: skipped)."""
        for name, t in weights:
            if (name.startswith("pooler.") and name not in self.params) or not t.is_floating_point():
                continue
            dst = self._target(name)
            if dst.shape != t.shape:
                raise ProbeError(f"candidate tensor {name!r} has shape {tuple(t.shape)}, the encoder {tuple(dst.shape)}")
            dst.copy_(t)

    def score(self) -> dict[str, float]:
        """The probe values of the resident encoder: acc.<task> (%), sts (x100) and the weighted score."""
        out: dict[str, float] = {}
        for spec, w, b, rows in self.tasks:
            out[f"acc.{spec.task}"] = task_accuracy(self.model, self.tok, rows, w, b, task=spec.task,
                                                    pooling=spec.pooling, device=self.device)
        accs = list(out.values())
        score = self.task_weight * float(np.mean(accs)) if accs and self.task_weight > 0 else 0.0
        if self.pairs:
            sts = sts_spearman(self.model, self.tok, self.pairs, max_length=self.max_length, device=self.device)
            out["sts"] = 0.0 if np.isnan(sts) else sts
            score += self.general_weight * out["sts"]
        out["score"] = score
        return out

    def score_model(self, folder: Path) -> dict[str, float]:
        """Load a written candidate (a model folder or safetensors file the engine wrote) into the
        resident encoder, tensor by tensor, and score it (:meth:`score`); the candidate is not kept.

        Raises:
            ProbeError: a tensor the encoder does not have, or of another shape.
        """
        from ..io.checkpoints import open_checkpoint

        with open_checkpoint(folder) as ck:
            self.load((name, ck.get(name)) for name in ck.keys())
        return self.score()

    def __call__(self, alphas: np.ndarray, weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]) -> float:
        t0 = time.perf_counter()
        self.load(weights())
        vals = self.score()
        self.evaluations.append(([float(a) for a in alphas], vals))
        log.info("cmaes evaluation=%d alphas=%s score=%.4f seconds=%.2f", len(self.evaluations),
                 [round(float(a), 4) for a in alphas], vals["score"], time.perf_counter() - t0)
        if self.on_eval is not None:
            self.on_eval(alphas, vals)
        return -vals["score"] / 100.0
