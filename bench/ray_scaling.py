"""Folds on Ray against the local fold, in one long-lived driver, and the 70B plan through a simulated scheduler.

Part 1, measured (``run``). One driver process, as the daemon is one: a local Ray instance of
``--workers`` CPUs (bound to 127.0.0.1), warmed by a small fold so that its worker processes exist
and have imported torch (a daemon pays that once, not per fold). Both executors run with the CLI's
default ``--threads auto`` (the usable cores). Then, per size, in rounds (pairs in
turn, medians): the plain copy of the expert's weight files (the floor), the local fold, the Ray
fold. Per fold: the engine's seconds, the driver's peak RSS during the fold (sampled), the bytes the
driver received from the tasks (the executor's count of pickled results) against the model's bytes,
and the output's identity with the local fold. Writes JSON and prints a markdown table::

    .venv/bin/python bench/ray_scaling.py run --sizes 1GB 4GB --ta-only 4GB --rounds 3 \\
        --json bench/results/ray_scaling.json

Part 2, simulated (``simulate``): the 70B plan (Llama-3-70B's 723 tensors, bf16, the executor's own
grouping, :func:`mergestream.engine.executors.ray_cluster.group_target`) run through a discrete-event
model of the executor's scheduler (FIFO, at most 2 tasks per CPU in flight, the driver taking
results in order). A task costs its compute (the CPU seconds per byte the Ray tasks of part 1
spent, one CPU per task) plus its own storage traffic (θ₀, θ_{t−1},
the expert read, the output written: 4 bytes per byte of θ₀) at ``--worker-gbs`` per worker; the
driver's per-task cost is the metadata it receives (measured) at ``--driver-gbs``::

    .venv/bin/python bench/ray_scaling.py simulate bench/results/ray_scaling.json --workers 8 64 \\
        --worker-gbs 0.5 2

Timings are never asserted in tests; this machine is shared: read ratios, not seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GB, MIB, REPO, SIZES, LlamaShape, _log, ensure_models, weight_files  # noqa: E402

DEFAULT_JSON = REPO / "bench" / "results" / "ray_scaling.json"
LLAMA_70B = LlamaShape(hidden=8192, intermediate=28672, layers=80, vocab=128256, heads=64, kv_heads=8)
POLICIES = {"task_arithmetic": {"lambda": 0.3}, "safe_merge": {}}


class PeakRSS:
    """The peak RSS (MiB) of this process while the block runs, sampled every 20 ms."""

    def __enter__(self) -> PeakRSS:
        self.peak, self._stop = 0, threading.Event()
        proc = psutil.Process()

        def sample() -> None:
            while not self._stop.is_set():
                self.peak = max(self.peak, proc.memory_info().rss)
                time.sleep(0.02)

        self._t = threading.Thread(target=sample, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def _copy_floor(src: Path, dest: Path) -> float:
    t0 = time.perf_counter()
    dest.mkdir(parents=True, exist_ok=True)
    for f in weight_files(src):
        with open(f, "rb") as a, open(dest / f.name, "wb") as b:
            shutil.copyfileobj(a, b, 16 * MIB)
            b.flush()
            os.fsync(b.fileno())
    return time.perf_counter() - t0


def _fold(base: Path, expert: Path, policy: str, out: Path, executor: Any) -> dict[str, Any]:
    from mergestream import engine

    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(out.with_name(out.name + "-state"), ignore_errors=True)
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    with PeakRSS() as rss:
        rep = engine.fold(base, None, expert, policy, POLICIES[policy], state_dir=out.with_name(out.name + "-state"),
                          out=out, expert_id="e", options=engine.ExecOptions(threads=0, executor=executor))
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"seconds": rep.seconds, "driver_peak_rss_mib": rss.peak / MIB, "received_bytes": rep.received_bytes,
            "tasks": rep.tasks, "sha256": rep.sha256[0],
            "driver_cpu_s": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)}


def _same(a: Path, b: Path) -> bool:
    fa = sorted(p.name for p in a.iterdir() if p.is_file())
    return fa == sorted(p.name for p in b.iterdir() if p.is_file()) and \
        all((a / f).read_bytes() == (b / f).read_bytes() for f in fa if f.endswith(".safetensors"))


def run(args: argparse.Namespace) -> int:
    from mergestream.engine import LocalExecutor, make_executor

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    work = args.workdir
    ray_ex = make_executor("ray", num_cpus=args.workers)
    small_base, small_expert, _ = ensure_models(work, "50MB", "bfloat16")
    _log("warming the Ray workers (a 50MB fold)")
    _fold(small_base, small_expert, "task_arithmetic", work / "warm", ray_ex)
    rows: list[dict[str, Any]] = []
    for size in args.sizes:
        base, expert, _ = ensure_models(work, size, "bfloat16")
        model_bytes = sum(f.stat().st_size for f in weight_files(expert))
        policies = ["task_arithmetic"] if size in args.ta_only else list(args.policies)
        for policy in policies:
            rounds = args.rounds if policy == "task_arithmetic" else args.slow_rounds
            samples: dict[str, list[dict[str, Any]]] = {"floor": [], "local": [], "ray": []}
            for r in range(rounds):
                samples["floor"].append({"seconds": _copy_floor(expert, work / "floor")})
                shutil.rmtree(work / "floor", ignore_errors=True)
                samples["local"].append(_fold(base, expert, policy, work / "out-local", LocalExecutor()))
                samples["ray"].append(_fold(base, expert, policy, work / "out-ray", ray_ex))
                same = _same(work / "out-local", work / "out-ray") and \
                    samples["local"][-1]["sha256"] == samples["ray"][-1]["sha256"]
                _log(f"{size} {policy} round {r + 1}: floor {samples['floor'][-1]['seconds']:.2f} s, local "
                     f"{samples['local'][-1]['seconds']:.2f} s, ray {samples['ray'][-1]['seconds']:.2f} s "
                     f"(received {samples['ray'][-1]['received_bytes']} B), identical output: {same}")
                if not same:
                    raise SystemExit(f"{size} {policy}: the Ray output differs from the local one")
            med = {k: statistics.median(s["seconds"] for s in v) for k, v in samples.items()}
            # CPU seconds (the load-robust figure): the local driver's; the Ray driver's plus its tasks'
            cpu = {"local": statistics.median(s["driver_cpu_s"] for s in samples["local"]),
                   "ray": statistics.median(s["driver_cpu_s"] + sum(t[2] for t in s["tasks"]) for s in samples["ray"])}
            rows.append({"size": size, "model_bytes": model_bytes, "policy": policy, "workers": args.workers,
                         "rounds": rounds, "median_s": med, "samples": samples,
                         "ray_over_local": med["ray"] / med["local"], "cpu_s": cpu,
                         "received_bytes": max(s["received_bytes"] for s in samples["ray"]),
                         "driver_peak_rss_mib": {k: max(s["driver_peak_rss_mib"] for s in samples[k])
                                                 for k in ("local", "ray")},
                         "load_avg": os.getloadavg()})
    doc = {"generated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
           "command": " ".join(sys.argv), "rows": rows}
    for path in (args.json, args.workdir / "ray_scaling.json"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1))
    print(table(doc))
    return 0


def table(doc: dict[str, Any]) -> str:
    lines = ["| size | policy | floor s | local s | Ray s (workers) | Ray / local | CPU s local / Ray (driver + tasks) "
             "| received by the driver | driver peak RSS MiB local / Ray |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in doc["rows"]:
        m = r["median_s"]
        lines.append(f"| {r['size']} | {r['policy']} | {m['floor']:.2f} | {m['local']:.2f} | {m['ray']:.2f} ({r['workers']}) "
                     f"| {r['ray_over_local']:.2f} | {r['cpu_s']['local']:.1f} / {r['cpu_s']['ray']:.1f} "
                     f"| {r['received_bytes'] / 1024:.1f} KiB "
                     f"({100 * r['received_bytes'] / r['model_bytes']:.4f} %) "
                     f"| {r['driver_peak_rss_mib']['local']:.0f} / {r['driver_peak_rss_mib']['ray']:.0f} |")
    return "\n".join(lines)


def simulate_plan(sizes: list[int], workers: int, rate_s_per_byte: float, worker_gbs: float,
                  received_per_task: float, driver_gbs: float, io_factor: float = 4.0) -> dict[str, float]:
    """Makespan (s) of the executor's scheduler on tasks of ``sizes`` bytes of θ₀ (see the module docstring)."""
    from mergestream.engine.executors.ray_cluster import IN_FLIGHT_PER_CPU, group_target

    target = group_target(sum(sizes), workers)
    groups, cur = [], 0
    for b in sizes:
        cur += b
        if cur >= target:
            groups.append(cur)
            cur = 0
    groups += [cur] if cur else []
    free = [0.0] * workers  # when each worker is next free
    driver, in_flight, done = 0.0, [], []
    for g in groups:
        while len(in_flight) >= IN_FLIGHT_PER_CPU * workers:  # the driver waits for the oldest result
            driver = max(driver, in_flight.pop(0)) + received_per_task / (driver_gbs * GB)
        i = min(range(workers), key=free.__getitem__)
        start = max(free[i], driver)
        free[i] = start + g * rate_s_per_byte + io_factor * g / (worker_gbs * GB)
        in_flight.append(free[i])
        done.append(free[i])
    for t in in_flight:
        driver = max(driver, t) + received_per_task / (driver_gbs * GB)
    return {"tasks": len(groups), "makespan_s": driver, "driver_busy_s": len(groups) * received_per_task / (driver_gbs * GB)}


def simulate(args: argparse.Namespace) -> int:
    doc = json.loads(args.json.read_text())
    sizes = [math.prod(s) * 2 for _, s in LLAMA_70B.tensors()]
    total = sum(sizes)
    print(f"70B plan: {len(sizes)} tensors, {total / GB:.1f} GB bf16; storage per worker {args.worker_gbs} GB/s; "
          f"driver link {args.driver_gbs} GB/s (metadata only)\n")
    print("| policy | compute CPU s/GB (measured) | received per task | " +
          " | ".join(f"{w} workers @ {g} GB/s" for w in args.workers for g in args.worker_gbs) + " |")
    print("| --- | ---: | ---: | " + " | ".join("---:" for _ in args.workers for _ in args.worker_gbs) + " |")
    out = []
    for r in doc["rows"]:
        if r["size"] != args.from_size:
            continue
        tasks = [t for s in r["samples"]["ray"] for t in (s["tasks"] or [])]
        # compute per byte of θ₀: the tasks' CPU seconds (what the shared machine's load does not
        # inflate), one CPU per task; their storage traffic is the model's own term at --worker-gbs
        rate = sum(t[2] for t in tasks) / sum(t[0] for t in tasks)
        per_task = r["received_bytes"] / max(1, len(r["samples"]["ray"][0]["tasks"] or [1]))
        cells = []
        for w in args.workers:
            for g in args.worker_gbs:
                sim = simulate_plan(sizes, w, rate, g, per_task, args.driver_gbs)
                cells.append(f"{sim['tasks']} tasks, {sim['makespan_s'] / 60:.1f} min")
                out.append({"policy": r["policy"], "workers": w, "worker_gbs": g, **sim})
        print(f"| {r['policy']} | {rate * GB:.1f} | {per_task:.0f} B | " + " | ".join(cells) + " |")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure local vs Ray folds in one driver")
    r.add_argument("--sizes", nargs="+", default=["1GB"], choices=list(SIZES))
    r.add_argument("--ta-only", nargs="*", default=[], choices=list(SIZES), help="sizes that run Task Arithmetic only")
    r.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    r.add_argument("--workers", type=int, default=2, help="CPUs of the local Ray instance")
    r.add_argument("--rounds", type=int, default=3, help="rounds for Task Arithmetic")
    r.add_argument("--slow-rounds", type=int, default=1, help="rounds for SAFE-Merge")
    r.add_argument("--workdir", type=Path, default=Path("/tmp/msbench-ray"))
    r.add_argument("--json", type=Path, default=DEFAULT_JSON)
    s = sub.add_parser("simulate", help="the 70B plan through the scheduler model")
    s.add_argument("json", type=Path)
    s.add_argument("--from-size", default="1GB")
    s.add_argument("--workers", nargs="+", type=int, default=[8, 64])
    s.add_argument("--worker-gbs", nargs="+", type=float, default=[0.5, 2.0])
    s.add_argument("--driver-gbs", type=float, default=0.1, help="the driver's link for task results (GB/s)")
    s.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    return run(a) if a.cmd == "run" else simulate(a)


if __name__ == "__main__":
    raise SystemExit(main())
