"""Continual weight averaging: the running uniform mean of the experts' weights.

Source: the uniform soup of Wortsman et al., "Model soups", ICML 2022 (arXiv 2203.05482), §3
(θ = (1/k) Σᵢ θᵢ), in the continual form of FusionBench's ``method/opcm/weight_average.py`` (the
baseline of the OPCM paper, Tang et al., arXiv 2501.09522, Table 1 "Weight Averaging"):
θ₁ = θ_expert,1 and θ_t = ((t − 1)·θ_{t−1} + θ_expert,t) / t. In task vectors,
Δ_t = (τ − (θ_{t−1} − θ₀)) / t, so after t folds θ_t − θ₀ = (1/t) Σ_{i≤t} τ_i: Task Arithmetic with
λ = 1/t, which shrinks as the stream grows. No parameters and no state: the fold count comes from
the state manifest (``ctx.n_previous``), the merged task vector from the backbone. Subtract-unmerge
of the latest fold restores θ_{t−1} exactly (the engine's stored residual); ``replay`` gives the
mean of the others.
"""

from __future__ import annotations

from .base import Policy, PolicyParams, Tensor, TensorContext, TensorFold, TensorState


class WeightAverageParams(PolicyParams):
    """No parameters: the weight of each expert is 1/t."""


class WeightAverage(Policy):
    """Continual uniform weight averaging (Wortsman et al. 2022, §3); see the module docstring."""

    name = "weight_average"
    Params = WeightAverageParams
    reference_params = {}

    def fold_tensor(self, base: Tensor, backbone: Tensor, tau: Tensor, state: TensorState,
                    ctx: TensorContext) -> TensorFold:
        """Δ_t = (τ − (θ_{t−1} − θ₀)) / t with t = ``ctx.n_previous`` + 1 (float32, τ's shape)."""
        t = ctx.n_previous + 1
        if t == 1:
            return TensorFold(tau)
        return TensorFold(tau.sub_(backbone).add_(base).div_(t))
