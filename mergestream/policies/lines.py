"""LiNeS: layer-increasing network scaling of the merged update, as a wrapper around any policy.

Source: Wang et al., "LiNeS: Post-training Layer Scaling Prevents Forgetting and Enhances Model
Merging", ICLR 2025 (arXiv 2410.17146), eq. 2: the task vector of layer ℓ ∈ {1..L} is scaled by

    λ(ℓ) = α + β (ℓ − 1)/(L − 1),

so shallow layers stay near θ₀ (general features kept) and deep layers take the update.

Here the scaled vector is the inner policy's merged task vector after every fold:
θ_t − θ₀ = λ(ℓ)·M_t. The wrapper hands the inner policy the backbone it would have produced
without scaling, θ₀ + (θ_{t−1} − θ₀)/λ(ℓ), so stateful policies (OPCM's norms, DOP's subspaces,
MDM-OC's directions) see their own merge, and returns λ(ℓ)·Δ'_t as the fold (exact algebra:
λ M_{t−1} + λ Δ' = λ M_t). A scale of exactly 1 returns the inner fold untouched (byte-equal).

Use: the parameters ``lines_alpha`` (α > 0), ``lines_beta`` (β ≥ 0, so λ is monotone in depth)
and ``lines_layers`` (L, the number of blocks; 0, the default, counts them from θ₀'s tensor names)
beside any policy's own, e.g. ``--set lines_alpha=0.5 --set lines_beta=0.5``; :func:`with_lines` is what
:func:`~mergestream.policies.make_policy` calls when such keys are present.

Depth from the tensor name (our choice): the first ``layer.N`` / ``layers.N`` / ``h.N`` /
``block(s).N`` component gives ℓ = N + 1 (N must be < L). Tensors outside the blocks: embeddings
(``ctx.is_embedding`` or "embed" in the name, including a tied LM head) take λ = α, like the
shallowest layer; everything else (final norm, pooler, untied heads) takes λ = α + β, like the
deepest.

State: the inner policy's, plus ``lines_scale`` (1,) float32 where λ ≠ 1, so contributions and
rebuilds from state (MDM-OC's unmerge and CMA-ES) are scaled as the fold was.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from pydantic import Field

from ..errors import PolicyError
from .base import Policy, PolicyParams, Tensor, TensorContext, TensorFold, TensorState, Wrapper

_LAYER = re.compile(r"(?:^|\.)(?:layers?|h|blocks?)\.(\d+)(?:\.|$)")
_KEY = "lines_scale"


class LinesParams(PolicyParams):
    lines_alpha: float = Field(gt=0, description="λ of the shallowest layer (α > 0)")
    lines_beta: float = Field(0.0, ge=0, description="λ grows by β from the first to the last layer")
    lines_layers: int = Field(0, ge=0, description="L, the number of blocks (layer.0 .. layer.L-1); "
                                                   "0: the model's, counted from θ₀'s tensor names")


def layer_index(name: str) -> int | None:
    """The block index N of a tensor name (``encoder.layer.3.attn.w`` → 3), or None outside blocks."""
    m = _LAYER.search(name)
    return int(m[1]) if m else None


def block_count(names) -> int:
    """The number of blocks of a model: 1 + the largest block index among its tensor names (0 if none)."""
    return max((i + 1 for i in map(layer_index, names) if i is not None), default=0)


def lines_scale(name: str, params: LinesParams, *, is_embedding: bool = False, n_blocks: int = 0) -> float:
    """λ for one tensor (module docstring); L is ``params.lines_layers``, or ``n_blocks`` (the model's
    block count) when that is 0.

    Raises:
        PolicyError: the name's block index is ≥ L, or L is unknown (0) for a tensor inside a block.
    """
    a, b = params.lines_alpha, params.lines_beta
    n_layers = params.lines_layers or n_blocks
    idx = layer_index(name)
    if idx is None:
        return a if is_embedding or "embed" in name else a + b
    if idx >= n_layers:
        raise PolicyError(f"tensor {name} is in block {idx} but lines_layers={n_layers}: set lines_layers to the "
                          "model's number of blocks (or 0 to count them from θ₀'s tensor names)")
    return a + b * idx / max(n_layers - 1, 1)


def _strip(state: TensorState) -> tuple[TensorState, float]:
    if _KEY not in state:
        return state, 1.0
    return {k: v for k, v in state.items() if k != _KEY}, float(state[_KEY][0])


class Lines(Wrapper):
    """Any policy with LiNeS scaling; see the module docstring. ``name``, parameters and
    capabilities are the inner policy's (``describe`` adds the ``lines_*`` keys)."""

    Own = LinesParams
    label = "with LiNeS"

    def __init__(self, inner: Policy, params: dict[str, Any] | LinesParams):
        super().__init__(inner, params)
        self.lines: LinesParams = self.own  # type: ignore[assignment]
        if inner.scales_globally():
            raise PolicyError(f"policy {inner.name}: LiNeS cannot wrap a whole-model rescale (scope=global)")

    def is_identity(self) -> bool:
        """λ = 1 for every tensor (α = 1, β = 0)."""
        return self.lines.lines_alpha == 1.0 and self.lines.lines_beta == 0.0

    def linear_scale(self) -> float | None:
        """The inner λ only when LiNeS is the identity (otherwise the scale varies per tensor)."""
        return self.inner.linear_scale() if self.is_identity() else None

    def searches_coefficients(self) -> bool:
        """The inner policy's capability (CMA-ES rebuilds go through :meth:`rebuild`, scaled)."""
        return self.inner.searches_coefficients()

    def fold_tensor(self, base: Tensor, backbone: Tensor, tau: Tensor, state: TensorState,
                    ctx: TensorContext) -> TensorFold:
        """λ(ℓ)·Δ' with Δ' the inner fold on the unscaled backbone θ₀ + (θ_{t−1} − θ₀)/λ(ℓ)."""
        s = lines_scale(ctx.name, self.lines, is_embedding=ctx.is_embedding, n_blocks=ctx.n_blocks)
        inner_state, _ = _strip(state)
        if s == 1.0:
            return self.inner.fold_tensor(base, backbone, tau, inner_state, ctx)
        unscaled = (backbone - base).div_(s).add_(base)
        res = self.inner.fold_tensor(base, unscaled, tau, inner_state, ctx)
        del unscaled
        new_state = {**res.state, _KEY: torch.tensor([s], dtype=torch.float32)}
        return TensorFold(res.delta, new_state, res.stats, scale=res.scale * s)

    def merge_tensor(self, base: Tensor, taus: list[Tensor], ctx: TensorContext) -> Tensor:
        """λ(ℓ) times the inner policy's offline merge."""
        s = lines_scale(ctx.name, self.lines, is_embedding=ctx.is_embedding, n_blocks=ctx.n_blocks)
        out = self.inner.merge_tensor(base, taus, ctx)
        return out if s == 1.0 else out.mul_(s)

    def contribution(self, state: TensorState, index: int, coefficient: float | None,
                     shape: torch.Size) -> Tensor | None:
        """The inner contribution rebuilt from state, times the λ(ℓ) its fold used."""
        inner_state, s = _strip(state)
        c = self.inner.contribution(inner_state, index, coefficient, shape)
        return c if c is None or s == 1.0 else c.mul_(s)

    def drop_from_state(self, state: TensorState, index: int) -> TensorState:
        """The inner policy's state without expert ``index``; ``lines_scale`` kept."""
        inner_state, _ = _strip(state)
        out = self.inner.drop_from_state(inner_state, index)
        return {**out, _KEY: state[_KEY]} if _KEY in state else out

    def rebuild(self, base: Tensor, state: TensorState, coefficients: list[float]) -> Tensor | None:
        """θ₀ + λ(ℓ)·(the inner rebuild − θ₀), or None where the inner policy cannot rebuild."""
        inner_state, s = _strip(state)
        r = self.inner.rebuild(base, inner_state, coefficients)
        return r if r is None or s == 1.0 else r.sub_(base).mul_(s).add_(base)


def split_lines_params(params: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the policy's own parameters, the ``lines_*`` ones) of a parameter dict."""
    own = dict(params or {})
    lines = {k: own.pop(k) for k in list(own) if k.startswith("lines_")}
    return own, lines


def with_lines(inner: Policy, lines: dict[str, Any]) -> Policy:
    """``inner`` wrapped in :class:`Lines` (``lines`` non-empty), else ``inner`` itself.

    Raises:
        PolicyError: a ``lines_*`` parameter is unknown, missing or out of range.
    """
    return Lines(inner, lines) if lines else inner
