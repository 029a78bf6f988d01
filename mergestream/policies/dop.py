"""DOP: dual orthogonal projections for data-free continual merging.

Source: "Continual Model Merging without Data: Dual Projections for Balancing Stability and
Plasticity", NeurIPS 2025 (reference implementation: FusionBench, ``fusion_bench/method/dop``).

At fold t ≥ 2 two models meet: the merged one, with task vector M = θ_{t−1} − θ₀, and the new
expert, with τ. For a 2-D weight each side i ∈ {M, τ} with task vector Δ_i contributes its top
singular block Δ_i ≈ U_i S_i V_iᵀ (r_i the smallest rank whose singular values hold a fraction
``epsilon`` of their sum) and the merged task vector X minimises

    L(X) = α·ℓ_M(X) + (1 − α)·ℓ_τ(X),
    ℓ_i(X) = ‖S_i U_iᵀ (X − Δ_i)‖²_F + ‖(X − Δ_i) V_i S_i‖²_F          (``space="uv"``)

(``space="u"``/``"v"`` keep one term): X may move freely orthogonally to the left *and* right
singular subspaces of each side ("dual projections") and pays, weighted by the singular values,
for leaving them. α weighs stability (the merged model) against plasticity (the new expert).

Solvers:

- ``exact`` (default, our choice): L is quadratic. With P_i = U_i S_i² U_iᵀ (m × m) and
  Q_i = V_i S_i² V_iᵀ (n × n), ∇L = 0 is the Sylvester equation A X + X B = C with
  A = α P_M + (1−α) P_τ, B = α Q_M + (1−α) Q_τ, C = α (P_M M + M Q_M) + (1−α)(P_τ τ + τ Q_τ).
  With A = E Λ Eᵀ, B = F Μ Fᵀ: X̃ = Eᵀ C F ⊘ (λ_i + μ_j) where λ_i + μ_j > 0; directions where
  λ_i + μ_j = 0 (outside every subspace, L flat) keep the starting point X₀ = (M + τ)/2 (the
  point the paper's optimiser starts from). X is the minimiser of L closest to X₀ in those
  coordinates. Cost: one SVD per side and two symmetric eigendecompositions of at most
  min(d, r_M + r_τ) for each side d ∈ {m, n} (float64; :func:`solve_exact`).
- ``adam`` (the paper's): ``steps`` Adam steps with rate ``lr`` from X₀; with ``mgda`` the two
  losses are weighted by the two-task min-norm solution of their loss-normalised gradients
  (MGDA, Sener & Koltun 2018, closed form for two objectives), smoothed by an EMA with rate
  ``ema_beta`` started at (α, 1 − α).

Variants of the reference (FusionBench 0.2.33's ``dop_general.DOPMerging``, by the paper's
authors; ``reference_params``, checked by tests/test_conformance.py): ``mgda=false`` weighs the two
losses by the fixed (α, 1 − α) (DOP without MGDA); ``ema=false`` uses each step's MGDA weights as
they are (DOP without the EMA). ``rank``: ``cover`` (ours, default) keeps the smallest r whose
singular values reach ε of their sum; ``below`` (reference) keeps the ranks whose cumulative share
is below ε, which drops the last real direction of a low-rank task vector (with ε = 1 it keeps
rank − 1 of a rank-deficient side, and every nonzero pair but the last of a full-rank one). The
reference runs ε = 0.99999 with the Adam solver. The MGDA weight of the two-objective min-norm
problem is clipped to [0.001, 0.999] at its ends, as in the MGDA authors' code that the reference
uses. Our default solver and ε are ours: the closed form is the minimiser the Adam loop
approaches; the quality benchmark (bench/results/quality.md) ran with them.

Special cases (tested): the first fold is the expert itself (X = τ, θ₁ = θ_expert); α = 1 gives
X = M + ½ (I − U_M U_Mᵀ)(τ − M)(I − V_M V_Mᵀ): the fold's update is orthogonal to both singular
subspaces of the merged task vector. Other tensors (1-D, embeddings, the tied LM head) take the
paper's simple average X = (M + τ)/2.

State: none. The merged task vector is read from the backbone, so a subtract-unmerge of the latest
fold leaves the next fold exactly as without it; ``replay`` refolds the others (the defaults of
:class:`~mergestream.policies.base.Policy`). Removing an earlier fold subtracts exactly what it
added, but the later folds had averaged with it (the paper has no unmerge; ``replay`` gives the
"never merged" model).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from .base import Policy, PolicyParams, Tensor, TensorContext, TensorFold, TensorState


class DopParams(PolicyParams):
    alpha: float = Field(0.8, ge=0, le=1, description="weight α of stability (the merged model) vs plasticity")
    epsilon: float = Field(1.0, gt=0, le=1, description="fraction of Σ singular values each side's subspace keeps")
    space: Literal["uv", "u", "v"] = Field("uv", description="project on left and right ('uv'), left or right singular vectors")
    solver: Literal["exact", "adam"] = Field("exact", description="closed-form minimiser or the paper's Adam loop")
    steps: int = Field(200, ge=0, description="Adam steps (solver=adam)")
    lr: float = Field(1e-4, gt=0, description="Adam learning rate (solver=adam)")
    mgda: bool = Field(True, description="MGDA loss weights with an EMA (solver=adam)")
    ema_beta: float = Field(0.999, ge=0, le=1, description="EMA rate of the MGDA weights (solver=adam)")
    ema: bool = Field(True, description="smooth the MGDA weights with an EMA (solver=adam, mgda=true)")
    rank: Literal["cover", "below"] = Field("cover", description="subspace: ranks reaching ε (ours) or below ε (reference)")


def principal_subspace(delta: Tensor, epsilon: float, rule: str = "cover") -> tuple[Tensor, Tensor, Tensor]:
    """Top singular block of a task vector.

    Args:
        delta: (m, n) float tensor.
        epsilon: 0 < ε ≤ 1, the fraction of Σ singular values to keep.
        rule: ``cover``: r the smallest rank with Σ_{k≤r} s_k ≥ ε Σ s_k; ``below`` (the reference's
            searchsorted): r the number of ranks whose cumulative share is < ε.

    Returns:
        U (m, r), S (r,), V (n, r) in ``delta``'s dtype (r = 0 for a zero matrix).
    """
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    total = float(s.sum())
    if total <= 0:
        return u[:, :0], s[:0], vh[:0].T
    share = torch.cumsum(s, 0) / total
    if rule == "below":
        r = int((share < epsilon).sum())
    else:
        r = min(int((share < epsilon * (1 - 1e-12)).sum()) + 1, s.shape[0])
    return u[:, :r], s[:r], vh[:r].T


def projection_loss(x: Tensor, target: Tensor, u: Tensor, s: Tensor, v: Tensor, space: str = "uv") -> Tensor:
    """ℓ(X) = ‖S Uᵀ (X − Δ)‖²_F + ‖(X − Δ) V S‖²_F (``space`` selects the terms); a 0-d tensor.

    Args:
        x, target: (m, n) X and Δ. u (m, r), s (r,), v (n, r): Δ's singular block.
    """
    d = x - target
    out = x.new_zeros(())
    if "u" in space:
        out = out + (s[:, None] * (u.T @ d)).square().sum()
    if "v" in space:
        out = out + ((d @ v) * s[None, :]).square().sum()
    return out


def _sides(m: Tensor, tau: Tensor, p: DopParams) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    return [(t, *principal_subspace(t, p.epsilon, p.rank)) for t in (m, tau)]


def dop_objective(x: Tensor, merged: Tensor, tau: Tensor, params: DopParams) -> float:
    """L(X) of the module docstring for one (m, n) weight (float64 sum), for tests and logs."""
    xs, sides = x.double(), _sides(merged.double(), tau.double(), params)
    w = (params.alpha, 1 - params.alpha)
    return float(sum(wi * projection_loss(xs, t, u, s, v, params.space) for wi, (t, u, s, v) in zip(w, sides)))


def _range_eig(w: Tensor) -> tuple[Tensor, Tensor]:
    """Eigenpairs of W Wᵀ (d × d, PSD) from W (d × k): (λ (k',), E (d × k')), all of them.

    Uses the k × k Gram matrix WᵀW when k < d (E = W Q Λ^{-1/2}; zero λ give zero columns, dropped
    by the caller's threshold), else W Wᵀ itself.
    """
    d, k = w.shape
    if k >= d:
        lam, e = torch.linalg.eigh(w @ w.T)
        return lam.clamp_min(0), e
    lam, q = torch.linalg.eigh(w.T @ w)
    lam = lam.clamp_min(0)
    e = (w @ q) / lam.sqrt().clamp_min(1e-300)
    return lam, e


def solve_exact(merged: Tensor, tau: Tensor, params: DopParams) -> Tensor:
    """The closed-form minimiser of L (module docstring, solver ``exact``).

    With A = E Λ Eᵀ and B = F Μ Fᵀ restricted to their positive eigenvalues (the rest: the null
    spaces, projectors Π⊥_A = I − E Eᵀ, Π⊥_B = I − F Fᵀ), ∇L = 0 splits into four blocks:

        X = E [(Eᵀ C F) ⊘ (λ_i + μ_j)] Fᵀ + E Λ⁻¹ Eᵀ C Π⊥_B + Π⊥_A C F Μ⁻¹ Fᵀ + Π⊥_A X₀ Π⊥_B.

    A and B are never formed when a side is thin: they are W Wᵀ with W = [√α U_M S_M, √(1−α) U_τ S_τ]
    (m × (r_M + r_τ)), so their eigenpairs come from the smaller Gram matrix.

    Args:
        merged: M (m, n) float32. tau: τ (m, n) float32.

    Returns:
        X (m, n) float32.
    """
    m64, t64 = merged.double(), tau.double()
    x0 = (m64 + t64) * 0.5
    w = (params.alpha, 1.0 - params.alpha)
    rows, cols = merged.shape
    left, right = [], []
    c = torch.zeros_like(m64)  # C = Σ_i w_i (P_i Δ_i + Δ_i Q_i), from the factors
    for wi, (t, u, s, v) in zip(w, _sides(m64, t64, params)):
        if wi == 0 or s.numel() == 0:
            continue
        if "u" in params.space:
            us = u * s
            left.append(us * wi ** 0.5)
            c.add_(us @ (us.T @ t), alpha=wi)
        if "v" in params.space:
            vs = v * s
            right.append(vs * wi ** 0.5)
            c.add_((t @ vs) @ vs.T, alpha=wi)
    wa = torch.cat(left, 1) if left else m64.new_zeros(rows, 0)
    wb = torch.cat(right, 1) if right else m64.new_zeros(cols, 0)
    lam, e = _range_eig(wa) if wa.shape[1] else (m64.new_zeros(0), m64.new_zeros(rows, 0))
    mu, f = _range_eig(wb) if wb.shape[1] else (m64.new_zeros(0), m64.new_zeros(cols, 0))
    top = max(float(lam.max()) if lam.numel() else 0.0, 0.0) + max(float(mu.max()) if mu.numel() else 0.0, 0.0)
    if top == 0.0:
        return x0.float()
    tol = 1e-12 * top
    e, lam = e[:, lam > tol], lam[lam > tol]
    f, mu = f[:, mu > tol], mu[mu > tol]

    def perp_rows(y: Tensor) -> Tensor:  # Π⊥_A Y
        return y - e @ (e.T @ y)

    def perp_cols(y: Tensor) -> Tensor:  # Y Π⊥_B
        return y - (y @ f) @ f.T

    ec = e.T @ c  # (p, n)
    x = e @ ((ec @ f) / (lam[:, None] + mu[None, :])) @ f.T
    x += e @ (perp_cols(ec) / lam[:, None])
    x += (perp_rows(c) @ f / mu[None, :]) @ f.T
    x += perp_cols(perp_rows(x0))
    return x.float()


def _min_norm_two(g1: Tensor, g2: Tensor) -> float:
    """Weight γ of g1 in the min-norm point γ g1 + (1−γ) g2 of the segment (MGDA, two objectives;
    Sener & Koltun 2018, Algorithm 1), 0.999 / 0.001 at the segment's ends as in their code."""
    v11, v12, v22 = float((g1 * g1).sum()), float((g1 * g2).sum()), float((g2 * g2).sum())
    if v12 >= v11:
        return 0.999
    if v12 >= v22:
        return 0.001
    return (v22 - v12) / (v11 + v22 - 2 * v12)


def solve_adam(merged: Tensor, tau: Tensor, params: DopParams) -> tuple[Tensor, list[float]]:
    """The paper's optimiser (module docstring, solver ``adam``).

    Args:
        merged: M (m, n) float32. tau: τ (m, n) float32.

    Returns:
        X (m, n) float32 and the weighted loss before each step and after the last (``steps`` + 1
        values, with the weights in use at that step).
    """
    sides = _sides(merged, tau, params)
    x = torch.nn.Parameter((merged + tau) * 0.5)
    opt = torch.optim.Adam([x], lr=params.lr)
    w = [params.alpha, 1.0 - params.alpha]
    history: list[float] = []
    with torch.enable_grad():
        for _ in range(params.steps):
            losses = [projection_loss(x, t, u, s, v, params.space) for t, u, s, v in sides]
            if params.mgda:
                grads = [torch.autograd.grad(li, x, retain_graph=True)[0] / max(float(li.detach()), 1e-30) for li in losses]
                g = _min_norm_two(grads[0], grads[1])
                if params.ema:
                    w = [params.ema_beta * w[0] + (1 - params.ema_beta) * g,
                         params.ema_beta * w[1] + (1 - params.ema_beta) * (1 - g)]
                else:
                    w = [g, 1 - g]
            loss = w[0] * losses[0] + w[1] * losses[1]
            history.append(float(loss.detach()))
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            history.append(float(sum(wi * projection_loss(x, t, u, s, v, params.space) for wi, (t, u, s, v)
                                     in zip(w, sides))))
    return x.detach(), history


class Dop(Policy):
    """DOP (NeurIPS 2025); see the module docstring."""

    name = "dop"
    strength_param = "alpha"
    strength_grid = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 1.0)
    Params = DopParams
    reference_params = {"solver": "adam", "epsilon": 0.99999, "rank": "below", "steps": 200, "lr": 1e-4,
                        "ema_beta": 0.999}

    def fold_tensor(self, base: Tensor, backbone: Tensor, tau: Tensor, state: TensorState,
                    ctx: TensorContext) -> TensorFold:
        """Δ_t = X − M: τ at the first fold, the minimiser of L for 2-D weights, (τ − M)/2 otherwise."""
        if ctx.n_previous == 0:  # θ₁ = θ_expert: X = τ
            return TensorFold(tau)
        merged = backbone - base
        if tau.ndim != 2 or min(tau.shape) < 2 or ctx.is_embedding:
            return TensorFold(tau.sub_(merged).mul_(0.5))  # X = (M + τ)/2
        p = self.params
        stats: dict[str, float] = {}
        if p.solver == "exact":
            x = solve_exact(merged, tau, p)
        else:
            x, hist = solve_adam(merged, tau, p)
            stats = {"loss_start": hist[0], "loss": hist[-1]}
        return TensorFold(x.sub_(merged), {}, stats)
