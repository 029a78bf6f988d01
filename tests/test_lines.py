"""LiNeS depth scaling around any policy: identity at scale 1, monotone in depth, exact algebra
through the real engine (folds, offline merge, subtract-unmerge, replay)."""

from __future__ import annotations

import json

import pytest
import torch

from mergestream import engine
from mergestream.errors import PolicyError
from mergestream.io.checkpoints import read_state_dict
from mergestream.policies import make_policy
from mergestream.policies.lines import Lines, LinesParams, block_count, layer_index, lines_scale

from .conftest import make_hf_expert, perturb, run_cli, save_tensors


def _model(seed=0, n_layers=3, m=24, n=20):
    g = torch.Generator().manual_seed(seed)
    t = {"embeddings.word_embeddings.weight": torch.randn(30, n, generator=g)}
    for i in range(n_layers):
        t[f"encoder.layer.{i}.attn.weight"] = torch.randn(m, n, generator=g) * 0.1
        t[f"encoder.layer.{i}.attn.bias"] = torch.randn(m, generator=g) * 0.1
    t["pooler.dense.weight"] = torch.randn(n, n, generator=g) * 0.1
    return t


def _chain(tmp_path, tag, bpath, experts, policy, params):
    prev, state = None, tmp_path / f"{tag}-state"
    for i, e in enumerate(experts):
        out = tmp_path / f"{tag}-{i}"
        engine.fold(bpath, prev, e, policy, params, state_dir=state, out=out, expert_id=f"e{i}")
        prev = out
    return prev, state


@pytest.fixture
def models(tmp_path):
    base = _model()
    bpath = save_tensors(tmp_path / "b.safetensors", base)
    experts = [save_tensors(tmp_path / f"e{i}.safetensors", perturb(base, 0.05, 10 + i)) for i in range(3)]
    return base, bpath, experts


def test_layer_index_patterns():
    assert layer_index("encoder.layer.3.attention.self.query.weight") == 3
    assert layer_index("model.layers.11.mlp.up_proj.weight") == 11
    assert layer_index("transformer.h.0.attn.c_attn.weight") == 0
    assert layer_index("blocks.7.norm1.weight") == 7
    assert layer_index("embeddings.word_embeddings.weight") is None
    assert layer_index("model.norm.weight") is None and layer_index("headless.5.w") is None


def test_scale_is_monotone_in_depth():
    p = LinesParams(lines_alpha=0.2, lines_beta=0.7, lines_layers=12)
    names = ["embeddings.word_embeddings.weight"] + [f"encoder.layer.{i}.output.dense.weight" for i in range(12)] \
        + ["pooler.dense.weight"]
    scales = [lines_scale(n, p) for n in names]
    assert all(a <= b for a, b in zip(scales, scales[1:]))
    assert scales[0] == scales[1] == 0.2 and scales[-1] == scales[-2] == pytest.approx(0.9)
    assert lines_scale("lm_head.weight", p, is_embedding=True) == 0.2  # a tied head is an embedding
    with pytest.raises(PolicyError, match="lines_layers"):
        lines_scale("encoder.layer.12.w", p)


SAFE = {"steps": 3, "k": 4, "k_s": 4, "rank": 2, "k_old": 4}


@pytest.mark.parametrize("policy,params", [("task_arithmetic", {"lambda": 0.4}), ("opcm", {}), ("dop", {}),
                                           ("mdm_oc", {"alpha": 0.5}), ("safe_merge", SAFE)])
def test_scale_one_everywhere_is_byte_identical(tmp_path, models, policy, params):
    _, bpath, experts = models
    plain, _ = _chain(tmp_path, "plain", bpath, experts, policy, params)
    lines, _ = _chain(tmp_path, "lines", bpath, experts, policy,
                      {**params, "lines_alpha": 1, "lines_beta": 0, "lines_layers": 3})
    a, b = read_state_dict(plain), read_state_dict(lines)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("policy,params", [("task_arithmetic", {"lambda": 0.4}), ("opcm", {}), ("dop", {"alpha": 0.6}),
                                           ("safe_merge", SAFE)])
def test_merged_task_vector_is_the_inner_one_scaled_by_depth(tmp_path, models, policy, params):
    """θ_T − θ₀ = λ(ℓ)·(the inner policy's θ_T − θ₀), after every fold: stateful policies see their
    own merge (OPCM's running mean of ‖τ‖, DOP's subspaces)."""
    base, bpath, experts = models
    lp = {"lines_alpha": 0.3, "lines_beta": 0.6, "lines_layers": 3}
    plain, _ = _chain(tmp_path, "plain", bpath, experts, policy, params)
    lines, _ = _chain(tmp_path, "lines", bpath, experts, policy, {**params, **lp})
    a, b = read_state_dict(plain), read_state_dict(lines)
    p = LinesParams(**lp)
    for k in base:
        s = lines_scale(k, p, is_embedding="embed" in k)
        torch.testing.assert_close(b[k] - base[k], s * (a[k] - base[k]), rtol=1e-4, atol=1e-6)
    # offline merge: the same scaling
    engine.merge(bpath, experts, "task_arithmetic", {"lambda": 0.4, **lp}, out=tmp_path / "off")
    off = read_state_dict(tmp_path / "off")
    k = "encoder.layer.1.attn.weight"
    want = 0.4 * lines_scale(k, p) * sum(read_state_dict(e)[k] - base[k] for e in experts)
    torch.testing.assert_close(off[k] - base[k], want, rtol=1e-5, atol=1e-6)


def test_mdm_oc_with_lines_subtract_and_replay(tmp_path, models):
    """Contributions rebuilt from state are scaled as the fold was: subtracting the last fold restores
    the previous backbone; replay without the first equals folding the others from scratch."""
    _, bpath, experts = models
    params = {"alpha": 0.5, "lines_alpha": 0.4, "lines_beta": 0.5, "lines_layers": 3}
    _chain(tmp_path, "two", bpath, experts[:2], "mdm_oc", params)
    _, state = _chain(tmp_path, "all", bpath, experts, "mdm_oc", params)
    engine.unmerge(state, "e2", "subtract", out=tmp_path / "minus")
    got, want = read_state_dict(tmp_path / "minus"), read_state_dict(tmp_path / "two-1")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    pol = make_policy("mdm_oc", params)
    assert isinstance(pol, Lines) and pol.describe()["lines_alpha"] == 0.4
    assert make_policy("mdm_oc", pol.refold_params(0.5)).describe() == pol.describe()


def test_block_count_from_the_base_names(tmp_path, models):
    """lines_layers 0 (the default): L is counted from θ₀'s names; the fold equals the explicit L's."""
    _, bpath, experts = models
    assert block_count(_model(n_layers=5)) == 5 and block_count(["embed.w", "norm.w"]) == 0
    lp = {"lines_alpha": 0.3, "lines_beta": 0.6}
    auto, _ = _chain(tmp_path, "auto", bpath, experts[:2], "task_arithmetic", {"lambda": 0.5, **lp})
    explicit, _ = _chain(tmp_path, "explicit", bpath, experts[:2], "task_arithmetic",
                         {"lambda": 0.5, **lp, "lines_layers": 3})
    wrong, _ = _chain(tmp_path, "wrong", bpath, experts[:2], "task_arithmetic",
                      {"lambda": 0.5, **lp, "lines_layers": 6})
    a, b, w = (read_state_dict(x) for x in (auto, explicit, wrong))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], w[k]) for k in a)  # L matters: 6 blocks scale layer 1 differently
    with pytest.raises(PolicyError, match="lines_layers"):
        lines_scale("encoder.layer.2.w", LinesParams(lines_alpha=0.5), n_blocks=0)


def test_bad_lines_parameters_are_policy_errors():
    with pytest.raises(PolicyError, match="lines_alpha"):
        make_policy("task_arithmetic", {"lines_alpha": 0, "lines_layers": 6})
    with pytest.raises(PolicyError, match="lines_beta"):
        make_policy("task_arithmetic", {"lines_alpha": 0.5, "lines_beta": -1, "lines_layers": 6})
    with pytest.raises(PolicyError, match="lines_layers"):
        make_policy("opcm", {"lines_alpha": 0.5, "lines_layers": -1})
    with pytest.raises(PolicyError, match="lines_gamma"):
        make_policy("opcm", {"lines_alpha": 0.5, "lines_layers": 2, "lines_gamma": 1})
    assert not isinstance(make_policy("opcm", {}), Lines)


def test_cli_set_lines_on_a_real_bert_folder(tmp_path, tiny_bert):
    """``--set lines_*`` through the real CLI on a Hugging Face folder: block 0 gets α, block 1 α + β."""
    ex = [make_hf_expert(tiny_bert, tmp_path / f"e{i}", seed=20 + i) for i in range(2)]
    sets = ["--set", "lambda=0.5", "--set", "lines_alpha=0.5", "--set", "lines_beta=0.5", "--set", "lines_layers=2"]
    run_cli("fold", "--base", tiny_bert, "--expert", ex[0], "--policy", "task_arithmetic", *sets,
            "--state", tmp_path / "s", "--out", tmp_path / "v1")
    proc = run_cli("fold", "--base", tiny_bert, "--backbone", tmp_path / "v1", "--expert", ex[1], "--policy",
                   "task_arithmetic", *sets, "--state", tmp_path / "s", "--out", tmp_path / "v2", "--json")
    assert json.loads(proc.stdout)["params"]["lines_beta"] == 0.5
    base, got = read_state_dict(tiny_bert), read_state_dict(tmp_path / "v2")
    taus = [{k: v - base[k] for k, v in read_state_dict(e).items() if v.is_floating_point()} for e in ex]
    for k, scale in (("encoder.layer.0.attention.self.query.weight", 0.5),
                     ("encoder.layer.1.attention.self.query.weight", 1.0)):
        torch.testing.assert_close(got[k] - base[k], 0.5 * scale * (taus[0][k] + taus[1][k]), rtol=1e-4, atol=1e-6)
