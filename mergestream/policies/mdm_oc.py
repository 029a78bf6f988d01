"""MDM-OC: orthogonal deltas, reversible merging (Khan et al., arXiv 2507.20997).

Per tensor (METHODS.md §mdm_oc):

1. δ⊥ = τ − Σⱼ ⟨τ, qⱼ⟩ qⱼ over the stored orthonormal directions qⱼ of earlier experts (modified
   Gram–Schmidt, re-orthogonalised once): the projection onto the null space of the stored basis,
   so ⟨δᵢ⊥, δⱼ⊥⟩ = 0 for i ≠ j (paper §3.1, eq. 3-4).
2. Factored form (``rank`` > 0, 2-D weights): each direction is kept as rank-r factors
   δⱼ = Lⱼ Rⱼᵀ with Rⱼ (n × r) orthonormal and all R's mutually orthogonal: τ is projected out of
   the union of the earlier right subspaces, τ' = τ (I − R Rᵀ), and truncated to its top-r SVD.
   Frobenius orthogonality follows from RᵢᵀRⱼ = 0 (paper §3.3, scalable form); state
   O(k·(m+n)·r) instead of O(k·m·n). The truncation drops τ's energy outside its top r directions
   — our choice of the subspace variant (right side).
3. θ = θ₀ + Σ αᵢ δᵢ⊥ (eq. 5). Coefficients fixed (α = ``alpha``) or optimised with CMA-ES over all α
   jointly with a quadratic stability penalty on moving earlier α (eq. 7, the EWC-style term):
   see :func:`cmaes_coefficients`. Or per layer (``coefficients=adamerging``): the new direction
   gets one α per layer group, learned by entropy minimisation on unlabeled inputs
   (:mod:`.adamerging`, run by the engine, :mod:`mergestream.engine.coefficients`); earlier experts keep
   theirs. ``layer_alphas`` folds with given per-layer α (what replay of such a fold uses).
4. Unmerge expert k: θ − α_k δ_k⊥ (exact up to rounding); the state drops direction k.

State per tensor: vector form ``Q`` (k, numel) unit directions and ``norms`` (k,) float32;
factored form ``L`` (m, k·r), ``R`` (n, k·r) and ``norms`` (k,). ``Q`` is bfloat16 when the
checkpoint stores the tensor in 16 bits (bf16 or fp16: bf16 keeps float32's exponent range, so
the ~1/√numel entries of a unit vector stay normal numbers), float32 otherwise: a fold's state
costs the model's size in its storage dtype, not twice it. The fold applies the direction as
stored (rounded to bf16, then widened), so α·‖δ⊥‖·q is exactly what unmerge rebuilds; the
rounding moves each entry by at most 2⁻⁹ of the direction's own entry, far below one unit in the
last place of the 16-bit weight it is added to unless the update is as large as the weight. Once any fold used per-layer α, also ``alphas``
(k,) float32: the α each direction has in this tensor (then it, not the manifest's one α per
expert, is what :meth:`MdmOc.rebuild` and :meth:`MdmOc.contribution` use).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from ..errors import PolicyError
from .base import Policy, PolicyParams, Tensor, TensorContext, TensorFold, TensorState
from .lines import layer_index
from .lowrank import randomized_svd

log = logging.getLogger(__name__)

#: storage dtypes whose MDM-OC directions are kept in bfloat16 (module docstring)
_HALF = (torch.bfloat16, torch.float16)


def gram_schmidt(tau: Tensor, basis: Tensor, *, passes: int = 2, inplace: bool = False) -> Tensor:
    """Project a flat vector onto the null space of an orthonormal basis (modified Gram–Schmidt).

    Args:
        tau: (N,) float32 vector (modified only with ``inplace``).
        basis: (k, N) float32 or bfloat16 rows orthonormal (zero rows allowed); a 16-bit row is
            widened to float32 one row at a time.
        passes: 2 = re-orthogonalise once ("twice is enough", Giraud et al. 2005).

    Returns:
        (N,) float32 δ⊥ with ⟨δ⊥, basis[j]⟩ ≈ 0 for every j.
    """
    out = tau if inplace else tau.clone()
    for _ in range(passes):
        for j in range(basis.shape[0]):
            q = basis[j] if basis.dtype == out.dtype else basis[j].to(out.dtype)
            out.sub_(q, alpha=float(torch.dot(q, out)))
    return out


def orthogonal_factors(tau: Tensor, r_prev: Tensor, rank: int, *, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Factored orthogonal direction: δ⊥ = L Rᵀ with R ⟂ every column of ``r_prev``.

    Args:
        tau: (m, n) float32.
        r_prev: (n, p) float32 earlier right factors, orthonormal columns (zero columns allowed).
        rank: r.

    Returns:
        L (m, r) and R (n, r) float32; R's columns orthonormal and orthogonal to r_prev (zero
        columns where the null space is exhausted).
    """
    m, n = tau.shape
    proj = tau.clone()
    for _ in range(2):
        if r_prev.shape[1]:
            proj -= (proj @ r_prev) @ r_prev.T
    room = n - int((r_prev.abs().sum(0) > 0).sum())
    r_eff = max(0, min(rank, m, room))
    R = tau.new_zeros(n, rank)
    if r_eff == 0:
        return tau.new_zeros(m, rank), R
    if min(m, n) <= 512:
        _, _, vh = torch.linalg.svd(proj.double(), full_matrices=False)
        v = vh[:r_eff].T.float()
    else:
        # a private generator (:func:`.lowrank.randomized_svd`): fold workers run this concurrently
        _, v = randomized_svd(proj, r_eff, oversample=10, niter=3, seed=seed)
    for _ in range(2):  # re-orthogonalise against the earlier factors, then among themselves
        if r_prev.shape[1]:
            v = v - r_prev @ (r_prev.T @ v)
        v, _ = torch.linalg.qr(v)
    R[:, :r_eff] = v
    L = proj @ R
    return L, R


class MdmOcParams(PolicyParams):
    alpha: float = Field(0.3, description="fixed coefficient α of each new direction (also CMA-ES start)")
    rank: int = Field(0, ge=0, description="0: vector Gram–Schmidt; r > 0: factored rank-r directions for 2-D weights")
    coefficients: Literal["fixed", "cmaes", "adamerging"] = Field(
        "fixed", description="fixed α, CMA-ES on an objective, or per-layer α by entropy minimisation (AdaMerging)")
    stability: float = Field(1.0, ge=0, description="weight of the penalty on moving earlier α")
    budget: int = Field(40, ge=1, description="CMA-ES objective evaluations")
    sigma: float = Field(0.1, gt=0, description="CMA-ES initial step size")
    min_norm_ratio: float = Field(1e-6, ge=0, description="δ⊥ smaller than this fraction of ‖τ‖ is dropped")
    layer_alphas: list[float] | None = Field(
        None, description="per-layer α of the new direction: [outside the blocks, block 0, ..., block L-1] "
                          "(overrides alpha; recorded by adamerging folds, used by their replay)")
    ada_steps: int = Field(30, ge=0, description="adamerging: Adam steps (0: the starting α)")
    ada_lr: float = Field(0.01, gt=0, description="adamerging: Adam learning rate")
    ada_max_mib: float = Field(4096.0, gt=0, description="adamerging: refuse a model whose θ₀ + new direction "
                                                         "(float32, in memory) exceed this (MiB)")


class MdmOc(Policy):
    """MDM-OC (Khan et al. 2025); see the module docstring."""

    name = "mdm_oc"
    strength_param = "alpha"
    strength_grid = (0.1, 0.15, 0.2, 0.3, 0.5)
    Params = MdmOcParams
    coefficient_param = "alpha"
    contributions_in_state = True
    state_grows = True

    def searches_coefficients(self) -> str | None:
        """Which search the engine runs after the fold pass (truthy), or None for fixed α:
        ``"cmaes"`` (every α on a black-box objective, §3 step 3) or ``"adamerging"`` (the new
        direction's per-layer α on a differentiable one, :mod:`mergestream.engine.coefficients`)."""
        return None if self.params.coefficients == "fixed" else self.params.coefficients

    def coefficient(self) -> float | None:
        """α of the new direction: ``alpha``, or the mean of ``layer_alphas`` (the per-tensor
        values are in the state)."""
        la = self.params.layer_alphas
        return float(np.mean(la)) if la else float(self.params.alpha)

    def refold_params(self, coefficient: float | None) -> dict[str, Any]:
        """Replay has no objective: a searched fold is refolded with the α it recorded (an
        adamerging fold with its recorded ``layer_alphas``)."""
        params = self.describe()
        if self.searches_coefficients():
            params.update(coefficients="fixed", alpha=params["alpha"] if coefficient is None else coefficient)
        return params

    def _alpha_of(self, ctx: TensorContext) -> float:
        """α of the new direction in tensor ``ctx.name`` (its layer group's, with ``layer_alphas``)."""
        la = self.params.layer_alphas
        if la is None:
            return self.params.alpha
        idx = layer_index(ctx.name)
        g = 0 if idx is None else idx + 1
        if (ctx.n_blocks and len(la) != ctx.n_blocks + 1) or g >= len(la):
            raise PolicyError(f"mdm_oc: layer_alphas has {len(la)} values, the model needs {max(ctx.n_blocks, g) + 1} "
                              f"(outside the blocks, then one per block; tensor {ctx.name})")
        return float(la[g])

    def _alphas_state(self, state: TensorState, ctx: TensorContext, alpha: float, k: int) -> TensorState:
        """The per-tensor ``alphas`` field after this fold, or {} while every fold used one α."""
        p = self.params
        if "alphas" not in state and p.layer_alphas is None and p.coefficients != "adamerging":
            return {}
        if p.coefficients == "cmaes":
            raise PolicyError("mdm_oc: coefficients=cmaes cannot continue a state folded with per-layer α "
                              "(adamerging or layer_alphas); use fixed or adamerging")
        prev = state.get("alphas")
        if prev is None:
            if len(ctx.coefficients) != k:
                raise PolicyError(f"tensor {ctx.name}: {k} stored directions but {len(ctx.coefficients)} coefficients")
            prev = torch.tensor(ctx.coefficients, dtype=torch.float32)
        return {"alphas": torch.cat([prev.float().cpu(), torch.tensor([alpha], dtype=torch.float32)])}

    def fold_tensor(self, base: Tensor, backbone: Tensor, tau: Tensor, state: TensorState,
                    ctx: TensorContext) -> TensorFold:
        p = self.params
        alpha = self._alpha_of(ctx)
        tau_norm = float(tau.norm())
        norms = state.get("norms", tau.new_zeros(0))
        alphas = self._alphas_state(state, ctx, alpha, norms.shape[0])
        if p.rank > 0 and tau.ndim == 2:
            L_prev = state.get("L", tau.new_zeros(tau.shape[0], 0))
            R_prev = state.get("R", tau.new_zeros(tau.shape[1], 0))
            L, R = orthogonal_factors(tau, R_prev, p.rank, seed=ctx.seed)
            norm = float(L.norm())
            if norm <= p.min_norm_ratio * tau_norm or norm == 0.0:
                L.zero_(), R.zero_()
                norm = 0.0
            direction = L @ R.T
            new_state = {"L": torch.cat([L_prev, L], 1), "R": torch.cat([R_prev, R], 1),
                         "norms": torch.cat([norms, norms.new_tensor([norm])]), **alphas}
        else:
            Q = state.get("Q", tau.new_zeros(0, tau.numel()))
            unit = gram_schmidt(tau.reshape(-1), Q, inplace=True)  # τ's buffer becomes δ⊥, then q
            norm = float(unit.norm())
            if norm <= p.min_norm_ratio * tau_norm or norm == 0.0:
                unit.zero_()
                norm = 0.0
            else:
                unit.div_(norm)
            q = unit
            if Q.dtype != torch.float32 or (Q.shape[0] == 0 and ctx.dtype in _HALF):
                q = unit.to(torch.bfloat16)  # the state's dtype (module docstring)
                unit.copy_(q)  # applied exactly as stored: unmerge rebuilds these bytes
            stacked = q[None] if Q.shape[0] == 0 else torch.cat([Q, q[None]], 0)
            new_state = {"Q": stacked, "norms": torch.cat([norms, norms.new_tensor([norm])]), **alphas}
            kept = norm / tau_norm if tau_norm > 0 else 0.0
            # Δ_t = α·‖δ⊥‖·q, applied by the engine as a scale: no tensor-sized temporary
            return TensorFold(unit.view_as(tau), new_state, {"orthogonal_fraction": kept}, scale=alpha * norm)
        kept = norm / tau_norm if tau_norm > 0 else 0.0
        return TensorFold(direction.mul_(alpha), new_state, {"orthogonal_fraction": kept})

    def _direction(self, state: TensorState, index: int, shape: torch.Size) -> Tensor:
        if "Q" in state:  # float32 whatever the stored dtype (and never a view of the state)
            return state["Q"][index].to(torch.float32, copy=True).mul_(state["norms"][index]).view(shape)
        r = state["L"].shape[1] // state["norms"].shape[0]
        sl = slice(index * r, (index + 1) * r)
        return state["L"][:, sl] @ state["R"][:, sl].T

    def contribution(self, state: TensorState, index: int, coefficient: float | None,
                     shape: torch.Size) -> Tensor | None:
        """α_k δ_k⊥ for expert ``index`` (float32, ``shape``), rebuilt from the state (α_k: the
        state's per-tensor ``alphas`` where present, else ``coefficient``)."""
        if "norms" not in state:
            return None
        if "alphas" in state:
            coefficient = float(state["alphas"][index])
        return self._direction(state, index, shape).mul_(float(coefficient))

    def drop_from_state(self, state: TensorState, index: int) -> TensorState:
        keep = [i for i in range(state["norms"].shape[0]) if i != index]
        out = {"norms": state["norms"][keep]}
        if "alphas" in state:
            out["alphas"] = state["alphas"][keep]
        if "Q" in state:
            out["Q"] = state["Q"][keep]
        else:
            r = state["L"].shape[1] // state["norms"].shape[0]
            cols = [c for i in keep for c in range(i * r, (i + 1) * r)]
            out["L"], out["R"] = state["L"][:, cols], state["R"][:, cols]
        return out

    def rebuild(self, base: Tensor, state: TensorState, coefficients: list[float]) -> Tensor:
        """θ₀ + Σ αᵢ δᵢ⊥ (float32, θ₀'s shape); αᵢ from the state's ``alphas`` where present."""
        out = base.clone()
        if "norms" not in state:
            return out
        if "alphas" in state:
            coefficients = [float(a) for a in state["alphas"]]
        for i, a in enumerate(coefficients):
            out += self._direction(state, i, base.shape).mul_(a)
        return out


def stability_penalty(alphas: Sequence[float], anchor: Sequence[float]) -> float:
    """Σ_{i<len(anchor)} (αᵢ − anchorᵢ)², the unweighted stability term of MDM-OC eq. 7."""
    anc = np.asarray(anchor, dtype=float)
    return float(np.sum((np.asarray(alphas, dtype=float)[: len(anc)] - anc) ** 2)) if len(anc) else 0.0


def cmaes_coefficients(objective: Callable[[np.ndarray], float], start: Sequence[float],
                       anchor: Sequence[float], *, stability: float = 1.0, budget: int = 40,
                       sigma: float = 0.1, bounds: tuple[float, float] = (0.0, 2.0),
                       seed: int = 0) -> tuple[np.ndarray, float, int]:
    """Optimise all coefficients α jointly with CMA-ES (Hansen 2016; the ``cma`` package).

    Minimises f(α) = objective(α) + stability · Σ_{i<len(anchor)} (αᵢ − anchorᵢ)², MDM-OC eq. 7
    (the stability term keeps earlier experts' coefficients near their previous values).

    Args:
        objective: α (np.ndarray, shape (K,)) -> loss, lower is better.
        start: initial α, shape (K,).
        anchor: the previous fold's coefficients of the first len(anchor) experts.
        budget: maximum number of objective evaluations (the start point included).

    Returns:
        (best α, its penalised loss, evaluations used). Never worse than ``start``: the start
        point is evaluated first and kept unless something beats it.
    """
    import cma

    x0 = np.asarray(start, dtype=float)
    anc = np.asarray(anchor, dtype=float)

    def penalised(x: np.ndarray) -> float:
        return float(objective(np.asarray(x, dtype=float))) + stability * stability_penalty(x, anc)

    best_x, best_f = x0.copy(), penalised(x0)
    evals = 1
    if budget <= 1:
        return best_x, best_f, evals
    if x0.size == 1:  # CMA-ES needs ≥ 2 dimensions: a seeded 1-D Gaussian search on the same budget
        rng = np.random.default_rng(seed)
        while evals < budget:
            x = np.clip(best_x + sigma * rng.standard_normal(1), *bounds)
            f = penalised(x)
            evals += 1
            if f < best_f:
                best_x, best_f = x, f
        return best_x, best_f, evals
    es = cma.CMAEvolutionStrategy(x0, sigma, {"bounds": list(bounds), "seed": seed + 1, "verbose": -9,
                                              "maxfevals": budget - 1})
    while not es.stop() and evals < budget:
        xs = es.ask()
        xs = xs[: budget - evals]
        fs = [penalised(np.asarray(x)) for x in xs]
        evals += len(xs)
        for x, f in zip(xs, fs):
            if f < best_f:
                best_x, best_f = np.asarray(x, dtype=float).copy(), f
        if len(xs) == es.popsize:
            es.tell(xs, fs)
        else:
            break
    return best_x, best_f, evals
