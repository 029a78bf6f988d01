"""OPCM: orthogonal projection-based continual merging (Tang et al., arXiv 2501.09522).

A peer for the benchmark. Per 2-D weight, with the unscaled merged task vector
M_{t−1} = Δ_{t−1} / λ_{t−1} (paper §4.1-4.2):

1. SVD M_{t−1} = U S Vᵀ; the dominant block is the first r singular pairs, r the smallest rank
   whose singular values hold a fraction ``alpha`` of their sum (our reading of the paper's α);
2. project the incoming τ off that block: τ' = τ − U_r (U_rᵀ τ V_r) V_rᵀ (the paper zeroes the
   block's entries of Uᵀ τ V);
3. M_t = M_{t−1} + τ', rescaled so that the merged task vector's norm is the running mean of the
   experts' ‖τ‖ (adaptive scaling): λ_t = mean_i ‖τ_i‖ / ‖M_t‖, θ_t = θ₀ + λ_t M_t.

Other tensors skip the projection (τ' = τ). Norms are per tensor — our choice.

Conventions of the reference (FusionBench 0.2.33's ``opcm_general.OPCM``, by the paper's authors;
``reference_params``, checked by tests/test_conformance.py), each a parameter:

- ``scope``: ``tensor`` (ours, default) rescales each tensor by its own norms; ``global``
  (reference) uses one λ_t for the whole model, the mean of the experts' whole-model ‖τ‖ over the
  whole-model ‖M_t‖. A global λ needs every tensor's M_t before any is written, so the fold runs
  in two steps: each tensor's M_t goes into the state (one float32 copy of the model, replaced at
  each fold), then the engine takes λ_t from the state's norms (:meth:`Opcm.global_scale`) and
  writes θ₀ + λ_t M_t (:meth:`Opcm.rebuild`); λ_t is the fold's recorded coefficient. ``subtract``
  unmerge is refused in this scope (``replay`` only), and an offline ``merge`` too.
- ``zero_diagonal``: also remove the diagonal of Uᵀ τ V beyond the block (every u_iᵀ τ v_i, i ≥ r),
  as the reference does (undocumented in the paper); default off.
- ``rank``: ``cover`` (ours, default) r = the smallest rank whose singular values hold ≥ α of
  their sum; ``above`` (reference) r = the number of ranks whose share is ≤ α (one pair fewer).
- ``project``: ``matrices`` (ours, default) projects every 2-D tensor; ``linear`` (reference)
  leaves embedding matrices and a tied LM head unprojected (FusionBench projects ``nn.Linear``
  weights only).

Our defaults are the ones measured on the quality benchmark (bench/results/quality.md); the
reference's conventions have not been run there. State per tensor
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

from collections.abc import Iterable
from typing import Literal

import torch
from pydantic import Field

from ..errors import PolicyError
from .base import Policy, PolicyParams, Tensor, TensorContext, TensorFold, TensorState


class OpcmParams(PolicyParams):
    alpha: float = Field(0.5, gt=0, le=1, description="energy fraction of M_{t−1}'s dominant singular block")
    scope: Literal["tensor", "global"] = Field("tensor", description="norm rescale per tensor (ours) or whole model (reference)")
    zero_diagonal: bool = Field(False, description="also remove the diagonal of Uᵀ τ V beyond the block (reference)")
    rank: Literal["cover", "above"] = Field("cover", description="block: ranks reaching α (ours) or one fewer (reference)")
    project: Literal["matrices", "linear"] = Field("matrices", description="project every 2-D tensor (ours) or not embeddings (reference)")


def block_rank(s: Tensor, alpha: float, rule: str) -> int:
    """The size r of the dominant singular block of singular values ``s`` (descending, (k,)).

    ``cover``: the smallest r with Σ_{i≤r} s_i ≥ α Σ s; ``above``: the number of i with
    Σ_{j≤i} s_j ≤ α Σ s (the reference's argmax(share > α)).
    """
    energy = torch.cumsum(s, 0) / s.sum().clamp_min(1e-30)
    if rule == "above":
        over = energy > alpha
        return int(over.to(torch.int8).argmax()) if bool(over.any()) else 0
    return int(torch.searchsorted(energy, torch.tensor(alpha, dtype=energy.dtype))) + 1


def project_off(tau: Tensor, merged_prev: Tensor, p: OpcmParams) -> Tensor:
    """τ' = τ without its components on M_{t−1}'s dominant block (and the diagonal, with
    ``zero_diagonal``): step 2 of the module docstring. Float32 (m, n) in, float32 (m, n) out."""
    u, s, vh = torch.linalg.svd(merged_prev, full_matrices=False)
    r = block_rank(s, p.alpha, p.rank)
    ur, vr = u[:, :r], vh[:r].T
    out = tau - ur @ (ur.T @ tau @ vr) @ vr.T
    if p.zero_diagonal and r < s.shape[0]:
        ud, vd = u[:, r:], vh[r:].T
        diag = ((ud.T @ tau) * vd.T).sum(1)  # u_iᵀ τ v_i, i ≥ r
        out -= (ud * diag) @ vd.T
    return out


class Opcm(Policy):
    """OPCM (Tang et al. 2025); see the module docstring."""

    name = "opcm"
    strength_param = "alpha"
    strength_grid = (0.3, 0.5, 0.7, 0.9)
    Params = OpcmParams
    reference_params = {"scope": "global", "zero_diagonal": True, "rank": "above", "project": "linear"}

    def __init__(self, params: dict | OpcmParams | None = None):
        """Parameters as :class:`OpcmParams`; ``scope=global`` narrows the unmerge to ``replay``."""
        super().__init__(params)
        if self.params.scope == "global":  # the state holds M_t: the fold's contribution is not kept
            self.subtract_unmerge = False
            self.contributions_in_state = True

    def scales_globally(self) -> bool:
        """Capability: the fold writes θ₀ + λ_t M_t after its pass, λ_t from :meth:`global_scale`."""
        return self.params.scope == "global"

    def scale_partial(self, state: TensorState) -> list[float]:
        """This tensor's share of λ_t (``scope=global``): ``[‖M_t‖², ‖τ_1‖², …, ‖τ_t‖²]`` in float64.

        Args:
            state: the tensor's new state: ``tau_sq`` (t,) ‖τ_i‖² of this tensor per fold, ``merged``
                M_t (float32, its shape).
        """
        return [float(state["merged"].double().square().sum()), *state["tau_sq"].double().tolist()]

    def finish_scale(self, partials: Iterable[list[float]]) -> float:
        """λ_t = mean_i ‖τ_i‖ / ‖M_t‖ over the whole model (``scope=global``; Tang et al. 2025,
        OPCM, the reference's single norm rescale), the norms summed over tensors in θ₀'s order.

        Returns:
            λ_t (0.0 for M_t = 0).
        """
        tau_sq: list[float] | None = None
        m_sq = 0.0
        for part in partials:
            m_sq += part[0]
            tau_sq = list(part[1:]) if tau_sq is None else [a + b for a, b in zip(tau_sq, part[1:])]
        if tau_sq is None or m_sq == 0.0:
            return 0.0
        return float(torch.tensor(tau_sq, dtype=torch.float64).sqrt().mean()) / m_sq ** 0.5

    def rebuild(self, base: Tensor, state: TensorState, coefficients: list[float]) -> Tensor | None:
        """θ_t = θ₀ + λ_t M_t (``scope=global``; λ_t the last coefficient), else None."""
        if self.params.scope != "global":
            return None
        return base + coefficients[-1] * state["merged"]

    def merge_tensor(self, base: Tensor, taus: list[Tensor], ctx: TensorContext) -> Tensor:
        """Offline merge by folding in memory (per-tensor scope only).

        Raises:
            PolicyError: ``scope=global`` (the global λ needs the whole model: fold instead).
        """
        if self.params.scope == "global":
            raise PolicyError("opcm with scope=global rescales the whole model at once: fold the experts one "
                              "by one (mergestream fold) instead of merge")
        return super().merge_tensor(base, taus, ctx)

    def _fold_global(self, base: Tensor, backbone: Tensor, tau: Tensor, state: TensorState,
                     ctx: TensorContext) -> TensorFold:
        """``scope=global``: M_t = M_{t−1} + τ' into the state, Δ_t from λ_t written by the engine."""
        if ctx.n_previous and "merged" not in state:
            raise PolicyError(f"opcm scope=global: the state of {ctx.name} was written with scope=tensor; "
                              "a stream keeps its scope (start a new state)")
        tau_sq = torch.cat([state.get("tau_sq", tau.new_zeros(0)), tau.new_tensor([float(tau.double().square().sum())])])
        if "merged" not in state:
            merged = tau.clone()
        else:
            merged_prev = state["merged"]
            if tau.ndim == 2 and min(tau.shape) > 1 and not (self.params.project == "linear" and ctx.is_embedding):
                tau = project_off(tau, merged_prev, self.params)
            merged = merged_prev + tau
        return TensorFold(torch.zeros_like(tau), {"tau_sq": tau_sq, "merged": merged})

    def fold_tensor(self, base: Tensor, backbone: Tensor, tau: Tensor, state: TensorState,
                    ctx: TensorContext) -> TensorFold:
        if self.params.scope == "global":
            return self._fold_global(base, backbone, tau, state, ctx)
        if "merged" in state:
            raise PolicyError(f"opcm scope=tensor: the state of {ctx.name} was written with scope=global; "
                              "a stream keeps its scope (start a new state)")
        norms = state.get("norms", tau.new_zeros(0))
        norms = torch.cat([norms, norms.new_tensor([float(tau.norm())])])
        if ctx.n_previous == 0 or "lam" not in state or float(state["lam"][0]) == 0.0:
            merged = tau
            prev_delta = None
        else:
            prev_delta = backbone - base
            merged_prev = prev_delta / float(state["lam"][0])
            if tau.ndim == 2 and min(tau.shape) > 1 and not (self.params.project == "linear" and ctx.is_embedding):
                tau = project_off(tau, merged_prev, self.params)
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
