"""Probes: measurements of a staged candidate, run before it is published.

A probe is any callable ``probe(model_dir, ctx) -> dict[str, float]`` with a ``name``
(:class:`Probe`). :func:`make_probe` builds one from a config entry (``type`` + ``params``) and
:func:`run_probes` runs a list of them and merges their metrics into one dict; the gate then
compares that dict with the current version's and θ₀'s.

Built-in probes (``type`` → metrics):

``weight_space`` (data-free, always on; reads weights tensor by tensor with
:func:`~mergestream.checkpoints.open_checkpoint`, never a whole model)
    ``relative_drift``  ‖θ_cand − θ₀‖ / ‖θ₀‖ over every float tensor of θ₀ (dimensionless).
    ``step_drift``      ‖θ_cand − θ_prev‖ / ‖θ₀‖ (θ_prev = θ₀ before the first fold).
    ``general_subspace_energy``  fraction of the step's energy that lies in θ₀'s top-k singular
                        subspaces, the general-knowledge risk SAFE-Merge measures: with Δ = θ_cand −
                        θ_prev and, per 2-D tensor of θ₀, U₀ (m×k) / V₀ (n×k) its top-k left/right
                        singular vectors, Σ‖U₀U₀ᵀ Δ V₀V₀ᵀ‖² / Σ‖Δ‖² over the 2-D tensors, in [0, 1]
                        (0.0 when Δ = 0). U₀, V₀ are cached per base (see :func:`clear_caches`).
    ``max_task_cosine`` the largest |cos(cᵢ, cⱼ)|, i < j, between the fold contributions folded so
                        far (``ctx.contributions``, whole-model cosine), in [0, 1]; 0.0 with fewer
                        than two.

``sentence_similarity`` (an encoder's general-knowledge probe)
    ``sts_spearman`` (renamed by ``metric``): 100 × Spearman correlation between the cosine
    similarity of the two sentences' mean-pooled embeddings and the gold scores of a TSV file with
    header ``score<TAB>text<TAB>text2`` (read with :mod:`csv`, standard double-quote quoting), in
    [-100, 100].

``perplexity`` (a causal LM on a UTF-8 text file)
    ``perplexity`` (renamed by ``metric``): exp of the mean next-token negative log-likelihood
    (nats) over the file's tokens, sliding windows of ``max_length`` tokens moved by ``stride``;
    ≥ 1, ``inf`` on overflow.

``classification`` (an encoder plus the linear task heads experts shipped; ``ctx.tasks``)
    ``acc.<task>`` for every :class:`TaskProbeSpec`: accuracy in percent (0–100) of
    ``argmax(pool(h) @ Wᵀ + b)`` against the labels of the task's JSONL file.

``entrypoint``
    a user function ``package.module:function`` called as ``function(model_dir, ctx, **params)``
    (every param except ``target`` and ``name`` is passed through as a keyword argument); it must
    return a mapping of metric name to number.

Data probes load the candidate with transformers (``AutoModel`` / ``AutoModelForCausalLM``,
float32, eval mode, no grad, local files only). The tokenizer comes from the model folder if it has
tokenizer files, else from ``ctx.tokenizer``, else from ``ctx.base`` when that is a folder.
Nothing model-specific is cached across candidates except tokenizers (keyed by the content of
their files) and θ₀'s singular vectors; within one :func:`run_probes` call a model loaded by one
probe is reused by the next one that needs the same class.

Probes raise :class:`ProbeError` for what they detect themselves (a checkpoint that cannot be opened
surfaces as the checkpoint error); :func:`run_probes` turns any exception into a :class:`ProbeError`
naming the probe, with the original as its cause.
"""

from __future__ import annotations

import contextlib
import contextvars
import csv
import hashlib
import importlib
import inspect
import json
import logging
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ..checkpoints import Checkpoint, TensorMeta, is_float_dtype, open_checkpoint
from ..residuals import is_exception_key
from ..errors import MergestreamError

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
    "spearman",
]

#: Folder an expert may ship its task probe in, and the files inside it.
TASK_PROBE_DIR = "mergestream_probe"
TASK_PROBE_HEAD = "head.safetensors"
TASK_PROBE_DATA = "probe.jsonl"
TASK_PROBE_META = "task.json"

POOLINGS = ("mean", "cls")
_TASK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


class ProbeError(MergestreamError):
    """A probe cannot be built (unknown type, bad parameter, bad target, missing data file), its
    inputs are malformed (data file, task head, tokenizer missing), or it failed while running."""


# ------------------------------------------------------------------------------------------
# Interface
# ------------------------------------------------------------------------------------------
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
        contributions: residual files (mergestream.residuals), one per fold folded so far including the
            candidate's own (last); same tensor names as θ₀'s float tensors; may be empty.
        tasks: per-task probes registered by earlier experts (and the candidate's own).
        device: torch device for the probes' math and forward passes (``cpu``, ``cuda``, ``cuda:1``).
        tokenizer: where to load a tokenizer from when the model folder has none.
    """

    base: Path
    previous: Path | None
    contributions: list[Path]
    tasks: list[TaskProbeSpec]
    device: str = "cpu"
    tokenizer: Path | None = None


@runtime_checkable
class Probe(Protocol):
    """A measurement of a candidate model folder.

    ``name`` identifies the probe in logs and errors; calling it returns metric name → value
    (plain floats, never NaN).
    """

    name: str

    def __call__(self, model_dir: Path, ctx: ProbeContext) -> dict[str, float]: ...


# ------------------------------------------------------------------------------------------
# Small shared helpers
# ------------------------------------------------------------------------------------------
def _as_metrics(obj: Any, probe_name: str) -> dict[str, float]:
    """Validate a probe's result: a mapping of non-empty str → real number, no NaN."""
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


def _positive_int(value: Any, what: str, *, allow_none: bool = True) -> int | None:
    """``value`` as an int ≥ 1 (ints, integral floats and digit strings from a config)."""
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


def _data_file(value: Any, what: str) -> Path:
    if value is None or value == "":
        raise ProbeError(f"{what}: parameter 'data' (a file path) is required")
    p = Path(value).expanduser()
    if not p.is_file():
        raise ProbeError(f"{what}: data file {p} does not exist")
    return p


def _device(ctx: ProbeContext) -> torch.device:
    try:
        dev = torch.device(ctx.device)
    except (RuntimeError, TypeError) as exc:
        raise ProbeError(f"invalid device {ctx.device!r}: {exc}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ProbeError(f"device {ctx.device!r} requested but CUDA is not available")
    return dev


# ------------------------------------------------------------------------------------------
# Data-free: weight space
# ------------------------------------------------------------------------------------------
#: θ₀ top-k singular vectors: key (base file fingerprint, k, svd mode) -> {tensor: (U m×k, V n×k)}.
_SVD_CACHE: OrderedDict[tuple, dict[str, tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
_SVD_CACHE_BASES = 2
_SVD_LOCK = threading.Lock()
#: Exact SVD when m·n·min(m, n) stays under this (e.g. 4096×1024, 30522×384); randomized above.
_EXACT_SVD_FLOPS = 1 << 33


def _fingerprint(ck: Checkpoint) -> tuple:
    """Identity of a checkpoint's weight files: resolved path, size and mtime of each."""
    parts = []
    for f in ck.weight_files:
        st = f.stat()
        parts.append((str(f.resolve()), st.st_size, st.st_mtime_ns))
    return tuple(parts)


def _svd_entry(ck: Checkpoint, k: int, mode: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    key = (_fingerprint(ck), k, mode)
    with _SVD_LOCK:
        entry = _SVD_CACHE.get(key)
        if entry is None:
            entry = _SVD_CACHE[key] = {}
            while len(_SVD_CACHE) > _SVD_CACHE_BASES:
                _SVD_CACHE.popitem(last=False)
        else:
            _SVD_CACHE.move_to_end(key)
        return entry


def _randomized_svd(a: torch.Tensor, k: int, oversample: int | None = None, niter: int = 8,
                    seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k singular vectors of ``a`` (m×n) by randomized subspace iteration (Halko et al., 2011)
    with a fixed seed (no global RNG touched). Returns U (m×k), V (n×k), float32, on a's device.

    Pretrained weights have almost no gap after the k-th singular value (σ₁₆/σ₁₇ ≈ 1.002 in
    MiniLM), so the defaults are generous: oversampling max(2k, 10) and 8 power iterations keep a
    Δ built inside the exact top-16 subspace of MiniLM's word embeddings at energy ≥ 0.99.
    """
    m, n = a.shape
    q = min(k + (oversample if oversample is not None else max(2 * k, 10)), m, n)
    g = torch.Generator(device=a.device).manual_seed(seed)
    omega = torch.randn(n, q, generator=g, device=a.device, dtype=a.dtype)
    qm = torch.linalg.qr(a @ omega).Q
    for _ in range(niter):
        qm = torch.linalg.qr(a.T @ qm).Q
        qm = torch.linalg.qr(a @ qm).Q
    ub, _, vh = torch.linalg.svd(qm.T @ a, full_matrices=False)
    return (qm @ ub)[:, :k], vh[:k].T


def _top_singular(a: torch.Tensor, k: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """U₀ (m×k), V₀ (n×k) of a float32 2-D tensor; ``mode`` is auto, exact or lowrank."""
    m, n = a.shape
    k = min(k, m, n)
    exact = mode == "exact" or (mode == "auto" and m * n * min(m, n) <= _EXACT_SVD_FLOPS)
    if exact:
        u, _, vh = torch.linalg.svd(a, full_matrices=False)
        return u[:, :k].contiguous(), vh[:k].T.contiguous()
    u, v = _randomized_svd(a, k)
    return u.contiguous(), v.contiguous()


class _Rows:
    """Row-chunked reads of float tensors from safetensors checkpoints (bounded memory)."""

    def __init__(self, ck: Checkpoint):
        from safetensors import safe_open

        self._handles: dict[str, Any] = {}
        self._legacy = None
        if not all(f.suffix == ".safetensors" for f in ck.weight_files):
            self._legacy = ck
            return
        for f in ck.weight_files:
            h = safe_open(str(f), framework="pt", backend="pread")
            for name in h.keys():
                self._handles[name] = h

    def read(self, name: str, start: int, stop: int, whole: bool) -> torch.Tensor:
        if self._legacy is not None or whole:
            t = self._legacy.get(name) if self._legacy is not None else self._handles[name].get_tensor(name)
            return t if whole else t[start:stop]
        return self._handles[name].get_slice(name)[start:stop]


class WeightSpaceProbe:
    """Data-free probe: drift from θ₀, step size, general-subspace energy, task-vector interference.

    One streaming pass over θ₀'s float tensors reads θ₀, the candidate and the previous backbone
    one tensor at a time (float32 math, float64 sums across tensors); a second pass reads the
    contributions in row chunks for their Gram matrix. Metrics: ``relative_drift``,
    ``step_drift``, ``general_subspace_energy``, ``max_task_cosine`` (see the module docstring).

    Args:
        k: rank of θ₀'s "general" subspace per 2-D tensor (capped at min(m, n)).
        svd: ``auto`` (exact SVD for small tensors, randomized subspace iteration above ~8.6 GFLOP),
            ``exact`` or ``lowrank``.
        chunk_bytes: memory cap (bytes) of the stacked float64 contribution slices held at once
            (a larger single row is read alone).
        name: probe name (default ``weight_space``).

    Raises:
        ProbeError: bad parameters; at call time, a candidate/previous/contribution that lacks a
            float tensor of θ₀ or has another shape, or θ₀ with zero norm.
    """

    def __init__(self, k: int = 16, svd: str = "auto", chunk_bytes: int = 256 * 1024**2,
                 name: str = "weight_space"):
        self.k = _positive_int(k, "weight_space: k", allow_none=False)
        if svd not in ("auto", "exact", "lowrank"):
            raise ProbeError(f"weight_space: svd must be auto, exact or lowrank, got {svd!r}")
        self.svd = svd
        self.chunk_bytes = _positive_int(chunk_bytes, "weight_space: chunk_bytes", allow_none=False)
        self.name = name

    def __repr__(self) -> str:
        return f"WeightSpaceProbe(k={self.k}, svd={self.svd!r})"

    @staticmethod
    def _check(other: Checkpoint, meta: TensorMeta, what: str) -> None:
        if meta.name not in other:
            raise ProbeError(f"{what} {other.path} lacks θ₀'s tensor {meta.name!r}")
        got = other.meta(meta.name).shape
        if got != meta.shape:
            raise ProbeError(f"{what} {other.path}: tensor {meta.name!r} has shape {got}, θ₀ has {meta.shape}")

    def __call__(self, model_dir: Path, ctx: ProbeContext) -> dict[str, float]:
        """Measure ``model_dir`` against θ₀, the previous backbone and the contributions.

        Returns:
            ``relative_drift``, ``step_drift``, ``general_subspace_energy``, ``max_task_cosine``.
        """
        dev = _device(ctx)
        base = open_checkpoint(ctx.base)
        cand = open_checkpoint(model_dir)
        prev = open_checkpoint(ctx.previous) if ctx.previous is not None else None
        try:
            floats = [m for m in base.metas() if is_float_dtype(m.dtype)]
            for m in floats:
                self._check(cand, m, "candidate")
                if prev is not None:
                    self._check(prev, m, "previous backbone")
            svd_cache = _svd_entry(base, self.k, self.svd)
            base_sq = drift_sq = step_sq = step2d_sq = inside_sq = 0.0
            for m in floats:
                b = base.get(m.name).to(dev, torch.float32)
                c = cand.get(m.name).to(dev, torch.float32)
                p = prev.get(m.name).to(dev, torch.float32) if prev is not None else b
                step = c - p
                del p
                s2 = float(torch.linalg.vector_norm(step)) ** 2
                step_sq += s2
                if len(m.shape) == 2:
                    step2d_sq += s2
                    uv = svd_cache.get(m.name)
                    if uv is None:
                        u, v = _top_singular(b, self.k, self.svd)
                        uv = svd_cache[m.name] = (u.cpu(), v.cpu())
                    u, v = (x.to(dev) for x in uv)
                    if s2 > 0.0:
                        inside_sq += float(torch.linalg.vector_norm((u.T @ step) @ v)) ** 2
                del step
                base_sq += float(torch.linalg.vector_norm(b)) ** 2
                c = c - b  # not in place: a legacy checkpoint's get() returns its stored tensor
                drift_sq += float(torch.linalg.vector_norm(c)) ** 2
                del b, c
        finally:
            for ck in (base, cand, prev):
                if ck is not None:
                    ck.close()
        if base_sq == 0.0:
            raise ProbeError(f"θ₀ {ctx.base} has zero norm; relative drift is undefined")
        base_norm = math.sqrt(base_sq)
        energy = min(1.0, inside_sq / step2d_sq) if step2d_sq > 0.0 else 0.0
        out = {
            "relative_drift": math.sqrt(drift_sq) / base_norm,
            "step_drift": math.sqrt(step_sq) / base_norm,
            "general_subspace_energy": energy,
            "max_task_cosine": self.max_task_cosine(ctx.contributions, dev),
        }
        return out

    def max_task_cosine(self, contributions: list[Path], device: torch.device | str = "cpu") -> float:
        """Largest |cos(cᵢ, cⱼ)| over pairs i < j of whole-model contributions; 0.0 with < 2.

        A contribution with zero norm has cosine 0 with every other. Reads every contribution's
        tensors in row chunks so that at most ``chunk_bytes`` of slices are held at once.
        """
        n = len(contributions)
        if n < 2:
            return 0.0
        gram = self.contribution_gram(contributions, device)
        norms = np.sqrt(np.clip(np.diagonal(gram), 0.0, None))
        denom = np.outer(norms, norms)
        with np.errstate(divide="ignore", invalid="ignore"):
            cos = np.where(denom > 0, gram / np.where(denom > 0, denom, 1.0), 0.0)
        iu = np.triu_indices(n, 1)
        return float(min(1.0, np.abs(cos[iu]).max()))

    def contribution_gram(self, contributions: list[Path], device: torch.device | str = "cpu") -> np.ndarray:
        """Gram matrix G[i, j] = ⟨cᵢ, cⱼ⟩ (float64, N×N) of the contributions over their float tensors.

        Raises:
            ProbeError: the contributions do not hold the same float tensors with the same shapes.
        """
        dev = torch.device(device)
        cks = [open_checkpoint(p) for p in contributions]
        try:
            ref = cks[0]
            metas = [m for m in ref.metas() if is_float_dtype(m.dtype) and not is_exception_key(m.name)]
            names = {m.name for m in metas}
            for ck in cks[1:]:
                other = {m.name for m in ck.metas() if is_float_dtype(m.dtype) and not is_exception_key(m.name)}
                if other != names:
                    diff = sorted(names ^ other)[:3]
                    raise ProbeError(f"contributions {ref.path} and {ck.path} hold different tensors "
                                     f"(e.g. {diff})")
                for m in metas:
                    if ck.meta(m.name).shape != m.shape:
                        raise ProbeError(f"contribution {ck.path}: tensor {m.name!r} has shape "
                                         f"{ck.meta(m.name).shape}, {ref.path} has {m.shape}")
            readers = [_Rows(ck) for ck in cks]
            n = len(cks)
            gram = torch.zeros(n, n, dtype=torch.float64)
            for m in metas:
                rows = m.shape[0] if m.shape else 1
                row_elems = max(1, m.numel // max(rows, 1))
                # float64 slices (8 bytes per element): the Gram does not depend on the chunking
                whole = not m.shape or n * m.numel * 8 <= self.chunk_bytes
                step = rows if whole else max(1, self.chunk_bytes // (n * row_elems * 8))
                for start in range(0, rows, step):
                    stop = min(rows, start + step)
                    x = torch.empty(n, (stop - start) * row_elems, dtype=torch.float64, device=dev)
                    for i, r in enumerate(readers):
                        x[i].copy_(r.read(m.name, start, stop, whole).reshape(-1))
                    gram += (x @ x.T).cpu()
                    del x
            return gram.numpy()
        finally:
            for ck in cks:
                ck.close()


# ------------------------------------------------------------------------------------------
# Loading models and tokenizers (transformers imported lazily)
# ------------------------------------------------------------------------------------------
_TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.txt", "vocab.json",
                          "spiece.model", "sentencepiece.bpe.model")
_TOKENIZER_AUX_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                        "merges.txt", "config.json")
_TOKENIZER_CACHE: OrderedDict[str, Any] = OrderedDict()
_TOKENIZER_CACHE_SIZE = 4
_TOKENIZER_LOCK = threading.Lock()

#: Models loaded during one run_probes call, shared by its probes; None outside run_probes.
_MODEL_SCOPE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("mergestream_probe_models",
                                                                           default=None)


def _has_tokenizer(folder: Path | None) -> bool:
    return folder is not None and Path(folder).is_dir() and any(
        (Path(folder) / f).is_file() for f in _TOKENIZER_VOCAB_FILES)


def _tokenizer_source(model_dir: Path, ctx: ProbeContext) -> Path:
    for cand in (model_dir, ctx.tokenizer, ctx.base):
        if cand is not None and _has_tokenizer(Path(cand)):
            return Path(cand)
    raise ProbeError(
        f"no tokenizer found: the model folder {model_dir} has no tokenizer files "
        f"({', '.join(_TOKENIZER_VOCAB_FILES)}), ctx.tokenizer is "
        f"{'unset' if ctx.tokenizer is None else str(ctx.tokenizer) + ' (no tokenizer files)'} and "
        f"ctx.base {ctx.base} is {'a folder without tokenizer files' if Path(ctx.base).is_dir() else 'not a folder'}")


def _tokenizer_key(src: Path) -> str:
    h = hashlib.sha256()
    for name in sorted((*_TOKENIZER_VOCAB_FILES, *_TOKENIZER_AUX_FILES)):
        f = src / name
        if f.is_file():
            h.update(name.encode() + b"\0")
            h.update(f.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


def load_tokenizer(model_dir: Path, ctx: ProbeContext):
    """The tokenizer for ``model_dir`` (see the module docstring for where it comes from).

    Tokenizers are cached by the sha256 of their files, so every candidate that carries θ₀'s copied
    tokenizer reuses one instance. A tokenizer without a pad token gets its EOS token as pad.

    Raises:
        ProbeError: no tokenizer anywhere, or transformers cannot load it.
    """
    src = _tokenizer_source(Path(model_dir), ctx)
    key = _tokenizer_key(src)
    with _TOKENIZER_LOCK:
        tok = _TOKENIZER_CACHE.get(key)
        if tok is not None:
            _TOKENIZER_CACHE.move_to_end(key)
            return tok
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError...
        raise ProbeError(f"cannot load a tokenizer from {src}: {type(exc).__name__}: {exc}") from exc
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    log.debug("probe tokenizer loaded source=%s key=%s", src, key[:12])
    with _TOKENIZER_LOCK:
        _TOKENIZER_CACHE[key] = tok
        while len(_TOKENIZER_CACHE) > _TOKENIZER_CACHE_SIZE:
            _TOKENIZER_CACHE.popitem(last=False)
    return tok


def _dtype_kwarg() -> str:
    import transformers

    major, minor = (int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def load_model(model_dir: Path, kind: str, device: torch.device):
    """Load ``model_dir`` with transformers in float32, eval mode, on ``device``.

    Args:
        kind: ``encoder`` (``AutoModel``) or ``causal_lm`` (``AutoModelForCausalLM``).

    Within a :func:`run_probes` call the loaded model is shared by later probes of the same kind;
    outside one every call loads afresh.

    Raises:
        ProbeError: transformers cannot load the folder, or the checkpoint lacks weights of that
            class (other than an encoder's pooler), e.g. an encoder loaded as a causal LM.
    """
    from transformers import AutoModel, AutoModelForCausalLM

    cls = {"encoder": AutoModel, "causal_lm": AutoModelForCausalLM}[kind]
    scope = _MODEL_SCOPE.get()
    key = (str(Path(model_dir).resolve()), kind, str(device))
    if scope is not None and key in scope:
        return scope[key]
    t0 = time.perf_counter()
    try:
        with _quiet_progress():
            model, info = cls.from_pretrained(str(model_dir), local_files_only=True, output_loading_info=True,
                                              **{_dtype_kwarg(): torch.float32})
        model = model.to(device).eval()
    except Exception as exc:
        raise ProbeError(f"cannot load {model_dir} with transformers {cls.__name__}: "
                         f"{type(exc).__name__}: {exc}") from exc
    # A head the checkpoint lacks would be randomly initialised: measuring it means nothing.
    missing = sorted(k for k in info.get("missing_keys", ()) if not (kind == "encoder" and "pooler" in k))
    mismatched = sorted(str(k) for k in info.get("mismatched_keys", ()))
    if missing or mismatched:
        raise ProbeError(f"{model_dir} does not hold a complete {type(model).__name__}: "
                         f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, mismatched {mismatched[:5]}")
    log.info("probe model loaded path=%s kind=%s seconds=%.2f", model_dir, kind, time.perf_counter() - t0)
    if scope is not None:
        scope.clear()  # keep at most one model resident
        scope[key] = model
    return model


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """Silence transformers' tqdm bar while loading (it would interleave with structured logs)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if was_enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _model_scope() -> Iterator[None]:
    token = _MODEL_SCOPE.set({})
    try:
        yield
    finally:
        scope = _MODEL_SCOPE.get()
        if scope:
            scope.clear()
        _MODEL_SCOPE.reset(token)


def clear_caches() -> None:
    """Drop every cached tokenizer and θ₀ singular-vector set (e.g. when θ₀ changes in place)."""
    with _SVD_LOCK:
        _SVD_CACHE.clear()
    with _TOKENIZER_LOCK:
        _TOKENIZER_CACHE.clear()


def _max_positions(model, tok, requested: int) -> int:
    limits = [requested]
    for attr in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        v = getattr(model.config, attr, None)
        if isinstance(v, int) and v > 0:
            limits.append(v)
            break
    mml = getattr(tok, "model_max_length", None)
    if isinstance(mml, int) and 0 < mml < 10**7:
        limits.append(mml)
    return min(limits)


def _pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """(B, T, H) last hidden state + (B, T) attention mask -> (B, H) float32."""
    if pooling == "cls":
        return hidden[:, 0].float()
    m = mask.to(hidden.dtype).unsqueeze(-1)
    return ((hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)).float()


@torch.inference_mode()
def embed(model, tok, texts: list[str], texts2: list[str | None] | None = None, *, pooling: str = "mean",
          batch_size: int = 32, max_length: int = 128, device: torch.device | str = "cpu") -> torch.Tensor:
    """Pooled last hidden states of ``texts`` (or of pairs ``(texts[i], texts2[i])``).

    Inputs are batched in order of length (less padding) and put back in input order.

    Returns:
        float32 CPU tensor (N × hidden).

    Raises:
        ProbeError: the model produced NaN/Inf.
    """
    n = len(texts)
    if texts2 is None:
        texts2 = [None] * n
    max_length = _max_positions(model, tok, max_length)
    order = sorted(range(n), key=lambda i: (texts2[i] is not None, len(texts[i]) + len(texts2[i] or "")))
    out: torch.Tensor | None = None
    i = 0
    while i < n:
        batch = order[i:i + batch_size]
        paired = texts2[batch[0]] is not None
        batch = [j for j in batch if (texts2[j] is not None) == paired]
        a = [texts[j] for j in batch]
        enc = (tok(a, [texts2[j] for j in batch], padding=True, truncation=True, max_length=max_length,
                   return_tensors="pt") if paired else
               tok(a, padding=True, truncation=True, max_length=max_length, return_tensors="pt"))
        enc = {k: v.to(device) for k, v in enc.items()}
        hidden = model(**enc).last_hidden_state
        pooled = _pool(hidden, enc["attention_mask"], pooling).cpu()
        if out is None:
            out = torch.empty(n, pooled.shape[1], dtype=torch.float32)
        out[batch] = pooled
        i += len(batch)
    assert out is not None
    if not torch.isfinite(out).all():
        raise ProbeError("the model produced non-finite (NaN/Inf) hidden states")
    return out


# ------------------------------------------------------------------------------------------
# Rank correlation
# ------------------------------------------------------------------------------------------
def _rankdata(x: np.ndarray) -> np.ndarray:
    """1-based ranks with ties given their average rank (scipy's ``rankdata(method='average')``)."""
    n = x.shape[0]
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    bounds = np.flatnonzero(xs[1:] != xs[:-1]) + 1
    starts = np.concatenate(([0], bounds))
    ends = np.concatenate((bounds, [n]))
    ranks = np.empty(n, dtype=np.float64)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return ranks


def spearman(x, y) -> float:
    """Spearman rank correlation of two equally long 1-D sequences (average ranks for ties).

    Returns:
        a float in [-1, 1]; NaN when either side is constant (undefined correlation).

    Raises:
        ValueError: different lengths or fewer than two values.
    """
    a = np.asarray(x, dtype=np.float64).reshape(-1)
    b = np.asarray(y, dtype=np.float64).reshape(-1)
    if a.shape != b.shape or a.size < 2:
        raise ValueError(f"spearman needs two sequences of equal length >= 2, got {a.size} and {b.size}")
    ra = _rankdata(a)
    rb = _rankdata(b)
    ra -= ra.mean()
    rb -= rb.mean()
    denom = math.sqrt(float(ra @ ra) * float(rb @ rb))
    if denom == 0.0:
        return float("nan")
    return max(-1.0, min(1.0, float(ra @ rb) / denom))


# ------------------------------------------------------------------------------------------
# Data probes
# ------------------------------------------------------------------------------------------
def read_scored_pairs(path: Path, max_pairs: int | None = None) -> list[tuple[float, str, str]]:
    """Read a TSV of scored sentence pairs (header ``score<TAB>text<TAB>text2``, :mod:`csv` quoting).

    Returns:
        ``(score, text, text2)`` tuples, at most ``max_pairs``.

    Raises:
        ProbeError: missing columns, a non-numeric or non-finite score, a missing sentence.
    """
    rows: list[tuple[float, str, str]] = []
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh, delimiter="\t")
        cols = reader.fieldnames or []
        missing = [c for c in ("score", "text", "text2") if c not in cols]
        if missing:
            raise ProbeError(f"{path}: header must have columns score, text, text2; missing {missing}")
        for row in reader:
            if max_pairs is not None and len(rows) >= max_pairs:
                break
            line = reader.line_num
            try:
                score = float(row["score"])
            except (TypeError, ValueError):
                raise ProbeError(f"{path}:{line}: score {row['score']!r} is not a number") from None
            if not math.isfinite(score):
                raise ProbeError(f"{path}:{line}: score {row['score']!r} is not finite")
            a, b = row["text"], row["text2"]
            if not a or not b:
                raise ProbeError(f"{path}:{line}: empty or missing text/text2")
            rows.append((score, a, b))
    return rows


def read_labelled_jsonl(path: Path, max_examples: int | None = None) -> list[tuple[str, str | None, int]]:
    """Read a JSONL probe set: ``{"text": str, ["text2": str,] "label": int}`` per non-blank line.

    Returns:
        ``(text, text2 or None, label)`` tuples, at most ``max_examples``.

    Raises:
        ProbeError: a line that is not such an object (names the file and line), or no examples.
    """
    out: list[tuple[str, str | None, int]] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if max_examples is not None and len(out) >= max_examples:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise ProbeError(f"{path}:{lineno}: not JSON ({exc})") from None
            if not isinstance(obj, dict):
                raise ProbeError(f"{path}:{lineno}: expected an object, got {type(obj).__name__}")
            text, text2, label = obj.get("text"), obj.get("text2"), obj.get("label")
            if not isinstance(text, str) or not text:
                raise ProbeError(f"{path}:{lineno}: 'text' must be a non-empty string")
            if text2 is not None and (not isinstance(text2, str) or not text2):
                raise ProbeError(f"{path}:{lineno}: 'text2' must be a non-empty string when present")
            if isinstance(label, bool) or not isinstance(label, int) or label < 0:
                raise ProbeError(f"{path}:{lineno}: 'label' must be a non-negative int, got {label!r}")
            out.append((text, text2, label))
    if not out:
        raise ProbeError(f"{path}: no examples")
    return out


def load_head(path: Path, task: str = "?") -> tuple[torch.Tensor, torch.Tensor]:
    """Load a linear head: ``weight`` (classes × hidden) and ``bias`` (classes,), as float32.

    Raises:
        ProbeError: unreadable file, missing tensors, wrong ranks/shapes, non-float or non-finite values.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        t = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ProbeError(f"task {task!r}: cannot read head {path}: {exc}") from exc
    missing = [k for k in ("weight", "bias") if k not in t]
    if missing:
        raise ProbeError(f"task {task!r}: head {path} lacks tensor(s) {missing}")
    w, b = t["weight"], t["bias"]
    if not w.is_floating_point() or not b.is_floating_point():
        raise ProbeError(f"task {task!r}: head {path} tensors must be floating point, got {w.dtype}, {b.dtype}")
    if w.dim() != 2 or b.dim() != 1 or b.shape[0] != w.shape[0] or w.shape[0] < 1:
        raise ProbeError(f"task {task!r}: head {path} needs weight (classes × hidden) and bias (classes,), "
                         f"got {tuple(w.shape)} and {tuple(b.shape)}")
    w, b = w.float(), b.float()
    if not (torch.isfinite(w).all() and torch.isfinite(b).all()):
        raise ProbeError(f"task {task!r}: head {path} holds NaN/Inf")
    return w, b


def sts_spearman_of(model, tok, rows: list[tuple[float, str, str]], *, batch_size: int = 32, max_length: int = 128,
                    device: torch.device | str = "cpu") -> float:
    """100 × Spearman(cosine of the mean-pooled embeddings of each pair, gold score) of a loaded
    encoder; NaN when the correlation is undefined (constant cosines). Each distinct sentence is
    embedded once."""
    index: dict[str, int] = {}
    for _, a, b in rows:
        index.setdefault(a, len(index))
        index.setdefault(b, len(index))
    emb = embed(model, tok, list(index), pooling="mean", batch_size=batch_size, max_length=max_length, device=device)
    emb = torch.nn.functional.normalize(emb.double(), dim=1)
    ia = torch.tensor([index[a] for _, a, _ in rows])
    ib = torch.tensor([index[b] for _, _, b in rows])
    return 100.0 * spearman((emb[ia] * emb[ib]).sum(1).numpy(), [s for s, _, _ in rows])


def head_accuracy_of(model, tok, rows: list[tuple[str, str | None, int]], w: torch.Tensor, b: torch.Tensor, *,
                     task: str = "?", pooling: str = "mean", batch_size: int = 32, max_length: int = 128,
                     device: torch.device | str = "cpu") -> float:
    """Accuracy (%) of a linear head (``w`` classes × hidden, ``b`` classes) on the pooled
    embeddings of labelled rows ``(text, text2 | None, label)`` of a loaded encoder.

    Raises:
        ProbeError: the head's hidden size differs from the model's.
    """
    texts2 = [t2 for _, t2, _ in rows]
    emb = embed(model, tok, [t for t, _, _ in rows], texts2 if any(texts2) else None, pooling=pooling,
                batch_size=batch_size, max_length=max_length, device=device)
    if emb.shape[1] != w.shape[1]:
        raise ProbeError(f"task {task!r}: head expects hidden size {w.shape[1]}, the model gives {emb.shape[1]}")
    pred = (emb @ w.T + b).argmax(1)
    return 100.0 * float((pred == torch.tensor([y for _, _, y in rows])).double().mean())


class SentenceSimilarityProbe:
    """General-knowledge probe of an encoder: STS-style Spearman correlation.

    Embeds both sentences of each pair (attention-masked mean of the last hidden state), takes the
    cosine similarity, and reports 100 × Spearman(cosines, gold scores) under ``metric``. A
    correlation that is undefined (all cosines equal, e.g. a collapsed model) is reported as 0.0.

    Args:
        data: TSV file with header ``score<TAB>text<TAB>text2``.
        metric: metric name (default ``sts_spearman``).
        max_pairs: use the first N pairs (default all).
        batch_size: sentences per forward pass.
        max_length: truncation length in tokens (capped by the model's positions).
        name: probe name (default ``sentence_similarity``).

    Raises:
        ProbeError: missing data file or bad parameters; at call time a malformed file, fewer than
            two pairs, no tokenizer, an unloadable model or non-finite embeddings.
    """

    def __init__(self, data: str | Path | None = None, metric: str = "sts_spearman", max_pairs: int | None = None,
                 batch_size: int = 32, max_length: int = 128, name: str = "sentence_similarity"):
        self.data = _data_file(data, "sentence_similarity")
        self.metric = metric
        self.max_pairs = _positive_int(max_pairs, "sentence_similarity: max_pairs")
        self.batch_size = _positive_int(batch_size, "sentence_similarity: batch_size", allow_none=False)
        self.max_length = _positive_int(max_length, "sentence_similarity: max_length", allow_none=False)
        self.name = name

    def __call__(self, model_dir: Path, ctx: ProbeContext) -> dict[str, float]:
        """Returns ``{metric: 100 × Spearman}`` in [-100, 100]."""
        rows = read_scored_pairs(self.data, self.max_pairs)
        if len(rows) < 2:
            raise ProbeError(f"{self.data}: need at least two scored pairs, got {len(rows)}")
        dev = _device(ctx)
        tok = load_tokenizer(Path(model_dir), ctx)
        model = load_model(Path(model_dir), "encoder", dev)
        rho = sts_spearman_of(model, tok, rows, batch_size=self.batch_size, max_length=self.max_length, device=dev)
        if math.isnan(rho):
            log.warning("probe=%s metric=%s undefined correlation (constant cosines); reporting 0.0",
                        self.name, self.metric)
            rho = 0.0
        return {self.metric: rho}


class PerplexityProbe:
    """Causal-LM perplexity on a UTF-8 text file.

    The whole file is tokenized once (special tokens as the tokenizer adds them) and cut to
    ``max_tokens``; windows of ``max_length`` tokens start every ``stride`` tokens and each token is
    scored once, in the first window that reaches it, conditioned on the rest of that window (the
    first token of the file is never scored). Perplexity = exp(Σ NLL / scored tokens).

    Args:
        data: text file (UTF-8).
        metric: metric name (default ``perplexity``).
        max_length: window length in tokens (default: min(1024, the model's positions)).
        stride: window step in tokens, ≤ max_length (default: max_length, no overlap).
        max_tokens: score only the first N tokens of the file (default all).
        name: probe name (default ``perplexity``).

    Raises:
        ProbeError: missing data file or bad parameters; at call time fewer than two tokens, no
            tokenizer, a model that is not a causal LM, or non-finite logits.
    """

    def __init__(self, data: str | Path | None = None, metric: str = "perplexity", max_length: int | None = None,
                 stride: int | None = None, max_tokens: int | None = None, name: str = "perplexity"):
        self.data = _data_file(data, "perplexity")
        self.metric = metric
        self.max_length = _positive_int(max_length, "perplexity: max_length")
        self.stride = _positive_int(stride, "perplexity: stride")
        self.max_tokens = _positive_int(max_tokens, "perplexity: max_tokens")
        if self.stride is not None and self.max_length is not None and self.stride > self.max_length:
            raise ProbeError(f"perplexity: stride {self.stride} > max_length {self.max_length} would skip tokens")
        self.name = name

    @torch.inference_mode()
    def __call__(self, model_dir: Path, ctx: ProbeContext) -> dict[str, float]:
        """Returns ``{metric: perplexity}`` (≥ 1; ``inf`` if exp overflows)."""
        text = self.data.read_text(encoding="utf-8")
        dev = _device(ctx)
        tok = load_tokenizer(Path(model_dir), ctx)
        ids = tok(text, return_attention_mask=False, verbose=False)["input_ids"]
        if self.max_tokens is not None:
            ids = ids[: self.max_tokens]
        n = len(ids)
        if n < 2:
            raise ProbeError(f"{self.data}: {n} token(s); perplexity needs at least two")
        model = load_model(Path(model_dir), "causal_lm", dev)
        length = _max_positions(model, tok, self.max_length or 1024)
        if length < 2:
            raise ProbeError(f"perplexity: max_length {length} < 2")
        stride = min(self.stride or length, length)
        ids_t = torch.tensor(ids, dtype=torch.long)
        nll, count, prev_end = 0.0, 0, 0
        for begin in range(0, n, stride):
            end = min(begin + length, n)
            first = max(prev_end, begin + 1)  # absolute index of the first token scored here
            if first < end:
                window = ids_t[begin:end].to(dev)
                logits = model(input_ids=window[None]).logits[0]
                pred = logits[first - begin - 1:end - begin - 1].float()
                if not torch.isfinite(pred).all():
                    raise ProbeError("the model produced non-finite (NaN/Inf) logits")
                nll += float(torch.nn.functional.cross_entropy(pred, window[first - begin:], reduction="sum"))
                count += end - first
            prev_end = end
            if end == n:
                break
        mean = nll / count
        log.debug("probe=%s tokens=%d mean_nll=%.6f", self.name, count, mean)
        try:
            ppl = math.exp(mean)
        except OverflowError:
            ppl = math.inf
        return {self.metric: ppl}


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
        self.batch_size = _positive_int(batch_size, "classification: batch_size", allow_none=False)
        self.max_length = _positive_int(max_length, "classification: max_length", allow_none=False)
        self.name = name

    def __call__(self, model_dir: Path, ctx: ProbeContext) -> dict[str, float]:
        """Returns ``{"acc.<task>": percent}`` for every task of ``ctx.tasks``."""
        if not ctx.tasks:
            return {}
        dev = _device(ctx)
        tok = load_tokenizer(Path(model_dir), ctx)
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
            out[metric] = head_accuracy_of(model, tok, rows, w, b, task=spec.task, pooling=spec.pooling,
                                           batch_size=self.batch_size, max_length=self.max_length, device=dev)
            log.debug("probe=%s task=%s examples=%d accuracy=%.3f", self.name, spec.task, len(rows), out[metric])
        return out


# ------------------------------------------------------------------------------------------
# User entry points
# ------------------------------------------------------------------------------------------
def _resolve_target(target: Any) -> Callable[..., Any]:
    if not isinstance(target, str) or target.count(":") != 1:
        raise ProbeError(f"entrypoint: target must be 'package.module:function', got {target!r}")
    mod_name, attr = target.split(":")
    if not mod_name or not attr:
        raise ProbeError(f"entrypoint: target must be 'package.module:function', got {target!r}")
    try:
        obj: Any = importlib.import_module(mod_name)
    except Exception as exc:
        raise ProbeError(f"entrypoint {target!r}: cannot import {mod_name!r}: {type(exc).__name__}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ProbeError(f"entrypoint {target!r}: {mod_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ProbeError(f"entrypoint {target!r}: {attr!r} is not callable")
    return obj


class EntryPointProbe:
    """A user probe: ``package.module:function`` (or ``module:obj.attr``) imported at construction.

    Called as ``function(model_dir: Path, ctx: ProbeContext, **params)`` where ``params`` are every
    keyword given to :func:`make_probe` except ``target`` and ``name``; it must return a mapping of
    metric name (str) to number, which is checked (no NaN) and converted to floats.

    Args:
        target: ``"package.module:function"``; the module must be importable (on ``sys.path``).
        name: probe name (default: the target string).
        **params: passed through to the function as keyword arguments.

    Raises:
        ProbeError: malformed target, import failure, missing or non-callable attribute; at call
            time a result that is not a mapping of names to numbers.
    """

    def __init__(self, target: str | None = None, name: str | None = None, **params: Any):
        self.target = target
        self.func = _resolve_target(target)
        self.params = params
        self.name = name or str(target)

    def __call__(self, model_dir: Path, ctx: ProbeContext) -> dict[str, float]:
        """Call the user function and validate its result."""
        return _as_metrics(self.func(Path(model_dir), ctx, **self.params), self.name)


# ------------------------------------------------------------------------------------------
# Registry, runner, discovery
# ------------------------------------------------------------------------------------------
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
    and released at the end.

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
    with _model_scope():
        for probe in probes:
            name = getattr(probe, "name", None) or type(probe).__name__
            t0 = time.perf_counter()
            try:
                result = probe(model_dir, ctx)
            except Exception as exc:
                raise ProbeError(f"probe {name!r} failed on {model_dir}: {type(exc).__name__}: {exc}") from exc
            metrics = _as_metrics(result, name)
            for k, v in metrics.items():
                if k in merged:
                    raise ProbeError(f"probe {name!r} reports metric {k!r}, already reported by probe {owner[k]!r}")
                merged[k] = v
                owner[k] = name
            log.info("probe=%s model=%s seconds=%.3f metrics=%s", name, model_dir, time.perf_counter() - t0,
                     json.dumps(metrics, sort_keys=True))
    return merged


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
    try:
        meta = json.loads((folder / TASK_PROBE_META).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProbeError(f"{folder / TASK_PROBE_META}: not JSON ({exc})") from None
    if not isinstance(meta, dict) or "task" not in meta:
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
