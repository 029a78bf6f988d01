"""Iso-C: isotropic merging of the summed task vectors, folded one expert at a time.

Source: Marczak et al., "No Task Left Behind: Isotropic Model Merging with Common and
Task-Specific Subspaces", ICML 2025 (arXiv 2502.04959), §4.1 (Iso-C).

For a 2-D weight the task vectors seen so far are summed, M_t = Σ_{i≤t} τ_i, and the merged update
keeps M_t's singular vectors but flattens its spectrum to the mean singular value:

    M_t = U Σ Vᵀ (thin SVD),   σ̄ = (1/r) Σ_{i≤r} σ_i,   θ_t = θ₀ + α · σ̄ · U_r V_rᵀ,

r the numerical rank of M_t (:func:`isotropic`; min(m, n) for full fine-tunes, as in the paper).

A task whose update spans directions that the others barely touch keeps them at full strength
instead of being drowned by the dominant ones ("no task left behind"); α is the paper's single
scaling coefficient (tuned on validation data, like λ). The result depends only on the set of
experts, not their order: after the t-th fold the backbone is exactly the offline Iso-C of the
first t experts (up to the storage dtype's rounding).

Continual form (our choice; the paper merges offline): each 2-D tensor's state keeps the running
sum ``sum`` = M_t, stored in the checkpoint's width (bf16/fp16 for 16-bit checkpoints, float32
otherwise; its arithmetic is float32), so the state is one copy of the model's matrices, replaced
at every fold, not one per fold. The fold's update is Δ_t = α σ̄ U Vᵀ − (θ_{t−1} − θ₀): the previous
merge is read from the backbone, not recomputed.

Other tensors (biases, norms: 1-D; embedding matrices and a tied LM head, whose rows belong to
tokens rather than a shared input space — our choice, the paper's encoders have no token
embeddings) take task arithmetic's Δ_t = λ·τ with their own coefficient ``lambda``.

Conventions of the reference implementation (FusionBench 0.2.33's ``iso_c``, a port of the
authors' code; ``reference_params``, checked by tests/test_conformance.py), each a parameter:

- ``rank``: ``numerical`` (ours, default) keeps only the directions whose singular values exceed
  10⁻⁶ σ_max and averages over them; ``full`` (reference) averages over all min(m, n) singular
  values and gives every singular pair σ̄, so a rank-deficient sum's near-zero directions are
  filled in at σ̄ (with whatever basis the SVD returns for them: not reproducible across
  libraries when the sum is rank deficient).
- ``others``: ``sum`` (ours, default) Δ = λ·Σ τ for 1-D tensors and the tensors kept out of the
  isotropic merge; ``mean`` (reference) α·(1/t) Σ τ, α the same scaling as the matrices'.
- ``embeddings``: ``task_arithmetic`` (ours, default) treats embedding matrices and a tied LM head
  like 1-D tensors (``others``); ``isotropic`` (reference) merges every 2-D tensor isotropically.

Our defaults are the ones measured on the quality benchmark (bench/results/quality.md, where α and
λ were tuned with them); the reference's conventions have not been run there.

Cost: one eigendecomposition of the smaller Gram matrix of every weight matrix per fold (float64,
O(m·n·min(m, n))): a fraction of a second per MiniLM matrix, but minutes per 4096 × 11008 matrix on a
CPU, so for 7B-class models run folds with ``--device cuda``.

Unmerge: the running sum cannot drop τ_j without τ_j itself, so ``subtract`` is refused (it would
leave the removed expert in M and bring it back at the next fold); ``replay`` refolds the other
experts from their raw task vectors and gives the "never merged" model byte for byte.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from .base import Policy, PolicyParams, Tensor, TensorContext, TensorFold, TensorState


class IsoCParams(PolicyParams):
    # defaults: the values tuned on the quality benchmark (bench/results/quality.md; the paper tunes α
    # per model on validation data), so `fold --policy iso_c` is the recommended setting
    alpha: float = Field(2.0, gt=0, description="scaling α of the isotropic merged update σ̄·U Vᵀ (2-D weights)")
    lam: float = Field(0.2, alias="lambda", ge=0,
                       description="task arithmetic's λ for the other tensors (1-D, embeddings)")
    rank: Literal["numerical", "full"] = Field("numerical", description="σ̄ over the numerical rank (ours) or all min(m, n) values (reference)")
    others: Literal["sum", "mean"] = Field("sum", description="other tensors: λ·Σ τ (ours) or α·mean τ (reference)")
    embeddings: Literal["task_arithmetic", "isotropic"] = Field(
        "task_arithmetic", description="embedding matrices as the other tensors (ours) or isotropic (reference)")


def isotropic(m: Tensor, rtol: float = 1e-6, *, full: bool = False) -> Tensor:
    """σ̄ · U_r V_rᵀ for a 2-D float32 matrix M (m × n) with thin SVD M = U Σ Vᵀ: its singular vectors
    kept, its singular values all replaced by their mean (Iso-C, Marczak et al. ICML 2025, §4.1).

    Only the numerical rank r counts (singular values above ``rtol`` · σ_max; our choice, the paper's
    full fine-tunes are full rank): the mean is over those r values and no direction where M is zero
    is filled in, so the sum of a few low-rank (LoRA) updates stays in their span. Computed from the
    eigendecomposition of the smaller Gram matrix (MᵀM or MMᵀ, float64): U_r V_rᵀ = M V_r Σ_r⁻¹ V_rᵀ,
    about 6x faster than a full SVD of a 2048 × 5504 matrix on the bench machine.

    With ``full`` (the reference's convention): σ̄ is the mean of all min(m, n) singular values and
    every singular pair of a float64 thin SVD is kept, near-zero ones included.

    Returns:
        float32 (m × n); its nonzero singular values all equal σ̄ (all zero for M = 0).
    """
    md = m.double()
    if full:
        u, s_all, vh = torch.linalg.svd(md, full_matrices=False)
        return (u * s_all.mean()).matmul(vh).to(torch.float32).contiguous()
    tall = md.shape[0] >= md.shape[1]
    a = md if tall else md.T  # (p, q), p ≥ q
    w, v = torch.linalg.eigh(a.T @ a)  # ascending σ², (q,); V (q, q)
    s = w.clamp_min(0).sqrt()
    if s.numel() == 0 or float(s[-1]) <= 0:
        return torch.zeros_like(m, dtype=torch.float32)
    keep = s > rtol * s[-1]
    s_r, v_r = s[keep], v[:, keep]
    out = ((a @ v_r) * (s_r.mean() / s_r)) @ v_r.T  # σ̄ U_r V_rᵀ
    return (out if tall else out.T).to(torch.float32).contiguous()


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The running sum's storage dtype for a checkpoint tensor of ``dtype``: its own 16-bit float
    width, float32 otherwise."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


def merges_isotropically(t: Tensor, ctx: TensorContext, embeddings: bool = False) -> bool:
    """Whether a tensor takes the isotropic merge: a 2-D weight with both sides ≥ 2, not an embedding
    unless ``embeddings``."""
    return t.ndim == 2 and min(t.shape) >= 2 and (embeddings or not ctx.is_embedding)


def running_mean_fold(tau: Tensor, base: Tensor, backbone: Tensor, ctx: TensorContext, alpha: float) -> Tensor:
    """Δ_t for θ_t = θ₀ + α·(1/t) Σ_{i≤t} τ_i, the earlier mean read from the backbone (θ_{t−1} − θ₀)/α.

    Args:
        tau: τ (float32, any shape; used in place). base / backbone: θ₀, θ_{t−1}. alpha: α > 0.

    Returns:
        Δ_t, float32, τ's shape.
    """
    n = ctx.n_previous
    prev = (backbone - base).div_(alpha)
    return tau.sub_(prev).div_(n + 1).mul_(alpha)


def isotropic_fold(d: Tensor, base: Tensor, backbone: Tensor, state: TensorState, ctx: TensorContext,
                   alpha: float, full: bool = False) -> tuple[Tensor, Tensor]:
    """One fold of the running isotropic merge θ_t = θ₀ + α·iso(Σ d_i) (see the module docstring).

    Args:
        d: this fold's update to sum (float32, m × n; Iso-C: τ, SAFE-Merge: its D); used in place.
        base / backbone: θ₀, θ_{t−1} (float32, m × n). state: ``sum`` from the previous fold, if any.
        alpha: α. full: :func:`isotropic`'s ``full`` (the reference's rank convention).

    Returns:
        Δ_t = α σ̄ U_r V_rᵀ − (θ_{t−1} − θ₀) (float32) and the new running sum (:func:`state_dtype`).
    """
    total = d if "sum" not in state else d.add_(state["sum"].to(torch.float32))
    kept = total.to(state_dtype(ctx.dtype))
    merged = isotropic(kept.to(torch.float32), full=full).mul_(alpha)
    return merged.sub_(backbone).add_(base), kept


class IsoC(Policy):
    """Iso-C (Marczak et al., ICML 2025); see the module docstring."""

    name = "iso_c"
    strength_param = "alpha"
    strength_grid = (1.0, 1.5, 2.0, 2.7, 3.5)
    Params = IsoCParams
    #: the running sum cannot drop one expert's τ (see the module docstring): replay only
    subtract_unmerge = False
    reference_params = {"rank": "full", "others": "mean", "embeddings": "isotropic"}

    def fold_tensor(self, base: Tensor, backbone: Tensor, tau: Tensor, state: TensorState,
                    ctx: TensorContext) -> TensorFold:
        """Δ_t for one tensor (see the module docstring).

        Args:
            base / backbone / tau: θ₀, θ_{t−1}, τ; float32, shape S.
            state: ``sum`` (S, the running Σ τ in :func:`state_dtype`) for a 2-D weight after its
                first fold; empty otherwise.

        Returns:
            :class:`TensorFold` with Δ_t (float32, S) and the new ``sum`` for 2-D weights.
        """
        p = self.params
        if not merges_isotropically(tau, ctx, p.embeddings == "isotropic"):
            if p.others == "mean":
                return TensorFold(running_mean_fold(tau, base, backbone, ctx, p.alpha))
            return TensorFold(tau.mul_(p.lam))
        delta, kept = isotropic_fold(tau, base, backbone, state, ctx, p.alpha, p.rank == "full")
        return TensorFold(delta, {"sum": kept})
