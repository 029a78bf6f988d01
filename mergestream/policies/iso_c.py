"""Iso-C: isotropic merging of the summed task vectors, folded one expert at a time.

Source: Marczak et al., "No Task Left Behind: Isotropic Model Merging with Common and
Task-Specific Subspaces", ICML 2025 (arXiv 2502.04959), §4.1 (Iso-C).

For a 2-D weight the task vectors seen so far are summed, M_t = Σ_{i≤t} τ_i, and the merged update
keeps M_t's singular vectors but flattens its spectrum to the mean singular value:

    M_t = U Σ Vᵀ (thin SVD),   σ̄ = (1/r) Σ_i σ_i  (r = min(m, n)),   θ_t = θ₀ + α · σ̄ · U Vᵀ.

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

Unmerge: the running sum cannot drop τ_j without τ_j itself, so ``subtract`` is refused (it would
leave the removed expert in M and bring it back at the next fold); ``replay`` refolds the other
experts from their raw task vectors and gives the "never merged" model byte for byte.
"""

from __future__ import annotations

import torch
from pydantic import Field

from .base import Policy, PolicyParams, Tensor, TensorContext, TensorFold, TensorState


class IsoCParams(PolicyParams):
    alpha: float = Field(1.5, gt=0, description="scaling α of the isotropic merged update σ̄·U Vᵀ (2-D weights)")
    lam: float = Field(0.3, alias="lambda", ge=0,
                       description="task arithmetic's λ for the other tensors (1-D, embeddings)")


def isotropic(m: Tensor) -> Tensor:
    """σ̄ · U Vᵀ for the thin SVD M = U Σ Vᵀ of a 2-D float32 matrix (m × n), σ̄ the mean of the
    min(m, n) singular values (Iso-C, Marczak et al. ICML 2025, §4.1). Float64 math, float32 result
    of M's shape; all singular values of the result equal σ̄ (zero for M = 0)."""
    u, s, vh = torch.linalg.svd(m.double(), full_matrices=False)
    return (s.mean() * (u @ vh)).to(torch.float32)


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The running sum's storage dtype for a checkpoint tensor of ``dtype``: its own 16-bit float
    width, float32 otherwise."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


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
        if tau.ndim != 2 or min(tau.shape) < 2 or ctx.is_embedding:
            return TensorFold(tau.mul_(self.params.lam))
        total = tau if "sum" not in state else tau.add_(state["sum"].to(torch.float32))
        kept = total.to(state_dtype(ctx.dtype))
        merged = isotropic(kept.to(torch.float32)).mul_(self.params.alpha)
        delta = merged.sub_(backbone).add_(base)  # α σ̄ U Vᵀ − (θ_{t−1} − θ₀)
        return TensorFold(delta, {"sum": kept})
