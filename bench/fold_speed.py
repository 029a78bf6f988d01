"""Fold speed benchmark: mergestream's policies against mergekit and a plain-copy floor.

For each model size this script

1. generates (once, cached under ``--workdir``) two synthetic Llama-shaped Hugging Face folders,
   ``base`` (θ₀) and ``expert`` (θ₀ + small noise), with a ``config.json`` for
   ``LlamaForCausalLM`` and safetensors weights (bf16 by default; sharded with an index when a
   model exceeds 1 GiB);
2. times ``mergestream fold`` (a first fold: backbone = base) for each policy, each in a fresh
   child process with a fresh state and output folder; for Task Arithmetic and SAFE-Merge also a
   later fold (the same expert folded onto the output of an untimed first fold: SAFE-Merge's
   later folds add the L_old term, whose W is k_new + k_old = 72 columns wide instead of 8);
3. times ``mergekit-yaml`` with ``task_arithmetic`` (weight 1, lambda 0.3) and ``ties``
   (density 0.2, weight 1, lambda 1) on the same inputs, from a separate virtual environment;
4. times the floor: read base and expert once, then copy the base's weight files to a new folder
   (``shutil.copyfile``), once with and once without ``fsync``.

Every row records wall seconds of the child process (interpreter start and imports included),
input GB/s = (base bytes + expert bytes) / seconds (the *logical* input, whatever a tool re-reads),
the child's peak RSS (``ru_maxrss`` as reported by GNU ``time -f %M`` wrapped around that very
child, so rows never leak into each other, nor this driver's own memory), and the bytes the run
left on disk (output + policy state). mergestream rows also keep the engine's own in-process
seconds from ``fold --json``. ``--repeat N`` (default 3) runs every row N times, in rounds over the
rows of a size (so the rows compared are measured side by side, pairs in turn), and reports the
median with min and max; ``--repeat-slow`` sets N for SAFE-Merge and MDM-OC.

The machine may be shared (2 cores here; tests may run next to the benchmark). Each row also
records the child's CPU seconds and the average number of cores that everything else kept busy
during the run ("other load", from ``/proc/stat``); before each run the driver waits up to
``--wait-idle`` seconds for the machine to go quiet. Treat rows with a high other load as suspect.

Page cache: we cannot drop it (no root assumed), so every row runs warm instead: the inputs are
read once right before each timed run. Note that mmap-based readers (mergekit) count resident
file pages in RSS, while mergestream reads with ``pread`` and does not.

mergestream's output and state are fsynced; mergekit does not fsync. Compare mergestream with the
"fsync" floor and mergekit with the "no fsync" floor.

SAFE-Merge runs 25 Adam steps per 2-D tensor by default. When its time on a smaller size,
scaled by model bytes, predicts more than ``--safe-budget`` seconds on a larger size, the larger
size runs with proportionally fewer steps and the ``params`` column says so.

How to run (from the repository root)::

    # smoke run: ~50 MB model, SAFE-Merge at 5 steps; about a minute on an idle 2-core
    # machine once mergekit is installed
    .venv/bin/python bench/fold_speed.py --quick

    # the real run: 0.5 GB and 2 GB (tens of minutes on 2 cores; run it in the background),
    # on a snapshot of the last commit so that concurrent edits cannot change what is measured
    nohup .venv/bin/python bench/fold_speed.py --sizes 0.5GB 2GB --rev HEAD > /tmp/fold_speed.log 2>&1 &

    # a subset
    .venv/bin/python bench/fold_speed.py --sizes 0.5GB --policies task_arithmetic ties --no-mergekit

    # an interrupted run: keep the rows already in the JSON, measure the rest
    .venv/bin/python bench/fold_speed.py --sizes 0.5GB 2GB --rev HEAD --resume

mergekit lives in its own virtual environment (default ``/tmp/mergekit-venv``). The script
creates it on demand; by hand::

    python -m venv /tmp/mergekit-venv
    /tmp/mergekit-venv/bin/pip install -c constraints.txt torch==2.13.0 mergekit

If mergekit cannot be installed or fails, its rows record the reason instead of a time.

Ray rows (``--executor ray --workers 1 2``): besides the local rows, each mergestream policy row
is measured again with ``fold --executor ray`` on a local Ray cluster of N worker CPUs that this
script starts (``ray start --head --num-cpus N``, outside the timed child, as a deployed cluster
would be running already) and stops after the row; the child joins it with ``--ray-address``. The
JSON keeps each Ray task's (bytes, seconds) and the bytes the driver received. These rows are cold
CLI folds (joining the cluster and starting its workers are in the time); the warm comparison a
daemon sees, and the 70B projection, are bench/ray_scaling.py's (bench/results/ray_scaling.md)::

    .venv/bin/python bench/fold_speed.py --sizes 1GB --policies task_arithmetic safe_merge \
        --executor ray --workers 1 2 --no-mergekit --no-floor --repeat 1 --workdir /tmp/msbench-ray \
        --json bench/results/ray_scaling.json --md /tmp/msbench-ray/ray_scaling_table.md

Output: a plain table on stdout and JSON in ``bench/results/fold_speed.json`` (rewritten after
every row, so an interrupted run keeps what it measured). Generated models, outputs and logs stay
under ``--workdir`` (default ``/tmp/mergestream-bench``), never in the repository.

The model generator, the measurement of a child process and the ``--rev`` snapshot live in
``bench/common.py``, shared with the other benchmarks.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402  (bench/ is not a package: the shared benchmark helpers live there)
    BASE_STD,
    CONSTRAINTS,
    DEFAULT_MERGESTREAM,
    DEFAULT_WORKDIR,
    EXPERT_STD,
    GB,
    GNU_TIME,
    MIB,
    REPO,
    SIZES,
    Measured,
    _log,
    _pip_version,
    ensure_models,
    mergestream_source,
    recorded_command,
    run_measured,
    tree_bytes,
    wait_for_idle,
    warm,
    weight_files,
)

DEFAULT_JSON = REPO / "bench" / "results" / "fold_speed.json"
DEFAULT_MD = REPO / "bench" / "results" / "fold_speed.md"
DEFAULT_MERGEKIT_VENV = Path("/tmp/mergekit-venv")

POLICIES = ("task_arithmetic", "ties", "safe_merge", "mdm_oc")
#: parameters shown in the table's ``params`` column (all of them go to the JSON).
SHOWN_PARAMS = {
    "task_arithmetic": ("lambda",),
    "ties": ("k", "lambda"),
    "safe_merge": ("steps", "rank", "rho", "lambda"),
    "mdm_oc": ("alpha", "rank"),
}
SAFE_DEFAULT_STEPS = 50


# ------------------------------------------------------------------------------------------
# Rows
# ------------------------------------------------------------------------------------------
@dataclass
class Row:
    """One line of the table (and one object in the JSON)."""

    size: str
    tool: str
    policy: str
    params: str
    model_bytes: int
    input_bytes: int
    seconds: float | None = None
    input_gb_s: float | None = None
    peak_rss_mib: float | None = None
    written_bytes: int | None = None
    cpu_seconds: float | None = None
    other_cores: float | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def fill(self, m: Measured) -> None:
        self.seconds = round(m.seconds, 3)
        self.input_gb_s = round(self.input_bytes / GB / m.seconds, 3) if m.seconds > 0 else None
        self.peak_rss_mib = round(m.peak_rss_bytes / MIB, 1)
        self.cpu_seconds = m.cpu_seconds
        self.other_cores = m.other_cores


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(rows: list[Row]) -> str:
    """The plain table: one line per row; failed rows show ``failed`` and a footnote."""
    head = ["size", "model GB", "tool", "policy", "params", "seconds", "in GB/s", "peak RSS MiB", "written GB",
            "CPU s", "other load"]
    lines = []
    notes = []
    for r in rows:
        if r.error:
            notes.append(f"[{len(notes) + 1}] {r.tool} {r.policy} @ {r.size}: {r.error}")
            secs = f"failed[{len(notes)}]"
        else:
            secs = _fmt(r.seconds, ".2f") + ("*" if r.extra.get("contended") else "")
            sp = r.extra.get("spread", {}).get("seconds")
            if sp and len(r.extra.get("samples", [])) > 1:
                secs += f" ({sp['min']:.2f}-{sp['max']:.2f})"
        lines.append([r.size, f"{r.model_bytes / GB:.3f}", r.tool, r.policy, r.params, secs,
                      _fmt(r.input_gb_s, ".3f"), _fmt(r.peak_rss_mib, ".0f"),
                      "-" if r.written_bytes is None else f"{r.written_bytes / GB:.2f}",
                      _fmt(r.cpu_seconds, ".1f"), _fmt(r.other_cores, ".2f")])
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(head)]
    right = {1, 5, 6, 7, 8, 9, 10}

    def render(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [render(head), render(["-" * w for w in widths])] + [render(line) for line in lines]
    if any(r.extra.get("contended") for r in rows):
        notes.append("* every try of this row ran while other processes kept the CPUs busy (other load)")
    return "\n".join(out + ([""] + notes if notes else []))


# ------------------------------------------------------------------------------------------
# The three kinds of run
# ------------------------------------------------------------------------------------------
def run_floor(ctx: SizeContext, fsync: bool) -> Row:
    """Read base + expert, then copy the base's weight files to a new folder (the floor)."""
    row = ctx.row("floor", "read+copy", "fsync" if fsync else "no fsync")
    out = ctx.scratch / f"floor-{'fsync' if fsync else 'nofsync'}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "_floor", str(out), "--copy",
           *map(str, weight_files(ctx.base))]
    if fsync:
        cmd.append("--fsync")
    cmd += ["--read", *map(str, ctx.inputs)]
    row.extra["waited_for_idle_s"] = round(ctx.prepare(), 1)
    m = run_measured(cmd, ctx.logs, f"{ctx.size}-floor-{'fsync' if fsync else 'nofsync'}", timeout=ctx.args.timeout)
    row.written_bytes = tree_bytes(out)
    if m.returncode != 0:
        row.error = f"exit {m.returncode}: {m.tail()}"
    else:
        row.fill(m)
    shutil.rmtree(out, ignore_errors=True)
    return row


def floor_child(argv: list[str]) -> int:
    """The floor's child process: ``_floor OUT --read FILE... --copy FILE... [--fsync]``."""
    p = argparse.ArgumentParser(prog="fold_speed.py _floor")
    p.add_argument("out", type=Path)
    p.add_argument("--read", nargs="+", type=Path, required=True)
    p.add_argument("--copy", nargs="+", type=Path, required=True)
    p.add_argument("--fsync", action="store_true")
    a = p.parse_args(argv)
    buf = bytearray(16 * MIB)
    for f in a.read:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    a.out.mkdir(parents=True)
    for f in a.copy:
        dest = a.out / f.name
        shutil.copyfile(f, dest)
        if a.fsync:
            fd = os.open(dest, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    return 0


class RayHead:
    """A local Ray cluster of ``cpus`` worker CPUs for the Ray rows (``ray start --head --block``),
    stopped (its process group terminated) on exit."""

    def __init__(self, cpus: int, logs: Path):
        self.cpus, self.logs = cpus, logs
        self.proc: subprocess.Popen | None = None
        self.address = ""

    def __enter__(self) -> RayHead:
        ray_exe = Path(sys.executable).parent / "ray"
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        self.logs.mkdir(parents=True, exist_ok=True)
        log = (self.logs / f"ray-head-{self.cpus}.log").open("w")
        # a loopback-only throwaway cluster: no token (Ray >= 2.5x enables token auth on `ray start`)
        # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: Ray keeps 127.0.0.1 instead of the machine's address
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        self.proc = subprocess.Popen([str(ray_exe), "start", "--head", "--block", f"--port={port}",
                                      "--node-ip-address=127.0.0.1", f"--num-cpus={self.cpus}",
                                      "--include-dashboard=false", "--disable-usage-stats"],
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env)
        deadline = time.time() + 120
        while time.time() < deadline:
            ok = subprocess.run([str(ray_exe), "status", f"--address={self.address}"], capture_output=True, check=False,
                                env=self.env)
            if ok.returncode == 0:
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(1)
        self.__exit__()
        raise RuntimeError(f"Ray head did not start; see {self.logs}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def run_mergestream_ray(ctx: SizeContext, policy: str, sets: dict[str, str], note: str, workers: int) -> Row:
    """One fold with ``--executor ray`` on a fresh local Ray cluster of ``workers`` CPUs."""
    with RayHead(workers, ctx.logs) as head:
        return run_mergestream(ctx, policy, sets, note, ray=head)


def run_mergestream(ctx: SizeContext, policy: str, sets: dict[str, str], note: str = "", later: bool = False,
                    ray: RayHead | None = None) -> Row:
    """One fold with ``mergestream fold`` in a fresh state and output folder: the first fold, or
    (``later``) a second fold onto the output of an untimed first fold (θ_{t−1} ≠ θ₀); with
    ``ray``, joined to that Ray cluster (``--executor ray``)."""
    tag = f"{ctx.size}-mergestream-{policy}" + ("-later" if later else "") + (f"-ray{ray.cpus}" if ray else "")
    state, out, first = ctx.scratch / f"{tag}-state", ctx.scratch / f"{tag}-out", ctx.scratch / f"{tag}-first"
    for p in (state, out, first):
        shutil.rmtree(p, ignore_errors=True)
    setargs = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    common = [str(ctx.args.mergestream), "fold", "--base", str(ctx.base), "--expert", str(ctx.expert),
              "--policy", policy, "--state", str(state), "--threads", str(ctx.args.threads), "--quiet", *setargs]
    if later:
        subprocess.run([*common, "--out", str(first), "--id", "first"], check=True, capture_output=True,
                       env=ctx.args.mergestream_env)
        common += ["--backbone", str(first), "--id", "second"]
    if ray is not None:
        common += ["--executor", "ray", "--ray-address", ray.address]
    cmd = [*common, "--out", str(out), "--json"]
    row = ctx.row("mergestream-ray" if ray else "mergestream", policy + (" (later fold)" if later else ""), "")
    row.extra["waited_for_idle_s"] = round(ctx.prepare(), 1)
    env = ctx.args.mergestream_env
    if ray is not None:
        env = {**(env or os.environ), "RAY_AUTH_MODE": "disabled"}
    state_before = tree_bytes(state) if state.exists() else 0  # a later fold: the first fold's state is there
    m = run_measured(cmd, ctx.logs, tag, env=env, timeout=ctx.args.timeout)
    row.written_bytes = tree_bytes(state, out) - state_before
    row.extra["output_bytes"] = tree_bytes(out)
    row.extra["state_bytes"] = tree_bytes(state)
    row.extra["state_bytes_before"] = state_before
    row.extra["command"] = recorded_command(cmd)
    row.extra["mergestream_source"] = ctx.args.mergestream_source
    if m.returncode != 0 or m.timed_out:
        row.error = "timed out" if m.timed_out else f"exit {m.returncode}: {m.tail()}"
    else:
        row.fill(m)
        try:
            report = json.loads(m.stdout.read_text())
        except ValueError:
            report = {}
        params = report.get("params", {})
        row.extra.update(engine_seconds=report.get("seconds"), report_bytes_read=report.get("bytes_read"),
                         report_bytes_written=report.get("bytes_written"), policy_params=params,
                         stats=report.get("stats"))
        shown = [f"{k}={params[k]:g}" if isinstance(params.get(k), float) else f"{k}={params.get(k)}"
                 for k in SHOWN_PARAMS.get(policy, ()) if k in params]
        row.params = " ".join(shown) + (f" ({note})" if note else "")
        if ray is not None:
            row.params += f" workers={ray.cpus}"
            row.extra.update(ray_workers=ray.cpus, ray_tasks=report.get("tasks"),
                             ray_received_bytes=report.get("received_bytes"))
    shutil.rmtree(state, ignore_errors=True)
    shutil.rmtree(first, ignore_errors=True)
    if later:
        shutil.rmtree(out, ignore_errors=True)
    else:
        ctx.keep_or_drop(f"mergestream-{policy}", out)
    return row


MERGEKIT_METHODS = {
    # ours: Δ = λ·τ with λ = 0.3
    "task_arithmetic": ({"weight": 1.0}, {"lambda": 0.3}),
    # ours: trim to top 20 %, λ = 1 (one expert: sign election and the disjoint mean are identities)
    "ties": ({"density": 0.2, "weight": 1.0}, {"lambda": 1.0}),
}


def mergekit_config(method: str, base: Path, expert: Path, out_dtype: str) -> str:
    """A mergekit YAML config: float32 math, output in the checkpoints' dtype (as mergestream)."""
    model_params, shared = MERGEKIT_METHODS[method]
    lines = [f"merge_method: {method}", f"base_model: {base}", "models:", f"  - model: {expert}",
             "    parameters:"]
    lines += [f"      {k}: {v}" for k, v in model_params.items()]
    lines += ["parameters:"] + [f"  {k}: {v}" for k, v in shared.items()]
    lines += ["dtype: float32", f"out_dtype: {out_dtype}"]
    return "\n".join(lines) + "\n"


def ensure_mergekit(args: argparse.Namespace) -> tuple[Path | None, str | None]:
    """Find ``mergekit-yaml`` in the mergekit venv, creating the venv if allowed.

    Returns:
        (path to mergekit-yaml, None) or (None, why it is unavailable).
    """
    exe = args.mergekit_venv / "bin" / "mergekit-yaml"
    if exe.exists():
        return exe, None
    if args.no_install:
        return None, f"{exe} not found (--no-install)"
    _log(f"installing mergekit into {args.mergekit_venv} (a few minutes)")
    log = args.workdir / "logs" / "mergekit-install.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    pip = [str(args.mergekit_venv / "bin" / "pip"), "install", "torch==2.13.0", "mergekit"]
    if CONSTRAINTS.is_file():
        pip[2:2] = ["-c", str(CONSTRAINTS)]
    with open(log, "wb") as fh:
        for cmd in ([sys.executable, "-m", "venv", str(args.mergekit_venv)], pip):
            rc = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT)
            if rc != 0:
                tail = log.read_text(errors="replace")[-800:].strip()
                return None, f"`{' '.join(cmd)}` exited {rc}: {tail}"
    return (exe, None) if exe.exists() else (None, f"installed, but {exe} is missing")


def run_mergekit(ctx: SizeContext, method: str, exe: Path | None, why: str | None) -> Row:
    """One ``mergekit-yaml`` run on the same base and expert."""
    model_params, shared = MERGEKIT_METHODS[method]
    row = ctx.row("mergekit", method, " ".join(f"{k}={v:g}" for k, v in {**model_params, **shared}.items()))
    if exe is None:
        row.error = f"mergekit unavailable: {why}"
        return row
    tag = f"{ctx.size}-mergekit-{method}"
    out = ctx.scratch / f"{tag}-out"
    shutil.rmtree(out, ignore_errors=True)
    cfg = ctx.scratch / f"{tag}.yml"
    cfg.write_text(mergekit_config(method, ctx.base, ctx.expert, ctx.args.dtype))
    cmd = [str(exe), str(cfg), str(out), "--no-copy-tokenizer", "--no-write-model-card", "--quiet",
           "--out-shard-size", "5B"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    row.extra["command"] = recorded_command(cmd)
    row.extra["config"] = cfg.read_text()
    row.extra["waited_for_idle_s"] = round(ctx.prepare(), 1)
    m = run_measured(cmd, ctx.logs, tag, env=env, timeout=ctx.args.timeout)
    row.written_bytes = tree_bytes(out)
    if m.returncode != 0 or m.timed_out:
        row.error = "timed out" if m.timed_out else f"exit {m.returncode}: {m.tail()}"
    else:
        row.fill(m)
    ctx.keep_or_drop(f"mergekit-{method}", out)
    return row


# ------------------------------------------------------------------------------------------
# Agreement between the two tools' outputs (a sanity check that the configs are comparable)
# ------------------------------------------------------------------------------------------
PROBE_TENSORS = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight")


def _read_tensor(folder: Path, name: str):
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = [folder / json.loads(index.read_text())["weight_map"][name]]
    else:
        files = weight_files(folder)
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            if name in fh.keys():
                return fh.get_tensor(name).float()
    raise KeyError(f"{name} not in {folder}")


def compare_outputs(base: Path, ours: Path, theirs: Path) -> dict[str, Any]:
    """Per probe tensor: max |ours − theirs| and ‖ours − theirs‖ / ‖ours − θ₀‖."""
    out: dict[str, Any] = {}
    for name in PROBE_TENSORS:
        try:
            a, b, t0 = _read_tensor(ours, name), _read_tensor(theirs, name), _read_tensor(base, name)
        except (KeyError, OSError, ValueError) as exc:
            out[name] = {"error": str(exc)}
            continue
        d = (a - b)
        out[name] = {"max_abs_diff": float(d.abs().max()), "equal_fraction": float((a == b).float().mean()),
                     "rel_diff_of_delta": float(d.norm() / (a - t0).norm().clamp_min(1e-30))}
    return out


# ------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------
@dataclass
class SizeContext:
    """Everything one size's runs share."""

    size: str
    args: argparse.Namespace
    base: Path
    expert: Path
    inputs: list[Path]
    model_bytes: int
    scratch: Path
    logs: Path
    kept: dict[str, Path] = field(default_factory=dict)

    def row(self, tool: str, policy: str, params: str) -> Row:
        input_bytes = sum(f.stat().st_size for f in self.inputs)
        return Row(self.size, tool, policy, params, self.model_bytes, input_bytes)

    def prepare(self) -> float:
        """Right before a timed run: warm the page cache, then wait for the machine to be idle."""
        warm(self.inputs)
        return wait_for_idle(self.args.wait_idle) if self.args.wait_idle > 0 else 0.0

    def keep_or_drop(self, key: str, out: Path) -> None:
        """Keep TA/TIES outputs of both tools for the agreement check; delete everything else."""
        if key.split("-", 1)[1] in MERGEKIT_METHODS and out.exists():
            self.kept[key] = out
        elif not self.args.keep_outputs:
            shutil.rmtree(out, ignore_errors=True)

    def cleanup(self) -> None:
        if not self.args.keep_outputs:
            for p in self.kept.values():
                shutil.rmtree(p, ignore_errors=True)
            self.kept.clear()


def row_key(size: str, tool: str, policy: str, params: str) -> tuple[str, str, str, str]:
    """What identifies a row across runs (the floor has two rows, told apart by their params; Ray
    rows by their ``workers=N``)."""
    if tool == "mergestream-ray":
        return size, tool, policy, params.rsplit(" ", 1)[-1]
    return size, tool, policy, params if tool == "floor" else ""


class Results:
    """The JSON document, rewritten after every row."""

    def __init__(self, path: Path, args: argparse.Namespace):
        self.path = path
        self.doc: dict[str, Any] = {
            "benchmark": "fold_speed",
            "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "argv": sys.argv,
            "machine": machine_info(args),
            "notes": [
                "seconds: wall time of the child process, interpreter start and imports included",
                "input GB/s: (base bytes + expert bytes) / seconds, 1 GB = 1e9 bytes",
                "peak RSS: ru_maxrss of the measured process (GNU time -f %M; without it, os.wait4, "
                "which includes this driver's RSS at fork); mmap-resident file pages count",
                "with --repeat N, each row is the median of N runs made in rounds over the rows of its "
                "size (min/median/max in extra.spread, every run in extra.samples)",
                "page cache warm for every row: inputs are read once before each timed run",
                "mergestream fsyncs its output and state; mergekit does not",
                "written GB: bytes the run added on disk (output + policy state folder; a later fold: less the state the first fold left)",
                "CPU s: user + system seconds of the measured process tree",
                "other load: average cores kept busy by everything else during the run (other "
                "processes, kernel writeback); the machine may be shared, and before each run the "
                "driver waits up to --wait-idle s for it to go quiet",
                f"synthetic models: base ~ N(0, {BASE_STD}^2), expert = base + N(0, {EXPERT_STD}^2), "
                f"norm weights 1 (+noise); dtype {args.dtype}",
            ],
            "models": {},
            "rows": [],
            "agreement": {},
        }
        self.rows: list[Row] = []

    def add(self, row: Row, quiet: bool = False) -> None:
        self.rows.append(row)
        self.doc["rows"] = [asdict(r) for r in self.rows]
        self.save()
        if quiet:
            return
        status = row.error.splitlines()[0][:200] if row.error else (
            f"{row.seconds:.2f} s, {row.input_gb_s:.3f} GB/s, {row.peak_rss_mib:.0f} MiB")
        _log(f"{row.size} {row.tool} {row.policy} [{row.params}]: {status}")

    def resume(self, source: str) -> dict[tuple[str, str, str, str], Row]:
        """Successful rows of an earlier run of the same JSON file, by :func:`row_key`.

        mergestream rows are kept only when they measured the same code (``source``: a commit, or
        the working tree at a HEAD); a dirty working tree never matches. The earlier file's model
        descriptions and agreement checks are carried over too.
        """
        if not self.path.is_file():
            return {}
        old = json.loads(self.path.read_text())
        self.doc["resumed"] = {"started": old.get("started"), "argv": old.get("argv")}
        self.doc["models"].update(old.get("models", {}))
        self.doc["agreement"].update(old.get("agreement", {}))
        rows = [Row(**r) for r in old.get("rows", []) if not r.get("error")]
        rows = [r for r in rows if r.tool != "mergestream" or (
            r.extra.get("mergestream_source") == source and not source.endswith("+dirty"))]
        return {row_key(r.size, r.tool, r.policy, r.params): r for r in rows}

    def save(self) -> None:
        self.doc["finished"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.doc, indent=2) + "\n")
        os.replace(tmp, self.path)


def machine_info(args: argparse.Namespace) -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                            "cpus": os.cpu_count(), "mergestream_threads": args.threads,
                            "rss_method": "GNU time -f %M" if GNU_TIME else "os.wait4 (includes driver RSS at fork)"}
    try:
        with open("/proc/meminfo") as fh:
            info["mem_total_gib"] = round(int(fh.readline().split()[1]) / 1024**2, 1)
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        # SAFE-Merge's speed against TA depends on these: native bf16 products (svd_products=auto)
        # and the L2 its recovery blocks are cut for (1 GiB first fold: 6.5x TA on a CPU with bf16
        # products, 10.7x on one without)
        caps = torch.cpu.get_capabilities()
        info["cpu"] = caps.get("cpu_name")
        info["cpu_l2_bytes"] = caps.get("l2_cache_size")
        info["cpu_bf16"] = bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    except (ImportError, AttributeError):
        pass
    return info


def summarize(rows: list[Row]) -> Row:
    """One row from several runs of it: the median run's figures (seconds, CPU, RSS are medians
    over the successful runs), min/median/max of each in ``extra.spread``, every run in
    ``extra.samples``. A failed run makes the row failed."""
    bad = [r for r in rows if r.error]
    if bad:
        return bad[0]
    ordered = sorted(rows, key=lambda r: r.seconds)
    mid = ordered[len(ordered) // 2]
    out = Row(**{k: v for k, v in asdict(mid).items()})
    spread = {}
    for key in ("seconds", "cpu_seconds", "peak_rss_mib", "other_cores"):
        vals = sorted(getattr(r, key) for r in rows if getattr(r, key) is not None)
        if vals:
            med = vals[len(vals) // 2] if len(vals) % 2 else (vals[len(vals) // 2 - 1] + vals[len(vals) // 2]) / 2
            spread[key] = {"min": vals[0], "median": round(med, 3), "max": vals[-1]}
            setattr(out, key, round(med, 3))
    if out.seconds:
        out.input_gb_s = round(out.input_bytes / GB / out.seconds, 3)
    out.extra["spread"] = spread
    out.extra["samples"] = [{"seconds": r.seconds, "cpu_seconds": r.cpu_seconds, "peak_rss_mib": r.peak_rss_mib,
                             "other_cores": r.other_cores} for r in rows]
    return out


def safe_merge_plan(args: argparse.Namespace, model_bytes: int, rate: float | None) -> tuple[dict[str, str], str]:
    """SAFE-Merge's ``--set`` values and a note for one size.

    ``rate`` is seconds per model byte measured with default steps on a smaller size (or None).
    """
    sets = dict(args.policy_sets.get("safe_merge", {}))
    if "steps" in sets:
        return sets, "steps set by --set"
    if args.safe_steps is not None:
        sets["steps"] = str(args.safe_steps)
        return sets, "steps set by --safe-steps"
    if rate is None:
        return sets, ""
    estimate = rate * model_bytes
    if estimate <= args.safe_budget:
        return sets, ""
    steps = max(1, int(SAFE_DEFAULT_STEPS * args.safe_budget / estimate))
    sets["steps"] = str(steps)
    return sets, f"reduced from {SAFE_DEFAULT_STEPS}: defaults est. {estimate:.0f} s"


def parse_sets(items: list[str]) -> dict[str, dict[str, str]]:
    """``POLICY:name=value`` items -> {policy: {name: value}}."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        pol, sep, kv = item.partition(":")
        if not sep or "=" not in kv or pol not in POLICIES:
            raise SystemExit(f"--set expects POLICY:name=value with POLICY in {POLICIES}, got {item!r}")
        k, v = kv.split("=", 1)
        out.setdefault(pol, {})[k.strip()] = v.strip()
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=["0.5GB", "2GB"],
                   help="model sizes to run (default: 0.5GB 2GB)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: the 50MB size, SAFE-Merge with 5 steps, no waiting for an idle machine")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
                   help="mergestream policies (default: all four)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="POLICY:NAME=VALUE",
                   help="extra policy parameter, e.g. safe_merge:steps=10 (repeatable)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="dtype of the synthetic checkpoints")
    p.add_argument("--threads", type=int, default=0, help="mergestream fold --threads (0: its auto default)")
    p.add_argument("--executor", choices=["local", "ray"], default="local",
                   help="ray: also measure every mergestream policy with fold --executor ray (rows per --workers)")
    p.add_argument("--workers", nargs="+", type=int, default=[1, 2], metavar="N",
                   help="worker CPUs of the local Ray cluster started for the Ray rows (default: 1 2)")
    p.add_argument("--no-mergekit", action="store_true", help="skip the mergekit rows")
    p.add_argument("--no-floor", action="store_true", help="skip the floor rows")
    p.add_argument("--mergekit-venv", type=Path, default=DEFAULT_MERGEKIT_VENV)
    p.add_argument("--no-install", action="store_true", help="never create the mergekit venv")
    p.add_argument("--mergestream", type=Path, default=DEFAULT_MERGESTREAM, help="the mergestream executable")
    p.add_argument("--rev", help="benchmark this git revision of mergestream/ (a snapshot run from the same "
                                 "venv) instead of the working tree, e.g. HEAD")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR,
                   help="generated models, outputs and logs (default: %(default)s)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="results file (default: %(default)s)")
    p.add_argument("--safe-budget", type=float, default=600.0,
                   help="seconds above which SAFE-Merge on a larger size runs with fewer steps")
    p.add_argument("--safe-steps", type=int, help="force SAFE-Merge's steps on every size")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs per row, in rounds over all rows of a size (pairs in turn); each row "
                        "reports the median with min-max (all samples in the JSON)")
    p.add_argument("--repeat-slow", type=int, default=1,
                   help="runs per row for SAFE-Merge and MDM-OC (minutes each on 2 cores)")
    p.add_argument("--md", type=Path, default=DEFAULT_MD, help="markdown table (default: %(default)s)")
    p.add_argument("--ta-only-sizes", nargs="*", default=[], choices=list(SIZES), metavar="SIZE",
                   help="sizes that run only the floor and mergestream Task Arithmetic rows (the "
                        "scaling check on a large model)")
    p.add_argument("--wait-idle", type=float,
                   help="before each run, wait up to this many seconds for other processes to go quiet "
                        "(default 300; 0 with --quick)")
    p.add_argument("--max-other-load", type=float, default=0.3,
                   help="a run during which other processes kept more cores busy than this is repeated")
    p.add_argument("--load-retries", type=int,
                   help="how many times a contended run is repeated (default 2; 0 with --quick)")
    p.add_argument("--timeout", type=float, default=3600.0, help="per-run limit in seconds")
    p.add_argument("--resume", action="store_true",
                   help="keep the successful rows already in --json (contended ones too) and run only "
                        "the missing ones")
    p.add_argument("--keep-outputs", action="store_true", help="keep every output folder in the workdir")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_floor"]:
        return floor_child(argv[1:])
    args = build_parser().parse_args(argv)
    if args.quick:
        args.sizes = ["50MB"]
        if args.safe_steps is None and "steps" not in parse_sets(args.sets).get("safe_merge", {}):
            args.safe_steps = 5
    if args.wait_idle is None:
        args.wait_idle = 0.0 if args.quick else 300.0
    if args.load_retries is None:
        args.load_retries = 0 if args.quick else 2
    args.policy_sets = parse_sets(args.sets)
    args.workdir = args.workdir.resolve()
    if REPO in args.workdir.parents or args.workdir == REPO:
        raise SystemExit(f"--workdir {args.workdir} is inside the repository; generated data stays out of it")
    if not args.mergestream.exists():
        raise SystemExit(f"{args.mergestream} not found (pass --mergestream)")
    sizes = sorted(dict.fromkeys(args.sizes), key=lambda s: SIZES[s].numel())
    results = Results(args.json, args)
    args.mergestream_env, results.doc["mergestream"] = mergestream_source(args)
    source = results.doc["mergestream"]
    args.mergestream_source = source.get("commit") or f"worktree@{source.get('head', '?')}" + (
        "+dirty" if source.get("worktree_dirty") else "")
    mk_exe, mk_why = (None, "skipped (--no-mergekit)")
    if not args.no_mergekit:
        mk_exe, mk_why = ensure_mergekit(args)
        results.doc["mergekit"] = {"exe": str(mk_exe) if mk_exe else None, "unavailable": mk_why}
        if mk_exe:
            results.doc["mergekit"]["version"] = _pip_version(args.mergekit_venv, "mergekit")
    previous = results.resume(args.mergestream_source) if args.resume else {}
    safe_rate: float | None = None

    def planned(ctx: SizeContext) -> list[tuple[tuple, Any, int]]:
        """(row key, run, repeats) of one size, in the order of a round."""
        plan: list[tuple[tuple, Any, int]] = []
        if not args.no_floor:
            for fsync in (True, False):
                plan.append((row_key(ctx.size, "floor", "read+copy", "fsync" if fsync else "no fsync"),
                             lambda fsync=fsync: run_floor(ctx, fsync), args.repeat))
        ta_only = ctx.size in args.ta_only_sizes
        for policy in (["task_arithmetic"] if ta_only else args.policies):
            sets, note = dict(args.policy_sets.get(policy, {})), ""
            if policy == "safe_merge":
                sets, note = safe_merge_plan(args, ctx.model_bytes, safe_rate)
            slow = policy in ("safe_merge", "mdm_oc")
            plan.append((row_key(ctx.size, "mergestream", policy, ""),
                         lambda p=policy, s=sets, n=note: run_mergestream(ctx, p, s, n),
                         args.repeat_slow if slow else args.repeat))
            if args.executor == "ray":
                for n in args.workers:
                    plan.append((row_key(ctx.size, "mergestream-ray", policy, f"workers={n}"),
                                 lambda p=policy, s=sets, nt=note, n=n: run_mergestream_ray(ctx, p, s, nt, n),
                                 args.repeat_slow if slow else args.repeat))
            if policy in ("task_arithmetic", "safe_merge"):  # SAFE-Merge's later folds add L_old (W of k_new + k_old)
                plan.append((row_key(ctx.size, "mergestream", policy + " (later fold)", ""),
                             lambda p=policy, s=sets: run_mergestream(ctx, p, s, later=True),
                             args.repeat_slow if slow else args.repeat))
        if not args.no_mergekit and not ta_only:
            for method in (m for m in MERGEKIT_METHODS if m in args.policies):  # the peers of the rows asked for
                plan.append((row_key(ctx.size, "mergekit", method, ""),
                             lambda m=method: run_mergekit(ctx, m, mk_exe, mk_why), args.repeat))
        return plan

    for size in sizes:
        base, expert, spec = ensure_models(args.workdir, size, args.dtype)
        inputs = weight_files(base) + weight_files(expert)
        model_bytes = sum(f.stat().st_size for f in weight_files(base))
        results.doc["models"][size] = {**spec, "weight_file_bytes": model_bytes, "base": str(base),
                                       "expert": str(expert), "files": [f.name for f in weight_files(base)]}
        scratch = args.workdir / "runs"
        scratch.mkdir(parents=True, exist_ok=True)
        ctx = SizeContext(size, args, base, expert, inputs, model_bytes, scratch, args.workdir / "logs")
        _log(f"== {size}: {model_bytes / GB:.3f} GB per checkpoint, {len(inputs)} input files")
        plan = planned(ctx)
        samples: dict[tuple, list[Row]] = {key: [] for key, _, _ in plan}
        # rounds: every row once per round, so that the rows compared are measured side by side
        for rnd in range(max(n for _, _, n in plan)):
            for key, run, n in plan:
                if key in previous or rnd >= n or any(r.error for r in samples[key]):
                    continue
                row = run()  # each run warms the page cache and waits for quiet itself
                samples[key].append(row)
                _log(f"{size} {key[1]} {key[2]} round {rnd + 1}: "
                     + (row.error.splitlines()[0][:200] if row.error else f"{row.seconds:.2f} s"))
        for key, _, _ in plan:
            row = previous[key] if key in previous else summarize(samples[key])
            results.add(row, quiet=key in previous)
            if key[2] == "safe_merge" and not row.error and \
                    row.extra.get("policy_params", {}).get("steps") == SAFE_DEFAULT_STEPS:
                safe_rate = row.seconds / model_bytes
        for method in MERGEKIT_METHODS:
            ours, theirs = ctx.kept.get(f"mergestream-{method}"), ctx.kept.get(f"mergekit-{method}")
            if ours and theirs:
                results.doc["agreement"].setdefault(size, {})[method] = compare_outputs(base, ours, theirs)
                results.save()
        ctx.cleanup()
        write_markdown(args.md, results)
    print(format_table(results.rows))
    if results.doc["agreement"]:
        print("\nagreement with mergekit (probe tensors; rel = |ours - theirs| / |ours - base|):")
        for size, methods in results.doc["agreement"].items():
            for method, probes in methods.items():
                vals = [v for v in probes.values() if "error" not in v]
                if vals:
                    worst = max(v["rel_diff_of_delta"] for v in vals)
                    mad = max(v["max_abs_diff"] for v in vals)
                    print(f"  {size} {method}: worst rel {worst:.3g}, max |diff| {mad:.3g} over {len(vals)} tensors")
    print(f"\nJSON: {args.json}")
    return 0 if not any(r.error for r in results.rows) else 1


def write_markdown(path: Path, results: Results) -> None:
    """bench/results/fold_speed.md: the machine, the table (median and min-max of every figure)
    and the ratios the streaming-core issue targets, from the JSON's rows."""
    doc = results.doc
    m = doc["machine"]
    lines = ["# Fold speed: mergestream vs mergekit vs the copy floor", "",
             f"Generated by `bench/fold_speed.py` ({' '.join(doc['argv'][1:]) or 'defaults'}), "
             f"{doc.get('finished', '')}. Machine: {m.get('cpus')} CPUs"
             + (f" ({m['cpu']}, L2 {m.get('cpu_l2_bytes', 0) // 1024} KiB, native bf16 products: "
                f"{'yes' if m.get('cpu_bf16') else 'no'})" if m.get("cpu") else "")
             + f", {m.get('mem_total_gib')} GiB, "
             f"Python {m.get('python')}, torch {m.get('torch')}; mergestream {doc['mergestream'].get('commit') or doc['mergestream'].get('head')}"
             f", mergekit {(doc.get('mergekit') or {}).get('version')}.", "",
             "Every row: a fresh child process (interpreter start and imports included), page cache warm; "
             "rows of a size run in rounds (each row once per round), figures are the median over the "
             "rounds with min-max. mergestream fsyncs its output and state, mergekit does not.", "",
             "| size | tool | policy | params | wall s median (min-max) | CPU s median (min-max) | "
             "peak RSS MiB median (min-max) | written GB | runs |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]

    def cell(r: Row, key: str, spec: str) -> str:
        sp = r.extra.get("spread", {}).get(key)
        v = getattr(r, key)
        if v is None:
            return "-"
        return f"{v:{spec}}" + (f" ({sp['min']:{spec}}-{sp['max']:{spec}})" if sp and sp["min"] != sp["max"] else "")

    for r in results.rows:
        if r.error:
            lines.append(f"| {r.size} | {r.tool} | {r.policy} | {r.params} | failed: {r.error.splitlines()[0][:80]} "
                         "| | | | |")
            continue
        lines.append(f"| {r.size} | {r.tool} | {r.policy} | {r.params} | {cell(r, 'seconds', '.2f')} | "
                     f"{cell(r, 'cpu_seconds', '.1f')} | {cell(r, 'peak_rss_mib', '.0f')} | "
                     f"{(r.written_bytes or 0) / GB:.2f} | {len(r.extra.get('samples', [])) or 1} |")
    lines += ["", "## Ratios (medians, same run)", "",
              "| size | TA / mergekit TA | TA CPU / mergekit CPU | TA / copy floor (fsync) | later TA / mergekit TA | "
              "TIES / mergekit TIES | MDM-OC / TA | SAFE-Merge / TA | later SAFE-Merge / later TA |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    by = {(r.size, r.tool, r.policy, r.params if r.tool == "floor" else ""): r for r in results.rows if not r.error}
    for size in dict.fromkeys(r.size for r in results.rows):
        def sec(tool, policy, params=""):
            r = by.get((size, tool, policy, params))
            return r.seconds if r else None

        def cpu(tool, policy):
            r = by.get((size, tool, policy, ""))
            return r.cpu_seconds if r else None

        def ratio(a, b):
            return f"{a / b:.2f}" if a and b else "-"

        ta = sec("mergestream", "task_arithmetic")
        safe = by.get((size, "mergestream", "safe_merge", ""))
        lines.append(f"| {size} | {ratio(ta, sec('mergekit', 'task_arithmetic'))} | "
                     f"{ratio(cpu('mergestream', 'task_arithmetic'), cpu('mergekit', 'task_arithmetic'))} | "
                     f"{ratio(ta, sec('floor', 'read+copy', 'fsync'))} | "
                     f"{ratio(sec('mergestream', 'task_arithmetic (later fold)'), sec('mergekit', 'task_arithmetic'))} | "
                     f"{ratio(sec('mergestream', 'ties'), sec('mergekit', 'ties'))} | "
                     f"{ratio(sec('mergestream', 'mdm_oc'), ta)} | "
                     f"{ratio(safe.seconds if safe else None, ta)}{' (' + safe.params + ')' if safe else ''} | "
                     f"{ratio(sec('mergestream', 'safe_merge (later fold)'), sec('mergestream', 'task_arithmetic (later fold)'))} |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
