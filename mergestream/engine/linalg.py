"""Small linear-algebra helpers for weight-space statistics: top-k singular subspaces and cosines.

Pure tensor math (no I/O), used by the streaming statistics of :mod:`mergestream.engine.inspection` and
through them by the daemon's weight-space probe. SAFE-Merge keeps its own
:func:`mergestream.policies.safe_merge.top_singular` (float64 exact SVD below 512 columns,
:func:`randomized_svd` with 3 power iterations and 10 oversampling columns above): its U₀, V₀ are
persisted in the policy state, so its numerics are part of the fold's result and its parameters
are not the probe's.
"""

from __future__ import annotations

import torch

from ..policies.lowrank import randomized_svd

#: Exact SVD when the short side is at most :data:`EXACT_SVD_MAX_SIDE` and m·n·min(m, n) stays under
#: this (e.g. 30522×384, MiniLM's word embeddings); randomized otherwise.
EXACT_SVD_FLOPS = 1 << 33
#: Longest short side of an exact SVD in ``auto``: a full SVD's cost grows faster on square matrices
#: than m·n·min(m, n) says (one thread pair, 2 GHz EPYC: 2048×2048 2.5 s exact against 0.14 s
#: randomized, 4096×1024 0.8 against 0.14 s, 30522×384 0.55 against 0.46 s). With 2048² attention
#: matrices exact, the daemon's start-up probe of a 1 GiB Llama-shaped θ₀ took 70 s.
EXACT_SVD_MAX_SIDE = 512
SVD_MODES = ("auto", "exact", "lowrank")
__all__ = ["randomized_svd", "top_singular_vectors", "subspace_energy", "cosine_matrix", "max_abs_cosine"]


def top_singular_vectors(a: torch.Tensor, k: int, mode: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """U (m×k′), V (n×k′) of a float32 2-D tensor, k′ = min(k, m, n), contiguous, a's device.

    Args:
        mode: ``exact`` (``torch.linalg.svd`` in a's dtype), ``lowrank`` (:func:`randomized_svd`)
            or ``auto`` (exact while min(m, n) ≤ :data:`EXACT_SVD_MAX_SIDE` and m·n·min(m, n) ≤
            :data:`EXACT_SVD_FLOPS`, randomized otherwise).

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in SVD_MODES:
        raise ValueError(f"svd mode must be one of {SVD_MODES}, got {mode!r}")
    m, n = a.shape
    k = min(k, m, n)
    exact = mode == "exact" or (mode == "auto" and min(m, n) <= EXACT_SVD_MAX_SIDE
                                and m * n * min(m, n) <= EXACT_SVD_FLOPS)
    if exact:
        u, _, vh = torch.linalg.svd(a, full_matrices=False)
        return u[:, :k].contiguous(), vh[:k].T.contiguous()
    u, v = randomized_svd(a, k)
    return u.contiguous(), v.contiguous()


def subspace_energy(x: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> float:
    """‖U Uᵀ x V Vᵀ‖²_F = ‖Uᵀ x V‖²_F for orthonormal U (m×k), V (n×k) and x (m×n): the energy
    of ``x`` inside the subspace pair (a Python float)."""
    return float(torch.linalg.vector_norm((u.T @ x) @ v)) ** 2


def cosine_matrix(gram: torch.Tensor) -> torch.Tensor:
    """Cosines C[i, j] = G[i, j] / (‖vᵢ‖ ‖vⱼ‖) from a Gram matrix G (N×N) of vectors vᵢ.

    A vector with zero norm has cosine 0 with every vector (itself included); NaN in G stays NaN.
    Returns G's dtype (use float64 Grams).
    """
    norms = gram.diagonal().clamp_min(0).sqrt()
    denom = torch.outer(norms, norms)
    return torch.where(denom == 0, torch.zeros_like(gram), gram / torch.where(denom == 0, 1.0, denom))


def max_abs_cosine(gram: torch.Tensor) -> float:
    """The largest |cos(vᵢ, vⱼ)|, i < j, from a Gram matrix (see :func:`cosine_matrix`), capped at
    1.0 (rounding); 0.0 with fewer than two vectors."""
    n = gram.shape[0]
    if n < 2:
        return 0.0
    iu = torch.triu_indices(n, n, 1)
    return float(min(1.0, float(cosine_matrix(gram)[iu[0], iu[1]].abs().max())))
