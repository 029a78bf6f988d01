"""A :meth:`~mergestream.policies.Policy.linear_scale` policy's fold and its subtract-unmerge, in
chunks of :data:`~mergestream.engine.stream.CHUNK_ELEMENTS` elements with per-thread buffers (format 3 of
:mod:`mergestream.engine.residuals`: Δ = λ·(e − θ₀) recomputed, the tie bits and misses written on the way).

A bf16 chunk on the CPU is folded by one compiled loop (:mod:`mergestream.engine.fused`) when the fold is
large enough to pay for loading it (:func:`compiled_loop_pays`), every other one in torch; both give
the same bits (tests/test_fused.py).
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from ..errors import NonFiniteError
from ..io.checkpoints import Checkpoint, check_finite_tensor, is_float_dtype, non_finite_error
from . import stream
from .residuals import ResidualReader, ResidualWriter, math_dtype, recover_previous, task_vector_chunk
from .stream import scratch

__all__ = ["fold_linear", "subtract_linear", "compiled_loop_pays", "load_compiled", "COMPILED_MIN_ENTRIES",
           "COMPILED_MIN_ENTRIES_LATER"]

#: bf16 entries of a fold from which loading the compiled loop pays: importing numba and loading the
#: cached kernels costs ~1 s of wall time once per process, the loop saves ~5 (first fold) to ~8
#: (later fold) ms of CPU per 1M entries against the torch path (2 GHz AVX2 EPYC, two workers), so
#: the two break even near 2²⁸ entries (512 MiB of bf16; at 1 GiB the loop was 0.9-1.6 s faster).
#: Re-measured after the loop went to 32-bit integer steps (bench/results/fused_kernel.md), on the
#: 0.5 GB benchmark checkpoint (2²⁸ entries less 2%), five alternating pairs: a first fold 4.13 s
#: with the loop against 4.03 s on the torch path (still about even), a later fold 4.59 against 4.88.
#: A process that has it loaded (a daemon) uses it for every size.
COMPILED_MIN_ENTRIES = 1 << 28

#: The threshold for a later fold (θ_{t−1} ≠ θ₀), whose torch path also computes the tie bits (about
#: 10 ms of CPU per 1M entries more than the loop): it breaks even near half the first fold's size.
COMPILED_MIN_ENTRIES_LATER = 1 << 27


def compiled_loop_pays(entries: int, dev: torch.device, later: bool = False) -> bool:
    """Whether a fold of ``entries`` bf16 entries on ``dev`` should use :mod:`mergestream.engine.fused`:
    on the CPU, when it is loaded already or the fold is at least :data:`COMPILED_MIN_ENTRIES`
    (:data:`COMPILED_MIN_ENTRIES_LATER` for a ``later`` fold, θ_{t−1} ≠ θ₀). Load it (on the
    calling thread) with :func:`load_compiled` before the workers start."""
    least = COMPILED_MIN_ENTRIES_LATER if later else COMPILED_MIN_ENTRIES
    return dev.type == "cpu" and ("mergestream.engine.fused" in sys.modules or entries >= least)


def fold_linear(name: str, e: torch.Tensor, lam: float, base: Checkpoint, backbone: Checkpoint | None,
                dev: torch.device, contrib: ResidualWriter | None, where: str,
                chunk_elements: int | None = None, compiled: bool = False) -> None:
    """Fold Δ = λ·τ for one tensor in chunks, writing θ_t into ``e``'s own memory.

    Same arithmetic as the whole-tensor path (τ = e − θ₀ in float32, ×λ, + θ_{t−1}, cast), so
    the result is bit-identical to it; temporaries are a few reused float32 chunk buffers per
    thread instead of tensor-sized allocations. bf16 on the CPU runs each chunk, exceptions
    included, as one compiled loop when ``compiled`` (:mod:`mergestream.engine.fused`, the same bits, a
    third of the CPU; see :func:`compiled_loop_pays`).

    Args:
        e: the expert's tensor as stored (CPU, fresh memory; overwritten with θ_t).
        lam: λ. base: θ₀. backbone: θ_{t−1}, or None at the first fold (θ_{t−1} = θ₀).
        contrib: where the tie bits and exception list go (format 3: ``ResidualWriter(...,
            recompute_lambda=λ)``; None: nothing stored).
        where: the expert's description for error messages.
        compiled: use :mod:`mergestream.engine.fused` where it applies (bf16 on the CPU).

    Raises:
        NonFiniteError: the expert holds NaN/Inf, or a result overflows the storage dtype.
    """
    meta = base.meta(name)
    dtype = meta.dtype
    assert is_float_dtype(dtype)
    step = chunk_elements or stream.CHUNK_ELEMENTS
    isz = dtype.itemsize
    flat = e.reshape(-1)
    n = flat.numel()
    step = max(8, step - step % 8)  # whole bytes of the tie bitmask per chunk
    # the first fold's file needs λ only: subtracting the only fold writes θ₀ itself (unmerge), so
    # its tie bits and misses would never be read (a first 1 GiB fold: 3.6 -> 2 s without them)
    exact = contrib is not None and backbone is not None
    ties_start = contrib.reserve_ties(meta) if exact else 0
    exceptions = []
    cpu = torch.device("cpu")
    fused = load_compiled(dtype, dev) if compiled else None
    for s in range(0, n, step):
        k = min(step, n - s)
        ec = flat[s:s + k]
        b_raw = base.read_into(name, scratch("base", k * isz, torch.uint8, cpu), s * isz).view(dtype)
        prev_raw = None if backbone is None else \
            backbone.read_into(name, scratch("prev", k * isz, torch.uint8, cpu), s * isz).view(dtype)
        if fused is not None:
            exc = _fold_chunk_fused(fused, name, ec, b_raw, prev_raw, lam, contrib if exact else None, ties_start,
                                    s, where)
        else:
            exc = _fold_chunk_torch(name, ec, b_raw, prev_raw, lam, dev, contrib if exact else None, ties_start,
                                    s, where)
        if exc is not None:
            exceptions.append(exc)
    if exact:
        contrib.finish(name, exceptions)


def load_compiled(dtype: torch.dtype, dev: torch.device):
    """:mod:`mergestream.engine.fused` when its compiled loop serves ``dtype`` on ``dev``, else None."""
    if dtype != torch.bfloat16 or dev.type != "cpu":
        return None
    try:
        from . import fused
    except ImportError:  # pragma: no cover - numba is a dependency; the torch path still works
        return None
    return fused if fused.applies(dtype, dev) else None


def _overflow(name: str, dtype: torch.dtype) -> NonFiniteError:
    """The error for a fold whose result is not finite in the storage dtype (a finite expert)."""
    return NonFiniteError(f"tensor {name}: the fold's result is not finite in {dtype} (overflow?); nothing written")


def _fold_chunk_fused(fused, name: str, ec: torch.Tensor, b_raw: torch.Tensor, prev_raw: torch.Tensor | None,
                      lam: float, contrib: ResidualWriter | None, ties_start: int, s: int, where: str
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`fold_linear`'s chunk with :func:`mergestream.engine.fused.fold_chunk` (bit-identical to
    :func:`_fold_chunk_torch`); returns the chunk's misses like it."""
    codes = None if prev_raw is None else scratch("codes", ec.numel(), torch.uint8).numpy()
    bad, bad_e = fused.fold_chunk(ec, b_raw, prev_raw, lam, codes)
    if bad_e:
        raise non_finite_error(name, where, bad_e)
    if bad:
        raise _overflow(name, ec.dtype)
    if contrib is None:
        return None
    ties, miss = fused.exceptions(codes)
    contrib.write_ties(ties_start, s, ties)
    if not miss.size:
        return None
    idx = torch.from_numpy(miss)
    return idx + s, prev_raw[idx]


def _fold_chunk_torch(name: str, ec: torch.Tensor, b_raw: torch.Tensor, prev_raw: torch.Tensor | None,
                      lam: float, dev: torch.device, contrib: ResidualWriter | None, ties_start: int, s: int,
                      where: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`fold_linear`'s chunk in torch on ``dev`` (any float dtype); writes θ_t over ``ec`` and
    returns the chunk's misses (:meth:`ResidualWriter.linear_exceptions`) when ``contrib`` is given."""
    k, dtype = ec.numel(), ec.dtype
    m = math_dtype(dtype)
    d, bf = task_vector_chunk(ec, b_raw, lam, dev)
    if prev_raw is None:
        prev_raw, pf = b_raw, bf
    else:
        pf = scratch("p", k, m, dev).copy_(prev_raw)
    y = torch.add(d, pf, out=scratch("y", k, m, dev))
    out_c = scratch("out", k, dtype, dev).copy_(y)
    y.copy_(out_c)  # θ_t as stored, back in the math dtype
    # one reduction catches both NaN/Inf in the expert (still intact in ec) and an overflow of the
    # sum or of the cast to the storage dtype; only then is it told apart which it was
    if not bool(torch.isfinite(y.sum())):
        check_finite_tensor(name, ec, where)
        raise _overflow(name, dtype)
    ec.copy_(out_c)
    if contrib is None:
        return None
    return contrib.linear_exceptions(ties_start, s, out_c, d, prev_raw, y)


def subtract_linear(name: str, cur_s: torch.Tensor, e: torch.Tensor, lam: float, base: Checkpoint,
                    dev: torch.device, exact: ResidualReader | None = None,
                    chunk_elements: int | None = None) -> torch.Tensor:
    """Subtract-unmerge of a format-3 fold for one tensor: rd(θ − λ·(e − θ₀)), in chunks.

    Args:
        cur_s: θ as stored (CPU, fresh memory: overwritten with the result and returned).
        e: the fold's expert tensor as stored (same shape). lam: the fold's λ
            (:attr:`ResidualReader.recompute_lambda`). base: θ₀. dev: the math device.
        exact: the fold's residual file, only when θ is that fold's output: its tie bits and
            exception list then give θ_{t−1} byte for byte (:func:`recover_previous`).

    Returns:
        ``cur_s`` holding the result (θ's dtype and shape).
    """
    dtype = cur_s.dtype
    isz, step = dtype.itemsize, chunk_elements or stream.CHUNK_ELEMENTS
    step = max(8, step - step % 8)
    flat, ef = cur_s.reshape(-1), e.reshape(-1)
    n = flat.numel()
    ties = index = value = None
    if exact is not None:
        ties, index, value = exact.linear(name)
        ties = np.unpackbits(ties.numpy(), count=n).astype(bool) if ties is not None else np.zeros(n, dtype=bool)
    cpu = torch.device("cpu")
    for s in range(0, n, step):
        k = min(step, n - s)
        b_raw = base.read_into(name, scratch("base", k * isz, torch.uint8, cpu), s * isz).view(dtype)
        d, _ = task_vector_chunk(ef[s:s + k], b_raw, lam, dev)
        flat[s:s + k].copy_(recover_previous(flat[s:s + k].to(dev), d, None if ties is None else ties[s:s + k]))
    if index is not None and index.numel():
        flat[index.to(torch.int64)] = value.to(dtype)
    return cur_s
