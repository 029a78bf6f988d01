"""GPU check: the same folds on ``--device cuda`` and on the CPU, compared and timed.

Run on a machine with a CUDA GPU (one short prepared script, as the streaming-core issue asks)::

    .venv/bin/python bench/gpu_check.py                # 1 GiB bf16 checkpoint (64 x 2048x4096)
    .venv/bin/python bench/gpu_check.py --tensors 8    # 128 MiB, a quick try

For each policy (Task Arithmetic, TIES, SAFE-Merge with few recovery steps, MDM-OC) it folds the
same expert into the same base in-process on the CPU and on CUDA, and reports the wall seconds of
each fold and the largest difference between the two outputs, in units in the last place (ULP)
of the storage dtype (0 for Task Arithmetic: the element-wise path does the same IEEE float32
operations on both). A table is printed and JSON written (``--json``). Without CUDA it says so and
exits 0 after the CPU folds (nothing to compare).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mergestream import engine  # noqa: E402
from mergestream.io.checkpoints import (
    TensorMeta,  # noqa: E402
    open_checkpoint,  # noqa: E402
)
from mergestream.io.writers import ModelWriter  # noqa: E402

POLICIES = {
    "task_arithmetic": {"lambda": 1.0},
    "ties": {"k": 20},
    "safe_merge": {"steps": 5},
    "mdm_oc": {"alpha": 0.3},
}


def make_models(root: Path, tensors: int, rows: int, cols: int) -> tuple[Path, Path]:
    """θ₀ ~ N(0, 0.02²) and an expert θ₀ + N(0, 0.002²), bf16, ``tensors`` matrices of rows x cols."""
    metas = [TensorMeta(f"model.layers.{i}.mlp.up_proj.weight", (rows, cols), torch.bfloat16) for i in range(tensors)]
    out = []
    for name, seed in (("base", 0), ("expert", 1)):
        folder = root / name
        folder.mkdir(parents=True)
        w = ModelWriter(folder, metas, {"format": "pt"})
        g0, g1 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(seed)
        for m in metas:
            t = torch.randn(m.shape, generator=g0) * 0.02
            if seed:
                t += torch.randn(m.shape, generator=g1) * 0.002
            w.write(m.name, t.to(torch.bfloat16))
        w.close()
        out.append(folder)
    return out[0], out[1]


def max_ulp(a: Path, b: Path) -> float:
    """Largest |a − b| over every tensor, in ULPs of the storage dtype at a's magnitude."""
    worst = 0.0
    with open_checkpoint(a) as ca, open_checkpoint(b) as cb:
        for name in ca.keys():
            x, y = ca.get(name), cb.get(name)
            if not x.is_floating_point():
                continue
            eps = torch.finfo(x.dtype).eps
            ulp = (x.float().abs() * eps).clamp_min(torch.finfo(x.dtype).tiny)
            worst = max(worst, float(((x.float() - y.float()).abs() / ulp).max()))
    return worst


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    p.add_argument("--json", type=Path, default=Path("gpu_check.json"))
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    root = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    rows = []
    try:
        base, expert = make_models(root, args.tensors, args.rows, args.cols)
        for policy in args.policies:
            row = {"policy": policy, "params": POLICIES[policy]}
            outs = {}
            for dev in ["cpu"] + (["cuda"] if cuda else []):
                out = root / f"{policy}-{dev}"
                t0 = time.perf_counter()
                engine.fold(base, None, expert, policy, POLICIES[policy], state_dir=root / f"s-{policy}-{dev}",
                            out=out, options=engine.ExecOptions(device=dev))
                if dev == "cuda":
                    torch.cuda.synchronize()
                row[f"{dev}_seconds"] = round(time.perf_counter() - t0, 2)
                outs[dev] = out
            if cuda:
                row["max_ulp_cuda_vs_cpu"] = max_ulp(outs["cpu"], outs["cuda"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{'policy':16s} {'cpu s':>8s} {'cuda s':>8s} {'max ULP':>8s}")
    for r in rows:
        print(f"{r['policy']:16s} {r['cpu_seconds']:8.2f} {r.get('cuda_seconds', float('nan')):8.2f} "
              f"{r.get('max_ulp_cuda_vs_cpu', float('nan')):8.2f}")
    doc = {"cuda": cuda, "device": torch.cuda.get_device_name(0) if cuda else None, "torch": torch.__version__,
           "tensors": args.tensors, "shape": [args.rows, args.cols], "rows": rows}
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    if not cuda:
        print("no CUDA device: CPU folds only, nothing compared")
    return 0


if __name__ == "__main__":
    sys.exit(main())
