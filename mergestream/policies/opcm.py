"""OPCM: orthogonal projection-based continual merging (Tang et al., arXiv 2501.09522).

A peer for the benchmark. Per 2-D weight, with the unscaled merged task vector
M_{t−1} = Δ_{t−1} / λ_{t−1} (paper §4.1-4.2):

1. SVD M_{t−1} = U S Vᵀ; the dominant block is the first r singular pairs, r the smallest rank
   whose singular values hold a fraction ``alpha`` of their sum (our reading of the paper's α);
2. project the incoming τ off that block: τ' = τ − U_r (U_rᵀ τ V_r) V_rᵀ (the paper zeroes the
   block's entries of Uᵀ τ V);
3. M_t = M_{t−1} + τ', rescaled so that the merged task vector's norm is the running mean of the
   experts' ‖τ‖ (adaptive scaling): λ_t = mean_i ‖τ_i‖ / ‖M_t‖, θ_t = θ₀ + λ_t M_t.

Other tensors skip the projection (τ' = τ). Norms are per tensor — our choice. State per tensor
(float32): ``norms`` (k,) of ‖τ_i‖, ``lams`` (k,) of λ_i after each fold i, and ``lam`` (1,) = λ_{t−1}
(the last of ``lams``; kept for states written before ``lams``).

Subtract-unmerge of expert j (:meth:`Opcm.drop_from_state`) drops its ‖τ_j‖ and λ_j. Removing the
most recent fold t restores θ_{t−1} byte for byte, and λ_{t−1} with it, so the next fold is the one
that would have followed without it. Removing an earlier fold keeps λ of the latest fold: the
backbone θ − Δ_j is then no fold's output and M = Δ/λ only an approximation (the paper has no
unmerge; ``replay`` gives the "never merged" model) — our choice. Either way the running mean of
‖τ‖ covers exactly the remaining experts. A state written before ``lams`` existed gives λ back only
when one fold remains (λ₁ = 1: M₁ = τ₁); otherwise its ``lam`` stays as it was.
"""

from __future__ import annotations

import torch
from pydantic import Field

from .base import Policy, PolicyParams, Tensor, TensorContext, TensorFold, TensorState


class OpcmParams(PolicyParams):
    alpha: float = Field(0.5, gt=0, le=1, description="energy fraction of M_{t−1}'s dominant singular block")


class Opcm(Policy):
    """OPCM (Tang et al. 2025); see the module docstring."""

    name = "opcm"
    Params = OpcmParams

    def fold_tensor(self, base: Tensor, backbone: Tensor, tau: Tensor, state: TensorState,
                    ctx: TensorContext) -> TensorFold:
        norms = state.get("norms", tau.new_zeros(0))
        norms = torch.cat([norms, norms.new_tensor([float(tau.norm())])])
        if ctx.n_previous == 0 or "lam" not in state or float(state["lam"][0]) == 0.0:
            merged = tau
            prev_delta = None
        else:
            prev_delta = backbone - base
            merged_prev = prev_delta / float(state["lam"][0])
            if tau.ndim == 2 and min(tau.shape) > 1:
                u, s, vh = torch.linalg.svd(merged_prev, full_matrices=False)
                energy = torch.cumsum(s, 0) / s.sum().clamp_min(1e-30)
                r = int(torch.searchsorted(energy, torch.tensor(self.params.alpha, dtype=energy.dtype))) + 1
                ur, vr = u[:, :r], vh[:r].T
                tau = tau - ur @ (ur.T @ tau @ vr) @ vr.T
            merged = merged_prev.add_(tau)
        mnorm = float(merged.norm())
        lam = float(norms.mean()) / mnorm if mnorm > 0 else 0.0
        new_delta = merged.mul_(lam)
        delta = new_delta if prev_delta is None else new_delta.sub_(prev_delta)
        lam_t = norms.new_tensor([lam])
        lams = torch.cat([_lam_history(state, norms.shape[0] - 1, norms), lam_t])
        return TensorFold(delta, {"norms": norms, "lam": lam_t, "lams": lams}, {"lambda": lam})

    def drop_from_state(self, state: TensorState, index: int) -> TensorState:
        """The state without expert ``index``: its ‖τ‖ and its λ are dropped, and ``lam`` becomes
        λ of the latest remaining fold (see the module docstring).

        Args:
            state: ``norms`` (k,), ``lams`` (k,) (absent in older states), ``lam`` (1,); float32.
            index: the removed expert's position in the fold order, 0 ≤ index < k.

        Returns:
            The same fields with k − 1 entries (``lam`` (1,)).
        """
        k = state["norms"].shape[0]
        keep = [i for i in range(k) if i != index]
        out = {**state, "norms": state["norms"][keep]}
        lams = _lam_history(state, k, state["norms"])[keep]
        if "lams" in state:
            out["lams"] = lams
        if not keep:
            return out
        if bool(torch.isfinite(lams[-1])):
            out["lam"] = lams[-1:].clone()
        elif len(keep) == 1:  # an older state: λ₁ = ‖τ₁‖ / ‖M₁‖ with M₁ = τ₁
            out["lam"] = out["norms"].new_tensor([1.0 if float(out["norms"][0]) > 0 else 0.0])
        return out


def _lam_history(state: TensorState, k: int, like: Tensor) -> Tensor:
    """λ after each of the ``k`` folds a state holds, (k,) float32: ``lams``, or for a state written
    before ``lams`` existed NaN (unknown) except the last, which is ``lam``."""
    if "lams" in state:
        return state["lams"]
    hist = like.new_full((k,), float("nan"))
    if k and "lam" in state:
        hist[-1] = state["lam"][0]
    return hist
