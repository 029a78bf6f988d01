"""Randomized top-k singular subspaces: the one implementation the policies and the weight-space
statistics share (SAFE-Merge's U₀/V₀ and risk subspaces, MDM-OC's factored directions,
:func:`mergestream.linalg.top_singular_vectors`).

Halko, Martinsson & Tropp, "Finding structure with randomness", SIAM Review 2011, Alg. 4.4
(randomized subspace iteration with QR re-orthonormalisation at every step).
"""

from __future__ import annotations

import torch

from .base import Tensor


def randomized_svd(a: Tensor, k: int, oversample: int | None = None, niter: int = 8,
                   seed: int = 0) -> tuple[Tensor, Tensor]:
    """Top-k singular vectors of ``a`` (m×n, float32) by randomized subspace iteration.

    The Gaussian test matrix comes from a private generator seeded with ``seed``: no global RNG is
    read or reseeded, so the result is deterministic per device and the same whichever fold worker
    thread computes it (reseeding torch's global generator, as ``torch.svd_lowrank`` needs, races
    between threads). Pretrained weights have almost no gap after the k-th singular value
    (σ₁₆/σ₁₇ ≈ 1.002 in MiniLM), so the defaults are generous: oversampling max(2k, 10) and 8
    power iterations keep a Δ built inside the exact top-16 subspace of MiniLM's word embeddings
    at energy ≥ 0.99; callers that need less pass their own.

    Args:
        a: (m, n) float32.
        k: number of vectors, at most min(m, n).
        oversample: extra test columns (default max(2k, 10)); niter: power iterations.

    Returns:
        U (m×k) and V (n×k) with orthonormal columns, a's dtype, on a's device (not contiguous).
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
