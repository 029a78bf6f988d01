"""Patch budget around any policy: identity at ρ = 1, at most ⌈ρ·n⌉ changed entries of a matrix per
fold, the backbone trails the inner policy by exactly the carried residual, smaller version patches,
config and CLI errors, through the real engine and patch builder."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mergestream import engine
from mergestream.errors import PolicyError, StateError
from mergestream.io.checkpoints import read_state_dict
from mergestream.io.model_card import provenance_of
from mergestream.io.state import StateDir
from mergestream.patches.build import build_patch
from mergestream.policies import REGISTRY, make_policy
from mergestream.policies.budget import PatchBudget

from .conftest import perturb, run_cli, save_tensors
from .test_lines import _chain, _model, models  # noqa: F401  (the fixture)

SAFE = {"steps": 3, "k": 4, "k_s": 4, "rank": 2, "k_old": 4}


def _folds(tmp_path, tag, bpath, experts, policy, params):
    """Every version of a chain (θ₀ first) as state dicts."""
    out = [read_state_dict(bpath)]
    prev, state = None, tmp_path / f"{tag}-state"
    for i, e in enumerate(experts):
        dst = tmp_path / f"{tag}-{i}"
        engine.fold(bpath, prev, e, policy, params, state_dir=state, out=dst, expert_id=f"e{i}")
        out.append(read_state_dict(dst))
        prev = dst
    return out


@pytest.mark.parametrize("policy,params", [("task_arithmetic", {"lambda": 0.4}), ("iso_c", {}), ("opcm", {}),
                                           ("safe_merge", SAFE)])
def test_budget_one_is_byte_identical(tmp_path, models, policy, params):
    _, bpath, experts = models
    plain, _ = _chain(tmp_path, "plain", bpath, experts, policy, params)
    budget, _ = _chain(tmp_path, "budget", bpath, experts, policy, {**params, "patch_budget": 1})
    a, b = read_state_dict(plain), read_state_dict(budget)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("policy,params", [("iso_c", {}), ("task_arithmetic", {"lambda": 0.4}), ("opcm", {}),
                                           ("dop", {"alpha": 0.6}), ("iso_c", {"lines_alpha": 0.5, "lines_beta": 0.5})])
@pytest.mark.parametrize("rho", [0.1, 0.3])
def test_each_fold_changes_at_most_its_share_and_trails_by_the_residual(tmp_path, models, policy, params, rho):
    """Per matrix and fold: ≤ ⌈ρ·n⌉ entries change, 1-D tensors change in full; after every fold the
    backbone plus the stored residual is the inner policy's backbone (stateful policies see their own
    merge through the wrapper)."""
    base, bpath, experts = models
    inner = _folds(tmp_path, "inner", bpath, experts, policy, params)
    got = _folds(tmp_path, "budget", bpath, experts, policy, {**params, "patch_budget": rho})
    state = StateDir(tmp_path / "budget-state")
    for t in range(1, len(got)):
        for k, v in got[t].items():
            changed = int((v != got[t - 1][k]).sum())
            if v.ndim >= 2:
                assert changed <= math.ceil(rho * v.numel()), (t, k)
    residual = {k: state.tensor_state(k).get("budget_residual") for k in base}
    for k in base:
        r = residual[k]
        if base[k].ndim < 2:
            assert r is None
            torch.testing.assert_close(got[-1][k], inner[-1][k], rtol=1e-5, atol=1e-6)
        else:
            assert r is not None and r.shape == base[k].shape
            torch.testing.assert_close(got[-1][k] + r, inner[-1][k], rtol=1e-5, atol=1e-6)
            assert float(r.abs().max()) > 0  # something was held back


def test_version_patches_shrink_with_the_budget(tmp_path):
    """The patch from version 3 to 4 of Iso-C (dense: every entry moves) against the same with ρ = 0.2,
    format 2 with zstd: the budgeted patch is under a third of the dense one."""
    base = _model(m=128, n=96)
    bpath = save_tensors(tmp_path / "b.safetensors", base)
    experts = [save_tensors(tmp_path / f"e{i}.safetensors", perturb(base, 0.05, 10 + i)) for i in range(4)]
    for tag, params in (("dense", {}), ("sparse", {"patch_budget": 0.2})):
        _chain(tmp_path, tag, bpath, experts, "iso_c", params)
    sizes = {}
    for tag in ("dense", "sparse"):
        info = build_patch(tmp_path / f"{tag}-2", tmp_path / f"{tag}-3", tmp_path / f"{tag}.patch",
                           source_version="3", target_version="4", patch_format=2, zstd_level=3)
        sizes[tag] = info["patch_bytes"]
    assert sizes["sparse"] < sizes["dense"] / 3, sizes


def test_bad_budgets_and_unwrappable_policies_are_policy_errors():
    for bad in (0, -0.1, 1.5, "x", float("nan")):
        with pytest.raises(PolicyError, match="patch_budget"):
            make_policy("iso_c", {"patch_budget": bad})
    with pytest.raises(PolicyError, match="scope=global"):
        make_policy("opcm", {"scope": "global", "patch_budget": 0.2})
    with pytest.raises(PolicyError, match="coefficient search"):
        make_policy("mdm_oc", {"coefficients": "cmaes", "patch_budget": 0.2})
    pol = make_policy("iso_c", {"alpha": 2.5, "patch_budget": 0.2})
    assert isinstance(pol, PatchBudget) and pol.describe()["patch_budget"] == 0.2
    assert not pol.subtract_unmerge and pol.linear_scale() is None
    assert make_policy("iso_c", pol.refold_params(None)).describe() == pol.describe()
    assert make_policy("task_arithmetic", {"lambda": 0.3, "patch_budget": 1}).linear_scale() == 0.3


@pytest.mark.parametrize("policy", sorted(REGISTRY))
def test_an_unknown_parameter_names_the_wrapper_parameters_every_policy_takes(policy):
    """The list of known parameters in an unknown-parameter error holds the ones any policy takes
    (``patch_budget``, ``lines_*``), and a near miss of one of them is suggested, beside a budget or
    not: the message used to list the inner policy's own keys only."""
    for params in ({"patch_bugdet": 0.2}, {"patch_budget": 0.2, "patch_bugdet": 0.2}):
        with pytest.raises(PolicyError, match=r"did you mean 'patch_budget'\?.*with any policy: .*patch_budget.*"
                                              r"lines_alpha, lines_beta, lines_layers"):
            make_policy(policy, params)
    with pytest.raises(PolicyError, match=r"with LiNeS: bad parameters: lines_alfa: unknown parameter "
                                          r"\(did you mean 'lines_alpha'\? known: lines_alpha, lines_beta, lines_layers\)"):
        make_policy(policy, {"lines_alpha": 0.5, "lines_alfa": 1})


def test_subtract_unmerge_is_refused_and_replay_refolds_with_the_budget(tmp_path, models):
    _, bpath, experts = models
    params = {"lambda": 0.4, "patch_budget": 0.25}
    _chain(tmp_path, "others", bpath, experts[1:3], "task_arithmetic", params)
    _, state = _chain(tmp_path, "all", bpath, experts[:3], "task_arithmetic", params)
    with pytest.raises(StateError, match="patch budget.*replay"):  # the cause named, not the inner policy
        engine.unmerge(state, "e0", "subtract", out=tmp_path / "minus")
    engine.unmerge(state, "e0", "replay", out=tmp_path / "replay")
    got, want = read_state_dict(tmp_path / "replay"), read_state_dict(tmp_path / "others-1")
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_cli_set_patch_budget_is_kept_by_later_folds(tmp_path, models):
    """``--set patch_budget=…`` through the CLI; a later ``fold --state`` without it keeps it (said on stderr)."""
    _, bpath, experts = models
    run_cli("fold", "--base", bpath, "--expert", experts[0], "--policy", "iso_c", "--set", "patch_budget=0.2",
            "--state", tmp_path / "s", "--out", tmp_path / "v1")
    proc = run_cli("fold", "--base", bpath, "--backbone", tmp_path / "v1", "--expert", experts[1], "--policy",
                   "iso_c", "--state", tmp_path / "s", "--out", tmp_path / "v2", "--json")
    assert json.loads(proc.stdout)["params"]["patch_budget"] == 0.2
    assert "patch_budget=0.2" in proc.stderr
    proc = run_cli("fold", "--base", bpath, "--expert", experts[0], "--policy", "iso_c", "--set",
                   "patch_budget=2", "--state", tmp_path / "s2", "--out", tmp_path / "bad", check=False)
    assert proc.returncode != 0 and "patch_budget" in proc.stderr and "Traceback" not in proc.stderr


def test_daemon_config_takes_patch_budget_and_refuses_a_bad_one(tmp_path, tiny_bert):
    from mergestream.config import ConfigError, load_config

    good = tmp_path / "good.yaml"
    good.write_text(f"base: {tiny_bert}\npolicy: {{name: iso_c, params: {{alpha: 2.0, patch_budget: 0.2}}}}\n")
    pol = load_config(good).policy.make()
    assert isinstance(pol, PatchBudget) and pol.describe()["patch_budget"] == 0.2
    for i, bad in enumerate(("1.5", "0")):
        path = tmp_path / f"bad{i}.yaml"
        path.write_text(f"base: {tiny_bert}\npolicy: {{name: iso_c, params: {{patch_budget: {bad}}}}}\n")
        with pytest.raises(ConfigError, match="patch_budget"):
            load_config(path)
    sub = tmp_path / "sub.yaml"
    sub.write_text(f"base: {tiny_bert}\npolicy: {{name: opcm, params: {{patch_budget: 0.2}}, unmerge_mode: subtract}}\n")
    with pytest.raises(ConfigError, match="patch budget"):  # opcm subtracts, its budget does not
        load_config(sub)
    sub.write_text(f"base: {tiny_bert}\npolicy: {{name: opcm, params: {{patch_budget: 0.2}}}}\n")
    assert load_config(sub).policy.unmerge_mode == "replay"


def test_offline_merge_is_the_inner_policys_and_records_no_budget(tmp_path, models):
    """An offline merge has no versions in between: it neither applies nor records the budget
    (its metadata and card said patch_budget=0.2 for weights merged without one)."""
    _, bpath, experts = models
    for name, params in (("plain", {"alpha": 2.0}), ("budget", {"alpha": 2.0, "patch_budget": 0.2})):
        report = engine.merge(bpath, experts[:3], "iso_c", params, out=tmp_path / name)
        assert "patch_budget" not in report.params
    meta = provenance_of(tmp_path / "budget")
    assert json.loads(meta["mergestream.params"]) == json.loads(provenance_of(tmp_path / "plain")["mergestream.params"])
    assert "patch_budget" not in (tmp_path / "budget" / "README.md").read_text()
    got, want = read_state_dict(tmp_path / "budget"), read_state_dict(tmp_path / "plain")
    assert all(torch.equal(got[k], want[k]) for k in want)
