"""SAFE-Merge's masked recovery loop, whole mask against column blocks: milliseconds per Adam step.

A recovery step's products C W and G = M⊙2RWᵀ gather one row of W (n, K) per kept entry, in random
column order; :mod:`mergestream.policies.recovery` cuts the mask into column blocks whose rows of W
fit in ``BLOCK_BYTES``. This times :func:`~mergestream.policies.recovery.fit_on_mask` (r = 16,
ρ = 0.1 random mask, on one thread, as a fold worker runs it) for matrices of the benchmark
checkpoints' shapes, at a first fold's K (k_new = 8) and a later fold's (k_new + k_old = 72), with
one block and with blocks of several budgets, in turn (each round times every variant once), and
checks that every variant gives the one-block losses within float tolerance.

    .venv/bin/python bench/recovery_blocks.py --json bench/results/recovery_blocks.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mergestream.policies import recovery  # noqa: E402

SHAPES = [(2048, 4096), (4096, 11008), (11008, 4096)]
#: budgets compared: one block (no limit), then bytes of W's rows per block
BUDGETS = [("one block", 1 << 62), ("128 KiB", 128 << 10), ("256 KiB (default)", 256 << 10), ("512 KiB", 512 << 10)]


def step_ms(m: int, n: int, k: int, budget: int, steps: int, seed: int = 0) -> tuple[float, list[float], int]:
    """Milliseconds per step of ``fit_on_mask`` on an (m, n) random mask with W (n, k), the losses
    and the number of blocks."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(m, n, generator=g) < 0.1
    w = torch.linalg.qr(torch.randn(n, k, generator=g))[0].contiguous()
    p = torch.randn(m, k, generator=g)
    a_t = (torch.randn(n, 16, generator=g) / 4).contiguous()
    b = torch.zeros(m, 16)
    old = recovery.BLOCK_BYTES
    recovery.BLOCK_BYTES = budget
    try:
        blocks = recovery.column_blocks(mask, k)
        start = time.perf_counter()
        losses = recovery.fit_on_mask(blocks, w, p, a_t, b, steps=steps, lr=1e-3)
        return (time.perf_counter() - start) / steps * 1e3, losses, len(blocks)
    finally:
        recovery.BLOCK_BYTES = old


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="rounds (median reported)")
    ap.add_argument("--steps", type=int, default=10, help="Adam steps per timing")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for m, n in SHAPES:
        for k in (8, 72):
            times: dict[str, list[float]] = {name: [] for name, _ in BUDGETS}
            counts: dict[str, int] = {}
            reference = None
            for _ in range(args.repeat):
                for name, budget in BUDGETS:
                    ms, losses, counts[name] = step_ms(m, n, k, budget, args.steps)
                    times[name].append(ms)
                    reference = reference or losses
                    assert all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(reference, losses)), (name, m, n, k)
            row = {"shape": [m, n], "K": k, "blocks": counts,
                   "ms_per_step": {name: {"min": min(v), "median": statistics.median(v), "max": max(v)}
                                   for name, v in times.items()}}
            rows.append(row)
            one = row["ms_per_step"]["one block"]["median"]
            cells = "  ".join(f"{name} [{counts[name]}]: {v['median']:7.2f} ({one / v['median']:.2f}x)"
                              for name, v in row["ms_per_step"].items())
            print(f"{m}x{n} K={k:<3} {cells}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"torch": torch.__version__, "threads": 1, "repeat": args.repeat,
                                         "steps": args.steps, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
