"""Has merge quality moved since a git revision? The same experts folded by that revision's engine
and by the working tree's, the final backbones measured the same way.

Speed work must not move quality (issue 11: "the quality benchmark's H for each policy within 0.3
of today's"). The full benchmark (``bench/quality.py``) re-trains its experts whenever its protocol
changes, so its numbers from different days are not comparable; this script isolates the engine:
it takes the experts, data and task order of one ``quality.json``, folds them in the file order
with each policy's benchmark parameters at ``--rev`` (a ``git archive`` snapshot of ``mergestream/``
first on ``PYTHONPATH``, as ``bench/fold_speed.py --rev`` does) and at the working tree, each in a
fresh process, and measures both final models with ``bench/quality.py``'s evaluator (the same
seeded test rows and STS-B pairs). Prints a table and writes JSON + md.

    .venv/bin/python bench/quality_since.py --rev 204e266^ --out bench/results/quality_since
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (the --rev snapshot: one home)
import quality  # noqa: E402  (rows, evaluator, H: one home)
from quality_report import hmean  # noqa: E402

from mergestream import experts as X  # noqa: E402

#: folds one chain in a child process with whichever mergestream is first on sys.path
CHILD = r"""
import json, shutil, sys, time
from mergestream.engine import fold
job = json.loads(sys.argv[1])
try:  # the execution options as one record; a --rev snapshot from before them takes threads=
    from mergestream.engine import ExecOptions
    opts = {"options": ExecOptions(threads=job["threads"])}
except ImportError:
    opts = {"threads": job["threads"]}
prev, secs = None, []
for i, (task, path) in enumerate(job["experts"], 1):
    out = f"{job['work']}/v{i}"
    t0 = time.perf_counter()
    fold(job["base"], prev, path, job["policy"], job["params"], state_dir=f"{job['work']}/state", out=out,
         expert_id=task, **opts)
    secs.append(time.perf_counter() - t0)
    if prev is not None:
        shutil.rmtree(prev)
    prev = out
print(json.dumps({"final": prev, "seconds": secs}))
"""


def fold_chain(env: dict[str, str] | None, job: dict[str, Any]) -> dict[str, Any]:
    """Run :data:`CHILD` with ``env`` (None: the installed working tree); its JSON answer.

    Raises:
        RuntimeError: the child failed (its stderr tail is in the message).
    """
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(job)], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"fold chain failed ({job['policy']}): {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", required=True, help="the git revision to compare the working tree with")
    ap.add_argument("--from-json", default=str(quality.RESULTS / "quality.json"),
                    help="the quality.json whose experts, data and task order are used")
    ap.add_argument("--policies", default="task_arithmetic,ties,safe_merge,mdm_oc",
                    help="rows of bench/quality.py (their default parameters)")
    ap.add_argument("--eval-examples", type=int, default=500)
    ap.add_argument("--sts-pairs", type=int, default=700)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None, help="folder for quality_since.{json,md} (default: print only)")
    args = ap.parse_args(argv)
    X._offline()
    args.workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ms-since-"))
    src = json.loads(Path(args.from_json).read_text())["protocol"]
    tasks, data = src["tasks"], common.resolved_path(src["data"])
    experts = {t: common.resolved_path(src["experts"][t]) for t in tasks}
    rows = dict((p + v, params) for p, v, params in quality.POLICIES)
    wanted = [p for p in args.policies.split(",") if p]
    if missing := [p for p in wanted if p not in rows]:
        ap.error(f"unknown rows: {', '.join(missing)}")
    env_rev, info = common.mergestream_source(argparse.Namespace(rev=args.rev, workdir=args.workdir))

    ev = quality.Evaluator.on_test_rows(tasks, experts, data, args.eval_examples, args.sts_pairs)

    results = []
    for name in wanted:
        row: dict[str, Any] = {"row": name, "params": rows[name]}
        for side, env in (("rev", env_rev), ("head", None)):
            work = args.workdir / f"{name}-{side}"
            job = {"base": str(X.base_model_path()), "work": str(work), "policy": name.split("+")[0],
                   "params": rows[name], "experts": [[t, str(experts[t])] for t in tasks], "threads": args.threads}
            t0 = time.perf_counter()
            got = fold_chain(env, job)
            accs, g = ev.measure(Path(got["final"]), tasks)
            acc = statistics.fmean(accs.values())
            row[side] = {"ACC": acc, "G": g, "H": hmean(acc, g), "acc": accs, "fold_seconds": got["seconds"]}
            print(f"{name} at {side}: ACC {acc:.2f} G {g:.2f} H {row[side]['H']:.2f} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
            shutil.rmtree(work, ignore_errors=True)
        row["delta_H"] = row["head"]["H"] - row["rev"]["H"]
        results.append(row)

    doc = {"command": " ".join([".venv/bin/python", "bench/quality_since.py", *common.recorded_command(argv or sys.argv[1:])]),
           "rev": info, "tasks": tasks, "experts": {t: common.recorded_path(p) for t, p in experts.items()},
           "eval_examples": args.eval_examples, "sts_pairs": args.sts_pairs, "rows": results,
           "cpus": os.cpu_count()}
    md = ["# Merge quality at a revision vs the working tree", "",
          f"Generated by `{doc['command']}`. The experts of `{common.recorded_path(args.from_json)}` ({len(tasks)} tasks, file order "
          f"{', '.join(tasks)}) folded with each row's default parameters by mergestream at `{args.rev}` "
          f"({info.get('commit', '?')[:12]}) and by the working tree ({info.get('head', '?')[:12]}"
          f"{', uncommitted changes' if info.get('worktree_dirty') else ''}); final models measured with "
          f"bench/quality.py's evaluator ({args.eval_examples} test rows per task, {args.sts_pairs} STS-B pairs).", "",
          "| row | params | H at rev | H now | ΔH | ACC at rev | ACC now | G at rev | G now | fold s at rev | fold s now |",
          "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        a, b = r["rev"], r["head"]
        md.append(f"| {r['row']} | {', '.join(f'{k}={v}' for k, v in r['params'].items())} | {a['H']:.2f} | "
                  f"{b['H']:.2f} | {r['delta_H']:+.2f} | {a['ACC']:.2f} | {b['ACC']:.2f} | {a['G']:.2f} | "
                  f"{b['G']:.2f} | {statistics.fmean(a['fold_seconds']):.1f} | {statistics.fmean(b['fold_seconds']):.1f} |")
    print("\n".join(md[4:]))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "quality_since.json").write_text(json.dumps(doc, indent=1))
        (args.out / "quality_since.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
