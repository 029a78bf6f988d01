"""SAFE-Merge: risk-aware sparse masking + masked low-rank recovery (Qiu et al., 2026).

Data-free continual merging that protects general knowledge. Per 2-D weight (METHODS.md §safe_merge):

1. general subspace U₀, V₀: top-k singular vectors of θ₀ (computed once, cached in the state);
2. task-specific subspace U_s, V_s: top-k_s singular vectors of τ_⊥ = (I − U₀U₀ᵀ) τ (I − V₀V₀ᵀ);
3. risk r = |G| / (|G| + |S| + ε) with G = U₀U₀ᵀ τ V₀V₀ᵀ and S = U_sU_sᵀ τ V_sV_sᵀ;
4. mask M: the top-ρ fraction of entries by c = (1 − r)·|τ| (exactly round(ρ·numel) entries);
5. D = M ⊙ τ + M ⊙ (B A), B ∈ ℝ^{m×r} zeros, A ∈ ℝ^{r×n} ~ N(0, 1)/√r;
6. minimise L = ‖(D − τ) V_new‖²_F + λ_old ‖D V_old‖²_F over A, B with Adam (``steps`` steps,
   lr = lr_scale · std(τ)); V_new: top right singular vectors of τ; V_old: those of Δ_{t−1}
   (skipped at the first fold, where Δ_{t−1} = 0);
7. Δ_t = λ·D.

Optional (``project_rank`` r > 0; off by default, our addition after OPCM, Tang et al. 2025 §4.2):
at later folds τ is first replaced by τ' = τ − U_r U_rᵀ τ V_r V_rᵀ, with U_r, V_r the top-r singular
vectors of Δ_{t−1}, and steps 2-7 run on τ' (the mask, the risk and the recovery target).

Optional (``iso_alpha`` α > 0; off by default, our composition with Iso-C, Marczak et al. ICML
2025 §4.1, :mod:`.iso_c`): instead of adding λ·D, each 2-D weight keeps the running sum of the folds'
D in its state and the backbone becomes θ₀ + α·σ̄ U Vᵀ of that sum (its spectrum flattened to the mean
singular value), so the risk-masked, recovered updates are merged isotropically; this applies to
every 2-D weight that is not an embedding, also those too small for the risk mask and recovery
(there D = M ⊙ τ with the magnitude mask). Subtract-unmerge is then refused (the sum cannot drop one
D): use replay.

Tensors that are not 2-D, 2-D tensors with min(shape) < 2k, and embedding matrices: magnitude mask
with the same ρ, no recovery (our choice, METHODS.md). Randomised SVD (subspace iteration with 3
power iterations and 10 oversampling columns, Halko et al. 2011 Alg. 4.4:
:func:`.lowrank.randomized_svd`) computes the top singular vectors; an exact float64 one
(:func:`.lowrank.exact_top_singular`) at or below 512 on the short side — our choice. Above that
size τ_⊥ of step 2 is never formed (its subspace iteration projects around products with τ,
:func:`.lowrank.randomized_svd_projected`), and S of step 3 is U_s diag(σ_s) V_sᵀ, the same matrix
since U_s ⊥ U₀ and V_s ⊥ V₀. There, all power-iteration products but the last (all of them for V_new
and V_old, of which only V is used) are taken in bfloat16 (float32 accumulation) where the device
multiplies it natively (``svd_products``, default ``auto``:
:func:`.lowrank.native_low_precision_dtype`). On real MiniLM experts forced onto this path
(bench/safe_svd_paths.py, bench/results/safe_svd_paths.md) its masks keep 99.9% of the float32
products' kept entries (min 99.65%), either keeps 90.8% of the exact path's, and H after three folds
is the same for all three (79.14, 79.13, 79.14); on spectra with a gap both match the exact risk
(tests/test_policies.py).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from .base import Policy, PolicyParams, Tensor, TensorContext, TensorFold, TensorState
from .iso_c import isotropic_fold, merges_isotropically
from .lowrank import (exact_top_singular, native_low_precision_dtype, randomized_right_singular, randomized_svd,
                      randomized_svd_projected)
from .masks import magnitude_mask
from .recovery import column_blocks, fit_on_mask

#: Largest short side at which SAFE-Merge computes top singular vectors exactly (float64); above it,
#: randomised subspace iteration (module docstring).
EXACT_MAX_SIDE = 512
RSVD_OVERSAMPLE, RSVD_NITER = 10, 3  # the randomised SVD's settings above it (module docstring)


def top_singular(w: Tensor, k: int, *, seed: int = 0, product_dtype: torch.dtype | None = None
                 ) -> tuple[Tensor, Tensor]:
    """Top-k left and right singular vectors of a 2-D float32 matrix.

    Args:
        w: (m, n) float32.
        k: number of vectors (clipped to min(m, n)).
        product_dtype: the randomised path's power-iteration product dtype (None: float32;
            :func:`.lowrank.randomized_svd`); the exact path ignores it.

    Returns:
        U (m, k') and V (n, k') float32 with orthonormal columns, k' = min(k, m, n).
    """
    k = min(k, *w.shape)
    if k == 0:
        return w.new_zeros(w.shape[0], 0), w.new_zeros(w.shape[1], 0)
    if min(w.shape) <= EXACT_MAX_SIDE:
        return exact_top_singular(w, k)
    # a private generator: fold workers run this concurrently, and reseeding torch's global one per
    # call both raced between them and cost 7% of a 1 GiB fold
    u, v = randomized_svd(w, k, oversample=RSVD_OVERSAMPLE, niter=RSVD_NITER, seed=seed, product_dtype=product_dtype)
    return u.contiguous(), v.contiguous()


def top_right_singular(w: Tensor, k: int, *, seed: int = 0, product_dtype: torch.dtype | None = None) -> Tensor:
    """Top-k right singular vectors V (n, k') of a 2-D float32 matrix, k' = min(k, m, n): the V of
    :func:`top_singular`, whose randomised path may then take every power-iteration product in
    ``product_dtype`` (:func:`.lowrank.randomized_right_singular`). Contiguous float32."""
    k = min(k, *w.shape)
    if k == 0 or min(w.shape) <= EXACT_MAX_SIDE:
        return top_singular(w, k, seed=seed)[1]
    return randomized_right_singular(w, k, oversample=RSVD_OVERSAMPLE, niter=RSVD_NITER, seed=seed,
                                     product_dtype=product_dtype).contiguous()


def risk_scores(tau: Tensor, u0: Tensor, v0: Tensor, k_s: int, eps: float = 1e-12, seed: int = 0,
                ctx: TensorContext | None = None, product_dtype: torch.dtype | None = None) -> Tensor:
    """General-knowledge risk r ∈ [0, 1] per entry (steps 2-3 above); (m, n) float32.

    Above :data:`EXACT_MAX_SIDE`, τ_⊥'s top-k_s triplets come from subspace iteration on the
    projections of τ (:func:`.lowrank.randomized_svd_projected`), and S = U_s diag(σ_s) V_sᵀ, which
    equals U_sU_sᵀ τ V_sV_sᵀ because U_s ⊥ U₀ and V_s ⊥ V₀: τ_⊥ is never formed, a third fewer
    (m, n)-sized products (``product_dtype`` as :func:`top_singular`). At or below it, τ_⊥ is
    formed for the exact float64 SVD.

    With ``ctx``, the (m, n) temporaries and the result live in its scratch buffers (slots
    ``safe.perp`` and ``safe.risk``): the result is valid until this thread's next call."""
    ctx = ctx or TensorContext("")
    x = u0.T @ tau  # (k, n)
    core = x @ v0  # U₀ᵀ τ V₀, (k, k)
    perp = ctx.scratch("safe.perp", tau.shape, device=tau.device)
    if min(tau.shape) <= EXACT_MAX_SIDE:
        # τ_⊥ = τ − U₀U₀ᵀτ − (τV₀ − U₀U₀ᵀτV₀)V₀ᵀ, formed in one (m, n) buffer
        torch.addmm(tau, u0, x, alpha=-1.0, out=perp)
        perp.addmm_(torch.addmm(tau @ v0, u0, core, alpha=-1.0), v0.T, alpha=-1.0)
        us, vs = top_singular(perp, k_s, seed=seed)
        s_left = us @ (us.T @ tau @ vs)
    else:
        us, sig, vs = randomized_svd_projected(tau, u0, v0, min(k_s, *tau.shape), oversample=RSVD_OVERSAMPLE,
                                               niter=RSVD_NITER, seed=seed, product_dtype=product_dtype)
        s_left = us * sig
    del x
    g = torch.mm(u0 @ core, v0.T, out=ctx.scratch("safe.risk", tau.shape, device=tau.device))  # U₀U₀ᵀτV₀V₀ᵀ
    s = torch.mm(s_left, vs.T, out=perp)  # S = U_sU_sᵀ τ V_sV_sᵀ, in τ_⊥'s buffer
    g.abs_()
    return g.div_(s.abs_().add_(g).add_(eps))


def masked_recovery(tau: Tensor, mask: Tensor, delta_prev: Tensor | None, *, rank: int, steps: int,
                    lambda_old: float, lr_scale: float, k_new: int, k_old: int,
                    seed: int = 0, in_place: bool = False, ctx: TensorContext | None = None,
                    product_dtype: torch.dtype | None = None) -> tuple[Tensor, list[float]]:
    """Steps 5-6: D = M⊙τ + M⊙(BA) with A, B fitted by Adam on the data-free objective.

    The objective L = ‖(D − τ) V_new‖²_F + λ_old ‖D V_old‖²_F is written as ‖P + C W‖²_F with
    C = M⊙(BA), W = [V_new, √λ_old·V_old] (n, K), P = [(M⊙τ − τ) V_new, √λ_old·(M⊙τ) V_old] (m, K);
    A (r, n) starts N(0, 1)/√r from a generator seeded with ``seed``, B (m, r) at zero, and
    :func:`.recovery.fit_on_mask` runs Adam on the ρ·m·n kept entries only (sparse, in column
    blocks), with the gradients autograd would give on the dense formulation.

    Args:
        tau: (m, n) float32 task vector.
        mask: (m, n) bool risk-aware mask M.
        delta_prev: Δ_{t−1} (m, n) float32, or None / all zeros at the first fold (L_old skipped).
        rank: r of the correction; steps: Adam steps (0 = no recovery).
        in_place: build D in ``tau``'s memory (τ is lost) instead of fresh memory.
        ctx: its scratch buffer (slot ``safe.rest``) holds the one (m, n) temporary.
        product_dtype: for V_new's and V_old's SVDs (:func:`top_right_singular`).

    Returns:
        D (m, n) float32, zero outside M; and the loss after each step (first = before any step;
        empty when there is no recovery: ``steps`` or ``rank`` 0, or an empty mask).
    """
    ctx = ctx or TensorContext("")
    zero = tau.new_zeros(())
    if steps == 0 or rank == 0 or not bool(mask.any()):
        return torch.where(mask, tau, zero, out=tau if in_place else None), []
    m, n = tau.shape
    v_new = top_right_singular(tau, k_new, seed=seed, product_dtype=product_dtype)
    # constant part of (D − τ) V_new = −(τ off the mask) V_new (exactly 0 on the kept entries)
    rest = torch.where(mask, zero, tau, out=ctx.scratch("safe.rest", tau.shape, device=tau.device))
    p_new = torch.mm(rest, v_new).neg_()
    del rest
    lr = lr_scale * float(tau.std()) if tau.numel() > 1 else lr_scale
    d0 = torch.where(mask, tau, zero, out=tau if in_place else None)  # M⊙τ in one pass (no ~M)
    w, p = [v_new], [p_new]
    if lambda_old > 0 and delta_prev is not None and bool(delta_prev.any()):
        v_old = top_right_singular(delta_prev, k_old, seed=seed + 1, product_dtype=product_dtype)
        w.append(v_old * lambda_old**0.5)
        p.append((d0 @ v_old) * lambda_old**0.5)
    w_all, p_all = torch.cat(w, 1), torch.cat(p, 1)  # W (n, K) contiguous, P (m, K)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    a_t = (torch.randn(rank, n, generator=gen) / rank**0.5).T.contiguous().to(tau.device)  # Aᵀ (n, r)
    b = torch.zeros(m, rank, device=tau.device)
    blocks = column_blocks(mask, w_all.shape[1])
    losses = fit_on_mask(blocks, w_all, p_all, a_t, b, steps=steps, lr=max(lr, 1e-12))
    for blk in blocks:  # D = M⊙τ + M⊙(B A)
        d0.view(-1).index_add_(0, blk.flat, blk.values)
    return d0, losses


class SafeMergeParams(PolicyParams):
    rho: float = Field(0.1, gt=0, le=1, description="keep ratio ρ of each tensor's entries")
    lam: float = Field(0.3, alias="lambda", description="fold scale λ")
    k: int = Field(64, ge=1, description="rank of θ₀'s general subspace")
    k_s: int = Field(64, ge=1, description="rank of τ's task-specific subspace")
    rank: int = Field(16, ge=0, description="rank r of the masked low-rank recovery (0 = none)")
    steps: int = Field(25, ge=0, description="Adam steps of the recovery (0 = none); 25 measured as good as 50 "
                                             "(docs: Speed and memory)")
    lambda_old: float = Field(1.0, ge=0, description="weight λ_old of the stay-off-old-directions term")
    lr_scale: float = Field(0.1, gt=0, description="Adam learning rate = lr_scale · std(τ)")
    k_new: int = Field(8, ge=1, description="top right singular vectors of τ in L_new")
    k_old: int = Field(64, ge=1, description="top right singular vectors of Δ_{t−1} in L_old")
    risk_mask: bool = Field(True, description="False: plain magnitude mask (the ablation row)")
    project_rank: int = Field(0, ge=0, description="later folds: first project τ off the top-r singular block of "
                                                   "Δ_{t−1} (OPCM-style; 0 = off)")
    iso_alpha: float = Field(0.0, ge=0, description="> 0: merge the running sum of the folds' D isotropically "
                                                    "(Iso-C) with this α instead of adding λ·D (0 = off)")
    svd_products: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="dtype of the randomised SVDs' power-iteration products above the exact side (auto: "
                            "bfloat16 where the device multiplies it natively, else float32)")


class SafeMerge(Policy):
    """SAFE-Merge (Qiu et al. 2026); see the module docstring. State: cached U₀, V₀ per tensor."""

    name = "safe_merge"
    strength_param = "lambda"
    strength_grid = (0.2, 0.3, 0.5, 0.7)
    Params = SafeMergeParams

    def __init__(self, params=None):
        super().__init__(params)
        self.subtract_unmerge = self.params.iso_alpha == 0  # the isotropic sum cannot drop one fold

    def strength(self) -> tuple[str, tuple[float, ...]]:
        """``lambda`` and its grid; with ``iso_alpha`` > 0 (the isotropic merge of the masked
        updates) ``iso_alpha`` and bench/quality.py's grid for it."""
        if self.params.iso_alpha > 0:
            return "iso_alpha", (1.5, 2.0, 2.5, 3.0, 4.5)
        return "lambda", tuple(self.strength_grid)

    def product_dtype(self, device: torch.device) -> torch.dtype | None:
        """The randomised SVDs' product dtype on ``device`` for ``svd_products`` (None: float32)."""
        choice = self.params.svd_products
        if choice == "auto":
            return native_low_precision_dtype(device)
        return torch.bfloat16 if choice == "bfloat16" else None

    def fold_tensor(self, base: Tensor, backbone: Tensor, tau: Tensor, state: TensorState,
                    ctx: TensorContext) -> TensorFold:
        p = self.params
        structured = tau.ndim == 2 and not ctx.is_embedding and min(tau.shape) >= 2 * p.k
        if not structured:
            mask = magnitude_mask(torch.abs(tau, out=ctx.scratch("safe.score", tau.shape, device=tau.device)), p.rho)
            stats = {"kept": float(torch.count_nonzero(mask))}  # 1/40 of bool sum()'s time
            if p.iso_alpha > 0 and merges_isotropically(tau, ctx):  # D = M ⊙ τ
                delta, kept = isotropic_fold(tau.mul_(mask), base, backbone, state, ctx, p.iso_alpha)
                return TensorFold(delta, {**state, "sum": kept}, stats)
            return TensorFold(tau.mul_(mask).mul_(p.lam), {}, stats)
        new_state = state
        low = self.product_dtype(tau.device)
        delta_prev = torch.sub(backbone, base, out=ctx.scratch("safe.delta_prev", tau.shape, device=tau.device)) \
            if ctx.n_previous > 0 else None
        if p.project_rank > 0 and delta_prev is not None and bool(delta_prev.any()):
            up, vp = top_singular(delta_prev, p.project_rank, seed=ctx.seed + 2, product_dtype=low)
            tau.addmm_(up @ ((up.T @ tau) @ vp), vp.T, alpha=-1.0)  # τ' = τ − U_r U_rᵀ τ V_r V_rᵀ
        if p.risk_mask:
            if "U0" not in state:
                u0, v0 = top_singular(base, p.k, seed=ctx.seed, product_dtype=low)
                new_state = {"U0": u0, "V0": v0}
            risk = risk_scores(tau, new_state["U0"], new_state["V0"], p.k_s, seed=ctx.seed, ctx=ctx,
                               product_dtype=low)
            score = risk.neg_().add_(1.0).mul_(tau).abs_()  # (1 − r)·|τ|, as 1 − r ≥ 0
        else:
            score = torch.abs(tau, out=ctx.scratch("safe.score", tau.shape, device=tau.device))
        mask = magnitude_mask(score, p.rho)
        del score
        d, losses = masked_recovery(tau, mask, delta_prev, rank=p.rank, steps=p.steps, lambda_old=p.lambda_old,
                                    lr_scale=p.lr_scale, k_new=p.k_new, k_old=p.k_old, seed=ctx.seed,
                                    in_place=True, ctx=ctx, product_dtype=low)
        stats = {"kept": float(torch.count_nonzero(mask))}  # 1/40 of bool sum()'s time
        if losses:
            stats.update(recovery_loss_first=losses[0], recovery_loss_last=losses[-1])
        if p.iso_alpha > 0:
            delta, kept = isotropic_fold(d, base, backbone, new_state, ctx, p.iso_alpha)
            return TensorFold(delta, {**new_state, "sum": kept}, stats)
        return TensorFold(d.mul_(p.lam), new_state, stats)
