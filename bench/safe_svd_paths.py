"""SAFE-Merge's two SVD paths on real experts: does the randomised path (with float32 or bfloat16
power-iteration products) keep the exact path's masks and merge quality?

Matrices with both sides over ``EXACT_MAX_SIDE`` (512) take randomised subspace iteration, and
there ``svd_products=auto`` multiplies in bfloat16 where the machine does so natively. MiniLM's
matrices are all at most 384 on one side, so ``bench/quality.py`` only ever measures the exact path.
This script lowers the threshold in-process so that the same real matrices take the randomised
path, then

1. per 2-D weight (not embeddings) of each expert: the fraction of the exact path's kept entries
   (risk mask, ρ 0.1, k = k_s = 64) that the randomised masks keep, float32 and bfloat16 products;
2. with ``--quality``: folds the experts in the file order with SAFE-Merge (the benchmark's λ 0.3)
   by each path and measures ACC, G and H with bench/quality.py's evaluator.

The experts are those of a ``quality.json`` (default bench/results/quality.json) that exist on this
machine; ``--tasks`` picks some. Prints tables and writes JSON + md with ``--out``.

    .venv/bin/python bench/safe_svd_paths.py --quality --out bench/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import quality  # noqa: E402  (evaluator, results folder: one home)
from common import recorded_command, recorded_path, resolved_path  # noqa: E402
from quality_report import hmean  # noqa: E402

from mergestream import experts as X  # noqa: E402
from mergestream.engine import ExecOptions, fold  # noqa: E402
from mergestream.policies import safe_merge as SM  # noqa: E402
from mergestream.policies.masks import magnitude_mask  # noqa: E402

#: (label, EXACT_MAX_SIDE, svd_products): the exact path and the randomised one both ways
PATHS = [("exact", SM.EXACT_MAX_SIDE, "float32"), ("randomised float32", 100, "float32"),
         ("randomised bfloat16", 100, "bfloat16")]


def risk_mask(tau: torch.Tensor, base: torch.Tensor, exact_max_side: int, products: str, rho: float = 0.1,
              k: int = 64) -> torch.Tensor:
    """SAFE-Merge's risk-aware mask (METHODS.md §safe_merge steps 1-4) of one (m, n) float32 τ, with
    the exact-SVD threshold and product dtype given; (m, n) bool."""
    low = torch.bfloat16 if products == "bfloat16" else None
    old = SM.EXACT_MAX_SIDE
    SM.EXACT_MAX_SIDE = exact_max_side
    try:
        u0, v0 = SM.top_singular(base, k, product_dtype=low)
        r = SM.risk_scores(tau, u0, v0, k, product_dtype=low).clone()
    finally:
        SM.EXACT_MAX_SIDE = old
    return magnitude_mask((1 - r) * tau.abs(), rho)


def mask_agreement(experts: dict[str, Path]) -> list[dict[str, Any]]:
    """One row per (expert, matrix): kept fraction of the exact mask in each randomised one."""
    base = load_file(X.base_model_path() / "model.safetensors")
    rows = []
    for task, path in experts.items():
        e = load_file(path / "model.safetensors")
        for name, b in base.items():
            if b.ndim != 2 or "embeddings" in name or min(b.shape) < 128 or name not in e:
                continue
            b = b.float()
            tau = e[name].float() - b
            masks = {label: risk_mask(tau, b, side, products) for label, side, products in PATHS}
            kept = float(masks["exact"].sum())
            row = {"task": task, "tensor": name, "shape": list(b.shape)}
            for label, _, _ in PATHS[1:]:
                row[label] = float((masks[label] & masks["exact"]).sum()) / kept
            row["bfloat16 vs float32"] = float((masks[PATHS[2][0]] & masks[PATHS[1][0]]).sum()) / float(
                masks[PATHS[1][0]].sum())
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from-json", default=str(quality.RESULTS / "quality.json"),
                    help="the quality.json whose experts, data and task order are used")
    ap.add_argument("--tasks", default=None, help="comma-separated subset (default: every expert found here)")
    ap.add_argument("--quality", action="store_true", help="also fold by each path and measure ACC, G, H")
    ap.add_argument("--lambda", dest="lam", type=float, default=0.3, help="SAFE-Merge's λ for --quality")
    ap.add_argument("--eval-examples", type=int, default=500)
    ap.add_argument("--sts-pairs", type=int, default=700)
    ap.add_argument("--data", type=Path, default=None,
                    help="task data folder (default: the quality.json's; its test rows are what --quality reads)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="folder for safe_svd_paths.{json,md}")
    args = ap.parse_args(argv)
    X._offline()
    torch.set_num_threads(args.threads)
    src = json.loads(Path(args.from_json).read_text())["protocol"]
    wanted = args.tasks.split(",") if args.tasks else src["tasks"]
    experts = {t: resolved_path(src["experts"][t]) for t in wanted if resolved_path(src["experts"][t]).exists()}
    if not experts:
        ap.error(f"none of the experts of {args.from_json} exist here; run bench/quality.py first")
    tasks = list(experts)
    t0 = time.perf_counter()
    rows = mask_agreement(experts)
    labels = [p[0] for p in PATHS[1:]] + ["bfloat16 vs float32"]
    summary = {lab: {"mean": statistics.fmean(r[lab] for r in rows), "min": min(r[lab] for r in rows)}
               for lab in labels}
    md = ["# SAFE-Merge's exact and randomised SVD paths on real experts", "",
          f"Generated by `.venv/bin/python bench/safe_svd_paths.py {' '.join(recorded_command(argv or sys.argv[1:]))}`. Experts of "
          f"`{recorded_path(args.from_json)}` found here: {', '.join(tasks)}. The randomised path is forced by lowering "
          f"EXACT_MAX_SIDE to 100 (MiniLM's matrices are 384 on one side, so the product runs the exact one); "
          f"machine: {torch.get_num_threads()} threads, bfloat16 native: "
          f"{SM.native_low_precision_dtype('cpu') is not None}.", "",
          f"## Risk masks (ρ 0.1, k = k_s = 64): kept entries of the reference mask also kept, over "
          f"{len(rows)} matrices ({time.perf_counter() - t0:.0f} s)", "",
          "| mask | against | mean | min |", "| --- | --- | ---: | ---: |"]
    for lab in labels:
        versus = "randomised float32" if lab == "bfloat16 vs float32" else "exact"
        md.append(f"| {lab.replace(' vs float32', '')} | {versus} | {summary[lab]['mean']:.4f} | "
                  f"{summary[lab]['min']:.4f} |")
    doc: dict[str, Any] = {"command": md[2], "tasks": tasks, "masks": rows, "mask_summary": summary}
    if args.quality:
        data = args.data or resolved_path(src["data"])
        ev = quality.Evaluator.on_test_rows(tasks, experts, data, args.eval_examples, args.sts_pairs)
        md += ["", f"## Quality after folding {', '.join(tasks)} in that order (λ {args.lam}; "
               f"{args.eval_examples} test rows per task, {args.sts_pairs} STS-B pairs)", "",
               "| path | ACC | G | H | fold s (mean) |", "| --- | ---: | ---: | ---: | ---: |"]
        doc["quality"] = []
        old = SM.EXACT_MAX_SIDE
        for label, side, products in PATHS:
            with tempfile.TemporaryDirectory(prefix="ms-svd-paths-") as work:
                SM.EXACT_MAX_SIDE = side
                prev, secs = None, []
                try:
                    for i, t in enumerate(tasks, 1):
                        s = time.perf_counter()
                        fold(X.base_model_path(), prev, experts[t], "safe_merge",
                             {"lambda": args.lam, "svd_products": products}, state_dir=f"{work}/state",
                             out=f"{work}/v{i}", expert_id=t, options=ExecOptions(threads=args.threads))
                        secs.append(time.perf_counter() - s)
                        prev = f"{work}/v{i}"
                finally:
                    SM.EXACT_MAX_SIDE = old
                accs, g = ev.measure(Path(prev), tasks)
            acc = statistics.fmean(accs.values())
            doc["quality"].append({"path": label, "ACC": acc, "G": g, "H": hmean(acc, g), "acc": accs,
                                   "fold_seconds": secs})
            md.append(f"| {label} | {acc:.2f} | {g:.2f} | {hmean(acc, g):.2f} | {statistics.fmean(secs):.1f} |")
    print("\n".join(md))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "safe_svd_paths.json").write_text(json.dumps(doc, indent=1))
        (args.out / "safe_svd_paths.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
