"""``policy.strength: auto`` (issue 39, item 5): the daemon folds each expert at every candidate
strength, scores each candidate with the data probes' objective (the task probes' validation rows
and the sentence_similarity probe) and keeps the best, recorded in ``fold.json``. Tiny BERT experts
whose task probes are labelled so that the data prefers a known strength."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mergestream import engine
from mergestream.datasteps import text
from mergestream.config import ConfigError, load_config
from mergestream.policies import strength_candidates

from .conftest import load_dir, make_hf_expert, save_tensors
from .test_daemon_datadriven import fold_doc, run_service, statuses
from .test_probes import bert, sentences, tok_dir, write_pairs  # noqa: F401 - fixtures

H = 32


def probe_from_own_predictions(expert: Path, task: str, seed: int, n: int = 24) -> Path:
    """A task probe whose labels are the expert's own predictions through a random head: the expert
    scores 100% on it and a model between θ₀ and the expert less, so the data prefers λ = 1."""
    g = torch.Generator().manual_seed(seed)
    w, b = torch.randn(3, H, generator=g), torch.zeros(3)
    rows = sentences(n, seed)
    model, tok = text.load_model(expert, "encoder", "cpu", reuse=False), text.load_tokenizer(expert)
    labels = (text.embed(model, tok, rows, pooling="mean") @ w.T + b).argmax(1).tolist()
    d = expert / "mergestream_probe"
    d.mkdir()
    save_tensors(d / "head.safetensors", {"weight": w, "bias": b})
    (d / "task.json").write_text(json.dumps({"task": task, "pooling": "mean"}))
    with open(d / "probe.jsonl", "w") as fh:
        for s, y in zip(rows, labels):
            fh.write(json.dumps({"text": s, "label": int(y)}) + "\n")
    return expert


@pytest.fixture(scope="module")
def experts(bert, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("strength")
    return [probe_from_own_predictions(make_hf_expert(bert, root / f"e{i}", seed=20 + i, scale=0.5), f"task{i}", i)
            for i in range(2)]


def base_similarity_pairs(bert: Path, path: Path) -> Path:
    """Sentence pairs whose gold scores are θ₀'s own cosine similarities: θ₀ has Spearman 100."""
    a, b = sentences(20, 1), sentences(20, 2)
    model, tok = text.load_model(bert, "encoder", "cpu", reuse=False), text.load_tokenizer(bert)
    ea, eb = text.embed(model, tok, a, pooling="mean"), text.embed(model, tok, b, pooling="mean")
    cos = torch.nn.functional.cosine_similarity(ea, eb).tolist()
    return write_pairs(path, [(5 * (c + 1) / 2, x, y) for c, x, y in zip(cos, a, b)])


def test_auto_strength_follows_the_task_probes_and_is_recorded(bert, experts, tmp_path):
    """Tasks only (general weight 0): each fold keeps λ = 1 (the probes' labels are the experts' own
    predictions) over the configured 0.3; fold.json and the state record it, and the published
    model is exactly the fold at that λ."""
    pairs = base_similarity_pairs(bert, tmp_path / "sts.tsv")
    svc = run_service(tmp_path, bert, experts, policy={
        "name": "task_arithmetic", "params": {"lambda": 0.3}, "strength": {"mode": "auto", "grid": [0.1, 1.0]},
        "objective": {"general_weight": 0.0, "examples_per_task": 24, "general_pairs": 20}},
        probes=[{"type": "sentence_similarity", "params": {"data": str(pairs)}}], gate={"rules": []})
    assert statuses(svc) == {"e0": "accepted", "e1": "accepted"}
    for v in (1, 2):
        doc = fold_doc(tmp_path, v)
        s = doc["strength"]
        assert s["param"] == "lambda" and s["configured"] == 0.3
        assert [c["value"] for c in s["candidates"]] == [0.3, 0.1, 1.0]  # the configured value first
        assert s["chosen"] == 1.0 == doc["params"]["lambda"]
        best = max(s["candidates"], key=lambda c: c["score"])
        assert best["value"] == 1.0 and best["score"] > s["candidates"][0]["score"]
        assert {f"acc.task{i}" for i in range(v)} <= set(best)  # every task folded so far, and the new one
        assert doc["timings"]["strength_seconds"] > 0
    assert fold_doc(tmp_path, 1)["strength"]["candidates"][2]["acc.task0"] == 100.0  # λ = 1: the expert itself
    man = json.loads((tmp_path / "state" / "versions" / "000002" / "state" / "manifest.json").read_text())
    assert [f["params"]["lambda"] for f in man["folds"]] == [1.0, 1.0]  # replay refolds at the chosen λ
    got = load_dir(tmp_path / "state" / "versions" / "000002" / "model")
    engine.fold(bert, None, experts[0], "task_arithmetic", {"lambda": 1.0}, state_dir=tmp_path / "r", out=tmp_path / "r1")
    engine.fold(bert, tmp_path / "r1", experts[1], "task_arithmetic", {"lambda": 1.0}, state_dir=tmp_path / "r",
                out=tmp_path / "r2")
    want = load_dir(tmp_path / "r2")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert not list((tmp_path / "state" / "staging").glob("*"))  # no candidate left behind


def test_auto_strength_keeps_general_knowledge_when_the_general_probe_weighs(bert, experts, tmp_path):
    """General probe only (task weight 0, gold = θ₀'s similarities): the smallest strength wins;
    the fixed mode folds at the configured value and records no search."""
    pairs = base_similarity_pairs(bert, tmp_path / "sts.tsv")
    probes = [{"type": "sentence_similarity", "params": {"data": str(pairs)}}]
    run_service(tmp_path / "auto", bert, experts[:1], policy={
        "name": "task_arithmetic", "params": {"lambda": 0.3}, "strength": {"mode": "auto", "grid": [0.0, 1.0]},
        "objective": {"task_weight": 0.0, "general_pairs": 20}}, probes=probes, gate={"rules": []})
    s = fold_doc(tmp_path / "auto", 1)["strength"]
    assert s["chosen"] == 0.0 and s["candidates"][1]["sts"] == pytest.approx(100.0)
    assert s["candidates"][0]["sts"] < 100.0
    run_service(tmp_path / "fixed", bert, experts[:1], policy={"name": "task_arithmetic", "params": {"lambda": 0.3}},
                probes=probes, gate={"rules": []})
    doc = fold_doc(tmp_path / "fixed", 1)
    assert "strength" not in doc and doc["params"]["lambda"] == 0.3


def test_strength_candidates_and_config_errors(bert, tmp_path):
    assert strength_candidates("iso_c", {"alpha": 2.0}) == ("alpha", [2.0, 1.0, 1.5, 2.7, 3.5], 2.0)
    assert strength_candidates("task_arithmetic", {}, grid=[0.5, 0.3]) == ("lambda", [0.3, 0.5], 0.3)
    assert strength_candidates("safe_merge", {"iso_alpha": 2.0})[0] == "iso_alpha"
    assert strength_candidates("dop", {}, grid=[0.9])[1] == [0.8, 0.9]
    assert strength_candidates("task_arithmetic", {"lambda": 0.3, "lines_alpha": 0.5})[0] == "lambda"  # LiNeS-wrapped
    sts = write_pairs(tmp_path / "sts.tsv", [(1.0, "a b", "a c"), (2.0, "b c", "c d")])
    probe = f"probes: [{{type: sentence_similarity, params: {{data: {sts}}}}}]\n"
    cases = {
        "policy: {name: iso_c, strength: auto}\n": None,  # the shorthand; iso_c's grid
        "policy: {name: task_arithmetic, strength: auto}\n" + "": "sentence_similarity",  # no general probe
        "policy: {name: dop, strength: {mode: auto, grid: [1.5]}}\n": "alpha",  # out of range for dop
        "policy: {name: weight_average, strength: auto}\n": "no strength parameter",
        "policy: {name: task_arithmetic, strength: {mode: auto, param: k}}\n": "no default grid",
        "policy: {name: task_arithmetic, strength: {mode: auto, param: nope, grid: [1]}}\n": "not a numeric parameter",
        "policy: {name: mdm_oc, params: {coefficients: cmaes}, strength: auto}\n": "both choose",
    }
    for i, (body, err) in enumerate(cases.items()):
        path = tmp_path / f"c{i}.yaml"
        path.write_text(f"base: {bert}\n" + body + (probe if err != "sentence_similarity" else ""))
        if err is None:
            assert load_config(path).policy.strength.mode == "auto"
        else:
            with pytest.raises(ConfigError, match=err):
                load_config(path)
