"""Patch budget: each fold changes at most a share ρ of every matrix's entries, the rest is carried.

For fleets: a version-to-version patch (:mod:`mergestream.patches`) is as large as the set of
entries a fold changes. Dense policies (Iso-C, OPCM, Task Arithmetic) change every entry at every
fold, so their patches are as large as the model. This wrapper bounds that, around any policy:

    g_t = Δ'_t + r_{t−1},    Δ_t = top_ρ(g_t),    r_t = g_t − Δ_t,

where Δ'_t is the inner policy's fold, top_ρ keeps the ⌈ρ·n⌉ entries of largest |g_t| of an
n-entry tensor (zero elsewhere; :func:`.masks.top_mask`) and r (the residual, r_0 = 0) is what the budget held back so far.
The inner policy is handed the backbone it would have produced without the budget,
θ_{t−1} + r_{t−1}, so a stateful policy (Iso-C's sum, OPCM's norms) folds exactly as without
the wrapper and the backbone trails the inner policy's by r_t alone: θ_t = θ_t^inner − r_t.
Held-back entries are not lost: they are sent when they grow large enough, at a later fold.

Source: top-k sparsification with error feedback ("memory"), Stich, Cordonnier & Jaggi,
"Sparsified SGD with Memory", NeurIPS 2018 (arXiv 1809.07599), Algorithm 1 (m_{t+1} = m_t + g_t −
top_k(m_t + g_t)); here the "gradient" is each fold's update of the backbone. Our use of it for
patch sizes is our own choice, measured in bench/quality.py (rows ``+budget``).

Scope (our choices): tensors with at least two dimensions; 1-D tensors (biases, norms: a
negligible share of the bytes) are folded in full. Which of several entries tied at the threshold
is sent is unspecified (as for TIES's trim).
The residual is stored in the checkpoint's width (:func:`.iso_c.state_dtype`: one more copy of the
model's matrices in the state). An offline ``merge`` has no versions in between, so it is the
inner policy's merge unchanged. Unmerge: ``replay`` only (the residual mixes the experts), and no
coefficient search or subtract rebuild goes through the wrapper.

Use: the parameter ``patch_budget`` (0 < ρ ≤ 1; 1 is the inner policy unchanged) beside any
policy's own, e.g. ``--set patch_budget=0.2`` or ``policy.params.patch_budget: 0.2``;
:func:`with_budget` is what :func:`~mergestream.policies.make_policy` calls when it is present.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from pydantic import Field

from ..errors import PolicyError
from .base import Policy, PolicyParams, Tensor, TensorContext, TensorFold, TensorState, Wrapper
from .iso_c import state_dtype
from .masks import top_mask

_KEY = "budget_residual"


class BudgetParams(PolicyParams):
    patch_budget: float = Field(gt=0, le=1, allow_inf_nan=False,
                                description="share ρ of a matrix's entries one fold may change "
                                            "(0 < ρ ≤ 1; the rest is carried to later folds)")


class PatchBudget(Wrapper):
    """Any policy with a per-fold patch budget; see the module docstring. ``name``, parameters and
    capabilities are the inner policy's (``describe`` adds ``patch_budget``)."""

    Own = BudgetParams
    label = "with a patch budget"

    def __init__(self, inner: Policy, params: dict[str, Any] | BudgetParams):
        super().__init__(inner, params)
        self.budget: BudgetParams = self.own  # type: ignore[assignment]
        if not self.is_identity():  # ρ = 1 keeps the inner policy's capabilities (Wrapper)
            self.contributions_in_state = False  # type: ignore[misc]
            self.subtract_unmerge = False  # type: ignore[misc]
            self.no_subtract_reason = "its patch budget's residual mixes the experts (patch_budget < 1)"
            if inner.scales_globally():
                raise PolicyError(f"policy {inner.name}: a patch budget cannot wrap a whole-model rescale "
                                  "(scope=global)")
            if inner.searches_coefficients():
                raise PolicyError(f"policy {inner.name}: a patch budget cannot wrap a coefficient search "
                                  f"({inner.searches_coefficients()}): it rebuilds the backbone from state")

    def is_identity(self) -> bool:
        """ρ = 1: every fold is the inner policy's, byte for byte."""
        return self.budget.patch_budget >= 1.0

    def linear_scale(self) -> float | None:
        """The inner λ only at ρ = 1 (otherwise the fold depends on the carried residual)."""
        return self.inner.linear_scale() if self.is_identity() else None

    def searches_coefficients(self) -> str | None:
        """The inner policy's search at ρ = 1; refused at construction otherwise."""
        return self.inner.searches_coefficients() if self.is_identity() else None

    def scales_globally(self) -> bool:
        """The inner policy's at ρ = 1; refused at construction otherwise."""
        return self.inner.scales_globally() if self.is_identity() else False

    def scale_partial(self, state: TensorState) -> list[float]:
        """The inner policy's (only reached at ρ = 1)."""
        return self.inner.scale_partial(state)

    def finish_scale(self, partials) -> float:
        """The inner policy's (only reached at ρ = 1)."""
        return self.inner.finish_scale(partials)

    def fold_tensor(self, base: Tensor, backbone: Tensor, tau: Tensor, state: TensorState,
                    ctx: TensorContext) -> TensorFold:
        """Δ_t = top_ρ(Δ'_t + r_{t−1}) with Δ'_t the inner fold on θ_{t−1} + r_{t−1} (module docstring).

        Args:
            base / backbone / tau: θ₀, θ_{t−1}, τ; float32, shape S.
            state: the inner policy's state plus ``budget_residual`` (S, in the checkpoint's width) once
                a fold held something back.

        Returns:
            :class:`TensorFold` with Δ_t (float32, S; zero outside the kept entries), the inner state
            and the new residual; stats gain ``budget_kept`` (share of entries changed).
        """
        if self.is_identity() or tau.ndim < 2:  # never holds anything back
            return self.inner.fold_tensor(base, backbone, tau, state, ctx)
        inner_state = {k: v for k, v in state.items() if k != _KEY}
        residual = state.get(_KEY)
        if residual is not None:
            backbone = backbone + residual.to(torch.float32)
        res = self.inner.fold_tensor(base, backbone, tau, inner_state, ctx)
        g = res.full_delta()
        g = g + residual.to(torch.float32) if residual is not None else g.clone()
        n = g.numel()
        keep = top_mask(g.abs(), min(n, math.ceil(self.budget.patch_budget * n)))
        delta = torch.where(keep, g, torch.zeros((), dtype=g.dtype))
        held = g.masked_fill_(keep, 0.0)
        stats = {**res.stats, "budget_kept": float(keep.sum()) / max(keep.numel(), 1)}
        return TensorFold(delta, {**res.state, _KEY: held.to(state_dtype(ctx.dtype))}, stats)

    def offline(self) -> Policy:
        """The inner policy: an offline merge has no versions in between, so no budget to apply or
        record (its card and metadata name the inner policy's parameters only)."""
        return self.inner.offline()

    def merge_tensor(self, base: Tensor, taus: list[Tensor], ctx: TensorContext) -> Tensor:
        """The inner policy's offline merge (one output, no patches in between)."""
        return self.inner.merge_tensor(base, taus, ctx)

    def contribution(self, state: TensorState, index: int, coefficient: float | None,
                     shape: torch.Size) -> Tensor | None:
        """The inner contribution at ρ = 1; None otherwise (nothing rebuilds through the budget)."""
        if not self.is_identity():
            return None
        return self.inner.contribution(state, index, coefficient, shape)

    def drop_from_state(self, state: TensorState, index: int) -> TensorState:
        """The inner policy's (subtract unmerge reaches this only at ρ = 1)."""
        return self.inner.drop_from_state(state, index)

    def rebuild(self, base: Tensor, state: TensorState, coefficients: list[float]) -> Tensor | None:
        """The inner rebuild at ρ = 1; None otherwise."""
        return self.inner.rebuild(base, state, coefficients) if self.is_identity() else None


def split_budget_params(params: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the other parameters, ``{"patch_budget": ρ}`` or ``{}``) of a parameter dict."""
    own = dict(params or {})
    budget = {k: own.pop(k) for k in list(own) if k == "patch_budget"}
    return own, budget


def is_budgeted(params: dict[str, Any] | None) -> bool:
    """Whether a parameter dict sets a ``patch_budget`` below 1 (ρ = 1 is the inner policy unchanged)."""
    return float((params or {}).get("patch_budget", 1)) < 1


def with_budget(inner: Policy, budget: dict[str, Any]) -> Policy:
    """``inner`` wrapped in :class:`PatchBudget` (``budget`` non-empty), else ``inner`` itself.

    Raises:
        PolicyError: ``patch_budget`` out of range, or an inner policy it cannot wrap.
    """
    return PatchBudget(inner, budget) if budget else inner
