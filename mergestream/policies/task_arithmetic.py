"""Task Arithmetic, TIES and MagMax: one generalized task-arithmetic family.

All three compute a merged task vector τ_m from the inputs and set θ = θ₀ + λ·τ_m; they differ in
the sparsification (trim to the top-k% magnitudes, or none) and the consensus (plain sum, sign
election + disjoint mean, or element-wise max |τ|).

- Task Arithmetic: Ilharco et al., "Editing Models with Task Arithmetic", ICLR 2023
  (arXiv 2212.04089), eq. 1: θ = θ₀ + λ Σᵢ τᵢ.
- TIES-Merging: Yadav et al., NeurIPS 2023 (arXiv 2306.01708), §3 steps 1-3 (trim, elect sign,
  disjoint merge).
- MagMax: Marczak et al., ECCV 2024 (arXiv 2407.06322), §3: per entry, the task-vector value of
  largest magnitude.

Continual forms (one expert at a time): Δ_{t−1}/λ is treated as one task vector weighted by the
number n of experts it holds, τ as the other. For TA this is exactly the offline sum; for MagMax
it is exact as well (max is associative); for TIES it is an approximation of offline TIES (the
earlier experts' trimmed entries are re-trimmed as one vector) — our choice, per METHODS.md.

Conventions of the reference implementation (FusionBench 0.2.33, checked by
tests/test_conformance.py; ``reference_params`` of each class):

- MagMax ``tie``: on an exact tie of magnitudes the later expert wins (``last``, the authors'
  released code, our default) or the earlier one stays (``first``).
- TIES ``continual``: ``merged`` (ours, default) re-merges θ₀ + λ·TIES(Δ_{t−1}/λ with weight n, τ);
  ``accumulate`` (FusionBench's continual TIES) adds λ·TIES(Δ_{t−1}, τ) onto θ_{t−1}, the first fold
  being λ·τ untrimmed, and elects a zero sign sum by the tensor's majority sign.
  ``disjoint``: the disjoint ``mean`` (the paper's, default) or ``sum`` (the reference's continual
  setting). ``trim``: keep int(k%·n) entries (``floor``, default) or int(k%·n) + 1 (``plus_one``, the
  reference's kthvalue threshold). The reference trims over the whole flattened model; we trim per
  tensor (a streaming fold never holds the whole model): the two agree on one-tensor models only.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from .base import Policy, PolicyParams, Tensor, TensorContext, TensorFold, TensorState
from .masks import top_mask


def trim_top_k(tau: Tensor, k_percent: float, *, inplace: bool = False, extra: int = 0) -> Tensor:
    """Keep the ``int(k/100 · numel) + extra`` entries of largest |τ| (exactly), zero the rest (TIES step 1).

    The selection is :func:`.masks.top_mask` (a sampled bracket around the threshold, never a sort
    or a full top-k of a large tensor). Temporaries: |τ| (freed after the selection) and boolean
    masks.

    Args:
        tau: float tensor of any shape.
        k_percent: keep ratio in percent, 0..100; 100 returns τ unchanged.
        inplace: zero τ's own entries instead of returning a new tensor.
        extra: entries kept beyond int(k/100 · numel) (1: the reference's count, ``trim=plus_one``).

    Returns:
        τ's shape and dtype: τ itself when ``inplace``, else a new tensor.
    """
    out = tau if inplace else tau.clone()
    if k_percent >= 100:
        return out
    flat = out.reshape(-1)
    keep = min(int(k_percent / 100.0 * flat.numel()) + extra, flat.numel())
    if keep <= 0:
        return out.zero_()
    return out.mul_(top_mask(flat.abs(), keep).view_as(out))


def elect_sign(trimmed: list[Tensor], weights: list[float]) -> Tensor:
    """TIES step 2: per entry, the sign of Σ wᵢ·τᵢ (a zero sum elects +1, as PEFT and TIES do).

    Returns:
        float32 tensor of ±1 of the inputs' shape.
    """
    total = torch.zeros_like(trimmed[0])
    for t, w in zip(trimmed, weights):
        total.add_(t, alpha=w)
    return torch.where(total >= 0, 1.0, -1.0).to(total.dtype)


def disjoint_mean(trimmed: list[Tensor], weights: list[float], sign: Tensor) -> Tensor:
    """TIES step 3: weighted mean of the non-zero values that agree with the elected sign.

    An entry where no value agrees gives 0 (never NaN). Accumulates in the inputs' dtype
    (float32 in the engine), so large fp16 deltas cannot overflow.
    """
    num = torch.zeros_like(trimmed[0])
    den = torch.zeros_like(trimmed[0])
    for t, w in zip(trimmed, weights):
        agree = (torch.sign(t) == sign).to(t.dtype)
        num.add_(t * agree, alpha=w)
        den.add_(agree, alpha=w)
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(den.dtype).tiny), torch.zeros_like(num))


def max_magnitude(values: list[Tensor], tie: str = "last") -> Tensor:
    """MagMax: per entry, the value of largest magnitude; on an exact tie the later value wins
    (``tie="last"``, the authors' code) or the earlier one stays (``"first"``)."""
    out = values[0].clone()
    for v in values[1:]:
        out = torch.where(v.abs() >= out.abs() if tie == "last" else v.abs() > out.abs(), v, out)
    return out


def ties_accumulate(prev: Tensor, tau: Tensor, mean: bool = False) -> Tensor:
    """The reference's continual TIES update of two trimmed task vectors: the disjoint sum (or, with
    ``mean``, the mean over the nonzero agreeing values) of the values agreeing with the elected sign
    sign(prev + τ), where a zero sum takes the tensor's majority sign sign(Σ sign(prev + τ)) (and,
    where that is 0 too, negative values agree).

    Args:
        prev, tau: trimmed Δ_{t−1} and τ, float32, same shape.

    Returns:
        float32, their shape.
    """
    sign = torch.sign(prev + tau)
    sign[sign == 0] = torch.sign(sign.sum())
    out = torch.zeros_like(prev)
    count = torch.zeros_like(prev)
    for t in (prev, tau):
        kept = torch.where(torch.where(sign > 0, t > 0, t < 0), t, torch.zeros_like(t))
        out.add_(kept)
        count.add_((kept != 0).to(count.dtype))
    return out.div_(count.clamp_min_(1.0)) if mean else out


def _ties_two(prev_t: Tensor, tau_t: Tensor, n: float, lam: float, backbone: Tensor, base: Tensor) -> Tensor:
    """The continual TIES fold of one expert: Δ_t = λ·τ_m − (θ_{t−1} − θ₀), with τ_m the sign-elected
    disjoint mean (TIES §3 steps 2-3) of the trimmed earlier merge ``prev_t`` (weight n) and the
    trimmed task vector ``tau_t`` (weight 1): the same arithmetic as :func:`elect_sign` and
    :func:`disjoint_mean` on two inputs, written into the two inputs' buffers and one more
    (float32, θ's shape; both inputs are overwritten). Temporaries besides that buffer: boolean
    masks only.
    """
    out = torch.mul(prev_t, n).add_(tau_t)  # n·prev + τ: its sign is the elected one (0 elects +1)
    pos = out >= 0
    agree_p = torch.where(pos, prev_t > 0, prev_t < 0)  # a zero never agrees
    agree_t = torch.where(pos, tau_t > 0, tau_t < 0)
    del pos
    torch.mul(prev_t.mul_(agree_p), n, out=out).add_(tau_t.mul_(agree_t))  # Σ wᵢ·τᵢ over agreeing values
    den = prev_t.copy_(agree_p).mul_(n).add_(agree_t).clamp_min_(1.0)  # Σ wᵢ over them (none: 0/1)
    del agree_p, agree_t
    return out.div_(den).mul_(lam).sub_(backbone).add_(base)


class GeneralizedTaskArithmeticParams(PolicyParams):
    lam: float = Field(0.3, alias="lambda", description="scaling coefficient λ")
    k: float = Field(100.0, ge=0, le=100, description="trim: keep the top-k% magnitudes (100 = no trim)")


class GeneralizedTaskArithmetic(Policy):
    """θ = θ₀ + λ·consensus(trim(τ₁), ..., trim(τ_K)); see the module docstring."""

    consensus: ClassVar[Literal["sum", "ties", "max"]] = "sum"

    def _trim(self, t: Tensor, *, inplace: bool = False) -> Tensor:
        extra = 1 if getattr(self.params, "trim", "floor") == "plus_one" else 0
        return trim_top_k(t, self.params.k, inplace=inplace, extra=extra)

    def _merge(self, taus: list[Tensor], weights: list[float]) -> Tensor:
        k = self.params.k
        if self.consensus == "sum":
            out = torch.zeros_like(taus[0])
            for t, w in zip(taus, weights):
                out.add_(trim_top_k(t, k) if k < 100 else t, alpha=w)
            return out
        trimmed = [self._trim(t) for t in taus]
        if self.consensus == "max":
            return max_magnitude(trimmed, self.params.tie)
        sign = elect_sign(trimmed, weights)
        if self.params.disjoint == "sum":
            return sum(t * (torch.sign(t) == sign) for t in trimmed)
        return disjoint_mean(trimmed, weights, sign)

    def linear_scale(self) -> float | None:
        """λ for Task Arithmetic without trim (Δ_t = λ·τ element-wise); None otherwise."""
        return float(self.params.lam) if self.consensus == "sum" and self.params.k >= 100 else None

    def merge_tensor(self, base: Tensor, taus: list[Tensor], ctx: TensorContext) -> Tensor:
        """Offline K-way: Δ = λ·τ_m with τ_m the consensus of the K (trimmed) task vectors."""
        return self._merge(taus, [1.0] * len(taus)).mul_(self.params.lam)

    def fold_tensor(self, base: Tensor, backbone: Tensor, tau: Tensor, state: TensorState,
                    ctx: TensorContext) -> TensorFold:
        lam = self.params.lam
        n = ctx.n_previous
        if self.consensus == "sum":  # exact: Δ_t = λ·trim(τ)
            if self.params.k < 100:
                tau = trim_top_k(tau, self.params.k, inplace=True)
            return TensorFold(tau.mul_(lam))
        if self.consensus == "ties" and self.params.continual == "accumulate":
            if n == 0:  # the reference's first fold: λ·τ, untrimmed
                return TensorFold(tau.mul_(lam))
            prev = self._trim(backbone - base, inplace=True)  # Δ_{t−1} itself, not divided by λ
            return TensorFold(ties_accumulate(prev, self._trim(tau, inplace=True),
                                              self.params.disjoint == "mean").mul_(lam))
        if n == 0 or lam == 0:
            # one input: sign election and disjoint mean (or max) return the trimmed vector itself,
            # so skip their tensor-sized temporaries (τ is ours to modify: trimmed in place)
            return TensorFold(self._trim(tau, inplace=True).mul_(lam))
        prev = (backbone - base).div_(lam)  # τ_m of the n experts folded so far
        if self.consensus == "max":
            trimmed = self._trim(tau, inplace=True)
            wins = trimmed.abs() >= prev.abs() if self.params.tie == "last" else trimmed.abs() > prev.abs()
            delta = torch.where(wins, trimmed - prev, torch.zeros_like(prev))
            return TensorFold(delta.mul_(lam))
        if self.params.disjoint == "sum":  # Σ of the agreeing values of n·prev and τ, as one merge
            p_t, t_t = self._trim(prev, inplace=True), self._trim(tau, inplace=True)
            sign = torch.where(p_t * n + t_t >= 0, 1.0, -1.0)
            merged = (p_t * n) * (torch.sign(p_t) == sign) + t_t * (torch.sign(t_t) == sign)
            return TensorFold(merged.mul_(lam).sub_(backbone).add_(base))
        # TIES: prev's buffer is trimmed in place and reused (two temporaries)
        return TensorFold(_ties_two(self._trim(prev, inplace=True), self._trim(tau, inplace=True), float(n), lam,
                                    backbone, base))


class TaskArithmetic(GeneralizedTaskArithmetic):
    """Task Arithmetic (Ilharco et al. 2023, eq. 1): Δ_t = λ·τ; default λ = 0.3."""

    name = "task_arithmetic"
    strength_param = "lambda"
    strength_grid = (0.1, 0.15, 0.2, 0.3, 0.5)
    consensus = "sum"
    Params = GeneralizedTaskArithmeticParams
    reference_params = {"lambda": 0.3}


class TiesParams(GeneralizedTaskArithmeticParams):
    lam: float = Field(1.0, alias="lambda", description="scaling coefficient λ")
    k: float = Field(20.0, ge=0, le=100, description="keep the top-k% magnitudes of each task vector")
    continual: Literal["merged", "accumulate"] = Field(
        "merged", description="merged: θ₀ + λ·TIES(Δ/λ weight n, τ) (ours); accumulate: θ_{t−1} + λ·TIES(Δ, τ) (reference)")
    disjoint: Literal["mean", "sum"] = Field("mean", description="disjoint mean (paper) or sum of the agreeing values")
    trim: Literal["floor", "plus_one"] = Field("floor", description="keep int(k%·n) entries, or one more (reference)")


class Ties(GeneralizedTaskArithmetic):
    """TIES-Merging (Yadav et al. 2023, §3): trim to top-k%, elect sign, disjoint mean; ×λ."""

    name = "ties"
    strength_param = "lambda"
    strength_grid = (0.5, 0.7, 1.0, 1.3)
    consensus = "ties"
    Params = TiesParams
    reference_params = {"continual": "accumulate", "disjoint": "sum", "trim": "plus_one", "lambda": 0.5, "k": 20}


class MagMaxParams(GeneralizedTaskArithmeticParams):
    lam: float = Field(0.5, alias="lambda", description="scaling coefficient λ")
    tie: Literal["last", "first"] = Field("last", description="on equal magnitudes the later (authors' code) or earlier expert wins")


class MagMax(GeneralizedTaskArithmetic):
    """MagMax (Marczak et al. 2024, §3): per entry the τ of largest magnitude; ×λ (default 0.5)."""

    name = "magmax"
    strength_param = "lambda"
    strength_grid = (0.15, 0.2, 0.3, 0.5, 0.7)
    consensus = "max"
    Params = MagMaxParams
    reference_params = {"tie": "last", "lambda": 0.5}
