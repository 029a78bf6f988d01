"""The compiled loop of a bf16 linear fold (mergestream.engine.fused): milliseconds of one core per 1M
entries, first fold and later fold (θ_t and the per-entry tie/miss codes of format 3), and the torch
path's θ_t alone (``_fold_chunk_torch`` without the tie bits, for scale).

Each source tree given with ``--tree`` (default: this checkout) is timed in its own process
(``PYTHONPATH`` = that tree), so an older commit's loop can be measured beside the current one on
the same machine in the same run: ``git worktree add /tmp/before <rev>`` and pass both. Rounds run
in turn (every tree and path once per round); the table shows median (min-max) over the rounds.
Every tree's output is checked bit for bit against the torch path of the same process.

    .venv/bin/python bench/fused_kernel.py --tree /tmp/before --tree . \
        --json bench/results/fused_kernel.json --md bench/results/fused_kernel.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENTRIES = 1 << 20


def worker(reps: int) -> dict[str, list[float]]:
    """Time each path ``reps`` times on one thread in this process (the tree on sys.path)."""
    import numpy as np
    import torch

    from mergestream.engine import linear_fold, residuals

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    b = (torch.randn(ENTRIES, generator=g) * 0.02).bfloat16()
    p = (b.float() + torch.randn(ENTRIES, generator=g) * 1e-3).bfloat16()
    e = (b.float() + torch.randn(ENTRIES, generator=g) * 1e-3).bfloat16()
    lam, cpu = 0.3, torch.device("cpu")
    codes = np.empty(ENTRIES, np.uint8)

    def torch_path(prev):
        out = e.clone()
        linear_fold._fold_chunk_torch("w", out, b, prev, lam, cpu, None, 0, 0, "bench")
        return out

    def compiled(prev):
        out = e.clone()
        linear_fold.load_compiled(torch.bfloat16, cpu).fold_chunk(out, b, prev, lam, None if prev is None else codes)
        return out

    paths = {"compiled first": lambda: compiled(None), "compiled later": lambda: compiled(p),
             "torch first (θ_t only)": lambda: torch_path(None), "torch later (θ_t only)": lambda: torch_path(p)}
    for kind, prev in (("first", None), ("later", p)):
        assert torch.equal(residuals.bits(compiled(prev)), residuals.bits(torch_path(prev))), kind
    times: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(reps):
        for k, f in paths.items():
            t = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t) * 1e3)
    d, _ = residuals.task_vector_chunk(e.clone(), b, lam, cpu)
    out = compiled(p)  # the codes against the torch definition of a tie (subtract_delta)
    tie = (residuals.bits(residuals.subtract_delta(out, d, out.float())) != residuals.bits(p)).numpy()
    assert np.array_equal(codes.astype(bool), tie)
    return times


def label(tree: str) -> str:
    """``tree`` with its commit (and a mark when it has uncommitted changes)."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", tree, *a], capture_output=True, text=True).stdout.strip()
    rev = git("rev-parse", "--short", "HEAD")
    dirty = " + changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    return f"{tree} ({rev}{dirty})" if rev else tree


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=None, help="source tree to time (repeatable; default: this one)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds in turn over the trees")
    ap.add_argument("--reps", type=int, default=10, help="timings per path within a round (the round keeps its min)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--md", type=Path, default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.reps)))
        return 0
    trees = [str(Path(t).resolve()) for t in (args.tree or [str(ROOT)])]
    rows: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for tree in trees:
            env = {**os.environ, "PYTHONPATH": tree}
            out = subprocess.run([sys.executable, __file__, "--worker", "--reps", str(args.reps)], env=env,
                                 capture_output=True, text=True, check=True)
            for path, ms in json.loads(out.stdout.strip().splitlines()[-1]).items():
                rows.setdefault((tree, path), []).append(min(ms))
    lines = [f"# Compiled loop vs torch path, ms of one core per {ENTRIES:,} bf16 entries",
             "", f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
             f"{args.rounds} rounds in turn, each the min of {args.reps}; median (min-max) over rounds. "
             "Each timing includes a copy of the expert's chunk (the loop writes over it).", "",
             "| tree | path | ms per 1M entries |", "| --- | --- | ---: |"]
    result = []
    for (tree, path), vals in rows.items():
        med = statistics.median(vals)
        lines.append(f"| {label(tree)} | {path} | {med:.2f} ({min(vals):.2f}-{max(vals):.2f}) |")
        result.append({"tree": label(tree), "path": path, "ms_median": med, "ms_min": min(vals), "ms_max": max(vals),
                       "rounds": vals})
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"entries": ENTRIES, "rows": result}, indent=2) + "\n")
    if args.md:
        args.md.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
