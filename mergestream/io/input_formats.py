"""What input files carry besides plain weights: the rules the readers and validation share.

Legacy pickles (``.bin``, ``.pt``, ``.pth``, ``.ckpt``; read with ``torch.load(weights_only=True,
mmap=True)``, never by unpickling code)
    :func:`unwrap_container` finds the state dict inside a training checkpoint (the keys of
    :data:`CONTAINER_KEYS`: Lightning's ``state_dict``, ``model``, ...); :func:`wrapper_prefix` the
    key prefix a wrapper added (:data:`WRAPPER_PREFIXES`: DataParallel's ``module.``, a Lightning
    module's ``model.``, ``torch.compile``'s ``_orig_mod.``), stripped only when every key has it
    and the stripped names are the base's; :func:`mapped_locations` where each tensor's bytes lie
    in the file, so that they are read with positional reads into fresh memory rather than through
    the mapping (pages read through a private file mapping stay resident until it is closed).

Quantized checkpoints (:func:`quantized_reason`)
    fp8 tensors (e4m3, e5m2, ...), torch quantized tensors, and the companions of quantized weights
    (:data:`QUANTIZATION_TENSOR_NAMES`: ``weight_scale``, ``weight_scale_inv``, ``input_scale``,
    GPTQ/AWQ ``qweight``/``qzeros``/``g_idx``, bitsandbytes ``absmax``/``quant_map``/``SCB``, ...)
    are refused: stored codes are not weights, a scale is not a weight, and requantising a merge
    needs the quantiser's rules.

Recomputed buffers (:data:`RECOMPUTED_BUFFERS`)
    tensors that older library versions saved but that the model recomputes at load (rotary
    ``inv_freq``, cached ``cos``/``sin``, BERT-style ``embeddings.position_ids``, GPT-2's causal
    mask ``attn.bias`` and ``attn.masked_bias``). An expert that carries one the base lacks has it
    dropped (never merged nor written); any other extra tensor is still refused.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..errors import QuantizedCheckpointError, UnsupportedCheckpointError
from . import st

#: keys of a training checkpoint that hold the model's state dict, in the order they are tried
CONTAINER_KEYS = ("state_dict", "model_state_dict", "model", "module")
#: key prefixes that wrappers add to every parameter name (stripped only when the base lacks them)
WRAPPER_PREFIXES = ("module.", "model.", "_orig_mod.")

#: dtypes whose stored values are quantization codes, not weights
QUANTIZED_DTYPES: frozenset[torch.dtype] = frozenset(
    d for d in (getattr(torch, n, None) for n in (
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
        "qint8", "quint8", "qint32", "quint4x2", "quint2x4")) if isinstance(d, torch.dtype))
#: safetensors dtype codes of quantized formats (refused at open when torch has no dtype for them)
QUANTIZED_ST_CODES = ("F8_", "F6_", "F4")
#: tensor names (last components) that only quantized checkpoints carry
QUANTIZATION_TENSOR_NAMES = re.compile(
    r"(^|\.)(weight_scale|weight_scale_inv|input_scale|weight_global_scale|input_global_scale|weight_zero_point"
    r"|weight_packed|qweight|qzeros|g_idx|SCB|absmax|quant_map|nested_absmax|nested_quant_map|quant_state\..+)$")


def _ints(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and dtype != torch.bool


#: (name pattern, test on (shape, dtype), what it is): buffers a model recomputes at load time
RECOMPUTED_BUFFERS: tuple[tuple[re.Pattern[str], Callable[[tuple[int, ...], torch.dtype], bool], str], ...] = (
    (re.compile(r"(^|\.)inv_freq$"), lambda s, d: len(s) == 1 and d.is_floating_point,
     "rotary embedding frequencies (RoPE inv_freq)"),
    (re.compile(r"(^|\.)(cos|sin)_cached$"), lambda s, d: d.is_floating_point, "cached rotary cos/sin tables"),
    (re.compile(r"(^|\.)embeddings\.(position_ids|token_type_ids)$"), lambda s, d: _ints(d),
     "BERT-style position / token type ids (an arange or zeros)"),
    (re.compile(r"(^|\.)attn\.masked_bias$"), lambda s, d: len(s) == 0, "GPT-2 attention mask fill value"),
    (re.compile(r"(^|\.)attn\.bias$"), lambda s, d: len(s) == 4, "GPT-2 causal attention mask"),
)


def recomputed_buffer(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> str | None:
    """What the tensor is if ``name`` (of that shape and dtype) is a known recomputed buffer
    (:data:`RECOMPUTED_BUFFERS`), else None."""
    for pattern, fits, what in RECOMPUTED_BUFFERS:
        if pattern.search(name) and fits(tuple(shape), dtype):
            return what
    return None


def quantized_reason(tensors: Iterable[tuple[str, torch.dtype]]) -> str | None:
    """Why a checkpoint with these ``(name, dtype)`` tensors is quantized, or None if it is not.

    Quantized: a tensor of a :data:`QUANTIZED_DTYPES` dtype (fp8 codes, torch quantized tensors),
    or a tensor named like the scale or packed weight of a quantized layer
    (:data:`QUANTIZATION_TENSOR_NAMES`).
    """
    tensors = list(tensors)
    for name, dtype in tensors:  # a quantized dtype names the format best
        if dtype in QUANTIZED_DTYPES:
            kind = "fp8" if "float8" in str(dtype) else "quantized"
            return f"tensor {name} is stored as {str(dtype).replace('torch.', '')} ({kind} codes)"
    for name, _ in tensors:
        if QUANTIZATION_TENSOR_NAMES.search(name):
            return f"tensor {name} is the scale or packed data of a quantized weight"
    return None


def check_not_quantized(ck: Any, role: str) -> None:
    """Refuse a quantized checkpoint from its headers (names and dtypes only, no data read).

    ``ck`` is anything with ``path``, ``keys()`` and ``meta(name)``: a
    :class:`~mergestream.io.checkpoints.Checkpoint` or a dense expert. Quantized: :func:`quantized_reason`.

    Raises:
        QuantizedCheckpointError: naming the first quantized tensor; nothing is merged from stored
            codes and no scale is ever treated as a weight.
    """
    why = quantized_reason((n, ck.meta(n).dtype) for n in ck.keys())
    if why:
        raise QuantizedCheckpointError(
            f"unsupported quantized checkpoint: {role} {ck.path}: {why}; mergestream merges unquantized "
            "weights only (dequantise to bf16/fp16/fp32 with the scales first)")


def dropped_buffers(base: Any, expert: Any) -> list[str]:
    """The expert's tensors the base lacks that are known recomputed buffers (rotary ``inv_freq``,
    ...; :data:`RECOMPUTED_BUFFERS`), in canonical order: validation
    allows them, the fold neither merges nor writes them (its content hash still covers them)."""
    return st.name_order(n for n in expert.keys() if n not in base
                         and recomputed_buffer(n, expert.meta(n).shape, expert.meta(n).dtype))


def _is_state_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())


def unwrap_container(obj: Any, where: str | os.PathLike) -> tuple[dict[str, torch.Tensor], str]:
    """The state dict inside what ``torch.load`` returned.

    A flat ``{name: tensor}`` dict is used as it is; otherwise the one key of
    :data:`CONTAINER_KEYS` that holds a dict is followed (at most three levels: e.g. a Lightning
    checkpoint's ``state_dict``, a training script's ``{"model": ..., "optimizer": ...}``).

    Returns:
        ``(state dict, how)``: ``how`` names the keys followed (``"['state_dict']"``), ``""`` for a
        flat state dict.

    Raises:
        UnsupportedCheckpointError: no state dict of tensors is found, several container keys hold
            one (ambiguous: never guessed), or the state dict holds a non-tensor value.
    """
    trail: list[str] = []
    for _ in range(4):
        if _is_state_dict(obj):
            return dict(obj), "".join(f"[{k!r}]" for k in trail)
        if not isinstance(obj, dict):
            break
        found = [k for k in CONTAINER_KEYS if isinstance(obj.get(k), dict)]
        if len(found) > 1:
            raise UnsupportedCheckpointError(
                f"{where}: several state dicts ({', '.join(repr(k) for k in found)}); save the one to merge alone")
        if not found:
            bad = next(((k, v) for k, v in obj.items() if not isinstance(v, torch.Tensor)), None)
            what = f"key {bad[0]!r} holds a {type(bad[1]).__name__}" if bad else "it is empty"
            raise UnsupportedCheckpointError(
                f"{where}: not a state dict of tensors ({what}) and no container key "
                f"({', '.join(CONTAINER_KEYS)}) holds one")
        trail.append(found[0])
        obj = obj[found[0]]
    raise UnsupportedCheckpointError(f"{where}: no state dict of tensors found (a {type(obj).__name__})")


def wrapper_prefix(keys: list[str], expected: set[str]) -> str:
    """The wrapper prefix to strip from every key so that the keys name the base's tensors.

    A prefix of :data:`WRAPPER_PREFIXES` (or several, nested: ``module.model.``) is stripped only
    when every key carries it, no key as it is names a tensor of the base (``expected``), and the
    stripped keys do; validation against the base then checks the whole key set.

    Returns:
        The prefix, or ``""`` when nothing is stripped.
    """
    names, prefix = list(keys), ""
    if not names or not expected:
        return ""
    for _ in range(len(WRAPPER_PREFIXES)):
        if any(n in expected for n in names):
            return prefix
        p = next((p for p in WRAPPER_PREFIXES if all(n.startswith(p) for n in names)), None)
        if p is None:
            return ""
        names = [n[len(p):] for n in names]
        prefix += p
    return prefix if any(n in expected for n in names) else ""


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to its last one in its storage (its strides included)."""
    return (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _file_mappings(st: os.stat_result) -> list[tuple[int, int, int]]:
    """``(start, end, file offset)`` of this process's memory mappings of the file ``st`` describes
    (its device and inode; Linux); [] where ``/proc/self/maps`` cannot be read."""
    try:
        with open("/proc/self/maps") as fh:
            lines = fh.readlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 5 or parts[4] != str(st.st_ino):
            continue
        major, _, minor = parts[3].partition(":")
        if (int(major, 16), int(minor, 16)) != (os.major(st.st_dev), os.minor(st.st_dev)):
            continue
        start, _, end = parts[0].partition("-")
        out.append((int(start, 16), int(end, 16), int(parts[2], 16)))
    return out


def mapped_locations(st: os.stat_result, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """``{name: (file offset, span bytes)}`` of the tensors whose data lies in a memory mapping of
    the file ``st`` describes (what ``torch.load(mmap=True)`` returns; ``st`` from ``os.fstat`` of
    the descriptor the reads will use), so that they can be read with positional reads. Tensors
    outside a mapping (an old-style pickle loaded into memory) and empty ones are left out; so is
    everything where ``/proc/self/maps`` is unavailable."""
    maps = _file_mappings(st)
    out: dict[str, tuple[int, int]] = {}
    for name, t in tensors.items():
        if t.numel() == 0 or t.device.type != "cpu":
            continue
        ptr, span = t.data_ptr(), _span_bytes(t)
        for start, end, offset in maps:
            if start <= ptr and ptr + span <= end:
                out[name] = (ptr - start + offset, span)
                break
    return out
