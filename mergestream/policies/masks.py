"""Top-k masks without a full top-k: the selection TIES's trim and SAFE-Merge's mask share.

TIES step 1 (Yadav et al., NeurIPS 2023, §3) keeps the top-k% magnitudes of each task vector;
SAFE-Merge step 4 (METHODS.md §safe_merge) the top-ρ fraction of its risk-weighted scores. Both
need exactly ``keep`` entries of largest score, which this module finds with a sampled bracket
around the threshold instead of ``torch.topk`` over the whole tensor.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import Tensor


def magnitude_mask(score: Tensor, rho: float) -> Tensor:
    """Boolean mask of exactly round(ρ·numel) entries with the largest score: :func:`top_mask`
    with a ratio ρ ∈ [0, 1] (SAFE-Merge's keep ratio)."""
    n = score.numel()
    return top_mask(score, min(n, max(0, round(rho * n))))


def top_mask(score: Tensor, keep: int) -> Tensor:
    """Boolean mask of exactly ``keep`` entries with the largest score (float ``score``, any shape;
    the mask has its shape; 0 ≤ keep ≤ numel). Which of several entries tied at the boundary is
    kept is unspecified (as with ``torch.topk``).

    On the CPU, for large tensors, the top set is found without a full top-k (``torch.topk`` with
    k = 0.1·numel took ~150 ms per 11M entries, a tenth of SAFE-Merge's fold, and holds buffers of
    several times the tensor): sample quantiles bracket the threshold, entries above the bracket
    are kept, entries below it dropped, and one small top-k over the entries inside the bracket
    picks the rest — the same set. When the sample misjudged the bracket (rare) it falls back to
    the full top-k.
    """
    flat = score.reshape(-1)
    n = flat.numel()
    if keep in (0, n):
        return torch.full_like(score, keep == n, dtype=torch.bool)
    if score.device.type == "cpu" and n >= _BRACKET_MIN:
        mask = _bracket_top(flat, keep)
        if mask is not None:
            return mask.view_as(score)
    mask = torch.zeros(n, dtype=torch.bool, device=score.device)
    mask[torch.topk(flat, keep, sorted=False).indices] = True
    return mask.view_as(score)


_BRACKET_MIN = 1 << 20  # entries below which a plain top-k is as fast
_BRACKET_SAMPLE = 1 << 18  # sampled scores (quantile error ~0.0006 at the 0.9 quantile)
_BRACKET_HALF_WIDTH = 0.003  # quantile half-width of the bracket (~5 standard errors)


def _bracket_top(flat: Tensor, keep: int) -> Tensor | None:
    """The top-``keep`` mask of CPU ``flat`` through a sampled bracket, or None to fall back."""
    n = flat.numel()
    x = flat.detach().contiguous().numpy()
    gen = torch.Generator().manual_seed(n)  # deterministic: the same tensor gives the same mask
    sample = flat[torch.randint(n, (_BRACKET_SAMPLE,), generator=gen)].numpy()
    q = 1.0 - keep / n
    lo, hi = np.quantile(sample, [max(0.0, q - _BRACKET_HALF_WIDTH), min(1.0, q + _BRACKET_HALF_WIDTH)])
    above = x > hi
    n_above = int(np.count_nonzero(above))
    inside = np.flatnonzero((x >= lo) & ~above)  # [lo, hi]: with ties lo may equal hi
    if not n_above <= keep <= n_above + inside.size:  # the threshold is not inside the bracket
        return None
    need = keep - n_above
    if need:
        top = torch.topk(torch.from_numpy(x[inside]), need, sorted=False).indices.numpy()
        above[inside[top]] = True
    return torch.from_numpy(above)
