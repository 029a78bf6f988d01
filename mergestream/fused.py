"""One compiled loop per chunk for a linear fold of a bf16 checkpoint on the CPU (numba).

A Task Arithmetic fold computes, per element, d = rd₃₂(rd₃₂(e − θ₀)·λ) and θ_t = rd₁₆(rd₃₂(θ_{t−1}
+ d)) (Ilharco et al. 2023, "Editing models with task arithmetic", eq. 1, with the roundings of
:func:`mergestream.residuals.task_vector_chunk` and :func:`mergestream.linear_fold.fold_linear`), and a
later fold also the exact-unmerge data of format 3: c = rd₁₆(rd₃₂(θ_t − d)), a tie bit where c is
not θ_{t−1}, and a miss where θ_{t−1} is not c's neighbour toward θ_t − d either
(:meth:`mergestream.residuals.ResidualWriter.linear_exceptions`). With torch each step is a pass
over float32 chunk buffers: about 16 passes, 12 ms of one core per 1M entries of a later fold on
the 2 GHz AVX2 EPYC of bench/results/fold_speed_ta_epyc.md, more than the I/O and hashing of the
same bytes. Here the same float32 operations run in the same order inside one vectorised loop
(no fused multiply-add: numba does not contract without ``fastmath``), so the results are bit for
bit those of the torch path (tests compare both on every kind of value): 2.7-3.9 ms per 1M.

bf16 → float32 is exact (the upper half of the float32 pattern); float32 → bf16 rounds to nearest,
ties to even, as torch does: (u + 0x7FFF + bit 16 of u) >> 16 of the pattern u. NaN patterns
differ from torch's, which never matters: a non-finite result stops the fold.

Only little-endian CPUs with numba, and only folds that pay for loading it
(:func:`mergestream.linear_fold.compiled_loop_pays`); everything else (CUDA, fp16, fp32, smaller
folds, numba missing, or :data:`ENABLED` off) keeps the torch path, which stays the reference.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

#: use the compiled loop where it applies (tests and the benchmark turn it off to compare)
ENABLED = True

#: per-entry codes :func:`fold_chunk` leaves in ``codes``: bit 0 a tie, bit 1 a miss
TIE, MISS = 1, 2


def _jit(signature: str):
    """numba's ``njit`` for a kernel: compiled now, cached on disk where numba finds a writable
    place (the package's ``__pycache__``, or ``NUMBA_CACHE_DIR``), else compiled in each process."""
    def wrap(f):
        try:
            return njit(signature, nogil=True, cache=True, boundscheck=False)(f)
        except RuntimeError:  # no writable cache location (a read-only install)
            return njit(signature, nogil=True, boundscheck=False)(f)
    return wrap


@intrinsic
def _f32_of(typingctx, x):
    """The float32 whose bit pattern is the uint32 ``x``."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def _u32_of(typingctx, x):
    """The bit pattern of the float32 ``x``."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@njit(inline="always")
def _widen(h):
    return _f32_of(np.uint32(h) << np.uint32(16))


@njit(inline="always")
def _round_bf16(u):
    return (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


@_jit("UniTuple(int64, 2)(uint16[::1], uint16[::1], float32)")
def _first(e, b, lam):
    bad = 0
    bad_e = 0
    for i in range(e.shape[0]):
        eu = e[i]
        bf = _widen(b[i])
        o = _round_bf16(_u32_of((_widen(eu) - bf) * lam + bf))
        bad_e += (eu & np.uint16(0x7F80)) == np.uint16(0x7F80)
        bad += (o & np.uint32(0x7F80)) == np.uint32(0x7F80)
        e[i] = np.uint16(o)
    return bad, bad_e


@_jit("UniTuple(int64, 2)(uint16[::1], uint16[::1], uint16[::1], float32, uint8[::1])")
def _later(e, b, p, lam, codes):
    bad = 0
    bad_e = 0
    for i in range(e.shape[0]):
        eu = e[i]
        pu = np.uint32(p[i])
        d = (_widen(eu) - _widen(b[i])) * lam
        o = _round_bf16(_u32_of(d + _widen(pu)))
        bad_e += (eu & np.uint16(0x7F80)) == np.uint16(0x7F80)
        bad += (o & np.uint32(0x7F80)) == np.uint32(0x7F80)
        e[i] = np.uint16(o)
        w = _u32_of(_widen(o) - d)  # θ_t − d in float32, as subtract_delta computes it
        tie = _round_bf16(w) != pu
        # θ_{t−1} is c's neighbour toward w iff pu·2¹⁶ − w ∈ [−2¹⁶, 2¹⁶) (residuals._bf16_misses)
        miss = ((pu << np.uint32(16)) - w + np.uint32(0x10000)) >= np.uint32(0x20000)
        codes[i] = np.uint8(tie) | (np.uint8(tie & miss) << np.uint8(1))
    return bad, bad_e


@_jit("int64(uint64[::1], int64[::1])")
def _misses(words, out):
    n = 0
    for j in range(words.shape[0]):
        if words[j] & np.uint64(0x0202020202020202):
            for k in range(8):  # little-endian: byte k of word j is entry 8j + k
                if (words[j] >> np.uint64(8 * k + 1)) & np.uint64(1):
                    out[n] = 8 * j + k
                    n += 1
    return n


def applies(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :func:`fold_chunk` serves chunks of ``dtype`` on ``device``."""
    return ENABLED and dtype == torch.bfloat16 and device.type == "cpu" and sys.byteorder == "little"


def _u16(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


def fold_chunk(e: torch.Tensor, b: torch.Tensor, p: torch.Tensor | None, lam: float,
               codes: np.ndarray | None) -> tuple[int, int]:
    """θ_t = rd(θ_{t−1} + λ·(e − θ₀)) of one flat bf16 chunk, written over ``e``.

    Args:
        e: the expert's chunk (bf16, CPU, contiguous, 1-D, k entries); overwritten with θ_t.
        b: θ₀'s chunk (same). p: θ_{t−1}'s chunk, or None at a first fold (θ_{t−1} = θ₀).
        lam: λ (rounded to float32, as torch rounds a scalar multiplier of a float32 tensor).
        codes: with ``p``, a uint8 buffer of k entries that receives :data:`TIE` / :data:`MISS`
            per entry (see :func:`exceptions`); ignored at a first fold.

    Returns:
        ``(non-finite results, non-finite expert entries)``: both 0 unless the fold must stop;
        ``e`` is then partly overwritten.
    """
    lam32 = np.float32(lam)
    if p is None:
        return _first(_u16(e), _u16(b), lam32)
    return _later(_u16(e), _u16(b), _u16(p), lam32, codes)


def exceptions(codes: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Format 3's data of one chunk from :func:`fold_chunk`'s codes (k entries, k a multiple of 8,
    or the tensor's last chunk): the tie bits (``numpy.packbits`` order, ⌈k/8⌉ bytes) and the
    misses' flat indices within the chunk (int64, ascending)."""
    k = codes.shape[0]
    ties = np.packbits(codes).tobytes()  # any nonzero code is a tie
    head = k - k % 8
    out = np.empty(max(k // 8, 1) * 8 + 8, np.int64)
    n = _misses(codes[:head].view(np.uint64), out)
    idx = out[:n]
    if head < k:
        idx = np.concatenate([idx, head + np.flatnonzero(codes[head:] & MISS)])
    return ties, idx
