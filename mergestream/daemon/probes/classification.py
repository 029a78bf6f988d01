"""``classification``: an encoder plus the linear task heads experts shipped (``ctx.tasks``).

Metric ``acc.<task>`` for every :class:`~.base.TaskProbeSpec`: accuracy in percent (0–100) of
``argmax(pool(h) @ Wᵀ + b)`` against the labels of the task's JSONL file
(:func:`mergestream.datasteps.text.task_accuracy`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from ...datasteps.text import load_head, load_model, read_labelled_jsonl, task_accuracy
from .base import ProbeContext, ProbeError, positive_int, probe_device, tokenizer_for

log = logging.getLogger(__name__)


class ClassificationProbe:
    """Per-task accuracy: the encoder's pooled embeddings through each task's linear head.

    For every :class:`TaskProbeSpec` in ``ctx.tasks``: embed the examples (``spec.pooling``;
    pairs as ``tokenizer(text, text2)``), logits = E @ Wᵀ + b, and report ``acc.<task>`` =
    100 × the fraction whose argmax equals the label. No tasks: ``{}``.

    Args:
        batch_size: examples per forward pass.
        max_length: truncation length in tokens (capped by the model's positions).
        name: probe name (default ``classification``).

    Raises:
        ProbeError: bad parameters; at call time a malformed head or data file, a head whose
            hidden size differs from the model's, a label ≥ the head's classes, no tokenizer, an
            unloadable model or non-finite embeddings.
    """

    def __init__(self, batch_size: int = 32, max_length: int = 128, name: str = "classification"):
        self.batch_size = positive_int(batch_size, "classification: batch_size", allow_none=False)
        self.max_length = positive_int(max_length, "classification: max_length", allow_none=False)
        self.name = name

    def __call__(self, model_dir: Path, ctx: ProbeContext) -> dict[str, float]:
        """Returns ``{"acc.<task>": percent}`` for every task of ``ctx.tasks``."""
        if not ctx.tasks:
            return {}
        dev = probe_device(ctx)
        tok = tokenizer_for(Path(model_dir), ctx)
        model = load_model(Path(model_dir), "encoder", dev)
        out: dict[str, float] = {}
        for spec in ctx.tasks:
            metric = f"acc.{spec.task}"
            if metric in out:
                raise ProbeError(f"task {spec.task!r} is registered twice")
            w, b = load_head(spec.head, spec.task)
            rows = read_labelled_jsonl(spec.data, spec.max_examples)
            bad = [y for _, _, y in rows if y >= w.shape[0]]
            if bad:
                raise ProbeError(f"task {spec.task!r}: label {bad[0]} in {spec.data} but the head has "
                                 f"{w.shape[0]} classes")
            out[metric] = task_accuracy(model, tok, rows, w, b, task=spec.task, pooling=spec.pooling,
                                        batch_size=self.batch_size, max_length=self.max_length, device=dev)
            log.debug("probe=%s task=%s examples=%d accuracy=%.3f", self.name, spec.task, len(rows), out[metric])
        return out
