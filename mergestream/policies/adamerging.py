"""AdaMerging-style coefficients: per-layer merging weights learned by entropy minimisation.

Source: Yang et al., "AdaMerging: Adaptive Model Merging for Multi-Task Learning", ICLR 2024
(arXiv 2310.02575), §3.2-3.3 (layer-wise AdaMerging): the merged model

    θ(λ)ˡ = θ₀ˡ + Σ_k λ_kˡ τ_kˡ                                              (eq. 4)

has one coefficient per task vector k and layer l, and λ minimises the Shannon entropy of each
task head's predictions on unlabeled inputs of that task (eq. 5; entropy is a surrogate of the
prediction loss, their §3.2):

    min_λ Σ_k  mean_{x ∈ B_k} H(softmax(head_k(f(x; θ(λ))))),   H(p) = −Σ_c p_c log p_c.

Here a "layer" is a block of the tensor names (:func:`~mergestream.policies.lines.layer_index`:
``layer.N`` → group N + 1); tensors outside the blocks (embeddings, final norm, pooler) share
group 0 — our choice. λ is learned with Adam and clamped to ``bounds`` after each step (the paper
clips to [0, 1]); the best iterate seen is returned (never worse than the start).

This module is the math (no I/O, no model classes): a forward function ``f(params) -> features``
is supplied by the caller (e.g. :func:`torch.func.functional_call` of a Hugging Face encoder plus
pooling). The engine's coefficient mode beside ``fixed`` and ``cmaes`` (MDM-OC
``coefficients=adamerging``) is built on it in :mod:`mergestream.engine.coefficients`: one fold learns
its own expert's per-layer λ, with earlier experts at the values the state holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from .base import Tensor
from .lines import layer_index


def prediction_entropy(logits: Tensor) -> Tensor:
    """Mean Shannon entropy (nats) of softmax(logits) over the rows; logits (B, C) → 0-d tensor."""
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1).mean()


def layer_groups(names: Sequence[str]) -> dict[str, int]:
    """Group of each tensor: block index + 1, or 0 outside the blocks (module docstring)."""
    return {n: (0 if (i := layer_index(n)) is None else i + 1) for n in names}


def merge_layerwise(base: Mapping[str, Tensor], taus: Sequence[Mapping[str, Tensor]], coeffs: Tensor,
                    groups: Mapping[str, int]) -> dict[str, Tensor]:
    """θ(λ) = θ₀ + Σ_k λ[k, g(name)] τ_k per tensor (eq. 4), differentiable in ``coeffs``.

    Args:
        base: θ₀ tensors (float). taus: K dicts with the same names (a missing name: τ = 0).
        coeffs: (K, G) float tensor (may require grad). groups: name → group index < G.

    Raises:
        ValueError: ``coeffs`` has another number of rows than there are task vectors, or a group
            index is out of range.
    """
    if coeffs.ndim != 2 or coeffs.shape[0] != len(taus):
        raise ValueError(f"coeffs must be (K={len(taus)}, G), got {tuple(coeffs.shape)}")
    out = {}
    for name, b in base.items():
        g = groups.get(name, 0)
        if not 0 <= g < coeffs.shape[1]:
            raise ValueError(f"tensor {name}: group {g} outside 0..{coeffs.shape[1] - 1}")
        t = b
        for k, tau in enumerate(taus):
            if name in tau:
                t = t + coeffs[k, g] * tau[name]
        out[name] = t
    return out


def entropy_objective(forward: Callable[[dict[str, Tensor], object], Tensor], base: Mapping[str, Tensor],
                      taus: Sequence[Mapping[str, Tensor]], groups: Mapping[str, int],
                      heads: Sequence[tuple[Tensor, Tensor]], batches: Sequence[object]) -> Callable[[Tensor], Tensor]:
    """The eq. 5 objective as a function of λ (K, G).

    Args:
        forward: ``forward(params, batch) -> features (B, D)`` of the model with those parameters.
        heads: per task k, (weight (C_k, D), bias (C_k,)) of its classification head.
        batches: per task k, its unlabeled inputs as ``forward`` takes them.

    Returns:
        λ ↦ Σ_k mean entropy of head_k on batch_k (0-d tensor, differentiable in λ).
    """
    if len(heads) != len(batches):
        raise ValueError(f"{len(heads)} heads but {len(batches)} batches")

    def objective(coeffs: Tensor) -> Tensor:
        params = merge_layerwise(base, taus, coeffs, groups)
        total = coeffs.new_zeros(())
        for (w, b), batch in zip(heads, batches):
            total = total + prediction_entropy(forward(params, batch) @ w.T + b)
        return total

    return objective


def adamerging_coefficients(objective: Callable[[Tensor], Tensor], start: Tensor, *, steps: int = 100,
                            lr: float = 1e-3, bounds: tuple[float, float] = (0.0, 1.0)) -> tuple[Tensor, list[float]]:
    """Learn λ by Adam on ``objective`` (entropy, eq. 5), clamped to ``bounds`` after each step.

    Args:
        objective: λ (same shape as ``start``) → 0-d tensor, differentiable.
        start: the starting λ (e.g. Task Arithmetic's 0.3 everywhere); not modified.
        steps: Adam steps; 0 returns ``start`` (a copy) and its loss.

    Returns:
        (the best λ seen, detached; the loss before each step and after the last: ``steps`` + 1
        values). The best is the start unless a step lowered the loss.
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    lam = start.detach().clone().requires_grad_(True)
    opt = torch.optim.Adam([lam], lr=lr)
    history: list[float] = []
    best, best_loss = start.detach().clone(), float("inf")
    with torch.enable_grad():
        for _ in range(steps + 1):
            loss = objective(lam)
            value = float(loss.detach())
            history.append(value)
            if value < best_loss:
                best, best_loss = lam.detach().clone(), value
            if len(history) > steps:
                break
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                lam.clamp_(*bounds)
    return best, history
