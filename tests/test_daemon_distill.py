"""The distil post-step in the daemon (``policy.postprocess: [distill]``): a real service on a tiny
BERT whose experts ship task probes; folds, an unmerge, an expert without a probe, one whose head
does not fit, and the config's rules."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from mergestream import engine
from mergestream.config import Config
from mergestream.daemon.service import Service
from mergestream.daemon.sources import ExpertReady
from mergestream.datasteps.distill import teacher_outputs
from mergestream.datasteps.ri import HFEncoderFeatures
from mergestream.datasteps.text import load_head, read_labelled_jsonl

from .conftest import make_hf_expert, save_tensors
from .test_daemon_datadriven import fold_doc, ship_probe, statuses
from .test_probes import bert, sentences, tok_dir, write_pairs  # noqa: F401 - fixtures

H = 32
DISTIL = {"name": "iso_c", "params": {"alpha": 1.0}, "postprocess": ["distill"],
          "distill": {"steps": 12, "lr": 1e-3, "batch_per_task": 8, "examples_per_task": 16}}


@pytest.fixture(scope="module")
def experts(bert, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("dist")
    out = []
    for i in range(3):
        e = make_hf_expert(bert, root / f"e{i}", seed=20 + i, scale=0.08)
        out.append(ship_probe(e, f"task{i}", seed=i) if i < 2 else e)  # e2 ships no probe
    return out


def service(tmp_path: Path, base: Path, policy: dict, probes: list | None = None) -> Service:
    c = Config(base=base, inbox=tmp_path / "inbox", state_dir=tmp_path / "state", metrics={"enabled": False},
               mlflow={"enabled": False}, policy=policy, gate={"rules": []},
               **({"probes": probes} if probes is not None else {}))
    svc = Service(c, serve_metrics=False, watch_sources=False)
    svc.start()
    return svc


def feed(svc: Service, experts: list[Path]) -> None:
    for e in experts:
        svc.on_expert_ready(ExpertReady(source="folder", uri=str(e), expert_id=e.name))
        assert svc.step()


def kl_to_experts(model: Path, experts: list[Path], base: Path) -> float:
    """Mean KL of ``model``'s task outputs to each expert's own, on its probe inputs (computed here)."""
    fm = HFEncoderFeatures(base, max_length=64)
    m = fm.load(model, torch.device("cpu"))
    total = 0.0
    for e in experts:
        p = e / "mergestream_probe"
        head = load_head(p / "head.safetensors", "t")
        inputs = [(t, t2) for t, t2, _ in read_labelled_jsonl(p / "probe.jsonl", 16)]
        target = teacher_outputs(fm, e, head, inputs)
        with torch.no_grad():
            lp = torch.log_softmax(fm.features(m, inputs) @ head[0].T + head[1], -1)
        total += float(torch.nn.functional.kl_div(lp, target, log_target=True, reduction="batchmean"))
    return total / len(experts)


def test_each_fold_is_distilled_toward_every_task_and_recorded(bert, experts, tmp_path):
    svc = service(tmp_path, bert, DISTIL)
    try:
        feed(svc, experts[:2])
    finally:
        svc.shutdown()
    assert statuses(svc) == {"e0": "accepted", "e1": "accepted"}
    first, second = fold_doc(tmp_path, 1), fold_doc(tmp_path, 2)
    assert first["distill"]["experts"] == ["e0"] and second["distill"]["experts"] == ["e0", "e1"]
    assert second["distill"]["tasks"] == ["task0", "task1"] and second["distill"]["steps"] == 12
    assert second["distill"]["kl_after"] < second["distill"]["kl_before"]
    assert second["timings"]["distill_seconds"] > 0
    # the published version is closer to both experts than the same folds without the step
    plain = tmp_path / "plain"
    prev = None
    for i, e in enumerate(experts[:2]):
        engine.fold(bert, prev, e, "iso_c", {"alpha": 1.0}, state_dir=plain / "state", out=plain / f"v{i + 1}")
        prev = plain / f"v{i + 1}"
    published = tmp_path / "state" / "versions" / "000002" / "model"
    assert kl_to_experts(published, experts[:2], bert) < kl_to_experts(prev, experts[:2], bert)
    # a replay unmerge is the default with the step; subtract is refused when the config loads
    assert svc.cfg.policy.unmerge_mode == "replay"
    with pytest.raises(ValidationError, match="postprocess \\[distill\\] changes the backbone"):
        Config(base=bert, inbox=tmp_path / "i", state_dir=tmp_path / "s", policy={**DISTIL, "unmerge_mode": "subtract"})


def test_unmerge_distils_the_remaining_tasks_only(bert, experts, tmp_path):
    svc = service(tmp_path, bert, DISTIL)
    try:
        feed(svc, experts[:2])
        assert "e0 unmerged" in svc.unmerge("e0")
    finally:
        svc.shutdown()
    doc = fold_doc(tmp_path, 3)
    assert doc["kind"] == "unmerge" and doc["distill"]["experts"] == ["e1"] and doc["experts"] == ["e1"]


def test_experts_without_a_probe_and_a_probe_that_does_not_fit(bert, experts, tmp_path):
    svc = service(tmp_path / "none", bert, DISTIL)
    try:
        feed(svc, [experts[2]])  # no task probe anywhere: the step is skipped, the fold published
    finally:
        svc.shutdown()
    assert statuses(svc) == {"e2": "accepted"}
    assert fold_doc(tmp_path / "none", 1)["distill"] == {"skipped": "no task probe"}

    bad = tmp_path / "bad" / "e3"
    shutil.copytree(experts[1], bad)
    save_tensors(bad / "mergestream_probe" / "head.safetensors",
                 {"weight": torch.randn(3, H + 1), "bias": torch.zeros(3)})  # a head for another hidden size
    svc = service(tmp_path / "run", bert, DISTIL)
    try:
        feed(svc, [experts[0], bad])
        current = svc.store.current()
    finally:
        svc.shutdown()
    assert statuses(svc) == {"e0": "accepted", "e3": "rejected"}
    assert current == 1  # nothing of e3 was published
    from mergestream.daemon.ledger import Ledger

    led = Ledger(tmp_path / "run" / "state" / "ledger.sqlite")
    try:
        reason = led.expert("e3").reason
    finally:
        led.close()
    assert reason.startswith("distil post-step:") and "does not fit" in reason
    assert str(tmp_path / "run" / "state" / "experts") not in reason  # named as it arrived, not the kept copy


def test_config_defaults_and_bad_values(bert, tmp_path):
    c = Config(base=bert, inbox=tmp_path / "i", state_dir=tmp_path / "s", policy={"name": "task_arithmetic",
                                                                                 "postprocess": ["distill"]})
    assert c.policy.unmerge_mode == "replay" and c.policy.distill.steps == 100 and c.policy.distill.gamma == 0.3
    assert c.policy.distill.anchor_examples == 1024 and c.policy.distill.anchor_batch == 16
    assert c.policy.distill.lr is None  # chosen per stream: default_lr (see the next test)
    for bad in ({"postprocess": ["distill", "distill"]}, {"postprocess": ["other"]},
                {"postprocess": ["distill"], "distill": {"gamma": -1}}, {"distill": {"lr": 0}},
                {"distill": {"steps": 10, "nosuch": 1}}, {"distill": {"gamma": float("inf")}},
                {"distill": {"lr": float("nan")}}, {"ri": {"lr": float("inf")}},
                {"distill": {"time_budget_seconds": float("inf")}}, {"objective": {"task_weight": float("nan")}},
                {"distill": {"anchor_examples": -1}}, {"distill": {"anchor_batch": 0}},
                {"distill": {"anchor_examples": 2.5}}):
        with pytest.raises(ValidationError):
            Config(base=bert, inbox=tmp_path / "i", state_dir=tmp_path / "s", policy={"name": "task_arithmetic", **bad})
    json.dumps(c.policy.distill.model_dump())  # a plain record


class _FailingFeatures:
    """A user's FeatureModel whose forward fails the way a real one can (memory)."""

    identity = "tests.failing"

    def load(self, path: Path, device: torch.device) -> torch.nn.Module:
        return torch.nn.Linear(2, 2)

    def features(self, model: torch.nn.Module, items) -> torch.Tensor:
        raise RuntimeError("CUDA out of memory (simulated by the test's feature model)")


def make_failing_features() -> _FailingFeatures:
    return _FailingFeatures()


def test_a_step_that_crashes_fails_the_fold_and_the_daemon_goes_on(bert, experts, tmp_path):
    policy = {**DISTIL, "distill": {**DISTIL["distill"], "forward": "tests.test_daemon_distill:make_failing_features"}}
    svc = service(tmp_path, bert, policy)
    try:
        feed(svc, experts[:2])  # each fold fails; the queue moves on
        current = svc.store.current()
    finally:
        svc.shutdown()
    assert statuses(svc) == {"e0": "failed", "e1": "failed"} and current is None
    assert not [p for p in (tmp_path / "state").rglob("staging*") if p.is_dir() and any(p.iterdir())]
    from mergestream.daemon.ledger import Ledger

    led = Ledger(tmp_path / "state" / "ledger.sqlite")
    try:
        assert "distil post-step: RuntimeError: CUDA out of memory" in led.expert("e1").reason
    finally:
        led.close()


@pytest.mark.parametrize("key,section", [("distill", "postprocess"), ("ri", "preprocess")])
def test_a_feature_model_that_cannot_be_built_stops_the_start_naming_its_key(bert, tmp_path, key, section):
    from mergestream.config import ConfigError

    aux = tmp_path / "aux.txt"
    aux.write_text("a b c\n")
    policy = {"name": "task_arithmetic", section: [key], "unmerge_mode": "replay",
              key: {"forward": "nope_module_xyz:make", **({"data": str(aux)} if key == "ri" else {})}}
    c = Config(base=bert, inbox=tmp_path / "inbox", state_dir=tmp_path / "state", metrics={"enabled": False},
               mlflow={"enabled": False}, policy=policy)
    svc = Service(c, serve_metrics=False, watch_sources=False)
    with pytest.raises(ConfigError, match=f"policy.{key}.forward"):
        svc.start()


def test_the_sentence_similarity_probe_gives_the_step_its_anchors(bert, experts, tmp_path):
    """With a sentence_similarity probe configured, its first ``anchor_examples`` distinct sentences
    join the similarity term (recorded); ``anchor_examples: 0`` turns them off; without the probe
    there are none."""
    a, b = sentences(12, seed=61), sentences(12, seed=62)
    rows = [(float(i % 5), a[i], b[i]) for i in range(12)] + [(1.0, a[0], b[0])]  # a repeated pair
    pairs = write_pairs(tmp_path / "sts.tsv", rows)
    probes = [{"type": "classification"}, {"type": "sentence_similarity", "params": {"data": str(pairs)}}]
    for name, distill, probe_list, want in (
            ("on", {}, probes, 20), ("all", {"anchor_examples": 1000}, probes, 24),
            ("off", {"anchor_examples": 0}, probes, 0), ("noprobe", {}, [{"type": "classification"}], 0),
            ("max_pairs", {}, [{"type": "sentence_similarity", "params": {"data": str(pairs), "max_pairs": 5}}], 10)):
        policy = {**DISTIL, "distill": {**DISTIL["distill"], "anchor_examples": 20, **distill}}
        svc = service(tmp_path / name, bert, policy, probes=probe_list)
        try:
            feed(svc, experts[:1])
        finally:
            svc.shutdown()
        assert statuses(svc) == {"e0": "accepted"}, name
        assert fold_doc(tmp_path / name, 1)["distill"]["anchors"] == want, name
        card = (tmp_path / name / "state" / "versions" / "000001" / "model" / "README.md").read_text()
        assert (f"kept on {want} general anchor sentences" in card) == bool(want), name


def test_under_a_patch_budget_the_step_trains_only_what_the_fold_changed(bert, experts, tmp_path):
    """patch_budget + distil: version 2 differs from version 1 in no more entries than the budget
    allows (the step trained only the fold's patch, recorded), yet it is closer to the experts than
    the same budgeted folds without the step."""
    from .conftest import load_dir

    budget = {"name": "iso_c", "params": {"alpha": 1.0, "patch_budget": 0.2}}
    svc = service(tmp_path / "d", bert, {**budget, "postprocess": ["distill"], "distill": DISTIL["distill"]})
    plain = service(tmp_path / "p", bert, budget)
    try:
        feed(svc, experts[:2])
        feed(plain, experts[:2])
    finally:
        svc.shutdown()
        plain.shutdown()
    assert statuses(svc) == {"e0": "accepted", "e1": "accepted"}
    v = [load_dir(tmp_path / "d" / "state" / "versions" / f"00000{i}" / "model") for i in (1, 2)]
    rec = fold_doc(tmp_path / "d", 2)["distill"]
    changed = sum(int((v[1][k] != v[0][k]).sum()) for k in v[0])
    assert 0 < changed <= rec["trained_entries"]
    for k, t in v[0].items():  # the budget's bound on every matrix (1-D tensors are folded whole)
        if t.dim() >= 2:
            assert int((v[1][k] != t).sum()) <= math.ceil(0.2 * t.numel()), k
    assert fold_doc(tmp_path / "d", 1)["distill"]["trained_entries"] is None  # the first version is whole
    published = [tmp_path / w / "state" / "versions" / "000002" / "model" for w in ("d", "p")]
    assert f"only the {rec['trained_entries']} entries the fold changed" in (published[0] / "README.md").read_text()
    assert kl_to_experts(published[0], experts[:2], bert) < kl_to_experts(published[1], experts[:2], bert)


def test_the_default_learning_rate_is_the_one_chosen_for_a_budget_or_none(bert, experts, tmp_path):
    """No ``distill.lr``: 3e-5 under a patch budget below 1, 1e-5 otherwise (ρ = 1 is no budget), on
    every fold and recorded in fold.json; a configured lr wins in both cases."""
    one_step = {k: v for k, v in DISTIL["distill"].items() if k != "lr"} | {"steps": 1}
    for name, params, lr, want in (("b", {"alpha": 1.0, "patch_budget": 0.2}, None, 3e-5),
                                   ("n", {"alpha": 1.0}, None, 1e-5), ("one", {"alpha": 1.0, "patch_budget": 1}, None, 1e-5),
                                   ("set", {"alpha": 1.0, "patch_budget": 0.2}, 2e-4, 2e-4)):
        distill = one_step | ({"lr": lr} if lr is not None else {})
        svc = service(tmp_path / name, bert, {"name": "iso_c", "params": params, "postprocess": ["distill"],
                                              "distill": distill})
        try:
            feed(svc, experts[:2])
        finally:
            svc.shutdown()
        assert [fold_doc(tmp_path / name, i)["distill"]["lr"] for i in (1, 2)] == [want, want], name


def test_a_distil_config_defaults_to_replay_for_every_reader_and_names_its_real_error(bert, tmp_path):
    """The operator commands load the config without building the policy: a distil config without
    ``unmerge_mode`` is still replay there (not refused as subtract), and a bad policy parameter
    beside distil is reported as itself, not as the subtract rule."""
    from mergestream.config import ConfigError, load_config

    def cfg(params: str) -> Path:
        path = tmp_path / f"c{len(list(tmp_path.iterdir()))}.yaml"
        path.write_text(f"base: {bert}\ninbox: {tmp_path / 'inbox'}\nstate_dir: {tmp_path / 'state'}\n"
                        f"policy:\n  name: iso_c\n  params: {params}\n  postprocess: [distill]\n")
        return path

    good = cfg("{alpha: 1.0, patch_budget: 0.2}")
    for check in (True, False):
        assert load_config(good, check_policy=check).policy.unmerge_mode == "replay"
    for bad, words in (("{patch_budget: 0}", "patch_budget"), ("{patch_budget: .nan}", "patch_budget"),
                       ("{foo: 1}", "foo")):
        with pytest.raises(ConfigError) as err:
            load_config(cfg(bad))
        assert words in str(err.value) and "subtract" not in str(err.value), str(err.value)
