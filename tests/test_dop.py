"""DOP (dual orthogonal projections): property and oracle tests, through the real engine where it matters."""

from __future__ import annotations

import pytest
import torch

from mergestream import engine
from mergestream.errors import PolicyError
from mergestream.io.checkpoints import read_state_dict
from mergestream.policies import TensorContext, make_policy
from mergestream.policies.dop import (
    DopParams,
    dop_objective,
    principal_subspace,
    solve_adam,
    solve_exact,
)

from .conftest import perturb, random_model, save_tensors


def _low_rank(m, n, r, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(m, r, generator=g) @ torch.randn(r, n, generator=g)


def _grad(x, merged, tau, p):
    x = x.double().clone().requires_grad_(True)
    from mergestream.policies.dop import _sides, projection_loss
    sides = _sides(merged.double(), tau.double(), p)
    loss = sum(w * projection_loss(x, t, u, s, v, p.space) for w, (t, u, s, v) in zip((p.alpha, 1 - p.alpha), sides))
    loss.backward()
    return x.grad


def test_first_fold_is_the_expert_itself(tmp_path):
    base = random_model(0)
    bpath = save_tensors(tmp_path / "b.safetensors", base)
    e = save_tensors(tmp_path / "e.safetensors", perturb(base, 0.05, 1))
    engine.fold(bpath, None, e, "dop", {}, state_dir=tmp_path / "s", out=tmp_path / "o")
    got, want = read_state_dict(tmp_path / "o"), read_state_dict(e)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_alpha_one_update_is_orthogonal_to_both_stored_subspaces():
    """α = 1 (pure stability): X − M = ½ (I − UUᵀ)(τ − M)(I − VVᵀ), orthogonal to M's left and right
    singular subspaces (the dual projection), on a merged task vector of rank 3."""
    merged, tau = _low_rank(40, 30, 3, 0), 0.3 * torch.randn(40, 30, generator=torch.Generator().manual_seed(1))
    p = DopParams(alpha=1.0, epsilon=0.99)  # float32 rounding leaves singular values ~1e-7: not the subspace
    update = solve_exact(merged, tau, p) - merged
    u, _, v = principal_subspace(merged.double(), 0.99)
    assert u.shape[1] == 3
    u, v = u.float(), v.float()
    assert float((u.T @ update).abs().max()) < 1e-4 * float(update.abs().max())
    assert float((update @ v).abs().max()) < 1e-4 * float(update.abs().max())
    pu, pv = torch.eye(40) - u @ u.T, torch.eye(30) - v @ v.T
    torch.testing.assert_close(update, 0.5 * pu @ (tau - merged) @ pv, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("space", ["uv", "u", "v"])
@pytest.mark.parametrize("alpha,epsilon", [(0.8, 1.0), (0.5, 0.9), (0.2, 0.6)])
def test_exact_solver_is_the_minimiser(space, alpha, epsilon):
    """∇L = 0 at the closed form, and no perturbation (nor either endpoint, nor the average) does better."""
    g = torch.Generator().manual_seed(2)
    merged, tau = torch.randn(24, 18, generator=g) * 0.1, torch.randn(24, 18, generator=g) * 0.1
    p = DopParams(alpha=alpha, epsilon=epsilon, space=space)
    x = solve_exact(merged, tau, p)
    grad = _grad(x, merged, tau, p)
    scale = _grad((merged + tau) / 2, merged, tau, p).abs().max()
    assert float(grad.abs().max()) < 1e-4 * float(scale)
    best = dop_objective(x, merged, tau, p)
    for other in (merged, tau, (merged + tau) / 2, x + 1e-3 * torch.randn(x.shape, generator=g)):
        assert best <= dop_objective(other, merged, tau, p) + 1e-9


def test_adam_solver_lowers_its_objective_towards_the_exact_one():
    g = torch.Generator().manual_seed(3)
    merged, tau = torch.randn(20, 16, generator=g) * 0.05, torch.randn(20, 16, generator=g) * 0.05
    p = DopParams(alpha=0.6, solver="adam", steps=150, lr=1e-3, mgda=False)
    x, hist = solve_adam(merged, tau, p)
    opt = dop_objective(solve_exact(merged, tau, p), merged, tau, p)
    assert len(hist) == 151 and hist[-1] - opt < 0.5 * (hist[0] - opt)
    assert opt <= dop_objective(x, merged, tau, p) <= hist[0]
    # MGDA (two-task min-norm weights, EMA from (α, 1 − α)) lowers its weighted loss too
    _, hist_mgda = solve_adam(merged, tau, DopParams(alpha=0.6, solver="adam", steps=60, lr=1e-3, ema_beta=0.9))
    assert hist_mgda[-1] < hist_mgda[0]
    # zero steps is the starting point, the average
    x0, h0 = solve_adam(merged, tau, DopParams(solver="adam", steps=0))
    torch.testing.assert_close(x0, (merged + tau) / 2)
    assert len(h0) == 1


def test_non_matrix_tensors_average_and_fold_through_the_engine(tmp_path):
    base = random_model(0)
    bpath = save_tensors(tmp_path / "b.safetensors", base)
    ex = [save_tensors(tmp_path / f"e{i}.safetensors", perturb(base, 0.05, 10 + i)) for i in range(3)]
    prev = None
    for i, e in enumerate(ex):
        engine.fold(bpath, prev, e, "dop", {"alpha": 0.6}, state_dir=tmp_path / "s", out=tmp_path / f"o{i}")
        prev = tmp_path / f"o{i}"
    o1, o2 = read_state_dict(tmp_path / "o1"), read_state_dict(tmp_path / "o2")
    e2 = read_state_dict(ex[2])
    for k in ("layer.0.attn.bias", "layer.0.norm.weight", "embed.word_embeddings.weight"):
        torch.testing.assert_close(o2[k], (o1[k] + e2[k]) / 2)  # θ₀ cancels: (M + τ)/2 + θ₀
    # the 2-D weight is the exact minimiser of L for (M, τ)
    k = "layer.0.attn.weight"
    want = base[k] + solve_exact(o1[k] - base[k], e2[k] - base[k], DopParams(alpha=0.6))
    torch.testing.assert_close(o2[k], want, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(o2[k]).all() and not torch.equal(o2[k], o1[k])


def test_zero_merged_task_vector_and_bad_parameters():
    p = make_policy("dop", {"alpha": 0.5})
    b = torch.zeros(6, 5)
    tau = torch.randn(6, 5)
    res = p.fold_tensor(b, b.clone(), tau.clone(), {}, TensorContext("w", n_previous=1))
    # M = 0 has no subspace: X minimises (1 − α) ℓ_τ alone, X = τ in τ's subspace (full here)
    torch.testing.assert_close(res.full_delta(), tau, rtol=1e-5, atol=1e-6)
    with pytest.raises(PolicyError, match="alpha"):
        make_policy("dop", {"alpha": 1.5})
    with pytest.raises(PolicyError, match="solver"):
        make_policy("dop", {"solver": "sgd"})
