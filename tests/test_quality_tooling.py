"""bench/quality.py tooling, cheaply: parameters without code changes, results to a scratch folder,
a held-out validation split carved before training, JSON before plots, typed recipes. No model is
trained or folded here."""

from __future__ import annotations

import csv
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from mergestream import experts as X
from mergestream.errors import PolicyError

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import quality  # noqa: E402
import quality_report as R  # noqa: E402
import quality_setup as S  # noqa: E402


def _args(*argv):
    return quality.build_parser().parse_args(list(argv))


def test_set_and_config_reach_the_rows_and_the_md(tmp_path):
    cfg = tmp_path / "p.yaml"
    cfg.write_text("params:\n  dop: {alpha: 0.6}\n  opcm+lines: {lines_beta: 0.3}\n  task_arithmetic: {lambda: 0.2}\n")
    pols, over = quality.select_policies(_args("--config", str(cfg), "--set", "dop.alpha=0.7",
                                               "--set", "dop+lines.lines_alpha=0.25"))
    rows = {p + v: params for p, v, params in pols}
    assert rows["dop"]["alpha"] == 0.7 and rows["dop+lines"]["alpha"] == 0.7  # --set wins; variants follow
    assert rows["dop+lines"]["lines_alpha"] == 0.25 and rows["dop"].get("lines_alpha") is None
    assert rows["opcm+lines"]["lines_beta"] == 0.3 and rows["opcm"] == {"alpha": 0.5}
    assert rows["task_arithmetic"]["lambda"] == 0.2 and isinstance(rows["task_arithmetic"]["lambda"], float)
    line = R.hyper_line({"tuned": False, "overrides": over})
    assert "dop.alpha=0.7" in line and "opcm+lines.lines_beta=0.3" in line and "defaults" not in line
    assert "defaults" in R.hyper_line({"tuned": False, "overrides": {}})


def test_bad_parameters_fail_before_anything_is_loaded(tmp_path):
    with pytest.raises(PolicyError, match="alpha"):
        quality.select_policies(_args("--set", "dop.alpha=7"))
    with pytest.raises(S.BenchInputError, match="no such row"):
        quality.select_policies(_args("--set", "nosuch.alpha=1"))
    with pytest.raises(S.BenchInputError, match="LABEL.NAME=VALUE"):
        S.parse_sets(["alpha=1"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("dop: {alpha: 1}\n")
    with pytest.raises(S.BenchInputError, match="params"):
        S.load_config(bad)
    with pytest.raises(SystemExit, match="unknown row"):
        quality.select_policies(_args("--policies", "dop,dopp"))


def test_recipe_is_passed_whole_and_typed():
    assert S.parse_recipe("lr=3e-5,max_train=64,head_init=lp,max_steps=null") == {
        "lr": 3e-5, "max_train": 64, "head_init": "lp", "max_steps": None}
    assert S.parse_recipe('{"lr": 1e-4, "epochs": 1}') == {"lr": 1e-4, "epochs": 1}
    assert S.parse_recipe("") == {}
    with pytest.raises(S.BenchInputError, match="learning_rate"):
        S.parse_recipe("learning_rate=1e-4")
    X.Recipe(**S.parse_recipe("lr=3e-5,max_train=64"))  # what build_expert receives


def test_out_defaults_to_a_scratch_folder_and_threads_option():
    args = _args("--threads", "2")
    assert args.out is None and args.threads == 2
    out = S.default_out()
    try:
        assert S.RESULTS not in out.resolve().parents and out.resolve() != S.RESULTS.resolve()
    finally:
        out.rmdir()


def _doc():
    tasks = ["sms", "trec"]
    steps = [{"t": 1, "task": "sms", "acc": {"sms": 90.0}, "G": 80.0, "fold_seconds": 1.0, "patch_ratio": None,
              "ri_seconds": None},
             {"t": 2, "task": "trec", "acc": {"sms": 88.0, "trec": 70.0}, "G": 79.0, "fold_seconds": 1.0,
              "patch_ratio": 0.5, "ri_seconds": None}]
    run = {"policy": "dop", "variant": "", "order_seed": None, "order": tasks, "params": {"alpha": 0.8},
           "final": {"ACC": 79.0, "BWT": -2.0, "G": 79.0, "H": 79.0, "norm_ACC": 95.0, "fold_seconds_mean": 1.0},
           "steps": steps, "diag": {"sms": 90.0, "trec": 70.0}}
    return {"command": "x", "protocol": {"tasks": tasks, "eval_examples": 10, "sts_pairs": 10, "shuffles": 0,
                                         "final_only_shuffles": False, "tuned": False, "reduced": "",
                                         "overrides": {"dop": {"alpha": 0.8}}, "validation": "holdout"},
            "references": {"expert_acc": {"sms": 95.0, "trec": 80.0}, "base_head_acc": {"sms": 50.0, "trec": 20.0},
                           "linear_probe_acc": {"sms": 90.0, "trec": 70.0}, "expert_G": {"sms": 80.0, "trec": 78.0},
                           "base_G": 82.0},
            "runs": [run], "skipped": [], "planned_runs": [["dop", None]]}


def test_json_is_written_before_the_plots_and_survives_a_plot_error(tmp_path):
    seen = []

    def plotter(doc, out):
        seen.append(json.loads((out / "quality.json").read_text()))  # already on disk
        raise RuntimeError("no display")

    files = R.save_outputs(_doc(), tmp_path, plotter)
    assert files == [] and seen and seen[0]["runs"][0]["policy"] == "dop"
    saved = json.loads((tmp_path / "quality.json").read_text())
    assert saved["plot_error"] == "RuntimeError: no display" and saved["runs"] == _doc()["runs"]
    md = (tmp_path / "quality.md").read_text()
    assert "| dop | alpha=0.8; others: the defaults when it ran |" in md and "overrides: dop.alpha=0.8" in md


def test_from_json_rerenders_with_real_plots(tmp_path):
    src = tmp_path / "in.json"
    src.write_text(json.dumps(_doc()))
    assert quality.main(["--from-json", str(src), "--out", str(tmp_path / "o")]) == 0
    got = json.loads((tmp_path / "o" / "quality.json").read_text())
    assert got["plots"] == ["quality_acc_matrix.png", "quality_curves.png"] and "plot_error" not in got
    assert all((tmp_path / "o" / f).stat().st_size > 0 for f in got["plots"])


def _family_doc():
    """_doc() with rows of several families (file order + one shuffle), each with patch sizes."""
    import copy

    doc = _doc()
    rows = {"iso_c": 79.7, "safe_merge": 76.9, "safe_merge+iso": 79.5, "mdm_oc": 76.7, "mdm_oc+cmaes": 76.8,
            "ties": 75.8, "ties+ri": 77.2, "dop": 75.6, "dop+lines": 77.2, "task_arithmetic": 76.8}
    doc["runs"], doc["protocol"]["shuffles"], doc["planned_runs"] = [], 1, []
    for i, (name, h) in enumerate(rows.items()):
        policy, _, variant = name.partition("+")
        for seed, dh in ((None, 0.0), (0, -0.2)):
            run = copy.deepcopy(_doc()["runs"][0])
            run.update(policy=policy, variant="+" + variant if variant else "", order_seed=seed)
            run["final"].update(H=h + dh, patch_ratio_mean=0.1 + 0.08 * i, patch_ratio_v2_mean=0.05 + 0.05 * i)
            doc["runs"].append(run)
    return doc


def test_plots_show_the_rows_that_matter_and_quality_against_patch_size(tmp_path):
    """quality_curves.png colours the default, the seed methods and each family's best (the rest
    grey, in a table); quality_patch.png plots H against patch/model for every row (issue 38)."""
    import quality_plots as P

    doc = _family_doc()
    assert P.highlighted(doc, "iso_c") == ["iso_c", "safe_merge", "mdm_oc", "safe_merge+iso", "mdm_oc+cmaes",
                                           "ties+ri", "dop+lines", "task_arithmetic"]
    assert P.mean_h(doc)["ties+ri"] == pytest.approx(77.1)
    files = P.plot(doc, tmp_path, "iso_c")
    assert files == ["quality_acc_matrix.png", "quality_curves.png", "quality_patch.png"]
    assert all((tmp_path / f).stat().st_size > 10_000 for f in files)
    for run in doc["runs"]:  # no patch sizes recorded: no patch plot, the others still drawn
        run["final"].pop("patch_ratio_mean")
    (tmp_path / "o").mkdir()
    assert P.plot(doc, tmp_path / "o", "iso_c") == ["quality_acc_matrix.png", "quality_curves.png"]


def test_validation_rows_are_carved_out_of_train_before_training(tmp_path):
    src = X.data_root()
    dst = S.carved_folder(tmp_path, ["sms", "trec"], 50)
    S.carve_validation(src, dst, ["sms", "trec"], 50)
    for t in ("sms", "trec"):
        orig, carved = X.load_task(t, src), X.load_task(t, dst)
        val = S.validation_rows(dst, t)
        assert len(val) == 50 and len(carved.train) == len(orig.train) - 50 and carved.test == orig.test
        assert carved.classes == orig.classes
        assert not set(val) & set(carved.train)  # what the experts train on never contains them
        assert set(val) <= set(orig.train)
    before = (dst / "tasks" / "sms.tsv").read_bytes()
    S.carve_validation(src, dst, ["sms", "trec"], 50)  # deterministic: same rows, same experts' cache key
    assert (dst / "tasks" / "sms.tsv").read_bytes() == before
    with open(dst / "tasks" / "sms.tsv", newline="", encoding="utf-8") as fh:
        assert {r["split"] for r in csv.DictReader(fh, delimiter="\t")} == {"train", "test", "val"}
    with pytest.raises(S.BenchInputError, match="cannot carve"):
        S.carve_validation(src, tmp_path / "too-many", ["sms"], 10_000)


def _probe_file_rows(folder: Path) -> list[tuple[str, str | None, int]]:
    return [(o["text"], o.get("text2"), o["label"]) for o in map(json.loads, open(folder / "probe.jsonl", encoding="utf-8"))]


@pytest.mark.parametrize("carved", [True, False], ids=["carved-val-rows", "shared-files"])
def test_expert_task_probes_are_validation_rows_never_test_rows(tmp_path, carved):
    """Issue 39, 4(e): the probe files written next to built experts (what the daemon's CMA-ES and
    strength search tune on) hold validation rows: on the 8 real stream tasks, no probe row is a test
    row (a text shared by the test and train splits, a known duplicate of the data, is a train row)
    and none is a row the expert trains on. Carved: the bench's val rows, the tuning rows themselves."""
    import torch

    tasks = list(X.STREAM_TASKS)
    src = X.data_root()
    data = S.carve_validation(src, S.carved_folder(tmp_path, tasks, 100), tasks, 100) if carved else src
    for t in tasks:
        orig = X.load_task(t, src)
        task = X.load_task(t, data)
        trained_on, rows, source = X.probe_split(task, 200)
        pdir = X.write_task_probe(tmp_path / f"probe-{t}", t, torch.zeros(len(task.classes), X.HIDDEN),
                                  torch.zeros(len(task.classes)), rows)
        written = _probe_file_rows(pdir)
        assert written == rows and len(written) == (100 if carved else 200) and "val" in source
        test_texts = {(a, b) for a, b, _ in orig.test}
        train_texts = {(a, b) for a, b, _ in orig.train}
        leaked = [r for r in written if (r[0], r[1]) in test_texts and (r[0], r[1]) not in train_texts]
        assert not leaked, f"{t}: {len(leaked)} probe rows are test rows"
        # the expert never trains on them (counted: a few tasks repeat a text within train)
        if carved:
            assert set(written) == set(S.validation_rows(data, t))  # the rows tuning uses, not in train
            assert trained_on.train == task.train
        else:
            assert Counter(trained_on.train) + Counter(written) == Counter(task.train)
            assert len(trained_on.train) == len(task.train) - 200
    assert X.probe_split(X.load_task("trec", data), 200) == X.probe_split(X.load_task("trec", data), 200)  # seeded


def test_lpft_rule_and_variants_tuned_with_their_parent():
    assert S.needs_lpft(60.0, 70.0) and not S.needs_lpft(75.0, 70.0)
    pols = [("dop", "", {"alpha": 0.8}), ("dop", "+lines", {"alpha": 0.8, "lines_alpha": 0.5}),
            ("opcm", "", {"alpha": 0.5}), ("opcm", "+lines", {"alpha": 0.5})]
    tuned = {"dop": {"param": "alpha", "chosen": 0.9}, "opcm": {"param": "alpha", "chosen": 0.7}}
    got = {p + v: params for p, v, params in quality.tuned_rows(pols, tuned, {"opcm+lines": {"alpha": 0.3}})}
    assert got["dop"]["alpha"] == got["dop+lines"]["alpha"] == 0.9 and got["dop+lines"]["lines_alpha"] == 0.5
    assert got["opcm"]["alpha"] == 0.7 and got["opcm+lines"]["alpha"] == 0.5  # set explicitly: kept

    # a variant with a grid of its own: the parent's tuned value, then its own
    rows = [("safe_merge", "", {"lambda": 0.3}), ("safe_merge", "+iso", {"lambda": 0.3, "iso_alpha": 2.0})]
    tuned = {"safe_merge": {"param": "lambda", "chosen": 0.5}, "safe_merge+iso": {"param": "iso_alpha", "chosen": 2.5}}
    got = {p + v: params for p, v, params in quality.tuned_rows(rows, tuned, {})}
    assert got["safe_merge"] == {"lambda": 0.5} and got["safe_merge+iso"] == {"lambda": 0.5, "iso_alpha": 2.5}
    got = {p + v: params for p, v, params in quality.tuned_rows(rows, tuned, {"safe_merge+iso": {"iso_alpha": 3.0}})}
    assert got["safe_merge+iso"] == {"lambda": 0.5, "iso_alpha": 2.0}  # set explicitly (applied by apply_overrides)
    assert all("+" not in k or k in {p + v for p, v, _ in quality.POLICIES} for k in quality.GRID)


def test_a_row_with_its_own_strength_keeps_it_over_the_tuned_value():
    rows = [("iso_c", "", {"alpha": 1.5}), ("iso_c", "+budget29", {"alpha": 1.5}), ("iso_c", "+a2.5", {"alpha": 2.5})]
    tuned = {"iso_c": {"param": "alpha", "chosen": 2.0}}
    got = {p + v: params for p, v, params in quality.tuned_rows(rows, tuned, {})}
    assert got["iso_c"]["alpha"] == got["iso_c+budget29"]["alpha"] == 2.0  # variants follow their parent
    assert got["iso_c+a2.5"]["alpha"] == 2.5  # chosen with its data steps on: kept
    labels = {p + v: params for p, v, params in quality.POLICIES}
    assert quality.OWN_STRENGTH <= set(labels)
    assert labels["iso_c+a2.5"]["alpha"] == json.loads((S.RESULTS / "distill_alpha.json").read_text())["chosen_alpha"]
    # the budgeted row's α: the validation argmax over every α tried under its mask at its distil lr
    docs = [json.loads(f.read_text()) for f in [*S.RESULTS.glob("distill_alpha*_budget29.json"),
                                                  S.RESULTS / "distill_lr_budget29.json"]]
    docs = [d for d in docs if d.get("row", "iso_c") == "iso_c"]  # another row's α is not this row's
    tried = [{"alpha": d["iso_c"]["alpha"], **r} for d in docs for r in d["rows"]]  # older files: α in "iso_c"
    at_lr = [r for r in tried if r["lr"] == quality.ROW_DISTILL["iso_c+budget29a3lr3e-5"]["distill_lr"]]
    assert {r["alpha"] for r in at_lr} >= {2.0, 2.5, 3.0, 3.5}
    assert labels["iso_c+budget29a3lr3e-5"]["alpha"] == max(at_lr, key=lambda r: r["validation"]["H"])["alpha"]
    # the seed row's ρ: the validation argmax over every ρ tried at its iso_alpha with the step at lr 1e-5, no budget
    row, seed = labels["safe_merge+iso-rho1"], labels["safe_merge+iso"]
    docs = [json.loads(f.read_text()) for f in S.RESULTS.glob("distill_safe_iso_*.json")]
    tried = [(d["params"]["rho"], r["validation"]["H"]) for d in docs if d["row"] == "safe_merge+iso"
             and d["patch_budget"] is None for r in d["rows"] if r["lr"] == 1e-5 and r["alpha"] == seed["iso_alpha"]]
    assert {rho for rho, _ in tried} >= {0.3, 0.5, 0.7, 0.9, 1.0}
    assert row["rho"] == max(tried, key=lambda t: t[1])[0]
    assert (row["lambda"], row["iso_alpha"]) == (seed["lambda"], seed["iso_alpha"])  # the seed row's others, as it ran


def test_gains_table_compares_each_variant_with_its_parent_on_shared_orders(tmp_path):
    doc = _doc()
    base = doc["runs"][0]
    var = json.loads(json.dumps(base))
    var.update(variant="+lines", params={"alpha": 0.8, "lines_alpha": 0.5})
    var["final"].update(H=80.5, ACC=81.0, fold_seconds_mean=2.0)
    lonely = json.loads(json.dumps(var))
    lonely["order_seed"] = 0  # the parent has no run on this order: not compared
    lonely["final"]["H"] = 0.0
    doc["runs"] += [var, lonely]
    R.save_outputs(doc, tmp_path, lambda d, o: [])
    md = (tmp_path / "quality.md").read_text()
    assert "| dop+lines | dop | 1 | +1.5 | +2.0 | +0.0 | +0.0 | 2.0 | 1.0 |" in md
    # a new method that is a policy of its own is compared with the policy it extends
    ta, iso = json.loads(json.dumps(base)), json.loads(json.dumps(base))
    ta.update(policy="task_arithmetic", params={"lambda": 0.2})
    iso.update(policy="iso_c", params={"alpha": 2.0})
    iso["final"].update(H=81.0, fold_seconds_mean=3.0)
    doc["runs"] += [ta, iso]
    R.save_outputs(doc, tmp_path, lambda d, o: [])
    md = (tmp_path / "quality.md").read_text()
    assert "| iso_c | task_arithmetic | 1 | +2.0 | +0.0 | +0.0 | +0.0 | 3.0 | 1.0 |" in md


def test_steps_curve_rows_are_safe_merge_with_those_steps_and_bad_values_fail_early():
    pols, _ = quality.select_policies(_args("--policies", "safe_merge", "--steps-curve", "0,200"))
    assert [(v, p.get("steps")) for _, v, p in pols] == [("", None), ("+steps0", 0), ("+steps200", 200)]
    assert all(p["rho"] == quality.SAFE_DEFAULTS["rho"] for _, _, p in pols)
    for bad in ("0,x", "-5"):
        with pytest.raises(SystemExit, match="steps-curve"):
            quality.select_policies(_args("--steps-curve", bad))


def test_resume_keeps_earlier_pieces_only_for_the_same_protocol(tmp_path):
    argv = ["--tasks", "sst2,trec", "--eval-examples", "50", "--tune", "--out", str(tmp_path)]
    args = _args(*argv)
    assert S.load_resume(tmp_path, args) is None  # nothing to resume: a fresh start
    doc = {**_doc(), "protocol": {**_doc()["protocol"], "args": S.protocol_args(args)}}
    (tmp_path / "quality.json").write_text(json.dumps(doc))
    # where results go, threads and the note do not change a number: still the same run
    same = _args(*argv, "--threads", "2", "--workdir", "/elsewhere", "--reduced-note", "x", "--resume")
    assert S.load_resume(tmp_path, same)["runs"] == doc["runs"]
    for change in (["--eval-examples", "60"], ["--shuffles", "1"], ["--set", "dop.alpha=0.7"], ["--cmaes"],
                   ["--recipe", "lr=3e-5"], ["--validation", "train"]):
        name = change[0].lstrip("-").replace("-", "_")
        name = "sets" if name == "set" else name
        with pytest.raises(S.BenchInputError, match=name):
            S.load_resume(tmp_path, _args(*argv, *change))
    # --ri-policies only adds rows: a resume may list more of them, never fewer
    more = _args(*argv, "--ri-policies", "task_arithmetic,ties,best,safe_merge+iso")
    assert S.load_resume(tmp_path, more)["runs"] == doc["runs"]
    with pytest.raises(S.BenchInputError, match="ri_policies"):
        S.load_resume(tmp_path, _args(*argv, "--ri-policies", "ties"))
    # an option added to the script after the run started matches when it is at its default
    older = {k: v for k, v in S.protocol_args(args).items() if k != "steps_curve"}
    (tmp_path / "quality.json").write_text(json.dumps({**doc, "protocol": {**doc["protocol"], "args": older}}))
    defaults = vars(quality.build_parser().parse_args([]))
    assert S.load_resume(tmp_path, args, defaults)["runs"] == doc["runs"]
    with pytest.raises(S.BenchInputError, match="steps_curve"):
        S.load_resume(tmp_path, _args(*argv, "--steps-curve", "0,200"), defaults)
    legacy = {**_doc()}  # a file from before --resume recorded its options
    (tmp_path / "quality.json").write_text(json.dumps(legacy))
    with pytest.raises(S.BenchInputError, match="does not record its options"):
        S.load_resume(tmp_path, args)


def test_a_resumed_run_refuses_experts_that_differ_from_its_earlier_pieces(tmp_path):
    """Real expert files, hashed with the definition the record used: a record from before the per-tensor
    weights hash (no ``expert_hash_version``) is checked with version 1, a new one with its version."""
    import torch

    from .conftest import save_tensors

    folders = {}
    for i, t in enumerate(("sst2", "trec", "other")):
        folders[t] = tmp_path / t
        folders[t].mkdir()
        save_tensors(folders[t] / "model.safetensors", {"w": torch.full((3, 2), float(i)), "b": torch.ones(2)})
    experts = {"sst2": folders["sst2"], "trec": folders["trec"]}
    v1 = {t: S.expert_hash(f, 1) for t, f in experts.items()}
    v2 = {t: S.expert_hash(f) for t, f in experts.items()}
    assert v1 != v2
    S.check_resumed_experts({"protocol": {"expert_hashes": v1}}, experts)  # an old record: version 1
    S.check_resumed_experts({"protocol": {"expert_hashes": v2, "expert_hash_version": 2}}, experts)
    S.check_resumed_experts(None, experts)  # a fresh start
    S.check_resumed_experts({"protocol": {}}, experts)  # pieces that recorded none
    with pytest.raises(S.BenchInputError, match=f"trec {v2['trec'][:12]} -> "):
        S.check_resumed_experts({"protocol": {"expert_hashes": v2, "expert_hash_version": 2}},
                                {"sst2": folders["sst2"], "trec": folders["other"]})
    with pytest.raises(S.BenchInputError, match="sst2"):  # v2 hashes recorded without their version
        S.check_resumed_experts({"protocol": {"expert_hashes": v2}}, experts)


def test_a_changed_grid_is_tuned_again_unless_runs_used_the_old_value():
    entry = {"param": "alpha", "grid": [0.5, 0.9], "chosen": 0.9}
    assert not quality.stale_grid(entry, [0.5, 0.9], "dop", [])
    assert quality.stale_grid(entry, [0.5, 0.9, 1.0], "dop", [{"policy": "opcm"}])
    with pytest.raises(S.BenchInputError, match="dop: GRID changed"):
        quality.stale_grid(entry, [0.5, 0.9, 1.0], "dop", [{"policy": "dop"}])
    # a variant's own grid: only that row's runs pin it
    runs = [{"policy": "safe_merge", "variant": ""}]
    assert quality.stale_grid(entry, [0.5, 1.0], "safe_merge", runs, "+iso")
    with pytest.raises(S.BenchInputError, match="GRID changed"):
        quality.stale_grid(entry, [0.5, 1.0], "safe_merge", runs + [{"policy": "safe_merge", "variant": "+iso"}], "+iso")


def test_bwt_is_reported_under_both_conventions_on_a_small_accuracy_matrix():
    """a (3 tasks, fold order a, b, c): a_aa = 90, a_bb = 80, a_cc = 70; after the last fold a = 84,
    b = 77, c = 70. Ours: ((84 − 90) + (77 − 80)) / 2 = −4.5; the reference's: the same sum / 3 = −3."""
    got = R.backward_transfer(["a", "b", "c"], {"a": 84.0, "b": 77.0, "c": 70.0}, {"a": 90.0, "b": 80.0, "c": 70.0})
    assert got == {"BWT": pytest.approx(-4.5), "BWT_ref": pytest.approx(-3.0)}
    assert R.backward_transfer(["a"], {"a": 50.0}, {"a": 60.0}) == {"BWT": 0.0, "BWT_ref": 0.0}
    res = {"final_acc": {"a": 84.0, "b": 77.0, "c": 70.0}, "diag": {"a": 90.0, "b": 80.0, "c": 70.0}, "G": 80.0,
           "fold_seconds": [1.0]}
    s = quality.summarise(["a", "b", "c"], res, {"a": 95.0, "b": 85.0, "c": 75.0})
    assert s["BWT"] == pytest.approx(-4.5) and s["BWT_ref"] == pytest.approx(-3.0)


def test_table_shows_the_reference_bwt_also_for_rows_written_before_it(tmp_path):
    """A stored row with BWT_ref renders it; an older row without it gets BWT · (T − 1)/T."""
    doc = _doc()
    R.write_md(doc, tmp_path / "old.md")
    assert "| BWT | BWT ref |" in (tmp_path / "old.md").read_text()
    assert "| -2.0 | -1.0 | 80.0 |" in (tmp_path / "old.md").read_text()  # T = 2: −2 · 1/2; a_jj (90 + 70)/2
    doc["runs"][0]["final"]["BWT_ref"] = -0.7
    R.write_md(doc, tmp_path / "new.md")
    assert "| -2.0 | -0.7 |" in (tmp_path / "new.md").read_text()


def _two_orders(doc, policy, finals, variant=""):
    """``doc`` with ``policy`` run in two orders whose final accuracies are ``finals`` (two dicts)."""
    runs = []
    for seed, (order, fa) in zip((None, 1), finals):
        steps = [{"t": 1, "task": order[0], "acc": {order[0]: 91.0}, "G": 80.0, "fold_seconds": 1.0,
                  "patch_ratio": None, "ri_seconds": None},
                 {"t": 2, "task": order[1], "acc": fa, "G": 79.0, "fold_seconds": 1.0, "patch_ratio": None,
                  "ri_seconds": None}]
        acc = sum(fa.values()) / 2
        runs.append({"policy": policy, "variant": variant, "order_seed": seed, "order": order, "params": {"alpha": 2.0},
                     "ran_params": {"alpha": 2.0, "lambda": 0.2, "rank": "numerical"},
                     "final": {"ACC": acc, "BWT": -1.0 - (seed or 0), "G": 79.0, "H": R.hmean(acc, 79.0),
                               "norm_ACC": 95.0, "fold_seconds_mean": 1.0},
                     "steps": steps, "diag": {order[0]: 91.0, order[1]: fa[order[1]]}})
    doc["runs"] += runs
    return doc


def test_order_free_rows_say_so_instead_of_a_zero_spread_and_list_every_parameter(tmp_path):
    same = {"sms": 88.0, "trec": 70.0}
    doc = _two_orders(_doc(), "iso_c", [(["sms", "trec"], same), (["trec", "sms"], same)])
    doc = _two_orders(doc, "iso_c", [(["sms", "trec"], same), (["trec", "sms"], {"sms": 86.0, "trec": 70.0})],
                      variant="+ri")
    R.write_md(doc, tmp_path / "q.md")
    rows: dict[str, str] = {}
    for line in (tmp_path / "q.md").read_text().splitlines():
        if line.startswith("| iso_c"):
            rows.setdefault(line.split(" | ")[0][2:], line)  # the final-model table comes first
    free = rows["iso_c"]
    assert "alpha=2.0, lambda=0.2, rank=numerical; order-free" in free
    assert "| 79.0 | 95.0 | -1.5 ± 0.5 |" in free  # ACC, norm ACC without a spread; BWT keeps its own
    assert "order-free" not in rows["iso_c+ri"] and "± 0.0" in rows["iso_c+ri"]  # RI depends on the order


def test_gain_share_table_per_task_and_on_average(tmp_path):
    """sms: expert 95, base+head 50, merged 88 → 84 %; trec: expert 80, base+head 20, merged 70 → 83 %;
    a task whose expert gains under a point over base+head gets –."""
    assert R.gain_share(88.0, 95.0, 50.0) == pytest.approx(100 * 38 / 45)
    assert R.gain_share(89.2, 89.6, 89.2) is None
    doc = _doc()
    R.write_md(doc, tmp_path / "q.md")
    text = (tmp_path / "q.md").read_text()
    assert "## Share of the expert's gain recovered" in text and "| dop | 84 | 83 | 84 |" in text
    doc["references"]["base_head_acc"]["trec"] = 79.5
    R.write_md(doc, tmp_path / "q2.md")
    assert "| dop | 84 | – | 84 |" in (tmp_path / "q2.md").read_text()


def test_heldout_split_and_report_without_models(tmp_path):
    """bench/quality_heldout.py: the split keeps file order and refuses a bad one; the report ranks
    each set, compares auto and the visible-tuned value with the default, and says how far the
    visible-best row is from the held-out best."""
    import quality_heldout as HO

    tasks = list(X.STREAM_TASKS)
    vis, held = HO.split_tasks(tasks, list(HO.HELDOUT))
    assert vis == ["sst2", "trec", "20ng", "tweets", "fortune_topic"] and held == ["agnews", "wn_noun", "sicke"]
    for bad in (["nope"], tasks, []):
        with pytest.raises(S.BenchInputError):
            HO.split_tasks(tasks, bad)

    def run(label, mode, which, h, strength):
        return {"label": label, "mode": mode, "set": which, "strength_text": f"x {strength}", "params": {"x": strength},
                "final": {"ACC": h, "G": h, "H": h, "BWT": -1.0}}

    runs = [run("task_arithmetic", "default", "visible", 70.0, 0.3), run("task_arithmetic", "auto", "visible", 71.0, "0.3 → 0.5"),
            run("iso_c", "visible-tuned", "visible", 80.0, 2.7), run("iso_c", "default", "visible", 79.0, 2.0),
            run("iso_c", "visible-tuned", "heldout", 75.0, 2.7), run("task_arithmetic", "visible-tuned", "heldout", 76.0, 0.2),
            run("iso_c", "default", "heldout", 74.0, 2.0), run("iso_c", "auto", "heldout", 74.5, "2 → 3.5")]
    doc = {"command": "c", "runs": runs, "seconds": 60.0, "references": {"base_G": 82.0},
           "tuning": {"iso_c": {"param": "alpha", "val_H": {"2.0": 80.0, "2.7": 81.0}, "chosen": 2.7}},
           "protocol": {"visible": vis, "heldout": held, "eval_examples": 300, "sts_pairs": 500, "val_rows": 100,
                        "recipe_overrides": {"epochs": 1}, "lpft": "tasks", "reduced": "file order only",
                        "objective": {"task_weight": 1.0, "general_weight": 1.0, "examples_per_task": 64,
                                      "general_pairs": 200}}}
    assert HO.ranking(runs, "heldout", "visible-tuned") == [("task_arithmetic", 76.0), ("iso_c", 75.0)]
    doc["findings"] = f = HO.findings(doc)
    assert f["visible-best on held-out"].startswith("iso_c (best on visible) scores H 75.00") and "1.00 below" in f["visible-best on held-out"]
    assert f["auto vs default (visible)"].startswith("mean ΔH +1.00") and f["auto vs default (heldout)"].startswith("mean ΔH +0.50")
    HO.write_md(doc, tmp_path / "q.md")
    md = (tmp_path / "q.md").read_text()
    assert "| iso_c | auto | x 2 → 3.5 | 74.5 | 74.50 | 74.50 | -1.0 | +0.50 |" in md
    assert "| visible-tuned | iso_c 80.00 | task_arithmetic 76.00, iso_c 75.00 |" in md and "Reduced: file order only" in md
    assert "POLICIES (iso_c {'x': 2.0}; task_arithmetic {'x': 0.3})" in md


def test_ri_rows_run_each_row_once_and_best_waits_for_the_file_order():
    """`--ri-policies best,iso_cts` where the best plain row is iso_cts planned and ran its +ri rows
    twice (the benchmark of 2026-12-06: 116 runs for 112 planned)."""
    pols = [("task_arithmetic", "", {"lambda": 0.2}), ("iso_c", "", {"alpha": 2.0}),
            ("iso_cts", "", {"alpha": 2.0}), ("iso_c", "+budget", {"patch_budget": 0.2})]
    wanted = ["task_arithmetic", "best", "iso_cts", "iso_c+budget", "nosuch"]
    assert quality.ri_rows(wanted, [], pols) == [("task_arithmetic", "+ri", {"lambda": 0.2}),
                                                 ("iso_cts", "+ri", {"alpha": 2.0}),
                                                 ("iso_c", "+budget+ri", {"patch_budget": 0.2})]

    def run(policy, h, seed=None, variant=""):
        return {"policy": policy, "variant": variant, "order_seed": seed, "final": {"H": h}}
    runs = [run("task_arithmetic", 90.0), run("iso_c", 79.7), run("iso_cts", 79.9), run("iso_c", 85.0, seed=0),
            run("iso_c", 99.0, variant="+budget")]
    rows = quality.ri_rows(wanted, runs, pols)
    assert [p + v for p, v, _ in rows] == ["task_arithmetic+ri", "iso_cts+ri", "iso_c+budget+ri"]
    runs.append(run("iso_c", 80.5))  # best is now iso_c: a row of its own, ahead of the listed ones
    rows = quality.ri_rows(wanted, runs, pols)
    assert [p + v for p, v, _ in rows] == ["task_arithmetic+ri", "iso_c+ri", "iso_cts+ri", "iso_c+budget+ri"]
    rows[1][2]["alpha"] = 9.0
    assert pols[1][2]["alpha"] == 2.0  # each row gets its own params


def test_patch_plot_labels_the_front_of_quality_against_patch_size():
    """A row no other row beats in H at its patch size or less is labelled even when it is no
    family's best (iso_c+budget at a fifth of the bytes, 0.3 H under Iso-C: unlabelled before)."""
    import quality_plots as P

    doc = _family_doc()
    ratio = {P._label(r): (r["final"]["patch_ratio_mean"], r["final"]["patch_ratio_v2_mean"]) for r in doc["runs"]}
    ratio |= {"iso_c+budget": (0.04, 0.02), "safe_merge+lines": (0.9, 0.5), "opcm+lines": (0.9, None),
              "iso_c+budget+ri": (0.04, 0.021), "iso_c+lines": (0.9, 0.045)}
    rows = (("iso_c+budget", 79.4), ("safe_merge+lines", 76.0), ("opcm+lines", 90.0), ("iso_c+budget+ri", 80.0),
            ("iso_c+lines", 79.5))  # iso_c's size (0.05) within the tolerance, 0.1 H worse: not on it
    for label, h in rows:
        policy, _, variant = label.partition("+")
        doc["runs"].append({"policy": policy, "variant": "+" + variant, "order_seed": None, "final": {"H": h}})
    show = P.patch_labels(doc, ratio, "iso_c")
    assert "iso_c+budget" in show and "safe_merge+lines" not in show and "iso_c+lines" not in show
    assert "iso_c+budget+ri" in show  # the front of every row; iso_c+budget is on the data-free one
    assert {"iso_c", "safe_merge", "ties", "dop+lines", "opcm+lines"} <= show  # plain rows, family bests


def test_distill_rows_extend_plain_variant_and_ri_rows_and_compare_with_them(tmp_path):
    """`--distill-policies iso_c,iso_c+ri`: each named row once more with the distil post-step,
    its +ri-ness kept, and the gains table sets each against the same row without the step."""
    pols = [("iso_c", "", {"alpha": 2.0}), ("iso_c", "+ri", {"alpha": 2.0}), ("opcm", "+lines", {"alpha": 0.5})]
    rows = quality.distill_rows(["iso_c", "iso_c+ri", "opcm+lines", "iso_c", "nosuch", "nosuch+ri"], pols)
    assert rows == [("iso_c", "+distill", {"alpha": 2.0}), ("iso_c", "+ri+distill", {"alpha": 2.0}),
                    ("opcm", "+lines+distill", {"alpha": 0.5})]
    # a +ri row --ri-policies does not run ("best" named another policy) is still a +ri+distill row
    assert quality.distill_rows(["iso_c+ri", "opcm+lines+ri"], [pols[0], pols[2]]) == [
        ("iso_c", "+ri+distill", {"alpha": 2.0}), ("opcm", "+lines+ri+distill", {"alpha": 0.5})]
    rows[0][2]["alpha"] = 9.0
    assert pols[0][2]["alpha"] == 2.0  # each row gets its own params
    args = quality.build_parser().parse_args(["--distill-policies", "iso_c+ri", "--distill-steps", "50"])
    assert args.distill_policies == "iso_c+ri" and args.distill_steps == 50 and args.distill_gamma == 0.3

    doc = _doc()
    base = doc["runs"][0]
    ri, both = json.loads(json.dumps(base)), json.loads(json.dumps(base))
    ri.update(variant="+ri")
    ri["final"].update(H=80.0)
    both.update(variant="+ri+distill")
    both["final"].update(H=81.5, distill_seconds_mean=42.0)
    doc["runs"] += [ri, both]
    R.save_outputs(doc, tmp_path, lambda d, o: [])
    md = (tmp_path / "quality.md").read_text()
    assert "| dop+ri+distill | dop+ri | 1 | +1.5 |" in md
    assert "| 42.0 |" in md.split("dop+ri+distill |", 1)[1].splitlines()[0]  # its distil seconds column
    assert R.recommended_row(doc)["label"] == "dop"  # a row that needs data is never the default


def test_a_resume_with_other_distil_options_reruns_only_the_distil_rows(tmp_path):
    """The distil options decide only the +distill rows: a resume with other values is accepted, and
    exactly the +distill runs that ran with other values (a run from before an option existed ran at
    its old value) are re-run."""
    argv = ["--tasks", "sst2,trec", "--distill-policies", "iso_c+ri", "--out", str(tmp_path)]
    args = _args(*argv)
    doc = {**_doc(), "protocol": {**_doc()["protocol"], "args": S.protocol_args(args)}}
    ran = {"distill_steps": 100, "distill_lr": 1e-5, "distill_gamma": 0.3, "distill_aux": 128}
    doc["runs"] = [{"policy": "iso_c", "variant": "+ri", "order_seed": None, "ran_params": {}},
                   {"policy": "iso_c", "variant": "+ri+distill", "order_seed": None, "ran_params": dict(ran)},
                   {"policy": "iso_c", "variant": "+ri+distill", "order_seed": 0,
                    "ran_params": {**ran, "distill_anchors": 256}}]
    (tmp_path / "quality.json").write_text(json.dumps(doc))
    for change, stale_seeds in (([], [0]), (["--distill-anchors", "256"], [None]),
                                (["--distill-gamma", "1.0", "--distill-anchors", "256"], [None, 0]),
                                (["--distill-steps", "50"], [None, 0])):
        now = _args(*argv, *change)
        prev = S.load_resume(tmp_path, now, vars(quality.build_parser().parse_args([])))
        assert [r["order_seed"] for r in S.stale_distill_runs(prev["runs"], now)] == stale_seeds, change
    with pytest.raises(S.BenchInputError, match="eval_examples"):  # other options still refuse
        S.load_resume(tmp_path, _args(*argv, "--distill-anchors", "256", "--eval-examples", "60"))



def test_a_row_with_its_own_distil_options_is_stale_only_against_them():
    """A row of ``ROW_DISTILL`` is compared with its own options, every other row with the
    command's: a resume re-runs neither when each ran as it should, and re-runs the row whose
    recorded options are not its own."""
    args = _args("--tasks", "sst2,trec", "--distill-policies", "iso_c+ri,iso_c+budget29+ri")
    ran = {"distill_steps": 100, "distill_lr": 1e-5, "distill_gamma": 0.3, "distill_aux": 128, "distill_anchors": 0}
    runs = [{"policy": "iso_c", "variant": "+ri+distill", "order_seed": None, "ran_params": dict(ran)},
            {"policy": "iso_c", "variant": "+budget29+ri+distill", "order_seed": None,
             "ran_params": {**ran, "distill_lr": 3e-5}},
            {"policy": "iso_c", "variant": "+budget29+ri+distill", "order_seed": 0, "ran_params": dict(ran)}]
    own = {"iso_c+budget29": {"distill_lr": 3e-5}}
    assert [(r["variant"], r["order_seed"]) for r in S.stale_distill_runs(runs, args, own)] == \
        [("+budget29+ri+distill", 0)]
    assert [r["order_seed"] for r in S.stale_distill_runs(runs, args)] == [None]  # no row options: the command's
    assert S.distill_row_label("iso_c", "+budget29+ri+distill") == "iso_c+budget29"
    assert S.distill_row_label("dop", "+distill") == "dop"
    assert set().union(*map(set, quality.ROW_DISTILL.values())) <= {"distill_steps", "distill_lr", "distill_gamma"}

def test_distil_anchors_are_sts_train_sentences_never_dev_or_test():
    """STS-B repeats some sentences across its splits: an anchor is never a sentence of dev (tuning)
    or test (the G measured), in any pair."""
    data = X.data_root(None)
    anchors = [a for a, _ in quality.sts_train_sentences(data)]
    assert len(anchors) > 9000 and len(set(anchors)) == len(anchors)
    held = {s for _, a, b in quality.read_sts_dev(data, None) for s in (a, b)}
    held |= {s for _, a, b in X.load_sts(data) for s in (a, b)}
    assert len(held) > 2000 and not held & set(anchors)


def test_the_distil_proxy_folds_a_row_as_the_benchmark_ran_it_and_varies_its_own_coefficient():
    import distill_gamma

    tuning = {"iso_c": {"param": "alpha", "chosen": 2.0}, "safe_merge": {"param": "lambda", "chosen": 0.5},
              "safe_merge+iso": {"param": "iso_alpha", "chosen": 2.5}}
    assert distill_gamma.row_params("iso_c", tuning) == ("iso_c", {"alpha": 2.0, "lambda": 0.2}, "alpha")
    policy, params, key = distill_gamma.row_params("safe_merge+iso", tuning)
    assert (policy, key) == ("safe_merge", "iso_alpha")
    assert params["iso_alpha"] == 2.5 and params["lambda"] == 0.5 and params["rho"] == 0.3
    with pytest.raises(ValueError):
        distill_gamma.row_params("no_such_row", tuning)


def test_the_distil_proxy_folds_a_row_at_other_values_of_its_parameters():
    import distill_gamma

    assert distill_gamma._overrides("rho=0.5, steps=200,risk_mask=false") == {"rho": 0.5, "steps": 200,
                                                                            "risk_mask": False}
    assert distill_gamma._overrides(None) == {} == distill_gamma._overrides("")
    for bad in ("rho", "=0.5", "rho=half"):
        with pytest.raises((SystemExit, ValueError)):
            distill_gamma._overrides(bad)


def test_results_record_no_host_folder_and_read_their_paths_back(tmp_path, monkeypatch):
    import common

    cache, home = tmp_path / "cache", tmp_path / "home"
    monkeypatch.setenv("MERGESTREAM_CACHE", str(cache))
    monkeypatch.setenv("HOME", str(home))
    expert, data = cache / "sst2-8db7e8dbde68", cache / "quality-data" / "data-val100-6d3932f0a7bd"
    assert common.recorded_path(expert) == "<cache>/sst2-8db7e8dbde68"
    assert common.recorded_path(data) == "<cache>/quality-data/data-val100-6d3932f0a7bd"
    assert common.recorded_path(S.RESULTS / "quality.json") == "bench/results/quality.json"
    assert common.recorded_path(home / "data" / "x") == "~/data/x"
    assert common.recorded_path(tmp_path / "scratch") == str(tmp_path / "scratch")  # scratch: as written
    for kept in ("<cache>/x", "bench/results/quality.json", "~/x"):
        assert common.recorded_path(kept) == kept  # already recorded: unchanged
    for recorded, there in (("<cache>/sst2-8db7e8dbde68", expert), ("~/data/x", home / "data" / "x"),
                            ("bench/results/quality.json", S.RESULTS / "quality.json"), (str(expert), expert)):
        assert common.resolved_path(recorded) == there
    argv = ["--data", str(data), f"--from-json={S.RESULTS / 'quality.json'}", "--workdir", "/tmp/qwork", "-x"]
    assert common.recorded_command(argv) == ["--data", "<cache>/quality-data/data-val100-6d3932f0a7bd",
                                             "--from-json=bench/results/quality.json", "--workdir", "/tmp/qwork", "-x"]

    # every write of quality.json records them so, whatever the document held
    doc = _doc()
    doc["protocol"].update(data=str(data), experts={"sms": str(cache / "sms-1"), "trec": str(cache / "trec-2")})
    R.save_outputs(doc, tmp_path / "out", lambda d, o: [])
    text = (tmp_path / "out" / "quality.json").read_text() + (tmp_path / "out" / "quality.md").read_text()
    assert str(cache) not in text
    saved = json.loads((tmp_path / "out" / "quality.json").read_text())["protocol"]
    assert saved["experts"] == {"sms": "<cache>/sms-1", "trec": "<cache>/trec-2"}
    assert common.resolved_path(saved["data"]) == data


def test_the_checked_in_results_hold_no_host_folder():
    for f in [*S.RESULTS.rglob("*.json"), *S.RESULTS.rglob("*.md")]:
        text = f.read_text(encoding="utf-8")
        hosts = {"/root/", "/home/", str(Path.home()).rstrip("/") + "/", str(S.RESULTS.parent.parent.resolve()) + "/"}
        for host in hosts - {"/"}:  # a home of "/" (some CI containers) names no folder
            assert host not in text, f"{f.relative_to(S.REPO)} names a host folder ({host})"
