"""Randomized top-k singular subspaces: the one implementation the policies and the weight-space
statistics share (SAFE-Merge's U₀/V₀ and risk subspaces, MDM-OC's factored directions,
:func:`mergestream.engine.linalg.top_singular_vectors`).

Halko, Martinsson & Tropp, "Finding structure with randomness", SIAM Review 2011, Alg. 4.4
(randomized subspace iteration with QR re-orthonormalisation at every step).
"""

from __future__ import annotations

import torch

from .base import Tensor


def randomized_svd(a: Tensor, k: int, oversample: int | None = None, niter: int = 8,
                   seed: int = 0, product_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
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
        product_dtype: None, or a narrower dtype (``torch.bfloat16``) in which all power-iteration
            products with ``a`` but the last are taken (float32 accumulation, through a copy of
            ``a`` in that dtype: half of a's bytes more memory); the last one and the product that
            gives σ and V stay in a's dtype. See :func:`native_low_precision_dtype`.

    Returns:
        U (m×k) and V (n×k) with orthonormal columns, a's dtype, on a's device (not contiguous).
    """
    u, _, v = _subspace_iteration(a, None, None, k, oversample, niter, seed, product_dtype)
    return u, v


def randomized_right_singular(a: Tensor, k: int, oversample: int | None = None, niter: int = 8, seed: int = 0,
                              product_dtype: torch.dtype | None = None) -> Tensor:
    """Top-k right singular vectors V (n×k) of ``a`` alone: :func:`randomized_svd` with every
    power-iteration product in ``product_dtype`` (the last one too).

    V comes from the final product qmᵀ a in a's dtype, and the narrow products' rounding of the basis
    qm reaches V only through the small singular values outside the top-k (on a gapped test matrix
    V's projector moved by 5e-7 with all products in bfloat16, U's by 2e-4), so the full-precision
    last step that U needs (:func:`randomized_svd`) is left out. Arguments as :func:`randomized_svd`.
    """
    return _subspace_iteration(a, None, None, k, oversample, niter, seed, product_dtype, narrow_last=True)[2]


def randomized_svd_projected(a: Tensor, u_out: Tensor, v_out: Tensor, k: int, oversample: int | None = None,
                             niter: int = 8, seed: int = 0, product_dtype: torch.dtype | None = None
                             ) -> tuple[Tensor, Tensor, Tensor]:
    """Top-k singular triplets of a⊥ = (I − U Uᵀ) a (I − V Vᵀ) without forming a⊥.

    The same subspace iteration as :func:`randomized_svd` (Halko et al. 2011, Alg. 4.4), whose
    products with a⊥ are taken as projections of the test matrices around one product with ``a``:
    a⊥ X = (I − U Uᵀ)(a (X − V Vᵀ X)), and likewise for a⊥ᵀ. Forming a⊥ itself costs four
    (m, n)-sized products with k columns, a third of the iteration's work at k = 64 (SAFE-Merge's
    τ_⊥, METHODS.md §safe_merge step 2).

    Args:
        a: (m, n) float32.
        u_out: (m, p) and v_out: (n, p') with orthonormal columns: the subspaces projected out.
        k: number of triplets, at most min(m, n); oversample, niter, seed, product_dtype: as
            :func:`randomized_svd`.

    Returns:
        U (m×k) orthogonal to ``u_out``, σ (k,) descending, V (n×k) orthogonal to ``v_out``, with
        Uᵀ a⊥ V = diag(σ) (and so Uᵀ a V = diag(σ)) up to rounding.
    """
    return _subspace_iteration(a, u_out, v_out, k, oversample, niter, seed, product_dtype)


def native_low_precision_dtype(device: torch.device | str) -> torch.dtype | None:
    """``torch.bfloat16`` where ``device`` multiplies bfloat16 matrices natively (a CUDA device that
    supports it; a CPU with AVX512-BF16 or AMX-BF16 instructions), else None.

    There a bfloat16 product with float32 accumulation runs 2-3x faster than a float32 one (a
    2048×5504 matrix times 74 columns, one thread: about 14 against 39 ms), while elsewhere it is
    emulated and slower. A property of the machine, so the choice is the same on every run there.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    if device.type == "cpu":
        caps = torch.cpu.get_capabilities()
        return torch.bfloat16 if caps.get("avx512_bf16") or caps.get("amx_bf16") else None
    return None


def _subspace_iteration(a: Tensor, u_out: Tensor | None, v_out: Tensor | None, k: int, oversample: int | None,
                        niter: int, seed: int, product_dtype: torch.dtype | None = None,
                        narrow_last: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """U, σ, V of the top-k block of (I − U_out U_outᵀ) a (I − V_out V_outᵀ) (None: no projection).

    With ``product_dtype``, the first 2·niter of the 2·niter + 1 products that steer the basis are
    taken with a copy of ``a`` in that dtype (the QR after each restores orthonormality in a's
    dtype); the last one and the final qmᵀ a, from which σ and V come, use ``a`` itself. That last
    full-precision step removes the narrow products' rounding from the basis wherever the spectrum
    has a gap after k (on a gapped test matrix, SAFE-Merge's risk moved by up to 0.22 per entry with
    all 2·niter + 1 products in bfloat16, by 4e-4 as now, by 2e-4 in float32). ``narrow_last``: that
    last product in ``product_dtype`` too, for callers that use only σ and V."""
    m, n = a.shape
    q = min(k + (oversample if oversample is not None else max(2 * k, 10)), m, n)
    narrow = product_dtype is not None and product_dtype != a.dtype and (niter > 0 or narrow_last)
    low = a.to(product_dtype) if narrow else a

    def mul(x: Tensor, y: Tensor) -> Tensor:  # x @ y; with the narrow copy on either side, in its dtype
        return x @ y if x.dtype == y.dtype else (x.to(low.dtype) @ y.to(low.dtype)).to(a.dtype)

    def forward(y: Tensor, last: bool) -> Tensor:  # a @ y; the last one in a's dtype unless narrow_last
        return mul(a if last and not narrow_last else low, y)

    def backward(x: Tensor) -> Tensor:  # aᵀ x in the product dtype, taken as (xᵀ a)ᵀ: MKL's product
        # with a transposed (m, n) left factor ran 1.2-2.1x slower on an AVX2 CPU, bit for bit the same
        return mul(x.T, low).T

    def off(basis: Tensor | None, x: Tensor) -> Tensor:  # (I − B Bᵀ) x
        return x if basis is None else x.addmm(basis, basis.T @ x, alpha=-1.0)

    g = torch.Generator(device=a.device).manual_seed(seed)
    omega = torch.randn(n, q, generator=g, device=a.device, dtype=a.dtype)
    qm = torch.linalg.qr(off(u_out, forward(off(v_out, omega), last=niter == 0))).Q
    for i in range(niter):
        qm = torch.linalg.qr(off(v_out, backward(off(u_out, qm)))).Q
        qm = torch.linalg.qr(off(u_out, forward(off(v_out, qm), last=i == niter - 1))).Q
    del low
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
