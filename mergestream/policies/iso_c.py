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

Cost: one eigendecomposition of the smaller Gram matrix of every weight matrix per fold (float64,
O(m·n·min(m, n))): a fraction of a second per MiniLM matrix, but minutes per 4096 × 11008 matrix on a
CPU, so for 7B-class models run folds with ``--device cuda``.

Unmerge: the running sum cannot drop τ_j without τ_j itself, so ``subtract`` is refused (it would
leave the removed expert in M and bring it back at the next fold); ``replay`` refolds the other
experts from their raw task vectors and gives the "never merged" model byte for byte.
"""

from __future__ import annotations

import torch
from pydantic import Field

from .base import Policy, PolicyParams, Tensor, TensorContext, TensorFold, TensorState


class IsoCParams(PolicyParams):
    # defaults: the values tuned on the quality benchmark (bench/results/quality.md; the paper tunes α
    # per model on validation data), so `fold --policy iso_c` is the recommended setting
    alpha: float = Field(2.0, gt=0, description="scaling α of the isotropic merged update σ̄·U Vᵀ (2-D weights)")
    lam: float = Field(0.2, alias="lambda", ge=0,
                       description="task arithmetic's λ for the other tensors (1-D, embeddings)")


def isotropic(m: Tensor, rtol: float = 1e-6) -> Tensor:
    """σ̄ · U_r V_rᵀ for a 2-D float32 matrix M (m × n) with thin SVD M = U Σ Vᵀ: its singular vectors
    kept, its singular values all replaced by their mean (Iso-C, Marczak et al. ICML 2025, §4.1).

    Only the numerical rank r counts (singular values above ``rtol`` · σ_max; our choice, the paper's
    full fine-tunes are full rank): the mean is over those r values and no direction where M is zero
    is filled in, so the sum of a few low-rank (LoRA) updates stays in their span. Computed from the
    eigendecomposition of the smaller Gram matrix (MᵀM or MMᵀ, float64): U_r V_rᵀ = M V_r Σ_r⁻¹ V_rᵀ,
    about 6x faster than a full SVD of a 2048 × 5504 matrix on the bench machine.

    Returns:
        float32 (m × n); its nonzero singular values all equal σ̄ (all zero for M = 0).
    """
    md = m.double()
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


def merges_isotropically(t: Tensor, ctx: TensorContext) -> bool:
    """Whether a tensor takes the isotropic merge: a 2-D weight with both sides ≥ 2, not an embedding."""
    return t.ndim == 2 and min(t.shape) >= 2 and not ctx.is_embedding


def isotropic_fold(d: Tensor, base: Tensor, backbone: Tensor, state: TensorState, ctx: TensorContext,
                   alpha: float) -> tuple[Tensor, Tensor]:
    """One fold of the running isotropic merge θ_t = θ₀ + α·iso(Σ d_i) (see the module docstring).

    Args:
        d: this fold's update to sum (float32, m × n; Iso-C: τ, SAFE-Merge: its D); used in place.
        base / backbone: θ₀, θ_{t−1} (float32, m × n). state: ``sum`` from the previous fold, if any.
        alpha: α.

    Returns:
        Δ_t = α σ̄ U_r V_rᵀ − (θ_{t−1} − θ₀) (float32) and the new running sum (:func:`state_dtype`).
    """
    total = d if "sum" not in state else d.add_(state["sum"].to(torch.float32))
    kept = total.to(state_dtype(ctx.dtype))
    merged = isotropic(kept.to(torch.float32)).mul_(alpha)
    return merged.sub_(backbone).add_(base), kept


class IsoC(Policy):
    """Iso-C (Marczak et al., ICML 2025); see the module docstring."""

    name = "iso_c"
    Params = IsoCParams
    #: the running sum cannot drop one expert's τ (see the module docstring): replay only
    subtract_unmerge = False

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
        if not merges_isotropically(tau, ctx):
            return TensorFold(tau.mul_(self.params.lam))
        delta, kept = isotropic_fold(tau, base, backbone, state, ctx, self.params.alpha)
        return TensorFold(delta, {"sum": kept})
