"""Iso-C (isotropic merging): property and oracle tests, through the real engine where it matters."""

from __future__ import annotations

import pytest
import torch

from mergestream import engine
from mergestream.config import PolicyConfig
from mergestream.errors import PolicyError, StateError
from mergestream.io.checkpoints import read_state_dict
from mergestream.policies import TensorContext, make_policy
from mergestream.policies.iso_c import isotropic
from mergestream.starter import write_starter

from .conftest import perturb, random_model, save_tensors


def _is_matrix(name: str, t: torch.Tensor) -> bool:
    return t.ndim == 2 and min(t.shape) > 1 and "embed" not in name


def test_isotropic_flattens_the_spectrum_and_keeps_the_singular_vectors():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(12, 7, generator=g) @ torch.diag(torch.logspace(-2, 1, 7))
    iso = isotropic(m)
    s = torch.linalg.svdvals(m.double())
    si = torch.linalg.svdvals(iso.double())
    torch.testing.assert_close(si, torch.full_like(si, float(s.mean())), rtol=1e-5, atol=1e-7)
    u, _, vh = torch.linalg.svd(m.double(), full_matrices=False)
    torch.testing.assert_close(iso.double(), s.mean() * u @ vh, rtol=1e-5, atol=1e-7)
    assert torch.count_nonzero(isotropic(torch.zeros(4, 3))) == 0
    torch.testing.assert_close(isotropic(m.T), iso.T)  # wide matrices: the other Gram matrix
    # a rank-2 matrix (e.g. a sum of LoRA updates) stays rank 2: σ̄ over its two values, no direction added
    low = torch.randn(12, 2, generator=g) @ torch.randn(2, 7, generator=g)
    sl = torch.linalg.svdvals(low.double())[:2]
    si = torch.linalg.svdvals(isotropic(low).double())
    torch.testing.assert_close(si[:2], torch.full((2,), float(sl.mean()), dtype=torch.float64), rtol=1e-5, atol=1e-7)
    assert float(si[2:].abs().max()) < 1e-5 * float(sl.mean())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_folds_equal_the_offline_iso_c_of_the_set_in_any_order(tmp_path, dtype):
    """The oracle: after folding K experts one by one, every matrix is θ₀ + α·iso(Σ τ) (the paper's
    offline Iso-C), other tensors θ₀ + λ Σ τ; the order of the folds does not matter."""
    base = {k: v.to(dtype) for k, v in random_model(0).items()}
    bpath = save_tensors(tmp_path / "b.safetensors", base)
    exps = [{k: v.to(dtype) for k, v in perturb(random_model(0), 0.05, 10 + i).items()} for i in range(3)]
    paths = [save_tensors(tmp_path / f"e{i}.safetensors", e) for i, e in enumerate(exps)]
    params = {"alpha": 1.7, "lambda": 0.4}
    finals = []
    for run, order in enumerate(([0, 1, 2], [2, 0, 1])):
        prev = None
        for i in order:
            out = tmp_path / f"r{run}-o{i}"
            engine.fold(bpath, prev, paths[i], "iso_c", params, state_dir=tmp_path / f"s{run}", out=out)
            prev = out
        finals.append(read_state_dict(prev))
    for name, b in base.items():
        tsum = sum(e[name].float() - b.float() for e in exps)
        if _is_matrix(name, b):
            want = b.float() + 1.7 * isotropic(tsum)
            s = torch.linalg.svdvals((finals[0][name].float() - b.float()).double())
            assert float(s.max() - s.min()) < 0.05 * float(s.mean()) + 1e-3  # isotropic up to rounding
        else:
            want = b.float() + 0.4 * tsum
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        for f in finals:
            assert f[name].dtype == dtype
            torch.testing.assert_close(f[name].float(), want, **tol)


def test_state_is_one_running_sum_in_the_checkpoint_width():
    p = make_policy("iso_c", {"alpha": 1.0, "lambda": 0.3})
    b = torch.zeros(6, 5)
    t1, t2 = torch.randn(6, 5), torch.randn(6, 5)
    for dtype, want in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.float32)):
        ctx = TensorContext("layer.0.w", dtype=dtype)
        r1 = p.fold_tensor(b, b.clone(), t1.clone(), {}, ctx)
        assert r1.state["sum"].dtype == want and r1.state["sum"].shape == (6, 5)
        th1 = b + r1.full_delta()
        r2 = p.fold_tensor(b, th1, t2.clone(), r1.state, TensorContext("layer.0.w", 1, dtype=dtype))
        torch.testing.assert_close(r2.state["sum"].float(), (t1.to(want).float() + t2).to(want).float())
        torch.testing.assert_close(th1 + r2.full_delta(), isotropic(r2.state["sum"].float()), rtol=1e-5, atol=1e-5)
    # 1-D tensors and embeddings: task arithmetic, no state
    r = p.fold_tensor(torch.zeros(5), torch.zeros(5), torch.ones(5), {}, TensorContext("layer.0.bias"))
    assert not r.state and torch.equal(r.full_delta(), torch.full((5,), 0.3))
    r = p.fold_tensor(b, b.clone(), t1.clone(), {}, TensorContext("embed.weight", is_embedding=True))
    assert not r.state and torch.allclose(r.full_delta(), 0.3 * t1)
    with pytest.raises(PolicyError, match="alpha"):
        make_policy("iso_c", {"alpha": 0})


def test_subtract_is_refused_and_replay_gives_the_never_merged_model(tmp_path):
    base = random_model(0)
    bpath = save_tensors(tmp_path / "b.safetensors", base)
    paths = [save_tensors(tmp_path / f"e{i}.safetensors", perturb(base, 0.05, 20 + i)) for i in range(3)]
    prev = None
    for i, e in enumerate(paths):
        engine.fold(bpath, prev, e, "iso_c", {}, state_dir=tmp_path / "s", out=tmp_path / f"o{i}", expert_id=f"e{i}")
        prev = tmp_path / f"o{i}"
    with pytest.raises(StateError, match="replay"):
        engine.unmerge(tmp_path / "s", "e1", "subtract", out=tmp_path / "u-sub")
    assert not (tmp_path / "u-sub").exists()
    engine.unmerge(tmp_path / "s", "e1", "replay", out=tmp_path / "u")
    never = None
    for i in (0, 2):
        engine.fold(bpath, never, paths[i], "iso_c", {}, state_dir=tmp_path / "s2", out=tmp_path / f"n{i}")
        never = tmp_path / f"n{i}"
    got, want = read_state_dict(tmp_path / "u"), read_state_dict(never)
    assert all(torch.equal(got[k], want[k]) for k in want)
    # the next fold after the replay does not bring e1 back
    engine.fold(bpath, tmp_path / "u", paths[1], "iso_c", {}, state_dir=tmp_path / "s", out=tmp_path / "again",
                expert_id="e1b")
    engine.fold(bpath, never, paths[1], "iso_c", {}, state_dir=tmp_path / "s2", out=tmp_path / "again2")
    a, b2 = read_state_dict(tmp_path / "again"), read_state_dict(tmp_path / "again2")
    assert all(torch.equal(a[k], b2[k]) for k in a)


def test_config_and_starter_default_to_replay_for_iso_c(tmp_path):
    assert PolicyConfig(name="iso_c").unmerge_mode == "replay"
    assert PolicyConfig(name="task_arithmetic").unmerge_mode == "subtract"
    with pytest.raises(ValueError, match="unmerge_mode: replay"):
        PolicyConfig(name="iso_c", unmerge_mode="subtract")
    path = write_starter(tmp_path / "site", str(tmp_path / "base.safetensors"), policy="iso_c")
    assert "unmerge_mode: replay" in path.read_text()


def test_safe_merge_with_iso_alpha_merges_its_masked_updates_isotropically(tmp_path):
    """SAFE-Merge + Iso-C: the backbone's 2-D weights are θ₀ + α·iso(Σ D_i), D_i SAFE-Merge's masked
    update of expert i (no recovery steps here, so D_i does not depend on the fold order); other
    tensors keep SAFE-Merge's λ·(M ⊙ τ); subtract is refused, the config defaults to replay."""
    base = random_model(0)
    bpath = save_tensors(tmp_path / "b.safetensors", base)
    exps = [perturb(base, 0.05, 30 + i) for i in range(3)]
    paths = [save_tensors(tmp_path / f"e{i}.safetensors", e) for i, e in enumerate(exps)]
    common = {"k": 4, "k_s": 4, "steps": 0, "rho": 0.3, "lambda": 0.5}
    prev = None
    for i, e in enumerate(paths):
        engine.fold(bpath, prev, e, "safe_merge", {**common, "iso_alpha": 1.3}, state_dir=tmp_path / "s",
                    out=tmp_path / f"o{i}", expert_id=f"e{i}")
        prev = tmp_path / f"o{i}"
    got = read_state_dict(prev)
    plain = make_policy("safe_merge", {**common, "lambda": 1.0})
    assert plain.subtract_unmerge and not make_policy("safe_merge", {"iso_alpha": 1.3}).subtract_unmerge
    for name, b in base.items():
        if not b.is_floating_point():
            continue
        ctx = TensorContext(name, is_embedding="embed" in name)
        ds = [plain.fold_tensor(b.float(), b.float(), e[name].float() - b.float(), {}, ctx).full_delta() for e in exps]
        want = b + (1.3 * isotropic(sum(ds)) if _is_matrix(name, b) else 0.5 * sum(ds))
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6)
    with pytest.raises(StateError, match="replay"):
        engine.unmerge(tmp_path / "s", "e0", "subtract", out=tmp_path / "u")
    # matrices too small for the risk mask and recovery (min(shape) < 2k, SAFE's default k 64) are
    # still merged isotropically: D = M ⊙ τ with the magnitude mask
    prev = None
    for i, e in enumerate(paths[:2]):
        engine.fold(bpath, prev, e, "safe_merge", {"rho": 0.3, "lambda": 0.5, "iso_alpha": 1.3},
                    state_dir=tmp_path / "s-small", out=tmp_path / f"small{i}")
        prev = tmp_path / f"small{i}"
    small = read_state_dict(prev)
    mag = make_policy("safe_merge", {"rho": 0.3, "lambda": 1.0})
    for name in ("layer.0.attn.weight", "layer.0.mlp.weight"):
        b = base[name]
        ds = [mag.fold_tensor(b, b, e[name] - b, {}, TensorContext(name)).full_delta() for e in exps[:2]]
        torch.testing.assert_close(small[name], b + 1.3 * isotropic(sum(ds)), rtol=1e-5, atol=1e-6)
    assert PolicyConfig(name="safe_merge", params={"iso_alpha": 1.3}).unmerge_mode == "replay"
    assert PolicyConfig(name="safe_merge").unmerge_mode == "subtract"


def test_iso_cts_with_no_task_specific_share_is_iso_c_over_all_singular_values():
    """Iso-CTS with common_fraction = 1 keeps only the common subspace (all d directions of the sum):
    it is Iso-C with the reference's rank convention (σ̄ over all min(m, n) values)."""
    from mergestream.policies.iso_cts import iso_cts

    g = torch.Generator().manual_seed(3)
    taus = torch.randn(3, 9, 6, generator=g)
    torch.testing.assert_close(iso_cts(taus, 1.0), isotropic(taus.sum(0), full=True), rtol=1e-5, atol=1e-6)
    # with a task-specific share each task keeps directions of its own: the result differs
    assert float((iso_cts(taus, 0.5) - isotropic(taus.sum(0), full=True)).abs().max()) > 1e-3
