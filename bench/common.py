"""What several benchmarks share: synthetic checkpoints, measuring a child process, the code measured.

- **Synthetic Llama-shaped checkpoints**: :class:`LlamaShape`, the named :data:`SIZES` and
  :func:`ensure_models`, which generates (once, cached under a work folder) a ``base`` (θ₀) and an
  ``expert`` (θ₀ + small noise) Hugging Face folder for one size; :func:`weight_files`,
  :func:`tree_bytes` and :func:`warm` (read files once so a timed run starts with a warm page cache).
- **Measuring a child process**: :func:`run_measured` (wall seconds, peak RSS through GNU ``time``,
  CPU seconds, the load everything else put on the machine), :func:`wait_for_idle`.
- **Which code is measured**: :func:`mergestream_source`, the installed working tree or a
  ``git archive`` snapshot of ``--rev`` put first on ``PYTHONPATH``; :func:`git`.
- **Paths a result records**: :func:`recorded_path` (no host folder in a checked-in result: the
  expert cache as ``<cache>/``, the repository relative, the home folder as ``~/``),
  :func:`recorded_command`, and :func:`resolved_path`, which reads one back.
- Paths and units: :data:`REPO`, :data:`DEFAULT_WORKDIR`, :data:`DEFAULT_MERGESTREAM`,
  :data:`CONSTRAINTS`, :data:`GB`, :data:`MIB`; :func:`_log` (a timestamped line on stderr).

Users: ``bench/fold_speed.py`` (all of it), ``bench/daemon_latency.py`` (the models, ``warm``) and
``bench/quality_since.py`` (the ``--rev`` snapshot). ``bench/`` is not a package: they put their own
folder first on ``sys.path`` and ``import common``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_WORKDIR = Path("/tmp/mergestream-bench")
DEFAULT_MERGESTREAM = REPO / ".venv" / "bin" / "mergestream"
CONSTRAINTS = REPO / "constraints.txt"

SHARD_BYTES = 1 << 30  # synthetic checkpoints: 1 GiB shards, so the 2 GB model is sharded
GB = 1e9
MIB = 1 << 20


# ------------------------------------------------------------------------------------------
# Synthetic Llama-shaped checkpoints
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LlamaShape:
    """The dimensions of a Llama decoder that fix every tensor's shape."""

    hidden: int
    intermediate: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every weight, in the order ``transformers`` names them."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"model.layers.{i}"
            out += [
                (f"{p}.self_attn.q_proj.weight", (h, h)),
                (f"{p}.self_attn.k_proj.weight", (kv, h)),
                (f"{p}.self_attn.v_proj.weight", (kv, h)),
                (f"{p}.self_attn.o_proj.weight", (h, h)),
                (f"{p}.mlp.gate_proj.weight", (self.intermediate, h)),
                (f"{p}.mlp.up_proj.weight", (self.intermediate, h)),
                (f"{p}.mlp.down_proj.weight", (h, self.intermediate)),
                (f"{p}.input_layernorm.weight", (h,)),
                (f"{p}.post_attention_layernorm.weight", (h,)),
            ]
        out += [("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]
        return out

    def numel(self) -> int:
        return sum(math.prod(s) for _, s in self.tensors())

    def config(self, dtype: str) -> dict[str, Any]:
        """A ``config.json`` for ``LlamaForCausalLM`` (untied embeddings) with these dimensions."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "max_position_embeddings": 2048,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": dtype,
        }


#: named sizes; the name says roughly how many bytes one bf16 checkpoint has.
SIZES: dict[str, LlamaShape] = {
    "50MB": LlamaShape(hidden=512, intermediate=1408, layers=6, vocab=8000, heads=8, kv_heads=2),
    "0.5GB": LlamaShape(hidden=1024, intermediate=2816, layers=17, vocab=32000, heads=16, kv_heads=4),
    "1GB": LlamaShape(hidden=2048, intermediate=5504, layers=9, vocab=32000, heads=32, kv_heads=4),
    "2GB": LlamaShape(hidden=2048, intermediate=5632, layers=20, vocab=32000, heads=32, kv_heads=4),
    "4GB": LlamaShape(hidden=2048, intermediate=5632, layers=42, vocab=32000, heads=32, kv_heads=4),
}

BASE_STD = 0.02  # θ₀ ~ N(0, 0.02²) for matrices, 1 for norms
EXPERT_STD = 0.002  # τ ~ N(0, 0.002²) everywhere


def _plan_shards(tensors: list[tuple[str, tuple[int, ...]]], itemsize: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def ensure_models(workdir: Path, size: str, dtype_name: str) -> tuple[Path, Path, dict[str, Any]]:
    """Generate (or reuse) the base and expert folders for one size.

    Tensors are drawn per name from a seeded generator, so the same spec always gives the same
    bytes. The folders are reused when ``spec.json`` next to them matches.

    Returns:
        (base folder, expert folder, spec dict).
    """
    import torch
    from safetensors.torch import save_file

    shape = SIZES[size]
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]
    spec = {"size": size, "dtype": dtype_name, "shape": asdict(shape), "numel": shape.numel(),
            "base_std": BASE_STD, "expert_std": EXPERT_STD, "shard_bytes": SHARD_BYTES, "version": 1}
    root = workdir / "models" / f"{size}-{dtype_name}"
    base, expert = root / "base", root / "expert"
    spec_file = root / "spec.json"
    if spec_file.is_file() and json.loads(spec_file.read_text()) == spec:
        return base, expert, spec
    shutil.rmtree(root, ignore_errors=True)
    base.mkdir(parents=True)
    expert.mkdir(parents=True)
    t0 = time.perf_counter()
    _log(f"generating {size} ({shape.numel() / 1e6:.0f}M params, {dtype_name}) under {root}")
    shards = _plan_shards(shape.tensors(), dtype.itemsize)
    n = len(shards)
    weight_map: dict[str, str] = {}
    for i, group in enumerate(shards):
        fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        b_shard: dict[str, torch.Tensor] = {}
        e_shard: dict[str, torch.Tensor] = {}
        for name, shp in group:
            gen = torch.Generator().manual_seed(hash_name(name))
            if len(shp) == 1:
                b = torch.ones(shp)
            else:
                b = torch.randn(shp, generator=gen).mul_(BASE_STD)
            e = torch.randn(shp, generator=gen).mul_(EXPERT_STD).add_(b)
            b_shard[name], e_shard[name] = b.to(dtype), e.to(dtype)
            weight_map[name] = fname
            del b, e
        save_file(b_shard, str(base / fname), metadata={"format": "pt"})
        save_file(e_shard, str(expert / fname), metadata={"format": "pt"})
        del b_shard, e_shard
    total = shape.numel() * dtype.itemsize
    for folder in (base, expert):
        (folder / "config.json").write_text(json.dumps(shape.config(dtype_name), indent=2) + "\n")
        if n > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    spec_file.write_text(json.dumps(spec, indent=2) + "\n")
    _log(f"generated {size} in {time.perf_counter() - t0:.1f} s")
    return base, expert, spec


def hash_name(name: str) -> int:
    """A stable 31-bit seed for a tensor name (Python's ``hash`` is salted per process)."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


#: how a result names the expert cache (``mergestream.experts.cache_root()``: ``$MERGESTREAM_CACHE`` or
#: ``~/.cache/mergestream/experts``)
CACHE_MARK = "<cache>"


def _cache_root() -> Path:
    from mergestream.experts import cache_root  # the one home of the rule; imported late: bench/ loads without it

    return cache_root()


def recorded_path(path: str | os.PathLike) -> str:
    """How a checked-in result records ``path``, never naming a host folder: inside the expert cache as
    ``<cache>/REL``, inside the repository relative to its root, inside the home folder as ``~/REL``,
    anything else (``/tmp`` scratch) as written; a relative or already recorded path is kept. Read
    back with :func:`resolved_path`."""
    text = os.fspath(path)
    if not os.path.isabs(text):
        return text
    full = Path(text).resolve()
    for root, mark in ((_cache_root(), CACHE_MARK), (REPO, ""), (Path.home(), "~")):
        root = root.resolve()
        if full.is_relative_to(root):
            rel = full.relative_to(root).as_posix()
            return f"{mark}/{rel}" if mark else rel
    return text


def recorded_command(argv: list[str]) -> list[str]:
    """``argv`` with every absolute path in it (a word, or the value of ``--opt=PATH``) recorded by
    :func:`recorded_path`."""
    out = []
    for word in map(str, argv):
        opt, eq, value = word.partition("=") if word.startswith("--") else ("", "", word)
        out.append(opt + eq + recorded_path(value) if os.path.isabs(value) else word)
    return out


def resolved_path(text: str) -> Path:
    """The path a result's recorded one (:func:`recorded_path`) names on this machine: ``<cache>/REL``
    under the expert cache, ``~/REL`` under the home folder, a relative path under the repository
    root, an absolute one (older results, scratch) as written."""
    if text.startswith(CACHE_MARK + "/"):
        return _cache_root() / text[len(CACHE_MARK) + 1:]
    if text.startswith("~/"):
        return Path(text).expanduser()
    return Path(text) if os.path.isabs(text) else REPO / text


def weight_files(folder: Path) -> list[Path]:
    """The ``*.safetensors`` files of a model folder, sorted by name."""
    return sorted(folder.glob("*.safetensors"))


def tree_bytes(*paths: Path) -> int:
    """Total size of the regular files under ``paths`` (missing paths count 0)."""
    total = 0
    for p in paths:
        if p.is_file():
            total += p.stat().st_size
        elif p.is_dir():
            total += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return total


def warm(paths: list[Path]) -> None:
    """Read files once so that every timed run starts with its inputs in the page cache."""
    buf = bytearray(16 * MIB)
    for p in paths:
        with open(p, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass

# ------------------------------------------------------------------------------------------
# Measuring a child process
# ------------------------------------------------------------------------------------------
@dataclass
class Measured:
    """One child process: exit status, wall seconds, peak RSS and where its output went."""

    returncode: int
    seconds: float
    peak_rss_bytes: int
    stdout: Path
    stderr: Path
    timed_out: bool = False
    cpu_seconds: float = 0.0
    other_cores: float = 0.0

    def tail(self, n: int = 1500) -> str:
        text = self.stderr.read_text(errors="replace") if self.stderr.exists() else ""
        return text[-n:].strip()


def gnu_time() -> str | None:
    """Path of GNU ``time`` if it is installed (it supports ``-f %M -o FILE``), else None."""
    exe = shutil.which("time", path="/usr/bin:/bin:/usr/local/bin")
    if exe is None:
        return None
    try:
        probe = subprocess.run([exe, "-f", "%M", "true"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return exe if probe.returncode == 0 and probe.stderr.strip().isdigit() else None


GNU_TIME = gnu_time()
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def busy_cpu_seconds() -> float:
    """CPU seconds spent busy by the whole machine since boot (``/proc/stat``; 0 if unreadable)."""
    try:
        with open("/proc/stat") as fh:
            f = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (f + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


def wait_for_idle(max_wait: float, threshold: float = 0.3) -> float:
    """Wait (at most ``max_wait`` s) until other processes use under ``threshold`` cores over 2 s.

    The machine may be shared (tests running next to the benchmark); timings taken under load
    are not comparable. Returns the seconds waited.
    """
    t0 = time.perf_counter()
    while True:
        b0 = busy_cpu_seconds()
        time.sleep(2.0)
        load = (busy_cpu_seconds() - b0) / 2.0
        waited = time.perf_counter() - t0
        if load < threshold or waited >= max_wait:
            if waited > 5:
                _log(f"waited {waited:.0f} s for other processes (load {load:.2f} cores)")
            return waited


def run_measured(cmd: list[str], logs: Path, tag: str, *, env: dict[str, str] | None = None,
                 timeout: float | None = None) -> Measured:
    """Run ``cmd`` alone and measure its wall seconds and peak RSS.

    Peak RSS comes from GNU ``time -f %M`` when available: ``time`` is a small C program, and the
    command is forked from it, so the figure is the command's own. Measuring with ``os.wait4``
    from this (large, torch-importing) Python process instead would report at least this
    process's RSS at fork time, because Linux carries the pre-exec high-water mark into
    ``ru_maxrss``; that is the fallback when GNU time is missing (flagged in the JSON).
    Either way ``ru_maxrss`` is per process, never summed over the tree, and is in KiB on Linux.
    """
    logs.mkdir(parents=True, exist_ok=True)
    out_path, err_path = logs / f"{tag}.stdout", logs / f"{tag}.stderr"
    rss_path = logs / f"{tag}.maxrss"
    rss_path.unlink(missing_ok=True)
    full = [GNU_TIME, "-f", "%M", "-o", str(rss_path), *cmd] if GNU_TIME else cmd
    timed_out = threading.Event()
    busy0 = busy_cpu_seconds()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(full, stdout=out, stderr=err, env=env, start_new_session=True)

        def kill() -> None:
            timed_out.set()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        timer = threading.Timer(timeout, kill) if timeout else None
        if timer:
            timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            if timer:
                timer.cancel()
        seconds = time.perf_counter() - t0
    busy = busy_cpu_seconds() - busy0
    cpu = usage.ru_utime + usage.ru_stime  # includes the command when it runs under GNU time
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here; keep Popen consistent
    peak_kib = usage.ru_maxrss
    if GNU_TIME:
        lines = rss_path.read_text().split() if rss_path.exists() else []
        peak_kib = int(lines[-1]) if lines and lines[-1].isdigit() else 0
    other = max(0.0, busy - cpu) / seconds if seconds > 0 else 0.0
    return Measured(proc.returncode, seconds, peak_kib * 1024, out_path, err_path, timed_out.is_set(),
                    round(cpu, 3), round(other, 3))


# ------------------------------------------------------------------------------------------
# Which mergestream code is measured
# ------------------------------------------------------------------------------------------
def git(*args: str) -> str:
    """``git -C REPO ARGS...``: its stdout, stripped (raises ``CalledProcessError`` on failure)."""
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout.strip()


def mergestream_source(args: argparse.Namespace) -> tuple[dict[str, str] | None, dict[str, Any]]:
    """Which mergestream code the runs use: the installed working tree, or a snapshot of ``--rev``.

    A snapshot (``git archive REV mergestream``, unpacked under the workdir) is put first on
    ``PYTHONPATH``, ahead of the editable install, so edits made to the working tree while the
    benchmark runs cannot change what it measures.

    Returns:
        (environment for the mergestream children or None for the inherited one, description).
    """
    info: dict[str, Any] = {}
    try:
        info["head"] = git("rev-parse", "HEAD")
        info["worktree_dirty"] = bool(git("status", "--porcelain", "--", "mergestream"))
    except (OSError, subprocess.CalledProcessError):
        pass
    if args.rev is None:
        info["source"] = "working tree (installed package)"
        return None, info
    sha = git("rev-parse", "--verify", f"{args.rev}^{{commit}}")
    dest = args.workdir / "src" / sha
    if not (dest / "mergestream" / "__init__.py").is_file():
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", sha, "mergestream"], capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    # bytecode, as an installed package has: otherwise, where PYTHONDONTWRITEBYTECODE is set, every
    # timed child compiles the modules it imports again
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(dest / "mergestream")], check=True)
    # and the compiled loop's machine code (numba's cache beside it), as the first fold after an
    # install leaves it: otherwise the first timed child compiles it (seconds)
    for module in ("engine.fused", "fused"):  # the layout since the root packages, and before
        if (dest / "mergestream" / f"{module.replace('.', '/')}.py").exists():
            # run in the snapshot: `python -c` puts the working directory first on sys.path
            subprocess.run([sys.executable, "-c", f"import mergestream.{module}"], check=True, cwd=dest,
                           env=dict(os.environ, PYTHONPATH=str(dest)))
            break
    info.update(source=f"git snapshot {sha}", rev=args.rev, commit=sha, path=str(dest))
    return dict(os.environ, PYTHONPATH=str(dest)), info


def _pip_version(venv: Path, package: str) -> str | None:
    try:
        out = subprocess.run([str(venv / "bin" / "python"), "-c",
                              f"import importlib.metadata as m; print(m.version({package!r}))"],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
