"""Merge quality on real experts, measured the way the papers measure it.

Folds the real all-MiniLM-L6-v2 task experts (``bench/experts.py``, ``mergestream/experts.py``) one
at a time with each policy through :func:`mergestream.engine.fold` (the daemon's engine), and after
every fold measures the backbone's accuracy on every task seen so far (each task with its expert's
own head) and G = STS-B test Spearman x100. Reports ACC, normalised ACC (merged / expert), BWT, G,
H = 2·ACC·G/(ACC+G), fold seconds, and for task_arithmetic and mdm_oc the unmerge accuracy drop
(UAD). Writes ``bench/results/quality.{md,json}`` and PNG plots.

    .venv/bin/python bench/quality.py                       # full protocol (hours on 2 cores)
    .venv/bin/python bench/quality.py --eval-examples 200 --sts-pairs 500 --shuffles 3 --final-only-shuffles

Protocol knobs (each recorded in quality.json under "protocol"; quality.md states them):
  --eval-examples N   a fixed seeded subsample of N rows of each task's test split (default: all)
  --sts-pairs N       the first... no: a fixed seeded subsample of N STS-B test pairs (default: all 1379)
  --shuffles S        S seeded shuffles of the task order besides the fixed file order
  --final-only-shuffles  for shuffled orders evaluate every task only after the last fold (a_{j,j}
                      for BWT is still measured right after each fold, on task j only)
  --tune              pick each policy's coefficient from a small grid on a validation split carved
                      from the train split (seeded 100 rows per task) with G on STS-B *dev*, never test
  --cmaes             also run mdm_oc with CMA-ES coefficients (objective: validation accuracy)

Hyperparameters without --tune are the METHODS.md defaults (recorded in each run's "params").
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from mergestream import experts as X  # noqa: E402
from mergestream import text as T  # noqa: E402
from mergestream.engine import fold, unmerge  # noqa: E402
from mergestream.patch_build import build_patch  # noqa: E402
from mergestream.ri import RIParams, adapt_expert  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

#: (policy, variant label, params): METHODS.md defaults.
POLICIES: list[tuple[str, str, dict[str, Any]]] = [
    ("task_arithmetic", "", {"lambda": 0.3}),
    ("ties", "", {"lambda": 1.0, "k": 20}),
    ("safe_merge", "", {"rho": 0.1, "lambda": 0.3}),
    ("safe_merge", "+magnitude-mask", {"rho": 0.1, "lambda": 0.3, "risk_mask": False, "steps": 0}),
    ("mdm_oc", "", {"alpha": 0.3}),
    ("opcm", "", {"alpha": 0.5}),
    ("magmax", "", {"lambda": 0.5}),
]
#: the coefficient --tune searches per policy
GRID = {"task_arithmetic": ("lambda", [0.2, 0.3, 0.5]), "ties": ("lambda", [0.5, 0.7, 1.0]),
        "safe_merge": ("lambda", [0.3, 0.5]), "mdm_oc": ("alpha", [0.2, 0.3, 0.5]), "opcm": ("alpha", [0.3, 0.5, 0.7]),
        "magmax": ("lambda", [0.3, 0.5, 0.7])}
UAD_POLICIES = ("task_arithmetic", "mdm_oc")


def hmean(a: float, g: float) -> float:
    return 2 * a * g / (a + g) if a + g > 0 else 0.0


def read_sts_dev(data: Path, n: int | None) -> list[tuple[float, str, str]]:
    rows = []
    with open(data / "raw" / "stsbenchmark" / "sts-dev.csv", encoding="utf-8") as fh:
        for line in fh:
            parts = line.rstrip("\n").split("\t")
            if len(parts) >= 7:
                rows.append((float(parts[4]), parts[5], parts[6]))
    return X.subsample(rows, n, seed=0)


class Evaluator:
    """Accuracy of a backbone on task rows with each expert's head, and G on STS pairs."""

    def __init__(self, tasks: dict[str, X.TaskData], heads: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 rows: dict[str, list], sts: list[tuple[float, str, str]], tok):
        self.tasks, self.heads, self.rows, self.sts, self.tok = tasks, heads, rows, sts, tok

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
                patches: bool = False, ri=None) -> dict[str, Any]:
    """Fold ``order`` one by one; returns steps, fold seconds, final metrics (and the state folder).

    ``patches``: build the version-to-version patch after every fold and record its size / the
    model's. ``ri``: ``ri(order[:t]) -> (adapted expert folder, RI seconds)``, the RI pre-step.
    """
    base = X.base_model_path()
    run = Path(tempfile.mkdtemp(prefix=f"{policy}-", dir=workdir))
    state = run / "state"
    prev: Path | None = None
    steps, diag, fold_s, patch_ratio, ri_s = [], {}, [], [], []
    for t, task in enumerate(order, 1):
        out = run / f"v{t}"
        src = experts[task]
        if ri is not None:
            src, secs = ri(tuple(order[:t]))
            ri_s.append(secs)
        t0 = time.perf_counter()
        objective = objective_for(order[:t]) if objective_for is not None else None
        fold(base, prev, src, policy, params, state_dir=state, out=out, expert_id=task,
             objective=objective)
        fold_s.append(time.perf_counter() - t0)
        if patches and prev is not None:
            st = build_patch(prev, out, run / "patch.safetensors", source_version=str(t - 1), target_version=str(t),
                             policy=policy, overwrite=True)
            patch_ratio.append(st["ratio"])
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
                      "ri_seconds": ri_s[-1] if ri_s else None})
        log(f"  {policy} t={t} {task}: acc[{task}]={accs[task]:.1f}" + (f" G={g:.2f}" if g is not None else "")
            + f" fold {fold_s[-1]:.1f}s")
    final_acc = steps[-1]["acc"]
    res = {"steps": steps, "diag": diag, "final_acc": final_acc, "G": steps[-1]["G"], "fold_seconds": fold_s,
           "patch_ratio": patch_ratio, "ri_seconds": ri_s, "run": run, "state": state, "backbone": prev}
    if not keep_final:
        shutil.rmtree(run, ignore_errors=True)
    return res


def summarise(order: list[str], res: dict[str, Any], expert_acc: dict[str, float]) -> dict[str, float]:
    fa = res["final_acc"]
    acc = float(np.mean([fa[t] for t in order]))
    bwt = float(np.mean([fa[t] - res["diag"][t] for t in order[:-1]])) if len(order) > 1 else 0.0
    norm = float(np.mean([100.0 * fa[t] / expert_acc[t] for t in order]))
    g = float(res["G"])
    out = {"ACC": acc, "BWT": bwt, "G": g, "H": hmean(acc, g), "norm_ACC": norm,
           "fold_seconds_mean": float(np.mean(res["fold_seconds"]))}
    if res.get("patch_ratio"):
        out["patch_ratio_mean"] = float(np.mean(res["patch_ratio"]))
    if res.get("ri_seconds"):
        out["ri_seconds_mean"] = float(np.mean(res["ri_seconds"]))
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


def make_objective(ev: Evaluator, val_rows: dict[str, list], seen: list[str]):
    """CMA-ES objective for mdm_oc: minus the mean validation accuracy (train-split rows) of the
    tasks folded so far; weights are streamed into a BertModel in memory."""
    base_model, _ = X.load_encoder()

    def objective(alphas, weights) -> float:
        sd = dict(weights())
        base_model.load_state_dict({k: v for k, v in sd.items()}, strict=False)
        accs = []
        for t in seen:
            rows = val_rows[t]
            emb = X.embed_rows(base_model, ev.tok, rows, max_length=64)
            w, b = ev.heads[t]
            accs.append(T.head_accuracy(emb, [y for _, _, y in rows], w, b))
        return -float(np.mean(accs))

    return objective


# ------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------
def complete_plan(doc: dict[str, Any]) -> None:
    """``+ri`` rows enter ``planned_runs`` only when their order is reached (the "best other"
    policy is chosen during the run): once a ``+ri`` label is known, plan it on every order."""
    seeds = [None, *range(doc["protocol"]["shuffles"])]
    plan = doc.setdefault("planned_runs", [])
    for name in sorted({n for n, _ in plan if n.endswith("+ri")}):
        for seed in seeds:
            if [name, seed] not in plan:
                plan.append([name, seed])



def label(run: dict[str, Any]) -> str:
    return run["policy"] + run["variant"]


def write_md(doc: dict[str, Any], path: Path) -> None:
    p = doc["protocol"]
    ref = doc["references"]
    lines = ["# Merge quality on real experts (all-MiniLM-L6-v2)", "",
             "Generated by `bench/quality.py`; do not edit by hand. Command:", "",
             f"    {doc['command']}", "",
             f"Tasks ({len(p['tasks'])}, file order): {', '.join(p['tasks'])}. "
             f"Evaluation: {p['eval_examples'] or 'all'} test rows per task (seeded subsample), G = STS-B test "
             f"Spearman x100 on {p['sts_pairs'] or 1379} pairs; orders: the file order"
             f"{' (accuracy of every seen task after every fold)' if True else ''}"
             + (f" plus {p['shuffles']} seeded shuffles" + (" (all tasks measured after the last fold only; "
                "a_jj right after each fold)" if p["final_only_shuffles"] else "") if p["shuffles"] else "") + ".",
             "", "Hyperparameters: " + ("tuned on a validation split carved from train (G on STS-B dev)"
                                        if p["tuned"] else "METHODS.md defaults, not tuned (see `params`)") + ".", ""]
    if p.get("reduced"):
        lines += ["**Reduced protocol** (what was cut to fit the time available): " + p["reduced"], ""]
    lines += ["## References", "",
              "| task | expert acc % | base + expert head % | linear probe on frozen base % |",
              "| --- | ---: | ---: | ---: |"]
    for t in p["tasks"]:
        lines.append(f"| {t} | {ref['expert_acc'][t]:.1f} | {ref['base_head_acc'][t]:.1f} | {ref['linear_probe_acc'][t]:.1f} |")
    lines.append(f"| **mean** | {np.mean(list(ref['expert_acc'].values())):.1f} | "
                 f"{np.mean(list(ref['base_head_acc'].values())):.1f} | {np.mean(list(ref['linear_probe_acc'].values())):.1f} |")
    lines += ["", f"G of the unchanged base: {ref['base_G']:.2f}; G of each single expert: "
              + ", ".join(f"{t} {v:.1f}" for t, v in ref["expert_G"].items()), ""]
    lines += ["## Final model after all folds", "",
              "Mean over orders (file order + shuffles) ± std where there are several; UAD = mean accuracy "
              "drop of the remaining tasks after `unmerge --mode subtract` of the first task, against the "
              "model folded without it from the start (= `--mode replay`), file order.", "",
              "patch/model = size of the version-to-version patch (`versions/N/patch-from-<N-1>`) over the full "
              "model's, mean over folds 2..T of the file order; RI s = seconds of the RI pre-step per expert "
              "(the first expert of an order has no earlier heads, so RI leaves it unchanged).", "",
              "| policy | params | ACC | norm ACC | BWT | G | H | fold s | RI s | patch/model | UAD |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in doc["runs"]:
        groups.setdefault(label(r), []).append(r)
    for name, rs in groups.items():
        def cell(key: str, rs=rs) -> str:
            v = [r["final"][key] for r in rs]
            return f"{np.mean(v):.1f}" + (f" ± {np.std(v):.1f}" if len(v) > 1 else "")
        u = next((r["uad"]["UAD"] for r in rs if r.get("uad")), None)
        pr = next((r["final"]["patch_ratio_mean"] for r in rs if r["final"].get("patch_ratio_mean") is not None), None)
        ri_s = [r["final"]["ri_seconds_mean"] for r in rs if r["final"].get("ri_seconds_mean") is not None]
        params = ", ".join(f"{k}={v}" for k, v in rs[0]["params"].items())
        lines.append(f"| {name} | {params} | {cell('ACC')} | {cell('norm_ACC')} | {cell('BWT')} | {cell('G')} | "
                     f"{cell('H')} | {np.mean([r['final']['fold_seconds_mean'] for r in rs]):.1f} | "
                     + (f"{np.mean(ri_s):.1f}" if ri_s else "–") + " | "
                     + (f"{pr:.3f}" if pr is not None else "–") + " | "
                     + (f"{u:.2f}" if u is not None else "–") + " |")
    planned = doc.get("planned_runs")
    if planned:
        done = {(r["policy"] + r["variant"], r["order_seed"]) for r in doc["runs"]}
        missing = [f"{name} (order {'file' if seed is None else 'shuffle ' + str(seed)})"
                   for name, seed in (tuple(x) for x in planned) if (name, seed) not in done]
        lines += ["", f"Runs completed: {len(done)} of {len(planned)} planned."
                  + (" Not completed (the run was stopped for time): " + ", ".join(missing) + "." if missing else "")]
    if doc.get("skipped"):
        lines += ["", "Not run: " + "; ".join(doc["skipped"])]
    lines += ["", "## File order, per fold (ACC over the tasks seen so far / G / H)", ""]
    fo = [r for r in doc["runs"] if r["order_seed"] is None]
    lines.append("| policy | " + " | ".join(f"t={i + 1}" for i in range(len(p["tasks"]))) + " |")
    lines.append("| --- |" + " ---: |" * len(p["tasks"]))
    for r in fo:
        cells = []
        for s in r["steps"]:
            a = float(np.mean(list(s["acc"].values())))
            cells.append(f"{a:.1f} / {s['G']:.1f} / {hmean(a, s['G']):.1f}" if s["G"] is not None else f"{a:.1f}")
        lines.append(f"| {label(r)} | " + " | ".join(cells) + " |")
    lines += ["", "Plots: " + ", ".join(f"`{x}`" for x in doc.get("plots", [])), ""]
    path.write_text("\n".join(lines))


def plot(doc: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = doc["protocol"]["tasks"]
    fo = [r for r in doc["runs"] if r["order_seed"] is None]
    files = []
    n = len(fo)
    cols = min(4, n)
    rows_ = math.ceil(n / cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(3.6 * cols, 3.4 * rows_), squeeze=False)
    for ax, r in zip(axes.flat, fo):
        m = np.full((len(tasks), len(tasks)), np.nan)
        for s in r["steps"]:
            for j, t in enumerate(tasks):
                if t in s["acc"]:
                    m[s["t"] - 1, j] = s["acc"][t]
        im = ax.imshow(m, vmin=0, vmax=100, cmap="viridis")
        ax.set_title(label(r), fontsize=9)
        ax.set_xticks(range(len(tasks)), tasks, rotation=70, fontsize=7)
        ax.set_yticks(range(len(tasks)), [f"t={i + 1}" for i in range(len(tasks))], fontsize=7)
        for i in range(len(tasks)):
            for j in range(len(tasks)):
                if not np.isnan(m[i, j]):
                    ax.text(j, i, f"{m[i, j]:.0f}", ha="center", va="center", fontsize=6, color="w")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.colorbar(im, ax=axes, shrink=0.6, label="accuracy %")
    fig.suptitle("accuracy after each fold (row) on each task (column), file order")
    f1 = out / "quality_acc_matrix.png"
    fig.savefig(f1, dpi=110, bbox_inches="tight")
    plt.close(fig)
    files.append(f1.name)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for r in fo:
        ts = [s["t"] for s in r["steps"]]
        acc = [float(np.mean(list(s["acc"].values()))) for s in r["steps"]]
        g = [s["G"] for s in r["steps"]]
        axes[0].plot(ts, acc, marker="o", label=label(r))
        axes[1].plot(ts, g, marker="o", label=label(r))
        axes[2].plot(ts, [hmean(a, b) for a, b in zip(acc, g)], marker="o", label=label(r))
    for ax, name in zip(axes, ("ACC (tasks seen so far) %", "G (STS-B Spearman x100)", "H")):
        ax.set_xlabel("folds")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_title(name)
        ax.grid(alpha=0.3)
    axes[1].axhline(doc["references"]["base_G"], color="k", ls="--", lw=0.8, label="base")
    axes[2].legend(fontsize=7)
    f2 = out / "quality_curves.png"
    fig.savefig(f2, dpi=110, bbox_inches="tight")
    plt.close(fig)
    files.append(f2.name)
    return files


# ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="merge quality on real MiniLM experts")
    ap.add_argument("--tasks", default=",".join(X.STREAM_TASKS))
    ap.add_argument("--policies", default=None, help="comma-separated labels (e.g. task_arithmetic,mdm_oc,safe_merge+magnitude-mask)")
    ap.add_argument("--eval-examples", type=int, default=None)
    ap.add_argument("--sts-pairs", type=int, default=None)
    ap.add_argument("--shuffles", type=int, default=3)
    ap.add_argument("--final-only-shuffles", action="store_true")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--cmaes", action="store_true")
    ap.add_argument("--cmaes-budget", type=int, default=12)
    ap.add_argument("--no-uad", action="store_true")
    ap.add_argument("--ri-policies", default="task_arithmetic,ties,best",
                    help="policies also run with the RI pre-step ('+ri' rows); 'best' = the best other "
                         "policy by H on the file order; '' for none")
    ap.add_argument("--ri-steps", type=int, default=40, help="RI AdamW steps per expert")
    ap.add_argument("--ri-lr", type=float, default=1e-5)
    ap.add_argument("--ri-aux", type=int, default=48,
                    help="unlabeled train-split inputs per task seen so far used as RI auxiliary data")
    ap.add_argument("--no-patches", action="store_true", help="skip the patch size measurement")
    ap.add_argument("--lp-train", type=int, default=None, help="train rows for the linear-probe reference (default: all)")
    ap.add_argument("--reduced-note", default="", help="text for quality.md about what was reduced")
    ap.add_argument("--recipe", default="", help="recipe overrides for smoke runs, e.g. max_train=64,max_steps=4")
    ap.add_argument("--shuffle-policies", default=None,
                    help="comma-separated labels run on the shuffled orders too (default: every policy)")
    ap.add_argument("--planned-policies", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--from-json", default=None, metavar="QUALITY_JSON",
                    help="only re-render quality.md and the plots from an existing quality.json")
    ap.add_argument("--cache", default=None)
    ap.add_argument("--data", default=None)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--workdir", default=None, help="scratch folder for backbones (default: a temp dir)")
    args = ap.parse_args(argv)
    X._offline()
    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        doc = json.loads(Path(args.from_json).read_text())
        if args.planned_policies and "planned_runs" not in doc:
            names = args.planned_policies.split(",")
            shuf = (args.shuffle_policies or args.planned_policies).split(",")
            doc["planned_runs"] = [[n, None] for n in names] + [[n, s] for s in range(doc["protocol"]["shuffles"])
                                                                for n in shuf]
        complete_plan(doc)
        doc["plots"] = plot(doc, out)
        (out / "quality.json").write_text(json.dumps(doc, indent=1) + "\n")
        write_md(doc, out / "quality.md")
        print(f"re-rendered {out / 'quality.md'} from {args.from_json}")
        return 0
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ms-quality-"))
    work.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.0f}s] {msg}", flush=True)

    tasks = [t for t in args.tasks.split(",") if t]
    data = X.data_root(args.data)
    over = {k: int(v) for k, v in (kv.split("=") for kv in args.recipe.split(",") if kv)}
    experts = {t: X.build_expert(X.ExpertSpec.for_task(t, **over), cache=args.cache, data=args.data, log=log,
                                 evaluate=not over) for t in tasks}
    tdata = {t: X.load_task(t, args.data) for t in tasks}
    heads = {t: T.load_head(experts[t] / "head.safetensors", t) for t in tasks}
    rows = {t: X.subsample(tdata[t].test, args.eval_examples, seed=0) for t in tasks}
    sts = X.subsample(X.load_sts(args.data), args.sts_pairs, seed=0)
    base_model, tok = X.load_encoder()
    ev = Evaluator(tdata, heads, rows, sts, tok)

    # references
    log("references: experts, base with expert heads, linear probe, G")
    ref: dict[str, Any] = {"expert_acc": {}, "base_head_acc": {}, "linear_probe_acc": {}, "expert_G": {}}
    ref["base_G"] = ev.g(base_model)
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

    pols = POLICIES
    if args.policies:
        want = set(args.policies.split(","))
        pols = [p for p in POLICIES if p[0] + p[1] in want]
    skipped = []
    if args.cmaes:
        pols = pols + [("mdm_oc", "+cmaes", {"alpha": 0.3, "coefficients": "cmaes", "budget": args.cmaes_budget})]
    else:
        skipped.append("mdm_oc with CMA-ES coefficients (--cmaes; not run for time)")

    tuned: dict[str, Any] = {}
    if args.tune:
        log("tuning on validation rows carved from train (100 per task) with G on STS-B dev")
        val_rows = {t: X.subsample(tdata[t].train, 100, seed=7) for t in tasks}
        vev = Evaluator(tdata, heads, val_rows, read_sts_dev(data, args.sts_pairs or 500), tok)
        new = []
        for pol, var, params in pols:
            if pol not in GRID or var:
                new.append((pol, var, params))
                continue
            key, grid = GRID[pol]
            scores = {}
            for v in grid:
                p = {**params, key: v}
                r = fold_stream(tasks, experts, pol, p, vev, work, full_steps=False, log=lambda m: None)
                a = float(np.mean(list(r["final_acc"].values())))
                scores[v] = hmean(a, r["G"])
                log(f"  tune {pol} {key}={v}: val ACC {a:.1f} G(dev) {r['G']:.2f} H {scores[v]:.2f}")
            best = max(scores, key=scores.get)
            tuned[pol] = {"param": key, "grid": grid, "val_H": scores, "chosen": best}
            new.append((pol, var, {**params, key: best}))
        pols = new

    rng_orders: list[tuple[int | None, list[str]]] = [(None, tasks)]
    for s in range(args.shuffles):
        o = tasks[:]
        random.Random(s).shuffle(o)
        rng_orders.append((s, o))
    shuffle_labels = set(args.shuffle_policies.split(",")) if args.shuffle_policies else None
    planned = [[p[0] + p[1], seed] for seed, _ in rng_orders for p in pols
               if seed is None or shuffle_labels is None or p[0] + p[1] in shuffle_labels]
    ri_params = RIParams(steps=args.ri_steps, lr=args.ri_lr, batch_size=16, max_length=64, eval_examples=64)
    ri_done: dict[tuple[str, ...], tuple[Path, float]] = {}

    def ri(prefix: tuple[str, ...]) -> tuple[Path, float]:
        """The RI-adapted expert of prefix[-1] given the earlier tasks' heads (cached per prefix)."""
        if prefix not in ri_done:
            task = prefix[-1]
            aux = [(r[0], r[1]) for s_ in prefix for r in X.subsample(tdata[s_].train, args.ri_aux, seed=5)]
            t0 = time.perf_counter()
            dst = work / "ri" / ("-".join(prefix[:-1]) or "first") / task
            path, res = adapt_expert(experts[task], X.base_model_path(), dst, own_head=heads[task],
                                     other_heads=[heads[s_] for s_ in prefix[:-1]], aux=aux, params=ri_params,
                                     cache_dir=work / "ri-cache")
            ri_done[prefix] = (path, time.perf_counter() - t0)
            log(f"  RI {task} after {len(prefix) - 1} task(s): {res.steps} steps, loss {res.loss_before:.4f} -> "
                f"{res.loss_after:.4f}, {ri_done[prefix][1]:.1f}s")
        return ri_done[prefix]

    ri_wanted = [p for p in args.ri_policies.split(",") if p]
    runs = []
    # every policy on the file order first, then the shuffles (an interrupted run keeps the former)
    for seed, order in rng_orders:
        # +ri rows come after the plain rows of each order; the file order runs first, so "best"
        # (the best other policy by H on the file order) is known when its +ri row is reached
        order_pols = list(pols) + [("__ri__", n, {}) for n in ri_wanted]
        for pol, var, params in order_pols:
            use_ri = pol == "__ri__"
            if use_ri:
                name = var
                if name == "best":
                    cands = [r for r in runs if r["order_seed"] is None and not r["variant"]
                             and r["policy"] not in ("task_arithmetic", "ties")]
                    if not cands:
                        continue
                    name = max(cands, key=lambda r: r["final"]["H"])["policy"]
                    log(f"best other policy by H on the file order: {name}")
                src = next((p for p in pols if p[0] == name and not p[1]), None)
                if src is None:
                    continue
                pol, var, params = src[0], "+ri", dict(src[2])
                if [pol + var, seed] not in planned:
                    planned.append([pol + var, seed])
                if shuffle_labels is not None and seed is not None and pol + var not in shuffle_labels:
                    continue
            elif [pol + var, seed] not in planned:
                continue
            log(f"{pol}{var} {params} order={'file' if seed is None else seed}: {','.join(order)}")
            objective_for = None
            if params.get("coefficients") == "cmaes":
                val_rows = {t: X.subsample(tdata[t].train, 32, seed=7) for t in tasks}

                def objective_for(seen, val_rows=val_rows):
                    return make_objective(ev, val_rows, list(seen))
            full = seed is None or not args.final_only_shuffles
            want_uad = seed is None and pol in UAD_POLICIES and not var and not args.no_uad
            res = fold_stream(order, experts, pol, params, ev, work, full_steps=full, log=log, objective_for=objective_for,
                              keep_final=want_uad, patches=seed is None and not args.no_patches,
                              ri=ri if use_ri else None)
            run = {"policy": pol, "variant": var, "order_seed": seed, "order": order, "params": params,
                   "final": summarise(order, res, ref["expert_acc"]),
                   "steps": [{"t": s["t"], "task": s["task"], "acc": s["acc"], "G": s["G"],
                              "fold_seconds": s["fold_seconds"], "patch_ratio": s["patch_ratio"],
                              "ri_seconds": s["ri_seconds"]} for s in res["steps"]],
                   "diag": res["diag"]}
            if want_uad:
                run["uad"] = uad(order, res, ev, order[0], log)
                shutil.rmtree(res["run"], ignore_errors=True)
            f = run["final"]
            log(f"  final ACC {f['ACC']:.1f} normACC {f['norm_ACC']:.1f} BWT {f['BWT']:.1f} G {f['G']:.2f} H {f['H']:.1f}")
            runs.append(run)
            doc = {"command": " ".join([".venv/bin/python", "bench/quality.py", *(argv if argv is not None else sys.argv[1:])]),
                   "protocol": {"tasks": tasks, "eval_examples": args.eval_examples, "sts_pairs": args.sts_pairs, "lp_train": args.lp_train,
                                "shuffles": args.shuffles, "final_only_shuffles": args.final_only_shuffles,
                                "tuned": bool(args.tune), "tuning": tuned, "reduced": args.reduced_note,
                                "ri": {"policies": ri_wanted, "params": ri_params.__dict__, "aux_per_task": args.ri_aux,
                                       "aux": "unlabeled train-split inputs of the tasks seen so far"},
                                "recipe": {t: X.read_expert(experts[t])["recipe"] for t in tasks},
                                "experts": {t: str(experts[t]) for t in tasks},
                                "torch_threads": torch.get_num_threads()},
                   "references": ref, "runs": runs, "skipped": skipped, "planned_runs": planned,
                   "seconds": time.perf_counter() - t_start}
            # written after every run, so an interrupted benchmark still leaves its results
            complete_plan(doc)
            doc["plots"] = plot(doc, out)
            (out / "quality.json").write_text(json.dumps(doc, indent=1) + "\n")
            write_md(doc, out / "quality.md")
    log(f"done in {time.perf_counter() - t_start:.0f}s: {out / 'quality.md'}")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
