"""Every OS error is one line (issue #36): a full disk, a read-only or lost path, a path under a
file, a name too long. Real errors only, as root in a container (chmod cannot refuse root): an
output under a regular file (ENOTDIR), ``/proc`` and ``/sys`` paths (ENOENT, EPERM), a 300-char
name (ENAMETOOLONG), a folder where a file is read (EISDIR), and a real full disk: a small tmpfs
mounted in a private user namespace (``unshare -Urm``), so nothing else on the machine is affected.

For each verb: exit 2, exactly one stderr line naming the path and the system's reason, no
traceback, no temp or staging file left, the state folder byte for byte as it was. The daemon on a
full disk: the fold is ``failed`` with that one line in ``status``,
``mergestream_storage_errors_total`` is counted, ``current`` is unchanged, and once space is back
the next expert folds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .conftest import MERGESTREAM, perturb, random_model, run_cli, save_tensors
from .test_daemon import Daemon

TEMP_MARKS = (".staging-", ".tmp", ".spool-", ".replay-", ".current-")


def tree(root: Path) -> dict[str, str]:
    """Every entry under ``root``: relative path -> sha256 of a file, ``dir`` or ``-> target``."""
    out = {}
    for p in sorted(root.rglob("*")) if root.exists() else []:
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def assert_one_line(rc: int, stderr: str, *names: str) -> str:
    """Exit 2 and one stderr line without a traceback that contains every one of ``names``."""
    lines = stderr.strip().splitlines()
    assert rc == 2, stderr
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    for n in names:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def no_temp_files(entries) -> None:
    left = [e for e in entries if any(m in Path(e).name for m in TEMP_MARKS)]
    assert not left, left


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A base, two experts and a state folder with one fold (``st``, model ``m1``)."""
    d = tmp_path_factory.mktemp("oserr")
    base = random_model(0, m=256, n=256)  # ~0.6 MB: a fold does not fit in a few hundred KB
    save_tensors(d / "base.safetensors", base)
    for i in (1, 2):
        save_tensors(d / f"e{i}.safetensors", perturb(base, 0.01, i))
    (d / "file.txt").write_text("a regular file\n")
    return d


def fold_args(d: Path, expert: str, state: Path | str, out: Path | str, backbone: Path | None = None) -> list[str]:
    """A fold of ``expert`` (every parameter given: no note about the state's last ones on stderr)."""
    return ["fold", "--base", str(d / "base.safetensors"), "--expert", str(d / expert), "--policy",
            "task_arithmetic", "--set", "lambda=0.5", "--set", "k=100.0", "--state", str(state), "--out", str(out),
            "-q", *(["--backbone", str(backbone)] if backbone else [])]


@pytest.fixture
def folded(models, tmp_path) -> Path:
    """A work folder with ``st`` (one fold of e1) and its model ``m1``."""
    run_cli(*fold_args(models, "e1.safetensors", tmp_path / "st", tmp_path / "m1"))
    return tmp_path


LONG = "n" * 300

#: (name, argv builder (models, work) -> argv, what the line must name, the reason)
CASES = [
    ("fold --out under a file", lambda d, w: fold_args(d, "e2.safetensors", w / "st", d / "file.txt" / "sub" / "m2", w / "m1"),
     "file.txt/sub", "Not a directory"),
    ("fold --out in /proc", lambda d, w: fold_args(d, "e2.safetensors", w / "st", "/proc/mergestream-out", w / "m1"),
     "/proc/", "No such file or directory"),
    ("fold --out a 300-char name", lambda d, w: fold_args(d, "e2.safetensors", w / "st", w / LONG / "m2", w / "m1"),
     LONG, "File name too long"),
    ("fold --state in /proc", lambda d, w: fold_args(d, "e2.safetensors", "/proc/mergestream-state", w / "m2"),
     "/proc/mergestream-state", "No such file or directory"),
    ("merge --out in /sys", lambda d, w: ["merge", "--base", str(d / "base.safetensors"), "--policy",
                                           "task_arithmetic", "--out", "/sys/mergestream-out", "-q",
                                           str(d / "e1.safetensors"), str(d / "e2.safetensors")],
     "/sys/", "Operation not permitted"),
    ("unmerge --out under a file", lambda d, w: ["unmerge", "--state", str(w / "st"), "--expert", "e1", "--out",
                                                 str(d / "file.txt" / "x" / "m0"), "-q"],
     "file.txt/x", "Not a directory"),
    ("make-patch --out a 300-char name", lambda d, w: ["make-patch", "--from-dir", str(d / "base.safetensors"),
                                                       "--to-dir", str(w / "m1"), "--out", str(w / LONG / "p")],
     LONG, "File name too long"),
    ("init in /proc", lambda d, w: ["init", "/proc/mergestream-init", "--base", str(d / "base.safetensors"),
                                    "--policy", "task_arithmetic"],
     "/proc/mergestream-init", "No such file or directory"),
    ("status --config a folder", lambda d, w: ["status", "--config", str(w / "st")], "st", "Is a directory"),
    ("feed keygen --keys under a file", lambda d, w: ["feed", "keygen", "--keys", str(d / "file.txt" / "keys")],
     "file.txt", "Not a directory"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_verb_reports_an_os_error_in_one_line_and_changes_nothing(models, folded, case):
    _, argv, where, reason = case
    before_models, before_work = tree(models), tree(folded)
    proc = run_cli(*argv(models, folded), check=False)
    assert_one_line(proc.returncode, proc.stderr, where, reason)
    assert tree(models) == before_models and tree(folded) == before_work  # the state folder too
    no_temp_files(tree(models)), no_temp_files(tree(folded))


def test_the_agent_reports_an_os_error_in_one_line(tmp_path):
    (tmp_path / "status.json").mkdir()
    proc = subprocess.run([sys.executable, "-m", "mergestream.agent.cli", "status", "--model-dir", str(tmp_path)],
                          capture_output=True, text=True)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "status.json" in lines[0] and "Is a directory" in lines[0]


# -- a real full disk: a small tmpfs in a private user namespace ---------------------------------------
def _tmpfs_ok() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True)
    return probe.returncode == 0


needs_tmpfs = pytest.mark.skipif(not _tmpfs_ok(), reason="needs unshare -Urm and tmpfs mounts in a user namespace")

#: Runs inside the namespace: argv[1] is a JSON spec {disk, setup: [argv], free, argv}. Mounts are
#: done by the caller; this runs the setup commands, fills the disk until ``free`` bytes are left,
#: runs ``argv`` and prints the disk's listing before and after, and the command's result.
HARNESS = textwrap.dedent("""
    import hashlib, json, os, subprocess, sys
    from pathlib import Path
    spec = json.loads(sys.argv[1])
    disk = Path(spec["disk"])
    def tree():
        out = {}
        for p in sorted(disk.rglob("*")):
            if p.name == ".filler":
                continue
            rel = str(p.relative_to(disk))
            out[rel] = ("-> " + os.readlink(p) if p.is_symlink() else "dir" if p.is_dir()
                        else hashlib.sha256(p.read_bytes()).hexdigest())
        return out
    for argv in spec["setup"]:
        subprocess.run(argv, check=True, capture_output=True)
    fill(disk / ".filler", spec["free"])
    before = tree()
    p = subprocess.run(spec["argv"], capture_output=True, text=True)
    print(json.dumps({"rc": p.returncode, "stderr": p.stderr, "before": before, "after": tree()}))
""")

FILL = textwrap.dedent("""
    import os
    def fill(path, free):
        # write zeros until the disk is full, then give back ``free`` bytes
        # unbuffered: nothing is left in a buffer for close() to fail on (it did, now and then)
        with open(path, "wb", buffering=0) as fh:
            try:
                while True:
                    fh.write(b"\\0" * 65536)
            except OSError:
                pass
        os.truncate(path, max(0, os.path.getsize(path) - free))
""")


def _in_namespace(disk: Path, size: str, argv: list[str]) -> list[str]:
    """``argv`` run in a fresh user + mount namespace with a tmpfs of ``size`` on ``disk``."""
    disk.mkdir(parents=True, exist_ok=True)
    return ["unshare", "-Urm", "sh", "-c", f'mount -t tmpfs -o size={size} tmpfs "{disk}" && exec "$@"', "sh", *argv]


@pytest.mark.slow
@needs_tmpfs
@pytest.mark.parametrize("verb", ["fold", "make-patch"])
def test_a_full_disk_mid_write_is_one_line_and_leaves_the_state_as_it_was(models, tmp_path, verb):
    disk = tmp_path / "disk"
    setup = [[*MERGESTREAM, *fold_args(models, "e1.safetensors", disk / "st", disk / "m1")]]
    if verb == "fold":
        argv = [*MERGESTREAM, *fold_args(models, "e2.safetensors", disk / "st", disk / "m2", disk / "m1")]
    else:
        argv = [*MERGESTREAM, "make-patch", "--from-dir", str(models / "base.safetensors"), "--to-dir",
                str(disk / "m1"), "--out", str(disk / "p.safetensors")]
    spec = {"disk": str(disk), "setup": setup, "free": 200_000, "argv": argv}
    script = FILL + HARNESS
    proc = subprocess.run(_in_namespace(disk, "8m", [sys.executable, "-c", script, json.dumps(spec)]),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert_one_line(res["rc"], res["stderr"], str(disk), "No space left on device")
    assert res["after"] == res["before"]  # nothing partial: no model, no state file, no manifest change
    no_temp_files(res["after"])


@pytest.mark.slow
@needs_tmpfs
def test_the_daemon_on_a_full_disk_fails_the_fold_counts_it_and_goes_on(tmp_path):
    # no MLflow: its store (created in the state folder after the first publish, seconds after e1
    # is accepted) would still be growing when the disk is filled, and the daemon's ledger would find
    # no room left at all: a different scenario from a fold that meets a full disk
    d = Daemon(tmp_path, {"state_dir": "disk/state", "mlflow": {"enabled": False}})
    base = random_model(0, m=256, n=256)
    save_tensors(tmp_path / "base.safetensors", base)  # replaces the tiny base: a fold needs ~2 MB
    disk = tmp_path / "disk"
    d.proc = subprocess.Popen(_in_namespace(disk, "16m", [*MERGESTREAM, "run", "--config", str(d.config)]),
                              stdout=subprocess.DEVNULL, stderr=open(d.log, "ab"), env=d.env)
    inside = ["nsenter", "-t", str(d.proc.pid), "-U", "-m", "--preserve-credentials"]

    def status() -> dict:
        p = subprocess.run([*inside, *MERGESTREAM, "status", "--config", str(d.config), "--json"],
                           capture_output=True, text=True, env=d.env)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)

    def expert(name: str) -> dict:
        return next((e for e in status()["experts"] if e["id"] == name), {})

    try:
        d.wait(lambda: d.http("/readyz")[0] == 200, 60, "daemon never became ready")
        save_tensors(tmp_path / "inbox" / "e1.safetensors", perturb(base, 0.01, 1))
        d.wait(lambda: expert("e1").get("status") == "accepted", 60, "e1 never accepted")
        assert status()["current_version"] == 1
        fill = subprocess.run([*inside, sys.executable, "-c", FILL + f"fill({str(disk / '.filler')!r}, 400_000)"],
                              capture_output=True, text=True)
        assert fill.returncode == 0, fill.stderr
        save_tensors(tmp_path / "inbox" / "e2.safetensors", perturb(base, 0.01, 2))
        d.wait(lambda: expert("e2").get("status") == "failed", 60, "e2 never failed")
        reason = expert("e2")["reason"]
        assert "No space left on device" in reason and str(disk / "state") in reason and "\n" not in reason, reason
        assert status()["current_version"] == 1
        d.wait(lambda: (d.metric("mergestream_storage_errors_total") or 0) >= 1, 10, "storage error not counted")
        _, body = d.http("/metrics")
        assert 'mergestream_storage_errors_total{errno="ENOSPC"}' in body
        staging = subprocess.run([*inside, "find", str(disk / "state" / "staging"), "-mindepth", "1"],
                                 capture_output=True, text=True)
        assert staging.stdout.strip() == "", staging.stdout  # the failed candidate is gone
        subprocess.run([*inside, "rm", str(disk / ".filler")], check=True)  # space is back
        save_tensors(tmp_path / "inbox" / "e3.safetensors", perturb(base, 0.01, 3))
        d.wait(lambda: expert("e3").get("status") == "accepted", 60, "e3 never accepted once space was back")
        assert status()["current_version"] == 2 and d.proc.poll() is None
    finally:
        d.stop()
    log = d.log.read_text()
    assert "Traceback" not in log, log[-3000:]


@needs_tmpfs
def test_the_ledger_on_a_full_disk_raises_an_os_error_naming_it(tmp_path):
    """SQLite's "database or disk is full" is the OSError it stands for, named by the ledger file
    (so the CLI and the daemon report it as every other OS error), and the ledger still reads."""
    disk = tmp_path / "disk"
    script = FILL + textwrap.dedent(f"""
        import errno, json
        from mergestream.daemon.ledger import Ledger
        from mergestream.errors import error_line
        led = Ledger({str(disk / "ledger.sqlite")!r})
        fill({str(disk / ".filler")!r}, 0)
        try:
            led.set_meta("big", "x" * 1_000_000)
        except OSError as exc:
            print(json.dumps({{"errno": exc.errno, "line": error_line(exc), "meta": led.get_meta("big")}}))
    """)
    proc = subprocess.run(_in_namespace(disk, "256k", [sys.executable, "-c", script]), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout, proc.stderr
    res = json.loads(proc.stdout)
    assert res["errno"] == 28 and res["meta"] is None
    assert str(disk / "ledger.sqlite") in res["line"] and "No space left on device" in res["line"]
