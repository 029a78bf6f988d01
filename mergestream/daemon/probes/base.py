"""The probe interface and what every probe family shares.

A probe is any callable ``probe(model_dir, ctx) -> dict[str, float]`` with a ``name``
(:class:`Probe`); :class:`ProbeContext` is what it may know besides the candidate. This module also
holds the per-task probe an expert ships (:class:`TaskProbeSpec`, :func:`discover_task_probe`) and
the small validators the probe families use for their parameters.

Data probes find the tokenizer with :func:`tokenizer_for`: the model folder if it has tokenizer
files, else ``ctx.tokenizer``, else ``ctx.base`` when that is a folder.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from ...errors import ProbeError
from ...io.st import load_json
from ...datasteps.text import (
    POOLINGS,
    TOKENIZER_VOCAB_FILES,
    has_tokenizer,
    load_head,
    load_tokenizer,
    read_labelled_jsonl,
)

log = logging.getLogger(__name__)

__all__ = ["POOLINGS", "Probe", "ProbeContext", "ProbeError", "TaskProbeSpec", "as_metrics", "data_file",
           "discover_task_probe", "positive_int", "probe_device", "tokenizer_for"]

#: Folder an expert may ship its task probe in, and the files inside it.
TASK_PROBE_DIR = "mergestream_probe"
TASK_PROBE_HEAD = "head.safetensors"
TASK_PROBE_DATA = "probe.jsonl"
TASK_PROBE_META = "task.json"

_TASK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


@dataclass(frozen=True)
class TaskProbeSpec:
    """A per-task probe registered by an expert: a linear head and a labelled probe set.

    Attributes:
        task: task name, used in the metric name ``acc.<task>``; letters, digits, ``_.-``.
        head: safetensors file holding ``weight`` (classes × hidden, float) and ``bias``
            (classes,) of a linear head applied to the pooled last hidden state.
        data: JSONL file, one object per line: ``{"text": str, ["text2": str,] "label": int}``
            (``text2`` makes it a sentence pair, encoded as ``tokenizer(text, text2)``).
        pooling: ``"mean"`` (attention-masked mean of the last hidden state) or ``"cls"``
            (the first token's last hidden state).
        max_examples: use only the first N examples of ``data`` (None: all).

    Raises:
        ProbeError: bad task name, pooling or ``max_examples``.
    """

    task: str
    head: Path
    data: Path
    pooling: str = "mean"
    max_examples: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.task, str) or not _TASK_NAME.match(self.task):
            raise ProbeError(f"task probe: task name {self.task!r} must match {_TASK_NAME.pattern}")
        if self.pooling not in POOLINGS:
            raise ProbeError(f"task probe {self.task!r}: pooling {self.pooling!r} is not one of {POOLINGS}")
        if self.max_examples is not None and (isinstance(self.max_examples, bool)
                                              or not isinstance(self.max_examples, int)
                                              or self.max_examples < 1):
            raise ProbeError(f"task probe {self.task!r}: max_examples must be a positive int, "
                             f"got {self.max_examples!r}")
        object.__setattr__(self, "head", Path(self.head))
        object.__setattr__(self, "data", Path(self.data))


@dataclass
class ProbeContext:
    """What probes may know besides the candidate.

    Attributes:
        base: θ₀, a ``.safetensors`` file or a Hugging Face folder.
        previous: the current published backbone's model folder; None before the first fold.
        contributions: residual files (mergestream.engine.residuals), one per fold folded so far including the
            candidate's own (last); may be empty. Open one with
            :func:`mergestream.engine.residuals.open_contribution` (path, θ₀): a Task Arithmetic fold's
            file stores no residual tensor, its Δ is recomputed from the expert it records.
        tasks: per-task probes registered by earlier experts (and the candidate's own).
        device: torch device for the probes' math and forward passes (``cpu``, ``cuda``, ``cuda:1``).
        tokenizer: where to load a tokenizer from when the model folder has none.
        cache_dir: a folder where probes may keep what they derive from θ₀ alone between processes
            (the daemon: ``state_dir/cache/probes``); None: nothing is kept.
    """

    base: Path
    previous: Path | None
    contributions: list[Path]
    tasks: list[TaskProbeSpec]
    device: str = "cpu"
    tokenizer: Path | None = None
    cache_dir: Path | None = None


@runtime_checkable
class Probe(Protocol):
    """A measurement of a candidate model folder.

    ``name`` identifies the probe in logs and errors; calling it returns metric name → value
    (plain floats, never NaN).
    """

    name: str

    def __call__(self, model_dir: Path, ctx: ProbeContext) -> dict[str, float]: ...


# ------------------------------------------------------------------------------------------
# Validators shared by the probe families
# ------------------------------------------------------------------------------------------
def as_metrics(obj: Any, probe_name: str) -> dict[str, float]:
    """Validate a probe's result: a mapping of non-empty str → real number, no NaN.

    Returns:
        the same metrics as plain floats (``inf`` allowed).

    Raises:
        ProbeError: not a mapping, an empty or non-str name, a value that is not a number, NaN.
    """
    if not isinstance(obj, Mapping):
        raise ProbeError(f"probe {probe_name!r} returned {type(obj).__name__}, expected a mapping "
                         "of metric name to number")
    out: dict[str, float] = {}
    for k, v in obj.items():
        if not isinstance(k, str) or not k:
            raise ProbeError(f"probe {probe_name!r} returned a metric name {k!r}; names must be non-empty strings")
        if isinstance(v, (bool, str, bytes)):
            raise ProbeError(f"probe {probe_name!r}: metric {k!r} is {v!r}, not a number")
        try:
            f = float(v)
        except (TypeError, ValueError) as exc:
            raise ProbeError(f"probe {probe_name!r}: metric {k!r} is {v!r}, not a number") from exc
        if math.isnan(f):
            raise ProbeError(f"probe {probe_name!r}: metric {k!r} is NaN")
        out[k] = f
    return out


def positive_int(value: Any, what: str, *, allow_none: bool = True) -> int | None:
    """``value`` as an int ≥ 1 (ints, integral floats and digit strings from a config); None
    passes when ``allow_none``.

    Raises:
        ProbeError: anything else, naming ``what``.
    """
    if value is None and allow_none:
        return None
    i: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        i = value
    elif isinstance(value, float) and value.is_integer():
        i = int(value)
    elif isinstance(value, str) and value.strip().isdigit():
        i = int(value)
    if i is None or i < 1:
        raise ProbeError(f"{what} must be a positive integer, got {value!r}")
    return i


def data_file(value: Any, what: str) -> Path:
    """The probe's ``data`` parameter as an existing file path (``~`` expanded).

    Raises:
        ProbeError: missing parameter or no such file.
    """
    if value is None or value == "":
        raise ProbeError(f"{what}: parameter 'data' (a file path) is required")
    p = Path(value).expanduser()
    if not p.is_file():
        raise ProbeError(f"{what}: data file {p} does not exist")
    return p


def probe_device(ctx: ProbeContext) -> torch.device:
    """``ctx.device`` as a torch device.

    Raises:
        ProbeError: an invalid device string, or CUDA requested where it is not available.
    """
    try:
        dev = torch.device(ctx.device)
    except (RuntimeError, TypeError) as exc:
        raise ProbeError(f"invalid device {ctx.device!r}: {exc}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ProbeError(f"device {ctx.device!r} requested but CUDA is not available")
    return dev


def tokenizer_for(model_dir: Path, ctx: ProbeContext):
    """The tokenizer for ``model_dir``: from the model folder, else ``ctx.tokenizer``, else
    ``ctx.base`` (the first that has tokenizer files), via :func:`mergestream.datasteps.text.load_tokenizer`.

    Raises:
        ProbeError: no tokenizer anywhere, or transformers cannot load it.
    """
    for cand in (model_dir, ctx.tokenizer, ctx.base):
        if cand is not None and has_tokenizer(Path(cand)):
            return load_tokenizer(Path(cand))
    raise ProbeError(
        f"no tokenizer found: the model folder {model_dir} has no tokenizer files "
        f"({', '.join(TOKENIZER_VOCAB_FILES)}), ctx.tokenizer is "
        f"{'unset' if ctx.tokenizer is None else str(ctx.tokenizer) + ' (no tokenizer files)'} and "
        f"ctx.base {ctx.base} is {'a folder without tokenizer files' if Path(ctx.base).is_dir() else 'not a folder'}")


# ------------------------------------------------------------------------------------------
# Task probes shipped by experts
# ------------------------------------------------------------------------------------------
def discover_task_probe(expert_dir: Path) -> TaskProbeSpec | None:
    """The task probe an expert ships in ``<expert_dir>/mergestream_probe/``, if any.

    The folder must hold ``task.json`` (``{"task": name, "pooling": "mean" | "cls",
    ["max_examples": N]}``), ``head.safetensors`` (``weight`` classes × hidden, ``bias``
    classes) and ``probe.jsonl`` (see :class:`TaskProbeSpec`); every line and label is checked
    against the head now, so a bad probe is refused when the expert arrives. The returned paths
    point inside ``expert_dir``: copy the folder somewhere durable if the expert may be removed.

    Returns:
        the spec, or None when the expert is a file or has no ``mergestream_probe/`` folder.

    Raises:
        ProbeError: the folder exists but a file is missing or malformed.
    """
    folder = Path(expert_dir) / TASK_PROBE_DIR
    if not Path(expert_dir).is_dir() or not folder.exists():
        return None
    if not folder.is_dir():
        raise ProbeError(f"{folder} is not a folder")
    missing = [f for f in (TASK_PROBE_META, TASK_PROBE_HEAD, TASK_PROBE_DATA) if not (folder / f).is_file()]
    if missing:
        raise ProbeError(f"{folder}: missing {', '.join(missing)}")
    meta = load_json((folder / TASK_PROBE_META).read_bytes(), str(folder / TASK_PROBE_META), error=ProbeError)
    if "task" not in meta:
        raise ProbeError(f"{folder / TASK_PROBE_META}: expected an object with a 'task' name")
    unknown = sorted(set(meta) - {"task", "pooling", "max_examples"})
    if unknown:
        raise ProbeError(f"{folder / TASK_PROBE_META}: unknown key(s) {unknown}")
    spec = TaskProbeSpec(task=meta["task"], head=folder / TASK_PROBE_HEAD, data=folder / TASK_PROBE_DATA,
                         pooling=meta.get("pooling", "mean"), max_examples=meta.get("max_examples"))
    w, _ = load_head(spec.head, spec.task)
    rows = read_labelled_jsonl(spec.data)
    bad = [y for _, _, y in rows if y >= w.shape[0]]
    if bad:
        raise ProbeError(f"{spec.data}: label {bad[0]} but the head has {w.shape[0]} classes")
    log.info("task probe found expert=%s task=%s examples=%d classes=%d", expert_dir, spec.task, len(rows), w.shape[0])
    return spec
