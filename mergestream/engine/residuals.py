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

Format 3, for a :meth:`~mergestream.policies.Policy.linear_scale` policy (Task Arithmetic) folding a
dense expert: Δ = λ·τ is a function of the expert and θ₀ alone, so the file stores **no** residual
tensor, only λ (metadata ``mergestream.lambda``) and what rounding lost. With d = λ·(e − θ₀)
recomputed exactly as the fold computed it (:func:`task_vector_chunk`) and c = rd(θ_t − d)
(:func:`subtract_delta`), c is θ_{t−1} except where θ_{t−1} + d fell on (or, after the float32 sum,
next to) a rounding tie: θ_t then has two preimages, and θ_{t−1} is c's neighbour on the far side of
θ_t − d. Experts and θ₀ share the storage grid, so such ties are common (λ = 0.5: a quarter to
half of the entries). Per tensor the file holds

* ``<name>::exact_ties`` (uint8, one bit per element, ``numpy.packbits`` order): set where
  θ_{t−1} is not c; it is then c's neighbour toward θ_t − d (1/16 of a bf16 tensor's size, 1/32
  of a float32 one's);
* ``<name>::exact_index`` / ``<name>::exact_value``: the rare entries neither rule gives (weights
  far smaller than d, whose low bits the fold lost; binade crossings), with θ_{t−1}'s value.

Subtract reads the kept expert again (its content hash is checked before anything is published)
and, for the most recent fold, applies both (:func:`recover_previous`). A first fold (θ_{t−1} =
θ₀) stores λ only: subtracting the only fold writes θ₀ itself, and an earlier fold's subtract
uses no exactness data. This saves writing the
model's size per fold: on the 1 GiB bf16 benchmark a later Task Arithmetic fold went from 4.8 to
3.1 s with no residual written at all (``bench/fold_speed.py``; docs/concepts.md, "What unmerge restores").

Fold paths: :meth:`ResidualWriter.add` for whole tensors (computed in chunks);
:func:`mergestream.engine.linear_fold.fold_linear` folds a :meth:`~mergestream.policies.Policy.linear_scale`
policy in chunks of :data:`~mergestream.engine.stream.CHUNK_ELEMENTS` elements, computing the exception
list on the way (format 3).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from ..errors import StateError
from ..io.checkpoints import TensorMeta, is_float_dtype, open_checkpoint, open_safetensors_file
from ..io.s3_checkpoint import is_s3_path
from ..io.writers import AppendWriter, tensor_bytes
from . import stream
from .stream import scratch

EXACT_INDEX = "::exact_index"
EXACT_VALUE = "::exact_value"
EXACT_TIES = "::exact_ties"
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def is_exception_key(key: str) -> bool:
    """True for the exception-list entries of a residual file (not a tensor's residual)."""
    return key.endswith((EXACT_INDEX, EXACT_VALUE, EXACT_TIES))


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


def task_vector_chunk(ec: torch.Tensor, b_raw: torch.Tensor, lam: float, dev: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """d = λ·(e − θ₀) of one flat chunk, the way a linear fold computes it (one home, so that
    subtract recomputes the very same float values).

    Args:
        ec: the expert's chunk as stored (any float dtype, any device). b_raw: θ₀'s chunk as stored
            (same dtype and length). lam: λ. dev: the math device.

    Returns:
        ``(d, θ₀)`` in :func:`math_dtype` of the storage dtype, on ``dev``: per-thread buffers
        (slots ``x`` and ``b``), valid until this thread asks for them again.
    """
    k, m = ec.numel(), math_dtype(b_raw.dtype)
    x = scratch("x", k, m, dev)
    bf = scratch("b", k, m, dev).copy_(b_raw)
    x.copy_(ec)  # widened into a buffer: a mixed-dtype op would allocate a temporary per call
    x.sub_(bf)
    if lam != 1.0:
        x.mul_(lam)  # λτ rounded, then added: the same two roundings as the whole-tensor path
    return x, bf


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype :func:`subtract_delta` takes θ − d in for a storage dtype."""
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def subtract_delta(theta: torch.Tensor, d: torch.Tensor, theta_wide: torch.Tensor | None = None) -> torch.Tensor:
    """rd(θ − d) in θ's storage dtype: within one unit in the last place of the exact θ − d.

    ``θ − d`` runs in float32 for bf16/fp16 checkpoints and in float64 for float32/float64 ones,
    then is rounded once to θ's dtype (the float32 difference may round first in rare cases; the
    fold computes the same function, so what it lists for exactness matches what unmerge gets).

    Args:
        theta: a flat chunk of θ (storage dtype, on d's device). d: the same chunk of Δ (float32 or
            float64). theta_wide: θ's exact widening when the caller has it in the wide dtype
            (the fold's float32 θ_t for bf16/fp16), saving one conversion; None otherwise.

    Returns:
        A per-thread buffer (slot ``sd_out``) in θ's dtype.
    """
    k, dev = theta.numel(), d.device
    wide = _wide(theta.dtype)
    a = scratch("sd_a", k, wide, dev)
    if theta_wide is not None and theta_wide.dtype == wide == d.dtype:
        torch.sub(theta_wide, d, out=a)
    else:
        a.copy_(theta)
        a.sub_(d if d.dtype == wide else scratch("sd_b", k, wide, dev).copy_(d))
    return scratch("sd_out", k, theta.dtype, dev).copy_(a)


def _neighbour_bits(c: torch.Tensor) -> torch.Tensor:
    """Bit patterns of c's neighbours one step toward θ − d (slot ``sd_a``, as
    :func:`subtract_delta` left it), element-wise: the other preimage of a rounding tie.

    Works on the sign-magnitude bit patterns: c's pattern moves one step toward θ − d's when
    compared as signed integers of the wide dtype, for either sign and for signed zeros. Where
    θ − d is exactly c the step is down (never used: such entries are listed). On the CPU in
    numpy, whose integer comparisons into bool are ~3x faster than torch's here. Returns a
    per-thread buffer (slot ``sd_alt``) of c's integer dtype.
    """
    k, dev = c.numel(), c.device
    w = scratch("sd_a", k, _wide(c.dtype), dev)
    cw = scratch("sd_cw", k, w.dtype, dev).copy_(c)
    cb = bits(c)
    alt = scratch("sd_alt", k, cb.dtype, dev)
    if dev.type == "cpu":
        up = np.greater(bits(w).numpy(), bits(cw).numpy(), out=scratch("sd_up", k, torch.bool).numpy())
        a = np.subtract(cb.numpy(), cb.numpy().dtype.type(1), out=alt.numpy())
        a += up
        a += up
    else:
        alt.copy_(torch.gt(bits(w), bits(cw))).mul_(2).sub_(1).add_(cb)
    return alt


def _bf16_misses(pb: torch.Tensor, ties: np.ndarray) -> np.ndarray:
    """The misses of :meth:`ResidualWriter.linear_exceptions` for a bf16 chunk on the CPU: of the
    tie positions ``ties`` (int64 flat indices where c = rd(w) is not θ_{t−1}, w = θ − d), those
    where θ_{t−1} (bit patterns ``pb``, int16) is not c's neighbour toward w either
    (:func:`_neighbour_bits`), read off w's float32 bits (slot ``sd_a``, as :func:`subtract_delta`
    left it). Returns int64 flat indices, ascending.

    A bf16 pattern is the upper half of the float32 one: with w's pattern h·2¹⁶ + l (h its upper
    16 bits, l ∈ [0, 2¹⁶) the lower), c is h or h + 1, and {c, neighbour} is {h, h + 1} when l ≠ 0,
    {h − 1, h} when l = 0 (w is c exactly; that neighbour is taken downward). Both cases say: θ_{t−1}
    is recovered iff q = pb·2¹⁶ − w's pattern lies in [−2¹⁶, 2¹⁶), which wrapping 32-bit arithmetic
    tests as (q + 2¹⁶ mod 2³²) < 2¹⁷, the same wrap as the neighbour's 16-bit patterns. Only the
    ties are looked at (2.6% of a bf16 fold's entries on bench/fold_speed.py's models): 2.0 against
    3.3-3.7 ms per 1M entries for widening c, stepping it and comparing everywhere (one thread;
    tests check both give the same misses).
    """
    w = bits(scratch("sd_a", pb.numel(), torch.float32)).numpy()
    q = pb.numpy()[ties].astype(np.int32)
    q <<= 16
    q -= w[ties]
    q += 1 << 16
    return ties[q.view(np.uint32) >= 1 << 17]


def recover_previous(theta: torch.Tensor, d: torch.Tensor, ties: np.ndarray | None) -> torch.Tensor:
    """θ_{t−1} of one flat chunk from θ_t and d (format 3; exception lists applied afterwards).

    Args:
        theta: θ_t's chunk (storage dtype). d: Δ's chunk (math dtype). ties: the chunk's tie bits
            unpacked (bool, numpy, one per element), or None for an earlier fold (then the result is
            rd(θ − d) only).

    Returns:
        A per-thread buffer (slot ``sd_out``) in θ's dtype.
    """
    c = subtract_delta(theta, d)
    if ties is not None and ties.any():
        cb = bits(c)
        mask = torch.from_numpy(ties).to(c.device)
        cb.copy_(torch.where(mask, _neighbour_bits(c), cb))
    return c


class ResidualWriter:
    """Write one fold's residual file (see the module docstring); threads may add concurrently.

    Args:
        path: the file (a ``*.tmp`` name from :meth:`mergestream.io.state.StateDir.new_file`).
        metas: θ₀'s tensors (to size the header). expert_id: stored in the metadata.
        recompute_lambda: λ of a linear fold (format 3: only exception lists, see the module
            docstring; :func:`~mergestream.engine.linear_fold.fold_linear` calls :meth:`linear_exceptions`), or None (format 2).
        expert_path: format 3: the expert file Δ is recomputed from (for :func:`open_contribution`).
    """

    def __init__(self, path: Path, metas: list[TensorMeta], expert_id: str, recompute_lambda: float | None = None,
                 expert_path: str | None = None):
        meta = {"mergestream.expert": expert_id, "mergestream.residual_format": "2"}
        if recompute_lambda is not None:
            meta.update({"mergestream.residual_format": "3", "mergestream.lambda": repr(float(recompute_lambda)),
                         "mergestream.expert_path": str(expert_path or "")})
        self._w = AppendWriter(path, meta, header_bytes=header_room(metas, 3))

    def reserve_ties(self, meta: TensorMeta) -> int:
        """Plan ``meta``'s tie bitmask (format 3, filled by :meth:`linear_exceptions`); its data start."""
        return self._w.reserve(meta.name + EXACT_TIES, ((meta.numel + 7) // 8,), torch.uint8)

    def linear_exceptions(self, ties_start: int, elem_offset: int, out_s: torch.Tensor, d: torch.Tensor,
                          prev_s: torch.Tensor, theta_wide: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Format 3 for one flat chunk: write its tie bits, return the entries they do not recover.

        A bit is set where c = rd(θ_t − d) is not θ_{t−1}; subtract then takes c's neighbour
        toward θ_t − d there (:func:`recover_previous`), and the returned entries override it
        where that is not θ_{t−1} either. All dense element-wise work: listing only the rare
        misses keeps it cheap (a fifth of a later 1 GiB fold's CPU when every differing entry
        was gathered first).

        Args:
            ties_start: the tensor's bitmask data start (:meth:`reserve_ties`). elem_offset: the
                chunk's first element in the tensor (a multiple of 8). out_s: θ_t (storage dtype).
                d: Δ in the math dtype (:func:`task_vector_chunk`). prev_s: θ_{t−1} (storage dtype).
                theta_wide: θ_t already widened (see :func:`subtract_delta`), or None.

        Returns:
            (flat indices in the whole tensor, θ_{t−1} values) of the misses, or None.
        """
        k, dev = out_s.numel(), out_s.device
        prev = prev_s.to(dev).reshape(-1)
        c = subtract_delta(out_s, d, theta_wide)
        cb, pb = bits(c), bits(prev)
        if dev.type == "cpu":
            ne = np.not_equal(cb.numpy(), pb.numpy(), out=scratch("sd_ne", k, torch.bool).numpy())
            if c.dtype == torch.bfloat16 and sys.byteorder == "little":
                miss = _bf16_misses(pb, np.flatnonzero(ne))
            else:
                miss = np.not_equal(_neighbour_bits(c).numpy(), pb.numpy(), out=scratch("sd_miss", k, torch.bool).numpy())
                miss = np.flatnonzero(np.logical_and(miss, ne, out=miss))
        else:
            alt = _neighbour_bits(c)
            ne_t = torch.ne(cb, pb)
            ne, miss = ne_t.cpu().numpy(), np.flatnonzero(torch.ne(alt, pb).logical_and_(ne_t).cpu().numpy())
        self.write_ties(ties_start, elem_offset, np.packbits(ne).tobytes())
        idx = torch.from_numpy(miss)
        if not idx.numel():
            return None
        return idx + elem_offset, prev[idx.to(dev)].cpu()

    def write_ties(self, ties_start: int, elem_offset: int, packed: bytes) -> None:
        """Write one chunk's tie bits (``numpy.packbits`` order) into the bitmask at ``ties_start``
        (:meth:`reserve_ties`); ``elem_offset``: the chunk's first element (a multiple of 8)."""
        self._w.write_range(ties_start + elem_offset // 8, packed)

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

        Works in chunks of :data:`~mergestream.engine.stream.CHUNK_ELEMENTS` with per-thread buffers, so
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
        meta = self._ck.metadata()
        #: λ of a format-3 file (Δ recomputed from the kept expert), else None
        self.recompute_lambda = (float(meta["mergestream.lambda"])
                                 if meta.get("mergestream.residual_format") == "3" else None)
        #: format 3: the expert file the fold read (absolute path or ``s3://`` URI)
        self.expert_path = meta.get("mergestream.expert_path") or None

    def linear(self, name: str) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Format 3: ``(tie bits, index, value)`` of tensor ``name`` (each None when not stored)."""
        ties = self._ck.get(name + EXACT_TIES) if name + EXACT_TIES in self._ck else None
        if name + EXACT_INDEX in self._ck:
            return ties, self._ck.get(name + EXACT_INDEX), self._ck.get(name + EXACT_VALUE)
        return ties, None, None

    def get(self, name: str) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``(r, index, value)`` of tensor ``name``; ``(None, None, None)`` if nothing was stored."""
        if name not in self._ck:
            return None, None, None
        if name + EXACT_INDEX in self._ck:
            return self._ck.get(name), self._ck.get(name + EXACT_INDEX), self._ck.get(name + EXACT_VALUE)
        return self._ck.get(name), None, None

    def close(self) -> None:
        self._ck.close()


class LinearContribution:
    """A format-3 fold's contribution Δ = λ·(e − θ₀) as a read-only checkpoint of float32 tensors
    (θ₀'s float tensors' names and shapes), for readers that need the vector itself, such as the
    weight-space probe's task cosine. Values are :func:`task_vector_chunk`'s, the fold's own.

    Raises (at construction):
        StateError: the expert file recorded in the residual file is gone.
    """

    def __init__(self, path: Path, base: str | Path, reader: ResidualReader):
        self.path = Path(path)
        self.lam = float(reader.recompute_lambda)
        expert = reader.expert_path
        if not expert or (not is_s3_path(expert) and not Path(expert).exists()):
            raise StateError(f"contribution {path} is recomputed from expert {expert or '(not recorded)'}, "
                             "which is gone")
        self._b = open_checkpoint(base)
        try:
            self._e = open_checkpoint(expert, expect_keys=self._b.keys())
        except BaseException:
            self._b.close()
            raise
        self._metas = {m.name: TensorMeta(m.name, m.shape, torch.float32)
                       for m in self._b.metas() if is_float_dtype(m.dtype)}

    def metas(self) -> list[TensorMeta]:
        return list(self._metas.values())

    def meta(self, name: str) -> TensorMeta:
        return self._metas[name]

    def keys(self) -> list[str]:
        return list(self._metas)

    def get(self, name: str) -> torch.Tensor:
        """Δ of tensor ``name`` (float32, θ₀'s shape)."""
        m = self._metas[name]
        return self.read_into(name, torch.empty(m.nbytes, dtype=torch.uint8)).view(torch.float32).view(m.shape)

    def read_into(self, name: str, out: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Δ's float32 bytes ``[start, start + out.numel())`` of tensor ``name`` into ``out``
        (uint8; ``start`` and the length multiples of 4)."""
        dtype = self._b.meta(name).dtype
        first, count, isz = start // 4, out.numel() // 4, dtype.itemsize
        b_raw = self._b.read_into(name, torch.empty(count * isz, dtype=torch.uint8), first * isz).view(dtype)
        e_raw = self._e.read_into(name, torch.empty(count * isz, dtype=torch.uint8), first * isz).view(dtype)
        d, _ = task_vector_chunk(e_raw, b_raw, self.lam, torch.device("cpu"))
        out.view(torch.float32).copy_(d)
        return out

    def close(self) -> None:
        self._e.close()
        self._b.close()


def open_contribution(path: Path, base: str | Path):
    """A fold's contribution file as a checkpoint of its Δ: the stored residual (formats 1 and 2,
    exception entries included as extra keys, see :func:`is_exception_key`) or, for format 3, a
    :class:`LinearContribution` recomputed from the recorded expert and θ₀ (``base``)."""
    reader = ResidualReader(path)
    if reader.recompute_lambda is None:
        reader.close()
        return open_safetensors_file(path)
    try:
        return LinearContribution(path, base, reader)
    finally:
        reader.close()
