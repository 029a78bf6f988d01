"""Iso-CTS: isotropic merging in the common and task-specific subspaces, folded one expert at a time.

Source: Marczak et al., "No Task Left Behind: Isotropic Model Merging with Common and
Task-Specific Subspaces", ICML 2025 (arXiv 2502.04959), §4.2 (Iso-CTS, Algorithm 1); conventions
as in the reference port, FusionBench 0.2.33's ``iso_cts`` (checked by tests/test_conformance.py).

For a 2-D weight (m × n, d = min(m, n)) and the T task vectors seen so far:

1. Common subspace: the top c singular pairs of the sum M = Σ τ_i, where c₀ = ⌊d·f⌋ (``common_fraction``
   f) and c = d − s·T with s = round((d − c₀)/T) directions per task (Python's rounding, half to
   even), so the task-specific part divides evenly.
2. Task-specific subspaces: for each task, the top s left/right singular vectors and values of
   τ_i with the common left subspace removed, (I − U_c U_cᵀ) τ_i.
3. Stack the T·s task directions and the c common ones (d columns of U, d rows of Vᵀ, d values),
   replace each stack by its nearest orthonormal one (the polar factor P Qᵀ of its thin SVD P Σ Qᵀ)
   and every value by their mean σ̄: X = σ̄ · Ũ Ṽᵀ.
4. θ_T = θ₀ + α·X.

So each task keeps s directions of its own at full strength next to the common ones, where Iso-C
(:mod:`.iso_c`) keeps only the directions of the sum. 1-D tensors take α·(1/T) Σ τ (the
reference's running mean); ``embeddings`` says whether embedding matrices and a tied LM head are
merged like other matrices (``isotropic``, the reference's default) or like 1-D tensors
(``mean``). Defaults are the paper's/reference's (α = 1, f = 0.8); bench/quality.py tuned α = 2.0
(the top of its grid) and measured H 79.9 against Iso-C's 79.7 at 18x its fold time
(bench/results/quality.md).

Continual form (our choice; the paper merges offline): the merge needs every task's own τ_i (step 2),
so each matrix's state keeps the T task vectors stacked, (T, m, n), in the checkpoint's width
(:func:`.iso_c.state_dtype`): T copies of the model's matrices, replaced at every fold, which is
the price of the task-specific subspaces (Iso-C keeps one running sum). After the t-th fold the
backbone is exactly the offline Iso-CTS of the first t experts (up to the storage dtype's
rounding), so the order of the folds does not matter. Unmerge: ``replay`` only (the state mixes the
experts into one merge), as for Iso-C.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from .base import Policy, PolicyParams, Tensor, TensorContext, TensorFold, TensorState
from .iso_c import merges_isotropically, running_mean_fold, state_dtype


class IsoCtsParams(PolicyParams):
    alpha: float = Field(1.0, gt=0, description="scaling α of the merged update (all tensors)")
    common_fraction: float = Field(0.8, ge=0, le=1, description="share f of min(m, n) given to the common subspace")
    embeddings: Literal["isotropic", "mean"] = Field("isotropic", description="embedding matrices merged isotropically or averaged")


def _polar(a: Tensor) -> Tensor:
    """The nearest matrix with orthonormal columns (or rows) to ``a``: P Qᵀ from its thin SVD."""
    p, _, qh = torch.linalg.svd(a, full_matrices=False)
    return p @ qh


def iso_cts(taus: Tensor, common_fraction: float) -> Tensor:
    """Iso-CTS of T task vectors (module docstring, steps 1-3), before the scaling α.

    Args:
        taus: (T, m, n) float tensor of task vectors.
        common_fraction: f, 0 ≤ f ≤ 1.

    Returns:
        X (m, n) float32 (computed in float64).
    """
    t64 = taus.double()
    n_tasks, rows, cols = t64.shape
    d = min(rows, cols)
    c0 = int(d * common_fraction)
    per_task = round((d - c0) / n_tasks)
    if per_task * n_tasks > d:  # rounding up past d (tiny matrices): our guard, the reference has none
        per_task = d // n_tasks
    common = d - per_task * n_tasks
    u, s, vh = torch.linalg.svd(t64.sum(0), full_matrices=False)
    uc, sc, vhc = u[:, :common], s[:common], vh[:common]
    us, ss, vhs = [], [], []
    for tau in t64:
        w = tau - uc @ (uc.T @ tau)
        ut, st, vht = torch.linalg.svd(w, full_matrices=False)
        us.append(ut[:, :per_task])
        ss.append(st[:per_task])
        vhs.append(vht[:per_task])
    big_u = _polar(torch.cat([*us, uc], 1))
    big_vh = _polar(torch.cat([*vhs, vhc], 0))
    sigma = torch.cat([*ss, sc]).mean()
    return (big_u * sigma).matmul(big_vh).to(torch.float32)


class IsoCts(Policy):
    """Iso-CTS (Marczak et al., ICML 2025, §4.2); see the module docstring."""

    name = "iso_cts"
    state_grows = True
    strength_param = "alpha"
    strength_grid = (0.7, 1.0, 1.3, 1.6, 2.0)
    Params = IsoCtsParams
    #: the state holds every task vector merged together: replay only
    subtract_unmerge = False
    reference_params = {"alpha": 1.0, "common_fraction": 0.8, "embeddings": "isotropic"}

    def fold_tensor(self, base: Tensor, backbone: Tensor, tau: Tensor, state: TensorState,
                    ctx: TensorContext) -> TensorFold:
        """Δ_t for one tensor (see the module docstring).

        Args:
            base / backbone / tau: θ₀, θ_{t−1}, τ; float32, shape S.
            state: ``taus`` (t − 1, m, n) in :func:`.iso_c.state_dtype` for a matrix after its first
                fold; empty otherwise.

        Returns:
            :class:`TensorFold` with Δ_t (float32, S) and the new ``taus`` (t, m, n) for matrices.
        """
        p = self.params
        if not merges_isotropically(tau, ctx, p.embeddings == "isotropic"):
            return TensorFold(running_mean_fold(tau, base, backbone, ctx, p.alpha))
        new = tau.to(state_dtype(ctx.dtype))[None]
        taus = new if "taus" not in state else torch.cat([state["taus"].to(new.dtype), new])
        merged = iso_cts(taus.to(torch.float32), p.common_fraction).mul_(p.alpha)
        return TensorFold(merged.sub_(backbone).add_(base), {"taus": taus})
