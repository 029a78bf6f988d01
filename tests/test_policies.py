"""Merge math, through the real engine and real safetensors files where it matters."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peft.utils.merge_utils import ties as peft_ties

from mergestream import engine
from mergestream.engine.folding import weights_stream
from mergestream.errors import NonFiniteError, PolicyError
from mergestream.io.checkpoints import open_checkpoint, read_state_dict
from mergestream.io.state import StateDir
from mergestream.policies import TensorContext, cmaes_coefficients, make_policy
from mergestream.policies.masks import magnitude_mask
from mergestream.policies.mdm_oc import gram_schmidt, orthogonal_factors
from mergestream.policies.recovery import PlainAdam
from mergestream.policies.safe_merge import masked_recovery, top_singular
from mergestream.policies.task_arithmetic import disjoint_mean, elect_sign, trim_top_k

from .conftest import perturb, random_model, save_tensors


def _models(tmp_path, dtype=torch.float32, n_experts=3, scale=0.05):
    base = random_model(0, dtype)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    experts = []
    for i in range(n_experts):
        experts.append(save_tensors(tmp_path / f"e{i}.safetensors", perturb(base, scale, seed=100 + i)))
    return bpath, experts


def _fold_chain(tmp_path, bpath, experts, policy, params, tag="run"):
    backbone = None
    state = tmp_path / f"{tag}-state"
    outs = []
    for i, e in enumerate(experts):
        out = tmp_path / f"{tag}-{i}"
        engine.fold(bpath, backbone, e, policy, params, state_dir=state, out=out)
        backbone = out
        outs.append(out)
    return outs, state


# -- Task Arithmetic ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_task_arithmetic_lambda_one_reproduces_the_expert(tmp_path, dtype):
    bpath, experts = _models(tmp_path, dtype, n_experts=1)
    out = tmp_path / "out"
    engine.fold(bpath, None, experts[0], "task_arithmetic", {"lambda": 1}, state_dir=tmp_path / "s", out=out)
    got, want = read_state_dict(out), read_state_dict(experts[0])
    for k, v in want.items():
        assert got[k].dtype == v.dtype
        if dtype == torch.float32 or not v.is_floating_point():
            assert torch.equal(got[k], v), k
        else:  # within one rounding step of the checkpoint dtype
            step = torch.finfo(dtype).eps * v.float().abs().clamp_min(torch.finfo(dtype).tiny)
            assert ((got[k].float() - v.float()).abs() <= step).all(), k


def test_continual_task_arithmetic_equals_offline_sum(tmp_path):
    bpath, experts = _models(tmp_path, n_experts=4)
    outs, _ = _fold_chain(tmp_path, bpath, experts, "task_arithmetic", {"lambda": 0.3})
    engine.merge(bpath, experts, "task_arithmetic", {"lambda": 0.3}, out=tmp_path / "offline")
    cont, off = read_state_dict(outs[-1]), read_state_dict(tmp_path / "offline")
    base = read_state_dict(bpath)
    exp_sum = {k: base[k] + 0.3 * sum(read_state_dict(e)[k] - base[k] for e in experts) for k in base
               if base[k].is_floating_point()}
    for k, v in exp_sum.items():
        torch.testing.assert_close(cont[k], v, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(off[k], v, rtol=1e-6, atol=1e-6)


# -- TIES -----------------------------------------------------------------------------------
def _ties_inputs(seed=0, k=4, shape=(64, 33)):
    g = torch.Generator().manual_seed(seed)
    taus = []
    for i in range(k):
        t = torch.randn(shape, generator=g)
        t[torch.rand(shape, generator=g) < 0.3] = 0.0  # explicit zeros
        taus.append(t)
    taus[1][:5] = -taus[0][:5]  # exact sign conflicts
    return taus


@pytest.mark.parametrize("k_percent,lam", [(20, 1.0), (50, 0.7), (100, 0.3)])
def test_offline_ties_equals_peft_oracle(k_percent, lam):
    taus = _ties_inputs()
    pol = make_policy("ties", {"k": k_percent, "lambda": lam})
    ours = pol.merge_tensor(torch.zeros_like(taus[0]), [t.clone() for t in taus], TensorContext("w"))
    oracle = peft_ties([t.clone() for t in taus], torch.full((len(taus),), lam), density=k_percent / 100)
    torch.testing.assert_close(ours, oracle, rtol=1e-6, atol=1e-7)


def test_ties_entry_with_no_agreeing_value_is_zero_not_nan():
    a = torch.tensor([1.0, 0.0, 0.0, -2.0])
    b = torch.tensor([-1.0, 0.0, 0.0, 2.0])
    trimmed = [a, b]
    sign = elect_sign(trimmed, [1.0, 1.0])
    merged = disjoint_mean(trimmed, [1.0, 1.0], sign)
    assert torch.isfinite(merged).all()
    assert merged[1] == 0 and merged[2] == 0  # all-zero entries: nobody agrees
    # a sign whose value nobody holds gives 0, never 0/0
    out = disjoint_mean([torch.tensor([0.0, 3.0])], [1.0], torch.tensor([1.0, -1.0]))
    assert out.tolist() == [0.0, 0.0]


def test_ties_no_fp16_overflow_on_large_deltas(tmp_path):
    base = {"w": torch.zeros(8, 8, dtype=torch.float16)}
    bpath = save_tensors(tmp_path / "b.safetensors", base)
    experts = [save_tensors(tmp_path / f"e{i}.safetensors", {"w": torch.full((8, 8), 60000.0 - i * 100, dtype=torch.float16)})
               for i in range(3)]
    engine.merge(bpath, experts, "ties", {"k": 100, "lambda": 1.0}, out=tmp_path / "out")
    got = read_state_dict(tmp_path / "out")["w"]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), torch.full((8, 8), 59900.0), rtol=1e-3, atol=0)
    # continual form: Δ/λ·n sums stay in float32 too
    outs, _ = _fold_chain(tmp_path, bpath, experts, "ties", {"k": 100, "lambda": 1.0})
    assert torch.isfinite(read_state_dict(outs[-1])["w"]).all()


def test_result_that_overflows_its_dtype_is_refused_and_nothing_written(tmp_path):
    bpath = save_tensors(tmp_path / "b.safetensors", {"w": torch.full((4,), 60000.0, dtype=torch.float16)})
    e = save_tensors(tmp_path / "e.safetensors", {"w": torch.full((4,), 65000.0, dtype=torch.float16)})
    with pytest.raises(NonFiniteError, match="w"):
        engine.fold(bpath, None, e, "task_arithmetic", {"lambda": 3.0}, state_dir=tmp_path / "s", out=tmp_path / "o")
    assert not (tmp_path / "o").exists()
    assert not (tmp_path / "s" / "manifest.json").exists()


def test_trim_keeps_exactly_k_percent():
    t = torch.randn(100, 37)
    kept = trim_top_k(t, 20)
    assert int((kept != 0).sum()) == int(0.2 * t.numel())
    assert kept.abs().min() == 0 and kept.abs().max() == t.abs().max()


@pytest.mark.parametrize("shape", [(64, 33), (1100, 1000)], ids=["small", "bracketed-trim"])
@pytest.mark.parametrize("n,lam,k", [(1, 1.0, 20), (3, 0.7, 50), (2, 0.5, 100)])
def test_continual_ties_later_fold_is_the_two_input_ties_of_the_earlier_merge_and_tau(shape, n, lam, k):
    """A later continual TIES fold (written into the inputs' buffers, two temporaries) is exactly the
    generic two-input TIES: trim both, elect the sign with weights (n, 1), disjoint mean, Δ = λ·τ_m −
    (θ_{t−1} − θ₀); with explicit zeros, exact sign conflicts and entries whose weighted sum is 0."""
    g = torch.Generator().manual_seed(n)
    base = torch.randn(shape, generator=g)
    prev, tau = _ties_inputs(seed=n, k=2, shape=shape)
    prev[-3:] = tau[-3:] / -n  # n·prev + τ = 0 exactly where both survive the trim: +1 is elected
    backbone = base + lam * prev
    pol = make_policy("ties", {"k": k, "lambda": lam})
    got = pol.fold_tensor(base.clone(), backbone.clone(), tau.clone(), {}, TensorContext("w", n_previous=n))
    trimmed = [trim_top_k((backbone - base) / lam, k), trim_top_k(tau, k)]
    merged = disjoint_mean(trimmed, [float(n), 1.0], elect_sign(trimmed, [float(n), 1.0]))
    want = lam * merged - (backbone - base)
    torch.testing.assert_close(got.full_delta(), want, rtol=1e-5, atol=1e-6)


def test_continual_ties_first_fold_equals_offline_single(tmp_path):
    bpath, experts = _models(tmp_path, n_experts=1)
    engine.fold(bpath, None, experts[0], "ties", {"k": 20}, state_dir=tmp_path / "s", out=tmp_path / "c")
    engine.merge(bpath, experts, "ties", {"k": 20}, out=tmp_path / "o")
    c, o = read_state_dict(tmp_path / "c"), read_state_dict(tmp_path / "o")
    for k in c:
        assert torch.equal(c[k], o[k]), k


# -- SAFE-Merge -----------------------------------------------------------------------------
def _safe_inputs(m=160, n=140, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(m, n, generator=g)
    tau = 0.01 * torch.randn(m, n, generator=g) + 0.02 * torch.randn(m, 3, generator=g) @ torch.randn(3, n, generator=g)
    return base, tau


@pytest.mark.parametrize("rho", [0.05, 0.1, 0.37])
def test_safe_merge_mask_and_unchanged_entries(rho):
    base, tau = _safe_inputs()
    backbone = base + 0.01 * torch.randn_like(base)
    pol = make_policy("safe_merge", {"rho": rho, "lambda": 0.5, "k": 16, "k_s": 16, "steps": 10})
    res = pol.fold_tensor(base, backbone, tau.clone(), {}, TensorContext("layer.w", n_previous=1, seed=3))
    assert res.stats["kept"] == round(rho * tau.numel())
    out = backbone + res.delta
    changed = out != backbone
    assert int(changed.sum()) <= res.stats["kept"]
    assert torch.equal(out[~changed], backbone[~changed])
    # the cached general subspace is part of the state
    assert set(res.state) == {"U0", "V0"} and res.state["U0"].shape == (160, 16)


def test_safe_merge_outside_mask_is_bit_for_bit_unchanged_in_bf16(tmp_path):
    base = {"layer.w": torch.randn(140, 150).to(torch.bfloat16)}
    bpath = save_tensors(tmp_path / "b.safetensors", base)
    e = save_tensors(tmp_path / "e.safetensors", perturb(base, 0.05, 1))
    out = tmp_path / "o"
    rep = engine.fold(bpath, None, e, "safe_merge", {"rho": 0.1, "k": 8, "k_s": 8, "steps": 5},
                      state_dir=tmp_path / "s", out=out)
    got = read_state_dict(out)["layer.w"]
    changed = got != base["layer.w"]
    assert int(changed.sum()) <= round(0.1 * got.numel())
    assert abs(rep.stats["kept_fraction"] - 0.1) < 1e-4


@pytest.mark.parametrize("rho", [0.001, 0.1, 0.5, 0.97])
@pytest.mark.parametrize("ties", [False, True])
def test_magnitude_mask_keeps_exactly_the_top_scores(rho, ties, monkeypatch):
    """The bracketed selection keeps round(ρ·n) entries whose scores are the top-k's (as a multiset:
    which of tied entries is kept is free), with heavy ties too, and so does its fallback."""
    from mergestream.policies import (
        masks as safe_merge,  # the selection's one home (TIES and SAFE-Merge)
    )

    g = torch.Generator().manual_seed(3)
    score = torch.randn(1100, 1000, generator=g).abs()
    if ties:
        score = (score * 8).round() / 8  # a few dozen distinct values: ties at every boundary
    keep = round(rho * score.numel())
    want = torch.topk(score.reshape(-1), keep, sorted=False).values.sort().values
    bracket, fell_back = safe_merge._bracket_top, []
    monkeypatch.setattr(safe_merge, "_bracket_top", lambda f, k: fell_back.append(bracket(f, k) is None) or bracket(f, k))
    for half_width in (safe_merge._BRACKET_HALF_WIDTH, 0.0):  # 0: the bracket may miss, the fallback runs
        monkeypatch.setattr(safe_merge, "_BRACKET_HALF_WIDTH", half_width)
        mask = magnitude_mask(score, rho)
        assert mask.shape == score.shape and mask.dtype == torch.bool and int(mask.sum()) == keep
        assert torch.equal(score[mask].sort().values, want)
    assert fell_back[0] is False  # the fast path itself, ties or not
    assert not magnitude_mask(score, 1e-9).any() and magnitude_mask(score, 1.0).all()


def _gapped(m, n, rank, seed, scale=1.0):
    """(m, n) float32 of rank-``rank`` signal (singular values 10..5) plus 1e-3 noise: a clear gap
    after the rank-th singular value, so randomised subspace iteration converges to the exact one."""
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(m, rank, generator=g)).Q
    v = torch.linalg.qr(torch.randn(n, rank, generator=g)).Q
    return scale * ((u * torch.linspace(10, 5, rank)) @ v.T + 1e-3 * torch.randn(m, n, generator=g))


@pytest.mark.parametrize("product_dtype", [None, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(300, 700), (700, 300)])
def test_randomized_svd_projected_is_the_svd_of_the_formed_projection(shape, product_dtype):
    """Top-k triplets of (I − U₀U₀ᵀ) a (I − V₀V₀ᵀ) without forming it: the same subspaces and
    singular values as an exact SVD of the formed matrix, U ⊥ U₀, V ⊥ V₀, and Uᵀ a V = diag(σ),
    also with all but the last power-iteration product in bfloat16 (with every one in bfloat16,
    U's projector was off by 2e-4)."""
    from mergestream.policies.lowrank import exact_top_singular, randomized_svd_projected

    m, n = shape
    u0, v0 = exact_top_singular(_gapped(m, n, 12, seed=1), 12)
    k = 20  # a⊥ keeps the rank-20 signal's gap: σ₂₀ ~ 5 against noise ~ 0.03
    a = _gapped(m, n, k, seed=2) + u0 @ torch.randn(12, n) + torch.randn(m, 12) @ v0.T  # mass inside U₀, V₀ too
    u, s, v = randomized_svd_projected(a, u0, v0, k, oversample=10, niter=3, seed=0, product_dtype=product_dtype)
    assert u.shape == (m, k) and s.shape == (k,) and v.shape == (n, k)
    assert u.dtype == s.dtype == v.dtype == torch.float32
    perp = a.double() - u0.double() @ (u0.double().T @ a.double())
    perp = perp - (perp @ v0.double()) @ v0.double().T
    ur, sr, vhr = torch.linalg.svd(perp, full_matrices=False)
    assert torch.allclose(s.double(), sr[:k], rtol=1e-4)
    assert torch.allclose(u.double() @ u.double().T, ur[:, :k] @ ur[:, :k].T, atol=1e-4)
    assert torch.allclose(v.double() @ v.double().T, vhr[:k].T @ vhr[:k], atol=1e-4)
    assert float((u0.T @ u).abs().max()) < 1e-5 and float((v0.T @ v).abs().max()) < 1e-5
    assert torch.allclose(u.T @ a @ v, torch.diag(s), atol=1e-4 * float(s[0]))


@pytest.mark.parametrize("shape", [(300, 700), (700, 300)])
def test_randomized_right_singular_in_bfloat16_is_the_exact_v(shape):
    """V alone with every power-iteration product in bfloat16 (the last too): the exact SVD's top-k
    right subspace to float32 precision, as V from the float32 iteration is."""
    from mergestream.policies.lowrank import exact_top_singular, randomized_right_singular, randomized_svd

    m, n = shape
    k = 20
    a = _gapped(m, n, k, seed=9)
    _, v_exact = exact_top_singular(a, k)
    want = v_exact.double() @ v_exact.double().T
    v16 = randomized_right_singular(a, k, oversample=10, niter=3, seed=0, product_dtype=torch.bfloat16)
    _, v32 = randomized_svd(a, k, oversample=10, niter=3, seed=0)
    assert v16.shape == (n, k) and v16.dtype == torch.float32
    assert torch.allclose(v16.T @ v16, torch.eye(k), atol=1e-5)
    for v in (v16, v32):
        assert torch.allclose(v.double() @ v.double().T, want, atol=1e-5)

@pytest.mark.parametrize("product_dtype", [None, torch.bfloat16], ids=["float32", "bfloat16"])
def test_safe_merge_risk_above_the_exact_side_equals_the_formed_tau_perp(monkeypatch, product_dtype):
    """Above EXACT_MAX_SIDE the risk never forms τ_⊥ and takes S = U_s diag(σ_s) V_sᵀ: the same risk
    as the formula of METHODS.md §safe_merge steps 2-3 written out with τ_⊥ formed and exact SVDs,
    also with the subspace iteration's products in bfloat16 (``svd_products``)."""
    from mergestream.policies import safe_merge
    from mergestream.policies.lowrank import exact_top_singular

    m, n, k, k_s = 260, 380, 10, 6
    u0, v0 = exact_top_singular(_gapped(m, n, k, seed=3), k)
    tau = _gapped(m, n, k_s, seed=4, scale=0.01) + 0.003 * (u0 @ torch.randn(k, n) + torch.randn(m, k) @ v0.T)
    td, ud, vd = tau.double(), u0.double(), v0.double()
    perp = td - ud @ (ud.T @ td)
    perp = perp - (perp @ vd) @ vd.T
    ur, _, vhr = torch.linalg.svd(perp, full_matrices=False)
    us, vs = ur[:, :k_s], vhr[:k_s].T
    g_ = (ud @ ud.T @ td @ vd @ vd.T).abs()
    s_ = (us @ us.T @ td @ vs @ vs.T).abs()
    want = g_ / (g_ + s_ + 1e-12)
    monkeypatch.setattr(safe_merge, "EXACT_MAX_SIDE", 100)  # this matrix takes the randomised path
    got = safe_merge.risk_scores(tau, u0, v0, k_s, product_dtype=product_dtype).double()
    # r is a ratio of small numbers where both |G| and |S| are near 0; compare where either is not
    big = (g_ + s_) > 1e-3 * float((g_ + s_).max())
    assert big.float().mean() > 0.5
    assert torch.allclose(got[big], want[big], atol=2e-3)
    mask_got = magnitude_mask(((1 - got) * td.abs()).float(), 0.1)
    mask_want = magnitude_mask(((1 - want) * td.abs()).float(), 0.1)
    assert float((mask_got & mask_want).sum()) / float(mask_want.sum()) > 0.995



def test_svd_products_choice_follows_the_device():
    """``svd_products``: float32 → None, bfloat16 → bfloat16, auto → bfloat16 exactly where the CPU
    has native bfloat16 dot products (the capabilities torch reports for this machine)."""
    from mergestream.policies.lowrank import native_low_precision_dtype

    caps = torch.cpu.get_capabilities()
    native = torch.bfloat16 if caps.get("avx512_bf16") or caps.get("amx_bf16") else None
    assert native_low_precision_dtype("cpu") is native
    cpu = torch.device("cpu")
    assert make_policy("safe_merge", {}).product_dtype(cpu) is native  # the default is auto
    assert make_policy("safe_merge", {"svd_products": "float32"}).product_dtype(cpu) is None
    assert make_policy("safe_merge", {"svd_products": "bfloat16"}).product_dtype(cpu) is torch.bfloat16
    with pytest.raises(PolicyError, match="svd_products"):
        make_policy("safe_merge", {"svd_products": "float16"})


def test_safe_merge_fold_with_bfloat16_products_matches_float32(monkeypatch):
    """A first and a later SAFE-Merge fold of a matrix on the randomised path give the same mask
    (≥ 99.5% of the kept entries), the same Δ on the entries both keep (within 5% of ‖Δ‖: the
    recovery's Adam run starts from slightly different V_new, V_old) and the same U₀, V₀ subspaces
    in the state with ``svd_products`` bfloat16 as with float32."""
    from mergestream.policies import safe_merge

    monkeypatch.setattr(safe_merge, "EXACT_MAX_SIDE", 100)
    m, n = 240, 420
    base = _gapped(m, n, 16, seed=5)
    tau = _gapped(m, n, 8, seed=6, scale=0.01) + 0.002 * torch.randn(m, n, generator=torch.Generator().manual_seed(7))
    backbone = base + 0.3 * _gapped(m, n, 8, seed=8, scale=0.01)
    params = {"k": 16, "k_s": 8, "steps": 20, "k_old": 8}
    for n_prev, bb in ((0, base), (1, backbone)):
        ctx = lambda: TensorContext("layer.w", n_previous=n_prev, seed=3)  # noqa: E731
        f32 = make_policy("safe_merge", {**params, "svd_products": "float32"}).fold_tensor(
            base, bb, tau.clone(), {}, ctx())
        b16 = make_policy("safe_merge", {**params, "svd_products": "bfloat16"}).fold_tensor(
            base, bb, tau.clone(), {}, ctx())
        kept32, kept16 = f32.delta != 0, b16.delta != 0
        assert float((kept32 & kept16).sum()) / float(kept32.sum()) > 0.995
        both = kept32 & kept16
        assert float((b16.delta - f32.delta)[both].norm()) < 0.05 * float(f32.delta.norm())
        for key in ("U0", "V0"):
            a, b = f32.state[key], b16.state[key]
            assert torch.allclose(a @ a.T, b @ b.T, atol=1e-4)

def test_safe_merge_recovery_loss_decreases():
    base, tau = _safe_inputs()
    mask = magnitude_mask(tau.abs(), 0.1)
    prev = 0.02 * torch.randn_like(tau)
    _, losses = masked_recovery(tau, mask, prev, rank=8, steps=40, lambda_old=1.0, lr_scale=0.1,
                                k_new=8, k_old=16, seed=0)
    assert len(losses) == 41
    assert losses[-1] < 0.7 * losses[0]
    assert min(losses) < losses[0]


def _dense_recovery(tau, mask, delta_prev, *, rank, steps, lambda_old, lr_scale, k_new, k_old, seed=0):
    """The recovery written densely with autograd (METHODS.md §safe_merge step 6): the oracle for the
    sparse formulation in mergestream."""
    mf = mask.float()
    d0 = tau * mf
    _, v_new = top_singular(tau, k_new, seed=seed)
    v_old = top_singular(delta_prev, k_old, seed=seed + 1)[1] if delta_prev is not None else None
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(rank, tau.shape[1], generator=gen) / rank**0.5).requires_grad_(True)
    b = torch.zeros(tau.shape[0], rank, requires_grad=True)
    opt = torch.optim.Adam([a, b], lr=lr_scale * float(tau.std()))
    losses = []
    for _ in range(steps + 1):
        corr = (b @ a) * mf
        loss = ((d0 - tau) @ v_new + corr @ v_new).square().sum()
        if v_old is not None:
            loss = loss + lambda_old * (d0 @ v_old + corr @ v_old).square().sum()
        losses.append(float(loss.detach()))
        if len(losses) > steps:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    return (d0 + (b @ a) * mf).detach(), losses


@pytest.mark.parametrize("blocks", ["one block", "column blocks"])
@pytest.mark.parametrize("transpose", ["sampled", "gathered"])
@pytest.mark.parametrize("with_previous,rho", [(False, 0.1), (True, 0.1), (True, 0.5), (False, 1.0)])
def test_safe_merge_sparse_recovery_equals_the_dense_formulation(with_previous, rho, transpose, blocks, monkeypatch):
    """Both ways to Gᵀ (sampled on Sᵀ's pattern for narrow W, S's values gathered for wide W), on the
    whole mask or cut into column blocks (uneven last one), give the dense formulation's D and
    losses."""
    from mergestream.policies import recovery

    monkeypatch.setattr(recovery, "SAMPLE_T_MAX_K", 1000 if transpose == "sampled" else 0)
    monkeypatch.setattr(recovery, "GATHER_MAX_NNZ", 0)  # these small masks would always gather
    if blocks == "column blocks":  # 4 blocks of 43, 43, 43, 41 columns at K = 14, 2 of 85 at K = 5
        monkeypatch.setattr(recovery, "BLOCK_BYTES", 170 * 14 * 4 // 4 + 1)
    base, tau = _safe_inputs(m=150, n=170, seed=3)
    mask = magnitude_mask(tau.abs(), rho)
    prev = 0.02 * torch.randn(tau.shape, generator=torch.Generator().manual_seed(4)) if with_previous else None
    kw = dict(rank=6, steps=25, lambda_old=0.7, lr_scale=0.1, k_new=5, k_old=9, seed=2)
    got, got_losses = masked_recovery(tau, mask, prev, **kw)
    want, want_losses = _dense_recovery(tau, mask, prev, **kw)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-6 * float(tau.abs().max()))
    assert not bool(got[~mask].any())  # D is zero outside M
    assert got_losses == pytest.approx(want_losses, rel=1e-4, abs=1e-9)


@pytest.mark.parametrize("with_previous", [False, True])
def test_safe_merge_recovery_gives_the_same_bits_whichever_way_it_builds_g_transposed(with_previous, monkeypatch):
    """Gᵀ sampled on Sᵀ's pattern and Gᵀ gathered from G's values are the same products summed in
    the same order: D and the losses agree bit for bit, on one block and on column blocks, so the
    choice between them (by K and by the block's kept entries) moves only time."""
    from mergestream.policies import recovery

    base, tau = _safe_inputs(m=150, n=170, seed=5)
    mask = magnitude_mask(tau.abs(), 0.2)
    prev = 0.02 * torch.randn(tau.shape, generator=torch.Generator().manual_seed(8)) if with_previous else None
    kw = dict(rank=6, steps=12, lambda_old=0.7, lr_scale=0.1, k_new=5, k_old=9, seed=2)
    results = {}
    for budget in (1 << 40, 170 * 6 * 4 // 3):  # one block; three column blocks at K = 5 or 14
        monkeypatch.setattr(recovery, "BLOCK_BYTES", budget)
        for way, (max_k, max_nnz) in {"sampled": (1000, 0), "gathered": (0, 0), "by size": (1000, 1 << 40)}.items():
            monkeypatch.setattr(recovery, "SAMPLE_T_MAX_K", max_k)
            monkeypatch.setattr(recovery, "GATHER_MAX_NNZ", max_nnz)
            results[budget, way] = masked_recovery(tau.clone(), mask, prev, **kw)
    for (budget, way), (d, losses) in results.items():
        ref_d, ref_losses = results[budget, "sampled"]
        assert torch.equal(d, ref_d) and losses == ref_losses, (budget, way)


def test_column_blocks_cover_the_kept_entries_once_and_drop_empty_blocks(monkeypatch):
    """The blocks' ``flat`` positions are exactly the mask's kept entries (in the whole matrix's
    numbering), each block's S holds its columns' entries, an all-false column range gives no block,
    and the recovery on such a mask still equals the dense formulation (the empty columns' rows of Aᵀ
    get zero gradient there too)."""
    from mergestream.policies import recovery

    base, tau = _safe_inputs(m=120, n=200, seed=6)
    mask = magnitude_mask(tau.abs(), 0.2)
    mask[:, 40:110] = False  # covers the whole second of four 50-column blocks
    monkeypatch.setattr(recovery, "BLOCK_BYTES", 200 * 10 * 4 // 4)  # K = 10: 4 blocks of 50 columns
    blocks = recovery.column_blocks(mask, 10)
    assert [(b.columns.start, b.columns.stop) for b in blocks] == [(0, 50), (100, 150), (150, 200)]
    flat = torch.cat([b.flat for b in blocks]).sort().values
    assert torch.equal(flat, mask.reshape(-1).nonzero().squeeze(1))
    for b in blocks:
        b.values.fill_(1.0)
        assert torch.equal(b.s.to_dense().bool(), mask[:, b.columns])
    assert recovery.column_blocks(torch.zeros(5, 7, dtype=torch.bool), 3) == []
    kw = dict(rank=4, steps=15, lambda_old=1.0, lr_scale=0.1, k_new=4, k_old=6, seed=1)
    prev = 0.02 * torch.randn(tau.shape, generator=torch.Generator().manual_seed(2))
    got, got_losses = masked_recovery(tau, mask, prev, **kw)
    want, want_losses = _dense_recovery(tau, mask, prev, **kw)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-6 * float(tau.abs().max()))
    assert got_losses == pytest.approx(want_losses, rel=1e-4, abs=1e-9)


@pytest.mark.parametrize("shape,rank", [((40, 300), None), ((300, 40), None), ((64, 64), None), ((50, 200), 5),
                                        ((200, 50), 0)])
def test_exact_top_singular_spans_the_svd_subspaces(shape, rank):
    """The Gram route gives the full SVD's top-k subspaces (projectors U Uᵀ, V Vᵀ) and orthonormal
    columns, on wide, tall and square matrices; rank-deficient and zero ones take the SVD fallback."""
    from mergestream.policies.lowrank import exact_top_singular

    g = torch.Generator().manual_seed(1)
    w = torch.randn(*shape, generator=g) * torch.logspace(0, -3, shape[1])
    if rank is not None:
        w = torch.randn(shape[0], rank, generator=g) @ torch.randn(rank, shape[1], generator=g)
    k = 12
    u, v = exact_top_singular(w, k)
    assert u.shape == (shape[0], k) and v.shape == (shape[1], k) and u.dtype == v.dtype == torch.float32
    ur, _, vhr = torch.linalg.svd(w.double(), full_matrices=False)
    kk = k if rank is None else rank  # beyond the rank the vectors are any orthonormal completion
    assert torch.allclose(u[:, :kk].double() @ u[:, :kk].double().T, ur[:, :kk] @ ur[:, :kk].T, atol=1e-5)
    assert torch.allclose(v[:, :kk].double() @ v[:, :kk].double().T, vhr[:kk].T @ vhr[:kk], atol=1e-5)
    for x in (u, v):
        assert torch.allclose(x.T @ x, torch.eye(k), atol=1e-5)


@pytest.mark.parametrize("lr", [1e-3, 0.5, 1e-9])
def test_plain_adam_is_torch_adam_step_for_step(lr):
    """The recovery's Adam gives torch.optim.Adam's values at every step (bit for bit), gradients of
    every scale included (tiny, zero, huge)."""
    gen = torch.Generator().manual_seed(7)
    params = [torch.randn(5, 33, generator=gen), torch.randn(70, 3, generator=gen)]
    ours = [p.clone() for p in params]
    ref = [p.clone() for p in params]
    opt_ref = torch.optim.Adam(ref, lr=lr)
    opt = PlainAdam(ours, lr=lr)
    for step in range(30):
        scale = (1e-30, 0.0, 1.0, 1e20)[step % 4]
        for g, r in zip(opt.grads, ref):
            g.copy_(torch.randn(g.shape, generator=gen) * scale)
            r.grad = g.clone()
        opt.step()
        opt_ref.step()
        for a, b in zip(ours, ref):
            assert torch.equal(a, b), step


@pytest.mark.parametrize("params", [{}, {"iso_alpha": 2.0}, {"risk_mask": False}, {"project_rank": 4},
                                    {"steps": 0}])
def test_safe_merge_with_the_engines_scratch_buffers_equals_fresh_memory(params):
    """SAFE-Merge's (m, n) temporaries in the engine's per-thread buffers (TensorContext.buffers):
    the same Δ_t and state, bit for bit, as with fresh memory, over three folds of tensors of
    several shapes folded in turn on one thread (a buffer reused for a smaller tensor, and for
    the next tensor while the last one's results are still held, must not leak into them)."""
    from mergestream.engine.stream import clear_scratch, policy_scratch

    gen = torch.Generator().manual_seed(11)
    shapes = [(300, 420), (140, 150), (300, 420), (96,), (160, 700)]
    pol = make_policy("safe_merge", {"k": 16, "k_s": 16, "rank": 4, "steps": 5, **params})
    bases = [0.02 * torch.randn(sh, generator=gen) for sh in shapes]
    runs = {}
    for buffers in (None, policy_scratch):
        clear_scratch()
        backbones, states, held = [b.clone() for b in bases], [{} for _ in shapes], []
        for t in range(3):
            for i, sh in enumerate(shapes):
                tau = 0.002 * torch.randn(sh, generator=torch.Generator().manual_seed(100 * t + i))
                ctx = TensorContext(f"w{i}", n_previous=t, seed=i, buffers=buffers)
                res = pol.fold_tensor(bases[i], backbones[i], tau, states[i], ctx)
                held.append(res)  # still referenced while the next tensors fold
                backbones[i] = backbones[i] + res.scale * res.delta
                states[i] = {k: v.clone() for k, v in res.state.items()}
        runs[buffers] = backbones, states, [(r.delta.clone(), r.stats) for r in held]
    clear_scratch()
    fresh, engine = runs[None], runs[policy_scratch]
    for a, b in zip(fresh[0], engine[0]):
        assert torch.equal(a, b)
    for a, b in zip(fresh[1], engine[1]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for (da, sa), (db, sb) in zip(fresh[2], engine[2]):
        assert torch.equal(da, db) and sa == sb


def test_masked_recovery_in_place_builds_d_in_tau_and_equals_the_copy():
    _, tau = _safe_inputs(m=150, n=170, seed=5)
    mask = magnitude_mask(tau.abs(), 0.2)
    kw = dict(rank=4, steps=6, lambda_old=1.0, lr_scale=0.1, k_new=4, k_old=4, seed=1)
    keep = tau.clone()
    d, losses = masked_recovery(tau, mask, None, **kw)
    assert torch.equal(tau, keep)  # the default leaves τ alone
    d2, losses2 = masked_recovery(tau, mask, None, **kw, in_place=True)
    assert d2.data_ptr() == tau.data_ptr() and torch.equal(d, d2) and losses == losses2


def test_safe_merge_recovery_with_an_empty_mask_is_zero():
    _, tau = _safe_inputs()
    d, losses = masked_recovery(tau, torch.zeros_like(tau, dtype=torch.bool), None, rank=4, steps=5, lambda_old=1.0,
                                lr_scale=0.1, k_new=4, k_old=4)
    assert not bool(d.any()) and losses == []


def test_safe_merge_projected_update_is_orthogonal_to_the_previous_block(tmp_path):
    """project_rank r: the second fold's update (ρ = 1, no recovery, no risk mask, so Δ = λτ') has
    no component in the top-r singular block of Δ₁; r = 0 is the plain policy, byte for byte."""
    bpath, experts = _models(tmp_path, n_experts=2)
    params = {"rho": 1, "lambda": 1, "steps": 0, "k": 4, "k_s": 4, "risk_mask": False}
    proj, _ = _fold_chain(tmp_path, bpath, experts, "safe_merge", {**params, "project_rank": 3}, "p")
    plain, _ = _fold_chain(tmp_path, bpath, experts, "safe_merge", params, "n")
    off, _ = _fold_chain(tmp_path, bpath, experts, "safe_merge", {**params, "project_rank": 0}, "o")
    base = read_state_dict(bpath)
    v1, v2p, v2n, v2o = (read_state_dict(x) for x in (proj[0], proj[1], plain[1], off[1]))
    checked = 0
    for k, b in base.items():
        assert torch.equal(v2n[k], v2o[k]), k
        if b.ndim != 2 or min(b.shape) < 8 or "embed" in k:  # embeddings: magnitude mask only
            continue
        d1 = v1[k].double() - b.double()
        u, _, vh = torch.linalg.svd(d1, full_matrices=False)
        step = v2p[k].double() - v1[k].double()
        block = u[:, :3].T @ step @ vh[:3].T
        plain_block = u[:, :3].T @ (v2n[k].double() - v1[k].double()) @ vh[:3].T
        assert float(block.norm()) < 1e-4 * float(plain_block.norm()) + 1e-6, k
        checked += 1
    assert checked


def test_safe_merge_rho_one_without_recovery_equals_task_arithmetic(tmp_path):
    bpath, experts = _models(tmp_path, n_experts=2)
    sm, _ = _fold_chain(tmp_path, bpath, experts, "safe_merge", {"rho": 1, "lambda": 1, "steps": 0, "k": 4, "k_s": 4}, "sm")
    ta, _ = _fold_chain(tmp_path, bpath, experts, "task_arithmetic", {"lambda": 1}, "ta")
    a, b = read_state_dict(sm[-1]), read_state_dict(ta[-1])
    for k in a:
        assert torch.equal(a[k], b[k]), k


# -- MDM-OC ---------------------------------------------------------------------------------
@pytest.mark.parametrize("rank", [0, 4])
def test_mdm_oc_directions_orthogonal_and_unmerge(tmp_path, rank):
    bpath, experts = _models(tmp_path, n_experts=5)
    params = {"alpha": 0.5, "rank": rank}
    outs, state = _fold_chain(tmp_path, bpath, experts, "mdm_oc", params, "oc")
    sd = StateDir(state)
    pol = make_policy("mdm_oc", params)
    base = read_state_dict(bpath)
    for name, t in base.items():
        if not t.is_floating_point():
            continue
        st = sd.tensor_state(name)
        dirs = [pol._direction(st, i, t.shape).reshape(-1) for i in range(5)]
        for i in range(5):
            for j in range(i + 1, 5):
                ni, nj = dirs[i].norm(), dirs[j].norm()
                if ni > 0 and nj > 0:
                    cos = float(torch.dot(dirs[i], dirs[j]) / (ni * nj))
                    assert abs(cos) < 1e-5, (name, i, j, cos)
    sd.close()
    # subtract-unmerge of the last expert restores the previous backbone
    engine.unmerge(state, "e4", "subtract", out=tmp_path / "minus-last")
    got, prev = read_state_dict(tmp_path / "minus-last"), read_state_dict(outs[-2])
    for k, v in prev.items():
        if v.is_floating_point():
            assert float((got[k] - v).norm() / v.norm()) < 1e-6, k
    assert StateDir(state).manifest.ids() == ["e0", "e1", "e2", "e3"]


def test_mdm_oc_replay_unmerge_of_first_equals_folding_the_others_from_scratch(tmp_path):
    bpath, experts = _models(tmp_path, n_experts=5)
    params = {"alpha": 0.4}
    _, state = _fold_chain(tmp_path, bpath, experts, "mdm_oc", params, "all")
    engine.unmerge(state, "e0", "replay", out=tmp_path / "replayed")
    scratch, _ = _fold_chain(tmp_path, bpath, experts[1:], "mdm_oc", params, "scratch")
    a, b = read_state_dict(tmp_path / "replayed"), read_state_dict(scratch[-1])
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert StateDir(state).manifest.ids() == ["e1", "e2", "e3", "e4"]


def test_gram_schmidt_projects_into_null_space():
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(500, 6, generator=g))[0].T.contiguous()
    tau = torch.randn(500, generator=g)
    d = gram_schmidt(tau, basis)
    assert (basis @ d).abs().max() < 1e-5
    # the part of τ already in the null space is untouched
    inside = tau - basis.T @ (basis @ tau)
    torch.testing.assert_close(d, inside, atol=1e-5, rtol=1e-5)


def test_factored_directions_exhaust_gracefully():
    tau = torch.randn(6, 4)
    L, R = orthogonal_factors(tau, torch.zeros(4, 0), 3)
    L2, R2 = orthogonal_factors(tau, R, 3)  # only one dimension left
    assert (R.T @ R2).abs().max() < 1e-5
    assert int((R2.abs().sum(0) > 0).sum()) == 1
    L3, R3 = orthogonal_factors(tau, torch.cat([R, R2], 1), 3)
    assert float(L3.norm()) == 0.0


def test_mdm_oc_cmaes_coefficients_through_the_engine(tmp_path):
    bpath, experts = _models(tmp_path, n_experts=2)
    base = read_state_dict(bpath)
    target = {k: base[k] + 0.8 * (read_state_dict(experts[0])[k] - base[k]) + 0.2 * (read_state_dict(experts[1])[k] - base[k])
              for k in base if base[k].is_floating_point()}
    calls = []

    def objective(alphas, weights):
        calls.append(list(alphas))
        return float(sum(((t - target[n]) ** 2).sum() for n, t in weights() if n in target))

    params = {"alpha": 0.3, "coefficients": "cmaes", "budget": 60, "stability": 0.0, "sigma": 0.3}
    engine.fold(bpath, None, experts[0], "mdm_oc", params, state_dir=tmp_path / "s", out=tmp_path / "o1",
                objective=objective)
    rep = engine.fold(bpath, tmp_path / "o1", experts[1], "mdm_oc", params, state_dir=tmp_path / "s",
                      out=tmp_path / "o2", objective=objective)
    assert len(rep.coefficients) == 2
    start_loss = objective(np.array([rep.coefficients[0], 0.3]), lambda: weights_stream(
        make_policy("mdm_oc", params), open_checkpoint(bpath), StateDir(tmp_path / "s").path /
        StateDir(tmp_path / "s").manifest.state_file, [rep.coefficients[0], 0.3], torch.device("cpu")))
    got = read_state_dict(tmp_path / "o2")
    final = float(sum(((got[k] - target[k]) ** 2).sum() for k in target))
    assert final <= start_loss + 1e-6
    assert abs(rep.coefficients[0] - 0.8) < 0.15  # moved toward the optimum


def test_mdm_oc_cmaes_without_objective_is_a_clear_error(tmp_path):
    bpath, experts = _models(tmp_path, n_experts=1)
    with pytest.raises(PolicyError, match="objective"):
        engine.fold(bpath, None, experts[0], "mdm_oc", {"coefficients": "cmaes"}, state_dir=tmp_path / "s",
                    out=tmp_path / "o")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("dim", [1, 3])
def test_cmaes_respects_budget_and_never_worsens(dim):
    evals = []

    def f(x):
        evals.append(x.copy())
        return float(np.sum((x - 1.7) ** 2))

    start = [0.3] * dim
    best, loss, used = cmaes_coefficients(f, start, start[:-1], stability=0.1, budget=25, sigma=0.3)
    assert used <= 25 and len(evals) == used
    start_loss = float(np.sum((np.array(start) - 1.7) ** 2))
    assert loss <= start_loss
    assert float(np.sum((best - 1.7) ** 2)) < start_loss


@pytest.mark.parametrize("dim", [1, 2, 4])
@pytest.mark.parametrize("budget", [1, 2, 9, 30])
def test_cmaes_returns_the_start_when_nothing_beats_it(dim, budget):
    """An objective whose minimum is the start point (and a rugged one around it): CMA-ES may only
    return the start, with its loss, after at most ``budget`` evaluations."""
    start = np.linspace(0.2, 0.6, dim)
    rng = np.random.default_rng(0)
    calls = []

    def f(x):
        calls.append(x.copy())
        d = float(np.sum((x - start) ** 2))
        return d + (0.0 if d == 0 else 0.5 + abs(rng.standard_normal()))  # every other point is worse

    best, loss, used = cmaes_coefficients(f, list(start), list(start[:-1]), stability=1.0, budget=budget, sigma=0.3)
    assert used == len(calls) <= budget
    np.testing.assert_array_equal(best, start)
    assert loss == 0.0
    np.testing.assert_array_equal(calls[0], start)  # the start is evaluated first


# -- OPCM and MagMax -----------------------------------------------------------------------
def test_opcm_keeps_merged_norm_at_running_mean(tmp_path):
    bpath, experts = _models(tmp_path, n_experts=3)
    outs, _ = _fold_chain(tmp_path, bpath, experts, "opcm", {"alpha": 0.5})
    base = read_state_dict(bpath)
    got = read_state_dict(outs[-1])
    name = "layer.0.attn.weight"
    norms = [float((read_state_dict(e)[name] - base[name]).norm()) for e in experts]
    assert abs(float((got[name] - base[name]).norm()) - np.mean(norms)) < 1e-4 * np.mean(norms)
    first = read_state_dict(outs[0])
    torch.testing.assert_close(first[name], read_state_dict(experts[0])[name])  # λ₁ = 1


def test_magmax_picks_largest_magnitude(tmp_path):
    bpath, experts = _models(tmp_path, n_experts=3)
    outs, _ = _fold_chain(tmp_path, bpath, experts, "magmax", {"lambda": 1.0})
    engine.merge(bpath, experts, "magmax", {"lambda": 1.0}, out=tmp_path / "off")
    base = read_state_dict(bpath)
    taus = torch.stack([read_state_dict(e)["layer.0.attn.weight"] - base["layer.0.attn.weight"] for e in experts])
    idx = taus.abs().argmax(0, keepdim=True)
    want = base["layer.0.attn.weight"] + taus.gather(0, idx)[0]
    torch.testing.assert_close(read_state_dict(outs[-1])["layer.0.attn.weight"], want)
    torch.testing.assert_close(read_state_dict(tmp_path / "off")["layer.0.attn.weight"], want)


def test_unknown_policy_and_bad_params_are_policy_errors():
    with pytest.raises(PolicyError, match="unknown policy"):
        make_policy("average")
    with pytest.raises(PolicyError, match="rho"):
        make_policy("safe_merge", {"rho": 2})
    with pytest.raises(PolicyError, match="nope"):
        make_policy("ties", {"nope": 1})
