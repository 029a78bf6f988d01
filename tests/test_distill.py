"""The distil post-step: objective, identities, the file-level step on real tiny BERT folders, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mergestream import engine
from mergestream.datasteps.distill import (
    DistillError,
    DistillParams,
    DistillTask,
    distill,
    distill_backbone,
    similarity_term,
    teacher_outputs,
)
from mergestream.datasteps.ri import HFEncoderFeatures

from .conftest import load_dir, make_hf_expert
from .test_probes import WORDS, bert, sentences, tok_dir  # noqa: F401 - fixtures

H = 32


def head(seed: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(classes, H, generator=g) * 3, torch.randn(classes, generator=g)


@pytest.fixture(scope="module")
def experts(bert, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("distil")
    return [make_hf_expert(bert, root / f"e{i}", seed=10 + i, scale=0.08) for i in range(2)]


@pytest.fixture(scope="module")
def backbone(bert, experts, tmp_path_factory) -> Path:
    """Task arithmetic of the two experts: a real fold's output folder."""
    root = tmp_path_factory.mktemp("bb")
    prev = None
    for i, e in enumerate(experts):
        engine.fold(bert, prev, e, "task_arithmetic", {"lambda": 0.5}, state_dir=root / "state",
                    out=root / f"v{i + 1}", expert_id=f"e{i}")
        prev = root / f"v{i + 1}"
    return prev


@pytest.fixture(scope="module")
def tasks(bert, experts) -> list[DistillTask]:
    fm = HFEncoderFeatures(bert, max_length=16)
    out = []
    for i, e in enumerate(experts):
        inputs = [(s, None) for s in sentences(24, seed=40 + i)]
        h = head(i, 3 + i)
        out.append(DistillTask(f"t{i}", h, inputs, teacher_outputs(fm, e, h, inputs)))
    return out


def _kl_on(folder: Path, tasks: list[DistillTask], fm, inputs_for) -> float:
    """Mean KL to the teachers on given inputs (a fresh, independent computation)."""
    model = fm.load(folder, torch.device("cpu"))
    total = 0.0
    with torch.no_grad():
        for t in tasks:
            items, target = inputs_for(t)
            lp = torch.log_softmax(fm.features(model, items) @ t.head[0].T + t.head[1], -1)
            total += float(torch.nn.functional.kl_div(lp, target, log_target=True, reduction="batchmean"))
    return total / len(tasks)


def test_distil_pulls_the_backbone_toward_each_expert_and_keeps_the_folder(bert, experts, backbone, tasks, tmp_path):
    fm = HFEncoderFeatures(bert, max_length=16)
    out, res = distill_backbone(backbone, bert, tmp_path / "d", tasks=tasks,
                                params=DistillParams(steps=30, lr=1e-3, batch_per_task=8, gamma=0.0),
                                feature_model=fm, cache_dir=tmp_path / "cache")
    assert res.steps == 30 and res.stopped == "steps" and res.tasks == ["t0", "t1"]
    assert res.kl_before > 0 and res.kl_after < 0.5 * res.kl_before
    # inputs the step never saw move toward the experts too (it distils, not memorises)
    held = {t.name: [(s, None) for s in sentences(24, seed=90 + k)] for k, t in enumerate(tasks)}
    targets = {t.name: teacher_outputs(fm, experts[k], t.head, held[t.name]) for k, t in enumerate(tasks)}

    def unseen(t):
        return held[t.name], targets[t.name]

    assert _kl_on(out, tasks, fm, unseen) < _kl_on(backbone, tasks, fm, unseen)
    a, b = load_dir(out), load_dir(backbone)
    assert set(a) == set(b) and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape for k in a)
    changed = {k for k in a if not torch.equal(a[k], b[k])}
    assert any(k.startswith("encoder.layer") for k in changed)
    assert not any(k.startswith("pooler.") for k in changed)  # mean pooling: no gradient reaches it
    assert (out / "config.json").exists() and (out / "tokenizer_config.json").exists()
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        meta = fh.metadata()
    assert meta["mergestream.policy"] == "task_arithmetic"  # the fold's provenance is kept
    assert '"steps": 30' in meta["mergestream.distill"]
    # the distilled backbone is a backbone the next fold (with the stream's state) accepts
    import shutil

    shutil.copytree(backbone.parent / "state", tmp_path / "s")
    engine.fold(bert, out, experts[0], "task_arithmetic", {"lambda": 0.5}, state_dir=tmp_path / "s",
                out=tmp_path / "next", expert_id="again")


def test_the_similarity_term_keeps_the_base_geometry(bert, backbone, tasks, tmp_path):
    fm = HFEncoderFeatures(bert, max_length=16)
    common = DistillParams(steps=30, lr=1e-3, batch_per_task=8)
    _, free = distill_backbone(backbone, bert, tmp_path / "free", tasks=tasks,
                               params=DistillParams(**{**common.__dict__, "gamma": 0.0}), feature_model=fm)
    _, kept = distill_backbone(backbone, bert, tmp_path / "kept", tasks=tasks,
                               params=DistillParams(**{**common.__dict__, "gamma": 10.0}), feature_model=fm)
    assert kept.sim_before == pytest.approx(free.sim_before)
    assert kept.sim_after < free.sim_after
    assert kept.sim_after < kept.sim_before


def test_similarity_term_is_zero_on_the_base_and_blind_to_scale():
    g = torch.Generator().manual_seed(0)
    f = torch.randn(10, H, generator=g)
    assert float(similarity_term(f, f)) == pytest.approx(0.0, abs=1e-6)
    assert float(similarity_term(f * torch.rand(10, 1, generator=g).add(0.5), f)) == pytest.approx(0.0, abs=1e-5)
    assert float(similarity_term(torch.randn(10, H, generator=g), f)) > 0.1


def test_zero_steps_is_the_identity_and_writes_nothing(bert, backbone, tasks, tmp_path):
    out, res = distill_backbone(backbone, bert, tmp_path / "d", tasks=tasks, params=DistillParams(steps=0))
    assert out == backbone and res.stopped == "identity" and res.steps == 0
    assert not (tmp_path / "d").exists()


def test_a_backbone_that_is_its_experts_teacher_stays_put(bert, experts, tasks):
    """The teacher is the model itself and γ = 0: the KL starts at 0 and the step cannot lower it."""
    fm = HFEncoderFeatures(bert, max_length=16)
    model = fm.load(experts[0], torch.device("cpu"))
    only = [tasks[0]]
    res = distill(model, fm.features, only, [torch.zeros(len(only[0].inputs), H)],
                  DistillParams(steps=3, lr=1e-4, gamma=0.0))
    assert res.kl_before == pytest.approx(0.0, abs=1e-6)
    assert res.kl_after < 1e-4


def test_distil_in_place_replaces_the_folder_whole(bert, backbone, tasks, tmp_path):
    import shutil

    folder = tmp_path / "bb"
    shutil.copytree(backbone, folder)
    out, _ = distill_backbone(folder, bert, folder, tasks=tasks, params=DistillParams(steps=2, lr=1e-3))
    assert out == folder and not (tmp_path / "bb.partial").exists()
    assert set(load_dir(folder)) == set(load_dir(backbone))
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in backbone.iterdir())


@pytest.mark.parametrize("kw", [{"steps": -1}, {"lr": 0.0}, {"gamma": float("nan")}, {"gamma": -0.1},
                                {"batch_per_task": 0}, {"time_budget_seconds": -1.0}, {"steps": 2.5},
                                {"eval_examples": 0}, {"time_budget_seconds": "5"}, {"lr": float("inf")},
                                {"gamma": float("inf")}, {"steps": True}, {"time_budget_seconds": float("inf")}])
def test_bad_parameters_are_refused(kw):
    with pytest.raises(DistillError):
        DistillParams(**kw)


def test_inputs_that_do_not_fit_are_refused_before_any_step(bert, backbone, tasks, tmp_path):
    t = tasks[0]
    bad_shape = DistillTask("t0", t.head, t.inputs, t.teacher_logp[:, :2])
    nan = DistillTask("t0", t.head, t.inputs, torch.full_like(t.teacher_logp, float("nan")))
    empty = DistillTask("t0", t.head, [], t.teacher_logp[:0])
    for bad, words in ((bad_shape, "teacher outputs must be"), (nan, "not finite"), (empty, "no inputs")):
        with pytest.raises(DistillError, match=words):
            distill_backbone(backbone, bert, tmp_path / "d", tasks=[bad], params=DistillParams(steps=2))
        assert not (tmp_path / "d").exists()
    with pytest.raises(DistillError, match="at least one task"):
        distill_backbone(backbone, bert, tmp_path / "d", tasks=[], params=DistillParams(steps=2))
    with pytest.raises(DistillError, match="does not fit"):
        teacher_outputs(HFEncoderFeatures(bert, max_length=16), backbone, (torch.zeros(2, H + 1), torch.zeros(2)),
                        t.inputs)


def test_two_experts_of_one_task_each_keep_their_own_inputs(bert, backbone, tasks, tmp_path):
    """A task's retrained expert beside its first one: the same task name, other inputs (fewer here)."""
    t0, t1 = tasks
    again = DistillTask("t0", t1.head, t1.inputs[:12], t1.teacher_logp[:12])
    out, res = distill_backbone(backbone, bert, tmp_path / "d", tasks=[t0, again],
                                params=DistillParams(steps=3, lr=1e-3))
    assert res.tasks == ["t0", "t0"] and res.steps == 3 and out.exists()


def test_an_existing_output_folder_is_never_replaced_and_a_missing_backbone_is_named(bert, backbone, tasks, tmp_path):
    keep = tmp_path / "existing"
    keep.mkdir()
    (keep / "precious.txt").write_text("mine")
    with pytest.raises(DistillError, match="exists and is not the backbone"):
        distill_backbone(backbone, bert, keep, tasks=tasks, params=DistillParams(steps=2))
    assert (keep / "precious.txt").read_text() == "mine"
    with pytest.raises(DistillError, match="backbone .* does not exist"):
        distill_backbone(tmp_path / "nosuch", bert, tmp_path / "d", tasks=tasks, params=DistillParams(steps=2))


def test_the_model_card_names_the_step(bert, backbone, tasks, tmp_path):
    from mergestream.io.model_card import write_model_card

    out, _ = distill_backbone(backbone, bert, tmp_path / "d", tasks=tasks, params=DistillParams(steps=2, lr=1e-3))
    card = write_model_card(out, base=bert).read_text()
    assert "| distil post-step | `2 AdamW steps toward the experts of t0, t1 (gamma 0.3, lr 0.001)` |" in card
    assert "distil post-step" not in write_model_card(backbone, base=bert).read_text()


def _geometry_drift(folder: Path, base: Path, fm, items) -> float:
    """‖Ĉ − Ĉ_θ₀‖²_F / B on ``items``: an independent forward of both models."""
    with torch.no_grad():
        f = fm.features(fm.load(folder, torch.device("cpu")), items)
        f0 = fm.features(fm.load(base, torch.device("cpu")), items)
    return float(similarity_term(f, f0))


def test_anchor_sentences_keep_the_base_geometry_where_no_task_input_is(bert, backbone, tasks, tmp_path):
    """General anchors (a sentence_similarity probe's sentences) join the similarity batch: after the
    step, θ₀'s geometry on unseen sentences of the anchors' kind drifts less than without them."""
    fm = HFEncoderFeatures(bert, max_length=16)
    anchors = [(s, None) for s in sentences(48, seed=90)]
    held = [(s, None) for s in sentences(24, seed=91)]
    p = DistillParams(steps=30, lr=1e-3, batch_per_task=8, gamma=10.0, anchor_batch=16)
    _, plain = distill_backbone(backbone, bert, tmp_path / "plain", tasks=tasks, params=p, feature_model=fm)
    _, anch = distill_backbone(backbone, bert, tmp_path / "anch", tasks=tasks, params=p, anchors=anchors,
                               feature_model=fm, cache_dir=tmp_path / "cache")
    assert plain.anchors == 0 and anch.anchors == 48
    on_anchors = [_geometry_drift(tmp_path / d, bert, fm, anchors) for d in ("plain", "anch")]
    on_held = [_geometry_drift(tmp_path / d, bert, fm, held) for d in ("plain", "anch")]
    assert on_anchors[1] < 0.75 * on_anchors[0], on_anchors
    assert on_held[1] < on_held[0], on_held
    # the KL term still does its work
    assert anch.kl_after < anch.kl_before


def test_anchors_off_or_without_their_features_are_handled(bert, backbone, tasks):
    fm = HFEncoderFeatures(bert, max_length=16)
    anchors = [(s, None) for s in sentences(8, seed=92)]
    bf = [torch.zeros(len(t.inputs), H) for t in tasks]
    with pytest.raises(DistillError, match="anchors need θ₀ features"):
        distill(fm.load(backbone, torch.device("cpu")), fm.features, tasks, bf, DistillParams(steps=1),
                anchors=anchors)
    with pytest.raises(DistillError, match="anchors need θ₀ features"):
        distill(fm.load(backbone, torch.device("cpu")), fm.features, tasks, bf, DistillParams(steps=1),
                anchors=anchors, anchor_feats=torch.zeros(8, H + 1))
    with pytest.raises(DistillError, match="anchor_batch"):
        DistillParams(anchor_batch=-1)
    # anchor_batch 0: the anchors are not used, the run is the run without them
    runs = []
    for kw in ({}, {"anchors": anchors, "anchor_feats": torch.zeros(8, H)}):
        model = fm.load(backbone, torch.device("cpu"))
        res = distill(model, fm.features, tasks, bf, DistillParams(steps=2, lr=1e-3, anchor_batch=0), **kw)
        runs.append((res.anchors, res.losses))
    assert runs[0] == runs[1] and runs[0][0] == 0


def test_within_the_previous_versions_patch_only_the_folds_changed_entries_move(bert, experts, backbone, tasks,
                                                                                  tmp_path):
    """``within_patch_from``: the distilled backbone differs from the previous version only where
    the fold's output did (a patch budget's bound holds), and there it still learns."""
    from mergestream.engine import fold as fold_once

    # a second fold that changes a fifth of the entries: Iso-C with a patch budget
    pol = {"alpha": 1.0, "patch_budget": 0.2}
    prev, sparse = tmp_path / "v1", tmp_path / "sparse"
    fold_once(bert, None, experts[0], "iso_c", pol, state_dir=tmp_path / "state", out=prev, expert_id="e0")
    fold_once(bert, prev, experts[1], "iso_c", pol, state_dir=tmp_path / "state", out=sparse, expert_id="e1")
    p = DistillParams(steps=10, lr=1e-3, batch_per_task=8)
    out, res = distill_backbone(sparse, bert, tmp_path / "d", tasks=tasks, params=p, within_patch_from=prev)
    free_out, free = distill_backbone(sparse, bert, tmp_path / "free", tasks=tasks, params=p)
    before, after, old = load_dir(sparse), load_dir(out), load_dir(prev)
    changed_by_fold = sum(int((before[k] != old[k]).sum()) for k in old)
    total = sum(v.numel() for v in old.values())
    assert 0 < changed_by_fold < 0.3 * total
    assert res.trained_entries == changed_by_fold and free.trained_entries is None
    moved = 0
    for k in old:
        outside = before[k] == old[k]
        assert torch.equal(after[k][outside], old[k][outside]), k  # bit for bit outside the fold's patch
        moved += int((after[k] != before[k]).sum())
    assert moved > 0.5 * changed_by_fold and res.kl_after < res.kl_before
    assert sum(int((load_dir(free_out)[k] != old[k]).sum()) for k in old) > 2 * changed_by_fold  # without it
    with pytest.raises(DistillError, match="previous version .* does not exist"):
        distill_backbone(sparse, bert, tmp_path / "x", tasks=tasks, params=p, within_patch_from=tmp_path / "nosuch")


def test_a_mask_without_an_entry_to_train_is_a_recorded_no_op(bert, backbone, tasks):
    """Under a patch budget a fold may change nothing (λ 0): the step then takes no step and
    leaves the backbone as it is, instead of refusing the expert."""
    fm = HFEncoderFeatures(bert, max_length=16)
    model = fm.load(backbone, torch.device("cpu"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    bf = [torch.zeros(len(t.inputs), H) for t in tasks]
    mask = {n: torch.zeros_like(p, dtype=torch.bool) for n, p in model.named_parameters()}
    res = distill(model, fm.features, tasks, bf, DistillParams(steps=3, lr=1e-3), train_mask=mask)
    assert res.stopped == "nothing to train" and res.steps == 0 and res.trained_entries == 0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with pytest.raises(DistillError, match="train mask of"):
        distill(model, fm.features, tasks, bf, DistillParams(steps=1),
                train_mask={n: torch.ones(3, dtype=torch.bool) for n, _ in model.named_parameters()})
