"""What subtract-unmerge needs: the residual each fold actually applied, in the checkpoint's dtype.

A fold writes θ_t = rd(θ_{t−1} + Δ_t), rounded to the storage dtype (bf16, fp16, fp32, ...). The
residual it *applied* is θ_t − θ_{t−1}, not Δ_t. Per tensor this module stores

* ``<name>``: r = rd(θ_t − θ_{t−1}) in the storage dtype (so a fold costs at most the model's size
  in its own dtype, not float32), and
* ``<name>::exact_index`` (int32, or int64 past 2³¹ elements; ascending flat indices) /
  ``<name>::exact_value`` (storage dtype): the few entries where
  ``rd(θ_t − r)`` is not θ_{t−1} bit for bit (where r itself had to be rounded), with
  θ_{t−1}'s stored value there.

Subtract-unmerge computes ``rd(θ − r)`` (float32 math; float64 for float64 checkpoints) and, when θ
is still exactly the output of that fold (the most recent fold, see
``FoldRecord.exact_restore``), overwrites the listed entries: the previous backbone comes back
byte for byte. For an earlier fold the listed entries are not used, and the result is within one
unit in the last place of the storage dtype of θ − r. Files of format 1 (a float32 Δ per tensor,
no exception lists) are still read.

Fold paths: :meth:`ResidualWriter.add` for whole tensors (computed in chunks); :func:`fold_linear` folds a
:meth:`~mergestream.policies.Policy.linear_scale` policy (Task Arithmetic) in chunks of
:data:`~mergestream.stream.CHUNK_ELEMENTS` elements, computing the residual on the way.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from . import stream
from .checkpoints import (
    Checkpoint,
    TensorMeta,
    check_finite_tensor,
    is_float_dtype,
    open_safetensors_file,
)
from .errors import NonFiniteError
from .stream import scratch
from .writers import AppendWriter, tensor_bytes

EXACT_INDEX = "::exact_index"
EXACT_VALUE = "::exact_value"
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def is_exception_key(key: str) -> bool:
    """True for the exception-list entries of a residual file (not a tensor's residual)."""
    return key.endswith((EXACT_INDEX, EXACT_VALUE))


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype residual arithmetic runs in: float64 for float64 tensors, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s storage reinterpreted as signed integers of the same size (bit-exact comparison)."""
    return t.view(_INT_OF_SIZE[t.dtype.itemsize])


def differing_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Flat int64 indices (ascending, on ``a``'s device) where two same-dtype tensors differ bit for
    bit. On the CPU numpy's comparison + ``flatnonzero`` (~5x faster than ``torch.ne(...).nonzero()``
    on 1M bf16 elements, which made the exception lists a tenth of a Task Arithmetic fold's CPU)."""
    if a.device.type == "cpu" and b.device.type == "cpu":
        diff = np.not_equal(bits(a.contiguous()).numpy().reshape(-1), bits(b.contiguous()).numpy().reshape(-1))
        return torch.from_numpy(np.flatnonzero(diff))
    return torch.ne(bits(a), bits(b)).reshape(-1).nonzero().squeeze(1)


def header_room(metas: list[TensorMeta], fields: int) -> int:
    """A generous header size (bytes) for a file holding up to ``fields`` entries per tensor."""
    return 4096 + sum((len(m.name.encode()) + 160) * fields for m in metas)


def subtract(cur_s: torch.Tensor, r: torch.Tensor, index: torch.Tensor | None = None,
             value: torch.Tensor | None = None) -> torch.Tensor:
    """rd(θ − r) in ``cur_s``'s dtype, with the exact entries restored when ``index`` is given.

    Args:
        cur_s: θ (storage dtype). r: the stored residual (storage dtype, or float32 for format 1).
        index / value: the fold's exception list (only for the fold that produced ``cur_s``).
    """
    m = math_dtype(cur_s.dtype)
    out = (cur_s.to(m) - r.to(cur_s.device, m)).to(cur_s.dtype)
    if index is not None and index.numel():
        out.view(-1)[index.to(out.device, torch.int64)] = value.to(out.device, out.dtype)
    return out


class ResidualWriter:
    """Write one fold's residual file (see the module docstring); threads may add concurrently.

    Args:
        path: the file (a ``*.tmp`` name from :meth:`mergestream.state.StateDir.new_file`).
        metas: θ₀'s tensors (to size the header). expert_id: stored in the metadata.
    """

    def __init__(self, path: Path, metas: list[TensorMeta], expert_id: str):
        self._w = AppendWriter(path, {"mergestream.expert": expert_id, "mergestream.residual_format": "2"},
                               header_bytes=header_room(metas, 3))

    def reserve(self, meta: TensorMeta) -> int:
        """Plan ``meta``'s residual (filled by :meth:`chunk`); returns its data start."""
        return self._w.reserve(meta.name, meta.shape, meta.dtype)

    def chunk(self, start: int, elem_offset: int, out_s: torch.Tensor, out_m: torch.Tensor,
              prev_s: torch.Tensor, prev_m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The residual of one flat chunk of a tensor, written at element ``elem_offset``.

        Args:
            start: the tensor's data start (:meth:`reserve`). out_s / prev_s: θ_t and θ_{t−1} of
                the chunk in the storage dtype; out_m / prev_m: the same in the math dtype
                (``out_m`` is overwritten). Per-thread buffers, no allocation.

        Returns:
            The chunk's exceptions as (flat indices in the whole tensor, θ_{t−1} values), or None:
            r = rd(θ_t − θ_{t−1}); listed are the entries where rd(θ_t − r) is not θ_{t−1}
            bit for bit.
        """
        dev, dtype, k = out_s.device, out_s.dtype, out_s.numel()
        d = scratch("d", k, out_m.dtype, dev)
        torch.sub(out_m, prev_m, out=d)
        r = scratch("r", k, dtype, dev).copy_(d)
        d.copy_(r)  # widened into a buffer: a mixed-dtype op would allocate a temporary per call (10x slower)
        out_m.sub_(d)
        back = scratch("back", k, dtype, dev).copy_(out_m)
        self._w.write_range(start + elem_offset * dtype.itemsize, tensor_bytes(r))
        prev_s = prev_s.to(dev)
        idx = differing_bits(back, prev_s)
        if not idx.numel():
            return None
        return idx.cpu() + elem_offset, prev_s.reshape(-1)[idx].cpu()

    def finish(self, name: str, exceptions: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append a tensor's exception list (if any)."""
        if exceptions:
            idx = torch.cat([i for i, _ in exceptions])
            if int(idx[-1]) < 2**31:  # ascending: int32 indices when they fit (6 bytes per bf16 entry)
                idx = idx.to(torch.int32)
            self._w.write(name + EXACT_INDEX, idx)
            self._w.write(name + EXACT_VALUE, torch.cat([v for _, v in exceptions]))

    def add(self, name: str, out_s: torch.Tensor, prev_s: torch.Tensor) -> None:
        """Whole-tensor form: θ_t (``out_s``, CPU) and θ_{t−1} (``prev_s``) of tensor ``name``.

        Works in chunks of :data:`~mergestream.stream.CHUNK_ELEMENTS` with per-thread buffers, so
        the residual costs no tensor-sized temporaries.
        """
        start = self._w.reserve(name, tuple(out_s.shape), out_s.dtype)
        out_f, prev_f = out_s.reshape(-1), prev_s.reshape(-1)
        m, dev = math_dtype(out_s.dtype), out_s.device
        exceptions = []
        for s in range(0, out_f.numel(), stream.CHUNK_ELEMENTS):
            k = min(stream.CHUNK_ELEMENTS, out_f.numel() - s)
            o, p = out_f[s:s + k], prev_f[s:s + k].to(dev)
            exc = self.chunk(start, s, o, scratch("am", k, m, dev).copy_(o), p, scratch("ap", k, m, dev).copy_(p))
            if exc is not None:
                exceptions.append(exc)
        self.finish(name, exceptions)

    def close(self) -> None:
        self._w.close()

    def abort(self) -> None:
        self._w.abort()


class ResidualReader:
    """Read a fold's residual file (format 2, or format 1's float32 Δ). Thread-safe."""

    def __init__(self, path: Path):
        self._ck = open_safetensors_file(path)

    def get(self, name: str) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``(r, index, value)`` of tensor ``name``; ``(None, None, None)`` if nothing was stored."""
        if name not in self._ck:
            return None, None, None
        if name + EXACT_INDEX in self._ck:
            return self._ck.get(name), self._ck.get(name + EXACT_INDEX), self._ck.get(name + EXACT_VALUE)
        return self._ck.get(name), None, None

    def close(self) -> None:
        self._ck.close()


def fold_linear(name: str, e: torch.Tensor, lam: float, base: Checkpoint, backbone: Checkpoint | None,
                dev: torch.device, contrib: ResidualWriter | None, where: str,
                chunk_elements: int | None = None) -> None:
    """Fold Δ = λ·τ for one tensor in chunks, writing θ_t into ``e``'s own memory.

    Same arithmetic as the whole-tensor path (τ = e − θ₀ in float32, ×λ, + θ_{t−1}, cast), so
    the result is bit-identical to it; temporaries are a few reused float32 chunk buffers per
    thread instead of tensor-sized allocations.

    Args:
        e: the expert's tensor as stored (CPU, fresh memory; overwritten with θ_t).
        lam: λ. base: θ₀. backbone: θ_{t−1}, or None at the first fold (θ_{t−1} = θ₀).
        contrib: where the applied residual goes (None: not stored).
        where: the expert's description for error messages.

    Raises:
        NonFiniteError: the expert holds NaN/Inf, or a result overflows the storage dtype.
    """
    meta = base.meta(name)
    dtype = meta.dtype
    assert is_float_dtype(dtype)
    m = math_dtype(dtype)
    step = chunk_elements or stream.CHUNK_ELEMENTS
    isz = dtype.itemsize
    flat = e.reshape(-1)
    n = flat.numel()
    start = contrib.reserve(meta) if contrib is not None else 0
    exceptions = []
    cpu = torch.device("cpu")
    for s in range(0, n, step):
        k = min(step, n - s)
        ec = flat[s:s + k]
        x = scratch("x", k, m, dev)
        b_raw = base.read_into(name, scratch("base", k * isz, torch.uint8, cpu), s * isz).view(dtype)
        bf = scratch("b", k, m, dev).copy_(b_raw)
        x.copy_(ec)  # widened into a buffer: a mixed-dtype op would allocate a temporary per call
        x.sub_(bf)
        if backbone is None:
            prev_raw, pf = b_raw, bf
        else:
            prev_raw = backbone.read_into(name, scratch("prev", k * isz, torch.uint8, cpu), s * isz).view(dtype)
            pf = scratch("p", k, m, dev).copy_(prev_raw)
        if lam != 1.0:
            x.mul_(lam)  # λτ rounded, then added: the same two roundings as the whole-tensor path
        x.add_(pf)
        out_c = scratch("out", k, dtype, dev).copy_(x)
        x.copy_(out_c)  # θ_t as stored, back in the math dtype
        # one reduction catches both NaN/Inf in the expert (still intact in ec) and an overflow of the
        # sum or of the cast to the storage dtype; only then is it told apart which it was
        if not bool(torch.isfinite(x.sum())):
            check_finite_tensor(name, ec, where)
            raise NonFiniteError(f"tensor {name}: the fold's result is not finite in {dtype} (overflow?); "
                                 "nothing written")
        ec.copy_(out_c)
        if contrib is not None:
            exc = contrib.chunk(start, s, out_c, x, prev_raw, pf)
            if exc is not None:
                exceptions.append(exc)
    if contrib is not None:
        contrib.finish(name, exceptions)
