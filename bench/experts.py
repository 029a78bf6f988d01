"""Build (or find in the cache) the real MiniLM experts of the quality benchmark and the demo.

    .venv/bin/python bench/experts.py                 # the 8 stream tasks + the harmful expert
    .venv/bin/python bench/experts.py --tasks sms,r8  # any tasks of shared/data/tasks
    MERGESTREAM_CACHE=/tmp/experts .venv/bin/python bench/experts.py --no-harmful

Recipe, cache key and folder layout: see mergestream/experts.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from mergestream import experts as X  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default=",".join(X.STREAM_TASKS), help="comma-separated task names")
    ap.add_argument("--harmful", dest="harmful", action="store_true", default=True,
                    help=f"also build the harmful expert {X.HARMFUL_NAME} (default)")
    ap.add_argument("--no-harmful", dest="harmful", action="store_false")
    ap.add_argument("--cache", default=None, help="cache root (default $MERGESTREAM_CACHE or ~/.cache/mergestream/experts)")
    ap.add_argument("--data", default=None, help="shared data folder (default: ../shared/data of the checkout)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", action="store_true", help="print a JSON summary")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    specs = [X.ExpertSpec.for_task(t) for t in args.tasks.split(",") if t]
    if args.harmful:  # right after the first task: the demo needs it early
        specs.insert(min(1, len(specs)), X.ExpertSpec.harmful())
    rows = []
    t0 = time.perf_counter()
    for s in specs:
        folder = X.build_expert(s, cache=args.cache, data=args.data, log=lambda m: print(m, flush=True))
        meta = X.read_expert(folder)
        rows.append({"name": s.name, "task": s.task, "folder": str(folder), "test_accuracy": meta["test_accuracy"],
                     "sts_spearman": meta["sts_spearman"], "train_seconds": meta["train_seconds"]})
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'expert':<16}{'acc %':>8}{'STS':>8}{'train s':>9}  folder")
        for r in rows:
            print(f"{r['name']:<16}{r['test_accuracy']:>8.1f}{r['sts_spearman']:>8.2f}{r['train_seconds']:>9.0f}  {r['folder']}")
        real = [r for r in rows if r["name"] != X.HARMFUL_NAME]
        if real:
            print(f"mean test accuracy of {len(real)} task experts: {sum(r['test_accuracy'] for r in real) / len(real):.1f}%")
    print(f"total {time.perf_counter() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
