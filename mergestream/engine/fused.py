"""One compiled loop per chunk for a linear fold of a bf16 checkpoint on the CPU (numba).

A Task Arithmetic fold computes, per element, d = rd₃₂(rd₃₂(e − θ₀)·λ) and θ_t = rd₁₆(rd₃₂(θ_{t−1}
+ d)) (Ilharco et al. 2023, "Editing models with task arithmetic", eq. 1, with the roundings of
:func:`mergestream.engine.residuals.task_vector_chunk` and :func:`mergestream.engine.linear_fold.fold_linear`), and a
later fold also the exact-unmerge data of format 3: c = rd₁₆(rd₃₂(θ_t − d)), a tie bit where c is
not θ_{t−1}, and a miss where θ_{t−1} is not c's neighbour toward θ_t − d either
(:meth:`mergestream.engine.residuals.ResidualWriter.linear_exceptions`). With torch each step is a pass
over float32 chunk buffers: about 16 passes, 12 ms of one core per 1M entries of a later fold on
the 2 GHz AVX2 EPYC of bench/results/fold_speed_ta_epyc.md, more than the I/O and hashing of the
same bytes. Here the same float32 operations run in the same order inside one vectorised loop
(no fused multiply-add: numba does not contract without ``fastmath``), so the results are bit for
bit those of the torch path (tests compare both on every kind of value): 1.2-1.7 ms per 1M
(bench/results/fused_kernel.md, the same machine).

bf16 → float32 is exact (the upper half of the float32 pattern); float32 → bf16 rounds to nearest,
ties to even, as torch does: (u + 0x7FFF + bit 16 of u) >> 16 of the pattern u. NaN patterns
differ from torch's, which never matters: a non-finite result stops the fold.

Only little-endian CPUs with numba, and only folds that pay for loading it
(:func:`mergestream.engine.linear_fold.compiled_loop_pays`); everything else (CUDA, fp16, fp32, smaller
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


_I32 = ir.IntType(32)


# The bit manipulations below are LLVM intrinsics in 32-bit arithmetic rather than numba expressions:
# numba types arithmetic on uint32 values as 64-bit, which halved the loops' vector width and added
# packing around every step (one core per 1M entries, with a copy of the chunk: a later fold's loop
# 3.42 ms as numba expressions, 1.71 ms as these; a first fold's 1.69 and 1.18 ms;
# bench/results/fused_kernel.md). The 32-bit wrap-around differs from 64-bit only where a value is
# not finite, which stops the fold.

@intrinsic
def _widen(typingctx, h):
    """The float32 of the bf16 pattern ``h`` (uint16): exact, h's bits in the upper half."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.shl(builder.zext(args[0], _I32), _I32(16)), ir.FloatType())
    return types.float32(types.uint16), codegen


def _round_ir(builder, u):
    """IR of float32 → bf16 rounding to nearest, ties to even, of the pattern ``u`` (i32): (u + 0x7FFF
    + bit 16 of u) >> 16, the bf16 pattern in the low half."""
    lsb = builder.and_(builder.lshr(u, _I32(16)), _I32(1))
    return builder.lshr(builder.add(builder.add(u, _I32(0x7FFF)), lsb), _I32(16))


@intrinsic
def _bf16_bits(typingctx, x):
    """The bf16 pattern (uint32, upper half zero) of the float32 ``x`` rounded to nearest, ties to even."""
    def codegen(context, builder, sig, args):
        return _round_ir(builder, builder.bitcast(args[0], _I32))
    return types.uint32(types.float32), codegen


@intrinsic
def _not_finite(typingctx, h):
    """1 where the bf16 pattern ``h`` (uint16, or the low half of a uint32) is Inf or NaN (its
    exponent all ones), else 0; uint32."""
    def codegen(context, builder, sig, args):
        v = args[0] if args[0].type.width == 32 else builder.zext(args[0], _I32)
        hit = builder.icmp_unsigned("==", builder.and_(v, _I32(0x7F80)), _I32(0x7F80))
        return builder.zext(hit, _I32)
    return types.uint32(h), codegen


@intrinsic
def _add(typingctx, a, b):
    """a + b in uint32 (a count of at most a chunk's entries)."""
    def codegen(context, builder, sig, args):
        return builder.add(args[0], args[1])
    return types.uint32(types.uint32, types.uint32), codegen


@intrinsic
def _code(typingctx, pu, w):
    """A later fold's per-entry code (uint8) from θ_{t−1}'s bf16 pattern ``pu`` (uint16) and the
    float32 ``w`` = θ_t − d: :data:`TIE` where w rounds to another bf16 than θ_{t−1}, and with it
    :data:`MISS` where θ_{t−1} is not that one's neighbour toward w either, that is where
    pu·2¹⁶ − w ∉ [−2¹⁶, 2¹⁶) (:meth:`mergestream.engine.residuals.ResidualWriter.linear_exceptions`)."""
    def codegen(context, builder, sig, args):
        p = builder.zext(args[0], _I32)
        u = builder.bitcast(args[1], _I32)
        tie = builder.icmp_unsigned("!=", _round_ir(builder, u), p)
        gap = builder.add(builder.sub(builder.shl(p, _I32(16)), u), _I32(0x10000))
        miss = builder.and_(tie, builder.icmp_unsigned(">=", gap, _I32(0x20000)))
        i8 = ir.IntType(8)
        return builder.or_(builder.zext(tie, i8), builder.shl(builder.zext(miss, i8), i8(1)))
    return types.uint8(types.uint16, types.float32), codegen


@_jit("UniTuple(int64, 2)(uint16[::1], uint16[::1], float32)")
def _first(e, b, lam):
    bad = np.uint32(0)
    bad_e = np.uint32(0)
    for i in range(e.shape[0]):
        eu = e[i]
        bf = _widen(b[i])
        o = _bf16_bits((_widen(eu) - bf) * lam + bf)
        bad_e = _add(bad_e, _not_finite(eu))
        bad = _add(bad, _not_finite(o))
        e[i] = np.uint16(o)
    return np.int64(bad), np.int64(bad_e)


@_jit("UniTuple(int64, 2)(uint16[::1], uint16[::1], uint16[::1], float32, uint8[::1])")
def _later(e, b, p, lam, codes):
    bad = np.uint32(0)
    bad_e = np.uint32(0)
    for i in range(e.shape[0]):
        eu = e[i]
        pu = p[i]
        d = (_widen(eu) - _widen(b[i])) * lam
        o = _bf16_bits(d + _widen(pu))
        bad_e = _add(bad_e, _not_finite(eu))
        bad = _add(bad, _not_finite(o))
        oh = np.uint16(o)
        e[i] = oh
        codes[i] = _code(pu, _widen(oh) - d)  # w = θ_t − d in float32, as subtract_delta computes it
    return np.int64(bad), np.int64(bad_e)


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
