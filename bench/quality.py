"""Merge quality on real experts, measured the way the papers measure it.

Folds the real all-MiniLM-L6-v2 task experts (``bench/experts.py``, ``mergestream/experts.py``) one
at a time with each policy through :func:`mergestream.engine.fold` (the daemon's engine), and after
every fold measures the backbone's accuracy on every task seen so far (each task with its expert's
own head) and G = STS-B test Spearman x100. Reports ACC, normalised ACC (merged / expert), BWT (ours and the reference's /T), G,
H = 2·ACC·G/(ACC+G), fold seconds, and for task_arithmetic and mdm_oc the unmerge accuracy drop
(UAD). Writes ``quality.json`` (first, and after every run), ``quality.md`` and PNG plots to
``--out`` (default: a new scratch folder; the checked-in results only with ``--out bench/results``).

    # the checked-in results: the command at the top of bench/results/quality.md; many hours on 2
    # cores, so it runs in pieces (the same command again continues where it stopped: --resume)
    .venv/bin/python bench/quality.py --tune --cmaes --adamerging --eval-examples 500 --sts-pairs 700 \
        --final-only-shuffles --steps-curve 0,25,100,200 --threads 2 --out bench/results --resume
    # a quick look
    .venv/bin/python bench/quality.py --eval-examples 200 --sts-pairs 500 --shuffles 1 --final-only-shuffles
    # one row with given parameters (no code change), e.g. a tuned row reproduced
    .venv/bin/python bench/quality.py --policies dop,dop+lines --set dop.alpha=0.7 --set dop+lines.lines_beta=0.6

Protocol knobs (each recorded in quality.json under "protocol"; quality.md states them):
  --eval-examples N   a fixed seeded subsample of N rows of each task's test split (default: all)
  --sts-pairs N       a fixed seeded subsample of N STS-B test pairs (default: all 1379)
  --shuffles S        S seeded shuffles of the task order besides the fixed file order
  --final-only-shuffles  for shuffled orders evaluate every task only after the last fold (a_{j,j}
                      for BWT is still measured right after each fold, on task j only)
  --set LABEL.NAME=V  a parameter of a policy (LABEL = policy: the row and its variants) or of one row
                      (LABEL = e.g. opcm+lines); --config FILE gives the same as YAML {params: {...}}
  --validation M      holdout (default): --val-rows train rows per task are carved out *before* the
                      experts are trained (a copy of the data folder; the experts are built from it);
                      train: the old in-sample rows (comparison only)
  --tune              pick each policy's coefficient from a grid on the validation rows with G on
                      STS-B *dev*, never test; variants (+lines, +magnitude-mask, +ri) take their
                      parent's tuned value
  --cmaes             also run mdm_oc with CMA-ES coefficients on the daemon's objective
                      (mergestream.daemon.objective.ProbeObjective, policy.objective defaults:
                      task_weight × mean validation accuracy + general_weight × STS-B *dev* Spearman)
  --adamerging        also run mdm_oc with AdaMerging per-layer coefficients (mergestream.engine.coefficients:
                      the seen tasks' heads' entropy on the unlabeled inputs RI uses, --ada-examples)
  --lpft rule         LP-FT for a task when its fine-tuned expert (random head) is not better than a
                      linear probe on frozen θ₀, both on the validation rows (`tasks`: the old name list)
  --recipe R          expert recipe fields, typed (`lr=3e-5,max_train=64` or a YAML mapping)
  --threads N         torch threads and fold worker threads

Hyperparameters without --tune or --set are the policies' defaults (recorded in each run's "params").

Tasks the tuning never saw: ``bench/quality_heldout.py`` splits the tasks into a visible and a
held-out set, tunes on the visible tasks only and runs the same parameters (and the daemon's
``policy.strength: auto``) on both, with this module's experts, evaluator and streams.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import recorded_command  # noqa: E402
from quality_report import backward_transfer, hmean, save_outputs  # noqa: E402
from quality_report import label as label_of  # noqa: E402
from quality_setup import (  # noqa: E402
    RESULTS,
    apply_overrides,
    carve_validation,
    carved_folder,
    check_resumed_experts,
    curve_steps,
    default_out,
    distill_row_label,
    expert_hash,
    load_config,
    load_resume,
    merge_overrides,
    needs_lpft,
    parse_recipe,
    parse_sets,
    protocol_args,
    stale_distill_runs,
    stale_grid,
    validation_rows,
)

from mergestream import experts as X  # noqa: E402
from mergestream.datasteps import text as T  # noqa: E402
from mergestream.config import ObjectiveConfig  # noqa: E402
from mergestream.daemon.objective import ProbeObjective  # noqa: E402
from mergestream.daemon.probes import SentenceSimilarityProbe, TaskProbeSpec  # noqa: E402
from mergestream.datasteps.distill import DistillParams, DistillTask, distill_backbone, teacher_outputs  # noqa: E402
from mergestream.engine import ExecOptions, fold, unmerge  # noqa: E402
from mergestream.engine.coefficients import EntropyObjective  # noqa: E402
from mergestream.io.st import WEIGHTS_HASH_VERSION  # noqa: E402
from mergestream.policies import is_budgeted  # noqa: E402
from mergestream.patches.build import build_patch  # noqa: E402
from mergestream.datasteps.ri import HFEncoderFeatures, RIParams, adapt_expert, load_feature_model  # noqa: E402

#: LiNeS for the 6-block MiniLM: shallowest blocks at half the update, the deepest at all of it
LINES = {"lines_alpha": 0.5, "lines_beta": 0.5, "lines_layers": 6}
#: SAFE-Merge's row (METHODS.md defaults; its Adam steps: the policy's default, 25)
SAFE_DEFAULTS: dict[str, Any] = {"rho": 0.1, "lambda": 0.3}
#: (policy, variant label, params): METHODS.md defaults.
POLICIES: list[tuple[str, str, dict[str, Any]]] = [
    ("task_arithmetic", "", {"lambda": 0.3}),
    ("ties", "", {"lambda": 1.0, "k": 20}),
    ("safe_merge", "", SAFE_DEFAULTS),
    ("safe_merge", "+magnitude-mask", {"rho": 0.1, "lambda": 0.3, "risk_mask": False, "steps": 0}),
    ("mdm_oc", "", {"alpha": 0.3}),
    ("opcm", "", {"alpha": 0.5}),
    ("magmax", "", {"lambda": 0.5}),
    ("dop", "", {"alpha": 0.8}),
    ("task_arithmetic", "+lines", {"lambda": 0.3, **LINES}),
    ("opcm", "+lines", {"alpha": 0.5, **LINES}),
    ("dop", "+lines", {"alpha": 0.8, **LINES}),
    ("safe_merge", "+lines", {"rho": 0.1, "lambda": 0.3, **LINES}),
    ("safe_merge", "+projected", {"rho": 0.1, "lambda": 0.3, "project_rank": 16}),
    ("safe_merge", "+projected+lines", {"rho": 0.1, "lambda": 0.3, "project_rank": 16, **LINES}),
    ("mdm_oc", "+lines", {"alpha": 0.3, **LINES}),
    # λ of the tensors Iso-C leaves to task arithmetic (1-D, embeddings): task arithmetic's tuned value
    ("iso_c", "", {"alpha": 1.5, "lambda": 0.2}),
    # the seed method merged isotropically (its masked, recovered updates summed, then Iso-C); ρ 0.3: the
    # merged update is dense anyway, the mask only filters (ρ 0.1 gave val H 82.1 at iso_alpha 2, ρ 0.3 82.8)
    ("safe_merge", "+iso", {**SAFE_DEFAULTS, "rho": 0.3, "iso_alpha": 2.0}),
    # Iso-C whose folds change at most 20 % of each matrix's entries (the rest carried): small fleet patches
    ("iso_c", "+budget", {"alpha": 1.5, "lambda": 0.2, "patch_budget": 0.2}),
    # the same at the largest budget whose format-2 patches stay within 0.3 of the model (issue 39's bound);
    # in STEP_ONLY: run only with a data step (--ri-policies / --distill-policies name it)
    ("iso_c", "+budget29", {"alpha": 1.5, "lambda": 0.2, "patch_budget": 0.29}),
    # the same with the distil step's learning rate chosen for a budgeted merge (ROW_DISTILL): 3e-5 of
    # 1e-5, 3e-5, 1e-4 on validation (bench/results/distill_lr_budget29.json); unbudgeted, 1e-5 stays best
    ("iso_c", "+budget29lr3e-5", {"alpha": 1.5, "lambda": 0.2, "patch_budget": 0.29}),
    # Iso-C at the α chosen with the distil step on (OWN_STRENGTH: kept over the plain row's tuned
    # α 2): 2.5 of 1.5, 2, 2.5, 3 on validation (distill_alpha.json; α 2: distill_lr.json); run only as +ri+distill
    ("iso_c", "+a2.5", {"alpha": 2.5, "lambda": 0.2}),
    # the budgeted row at the α chosen under its 0.29 mask with the distil step on at lr 3e-5 (OWN_STRENGTH,
    # ROW_DISTILL): 3 of 2, 2.5, 3, 3.5 (distill_lr_budget29.json, distill_alpha{,3,35}_budget29.json)
    ("iso_c", "+budget29a3lr3e-5", {"alpha": 3.0, "lambda": 0.2, "patch_budget": 0.29}),
    # the seed row at the ρ chosen with the distil step on (OWN_STRENGTH: λ and iso_alpha as the seed row ran):
    # 1 of 0.3, 0.5, 0.7, 0.9, 1 at iso_alpha 2 on validation (bench/results/distill_safe_iso_{alpha,rho05,rho07,
    # rho09,rho10}.json);
    # at ρ 1 the mask keeps every entry: the masked low-rank recovery and the isotropic merge remain
    ("safe_merge", "+iso-rho1", {**SAFE_DEFAULTS, "rho": 1.0, "lambda": 0.3, "iso_alpha": 2.0}),
    # Iso-C with task-specific subspaces: the paper's/reference's defaults (alpha 1, 80 % common)
    ("iso_cts", "", {"alpha": 1.0, "common_fraction": 0.8}),
]
#: rows of POLICIES never run plain: only as the +ri / +distill rows --ri-policies and --distill-policies name
STEP_ONLY = frozenset({"iso_c+budget29", "iso_c+budget29lr3e-5", "iso_c+a2.5", "iso_c+budget29a3lr3e-5",
                       "safe_merge+iso-rho1"})
#: rows whose strength was chosen elsewhere (with the distil step on: bench/distill_gamma.py --alphas):
#: their own coefficient is kept, never replaced by the parent's --tune value
OWN_STRENGTH = frozenset({"iso_c+a2.5", "iso_c+budget29a3lr3e-5", "safe_merge+iso-rho1"})
#: distil options a row's +distill runs use instead of the command's, by row label (policy + variant
#: before "+ri"/"+distill"): distill_steps, distill_lr or distill_gamma (DistillParams fields; the
#: inputs and anchors are shared by every row); each value chosen on validation (bench/distill_gamma.py)
ROW_DISTILL: dict[str, dict[str, Any]] = {"iso_c+budget29lr3e-5": {"distill_lr": 3e-5},
                                            "iso_c+budget29a3lr3e-5": {"distill_lr": 3e-5}}
#: the coefficient --tune searches per policy (the last run's tuned values sit inside each grid)
GRID = {"task_arithmetic": ("lambda", [0.1, 0.15, 0.2, 0.3, 0.5]), "ties": ("lambda", [0.5, 0.7, 1.0, 1.3]),
        "safe_merge": ("lambda", [0.2, 0.3, 0.5, 0.7]), "mdm_oc": ("alpha", [0.1, 0.15, 0.2, 0.3, 0.5]),
        "opcm": ("alpha", [0.3, 0.5, 0.7, 0.9]), "magmax": ("lambda", [0.15, 0.2, 0.3, 0.5, 0.7]),
        "dop": ("alpha", [0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 1.0]),  # 0.95 won at the old edge: up to α's bound
        "iso_c": ("alpha", [1.0, 1.5, 2.0, 2.7, 3.5]), "iso_cts": ("alpha", [0.7, 1.0, 1.3, 1.6, 2.0]),
        "safe_merge+iso": ("iso_alpha", [1.5, 2.0, 2.5, 3.0, 4.5])}  # a variant's own grid: tuned after its parent
UAD_POLICIES = ("task_arithmetic", "mdm_oc")


def _sts_rows(path: Path) -> list[tuple[float, str, str]]:
    """``(score, text, text2)`` of every row of an STS-B csv split (``raw/stsbenchmark``), in file order."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            parts = line.rstrip("\n").split("\t")
            if len(parts) >= 7:
                rows.append((float(parts[4]), parts[5], parts[6]))
    return rows


def _sts_sentences(path: Path) -> dict[str, None]:
    """The distinct sentences of an STS-B csv split, in file order."""
    return dict.fromkeys(s for _, a, b in _sts_rows(path) for s in (a, b))


def sts_train_sentences(data: Path) -> list[tuple[str, None]]:
    """The distinct sentences of the STS-B *train* split that occur in neither dev (which tunes G)
    nor test (which measures it; STS-B repeats some sentences across splits, 464 of 10566), in file
    order, as distil anchor inputs: the stand-in for the sentences of a daemon's sentence_similarity
    probe."""
    raw = data / "raw" / "stsbenchmark"
    held = {**_sts_sentences(raw / "sts-dev.csv"), **_sts_sentences(raw / "sts-test.csv")}
    return [(s, None) for s in _sts_sentences(raw / "sts-train.csv") if s not in held]


def read_sts_dev(data: Path, n: int | None) -> list[tuple[float, str, str]]:
    return X.subsample(_sts_rows(data / "raw" / "stsbenchmark" / "sts-dev.csv"), n, seed=0)


class Evaluator:
    """Accuracy of a backbone on task rows with each expert's head, and G on STS pairs."""

    def __init__(self, tasks: dict[str, X.TaskData], heads: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 rows: dict[str, list], sts: list[tuple[float, str, str]], tok):
        self.tasks, self.heads, self.rows, self.sts, self.tok = tasks, heads, rows, sts, tok

    @classmethod
    def on_test_rows(cls, tasks: list[str], experts: dict[str, Path], data: Path, eval_examples: int,
                     sts_pairs: int) -> "Evaluator":
        """The evaluator of a results table: ``eval_examples`` seeded test rows per task with each
        expert's head (``experts[task]/head.safetensors``) and ``sts_pairs`` seeded STS-B test pairs."""
        tdata = {t: X.load_task(t, data) for t in tasks}
        heads = {t: T.load_head(experts[t] / "head.safetensors", t) for t in tasks}
        rows = {t: X.subsample(tdata[t].test, eval_examples, seed=0) for t in tasks}
        sts = X.subsample(X.load_sts(data), sts_pairs, seed=0)
        _, tok = X.load_encoder()
        return cls(tdata, heads, rows, sts, tok)

    def load(self, folder: Path):
        model, _ = X.load_encoder(folder)
        return model

    def acc(self, model, task: str) -> float:
        rows = self.rows[task]
        emb = X.embed_rows(model, self.tok, rows, max_length=64)
        w, b = self.heads[task]
        return T.head_accuracy(emb, [y for _, _, y in rows], w, b)

    def g(self, model) -> float:
        return X.sts_spearman(model, self.tok, self.sts)

    def measure(self, folder: Path, tasks: list[str], with_g: bool = True) -> tuple[dict[str, float], float | None]:
        model = self.load(folder)
        accs = {t: self.acc(model, t) for t in tasks}
        g = self.g(model) if with_g else None
        del model
        return accs, g


def fold_stream(order: list[str], experts: dict[str, Path], policy: str, params: dict[str, Any], ev: Evaluator,
                workdir: Path, *, full_steps: bool, log, objective_for=None, keep_final: bool = False,
                patches: bool = False, ri=None, threads: int | None = 1, fold_with=None,
                post=None) -> dict[str, Any]:
    """Fold ``order`` one by one; returns steps, fold seconds, final metrics (and the state folder).

    ``patches``: build the version-to-version patch after every fold and record its size / the
    model's. ``ri``: ``ri(order[:t]) -> (adapted expert folder, RI seconds)``, the RI pre-step.
    ``fold_with``: ``fold_with(seen, backbone | None, expert, state, out) -> FoldReport`` instead of
    one engine fold (``bench/quality_heldout.py``: the daemon's per-fold strength choice).
    ``post``: ``post(seen, out, prev) -> seconds``, a post-step that rewrites the fold's output in
    place (the distil step; ``prev`` the previous version or None), timed apart from the fold.
    """
    base = X.base_model_path()
    run = Path(tempfile.mkdtemp(prefix=f"{policy}-", dir=workdir))
    state = run / "state"
    prev: Path | None = None
    steps, diag, fold_s, patch_ratio, patch_ratio_v2, ri_s, post_s = [], {}, [], [], [], [], []
    for t, task in enumerate(order, 1):
        out = run / f"v{t}"
        src = experts[task]
        if ri is not None:
            src, secs = ri(tuple(order[:t]))
            ri_s.append(secs)
        t0 = time.perf_counter()
        objective = objective_for(order[:t]) if objective_for is not None else None
        if fold_with is not None:
            frep = fold_with(order[:t], prev, src, state, out)
        else:
            frep = fold(base, prev, src, policy, params, state_dir=state, out=out, expert_id=task,
                        objective=objective, options=ExecOptions(threads=threads))
        fold_s.append(time.perf_counter() - t0)
        if post is not None:
            post_s.append(post(tuple(order[:t]), out, prev))
        if patches and prev is not None:
            ratios = [build_patch(prev, out, run / "patch.safetensors", source_version=str(t - 1),
                                  target_version=str(t), policy=policy, overwrite=True, patch_format=fmt,
                                  zstd_level=level)["ratio"] for fmt, level in ((1, None), (2, 3))]
            patch_ratio.append(ratios[0])
            patch_ratio_v2.append(ratios[1])
        if prev is not None:
            shutil.rmtree(prev, ignore_errors=True)
        prev = out
        last = t == len(order)
        if full_steps or last:
            accs, g = ev.measure(out, order[:t])
        else:
            accs, g = ev.measure(out, [task], with_g=False)
        diag[task] = accs[task]
        steps.append({"t": t, "task": task, "acc": accs, "G": g, "fold_seconds": fold_s[-1],
                      "patch_ratio": patch_ratio[-1] if patches and t > 1 else None,
                      "ri_seconds": ri_s[-1] if ri_s else None, "distill_seconds": post_s[-1] if post_s else None,
                      "search": frep.search,
                      "coefficients": frep.coefficients, "layer_alphas": frep.params.get("layer_alphas")})
        log(f"  {policy} t={t} {task}: acc[{task}]={accs[task]:.1f}" + (f" G={g:.2f}" if g is not None else "")
            + f" fold {fold_s[-1]:.1f}s" + (f" distil {post_s[-1]:.1f}s" if post_s else ""))
    final_acc = steps[-1]["acc"]
    res = {"steps": steps, "diag": diag, "final_acc": final_acc, "G": steps[-1]["G"], "fold_seconds": fold_s,
           "patch_ratio": patch_ratio, "patch_ratio_v2": patch_ratio_v2, "ri_seconds": ri_s,
           "distill_seconds": post_s, "run": run, "state": state, "backbone": prev,
           "ran_params": {k: v for k, v in frep.params.items() if k != "layer_alphas"}}
    if not keep_final:
        shutil.rmtree(run, ignore_errors=True)
    return res


def summarise(order: list[str], res: dict[str, Any], expert_acc: dict[str, float]) -> dict[str, float]:
    fa = res["final_acc"]
    acc = float(np.mean([fa[t] for t in order]))
    bwt = backward_transfer(order, fa, res["diag"])
    norm = float(np.mean([100.0 * fa[t] / expert_acc[t] for t in order]))
    g = float(res["G"])
    out = {"ACC": acc, **bwt, "G": g, "H": hmean(acc, g), "norm_ACC": norm,
           "fold_seconds_mean": float(np.mean(res["fold_seconds"]))}
    if res.get("patch_ratio"):
        out["patch_ratio_mean"] = float(np.mean(res["patch_ratio"]))
    if res.get("patch_ratio_v2"):  # format 2 (bitmask + values) with zstd level 3
        out["patch_ratio_v2_mean"] = float(np.mean(res["patch_ratio_v2"]))
    if res.get("ri_seconds"):
        out["ri_seconds_mean"] = float(np.mean(res["ri_seconds"]))
    if res.get("distill_seconds"):
        out["distill_seconds_mean"] = float(np.mean(res["distill_seconds"]))
    return out


def uad(order: list[str], res: dict[str, Any], ev: Evaluator, remove: str, log) -> dict[str, Any]:
    """Remove ``remove`` from the final backbone by subtract and by replay; the replay output is the
    model folded without it from the start (same order, same parameters, raw task vectors)."""
    rest = [t for t in order if t != remove]
    out: dict[str, Any] = {"removed": remove}
    for mode in ("subtract", "replay"):
        dst = res["run"] / f"unmerge-{mode}"
        # each mode works on its own copy of the state (unmerge rewrites it)
        st = res["run"] / f"state-{mode}"
        shutil.copytree(res["state"], st)
        t0 = time.perf_counter()
        unmerge(st, remove, mode, out=dst, backbone=res["backbone"], base=X.base_model_path())
        secs = time.perf_counter() - t0
        accs, _ = ev.measure(dst, rest, with_g=False)
        out[mode] = {"acc": accs, "seconds": secs}
        shutil.rmtree(dst, ignore_errors=True)
        shutil.rmtree(st, ignore_errors=True)
    never = out["replay"]["acc"]
    out["UAD"] = float(np.mean([never[t] - out["subtract"]["acc"][t] for t in rest]))
    log(f"  UAD({remove}) subtract vs never-merged: {out['UAD']:.2f} points")
    return out


def make_objective(experts: dict[str, Path], val_rows: dict[str, list], sts_dev: list[tuple[float, str, str]],
                   seen: list[str], folder: Path) -> ProbeObjective:
    """The daemon's CMA-ES objective (:class:`mergestream.daemon.objective.ProbeObjective` with the
    defaults of ``policy.objective``): task_weight × mean accuracy of the tasks folded so far (each
    expert's head, the first examples_per_task validation rows) + general_weight × Spearman on the
    first general_pairs STS-B *dev* pairs (never the test pairs G is measured on). The rows are
    written as the probe files the daemon reads (JSONL tasks, TSV pairs) into ``folder``."""
    oc = ObjectiveConfig()
    folder.mkdir(parents=True, exist_ok=True)
    specs = []
    for t in seen:
        path = folder / f"{t}.jsonl"
        if not path.exists():
            with open(path, "w", encoding="utf-8") as fh:
                for text, text2, y in val_rows[t]:
                    fh.write(json.dumps({"text": text, **({"text2": text2} if text2 is not None else {}), "label": y})
                             + "\n")
        specs.append(TaskProbeSpec(task=t, head=experts[t] / "head.safetensors", data=path))
    sts = folder / "sts-dev.tsv"
    if not sts.exists():
        with open(sts, "w", newline="", encoding="utf-8") as fh:
            w = csv.writer(fh, delimiter="\t")
            w.writerow(["score", "text", "text2"])
            w.writerows(random.Random(0).sample(sts_dev, len(sts_dev)))  # "first N" spans the genres
    base = X.base_model_path()
    return ProbeObjective(base, specs, SentenceSimilarityProbe(data=sts), tokenizer=base, task_weight=oc.task_weight,
                          general_weight=oc.general_weight, examples_per_task=oc.examples_per_task,
                          general_pairs=oc.general_pairs)


def make_entropy_objective(heads: dict[str, tuple[torch.Tensor, torch.Tensor]], aux: list, n: int) -> EntropyObjective:
    """The adamerging objective (:class:`mergestream.engine.coefficients.EntropyObjective`): the heads' mean
    prediction entropy on a seeded subsample of ``n`` of the unlabeled inputs ``aux`` (RI's)."""
    base = X.base_model_path()
    fm = load_feature_model(None, tokenizer=base, max_length=64)
    return EntropyObjective(base, heads, X.subsample(aux, n, seed=0), feature_model=fm, batch_size=16)


# ------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description="merge quality on real MiniLM experts")
    ap.add_argument("--tasks", default=",".join(X.STREAM_TASKS))
    ap.add_argument("--policies", default=None, help="comma-separated labels (e.g. task_arithmetic,mdm_oc,safe_merge+magnitude-mask)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="LABEL.NAME=VALUE",
                    help="policy parameter for a policy (and its variants) or one row label, e.g. dop.alpha=0.7")
    ap.add_argument("--config", default=None, help="YAML/JSON file {params: {LABEL: {NAME: VALUE}}}; --set wins")
    ap.add_argument("--eval-examples", type=int, default=None)
    ap.add_argument("--sts-pairs", type=int, default=None)
    ap.add_argument("--shuffles", type=int, default=3)
    ap.add_argument("--final-only-shuffles", action="store_true")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--validation", choices=("holdout", "train"), default="holdout",
                    help="validation rows: carved out of train before the experts are trained (holdout), or the "
                         "old in-sample train rows")
    ap.add_argument("--val-rows", type=int, default=100, help="validation rows per task")
    ap.add_argument("--lpft", choices=("rule", "tasks"), default="rule",
                    help="LP-FT by the measured rule (expert not better than a linear probe on validation) or by "
                         "the old task-name list")
    ap.add_argument("--cmaes", action="store_true")
    ap.add_argument("--cmaes-budget", type=int, default=12)
    ap.add_argument("--adamerging", action="store_true", help="also run mdm_oc+adamerging")
    ap.add_argument("--ada-steps", type=int, default=30, help="AdaMerging Adam steps per fold")
    ap.add_argument("--ada-examples", type=int, default=ObjectiveConfig().adamerging_examples,
                    help="unlabeled inputs of the adamerging objective (a subsample of RI's)")
    ap.add_argument("--no-uad", action="store_true")
    ap.add_argument("--steps-curve", default="",
                    help="SAFE-Merge's H-vs-steps curve: comma-separated Adam step counts, each an extra row "
                         "safe_merge+steps<N> run on the file order only (e.g. 0,25,100,200)")
    ap.add_argument("--ri-policies", default="task_arithmetic,ties,best",
                    help="policies or variant labels (e.g. safe_merge+iso) also run with the RI pre-step ('+ri' rows); "
                         "'best' = the best other "
                         "policy by H on the file order; '' for none")
    ap.add_argument("--ri-steps", type=int, default=40, help="RI AdamW steps per expert")
    ap.add_argument("--ri-lr", type=float, default=1e-5)
    ap.add_argument("--ri-aux", type=int, default=48,
                    help="unlabeled train-split inputs per task seen so far used as RI auxiliary data")
    ap.add_argument("--distill-policies", default="",
                    help="row labels (plain, variants or +ri rows, e.g. iso_c,iso_c+ri) also run with the distil "
                         "post-step after every fold ('+distill' rows; mergestream.datasteps.distill); '' for none")
    ap.add_argument("--distill-steps", type=int, default=DistillParams().steps, help="distil AdamW steps per fold")
    ap.add_argument("--distill-lr", type=float, default=DistillParams().lr)
    ap.add_argument("--distill-gamma", type=float, default=DistillParams().gamma,
                    help="weight of the distil step's similarity-preserving term toward θ₀")
    ap.add_argument("--distill-aux", type=int, default=128,
                    help="unlabeled train-split inputs per task the distil step uses (its experts' outputs on them)")
    ap.add_argument("--distill-anchors", type=int, default=0,
                    help="general anchor sentences (distinct STS-B *train* sentences, never dev or test) kept in "
                         "θ₀'s geometry by the distil step's similarity term, the daemon's sentence_similarity "
                         "probe sentences; 0 for none")
    ap.add_argument("--no-patches", action="store_true", help="skip the patch size measurement")
    ap.add_argument("--lp-train", type=int, default=None, help="train rows for the linear-probe reference (default: all)")
    ap.add_argument("--reduced-note", default="", help="text for quality.md about what was reduced")
    ap.add_argument("--recipe", default="", help="expert recipe fields, typed: lr=3e-5,max_train=64 or a YAML mapping")
    ap.add_argument("--shuffle-policies", default=None,
                    help="comma-separated labels run on the shuffled orders too (default: every policy)")
    ap.add_argument("--planned-policies", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--from-json", default=None, metavar="QUALITY_JSON",
                    help="only re-render quality.md and the plots from an existing quality.json")
    ap.add_argument("--threads", type=int, default=None, help="torch threads and fold worker threads (default: torch's)")
    ap.add_argument("--cache", default=None)
    ap.add_argument("--data", default=None)
    ap.add_argument("--out", default=None,
                    help=f"results folder (default: a new scratch folder; the checked-in results: {RESULTS})")
    ap.add_argument("--workdir", default=None, help="scratch folder for backbones (default: a temp dir)")
    ap.add_argument("--resume", action="store_true",
                    help="continue the run in --out/quality.json (same options): keep its references, tuning "
                         "and finished runs, run only what is missing (a long benchmark in pieces)")
    return ap


def select_policies(args: argparse.Namespace) -> tuple[list[tuple[str, str, dict[str, Any]]], dict[str, dict[str, Any]]]:
    """The rows to run (``--policies``, ``--cmaes``) with ``--config`` and ``--set`` applied, checked
    before anything is loaded; and the overrides as given (for quality.md)."""
    pols = list(POLICIES)
    if args.policies:
        want = set(args.policies.split(","))
        known = {p + v for p, v, _ in POLICIES}
        if args.cmaes:
            known.add("mdm_oc+cmaes")
        if args.adamerging:
            known.add("mdm_oc+adamerging")
        stray = sorted(want - known)
        if stray:
            raise SystemExit(f"--policies: unknown row(s) {', '.join(stray)}; known: {', '.join(sorted(known))}")
        pols = [p for p in POLICIES if p[0] + p[1] in want]
    if args.cmaes and (not args.policies or "mdm_oc+cmaes" in want):
        pols = pols + [("mdm_oc", "+cmaes", {"alpha": 0.3, "coefficients": "cmaes", "budget": args.cmaes_budget})]
    if args.adamerging and (not args.policies or "mdm_oc+adamerging" in want):
        pols = pols + [("mdm_oc", "+adamerging", {"alpha": 0.3, "coefficients": "adamerging",
                                                  "ada_steps": args.ada_steps})]
    pols = pols + [("safe_merge", f"+steps{n}", {**SAFE_DEFAULTS, "steps": n}) for n in curve_steps(args)]
    overrides = merge_overrides(load_config(args.config) if args.config else {}, parse_sets(args.sets))
    return apply_overrides(pols, overrides), overrides


def tuned_rows(pols, tuned: dict[str, Any], overrides: dict[str, dict[str, Any]]):
    """Every row with its parent's tuned coefficient (variants follow their parent) and, for a variant
    with a grid of its own (``GRID["policy+variant"]``), its own tuned one; except where a coefficient
    was set explicitly for that policy or row, or the row is in ``OWN_STRENGTH``."""
    out = []
    for pol, var, params in pols:
        for t in (tuned.get(pol), tuned.get(pol + var) if var else None):
            explicit = t is not None and (t["param"] in overrides.get(pol, {})
                                          or t["param"] in overrides.get(pol + var, {})
                                          or pol + var in OWN_STRENGTH)
            if t is not None and not explicit:
                params = {**params, t["param"]: t["chosen"]}
        out.append((pol, var, params))
    return out


def measure_references(tasks, experts, ev: Evaluator, base_model, tok, tdata, rows, args, log) -> dict[str, Any]:
    """The reference rows of quality.md: each expert's accuracy and G, θ₀ with each expert's head, a
    linear probe on frozen θ₀, and θ₀'s G."""
    log("references: experts, base with expert heads, linear probe, G")
    ref: dict[str, Any] = {"expert_acc": {}, "base_head_acc": {}, "linear_probe_acc": {}, "expert_G": {},
                           "base_G": ev.g(base_model)}
    for t in tasks:
        ref["base_head_acc"][t] = ev.acc(base_model, t)
        lp_train = X.subsample(tdata[t].train, args.lp_train, seed=0)
        emb = X.embed_rows(base_model, tok, lp_train, max_length=64)
        w, b = X.fit_linear_probe(emb, [y for _, _, y in lp_train], len(tdata[t].classes))
        ref["linear_probe_acc"][t] = T.head_accuracy(X.embed_rows(base_model, tok, rows[t], max_length=64),
                                                     [y for _, _, y in rows[t]], w, b)
        em = ev.load(experts[t])
        ref["expert_acc"][t] = ev.acc(em, t)
        meta = X.read_expert(experts[t])
        ref["expert_G"][t] = meta["sts_spearman"] if args.sts_pairs is None and meta.get("sts_spearman") is not None else ev.g(em)
        del em
        log(f"  {t}: expert {ref['expert_acc'][t]:.1f}  base+head {ref['base_head_acc'][t]:.1f}  "
            f"LP {ref['linear_probe_acc'][t]:.1f}  expert G {ref['expert_G'][t]:.2f}")
    return ref


def build_experts(tasks, data: Path, over: dict[str, Any], lpft: str, val: dict[str, list] | None, log, cache=None):
    """The experts of ``tasks`` built from ``data``; with ``lpft='rule'`` (needs ``val``) a task gets
    LP-FT when its random-head expert is not better than a linear probe on frozen θ₀ on the
    validation rows. Returns (expert folders, the rule's measurements per task)."""
    experts, decisions = {}, {}
    base_model = tok = None
    for t in tasks:
        if lpft == "tasks" or val is None or "head_init" in over:
            experts[t] = X.build_expert(X.ExpertSpec.for_task(t, **over), cache=cache,
                                        data=data, log=log, evaluate=not over)
            continue
        ft = X.build_expert(X.ExpertSpec.for_task(t, **{**over, "head_init": "random"}), cache=cache, data=data, log=log,
                            evaluate=not over)
        if base_model is None:
            base_model, tok = X.load_encoder()
        td = X.load_task(t, data)
        w, b = X.fit_linear_probe(X.embed_rows(base_model, tok, td.train, max_length=64), [y for _, _, y in td.train],
                                  len(td.classes))
        labels = [y for _, _, y in val[t]]
        probe = T.head_accuracy(X.embed_rows(base_model, tok, val[t], max_length=64), labels, w, b)
        em, _ = X.load_encoder(ft)
        fw, fb = T.load_head(ft / "head.safetensors", t)
        own = T.head_accuracy(X.embed_rows(em, tok, val[t], max_length=64), labels, fw, fb)
        del em
        use = needs_lpft(own, probe)
        decisions[t] = {"expert_val_acc": own, "probe_val_acc": probe, "lpft": use}
        log(f"  LP-FT rule {t}: fine-tuned {own:.1f} vs linear probe {probe:.1f} on validation -> "
            f"{'LP-FT' if use else 'fine-tune'}")
        experts[t] = ft if not use else X.build_expert(X.ExpertSpec.for_task(t, **{**over, "head_init": "lp"}),
                                                       cache=cache, data=data, log=log, evaluate=not over)
    return experts, decisions


def ri_rows(wanted: list[str], runs: list[dict[str, Any]], pols: list[tuple[str, str, dict[str, Any]]],
            log=lambda m: None) -> list[tuple[str, str, dict[str, Any]]]:
    """The +ri rows to run, each once, in the order of ``--ri-policies``.

    ``best`` names the best other plain policy by H on the file order (not Task Arithmetic or TIES,
    which have rows of their own) among ``runs`` so far, and is dropped while none has run; a name
    that is no row in ``pols`` is dropped; a row named twice (``best`` resolving to a listed policy)
    runs once.

    Returns:
        (policy, variant + "+ri", params) per row.
    """
    rows: list[tuple[str, str, dict[str, Any]]] = []
    for name in wanted:
        if name == "best":
            cands = [r for r in runs if r["order_seed"] is None and not r["variant"]
                     and r["policy"] not in ("task_arithmetic", "ties")]
            if not cands:
                continue
            name = max(cands, key=lambda r: r["final"]["H"])["policy"]
            log(f"best other policy by H on the file order: {name}")
        src = next((p for p in pols if p[0] + p[1] == name), None)  # a policy or a variant label
        if src is not None and all(r[0] + r[1] != src[0] + src[1] + "+ri" for r in rows):
            rows.append((src[0], src[1] + "+ri", dict(src[2])))
    return rows


def distill_rows(wanted: list[str], rows: list[tuple[str, str, dict[str, Any]]]) -> list[tuple[str, str, dict[str, Any]]]:
    """The +distill rows to run, each once, in the order of ``--distill-policies``: a name is the
    label of a row in ``rows`` (plain, variant or +ri), or a row's label + "+ri" (with RI, whether
    or not ``--ri-policies`` runs that +ri row: its "best" may name another policy); a name that is
    none is dropped.

    Returns:
        (policy, variant + "+distill", params) per row.
    """
    out: list[tuple[str, str, dict[str, Any]]] = []
    for name in dict.fromkeys(wanted):
        src = next((p for p in rows if p[0] + p[1] == name), None)
        ri = ""
        if src is None and name.endswith("+ri"):
            src, ri = next((p for p in rows if p[0] + p[1] == name[:-3]), None), "+ri"
        if src is not None:
            out.append((src[0], src[1] + ri + "+distill", dict(src[2])))
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    X._offline()
    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out else default_out()
    out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        doc = json.loads(Path(args.from_json).read_text())
        if args.planned_policies and "planned_runs" not in doc:
            names = args.planned_policies.split(",")
            shuf = (args.shuffle_policies or args.planned_policies).split(",")
            doc["planned_runs"] = [[n, None] for n in names] + [[n, s] for s in range(doc["protocol"]["shuffles"])
                                                                for n in shuf]
        save_outputs(doc, out)
        print(f"re-rendered {out / 'quality.md'} from {args.from_json}")
        return 0
    pols, overrides = select_policies(args)  # bad parameters fail here, before any model is loaded
    prev = load_resume(out, args, vars(build_parser().parse_args([]))) if args.resume else None  # so do options that differ from the run resumed
    over = parse_recipe(args.recipe)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ms-quality-"))
    work.mkdir(parents=True, exist_ok=True)
    fold_threads = args.threads or 1

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.0f}s] {msg}", flush=True)

    log(f"results to {out}")
    tasks = [t for t in args.tasks.split(",") if t]
    src_data = X.data_root(args.data)
    if args.validation == "holdout":
        # carved next to the expert cache, so the same carve finds the same experts again
        data = carve_validation(src_data, carved_folder(X.cache_root(args.cache) / "quality-data", tasks,
                                                        args.val_rows), tasks, args.val_rows)
        val_rows = {t: validation_rows(data, t) for t in tasks}
    else:
        data = src_data
        val_rows = {t: X.subsample(X.load_task(t, data).train, args.val_rows, seed=7) for t in tasks}
    experts, lpft = build_experts(tasks, data, over, args.lpft, val_rows if args.validation == "holdout" else None,
                                  log, cache=args.cache)
    expert_hashes = {t: expert_hash(experts[t]) for t in tasks}
    recipes = {t: X.read_expert(experts[t])["recipe"] for t in tasks}  # read once, saved after every run
    check_resumed_experts(prev, experts)
    tdata = {t: X.load_task(t, data) for t in tasks}
    heads = {t: T.load_head(experts[t] / "head.safetensors", t) for t in tasks}
    rows = {t: X.subsample(tdata[t].test, args.eval_examples, seed=0) for t in tasks}
    sts = X.subsample(X.load_sts(data), args.sts_pairs, seed=0)
    base_model, tok = X.load_encoder()
    ev = Evaluator(tdata, heads, rows, sts, tok)

    # references
    if prev is not None:
        ref = prev["references"]
        log(f"resuming {out / 'quality.json'}: {len(prev['runs'])} run(s) and "
            f"{len(prev['protocol']['tuning'])} tuned polic(ies) kept")
    else:
        ref = measure_references(tasks, experts, ev, base_model, tok, tdata, rows, args, log)

    skipped = ([] if args.cmaes else ["mdm_oc with CMA-ES coefficients (--cmaes; not run for time)"]) + \
        ([] if args.adamerging else ["mdm_oc with AdaMerging coefficients (--adamerging; not run for time)"])
    sts_dev = read_sts_dev(data, args.sts_pairs or 500)  # tuning's and the CMA-ES objective's pairs (never test)
    tuned: dict[str, Any] = dict(prev["protocol"]["tuning"]) if prev is not None else {}
    dparams = DistillParams(steps=args.distill_steps, lr=args.distill_lr, gamma=args.distill_gamma)
    d_anchors = X.subsample(sts_train_sentences(data), args.distill_anchors, seed=7) if args.distill_anchors else []
    ri_params = RIParams(steps=args.ri_steps, lr=args.ri_lr, batch_size=16, max_length=64, eval_examples=64)
    ri_wanted = [p for p in args.ri_policies.split(",") if p]
    distill_wanted = [p for p in args.distill_policies.split(",") if p]
    runs: list[dict[str, Any]] = list(prev["runs"]) if prev is not None else []
    stale = stale_distill_runs(runs, args, ROW_DISTILL)
    if stale:
        log(f"re-running {len(stale)} +distill run(s) of an earlier piece: they ran with other distil options")
        runs = [r for r in runs if not any(r is s_ for s_ in stale)]
    planned: list[list[Any]] = []
    pieces: list[dict[str, Any]] = list(prev.get("pieces", [])) if prev is not None else []
    pieces.append({"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": 0.0,
                   "runs_before": len(runs)})

    def document() -> dict[str, Any]:
        pieces[-1]["seconds"] = time.perf_counter() - t_start
        return {"command": shlex.join([".venv/bin/python", "bench/quality.py", *recorded_command(argv if argv is not None else sys.argv[1:])]),
                "protocol": {"tasks": tasks, "eval_examples": args.eval_examples, "sts_pairs": args.sts_pairs,
                             "lp_train": args.lp_train, "shuffles": args.shuffles,
                             "final_only_shuffles": args.final_only_shuffles, "tuned": bool(args.tune),
                             "tuning": tuned, "reduced": args.reduced_note, "overrides": overrides,
                             "validation": args.validation, "val_rows": args.val_rows, "data": str(data),
                             "lpft": {"mode": args.lpft, "rule": "LP-FT when the random-head expert's validation "
                                      "accuracy is below the frozen-θ₀ linear probe's", "tasks": lpft},
                             "coefficient_search": {
                                 "cmaes": {"objective": "daemon ProbeObjective", **ObjectiveConfig().model_dump(),
                                           "tasks": "validation rows", "general": "STS-B dev pairs"},
                                 "adamerging": {"objective": "entropy of the seen tasks' heads",
                                                "examples": args.ada_examples, "steps": args.ada_steps,
                                                "inputs": "a subsample of the RI auxiliary inputs"}},
                             "distill": {"policies": distill_wanted, "params": dparams.__dict__,
                                         "aux_per_task": args.distill_aux, "anchors": args.distill_anchors,
                                         "aux": "unlabeled train-split inputs of each task seen so far, with its "
                                                "expert's outputs as the target"},
                             "ri": {"policies": ri_wanted, "params": ri_params.__dict__, "aux_per_task": args.ri_aux,
                                    "aux": "unlabeled train-split inputs of the tasks seen so far"},
                             "recipe": recipes,
                             "experts": {t: str(experts[t]) for t in tasks}, "expert_hashes": expert_hashes,
                             "expert_hash_version": WEIGHTS_HASH_VERSION,
                             "torch_threads": torch.get_num_threads(), "fold_threads": fold_threads,
                             "args": protocol_args(args)},
                "references": ref, "runs": runs, "skipped": skipped, "planned_runs": planned,
                "pieces": pieces, "seconds": sum(p_["seconds"] for p_ in pieces)}

    if args.tune:
        log(f"tuning on {args.val_rows} validation rows per task ({args.validation}) with G on STS-B dev")
        vev = Evaluator(tdata, heads, val_rows, sts_dev, tok)
        for pol, var, params in pols:
            gkey = pol + var  # a parent's grid, or a variant's own (tuned after its parent, with its value)
            if gkey not in GRID:
                continue
            key, grid = GRID[gkey]
            if gkey in tuned and stale_grid(tuned[gkey], grid, pol, runs, var):
                log(f"  {gkey}: its grid changed since it was tuned ({tuned[gkey]['grid']} -> {grid}): tuned again")
                del tuned[gkey]
            if gkey in tuned:
                continue
            if key in overrides.get(pol, {}) or key in overrides.get(gkey, {}):
                continue  # set explicitly: not tuned
            start = tuned_rows([(pol, var, params)], tuned, overrides)[0][2]
            scores = {}
            for v in grid:
                r = fold_stream(tasks, experts, pol, {**start, key: v}, vev, work, full_steps=False,
                                log=lambda m: None, threads=fold_threads)
                a = float(np.mean(list(r["final_acc"].values())))
                scores[v] = hmean(a, r["G"])
                log(f"  tune {gkey} {key}={v}: val ACC {a:.1f} G(dev) {r['G']:.2f} H {scores[v]:.2f}")
            best = max(scores, key=scores.get)
            tuned[gkey] = {"param": key, "grid": grid, "val_H": scores, "chosen": best,
                           "at_grid_edge": best in (grid[0], grid[-1])}
            save_outputs(document(), out)  # a resumed run keeps each finished grid
        pols = tuned_rows(pols, tuned, overrides)

    rng_orders: list[tuple[int | None, list[str]]] = [(None, tasks)]
    for s in range(args.shuffles):
        o = tasks[:]
        random.Random(s).shuffle(o)
        rng_orders.append((s, o))
    shuffle_labels = set(args.shuffle_policies.split(",")) if args.shuffle_policies else None
    curve = {f"safe_merge+steps{n}" for n in curve_steps(args)}  # the steps curve: file order only
    planned = [[p[0] + p[1], seed] for seed, _ in rng_orders for p in pols if p[0] + p[1] not in STEP_ONLY
               and (seed is None or ((shuffle_labels is None or p[0] + p[1] in shuffle_labels)
                                     and p[0] + p[1] not in curve))]
    for name, seed in (prev or {}).get("planned_runs", []):  # +ri rows the earlier pieces planned
        if [name, seed] not in planned:
            planned.append([name, seed])
    done = {(label_of(r), r["order_seed"]) for r in runs}
    ri_done: dict[tuple[str, ...], tuple[Path, float]] = {}

    def aux_inputs(seen) -> list:
        """The unlabeled inputs RI (and the adamerging objective) use: train-split inputs of the tasks seen."""
        return [(r[0], r[1]) for s_ in seen for r in X.subsample(tdata[s_].train, args.ri_aux, seed=5)]

    def ri(prefix: tuple[str, ...]) -> tuple[Path, float]:
        """The RI-adapted expert of prefix[-1] given the earlier tasks' heads (cached per prefix)."""
        if prefix not in ri_done:
            task = prefix[-1]
            aux = aux_inputs(prefix)
            t0 = time.perf_counter()
            dst = work / "ri" / ("-".join(prefix[:-1]) or "first") / task
            path, res = adapt_expert(experts[task], X.base_model_path(), dst, own_head=heads[task],
                                     other_heads=[heads[s_] for s_ in prefix[:-1]], aux=aux, params=ri_params,
                                     cache_dir=work / "ri-cache")
            ri_done[prefix] = (path, time.perf_counter() - t0)
            log(f"  RI {task} after {len(prefix) - 1} task(s): {res.steps} steps, loss {res.loss_before:.4f} -> "
                f"{res.loss_after:.4f}, {ri_done[prefix][1]:.1f}s")
        return ri_done[prefix]

    d_tasks: dict[str, DistillTask] = {}
    d_fm = HFEncoderFeatures(X.base_model_path(), max_length=dparams.max_length)

    def distil(seen: tuple[str, ...], out_dir: Path, prev: Path | None, *, budgeted: bool,
               params: DistillParams) -> float:
        """The distil post-step on a fold's output, in place: every seen task's head toward its
        (original) expert's outputs on --distill-aux unlabeled train inputs; in a ``budgeted`` row
        only the entries the fold changed from ``prev`` are trained, as the daemon does under a
        patch budget; returns its seconds."""
        t0 = time.perf_counter()
        for s_ in seen:
            if s_ not in d_tasks:
                inputs = [(r[0], r[1]) for r in X.subsample(tdata[s_].train, args.distill_aux, seed=5)]
                d_tasks[s_] = DistillTask(s_, heads[s_], inputs, teacher_outputs(d_fm, experts[s_], heads[s_], inputs))
        _, dres = distill_backbone(out_dir, X.base_model_path(), out_dir, tasks=[d_tasks[s_] for s_ in seen],
                                   params=params, anchors=d_anchors, within_patch_from=prev if budgeted else None,
                                   feature_model=d_fm, cache_dir=work / "distill-cache")
        log(f"  distil {len(seen)} task(s): KL {dres.kl_before:.4f} -> {dres.kl_after:.4f}, "
            f"similarity {dres.sim_before:.4f} -> {dres.sim_after:.4f}, {dres.seconds:.1f}s")
        return time.perf_counter() - t0

    save_outputs(document(), out)  # the references and the plan, before the first run
    # every policy on the file order first, then the shuffles (an interrupted run keeps the former)
    def order_rows():
        """An order's rows: the plain ones, then the +ri ones. The file order runs first, so "best"
        (the best other policy by H on the file order) is known when its +ri rows are reached."""
        plain = list(pols)
        for row in plain:
            yield (*row, False)
        with_ri = ri_rows(ri_wanted, runs, pols, log)
        for row in with_ri:
            yield (*row, True)
        for row in distill_rows(distill_wanted, plain + with_ri):
            yield (*row, "+ri" in row[1])

    for seed, order in rng_orders:
        for pol, var, params, use_ri in order_rows():
            use_distill = var.endswith("+distill")
            row_d = ROW_DISTILL.get(distill_row_label(pol, var), {}) if use_distill else {}
            row_dparams = replace(dparams, **{k.removeprefix("distill_"): v for k, v in row_d.items()})
            if use_ri or use_distill:
                if [pol + var, seed] not in planned:
                    planned.append([pol + var, seed])
                if shuffle_labels is not None and seed is not None and pol + var not in shuffle_labels:
                    continue
            elif [pol + var, seed] not in planned:
                continue
            if (pol + var, seed) in done:
                continue  # finished by an earlier piece (--resume)
            log(f"{pol}{var} {params} order={'file' if seed is None else seed}: {','.join(order)}")
            objective_for = None
            if params.get("coefficients") == "cmaes":
                def objective_for(seen):
                    return make_objective(experts, val_rows, sts_dev, list(seen), work / "objective")
            elif params.get("coefficients") == "adamerging":
                def objective_for(seen):
                    return make_entropy_objective({t: heads[t] for t in seen}, aux_inputs(seen), args.ada_examples)
            full = seed is None or not args.final_only_shuffles
            want_uad = seed is None and pol in UAD_POLICIES and not var and not args.no_uad
            res = fold_stream(order, experts, pol, params, ev, work, full_steps=full, log=log, objective_for=objective_for,
                              keep_final=want_uad, patches=seed is None and not args.no_patches,
                              ri=ri if use_ri else None, threads=fold_threads,
                              post=partial(distil, budgeted=is_budgeted(params),
                                           params=row_dparams)
                              if use_distill else None)
            if use_distill:
                res["ran_params"].update({"distill_steps": row_dparams.steps, "distill_lr": row_dparams.lr,
                                          "distill_gamma": row_dparams.gamma, "distill_aux": args.distill_aux,
                                          "distill_anchors": args.distill_anchors})
            run = {"policy": pol, "variant": var, "order_seed": seed, "order": order, "params": params,
                   "final": summarise(order, res, ref["expert_acc"]),
                   "steps": [{"t": s["t"], "task": s["task"], "acc": s["acc"], "G": s["G"],
                              "fold_seconds": s["fold_seconds"], "patch_ratio": s["patch_ratio"],
                              "ri_seconds": s["ri_seconds"],
                              "distill_seconds": s["distill_seconds"], "search": s["search"], "coefficients": s["coefficients"],
                              "layer_alphas": s["layer_alphas"]} for s in res["steps"]],
                   "diag": res["diag"], "ran_params": res["ran_params"]}
            if want_uad:
                run["uad"] = uad(order, res, ev, order[0], log)
                shutil.rmtree(res["run"], ignore_errors=True)
            f = run["final"]
            log(f"  final ACC {f['ACC']:.1f} normACC {f['norm_ACC']:.1f} BWT {f['BWT']:.1f} (ref {f.get('BWT_ref', float('nan')):.1f}) G {f['G']:.2f} H {f['H']:.1f}")
            runs.append(run)
            done.add((pol + var, seed))
            # JSON first, after every run (an interrupted benchmark keeps its results), plots last
            save_outputs(document(), out)
    log(f"done in {time.perf_counter() - t_start:.0f}s: {out / 'quality.md'}")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
