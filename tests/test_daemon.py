"""The daemon end to end: a real subprocess, real filesystem events, real SQLite, metrics scraped
over HTTP, and (marked slow) a real MLflow tracking server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from .conftest import MERGESTREAM, perturb, run_cli, save_tensors


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_base(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"layer.0.weight": torch.randn(64, 48, generator=g), "layer.0.bias": torch.randn(64, generator=g),
            "layer.1.weight": torch.randn(32, 64, generator=g), "position_ids": torch.arange(8)}


def scaled_expert(base: dict, seed: int, factor: float = 1.0) -> dict[str, torch.Tensor]:
    e = perturb(base, 0.01, seed)
    return {k: (base[k] + factor * (v - base[k]) if v.is_floating_point() else v) for k, v in e.items()}


class Daemon:
    """A `mergestream run` subprocess on a temporary config."""

    def __init__(self, root: Path, extra: dict | None = None, env: dict | None = None):
        self.root = root
        self.port = free_port()
        base = tiny_base()
        save_tensors(root / "base.safetensors", base)
        cfg = {"base": "base.safetensors", "inbox": "inbox", "state_dir": "state",
               "policy": {"name": "task_arithmetic", "params": {"lambda": 0.3}},
               "watch": {"settle_seconds": 0.5, "poll_interval": 0.2},
               "metrics": {"host": "127.0.0.1", "port": self.port}, "log_format": "json"}
        for k, v in (extra or {}).items():
            cfg[k] = v
        self.config = root / "config.yaml"
        self.config.write_text(yaml.safe_dump(cfg))
        (root / "inbox").mkdir(exist_ok=True)
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.log = root / "daemon.log"

    def start(self, wait_ready: bool = True) -> Daemon:
        self.proc = subprocess.Popen([*MERGESTREAM, "run", "--config", str(self.config)], stdout=subprocess.DEVNULL,
                                     stderr=open(self.log, "ab"), env=self.env)
        if wait_ready:
            self.wait(lambda: self.http("/readyz")[0] == 200, 60, "daemon never became ready")
        return self

    def http(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, ""
        except OSError:
            return 0, ""

    def metric(self, name: str) -> float | None:
        _, body = self.http("/metrics")
        for line in body.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return None

    def status(self) -> dict:
        return json.loads(run_cli("status", "--config", self.config, "--json").stdout)

    def wait(self, cond, timeout: float, msg: str) -> None:
        end = time.time() + timeout
        while time.time() < end:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"daemon exited ({self.proc.returncode}): {self.log.read_text()[-3000:]}")
            if cond():
                return
            time.sleep(0.2)
        raise AssertionError(f"{msg}; log tail:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> int:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode if self.proc else 0


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path)
    yield d
    d.stop()


def _write_slowly(path: Path, data: bytes, chunks: int = 6, pause: float = 0.4) -> None:
    step = len(data) // chunks + 1
    with open(path, "wb") as fh:
        for i in range(0, len(data), step):
            fh.write(data[i:i + step])
            fh.flush()
            time.sleep(pause)


@pytest.mark.slow
def test_three_experts_arrive_and_each_is_folded_once(daemon, tmp_path):
    base = tiny_base()
    daemon.start()
    staging = tmp_path / "src"
    e = [save_tensors(staging / f"e{i}.safetensors", scaled_expert(base, 10 + i)) for i in range(3)]
    inbox = tmp_path / "inbox"
    _write_slowly(inbox / "e0.safetensors", e[0].read_bytes())          # written slowly in chunks
    (inbox / "e1.safetensors").write_bytes(e[1].read_bytes())
    (inbox / "e1-again.safetensors").write_bytes(e[1].read_bytes())      # the same expert copied twice
    tmp = inbox / ".e2.safetensors.part"
    tmp.write_bytes(e[2].read_bytes())
    os.rename(tmp, inbox / "e2.safetensors")                             # renamed into place
    daemon.wait(lambda: daemon.status()["current_version"] == 3, 90, "current never reached version 3")
    time.sleep(1.5)  # give duplicates a chance to (wrongly) fold
    st = daemon.status()
    assert st["current_version"] == 3
    accepted = sorted(x["id"] for x in st["experts"] if x["status"] == "accepted")
    assert len(st["experts"]) == 3 and len(accepted) == 3  # the copy is the same expert, whichever came first
    assert accepted[0] == "e0" and accepted[1] in ("e1", "e1-again") and accepted[2] == "e2"
    hist = json.loads(run_cli("history", "--config", daemon.config, "--json").stdout)
    folds = [h for h in hist if h["kind"] == "fold"]
    assert [h["expert_id"] for h in folds] == [x["id"] for x in st["experts"]]
    assert all(h["decision"] == "accepted" for h in folds) and [h["version"] for h in folds] == [1, 2, 3]
    dup = [h for h in hist if h["kind"] == "duplicate"]  # the copy is reported, not folded
    assert len(dup) == 1 and dup[0]["decision"] == "rejected" and {dup[0]["expert_id"], accepted[1]} == {"e1", "e1-again"}
    assert daemon.metric("mergestream_current_version") == 3
    assert not list((tmp_path / "state" / "staging").iterdir())
    # θ₀'s singular vectors of the weight-space probe are kept for the next start
    assert len(list((tmp_path / "state" / "cache" / "probes").glob("weight_space-svd-*.safetensors"))) == 1
    # the published backbone equals the offline task-arithmetic sum of the three experts
    from mergestream.io.checkpoints import read_state_dict

    got = read_state_dict(tmp_path / "state" / "current" / "model")
    for k, v in base.items():
        if v.is_floating_point():
            want = v + 0.3 * sum(read_state_dict(p)[k] - v for p in e)
            torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_harmful_expert_is_rejected_and_rollback_counted(daemon, tmp_path):
    base = tiny_base()
    daemon.start()
    inbox = tmp_path / "inbox"
    for i in range(2):
        save_tensors(inbox / f"ok{i}.safetensors", scaled_expert(base, 20 + i))
        daemon.wait(lambda i=i: daemon.status()["current_version"] == i + 1, 60, f"ok{i} not folded")
    save_tensors(inbox / "harmful.safetensors", scaled_expert(base, 30, factor=50.0))
    daemon.wait(lambda: any(x["id"] == "harmful" and x["status"] == "rejected" for x in daemon.status()["experts"]),
                60, "harmful expert not rejected")
    st = daemon.status()
    assert st["current_version"] == 2
    reason = next(x["reason"] for x in st["experts"] if x["id"] == "harmful")
    assert "step_drift" in reason and "median" in reason
    assert daemon.metric("mergestream_rollbacks_total") == 1.0
    assert daemon.http("/healthz")[0] == 200


@pytest.mark.slow
def test_bad_inputs_are_rejected_with_reasons_while_serving(daemon, tmp_path):
    base = tiny_base()
    daemon.start()
    inbox = tmp_path / "inbox"
    good = save_tensors(tmp_path / "src" / "good.safetensors", scaled_expert(base, 1))
    trunc = inbox / "truncated"
    trunc.mkdir()
    (trunc / "model.safetensors").write_bytes(good.read_bytes()[:-64])
    (trunc / "READY").write_text("")
    bad_shape = scaled_expert(base, 2)
    bad_shape["layer.1.weight"] = torch.zeros(32, 65)
    save_tensors(inbox / "shape.safetensors", bad_shape)
    nan = scaled_expert(base, 3)
    nan["layer.0.bias"][5] = float("nan")
    save_tensors(inbox / "nan.safetensors", nan)

    def reasons():
        return {x["id"]: (x["status"], x["reason"]) for x in daemon.status()["experts"]}

    daemon.wait(lambda: len([r for r in reasons().values() if r[0] == "rejected"]) == 3, 60, "not all rejected")
    r = reasons()
    assert "CorruptCheckpointError" in r["truncated"][1]
    assert "ShapeMismatchError" in r["shape"][1] and "layer.1.weight" in r["shape"][1]
    assert "NonFiniteError" in r["nan"][1]
    assert daemon.status()["current_version"] is None
    assert daemon.http("/healthz")[0] == 200
    assert daemon.metric('mergestream_experts_rejected_total{stage="validation"}') == 3.0
    # the daemon still folds good experts afterwards
    (inbox / "good.safetensors").write_bytes(good.read_bytes())
    daemon.wait(lambda: daemon.status()["current_version"] == 1, 60, "good expert not folded after bad ones")


@pytest.mark.slow
def test_two_daemons_on_one_state_folder(daemon, tmp_path):
    daemon.start()
    second = subprocess.run([*MERGESTREAM, "run", "--config", str(daemon.config)], capture_output=True, text=True,
                            timeout=60)
    assert second.returncode != 0
    assert "only one daemon" in second.stderr
    assert daemon.http("/healthz")[0] == 200


@pytest.mark.slow
def test_kill_9_mid_fold_then_restart_folds_once(tmp_path):
    base = tiny_base()
    d = Daemon(tmp_path, env={"MERGESTREAM_FOLD_DELAY_SECONDS": "0.7"})
    d.start()
    inbox = tmp_path / "inbox"
    save_tensors(inbox / "first.safetensors", scaled_expert(base, 1))
    d.wait(lambda: d.status()["current_version"] == 1, 60, "first not folded")
    save_tensors(inbox / "second.safetensors", scaled_expert(base, 2))
    staging = tmp_path / "state" / "staging"
    d.wait(lambda: staging.exists() and any(staging.iterdir()), 30, "second fold never started")
    time.sleep(0.8)
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    from mergestream.daemon.store import Store
    from mergestream.io.checkpoints import read_state_dict

    assert Store(tmp_path / "state").current() == 1
    assert read_state_dict(tmp_path / "state" / "current" / "model")  # a complete earlier version
    d.env.pop("MERGESTREAM_FOLD_DELAY_SECONDS")
    d.start()
    d.wait(lambda: d.status()["current_version"] == 2, 60, "interrupted expert not folded after restart")
    hist = json.loads(run_cli("history", "--config", d.config, "--json").stdout)
    assert [h["expert_id"] for h in hist] == ["first", "second"]
    assert not any(staging.iterdir())
    # a patch between two kept versions in format 2 + zstd rebuilds the later one
    from mergestream.io import st
    from mergestream.patches import weights_sha256

    versions = tmp_path / "state" / "versions"
    patch = tmp_path / "p12.safetensors"
    run_cli("patch", "--from", "1", "--to", "2", "--config", d.config, "--out", str(patch), "--format", "2",
            "--zstd", "3")
    assert "mergestream-patch/2" in st.read_header(patch).obj["__metadata__"].values()
    run_cli("apply-patch", str(versions / "000001" / "model"), str(patch), "--out", str(tmp_path / "rebuilt"))
    assert weights_sha256(tmp_path / "rebuilt") == weights_sha256(versions / "000002" / "model")
    bad = run_cli("patch", "--from", "1", "--to", "2", "--config", d.config, "--out", str(tmp_path / "p.st"),
                  "--format", "1", "--zstd", "3", check=False)
    assert bad.returncode == 2 and "zstd" in bad.stderr
    # operator commands reach the running daemon
    run_cli("rollback", "--config", d.config, "--to", "1")
    assert d.status()["current_version"] == 1
    assert {x["id"]: x["status"] for x in d.status()["experts"]}["second"] == "unmerged"
    run_cli("retry", "second", "--config", d.config)
    d.wait(lambda: d.status()["current_version"] == 3, 60, "retried expert not folded")
    run_cli("unmerge", "second", "--config", d.config)
    st = d.status()
    assert st["current_version"] == 4
    assert {x["id"]: x["status"] for x in st["experts"]}["second"] == "unmerged"
    got = read_state_dict(tmp_path / "state" / "current" / "model")
    v1 = read_state_dict(tmp_path / "state" / "versions" / "000001" / "model")
    for k in v1:
        torch.testing.assert_close(got[k], v1[k], rtol=1e-6, atol=1e-6)
    assert d.stop() == 0


def test_operator_commands_without_a_running_daemon(tmp_path):
    d = Daemon(tmp_path)
    bad = run_cli("rollback", "--config", d.config, "--to", "3", check=False)
    assert bad.returncode == 2 and "version 3 does not exist" in bad.stderr
    st = json.loads(run_cli("status", "--config", d.config, "--json").stdout)
    assert st["current_version"] is None and st["experts"] == []


@pytest.mark.slow
def test_tracking_outage_never_stops_folding(tmp_path):
    base = tiny_base()
    dead = f"http://127.0.0.1:{free_port()}"
    d = Daemon(tmp_path, extra={"mlflow": {"tracking_uri": dead, "retry_seconds": 1}})
    d.start()
    try:
        for i in range(2):
            save_tensors(tmp_path / "inbox" / f"e{i}.safetensors", scaled_expert(base, 40 + i))
        d.wait(lambda: d.status()["current_version"] == 2, 90, "folding stopped during a tracking outage")
        assert d.metric("mergestream_tracking_errors_total") >= 2
        assert d.status()["tracking_pending"] >= 2
        assert d.http("/healthz")[0] == 200
    finally:
        d.stop()
