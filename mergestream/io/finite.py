"""Finiteness checks of tensors: NaN/±Inf found with one reduction, counted only when there are some.

Used by the readers' validation (:func:`mergestream.io.checkpoints.validate_against_base`), the engine's
single pass and the casts of results (re-exported by :mod:`mergestream.io.checkpoints`).
"""

from __future__ import annotations

import torch

from ..errors import NonFiniteError


def count_non_finite(t: torch.Tensor, chunk: int = 1 << 20) -> int:
    """Number of NaN/±Inf entries, counted in chunks of ``chunk`` elements (``torch.isfinite`` on a
    whole tensor allocates a same-sized temporary plus masks)."""
    if not t.is_floating_point():
        return 0
    flat = t.reshape(-1)
    return sum(int((~torch.isfinite(flat[i:i + chunk])).sum()) for i in range(0, flat.numel(), chunk))



def sum_is_finite(t: torch.Tensor) -> bool:
    """Whether one sum of float tensor ``t`` is finite (False: NaN/±Inf, or an overflow). In ``t``'s
    dtype: ``dtype=float32`` on bf16 materialises a float32 copy (~20x slower); float16 (range
    65504, easily overflowed by a sum) is the exception."""
    if t.dtype == torch.float16:
        return bool(torch.isfinite(t.sum(dtype=torch.float32)))
    return bool(torch.isfinite(t.sum()))


def check_finite_tensor(name: str, t: torch.Tensor, where: str) -> None:
    """Raise NonFiniteError if float tensor ``t`` holds NaN/±Inf.

    Fast path: one float32 reduction (NaN and ±Inf propagate through a sum); only when the sum is
    not finite (which finite values can also cause, by overflow) are entries counted in chunks.
    """
    if not t.is_floating_point() or t.numel() == 0:
        return
    if sum_is_finite(t):
        return
    bad = count_non_finite(t)
    if bad:
        raise non_finite_error(name, where, bad)


def non_finite_error(name: str, where: str, count: int) -> NonFiniteError:
    """The error for ``count`` NaN/±Inf values found in tensor ``name`` of ``where``."""
    return NonFiniteError(f"tensor {name}: {where} holds {count} NaN/Inf value(s)")
