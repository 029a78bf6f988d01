"""Daemon latency: from an expert's READY marker to its published version, against the CLI fold.

Issue 11's target: on the 1 GiB bf16 checkpoint of ``bench/fold_speed.py`` (Task Arithmetic,
data-free probes), READY → published ≤ 2x the wall time of ``mergestream fold`` on the same
inputs. Both are measured in the same run, in rounds (a CLI fold, then a daemon fold, repeated),
and each figure is the median over the rounds with min-max.

What each side includes:

- **CLI fold**: a fresh ``mergestream fold`` process (interpreter start and the torch import
  included), first fold (θ_{t−1} = θ₀), output and state fsynced.
- **daemon**: a fresh ``mergestream init`` deployment (the starter config: weight-space probes,
  MLflow tracking in sqlite, a patch per version), started and ready (``/readyz``) before the clock
  starts; then the expert folder is hard-linked into the inbox and its ``READY`` marker written
  (t₀); the clock stops when ``state/current`` points at the new version (t₁). That covers
  readiness detection, the kept copy, validation, the fold, the probes, the gate, the patch, the
  MLflow run and the atomic switch.

Run: ``.venv/bin/python bench/daemon_latency.py --size 1GB --repeat 3``; writes
``bench/results/daemon_latency.{json,md}`` (``--out DIR`` to write elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package: the model generator lives there)

REPO = Path(__file__).resolve().parent.parent
EXE = REPO / ".venv" / "bin" / "mergestream"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _current(state: Path) -> str | None:
    link = state / "current"
    try:
        return os.readlink(link)
    except OSError:
        return None


def cli_fold(base: Path, expert: Path, scratch: Path, lam: float) -> float:
    """Wall seconds of one ``mergestream fold`` (fresh process, fresh state and output)."""
    state, out = scratch / "cli-state", scratch / "cli-out"
    for p in (state, out):
        shutil.rmtree(p, ignore_errors=True)
    cmd = [str(EXE), "fold", "--base", str(base), "--expert", str(expert), "--policy", "task_arithmetic",
           "--set", f"lambda={lam}", "--state", str(state), "--out", str(out), "--quiet", "--json"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    seconds = time.perf_counter() - t0
    shutil.rmtree(state, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    return seconds


def daemon_fold(base: Path, expert: Path, scratch: Path, lam: float, timeout: float) -> dict[str, float]:
    """One daemon fold: seconds from READY to the switch of ``state/current`` (and the start-up)."""
    deploy = scratch / "deploy"
    shutil.rmtree(deploy, ignore_errors=True)
    subprocess.run([str(EXE), "init", str(deploy), "--base", str(base), "--policy", "task_arithmetic"],
                   check=True, capture_output=True)
    cfg = deploy / "config.yaml"
    port = _free_port()
    doc = yaml.safe_load(cfg.read_text())
    doc.setdefault("policy", {})["params"] = {"lambda": lam}
    doc.setdefault("metrics", {})["port"] = port
    cfg.write_text(yaml.safe_dump(doc))
    env = dict(os.environ)
    log = open(scratch / "daemon.log", "wb")
    t_start = time.perf_counter()
    proc = subprocess.Popen([str(EXE), "run", "--config", str(cfg)], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"daemon exited {proc.returncode}: see {scratch / 'daemon.log'}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.perf_counter() - t_start > timeout:
                raise TimeoutError("daemon not ready")
            time.sleep(0.05)
        startup = time.perf_counter() - t_start
        state = deploy / "state"
        before = _current(state)
        inbox_item = deploy / "inbox" / "expert-1"
        staging = deploy / "inbox" / ".expert-1"
        shutil.copytree(expert, staging, copy_function=os.link)  # hard links: no copy time on the clock
        staging.rename(inbox_item)
        t0 = time.perf_counter()
        (inbox_item / "READY").touch()
        while _current(state) == before:
            if proc.poll() is not None:
                raise RuntimeError(f"daemon exited {proc.returncode}: see {scratch / 'daemon.log'}")
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError("no version published")
            time.sleep(0.01)
        seconds = time.perf_counter() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    shutil.rmtree(deploy, ignore_errors=True)
    return {"ready_to_published_s": seconds, "startup_s": startup}


def _spread(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1GB", choices=sorted(common.SIZES))
    ap.add_argument("--repeat", type=int, default=3, help="rounds (each: one CLI fold, one daemon fold)")
    ap.add_argument("--lambda", dest="lam", type=float, default=0.3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/mergestream-bench"))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="folder for the JSON and md")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per fold before giving up")
    args = ap.parse_args(argv)

    base, expert, spec = common.ensure_models(args.workdir, args.size, "bfloat16")
    scratch = args.workdir / "daemon-latency"
    scratch.mkdir(parents=True, exist_ok=True)
    common.warm(common.weight_files(base) + common.weight_files(expert))
    cli, daemon, startup = [], [], []
    for i in range(args.repeat):
        cli.append(cli_fold(base, expert, scratch, args.lam))
        d = daemon_fold(base, expert, scratch, args.lam, args.timeout)
        daemon.append(d["ready_to_published_s"])
        startup.append(d["startup_s"])
        print(f"round {i + 1}: CLI fold {cli[-1]:.2f} s, daemon READY->published {daemon[-1]:.2f} s "
              f"(start-up {startup[-1]:.1f} s)", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    ratio = statistics.median(daemon) / statistics.median(cli)
    doc: dict[str, Any] = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "bench/daemon_latency.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "size": args.size, "model_bytes": sum(f.stat().st_size for f in common.weight_files(base)),
        "rounds": args.repeat, "cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg(),
        "cli_fold_s": _spread(cli), "daemon_ready_to_published_s": _spread(daemon),
        "daemon_startup_s": _spread(startup), "ratio_median": ratio, "samples": {"cli": cli, "daemon": daemon},
        "spec": spec,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "daemon_latency.json").write_text(json.dumps(doc, indent=2) + "\n")
    c, d = doc["cli_fold_s"], doc["daemon_ready_to_published_s"]
    md = [
        "# Daemon latency: READY marker to published version", "",
        f"Generated by `{doc['command']}`, {doc['when']}; {doc['cpus']} CPUs, load average at the end "
        f"{', '.join(f'{x:.2f}' for x in doc['load_avg_at_end'])}. See the script's docstring for what each "
        "side includes (the daemon: starter config of `mergestream init`, weight-space probes, MLflow in "
        "sqlite, a patch per version; the CLI: a fresh process including the torch import).", "",
        "| size | CLI fold s median (min-max) | daemon READY→published s median (min-max) | daemon / CLI | rounds |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| {args.size} | {c['median']:.2f} ({c['min']:.2f}-{c['max']:.2f}) | {d['median']:.2f} "
        f"({d['min']:.2f}-{d['max']:.2f}) | {ratio:.2f} | {args.repeat} |", "",
    ]
    (args.out / "daemon_latency.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
