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
    u, _, v = _subspace_iteration(a, None, None, k, oversample, niter, seed)
    return u, v


def randomized_svd_projected(a: Tensor, u_out: Tensor, v_out: Tensor, k: int, oversample: int | None = None,
                             niter: int = 8, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Top-k singular triplets of a⊥ = (I − U Uᵀ) a (I − V Vᵀ) without forming a⊥.

    The same subspace iteration as :func:`randomized_svd` (Halko et al. 2011, Alg. 4.4), whose
    products with a⊥ are taken as projections of the test matrices around one product with ``a``:
    a⊥ X = (I − U Uᵀ)(a (X − V Vᵀ X)), and likewise for a⊥ᵀ. Forming a⊥ itself costs four
    (m, n)-sized products with k columns, a third of the iteration's work at k = 64 (SAFE-Merge's
    τ_⊥, METHODS.md §safe_merge step 2).

    Args:
        a: (m, n) float32.
        u_out: (m, p) and v_out: (n, p') with orthonormal columns: the subspaces projected out.
        k: number of triplets, at most min(m, n); oversample, niter, seed: as :func:`randomized_svd`.

    Returns:
        U (m×k) orthogonal to ``u_out``, σ (k,) descending, V (n×k) orthogonal to ``v_out``, with
        Uᵀ a⊥ V = diag(σ) (and so Uᵀ a V = diag(σ)) up to rounding.
    """
    return _subspace_iteration(a, u_out, v_out, k, oversample, niter, seed)


def _subspace_iteration(a: Tensor, u_out: Tensor | None, v_out: Tensor | None, k: int, oversample: int | None,
                        niter: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """U, σ, V of the top-k block of (I − U_out U_outᵀ) a (I − V_out V_outᵀ) (None: no projection)."""
    m, n = a.shape
    q = min(k + (oversample if oversample is not None else max(2 * k, 10)), m, n)

    def off(basis: Tensor | None, x: Tensor) -> Tensor:  # (I − B Bᵀ) x
        return x if basis is None else x.addmm(basis, basis.T @ x, alpha=-1.0)

    g = torch.Generator(device=a.device).manual_seed(seed)
    omega = torch.randn(n, q, generator=g, device=a.device, dtype=a.dtype)
    qm = torch.linalg.qr(off(u_out, a @ off(v_out, omega))).Q
    for _ in range(niter):
        qm = torch.linalg.qr(off(v_out, a.T @ off(u_out, qm))).Q
        qm = torch.linalg.qr(off(u_out, a @ off(v_out, qm))).Q
    # qm ⊥ U_out already, so qmᵀ a⊥ = (qmᵀ a)(I − V_out V_outᵀ)
    ub, s, vh = torch.linalg.svd(off(v_out, (qm.T @ a).T).T, full_matrices=False)
    return (qm @ ub)[:, :k], s[:k], vh[:k].T


#: Smallest σ_k/σ₁ for which :func:`exact_top_singular` trusts the Gram route (σ² keeps ~16 digits in
#: float64, so vectors of σ_k above 1e-6·σ₁ come out to float32 precision); below it, a full SVD.
GRAM_MIN_RATIO = 1e-6


def exact_top_singular(w: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k singular vectors of a float32 (m, n) matrix, computed exactly in float64.

    Through the eigendecomposition of the smaller Gram matrix (w wᵀ when m ≤ n, else wᵀw): the
    other side's vectors are w's product with them over σ. A quarter of a full float64 SVD's time
    for a 256×2048 matrix, and the same vectors up to sign and float32 rounding (signs do not matter
    to projections U Uᵀ). When σ_k is below :data:`GRAM_MIN_RATIO`·σ₁ (a rank-deficient matrix, where
    the Gram route loses those vectors' precision) it falls back to ``torch.linalg.svd``.

    Returns:
        U (m, k) and V (n, k) float32 with orthonormal columns, contiguous; k ≤ min(m, n).
    """
    wd = w.double()
    wide = w.shape[0] <= w.shape[1]
    evals, evecs = torch.linalg.eigh(wd @ wd.T if wide else wd.T @ wd)  # ascending
    top = evals.flip(0)[:k].clamp_min(0).sqrt()
    if k and float(top[-1]) > GRAM_MIN_RATIO * float(top[0]):
        small = evecs.flip(1)[:, :k]
        other = (wd.T @ small if wide else wd @ small) / top
        u, v = (small, other) if wide else (other, small)
    else:
        u, _, vh = torch.linalg.svd(wd, full_matrices=False)
        u, v = u[:, :k], vh[:k].T
    return u.float().contiguous(), v.float().contiguous()
