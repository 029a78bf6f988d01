"""Quality on tasks the tuning never saw (issue 39, item 5): a held-out task split for
``bench/quality.py``, and the daemon's per-fold strength choice against the fixed default.

The 8 stream tasks are split into a *visible* set (tuning sees only these) and a *held-out* set
(``--heldout``, 3 tasks by default). For each policy row (``bench/quality.py``'s POLICIES, default
parameters) three modes are folded on both sets, each set as its own stream in file order:

* ``default``: the row's fixed parameters (METHODS.md defaults);
* ``visible-tuned``: the strength coefficient (``quality.GRID``) picked by H on the *visible* tasks'
  validation rows (carved out of train before the experts are trained) with G on STS-B *dev*, then
  run unchanged on both sets: a policy's default should be the best on the held-out set at
  visible-tuned parameters;
* ``auto``: the daemon's ``policy.strength: auto`` (:func:`mergestream.daemon.strength.fold_at_best_strength`,
  the same code): at every fold each candidate strength (the default first, then the policy's grid,
  which is ``quality.GRID``'s) is scored by the daemon's objective on the task probes the built
  experts ship (``mergestream_probe/``: validation rows, never test rows) of the tasks folded so far,
  plus STS-B dev pairs, and the best is kept. It uses no test row and no tuning run.

Every run is measured on test rows (``--eval-examples`` per task) and STS-B test pairs
(``--sts-pairs``): ACC, G, H = 2·ACC·G/(ACC+G), BWT. Writes ``quality_heldout.json`` (after every
run; ``--resume`` continues it) and ``quality_heldout.md`` to ``--out`` (default: a scratch folder).

    # the checked-in reduced run (bench/results/quality_heldout.md states its protocol)
    .venv/bin/python bench/quality_heldout.py --policies task_arithmetic,iso_c,opcm,safe_merge \\
        --eval-examples 300 --sts-pairs 500 --recipe epochs=1 --lpft tasks --threads 2 --out bench/results --resume
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import quality as Q  # noqa: E402
import torch  # noqa: E402
from quality_report import hmean  # noqa: E402
from quality_setup import (  # noqa: E402
    BenchInputError,
    carve_validation,
    carved_folder,
    default_out,
    expert_hash,
    parse_recipe,
    validation_rows,
)

from mergestream import experts as X  # noqa: E402
from mergestream.datasteps import text as T  # noqa: E402
from mergestream.config_policy import ObjectiveConfig, PolicyConfig  # noqa: E402
from mergestream.daemon.objective import ProbeObjective  # noqa: E402
from mergestream.daemon.probes import SentenceSimilarityProbe, discover_task_probe  # noqa: E402
from mergestream.daemon.strength import fold_at_best_strength  # noqa: E402
from mergestream.engine import ExecOptions, fold  # noqa: E402
from mergestream.io.state import StateDir  # noqa: E402

#: held out by default: one topic task (a visible cousin: 20ng), one lexical-semantics task and the
#: pair task (no visible cousin): the visible stream keeps sst2, trec, 20ng, tweets, fortune_topic
HELDOUT = ("agnews", "wn_noun", "sicke")
MODES = ("default", "visible-tuned", "auto")
SETS = ("visible", "heldout")


def split_tasks(tasks: list[str], heldout: list[str]) -> tuple[list[str], list[str]]:
    """(visible, held-out) tasks, each in ``tasks``' order.

    Raises:
        BenchInputError: a held-out task not in ``tasks``, or no task left on either side.
    """
    stray = sorted(set(heldout) - set(tasks))
    if stray:
        raise BenchInputError(f"--heldout: {', '.join(stray)} not among --tasks ({', '.join(tasks)})")
    visible = [t for t in tasks if t not in heldout]
    held = [t for t in tasks if t in heldout]
    if not visible or not held:
        raise BenchInputError(f"need visible and held-out tasks, got visible={visible} held-out={held}")
    return visible, held


def write_sts_dev(pairs: list[tuple[float, str, str]], path: Path) -> Path:
    """STS-B dev pairs as the daemon's sentence_similarity probe file (TSV ``score, text, text2``)."""
    import csv
    import random

    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="", encoding="utf-8") as fh:
            w = csv.writer(fh, delimiter="\t")
            w.writerow(["score", "text", "text2"])
            w.writerows(random.Random(0).sample(pairs, len(pairs)))  # "first N" spans the genres
    return path


def probe_objective(experts: dict[str, Path], seen: list[str], sts_file: Path) -> ProbeObjective:
    """The daemon's objective (``policy.objective`` defaults) on the task probes the experts of
    ``seen`` ship (their validation rows) and the STS-B dev pairs."""
    oc = ObjectiveConfig()
    specs = [discover_task_probe(experts[t]) for t in seen]
    base = X.base_model_path()
    return ProbeObjective(base, [s for s in specs if s is not None], SentenceSimilarityProbe(data=sts_file),
                          tokenizer=base, task_weight=oc.task_weight, general_weight=oc.general_weight,
                          examples_per_task=oc.examples_per_task, general_pairs=oc.general_pairs)


def auto_folder(policy: str, params: dict[str, Any], experts: dict[str, Path], sts_file: Path,
                threads: int | None, record: list[dict[str, Any]]):
    """A ``fold_with`` for :func:`quality.fold_stream` that folds as the daemon does with
    ``policy.strength: auto`` (``params``' strength is the configured value); each fold's choice is
    appended to ``record``."""
    cfg = PolicyConfig(name=policy, params=params, strength={"mode": "auto"})
    base = X.base_model_path()

    def fold_with(seen, prev: Path | None, src: Path, state: Path, out: Path):
        staging = Path(tempfile.mkdtemp(prefix="auto-", dir=out.parent))

        def carry(dest: Path) -> None:  # the daemon's carry_state: the current state, hard-linked
            if state.exists():
                shutil.copytree(state, dest, copy_function=os.link)
            else:
                dest.mkdir(parents=True)

        def fold_one(pol, state_dir: Path, o: Path):
            return fold(base, prev, src, pol, state_dir=state_dir, out=o, expert_id=seen[-1],
                        options=ExecOptions(threads=threads))

        try:
            rep, rec = fold_at_best_strength(cfg, probe_objective(experts, list(seen), sts_file), fold_one, carry,
                                             staging)
            shutil.rmtree(state, ignore_errors=True)
            (staging / "state").rename(state)
            (staging / "model").rename(out)
            StateDir(state).set_backbone(out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        record.append({"task": seen[-1], **rec})
        return rep

    return fold_with


def summary(order: list[str], res: dict[str, Any]) -> dict[str, float]:
    """ACC, G, H and BWT (ours and the reference's) of a finished stream."""
    from quality_report import backward_transfer

    acc = float(np.mean([res["final_acc"][t] for t in order]))
    g = float(res["G"])
    return {"ACC": acc, "G": g, "H": hmean(acc, g), **backward_transfer(order, res["final_acc"], res["diag"]),
            "fold_seconds_mean": float(np.mean(res["fold_seconds"]))}


def ranking(runs: list[dict[str, Any]], which: str, mode: str) -> list[tuple[str, float]]:
    """(row label, H) of the runs of one set and mode, best first."""
    rows = [(r["label"], r["final"]["H"]) for r in runs if r["set"] == which and r["mode"] == mode]
    return sorted(rows, key=lambda x: -x[1])


def write_md(doc: dict[str, Any], path: Path) -> None:
    """``quality_heldout.md``: the protocol, per set the three modes of every row, the rankings."""
    p, runs = doc["protocol"], doc["runs"]
    lines = ["# Quality on held-out tasks (issue 39, item 5)", "",
             f"Command: `{doc['command']}`", "",
             f"Machine: {doc.get('machine', 'not recorded')}, torch threads {p.get('torch_threads')}.", "",
             f"Visible tasks (tuning sees only these): {', '.join(p['visible'])}. "
             f"Held-out tasks: {', '.join(p['heldout'])}. Each set is its own stream, file order only.", "",
             f"Protocol: {p['eval_examples'] or 'all'} seeded test rows per task, {p['sts_pairs'] or 'all 1379'} "
             f"STS-B test pairs (G); tuning on {p['val_rows']} validation rows per task carved out of train before "
             f"training, with G on STS-B dev; auto: the daemon's objective (task_weight {p['objective']['task_weight']}, "
             f"general_weight {p['objective']['general_weight']}, first {p['objective']['examples_per_task']} probe rows "
             f"per task, first {p['objective']['general_pairs']} STS-B dev pairs) on the experts' own task probes. "
             f"Expert recipe overrides: {p['recipe_overrides'] or 'none'}; LP-FT: {p['lpft']}. "
             + (f"Reduced: {p['reduced']}. " if p.get("reduced") else "")
             + f"θ₀'s G on these pairs: {doc['references']['base_G']:.2f}. Wall time {doc['seconds'] / 60:.0f} min.", "",
             "`default` runs each row's parameters in bench/quality.py's POLICIES ("
             + "; ".join(sorted({f"{r['label']} {r['params']}" for r in runs if r["mode"] == "default"}))
             + "); `auto` starts each fold from them. One order and a few hundred rows per task: differences "
             "below about 1 H are within what this protocol resolves (our judgment, not a measured interval).", ""]
    for which in SETS:
        lines += [f"## {which} tasks ({', '.join(p[which])})", "",
                  "| row | mode | strength | ACC | G | H | BWT | ΔH vs default |", "|---|---|---|---|---|---|---|---|"]
        for r in [r for r in runs if r["set"] == which]:
            ref = next((d for d in runs if d["set"] == which and d["label"] == r["label"] and d["mode"] == "default"), None)
            dh = f"{r['final']['H'] - ref['final']['H']:+.2f}" if ref is not None and r["mode"] != "default" else ""
            f = r["final"]
            lines.append(f"| {r['label']} | {r['mode']} | {r['strength_text']} | {f['ACC']:.1f} | {f['G']:.2f} | "
                         f"{f['H']:.2f} | {f['BWT']:.1f} | {dh} |")
        lines.append("")
    lines += ["## Rankings by H", "", "| mode | visible | held-out |", "|---|---|---|"]
    for mode in MODES:
        cells = [", ".join(f"{lab} {h:.2f}" for lab, h in ranking(runs, which, mode)) for which in SETS]
        lines.append(f"| {mode} | {cells[0]} | {cells[1]} |")
    for name, text in doc.get("findings", {}).items():
        lines += ["", f"- {name}: {text}"]
    tun = doc.get("tuning", {})
    if tun:
        lines += ["", "## Tuning on the visible tasks' validation rows (H with G on STS-B dev)", ""]
        for lab, t in tun.items():
            lines.append(f"- {lab}: {t['param']} " + ", ".join(f"{k}: {v:.2f}" for k, v in t["val_H"].items())
                         + f" -> {t['chosen']}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def findings(doc: dict[str, Any]) -> dict[str, str]:
    """The issue's questions answered from the runs: does the visible-best stay near the held-out
    best, and does auto beat the fixed default on each set (mean ΔH over rows)."""
    runs, out = doc["runs"], {}
    vis, held = ranking(runs, "visible", "visible-tuned"), ranking(runs, "heldout", "visible-tuned")
    if vis and held:
        best_vis = vis[0][0]
        h = dict(held)
        if best_vis in h:
            out["visible-best on held-out"] = (f"{best_vis} (best on visible) scores H {h[best_vis]:.2f} on the held-out "
                                               f"set, {held[0][1] - h[best_vis]:.2f} below its best ({held[0][0]})")
    for which in SETS:
        d = [r["final"]["H"] - next(x["final"]["H"] for x in runs if x["set"] == which and x["label"] == r["label"]
                                    and x["mode"] == "default")
             for r in runs if r["set"] == which and r["mode"] == "auto"
             and any(x["set"] == which and x["label"] == r["label"] and x["mode"] == "default" for x in runs)]
        if d:
            out[f"auto vs default ({which})"] = (f"mean ΔH {np.mean(d):+.2f} over {len(d)} rows "
                                                 f"(min {min(d):+.2f}, max {max(d):+.2f})")
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description="merge quality on held-out tasks; auto strength vs the fixed default")
    ap.add_argument("--tasks", default=",".join(X.STREAM_TASKS))
    ap.add_argument("--heldout", default=",".join(HELDOUT), help="comma-separated tasks tuning never sees")
    ap.add_argument("--policies", default="task_arithmetic,iso_c,opcm,safe_merge",
                    help="row labels of bench/quality.py's POLICIES whose policy has a GRID")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--eval-examples", type=int, default=None)
    ap.add_argument("--sts-pairs", type=int, default=None)
    ap.add_argument("--val-rows", type=int, default=100)
    ap.add_argument("--recipe", default="", help="expert recipe fields (bench/quality.py --recipe)")
    ap.add_argument("--lpft", choices=("rule", "tasks"), default="rule")
    ap.add_argument("--reduced-note", default="")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cache", default=None)
    ap.add_argument("--data", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--resume", action="store_true", help="keep the tuning and runs of --out/quality_heldout.json")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the held-out benchmark (see the module docstring); returns 0."""
    args = build_parser().parse_args(argv)
    X._offline()
    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = args.threads or 1

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.0f}s] {msg}", flush=True)

    tasks = [t for t in args.tasks.split(",") if t]
    visible, held = split_tasks(tasks, [t for t in args.heldout.split(",") if t])
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - set(MODES):
        raise BenchInputError(f"--modes: {sorted(set(modes) - set(MODES))} unknown; known: {', '.join(MODES)}")
    rows = [p for p in Q.POLICIES if p[0] + p[1] in args.policies.split(",")]
    missing = sorted(set(args.policies.split(",")) - {p[0] + p[1] for p in rows})
    if missing:
        raise BenchInputError(f"--policies: {', '.join(missing)} not in bench/quality.py's POLICIES")
    out = Path(args.out) if args.out else default_out()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ms-heldout-"))
    over = parse_recipe(args.recipe)
    data = carve_validation(X.data_root(args.data), carved_folder(X.cache_root(args.cache) / "quality-data", tasks,
                                                                  args.val_rows), tasks, args.val_rows)
    val = {t: validation_rows(data, t) for t in tasks}
    experts, _ = Q.build_experts(tasks, data, over, args.lpft, val, log, cache=args.cache)
    tdata = {t: X.load_task(t, data) for t in tasks}
    heads = {t: T.load_head(experts[t] / "head.safetensors", t) for t in tasks}
    _, tok = X.load_encoder()
    ev = Q.Evaluator(tdata, heads, {t: X.subsample(tdata[t].test, args.eval_examples, seed=0) for t in tasks},
                     X.subsample(X.load_sts(data), args.sts_pairs, seed=0), tok)
    sts_dev = Q.read_sts_dev(data, args.sts_pairs or 500)
    vev = Q.Evaluator(tdata, heads, val, sts_dev, tok)
    sts_file = write_sts_dev(sts_dev, work / "sts-dev.tsv")
    protocol = {"tasks": tasks, "visible": visible, "heldout": held, "eval_examples": args.eval_examples,
                "sts_pairs": args.sts_pairs, "val_rows": args.val_rows, "recipe_overrides": over, "lpft": args.lpft,
                "objective": ObjectiveConfig().model_dump(), "reduced": args.reduced_note, "modes": modes,
                "expert_hashes": {t: expert_hash(experts[t]) for t in tasks}, "torch_threads": torch.get_num_threads()}
    path = out / "quality_heldout.json"
    prev = json.loads(path.read_text()) if args.resume and path.exists() else None
    if prev is not None and {k: v for k, v in prev["protocol"].items() if k != "modes"} != \
            {k: v for k, v in json.loads(json.dumps(protocol)).items() if k != "modes"}:
        raise BenchInputError(f"{path} was run with another protocol (or other experts): use another --out")
    doc: dict[str, Any] = prev or {"protocol": protocol, "runs": [], "tuning": {}, "seconds": 0.0,
                                   "references": {"base_G": ev.g(ev.load(X.base_model_path()))}}
    doc["command"] = shlex.join([".venv/bin/python", "bench/quality_heldout.py", *(argv if argv is not None else sys.argv[1:])])
    doc.setdefault("machine", f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}, torch "
                              f"{torch.__version__}")
    done_before = doc["seconds"]

    def save() -> None:
        doc["seconds"] = done_before + time.perf_counter() - t_start
        doc["findings"] = findings(doc)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        write_md(doc, out / "quality_heldout.md")

    save()
    for pol, var, params in rows:
        label = pol + var
        gkey = label if label in Q.GRID else pol
        key, grid = Q.GRID[gkey]
        if "visible-tuned" in modes and label not in doc["tuning"]:
            scores = {}
            for v in grid:
                r = Q.fold_stream(visible, experts, pol, {**params, key: v}, vev, work, full_steps=False,
                                  log=lambda m: None, threads=threads)
                scores[str(v)] = hmean(float(np.mean(list(r["final_acc"].values()))), r["G"])
                log(f"tune {label} {key}={v}: val H {scores[str(v)]:.2f}")
            doc["tuning"][label] = {"param": key, "grid": grid, "val_H": scores,
                                    "chosen": float(max(scores, key=scores.get))}
            save()
        for mode in modes:
            for which, order in (("visible", visible), ("heldout", held)):
                if any(r["label"] == label and r["mode"] == mode and r["set"] == which for r in doc["runs"]):
                    continue
                p = dict(params)
                if mode == "visible-tuned":
                    p[key] = doc["tuning"][label]["chosen"]
                choices: list[dict[str, Any]] = []
                fold_with = auto_folder(pol, p, experts, sts_file, threads, choices) if mode == "auto" else None
                log(f"{label} {mode} on {which}: {','.join(order)}")
                res = Q.fold_stream(order, experts, pol, p, ev, work, full_steps=False, log=log, threads=threads,
                                    fold_with=fold_with)
                strength = [c["chosen"] for c in choices] if choices else p.get(key)
                run = {"label": label, "policy": pol, "variant": var, "mode": mode, "set": which, "order": order,
                       "params": p, "strength": strength, "strength_param": key,
                       "strength_text": f"{key} " + (" → ".join(f"{v:g}" for v in strength) if choices else f"{strength:g}"),
                       "auto_choices": choices, "final": summary(order, res), "final_acc": res["final_acc"],
                       "diag": res["diag"]}
                log(f"  {label} {mode} {which}: ACC {run['final']['ACC']:.1f} G {run['final']['G']:.2f} "
                    f"H {run['final']['H']:.2f} ({run['strength_text']})")
                doc["runs"].append(run)
                save()
    shutil.rmtree(work, ignore_errors=True)
    log(f"done: {out / 'quality_heldout.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
