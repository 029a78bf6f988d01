"""The device agent against a real feed on a loopback HTTP server (issue 16 acceptance).

Every agent run is a subprocess in which only the standard library and the packages of the
``agent`` extra can be imported (torch, boto3, ... raise ImportError): the agent runs without torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from securesystemslib.signer import CryptoSigner
from tuf.api.metadata import Metadata

from mergestream.feed.build import build_feed
from mergestream.patches import read_patch, weights_sha256

from .test_feed import served_feed, signed_targets

ALLOWED_TOP_LEVEL = {"mergestream", "numpy", "click", "tuf", "securesystemslib", "urllib3", "cryptography",
                     "_cffi_backend", "zstandard"}
#: runs the agent's CLI where only the standard library and the `agent` extra can be imported
#: (torch and everything else raise ImportError, as on a device without them)
ONLY_AGENT_DEPS = f"""
import sys
ALLOWED = {sorted(ALLOWED_TOP_LEVEL)!r}
class Block:
    def find_spec(self, name, path=None, target=None):
        top = name.split('.')[0]
        if top not in sys.stdlib_module_names and top not in ALLOWED:
            raise ModuleNotFoundError(f'{{name}} is not installed on this device', name=name)
        return None
sys.meta_path.insert(0, Block())
from mergestream.agent.cli import main
main()
"""


def agent(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``mergestream-agent`` (torch blocked) and return the finished process."""
    return subprocess.run([sys.executable, "-c", ONLY_AGENT_DEPS, *map(str, args)], capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})), timeout=120)


@pytest.fixture
def world(tmp_path):
    """Five daemon versions, keys, a feed whose release 1 says "latest = v1", and its server."""
    w = {**served_feed(tmp_path, latest=1), "tmp": tmp_path}
    yield w
    w["server"].close()


def pull(w, device: Path, *extra, env=None) -> subprocess.CompletedProcess:
    """One ``pull`` of ``device`` from the world's feed."""
    return agent("pull", "--feed", w["server"].url, "--model-dir", device, "--root", w["root"], *extra, env=env)


def current_hash(device: Path) -> str:
    """Weights hash of what ``current`` names (read from the files, not the agent's records)."""
    return weights_sha256(device / "current")


def same_files(a: Path, b: Path) -> bool:
    """Byte-for-byte equal folders (every file, recursively)."""
    fa = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    fb = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return fa == fb and all((a / f).read_bytes() == (b / f).read_bytes() for f in fa)


def at_v1(w) -> Path:
    """A device that pulled release 1 (v1, full model)."""
    device = w["tmp"] / "device"
    proc = pull(w, device)
    assert proc.returncode == 0, proc.stderr
    assert same_files(device / "current", w["store"].path(1) / "model")
    return device


def one_error_line(proc: subprocess.CompletedProcess, code: int, *words: str) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


# -- the happy paths ---------------------------------------------------------------------------------
def test_v1_reaches_v5_by_patches_and_a_fresh_device_by_the_full_model(world):
    w = world
    device = at_v1(w)
    build_feed(w["store"].root, w["feed"], w["keys"])  # release 2: latest = v5
    w["server"].log.clear()
    proc = pull(w, device, "--json")
    assert proc.returncode == 0, proc.stderr
    status = json.loads(proc.stdout)
    v5 = weights_sha256(w["store"].path(5) / "model")
    assert status["outcome"] == "updated" and status["plan"].startswith("patches 1->2->3->4->5")
    assert status["current"]["weights_sha256"] == v5 and status["current"]["version"] == 5
    assert same_files(device / "current", w["store"].path(5) / "model")
    assert json.loads((device / "status.json").read_text())["current"]["weights_sha256"] == v5
    assert not any("/models/" in p for p, _ in w["server"].log), "a patch-reachable device downloaded the model"
    assert status["bytes_downloaded"] < (w["store"].path(5) / "model" / "model.safetensors").stat().st_size
    assert current_hash(device) == v5 and (device / "previous").resolve() != (device / "current").resolve()

    fresh = w["tmp"] / "fresh"
    proc = pull(w, fresh)
    assert proc.returncode == 0, proc.stderr
    assert "full model v5" in proc.stdout
    assert same_files(fresh / "current", w["store"].path(5) / "model")

    again = pull(w, device)
    assert again.returncode == 0 and again.stdout.startswith("up to date")


def test_format2_zstd_patches_are_applied_by_the_agent(world):
    w = world
    device = at_v1(w)
    rep = build_feed(w["store"].root, w["feed"], w["keys"], patch_format=2, zstd_level=3)
    # the 1 -> 2 patch the newest signed targets name (the folder also keeps release 1's format-1 file,
    # under its own consistent-snapshot name: which of the two a directory listing gives first is chance)
    signed = signed_targets(w["feed"])
    path = next(p for p in signed if p.startswith("patches/") and "000001-000002" in p)
    patch = w["feed"] / "targets" / "patches" / f"{signed[path].hashes['sha256']}.{Path(path).name}"
    assert read_patch(patch).metadata["patch_format"] == "mergestream-patch/2"
    proc = pull(w, device, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["bytes_downloaded"] == rep["bytes_to_latest"]["1"]
    assert same_files(device / "current", w["store"].path(5) / "model")


def test_a_damaged_current_slot_is_replaced_by_the_full_model(world):
    w = world
    device = at_v1(w)
    build_feed(w["store"].root, w["feed"], w["keys"])
    weights = device / "current" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    proc = pull(w, device)
    assert proc.returncode == 0, proc.stderr
    assert "full model v5" in proc.stdout
    assert same_files(device / "current", w["store"].path(5) / "model")


def test_every_keeps_pulling_until_sigterm(world):
    w = world
    device = w["tmp"] / "device"
    proc = subprocess.Popen([sys.executable, "-c", ONLY_AGENT_DEPS, "pull", "--feed", w["server"].url, "--model-dir",
                             str(device), "--root", str(w["root"]), "--every", "0.5s"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def version():
            doc = json.loads((device / "status.json").read_text()) if (device / "status.json").exists() else {}
            return (doc.get("current") or {}).get("version")

        deadline = time.monotonic() + 30
        while version() != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        build_feed(w["store"].root, w["feed"], w["keys"])
        while version() != 5 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert version() == 5
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "updated to v1" in out and "updated to v5" in out


def test_a_device_follows_key_rotation_through_root(world):
    from mergestream.feed.keys import rotate_key

    w = world
    device = at_v1(w)
    rotate_key(w["keys"], "root")
    rotate_key(w["keys"], "targets")
    assert build_feed(w["store"].root, w["feed"], w["keys"])["root_version"] == 2
    proc = pull(w, device)
    assert proc.returncode == 0, proc.stderr
    assert same_files(device / "current", w["store"].path(5) / "model")
    assert (device / ".agent" / "metadata" / "root_history" / "2.root.json").exists()


def test_local_rollback_returns_to_the_previous_slot_and_holds_the_version_back(world):
    w = world
    device = at_v1(w)
    build_feed(w["store"].root, w["feed"], w["keys"])
    assert pull(w, device).returncode == 0
    proc = agent("rollback", "--model-dir", device)
    assert proc.returncode == 0, proc.stderr
    assert current_hash(device) == weights_sha256(w["store"].path(1) / "model")
    held = pull(w, device)
    assert held.returncode == 0 and "rolled back" in held.stdout
    assert current_hash(device) == weights_sha256(w["store"].path(1) / "model")
    # an operator rollback (a new, signed release pointing back to v3) is installed
    build_feed(w["store"].root, w["feed"], w["keys"], latest=3)
    assert pull(w, device).returncode == 0
    assert same_files(device / "current", w["store"].path(3) / "model")


def test_nothing_to_roll_back_and_no_trusted_root_are_refused(world, tmp_path):
    one_error_line(agent("rollback", "--model-dir", tmp_path / "d"), 7, "no previous slot")
    proc = agent("pull", "--feed", world["server"].url, "--model-dir", tmp_path / "d")
    one_error_line(proc, 7, "no trusted root")


def test_health_check_failure_keeps_the_old_model(world):
    w = world
    device = at_v1(w)
    build_feed(w["store"].root, w["feed"], w["keys"])
    v1 = current_hash(device)
    bad = f"{sys.executable} -c \"import sys; sys.exit(3)\""
    one_error_line(pull(w, device, "--check", bad), 6, "health check", "exited 3")
    assert current_hash(device) == v1
    assert json.loads((device / "status.json").read_text())["error"]["code"] == 6
    good = f"{sys.executable} -c \"import os, sys; sys.exit(not os.path.isfile('{{model_dir}}/model.safetensors'))\""
    proc = pull(w, device, "--check", good)
    assert proc.returncode == 0, proc.stderr
    assert current_hash(device) == weights_sha256(w["store"].path(5) / "model")


# -- tampering -----------------------------------------------------------------------------------------
def _served(feed: Path, suffix: str) -> Path:
    (path,) = [p for p in (feed / "targets").rglob("*") if p.name.endswith(suffix)]
    return path


def _tamper_flip(w):
    p = _served(w["feed"], "000001-000002.safetensors")
    data = bytearray(p.read_bytes())
    data[-5] ^= 0x01
    p.unlink()
    p.write_bytes(bytes(data))


def _tamper_longer(w):
    p = _served(w["feed"], "000001-000002.safetensors")
    data = p.read_bytes()
    p.unlink()
    p.write_bytes(data + b"\0" * 64)


def _tamper_shorter(w):
    p = _served(w["feed"], "000001-000002.safetensors")
    data = p.read_bytes()
    p.unlink()
    p.write_bytes(data[:-64])


def _tamper_other_key(w):
    """The release's targets metadata re-signed by a key root does not trust (pointing at an
    attacker's patch)."""
    path = w["feed"] / "metadata" / "2.targets.json"
    md = Metadata.from_file(str(path))
    tf = md.signed.targets["patches/000001-000002.safetensors"]
    evil = _served(w["feed"], "000001-000002.safetensors").read_bytes()[:-1] + b"!"
    import hashlib

    tf.hashes = {"sha256": hashlib.sha256(evil).hexdigest()}
    (w["feed"] / "targets" / "patches" / f"{tf.hashes['sha256']}.000001-000002.safetensors").write_bytes(evil)
    md.signatures.clear()
    md.sign(CryptoSigner.generate_ed25519())
    md.to_file(str(path))


def _tamper_expired(w):
    build_feed(w["store"].root, w["feed"], w["keys"], expires={"timestamp": __import__("datetime").timedelta(seconds=-60)})


TAMPER = {
    "flipped_byte": (_tamper_flip, 4, ["sha256", "refused"]),
    "longer_than_signed": (_tamper_longer, 4, ["more than the signed length"]),
    "shorter_than_signed": (_tamper_shorter, 4, ["the signed length is"]),
    "other_key": (_tamper_other_key, 3, ["metadata refused", "targets"]),
    "expired_timestamp": (_tamper_expired, 3, ["expired"]),
}


@pytest.mark.parametrize("case", sorted(TAMPER))
def test_tampering_is_refused_and_the_model_untouched(world, case):
    w = world
    device = at_v1(w)
    build_feed(w["store"].root, w["feed"], w["keys"])
    tamper, code, words = TAMPER[case]
    tamper(w)
    before = {p: p.read_bytes() for p in (device / "current").rglob("*") if p.is_file()}
    one_error_line(pull(w, device), code, *words)
    assert {p: p.read_bytes() for p in (device / "current").rglob("*") if p.is_file()} == before
    assert current_hash(device) == weights_sha256(w["store"].path(1) / "model")
    assert json.loads((device / "status.json").read_text())["error"]["code"] == code


def test_replayed_old_metadata_is_refused(world):
    """Rollback attack: after release 2 (v2) the server replays release 1 (v1)."""
    w = world
    device = at_v1(w)
    old = {p.name: p.read_bytes() for p in (w["feed"] / "metadata").iterdir()}
    build_feed(w["store"].root, w["feed"], w["keys"], latest=2)
    assert pull(w, device).returncode == 0
    (w["feed"] / "metadata" / "timestamp.json").write_bytes(old["timestamp.json"])
    one_error_line(pull(w, device), 3, "metadata refused", "version")
    assert current_hash(device) == weights_sha256(w["store"].path(2) / "model")


def test_a_frozen_feed_is_refused_once_its_timestamp_expires(world):
    w = world
    from datetime import timedelta

    build_feed(w["store"].root, w["feed"], w["keys"], latest=1, expires={"timestamp": timedelta(seconds=2)})
    device = at_v1(w)
    time.sleep(2.5)  # the feed stops updating
    one_error_line(pull(w, device), 3, "expired")
    assert current_hash(device) == weights_sha256(w["store"].path(1) / "model")


# -- power loss and resume ----------------------------------------------------------------------------
@pytest.mark.parametrize("stage", ["download:1", "apply", "apply:2", "verify", "switch"])
def test_sigkill_at_each_stage_leaves_a_complete_slot_and_the_next_run_finishes(world, stage):
    w = world
    device = at_v1(w)
    build_feed(w["store"].root, w["feed"], w["keys"])
    proc = pull(w, device, env={"MERGESTREAM_AGENT_CRASH_AT": stage})
    assert proc.returncode == -9, (proc.returncode, proc.stderr)
    assert current_hash(device) == weights_sha256(w["store"].path(1) / "model")
    proc = pull(w, device)
    assert proc.returncode == 0, proc.stderr
    assert same_files(device / "current", w["store"].path(5) / "model")


def test_fresh_device_killed_mid_download_has_no_current_and_recovers(world):
    w = world
    device = w["tmp"] / "fresh"
    proc = pull(w, device, env={"MERGESTREAM_AGENT_CRASH_AT": "download:1"})
    assert proc.returncode == -9
    assert not (device / "current").exists()
    assert pull(w, device).returncode == 0
    assert same_files(device / "current", w["store"].path(1) / "model")


def test_a_cut_download_resumes_from_the_byte_it_reached(world):
    w = world
    size = (w["store"].path(1) / "model" / "model.safetensors").stat().st_size
    half = size // 2
    w["server"].cut_once[".model.safetensors"] = half
    device = w["tmp"] / "fresh"
    one_error_line(pull(w, device), 5, f"after {half} of {size} bytes", "resumes")
    w["server"].log.clear()
    assert pull(w, device).returncode == 0
    ranges = [r for p, r in w["server"].log if p.endswith(".model.safetensors")]
    assert ranges == [f"bytes={half}-"], w["server"].log
    assert same_files(device / "current", w["store"].path(1) / "model")


# -- installable without torch -------------------------------------------------------------------------
def test_the_agent_imports_only_its_declared_requirements():
    """Every agent test runs the agent with only the stdlib and the `agent` extra importable; this
    one checks the blocker itself is effective (torch cannot be imported under it)."""
    code = ONLY_AGENT_DEPS.replace("from mergestream.agent.cli import main\nmain()", "import torch")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 1 and "torch is not installed on this device" in proc.stderr


def test_pyproject_declares_the_agent_script_and_extra():
    import tomllib

    doc = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert doc["project"]["scripts"]["mergestream-agent"] == "mergestream.agent.cli:main"
    names = {r.split("[")[0].split(">")[0].split("=")[0].strip() for r in doc["project"]["optional-dependencies"]["agent"]}
    assert {"numpy", "click", "tuf", "securesystemslib", "urllib3"} <= names
    assert not any(n.startswith("torch") for n in names)
