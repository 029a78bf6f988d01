"""AdaMerging-style coefficients as MDM-OC's third coefficient mode (``coefficients: adamerging``),
through the engine and the daemon, on a tiny BERT whose experts ship task heads: the mode lowers its
own objective, zero steps are the starting coefficients (byte for byte), the per-layer α live in the
state so subtract and replay still work, and the config needs the RI inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mergestream import engine
from mergestream.engine.coefficients import CoefficientError, EntropyObjective
from mergestream.errors import PolicyError
from mergestream.io.checkpoints import read_state_dict
from mergestream.io.state import StateDir
from mergestream.policies.adamerging import layer_groups
from mergestream.datasteps.ri import load_feature_model
from mergestream.datasteps.text import load_head

from .test_daemon_datadriven import experts, fold_doc, run_service, statuses  # noqa: F401 - fixture
from .test_probes import bert, sentences, tok_dir  # noqa: F401 - fixtures

ADA = {"coefficients": "adamerging", "alpha": 0.3, "ada_steps": 12, "ada_lr": 0.05}


def _objective(bert: Path, experts: list[Path], k: int) -> EntropyObjective:
    """The entropy of the heads of the first ``k`` experts on unlabeled sentences."""
    heads = {e.name: load_head(e / "mergestream_probe" / "head.safetensors") for e in experts[:k]}
    fm = load_feature_model(None, tokenizer=bert, max_length=16)
    return EntropyObjective(bert, heads, [(s, None) for s in sentences(24, seed=7)], feature_model=fm, batch_size=12)


def _fold(bert, experts, tmp_path, tag, params, k=2):
    state, prev, reps = tmp_path / f"{tag}-state", None, []
    for i, e in enumerate(experts[:k]):
        out = tmp_path / f"{tag}-v{i + 1}"
        reps.append(engine.fold(bert, prev, e, "mdm_oc", params, state_dir=state, out=out, expert_id=e.name,
                                objective=_objective(bert, experts, i + 1)))
        prev = out
    return state, prev, reps


def _entropy(bert, experts, model_dir: Path, k: int = 2) -> float:
    sd = read_state_dict(model_dir)
    with torch.no_grad():
        return float(_objective(bert, experts, k)({n: v.float() for n, v in sd.items() if v.is_floating_point()}))


@pytest.mark.parametrize("lines", [{}, {"lines_alpha": 0.5, "lines_beta": 0.5}], ids=["plain", "lines"])
def test_adamerging_lowers_its_own_objective_and_writes_what_it_measured(bert, experts, tmp_path, lines):
    _, out, reps = _fold(bert, experts, tmp_path, "ada", {**ADA, **lines})
    _fold(bert, experts, tmp_path, "zero", {**ADA, **lines, "ada_steps": 0})
    rep = reps[-1]
    assert rep.search["objective"] < rep.search["objective_start"] and rep.search["evaluations"] == 13
    # measured again on the written models: what was learned is what was written
    assert _entropy(bert, experts, out) == pytest.approx(rep.search["objective"], rel=1e-4)
    # and after the first fold (same start in both runs) the learned backbone is less uncertain
    first, first_start = _entropy(bert, experts, tmp_path / "ada-v1", 1), _entropy(bert, experts, tmp_path / "zero-v1", 1)
    assert first == pytest.approx(reps[0].search["objective"], rel=1e-4) and first < first_start
    assert first_start == pytest.approx(reps[0].search["objective_start"], rel=1e-4)
    assert len(rep.params["layer_alphas"]) == 3 and (not lines or rep.params["lines_alpha"] == 0.5)


def test_adamerging_keeps_per_layer_alphas_in_the_state_and_the_fold_record(bert, experts, tmp_path):
    state, out, reps = _fold(bert, experts, tmp_path, "ada", ADA)
    rep = reps[-1]
    profile = rep.params["layer_alphas"]
    assert len(profile) == 3 and all(0.0 <= a <= 1.0 for a in profile) and profile != [0.3] * 3
    sd = StateDir(state)
    man = sd.manifest
    assert man.folds[-1].params["layer_alphas"] == profile
    assert man.folds[-1].coefficient == pytest.approx(sum(profile) / 3)
    groups = layer_groups(read_state_dict(out).keys())
    earlier = man.folds[0].params["layer_alphas"]
    for name in ("encoder.layer.1.output.dense.weight", "embeddings.word_embeddings.weight"):
        alphas = sd.tensor_state(name)["alphas"]
        assert alphas.tolist() == pytest.approx([earlier[groups[name]], profile[groups[name]]], abs=1e-7)
    sd.close()


def test_zero_steps_give_the_starting_coefficients_byte_for_byte(bert, experts, tmp_path):
    params = {**ADA, "ada_steps": 0, "layer_alphas": [0.2, 0.35, 0.5]}
    state, out, reps = _fold(bert, experts, tmp_path, "zero", params)
    assert reps[-1].params["layer_alphas"] == [0.2, 0.35, 0.5]  # as given, not float32-rounded
    assert reps[-1].search["objective"] == reps[-1].search["objective_start"]
    # the same folds with those per-layer α fixed: the same bytes
    ref_state, prev = tmp_path / "ref-state", None
    for i, e in enumerate(experts[:2]):
        prev_out = tmp_path / f"ref-v{i + 1}"
        engine.fold(bert, prev, e, "mdm_oc", {"layer_alphas": [0.2, 0.35, 0.5]}, state_dir=ref_state, out=prev_out,
                    expert_id=e.name)
        prev = prev_out
    got, want = read_state_dict(out), read_state_dict(prev)
    for k in want:  # rebuilt from the state vs added fold by fold: float32 rounding apart
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)
    a, b = StateDir(state), StateDir(ref_state)
    for name in want:
        sa, sb = a.tensor_state(name), b.tensor_state(name)
        assert sa.keys() == sb.keys() and all(torch.equal(sa[f], sb[f]) for f in sa), name
    a.close(), b.close()
    # and one fold rebuilt from the state like a coefficient search that kept its start: the same bytes
    engine.fold(bert, None, experts[0], "mdm_oc", {**ADA, "ada_steps": 0}, state_dir=tmp_path / "z1", out=tmp_path / "z1m",
                objective=_objective(bert, experts, 1))
    engine.fold(bert, None, experts[0], "mdm_oc", {"coefficients": "cmaes", "budget": 1}, state_dir=tmp_path / "c1",
                out=tmp_path / "c1m", objective=lambda alphas, weights: 0.0)
    got, want = read_state_dict(tmp_path / "z1m"), read_state_dict(tmp_path / "c1m")
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_subtract_and_replay_of_an_adamerging_state(bert, experts, tmp_path):
    state, out, reps = _fold(bert, experts, tmp_path, "u", ADA)
    first = read_state_dict(tmp_path / "u-v1")
    # subtract the latest: the previous backbone (up to float32 rounding); the state drops its α
    sub_state = tmp_path / "sub-state"
    import shutil

    shutil.copytree(state, sub_state)
    engine.unmerge(sub_state, experts[1].name, "subtract", out=tmp_path / "sub", backbone=out)
    got = read_state_dict(tmp_path / "sub")
    for k, v in first.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-5)
    sd = StateDir(sub_state)
    assert sd.tensor_state("encoder.layer.0.attention.self.query.weight")["alphas"].shape == (1,)
    sd.close()
    # replay without the first: the second refolded from θ₀ with the per-layer α it recorded
    engine.unmerge(state, experts[0].name, "replay", out=tmp_path / "rep")
    profile = reps[-1].params["layer_alphas"]
    engine.fold(bert, None, experts[1], "mdm_oc", {**ADA, "coefficients": "fixed", "layer_alphas": profile},
                state_dir=tmp_path / "alone-state", out=tmp_path / "alone")
    got, want = read_state_dict(tmp_path / "rep"), read_state_dict(tmp_path / "alone")
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_refusals_are_specific_and_leave_the_state_unchanged(bert, experts, tmp_path):
    obj = _objective(bert, experts, 1)
    with pytest.raises(PolicyError, match="ada_max_mib"):
        engine.fold(bert, None, experts[0], "mdm_oc", {**ADA, "ada_max_mib": 0.01}, state_dir=tmp_path / "s",
                    out=tmp_path / "o", objective=obj)
    assert not (tmp_path / "o").exists() and not (tmp_path / "s" / "manifest.json").exists()
    with pytest.raises(PolicyError, match="layer_alphas has 2 values"):
        engine.fold(bert, None, experts[0], "mdm_oc", {"layer_alphas": [0.1, 0.2]}, state_dir=tmp_path / "s",
                    out=tmp_path / "o")
    with pytest.raises(PolicyError, match="needs an objective"):
        engine.fold(bert, None, experts[0], "mdm_oc", ADA, state_dir=tmp_path / "s", out=tmp_path / "o")
    engine.fold(bert, None, experts[0], "mdm_oc", ADA, state_dir=tmp_path / "s", out=tmp_path / "v1", objective=obj)
    with pytest.raises(PolicyError, match="cmaes cannot continue"):
        engine.fold(bert, tmp_path / "v1", experts[1], "mdm_oc", {"coefficients": "cmaes"}, state_dir=tmp_path / "s",
                    out=tmp_path / "v2", objective=lambda a, w: 0.0)
    assert len(StateDir(tmp_path / "s").manifest.folds) == 1
    with pytest.raises(CoefficientError, match="task head"):
        EntropyObjective(bert, {}, [("a b", None)], feature_model=load_feature_model(None, tokenizer=bert))


def test_the_daemon_learns_per_layer_alphas_on_the_ri_inputs(bert, experts, tmp_path):
    aux = tmp_path / "aux.txt"
    aux.write_text("\n".join(sentences(30, seed=99)) + "\n")
    svc = run_service(tmp_path, bert, experts[:2], policy={
        "name": "mdm_oc", "params": {**ADA, "ada_steps": 5}, "ri": {"data": str(aux), "max_length": 16},
        "objective": {"adamerging_examples": 16}}, gate={"rules": []})
    assert statuses(svc) == {"e0": "accepted", "e1": "accepted"}
    for v in (1, 2):
        doc = fold_doc(tmp_path, v)
        c = doc["adamerging"]
        assert c["objective"] <= c["objective_start"] and c["evaluations"] == 6
        assert len(doc["params"]["layer_alphas"]) == 3
        assert {"score", "entropy.task0"} <= set(c["evaluations_log"][0])
        assert doc["timings"]["adamerging_evaluations"] == c["evaluations"] and "cmaes" not in doc
    assert "entropy.task1" in fold_doc(tmp_path, 2)["adamerging"]["evaluations_log"][0]


def test_the_config_accepts_adamerging_and_refuses_it_without_ri_data(bert, tmp_path):
    from mergestream.config import ConfigError, load_config

    (tmp_path / "aux.txt").write_text("one two\n")
    (tmp_path / "c.yaml").write_text(json.dumps({"base": str(bert), "policy": {
        "name": "mdm_oc", "params": {"coefficients": "adamerging"}, "ri": {"data": "aux.txt"}}}))
    cfg = load_config(tmp_path / "c.yaml")  # no data probe needed (unlike cmaes)
    assert cfg.policy.make().searches_coefficients() == "adamerging"
    (tmp_path / "bad.yaml").write_text(json.dumps({"base": str(bert), "policy": {
        "name": "mdm_oc", "params": {"coefficients": "adamerging"}}}))
    with pytest.raises(ConfigError, match="adamerging.*policy.ri.data"):
        load_config(tmp_path / "bad.yaml")


def test_the_probe_objective_skips_integer_tensors_of_the_candidate(bert, experts):
    """Regression (found by the benchmark's CMA-ES rows on MiniLM): a checkpoint that stores the
    integer ``embeddings.position_ids`` buffer, which the loaded encoder does not list, was refused."""
    from mergestream.daemon.objective import ProbeObjective
    from mergestream.daemon.probes import discover_task_probe

    obj = ProbeObjective(bert, [discover_task_probe(experts[0])], None, tokenizer=bert, examples_per_task=4)
    w = read_state_dict(experts[0])["embeddings.word_embeddings.weight"]
    obj.load(iter([("embeddings.position_ids", torch.arange(64)[None]), ("embeddings.word_embeddings.weight", w)]))
    assert torch.equal(obj.params["embeddings.word_embeddings.weight"], w)
