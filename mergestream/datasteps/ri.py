"""RI — Resolving Interference: a data-driven pre-step that adapts an expert before it is folded.

Ramesh et al., arXiv 2603.13467 (METHODS.md, "ri"). With unlabeled auxiliary inputs x, the expert's
parameters θᵢ′ (initialised at θᵢ) minimise

    L(θᵢ′) = KL(hᵢ(f_θᵢ(x)) ‖ hᵢ(f_θᵢ′(x)))  +  α/(N−1) · Σ_{j≠i} KL(hⱼ(f_θ₀(x)) ‖ hⱼ(f_θᵢ′(x)))

(the expert keeps its own head's outputs, and through every other task's head hⱼ it looks like
the base θ₀). Then θᵢ′ is folded with any policy. In a stream, the "other" heads are the earlier
tasks' heads; N − 1 is their number, so the first expert (no other heads) is left unchanged.

Two layers:

* :func:`resolve_interference` — the optimisation on an in-memory ``torch.nn.Module`` with any
  feature function ``features(model, batch) -> (B, H)`` and linear heads; no I/O.
* :func:`adapt_expert` — the file-level pre-step: loads an expert folder with a
  :class:`FeatureModel` (default: a Hugging Face encoder with mean pooling,
  :class:`HFEncoderFeatures`; or a user's, via ``package.module:factory``), caches the base's
  features on disk, runs the optimisation under a step and a time budget, and writes the adapted
  expert as a safetensors folder with the expert's own tensor names and dtypes.

Unlike folding, RI trains: the whole expert, its gradients and AdamW's two moments are resident
(≈ 4× the expert's float32 size). It runs in eval mode (no dropout), so with α = 0 the gradient at
θᵢ is exactly zero and the expert comes back unchanged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from ..errors import MergestreamError, ProbeError
from ..io.st import copy_aux_files, load_json
from ..plugins import resolve_callable
from .text import POOLINGS, encode, load_model, load_tokenizer, pool

log = logging.getLogger(__name__)

#: one auxiliary input: a text, or a sentence pair (text, text2)
AuxItem = tuple[str, "str | None"]
#: a linear head: weight (classes × hidden, float32) and bias (classes,)
Head = tuple[torch.Tensor, torch.Tensor]


class RIError(MergestreamError):
    """The RI pre-step cannot run: bad auxiliary data, a head that does not fit the features, a
    feature model that cannot be loaded, or tensor names that do not match the checkpoint."""


@dataclass(frozen=True)
class RIParams:
    """RI hyperparameters.

    Attributes:
        alpha: weight α of the "look like the base through the other heads" term (paper: 1).
        steps: step budget (AdamW updates); 0 makes the pre-step the identity.
        time_budget_seconds: wall-clock budget for the optimisation (s); None: no limit.
        lr: AdamW learning rate (no weight decay, so a zero gradient leaves θ unchanged).
        batch_size: auxiliary examples per step.
        max_length: tokens per example for the default Hugging Face features.
        seed: order of the auxiliary batches.
        eval_examples: examples of the auxiliary set on which the loss is reported before and after.
        eval_every: evaluate L on those examples every N steps and return the best iterate seen
            (θᵢ itself included, as step 0) instead of the last one; 0 returns the last iterate.
            Costs one forward pass over ``eval_examples`` per evaluation and a copy of the trained
            parameters. Our choice: with a loss that starts near its minimum, AdamW's last
            iterate can end above where it started.
    """

    alpha: float = 1.0
    steps: int = 100
    time_budget_seconds: float | None = None
    lr: float = 1e-5
    batch_size: int = 16
    max_length: int = 64
    seed: int = 0
    eval_examples: int = 256
    eval_every: int = 10

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.steps < 0 or self.lr <= 0 or self.batch_size < 1 or self.max_length < 1:
            raise RIError(f"invalid RI parameters {self}: alpha, steps >= 0; lr > 0; batch_size, max_length >= 1")
        if self.eval_every < 0:
            raise RIError("eval_every must be >= 0")
        if self.time_budget_seconds is not None and self.time_budget_seconds < 0:
            raise RIError("time_budget_seconds must be >= 0")


@dataclass
class RIResult:
    """What one RI run did.

    Attributes:
        steps: AdamW steps taken.
        seconds: wall time of the optimisation (s), without loading and writing.
        stopped: ``"steps"`` (step budget reached), ``"time"`` (time budget), or ``"identity"``
            (nothing to do: no steps, or no other heads and α irrelevant).
        loss_before / loss_after: L on the first ``eval_examples`` auxiliary examples at θᵢ and at θᵢ′.
        own_kl_after / base_kl_after: the two terms of ``loss_after`` (base term already weighted).
        losses: the mini-batch loss of every step.
        other_heads: N − 1, the number of other tasks' heads.
        best_step: the step whose iterate was returned (0: θᵢ unchanged; ``steps`` when the last
            iterate is returned or ``eval_every`` is 0).
        eval_losses: (step, L on the eval examples) of every evaluation, step 0 first.
    """

    steps: int = 0
    seconds: float = 0.0
    stopped: str = "identity"
    loss_before: float = 0.0
    loss_after: float = 0.0
    own_kl_after: float = 0.0
    base_kl_after: float = 0.0
    losses: list[float] = field(default_factory=list)
    other_heads: int = 0
    best_step: int = 0
    eval_losses: list[tuple[int, float]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("losses")
        d.pop("eval_losses")
        d["loss_first_step"] = self.losses[0] if self.losses else None
        d["loss_last_step"] = self.losses[-1] if self.losses else None
        return d


# ------------------------------------------------------------------------------------------
# The objective and the optimisation (no I/O)
# ------------------------------------------------------------------------------------------
def _logits(feats: torch.Tensor, head: Head) -> torch.Tensor:
    w, b = head
    return feats @ w.T + b


def ri_terms(student: torch.Tensor, teacher_logp: torch.Tensor, base_feats: torch.Tensor,
             own_head: Head, other_heads: Sequence[Head], alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The two terms of the RI loss on one batch (Ramesh et al., the objective in METHODS.md).

    Args:
        student: features of the adapted expert f_θᵢ′(x), (B, H) float32.
        teacher_logp: log-softmax of the original expert's own logits hᵢ(f_θᵢ(x)), (B, Cᵢ).
        base_feats: the base's features f_θ₀(x), (B, H) float32.
        own_head: hᵢ as (weight (Cᵢ, H), bias (Cᵢ,)).
        other_heads: the hⱼ, j ≠ i.
        alpha: α.

    Returns:
        (KL(hᵢ(f_θᵢ) ‖ hᵢ(f_θᵢ′)), α/(N−1)·Σⱼ KL(hⱼ(f_θ₀) ‖ hⱼ(f_θᵢ′))), scalars, batch means.
    """
    own = F.kl_div(F.log_softmax(_logits(student, own_head), -1), teacher_logp, log_target=True,
                   reduction="batchmean")
    if not other_heads or alpha == 0:
        return own, student.new_zeros(())
    terms = [F.kl_div(F.log_softmax(_logits(student, h), -1), F.log_softmax(_logits(base_feats, h), -1),
                      log_target=True, reduction="batchmean") for h in other_heads]
    return own, alpha / len(other_heads) * torch.stack(terms).sum()


def resolve_interference(model: torch.nn.Module, features: Callable[[torch.nn.Module, list[AuxItem]], torch.Tensor],
                         aux: Sequence[AuxItem], base_features: torch.Tensor, own_head: Head,
                         other_heads: Sequence[Head], params: RIParams = RIParams(), *,
                         teacher_logits: torch.Tensor | None = None,
                         progress: Callable[[int, float], None] | None = None) -> RIResult:
    """Adapt ``model`` (θᵢ, updated in place to θᵢ′) with the RI objective on ``aux``.

    Args:
        model: the expert's module; every floating parameter with ``requires_grad`` is trained.
        features: ``features(model, items) -> (B, H)`` float32 features of a batch (differentiable).
        aux: the unlabeled auxiliary inputs (N items).
        base_features: f_θ₀ of every aux item, (N, H) float32, row i for ``aux[i]``.
        own_head: the expert's head hᵢ, (Cᵢ, H) and (Cᵢ,).
        other_heads: the earlier tasks' heads hⱼ.
        params: budgets and hyperparameters.
        teacher_logits: hᵢ(f_θᵢ(x)) of every aux item, (N, Cᵢ); default: computed from ``model``
            as it is on entry (the usual case: ``model`` is θᵢ).
        progress: called after every step with (step, mini-batch loss).

    Returns:
        :class:`RIResult`; ``stopped == "identity"`` and ``model`` untouched when
        ``params.steps == 0``, or when the teacher is ``model`` itself and the base term vanishes
        (α = 0 or no other heads): then L ≥ 0 = L(θᵢ), θᵢ is already a minimiser, and running
        AdamW would only turn float rounding in a zero gradient into steps of size ~lr.

    Raises:
        RIError: empty ``aux``, ``base_features`` of the wrong shape, heads whose hidden size
            differs from the features', or a non-finite loss.
    """
    n = len(aux)
    if n == 0:
        raise RIError("RI needs at least one auxiliary input")
    if base_features.dim() != 2 or base_features.shape[0] != n:
        raise RIError(f"base_features must be (N={n}, H), got {tuple(base_features.shape)}")
    hidden = base_features.shape[1]
    for k, (w, b) in enumerate([own_head, *other_heads]):
        if w.dim() != 2 or w.shape[1] != hidden or b.shape != (w.shape[0],):
            raise RIError(f"head {k}: weight {tuple(w.shape)} / bias {tuple(b.shape)} do not fit hidden size {hidden}")
    res = RIResult(other_heads=len(other_heads))
    if params.steps == 0 or (teacher_logits is None and (params.alpha == 0 or not other_heads)):
        return res
    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    own_head = (own_head[0].to(dev).float(), own_head[1].to(dev).float())
    other_heads = [(w.to(dev).float(), b.to(dev).float()) for w, b in other_heads]
    base_features = base_features.to(dev).float()
    bs = params.batch_size

    def batches(idx: list[int]):
        for s in range(0, len(idx), bs):
            yield idx[s:s + bs]

    if teacher_logits is not None:
        if teacher_logits.shape != (n, own_head[0].shape[0]):
            raise RIError(f"teacher_logits must be (N={n}, C={own_head[0].shape[0]}), got {tuple(teacher_logits.shape)}")
        teacher = F.log_softmax(teacher_logits.to(dev).float(), -1)
    else:
        with torch.no_grad():  # the teacher: the original expert's own outputs, computed once
            teacher = torch.cat([F.log_softmax(_logits(features(model, [aux[i] for i in b]).float(), own_head), -1)
                                 for b in batches(list(range(n)))])
    ev_idx = list(range(min(n, params.eval_examples)))

    def full_loss() -> tuple[float, float]:
        own_s = base_s = 0.0
        with torch.no_grad():
            for b in batches(ev_idx):
                o, g = ri_terms(features(model, [aux[i] for i in b]).float(), teacher[b], base_features[b],
                                own_head, other_heads, params.alpha)
                own_s += float(o) * len(b)
                base_s += float(g) * len(b)
        return own_s / len(ev_idx), base_s / len(ev_idx)

    o0, g0 = full_loss()
    res.loss_before = o0 + g0
    trainable = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]
    best = _BestIterate(trainable, res.loss_before) if params.eval_every > 0 else None
    res.eval_losses.append((0, res.loss_before))
    opt = torch.optim.AdamW(trainable, lr=params.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(params.seed)
    order: list[int] = []
    t0 = time.perf_counter()
    res.stopped = "steps"
    for step in range(params.steps):
        if params.time_budget_seconds is not None and time.perf_counter() - t0 >= params.time_budget_seconds:
            res.stopped = "time"
            break
        if len(order) < bs:
            order += torch.randperm(n, generator=gen).tolist()
        b, order = order[:bs], order[bs:]
        own, base_t = ri_terms(features(model, [aux[i] for i in b]).float(), teacher[b], base_features[b],
                               own_head, other_heads, params.alpha)
        res.losses.append(optimiser_step(opt, own + base_t, step, RIError, "RI"))
        res.steps = step + 1
        if progress is not None:
            progress(res.steps, res.losses[-1])
        if best is not None and res.steps % params.eval_every == 0 and res.steps < params.steps:
            o, g = full_loss()
            res.eval_losses.append((res.steps, o + g))
            best.offer(res.steps, o + g)
    res.seconds = time.perf_counter() - t0
    o1, g1 = full_loss()
    res.eval_losses.append((res.steps, o1 + g1))
    res.best_step = res.steps
    if best is not None and best.loss < o1 + g1:
        best.restore()
        res.best_step = best.step
        o1, g1 = full_loss()
    res.loss_after, res.own_kl_after, res.base_kl_after = o1 + g1, o1, g1
    opt.zero_grad(set_to_none=True)
    model.train(was_training)
    log.info("ri steps=%d best_step=%d stopped=%s seconds=%.1f loss_before=%.5g loss_after=%.5g other_heads=%d",
             res.steps, res.best_step, res.stopped, res.seconds, res.loss_before, res.loss_after, res.other_heads)
    return res


def optimiser_step(opt: torch.optim.Optimizer, loss: torch.Tensor, step: int, error: type[MergestreamError],
                   what: str) -> float:
    """One update of ``opt`` on the scalar ``loss`` (gradients cleared first); returns the loss.

    Raises:
        error: the loss is NaN or infinite (``what`` names the step in the message).
    """
    if not torch.isfinite(loss):
        raise error(f"{what} loss became non-finite at step {step}")
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach())


class _BestIterate:
    """The trained parameters at the lowest evaluated loss so far (a CPU copy, taken only on improvement)."""

    def __init__(self, params: list[torch.Tensor], loss: float):
        self._params = params
        self.step, self.loss = 0, loss
        self._copy = [p.detach().to("cpu", copy=True) for p in params]

    def offer(self, step: int, loss: float) -> None:
        """Keep the current parameters if ``loss`` is below the best so far."""
        if loss < self.loss:
            self.step, self.loss = step, loss
            for c, p in zip(self._copy, self._params):
                c.copy_(p.detach())

    def restore(self) -> None:
        """Write the best parameters back into the model."""
        with torch.no_grad():
            for c, p in zip(self._copy, self._params):
                p.copy_(c)


# ------------------------------------------------------------------------------------------
# Feature models
# ------------------------------------------------------------------------------------------
class FeatureModel(Protocol):
    """How RI loads a checkpoint as a module and computes features of auxiliary inputs.

    ``load(path, device)`` returns a float32 ``torch.nn.Module`` whose ``state_dict()`` names are the
    checkpoint's tensor names (optionally under one prefix); ``features(model, items)`` returns
    (B, H) float32 features of a batch of :data:`AuxItem`, differentiable w.r.t. the parameters.
    ``identity`` is a string that changes whenever the features would (used in the cache key).
    """

    identity: str

    def load(self, path: Path, device: torch.device) -> torch.nn.Module: ...

    def features(self, model: torch.nn.Module, items: list[AuxItem]) -> torch.Tensor: ...


class HFEncoderFeatures:
    """A Hugging Face encoder (``AutoModel``) with attention-masked mean (or CLS) pooling of the last
    hidden state, the benchmark's and the probes' form (:func:`mergestream.datasteps.text.pool`).

    Args:
        tokenizer: folder holding the tokenizer (the base or the expert).
        pooling: ``"mean"`` or ``"cls"``.
        max_length: truncation length in tokens.

    Raises:
        RIError: a bad pooling, or no tokenizer can be loaded from ``tokenizer``.
    """

    def __init__(self, tokenizer: str | os.PathLike, pooling: str = "mean", max_length: int = 64):
        if pooling not in POOLINGS:
            raise RIError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
        try:
            self.tok = load_tokenizer(tokenizer)
        except ProbeError as exc:
            raise RIError(str(exc)) from exc
        self.pooling = pooling
        self.max_length = max_length
        self.identity = f"hf-encoder:{pooling}:{max_length}:{type(self.tok).__name__}:{len(self.tok)}"

    def load(self, path: Path, device: torch.device) -> torch.nn.Module:
        """A private float32 copy of the encoder at ``path`` on ``device``, in eval mode (RI trains it).

        Raises:
            RIError: transformers cannot load it as a complete encoder.
        """
        try:
            return load_model(path, "encoder", device, reuse=False)
        except ProbeError as exc:
            raise RIError(str(exc)) from exc

    def features(self, model: torch.nn.Module, items: list[AuxItem]) -> torch.Tensor:
        """Pooled last hidden states (B, H) float32 of a batch, differentiable; a batch with any
        pair is encoded as pairs (a missing second text is empty)."""
        a = [t for t, _ in items]
        pair = [t2 for _, t2 in items]
        enc = encode(self.tok, a, [p or "" for p in pair] if any(p is not None for p in pair) else None,
                     max_length=self.max_length)
        dev = next(model.parameters()).device
        enc = {k: v.to(dev) for k, v in enc.items()}
        return pool(model(**enc).last_hidden_state, enc["attention_mask"], self.pooling)


def load_feature_model(spec: str | None, *, tokenizer: str | os.PathLike, pooling: str = "mean",
                       max_length: int = 64, what: str = "ri.forward") -> FeatureModel:
    """The default :class:`HFEncoderFeatures`, or a user's: ``spec = "package.module:factory"`` where
    ``factory()`` returns a :class:`FeatureModel` (resolved with
    :func:`mergestream.plugins.resolve_callable`). ``what``: the config key named in errors.

    Raises:
        RIError: the spec is malformed, cannot be imported, fails, or returns something without
            ``load``/``features``.
    """
    if not spec:
        return HFEncoderFeatures(tokenizer, pooling, max_length)
    factory = resolve_callable(spec, what=what, form="package.module:factory", error=RIError)
    try:
        obj = factory()
    except Exception as exc:
        raise RIError(f"cannot build the feature model {spec!r}: {type(exc).__name__}: {exc}") from exc
    if not all(callable(getattr(obj, a, None)) for a in ("load", "features")):
        raise RIError(f"{spec!r} returned {type(obj).__name__}, which lacks load() / features()")
    if not getattr(obj, "identity", None):
        obj.identity = spec
    return obj


# ------------------------------------------------------------------------------------------
# Auxiliary data and the base-feature cache
# ------------------------------------------------------------------------------------------
def read_aux(path: str | os.PathLike, max_examples: int | None = None) -> list[AuxItem]:
    """Read unlabeled auxiliary inputs: a ``.jsonl`` file (objects with ``text`` and optionally
    ``text2``; other keys such as labels are ignored) or a text file (one input per non-empty line).

    Raises:
        RIError: missing/unreadable file, malformed JSONL line, or no inputs.
    """
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise RIError(f"cannot read RI auxiliary data {p}: {exc}") from None
    out: list[AuxItem] = []
    jsonl = p.suffix.lower() in (".jsonl", ".json")
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if jsonl:
            obj = load_json(line, f"{p}:{no}", error=RIError)
            if not isinstance(obj.get("text"), str) or not obj["text"]:
                raise RIError(f"{p}:{no}: expected an object with a non-empty 'text'")
            t2 = obj.get("text2")
            if t2 is not None and not isinstance(t2, str):
                raise RIError(f"{p}:{no}: 'text2' must be a string")
            out.append((obj["text"], t2))
        else:
            out.append((line.strip(), None))
        if max_examples is not None and len(out) >= max_examples:
            break
    if not out:
        raise RIError(f"{p}: no auxiliary inputs")
    return out


def _weights_identity(path: Path) -> str:
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    return ";".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)


def base_features(fm: FeatureModel, base: Path, aux: Sequence[AuxItem], *, cache_dir: Path | None,
                  device: torch.device, batch_size: int = 64) -> torch.Tensor:
    """f_θ₀ of every auxiliary input, (N, H) float32 on CPU, cached in ``cache_dir`` under a key of
    the base's weight files (name, size, mtime), the inputs and ``fm.identity``."""
    key = hashlib.sha256(json.dumps([str(Path(base).resolve()), _weights_identity(Path(base)), fm.identity,
                                     list(aux)]).encode()).hexdigest()[:20]
    path = cache_dir / f"ri-base-{key}.safetensors" if cache_dir is not None else None
    if path is not None and path.exists():
        from safetensors.torch import load_file

        try:
            t = load_file(str(path))["features"]
            if t.shape[0] == len(aux):
                return t
        except Exception:  # a damaged cache entry is recomputed
            log.warning("ri base-feature cache %s unreadable; recomputing", path)
    model = fm.load(Path(base), device)
    with torch.no_grad():
        feats = torch.cat([fm.features(model, list(aux[s:s + batch_size])).float().cpu()
                           for s in range(0, len(aux), batch_size)])
    del model
    if path is not None:
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file({"features": feats.contiguous()}, str(tmp))
        os.replace(tmp, path)
    return feats


# ------------------------------------------------------------------------------------------
# The file-level pre-step
# ------------------------------------------------------------------------------------------
def match_names(ck_names: list[str], sd: dict[str, torch.Tensor]) -> dict[str, str]:
    """checkpoint name -> state_dict name (exact, or the same name under one model prefix, or the
    checkpoint's name without its first component); names with no match are left out. Shared by the
    file-level steps here and the engine's AdaMerging objective (:mod:`mergestream.engine.coefficients`)."""
    out = {}
    for n in ck_names:
        if n in sd:
            out[n] = n
            continue
        hits = [k for k in sd if k.endswith("." + n) and k.count(".") == n.count(".") + 1]
        if len(hits) == 1:
            out[n] = hits[0]
        elif n.partition(".")[2] in sd:  # the checkpoint carries a prefix the bare model lacks
            out[n] = n.partition(".")[2]
    return out


def write_trained(model: torch.nn.Module, src: Path, out: Path, metadata: dict[str, str], *,
                  error: type[MergestreamError] = RIError) -> None:
    """Write ``model``'s trained parameters as a checkpoint folder ``out`` shaped like ``src``.

    ``out`` holds one ``model.safetensors`` with ``src``'s tensor names and dtypes (tensors the
    model does not train, or that it lacks, are copied bit for bit from ``src``), ``src``'s other
    files (tokenizer, config, task probe, ``1_Pooling/`` ...) and in the safetensors header
    ``src``'s metadata updated with ``metadata``. Staged in ``out.partial`` and renamed, so ``out`` is never half written; an existing
    ``out`` is replaced. ``src`` may be ``out`` itself (a backbone distilled in place).

    Raises:
        error: none of ``src``'s tensor names match the module's trained parameters.
    """
    from safetensors.torch import save_file

    from ..io.checkpoints import open_checkpoint

    sd = {k: v.detach() for k, v in model.state_dict().items()}
    ck = open_checkpoint(src)
    try:
        names = ck.keys()
        mapping = match_names(names, sd)
        header = {**ck.metadata(), **metadata}
        trained = {n for n, p in model.named_parameters() if p.requires_grad}
        if not any(mapping.get(n) in trained for n in names):
            raise error(f"none of {src}'s tensor names match the feature model's parameters "
                        f"(e.g. {names[:3]} vs {list(sd)[:3]})")
        tensors = {}
        for n in names:
            orig = ck.get(n)
            k = mapping.get(n)
            if k is None or k not in trained:
                tensors[n] = orig.contiguous()
            else:
                tensors[n] = sd[k].to("cpu", orig.dtype).reshape(orig.shape).contiguous()
    finally:
        ck.close()
    del sd
    stage = out.with_name(out.name + ".partial")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    copy_aux_files(src, stage)
    save_file(tensors, str(stage / "model.safetensors"), metadata=header)
    if out.exists():
        shutil.rmtree(out)
    os.replace(stage, out)


def adapt_expert(expert: str | os.PathLike, base: str | os.PathLike, out: str | os.PathLike, *,
                 own_head: Head, other_heads: Sequence[Head], aux: Sequence[AuxItem],
                 params: RIParams = RIParams(), feature_model: FeatureModel | None = None,
                 cache_dir: str | os.PathLike | None = None, device: str | torch.device = "cpu",
                 progress: Callable[[int, float], None] | None = None) -> tuple[Path, RIResult]:
    """Run the RI pre-step on an expert folder and write θᵢ′ to ``out``.

    Args:
        expert: the expert θᵢ (a Hugging Face folder for the default features).
        base: θ₀ (same form).
        out: folder for the adapted expert (created; replaced if present). Holds the adapted
            weights as one ``model.safetensors`` (the expert's tensor names and dtypes; tensors the
            optimisation did not touch are copied bit for bit) and the expert's other files.
        own_head / other_heads: hᵢ and the earlier tasks' hⱼ as (weight (C, H), bias (C,)).
        aux: unlabeled auxiliary inputs.
        feature_model: default :class:`HFEncoderFeatures` with the expert's (or base's) tokenizer.
        cache_dir: where the base's features are cached (None: not cached).
        progress: called after each step with (step, loss).

    Returns:
        (the folder to fold, result). With ``params.steps == 0``, α = 0 or no other heads the
        pre-step is the identity and the folder returned is ``expert`` itself (nothing is written).

    Raises:
        RIError: see :func:`resolve_interference`, plus a module whose parameters cannot be matched
            to the checkpoint's tensor names.
    """
    expert, base, out = Path(expert), Path(base), Path(out)
    if params.steps == 0 or params.alpha == 0 or not other_heads:  # see resolve_interference
        return expert, RIResult(other_heads=len(other_heads))
    dev = torch.device(device)
    if feature_model is None:
        tok_src = expert if (expert / "tokenizer_config.json").exists() or (expert / "tokenizer.json").exists() else base
        feature_model = HFEncoderFeatures(tok_src, max_length=params.max_length)
    bf = base_features(feature_model, base, aux, cache_dir=Path(cache_dir) if cache_dir else None, device=dev)
    model = feature_model.load(expert, dev)
    res = resolve_interference(model, feature_model.features, aux, bf, own_head, other_heads, params,
                               progress=progress)
    write_trained(model, expert, out, {"mergestream.ri": json.dumps({**res.to_json(), "params": asdict(params)})},
                  error=RIError)
    return out, res
