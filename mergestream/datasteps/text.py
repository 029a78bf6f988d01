"""Text-encoder toolkit: load, pool, embed, STS Spearman, linear-head accuracy, probe data files.

Shared by the daemon's data probes (:mod:`mergestream.daemon.probes`), its CMA-ES objective, the
RI pre-step (:mod:`mergestream.datasteps.ri`) and the experts toolkit (:mod:`mergestream.experts`), so that
what the probes measure is what RI adapts and what the benchmarks report. Nothing here imports the
daemon; every function that loads or runs a model takes the torch device it runs on.

* Loading (transformers imported lazily): :func:`load_tokenizer` (cached by the sha256 of the
  tokenizer files) and :func:`load_model` (float32, eval mode, refuses checkpoints that lack
  weights of the requested class); inside :func:`model_scope` a loaded model is reused by the next
  load of the same folder, kind and device.
* Embeddings: :func:`pool` (attention-masked mean or CLS of the last hidden state),
  :func:`encode`, :func:`embed` (length-sorted batches).
* Measures: :func:`spearman` (average ranks for ties), :func:`sts_spearman` (100 × Spearman of the
  pairs' cosines against gold scores), :func:`head_accuracy` and :func:`task_accuracy` (a linear
  head's argmax accuracy, in percent).
* Files: :func:`read_scored_pairs` (TSV ``score<TAB>text<TAB>text2``), :func:`read_labelled_jsonl`
  (``{"text", ["text2",] "label"}`` per line), :func:`load_head` (``weight`` classes × hidden and
  ``bias`` classes in a safetensors file).

Everything raises :class:`ProbeError` for bad inputs (the daemon's probes re-export it).
"""

from __future__ import annotations

import contextlib
import contextvars
import csv
import hashlib
import logging
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ProbeError
from ..io.st import load_json

log = logging.getLogger(__name__)

POOLINGS = ("mean", "cls")
#: A folder holds a tokenizer when it has one of these files.
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.txt", "vocab.json",
                         "spiece.model", "sentencepiece.bpe.model")
_TOKENIZER_AUX_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                        "merges.txt", "config.json")
_TOKENIZER_CACHE: OrderedDict[str, Any] = OrderedDict()
_TOKENIZER_CACHE_SIZE = 4
_TOKENIZER_LOCK = threading.Lock()

#: Models loaded inside one model_scope(), shared by its users; None outside a scope.
_MODEL_SCOPE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("mergestream_text_models",
                                                                           default=None)


# ------------------------------------------------------------------------------------------
# Loading tokenizers and models
# ------------------------------------------------------------------------------------------
def has_tokenizer(folder: str | Path | None) -> bool:
    """True when ``folder`` is a directory holding one of :data:`TOKENIZER_VOCAB_FILES`."""
    return folder is not None and Path(folder).is_dir() and any(
        (Path(folder) / f).is_file() for f in TOKENIZER_VOCAB_FILES)


def _tokenizer_key(src: Path) -> str:
    h = hashlib.sha256()
    if not has_tokenizer(src):  # e.g. a byte-level tokenizer: no content to key on, key on the folder
        h.update(str(src.resolve()).encode() + b"\0")
    for name in sorted((*TOKENIZER_VOCAB_FILES, *_TOKENIZER_AUX_FILES)):
        f = src / name
        if f.is_file():
            h.update(name.encode() + b"\0")
            h.update(f.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


def load_tokenizer(src: str | Path):
    """The transformers tokenizer of folder ``src`` (``AutoTokenizer``, local files only).

    Tokenizers are cached by the sha256 of their files, so every candidate that carries θ₀'s copied
    tokenizer reuses one instance. A tokenizer without a pad token gets its EOS token as pad.

    Raises:
        ProbeError: transformers cannot load a tokenizer from ``src``.
    """
    src = Path(src)
    key = _tokenizer_key(src)
    with _TOKENIZER_LOCK:
        tok = _TOKENIZER_CACHE.get(key)
        if tok is not None:
            _TOKENIZER_CACHE.move_to_end(key)
            return tok
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(  # nosec B615 # a local folder only (local_files_only): no Hub download
            str(src), local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError...
        raise ProbeError(f"cannot load a tokenizer from {src}: {type(exc).__name__}: {exc}") from exc
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    log.debug("tokenizer loaded source=%s key=%s", src, key[:12])
    with _TOKENIZER_LOCK:
        _TOKENIZER_CACHE[key] = tok
        while len(_TOKENIZER_CACHE) > _TOKENIZER_CACHE_SIZE:
            _TOKENIZER_CACHE.popitem(last=False)
    return tok


def _dtype_kwarg() -> str:
    import transformers

    major, minor = (int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def load_model(model_dir: str | Path, kind: str, device: torch.device | str, *, reuse: bool = True):
    """Load ``model_dir`` with transformers in float32, eval mode, on ``device``.

    Args:
        kind: ``encoder`` (``AutoModel``) or ``causal_lm`` (``AutoModelForCausalLM``).
        device: torch device of the returned model.
        reuse: inside :func:`model_scope`, return the model already loaded for the same folder,
            kind and device (and keep this one for the next call). Pass False for a private copy
            whose weights the caller will change (training, overwriting parameters).

    Raises:
        ProbeError: transformers cannot load the folder, or the checkpoint lacks weights of that
            class (other than an encoder's pooler), e.g. an encoder loaded as a causal LM.
    """
    from transformers import AutoModel, AutoModelForCausalLM

    cls = {"encoder": AutoModel, "causal_lm": AutoModelForCausalLM}[kind]
    scope = _MODEL_SCOPE.get() if reuse else None
    key = (str(Path(model_dir).resolve()), kind, str(device))
    if scope is not None and key in scope:
        return scope[key]
    t0 = time.perf_counter()
    try:
        with quiet_progress():
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
    log.info("model loaded path=%s kind=%s seconds=%.2f", model_dir, kind, time.perf_counter() - t0)
    if scope is not None:
        scope.clear()  # keep at most one model resident
        scope[key] = model
    return model


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
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
def model_scope() -> Iterator[None]:
    """Within the block, :func:`load_model` shares one resident model between its callers; it is
    released when the block ends."""
    token = _MODEL_SCOPE.set({})
    try:
        yield
    finally:
        scope = _MODEL_SCOPE.get()
        if scope:
            scope.clear()
        _MODEL_SCOPE.reset(token)


def clear_caches() -> None:
    """Drop every cached tokenizer (e.g. when a tokenizer folder changes in place)."""
    with _TOKENIZER_LOCK:
        _TOKENIZER_CACHE.clear()


# ------------------------------------------------------------------------------------------
# Embeddings
# ------------------------------------------------------------------------------------------
def max_positions(model, tok, requested: int) -> int:
    """``requested`` capped by the model's position embeddings and the tokenizer's
    ``model_max_length`` (tokens)."""
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


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str = "mean") -> torch.Tensor:
    """Pool a last hidden state: (B, T, H) + (B, T) attention mask -> (B, H) float32.

    ``mean``: attention-masked mean over tokens (a row with no token gives 0); ``cls``: the first
    token. Differentiable (used for training as well as measuring).
    """
    if pooling == "cls":
        return hidden[:, 0].float()
    m = mask.to(hidden.dtype).unsqueeze(-1)
    return ((hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)).float()


def encode(tok, texts: list[str], texts2: list[str] | None = None, *, max_length: int) -> dict[str, torch.Tensor]:
    """Tokenize a batch (padded, truncated to ``max_length`` tokens, PyTorch tensors); with
    ``texts2`` as sentence pairs ``tok(texts[i], texts2[i])`` = ``[CLS] a [SEP] b [SEP]`` for BERT."""
    kw = {"padding": True, "truncation": True, "max_length": max_length, "return_tensors": "pt"}
    return tok(texts, texts2, **kw) if texts2 is not None else tok(texts, **kw)


@torch.inference_mode()
def embed(model, tok, texts: list[str], texts2: list[str | None] | None = None, *, pooling: str = "mean",
          batch_size: int = 32, max_length: int = 128, device: torch.device | str = "cpu") -> torch.Tensor:
    """Pooled last hidden states of ``texts`` (or of pairs ``(texts[i], texts2[i])``).

    Inputs are batched in order of length (less padding) and put back in input order; a batch holds
    only single texts or only pairs. ``max_length`` is capped by :func:`max_positions`.

    Returns:
        float32 CPU tensor (N × hidden).

    Raises:
        ProbeError: the model produced NaN/Inf.
    """
    n = len(texts)
    if texts2 is None:
        texts2 = [None] * n
    max_length = max_positions(model, tok, max_length)
    order = sorted(range(n), key=lambda i: (texts2[i] is not None, len(texts[i]) + len(texts2[i] or "")))
    out: torch.Tensor | None = None
    i = 0
    while i < n:
        batch = order[i:i + batch_size]
        paired = texts2[batch[0]] is not None
        batch = [j for j in batch if (texts2[j] is not None) == paired]
        enc = encode(tok, [texts[j] for j in batch], [texts2[j] for j in batch] if paired else None,
                     max_length=max_length)
        enc = {k: v.to(device) for k, v in enc.items()}
        pooled = pool(model(**enc).last_hidden_state, enc["attention_mask"], pooling).cpu()
        if out is None:
            out = torch.empty(n, pooled.shape[1], dtype=torch.float32)
        out[batch] = pooled
        i += len(batch)
    assert out is not None
    if not torch.isfinite(out).all():
        raise ProbeError("the model produced non-finite (NaN/Inf) hidden states")
    return out


# ------------------------------------------------------------------------------------------
# Measures
# ------------------------------------------------------------------------------------------
def rankdata(x: np.ndarray) -> np.ndarray:
    """1-based ranks (float64) of a 1-D array, ties given their average rank (scipy's
    ``rankdata(method='average')``)."""
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
    ra = rankdata(a)
    rb = rankdata(b)
    ra -= ra.mean()
    rb -= rb.mean()
    denom = math.sqrt(float(ra @ ra) * float(rb @ rb))
    if denom == 0.0:
        return float("nan")
    return max(-1.0, min(1.0, float(ra @ rb) / denom))


def sts_spearman(model, tok, rows: list[tuple[float, str, str]], *, batch_size: int = 32, max_length: int = 128,
                 device: torch.device | str = "cpu") -> float:
    """100 × Spearman(cosine of the mean-pooled embeddings of each pair, gold score) of a loaded
    encoder, in [-100, 100]; NaN when the correlation is undefined (constant cosines). Each
    distinct sentence is embedded once.

    Args:
        rows: ``(score, text, text2)`` as :func:`read_scored_pairs` returns them (≥ 2).

    Raises:
        ProbeError: non-finite embeddings. ValueError: fewer than two pairs.
    """
    index: dict[str, int] = {}
    for _, a, b in rows:
        index.setdefault(a, len(index))
        index.setdefault(b, len(index))
    emb = embed(model, tok, list(index), pooling="mean", batch_size=batch_size, max_length=max_length, device=device)
    emb = torch.nn.functional.normalize(emb.double(), dim=1)
    ia = torch.tensor([index[a] for _, a, _ in rows])
    ib = torch.tensor([index[b] for _, _, b in rows])
    return 100.0 * spearman((emb[ia] * emb[ib]).sum(1).numpy(), [s for s, _, _ in rows])


def head_accuracy(emb: torch.Tensor, labels: Iterable[int], w: torch.Tensor, b: torch.Tensor) -> float:
    """Accuracy in percent (0–100) of ``argmax(emb @ wᵀ + b)`` against ``labels``.

    Args:
        emb: (N, hidden) float32 embeddings; w: (classes, hidden); b: (classes,); labels: N ints.
    """
    y = torch.as_tensor(list(labels))
    return 100.0 * float(((emb @ w.T + b).argmax(1) == y).double().mean())


def task_accuracy(model, tok, rows: list[tuple[str, str | None, int]], w: torch.Tensor, b: torch.Tensor, *,
                  task: str = "?", pooling: str = "mean", batch_size: int = 32, max_length: int = 128,
                  device: torch.device | str = "cpu") -> float:
    """Accuracy (%) of a linear head (``w`` classes × hidden, ``b`` classes) on the pooled
    embeddings of labelled rows ``(text, text2 | None, label)`` of a loaded encoder.

    Raises:
        ProbeError: the head's hidden size differs from the model's, or non-finite embeddings.
    """
    texts2 = [t2 for _, t2, _ in rows]
    emb = embed(model, tok, [t for t, _, _ in rows], texts2 if any(texts2) else None, pooling=pooling,
                batch_size=batch_size, max_length=max_length, device=device)
    if emb.shape[1] != w.shape[1]:
        raise ProbeError(f"task {task!r}: head expects hidden size {w.shape[1]}, the model gives {emb.shape[1]}")
    return head_accuracy(emb, [y for _, _, y in rows], w, b)


# ------------------------------------------------------------------------------------------
# Data files and heads
# ------------------------------------------------------------------------------------------
def read_scored_pairs(path: str | Path, max_pairs: int | None = None) -> list[tuple[float, str, str]]:
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


def read_labelled_jsonl(path: str | Path, max_examples: int | None = None) -> list[tuple[str, str | None, int]]:
    """Read a JSONL probe set: ``{"text": str, ["text2": str,] "label": int}`` per non-blank line.

    Returns:
        ``(text, text2 or None, label)`` tuples, at most ``max_examples``.

    Raises:
        ProbeError: a line that is not such an object (names the file and line), or no examples.
    """
    out: list[tuple[str, str | None, int]] = []
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if max_examples is not None and len(out) >= max_examples:
                break
            if not line.strip():
                continue
            obj = load_json(line, f"{path}:{lineno}", error=ProbeError)
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


def load_head(path: str | Path, task: str = "?") -> tuple[torch.Tensor, torch.Tensor]:
    """Load a linear head: ``weight`` (classes × hidden) and ``bias`` (classes,), as float32 CPU.

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
