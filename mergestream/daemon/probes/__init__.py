"""Probes: measurements of a staged candidate, run before it is published.

A probe is any callable ``probe(model_dir, ctx) -> dict[str, float]`` with a ``name``
(:class:`Probe`, :class:`ProbeContext` in :mod:`.base`). :func:`make_probe` builds one from a config
entry (``type`` + ``params``) and :func:`run_probes` runs a list of them and merges their metrics
into one dict; the gate then compares that dict with the current version's and θ₀'s.

Built-in probes, one module each (``type`` → class; the metrics are in each module's docstring):

``weight_space`` (:mod:`.weight_space`, data-free, always on), ``sentence_similarity``
(:mod:`.sentence_similarity`, an encoder's STS Spearman), ``perplexity`` (:mod:`.perplexity`, a
causal LM on a text file), ``classification`` (:mod:`.classification`, the task heads experts
shipped) and ``entrypoint`` (:mod:`.entry_point`, a user function ``package.module:function``).
Adding a probe is one module plus one line in :data:`PROBE_TYPES`.

Data probes load the candidate with :func:`mergestream.datasteps.text.load_model` (float32, eval mode, no
grad, local files only). Nothing model-specific is cached across candidates except tokenizers
(keyed by the content of their files) and θ₀'s singular vectors; within one :func:`run_probes`
call a model loaded by one probe is reused by the next one that needs the same class.

Probes raise :class:`ProbeError` for what they detect themselves (a checkpoint that cannot be opened
surfaces as the checkpoint error); :func:`run_probes` turns any exception into a :class:`ProbeError`
naming the probe, with the original as its cause.
"""

from __future__ import annotations

import inspect
import json
import logging
import time
from pathlib import Path
from typing import Any

from ...datasteps import text
from .base import Probe, ProbeContext, ProbeError, TaskProbeSpec, as_metrics, discover_task_probe
from .classification import ClassificationProbe
from .entry_point import EntryPointProbe
from .perplexity import PerplexityProbe
from .sentence_similarity import SentenceSimilarityProbe
from .weight_space import WeightSpaceProbe, clear_svd_cache

log = logging.getLogger(__name__)

__all__ = [
    "ClassificationProbe",
    "EntryPointProbe",
    "PerplexityProbe",
    "Probe",
    "ProbeContext",
    "ProbeError",
    "PROBE_TYPES",
    "SentenceSimilarityProbe",
    "TaskProbeSpec",
    "WeightSpaceProbe",
    "clear_caches",
    "discover_task_probe",
    "make_probe",
    "run_probes",
]

#: The registry: probe type (the config's ``type``) -> class.
PROBE_TYPES: dict[str, type] = {
    "weight_space": WeightSpaceProbe,
    "sentence_similarity": SentenceSimilarityProbe,
    "perplexity": PerplexityProbe,
    "classification": ClassificationProbe,
    "entrypoint": EntryPointProbe,
}


def make_probe(type: str, **params: Any) -> Probe:  # noqa: A002 - the config's key is "type"
    """Build a probe from a config entry.

    Args:
        type: one of :data:`PROBE_TYPES` (``weight_space``, ``sentence_similarity``,
            ``perplexity``, ``classification``, ``entrypoint``).
        **params: the probe class's keyword arguments (see each class); every probe accepts
            ``name``. For ``entrypoint``: ``target="package.module:function"`` and any extra
            params, which are passed to the function as keyword arguments.

    Returns:
        a :class:`Probe`.

    Raises:
        ProbeError: unknown type, unknown or missing parameter, bad value, missing data file, or an
            entry point that cannot be imported — all before any model is touched.
    """
    cls = PROBE_TYPES.get(type)
    if cls is None:
        raise ProbeError(f"unknown probe type {type!r}; known: {', '.join(sorted(PROBE_TYPES))}")
    try:
        inspect.signature(cls).bind(**params)
    except TypeError as exc:
        raise ProbeError(f"probe {type!r}: bad parameters {sorted(params)}: {exc}") from None
    return cls(**params)


def run_probes(probes: list[Probe], model_dir: Path, ctx: ProbeContext) -> dict[str, float]:
    """Run every probe on ``model_dir`` in order and merge their metrics.

    A model loaded by one data probe is reused by later probes of the same kind within this call
    and released at the end (:func:`mergestream.datasteps.text.model_scope`).

    Returns:
        metric name → float (no NaN).

    Raises:
        ProbeError: naming the probe, if a probe raises (the original exception is the cause),
            returns something other than a mapping of names to numbers, returns NaN, or reports a
            metric another probe already reported.
    """
    merged: dict[str, float] = {}
    owner: dict[str, str] = {}
    model_dir = Path(model_dir)
    with text.model_scope():
        for probe in probes:
            name = getattr(probe, "name", None) or type(probe).__name__
            t0 = time.perf_counter()
            try:
                result = probe(model_dir, ctx)
            except Exception as exc:
                raise ProbeError(f"probe {name!r} failed on {model_dir}: {type(exc).__name__}: {exc}") from exc
            metrics = as_metrics(result, name)
            for k, v in metrics.items():
                if k in merged:
                    raise ProbeError(f"probe {name!r} reports metric {k!r}, already reported by probe {owner[k]!r}")
                merged[k] = v
                owner[k] = name
            log.info("probe=%s model=%s seconds=%.3f metrics=%s", name, model_dir, time.perf_counter() - t0,
                     json.dumps(metrics, sort_keys=True))
    return merged


def clear_caches() -> None:
    """Drop every cached tokenizer and θ₀ singular-vector set (e.g. when θ₀ changes in place)."""
    clear_svd_cache()
    text.clear_caches()
