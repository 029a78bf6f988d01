"""Patch sizes on real experts: version-to-version patches in format 1, format 2 and format 2 + zstd.

Real all-MiniLM-L6-v2 experts (fp32, built and cached by :mod:`mergestream.experts`) are folded in
order with each policy; after every fold after the first, the patch from the previous version is
built in each format (:func:`mergestream.patches.build.build_patch`) and applied back
(:func:`mergestream.patches.apply_patch`) to check it rebuilds the version byte for byte. Each
row reports the mean patch bytes / model bytes over the folds. This is the quality benchmark's
patch/model column (bench/quality.py measures format 1 only) for all three encodings, on a
shorter stream.

Run: ``.venv/bin/python bench/patch_sizes.py`` (defaults: tasks sst2, agnews, trec, 1 epoch on 2,000
training rows each; about 10 minutes on 2 cores with a cold expert cache); writes
``bench/results/patch_sizes.{json,md}`` (``--out DIR`` to write elsewhere).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mergestream import engine  # noqa: E402
from mergestream import experts as X  # noqa: E402
from mergestream.patches import apply_patch, weights_sha256  # noqa: E402
from mergestream.patches.build import build_patch  # noqa: E402

#: (label, policy, params): the quality benchmark's defaults
POLICIES: list[tuple[str, str, dict[str, Any]]] = [
    ("task_arithmetic", "task_arithmetic", {"lambda": 0.3}),
    ("ties", "ties", {"lambda": 1.0, "k": 20}),
    ("safe_merge rho=0.1", "safe_merge", {"rho": 0.1, "lambda": 0.3}),
    ("safe_merge rho=0.1, no recovery", "safe_merge", {"rho": 0.1, "lambda": 0.3, "steps": 0}),
    ("mdm_oc", "mdm_oc", {"alpha": 0.3}),
    ("opcm", "opcm", {"alpha": 0.5}),
    ("magmax", "magmax", {"lambda": 0.5}),
]
FORMATS: list[tuple[str, int, int | None]] = [("format 1", 1, None), ("format 2", 2, None), ("format 2 + zstd", 2, 3)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="sst2,agnews,trec", help="comma-separated stream of tasks")
    ap.add_argument("--max-train", type=int, default=2000, help="training rows per expert (None: all)")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--cache", default=None, help="expert cache root (default: mergestream.experts')")
    args = ap.parse_args(argv)

    tasks = [t for t in args.tasks.split(",") if t]
    base = X.base_model_path()
    specs = [X.ExpertSpec.for_task(t, max_train=args.max_train, epochs=args.epochs) for t in tasks]
    folders = [X.build_expert(s, cache=args.cache, progress=False, evaluate=False, log=print) for s in specs]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="patch-sizes-") as tmp:
        work = Path(tmp)
        for label, policy, params in POLICIES:
            state, prev = work / "state", None
            ratios: dict[str, list[float]] = {f: [] for f, _, _ in FORMATS}
            t0 = time.perf_counter()
            for i, (spec, folder) in enumerate(zip(specs, folders)):
                out = work / f"v{i + 1}"
                engine.fold(base, prev, folder, policy, params, state_dir=state, out=out, expert_id=spec.name)
                if prev is not None:
                    for fname, fmt, level in FORMATS:
                        pfile = work / "patch.safetensors"
                        stats = build_patch(prev, out, pfile, source_version=str(i), target_version=str(i + 1),
                                            overwrite=True, patch_format=fmt, zstd_level=level)
                        rebuilt = work / "rebuilt"
                        apply_patch(prev, pfile, rebuilt)
                        if weights_sha256(rebuilt) != weights_sha256(out):
                            raise SystemExit(f"{label} {fname}: the patch does not rebuild version {i + 1}")
                        shutil.rmtree(rebuilt)
                        ratios[fname].append(stats["ratio"])
                    shutil.rmtree(prev)
                prev = out
            shutil.rmtree(state, ignore_errors=True)
            shutil.rmtree(prev, ignore_errors=True)
            row = {"label": label, "policy": policy, "params": params, "folds": len(folders),
                   "seconds": round(time.perf_counter() - t0, 1),
                   **{f: statistics.mean(r) for f, r in ratios.items()}, "samples": ratios}
            rows.append(row)
            print(f"{label}: " + ", ".join(f"{f} {row[f]:.3f}" for f, _, _ in FORMATS), flush=True)
    doc = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "command": "bench/patch_sizes.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "tasks": tasks, "max_train": args.max_train, "epochs": args.epochs, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "patch_sizes.json").write_text(json.dumps(doc, indent=2) + "\n")
    md = ["# Patch sizes on real MiniLM experts (patch bytes / model bytes, mean over the folds)", "",
          f"Generated by `{doc['command']}`, {doc['when']}. Stream: {', '.join(tasks)} "
          f"({args.epochs} epoch(s) on {args.max_train} training rows each); every patch is applied back and "
          "rebuilds its version's weights hash.", "",
          "| policy | " + " | ".join(f for f, _, _ in FORMATS) + " |",
          "| --- | " + " | ".join("---:" for _ in FORMATS) + " |"]
    md += [f"| {r['label']} | " + " | ".join(f"{r[f]:.3f}" for f, _, _ in FORMATS) + " |" for r in rows]
    (args.out / "patch_sizes.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
