"""What a new operator hit (issue: rollback bookkeeping, late config errors, ...): each as a class,
through the real service, ledger, store and CLI."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mergestream.config import Config, ConfigError, load_config
from mergestream.daemon.service import Service
from mergestream.daemon.sources import ExpertReady
from mergestream.io.checkpoints import read_state_dict
from mergestream.io.state import StateDir

from .conftest import perturb, random_model, run_cli, save_tensors


def _experts(tmp: Path, n: int) -> tuple[Path, list[Path]]:
    base = random_model(0)
    bpath = save_tensors(tmp / "base.safetensors", base)
    return bpath, [save_tensors(tmp / f"e{i}.safetensors", perturb(base, 0.01, seed=i + 1)) for i in range(n)]


def _service(tmp: Path, base: Path, watch_sources: bool = False, **extra) -> Service:
    cfg = Config(base=base, inbox=tmp / "inbox", state_dir=tmp / "state", metrics={"enabled": False},
                 mlflow={"enabled": False}, gate={"rules": []}, **extra)
    svc = Service(cfg, serve_metrics=False, watch_sources=watch_sources)
    svc.start()
    return svc


def _fold_each(svc: Service, experts: list[Path], ids: list[str]) -> None:
    """Hand each expert to the service as a folder source would, and fold it (one loop step)."""
    for e, eid in zip(experts, ids):
        svc.on_expert_ready(ExpertReady(source="folder", uri=str(e), expert_id=eid))
        assert svc.step()


def _status(svc: Service) -> dict[str, str]:
    return {r.expert_id: r.status for r in svc.ledger.experts()}


def _ok(svc: Service, verb: str, arg) -> str:
    import json

    res = json.loads(svc.execute(verb, str(arg)))
    assert res["ok"], res["message"]
    return res["message"]


def test_rollback_back_and_forth_keeps_status_unmerge_and_retry_working(tmp_path):
    bpath, experts = _experts(tmp_path, 4)
    svc = _service(tmp_path, bpath)
    try:
        _fold_each(svc, experts, [f"e{i}" for i in range(len(experts))])
        assert svc.store.current() == 4 and set(_status(svc).values()) == {"accepted"}
        for back, forth in ((1, 2), (1, 4), (3, 4), (2, 3)):
            _ok(svc, "rollback", back)
            want = {f"e{i}": "accepted" if i < back else "unmerged" for i in range(4)}
            assert _status(svc) == want, f"after rollback to {back}"
            _ok(svc, "rollback", forth)
            want = {f"e{i}": "accepted" if i < forth else "unmerged" for i in range(4)}
            assert _status(svc) == want, f"after rolling forward {back} -> {forth}"
        # at version 3 (e0..e2): unmerge works on a rolled-forward expert, retry on the rolled-out one
        assert "e2 unmerged" in _ok(svc, "unmerge", "e2")
        assert _status(svc)["e2"] == "unmerged" and svc.store.current() == 5
        _ok(svc, "retry", "e3")
        assert svc.step() and _status(svc)["e3"] == "accepted" and svc.store.current() == 6
        assert set(svc.store.fold_json(6)["experts"]) == {"e0", "e1", "e3"}
        # an unmerged expert comes back with a rollback to a version that holds it
        _ok(svc, "rollback", 3)
        assert _status(svc) == {"e0": "accepted", "e1": "accepted", "e2": "accepted", "e3": "unmerged"}
    finally:
        svc.shutdown()


def test_published_states_name_their_own_model(tmp_path):
    """A one-shot unmerge of a published state needs no --backbone: every version's state names
    versions/N/model (never the staging folder it was built in, which is gone)."""
    bpath, experts = _experts(tmp_path, 2)
    # a policy that can subtract (the default, Iso-C, unmerges by replay only)
    svc = _service(tmp_path, bpath, policy={"name": "task_arithmetic", "params": {"lambda": 0.3}})
    try:
        _fold_each(svc, experts, [f"e{i}" for i in range(len(experts))])
    finally:
        svc.shutdown()
    for n in (1, 2):
        version = tmp_path / "state" / "versions" / f"{n:06d}"
        assert Path(StateDir(version / "state").manifest.backbone) == (version / "model").resolve()
    v2 = tmp_path / "state" / "versions" / "000002"
    work = tmp_path / "oneshot-state"
    shutil.copytree(v2 / "state", work)
    run_cli("unmerge", "--state", str(work), "--expert", "e1", "--out", str(tmp_path / "out"))
    got, want = read_state_dict(tmp_path / "out"), read_state_dict(tmp_path / "state" / "versions" / "000001" / "model")
    assert got.keys() == want.keys() and all(bool((got[k] == want[k]).all()) for k in want)


@pytest.mark.parametrize("policy, why", [
    ({"name": "safemerge"}, "unknown policy 'safemerge'"),
    ({"name": "safe_merge", "params": {"rhoo": 0.2}}, "rhoo"),
    ({"name": "ties", "params": {"k": 250}}, "k"),
    ({"name": "task_arithmetic", "params": {"lambda": "much"}}, "lambda"),
])
def test_a_bad_policy_or_parameter_is_refused_when_the_config_loads(tmp_path, policy, why):
    import yaml

    bpath, _ = _experts(tmp_path, 0)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({"base": str(bpath), "policy": policy}))
    with pytest.raises(ConfigError, match=why):
        load_config(cfg)
    bad = run_cli("run", "--config", str(cfg), check=False)
    assert bad.returncode == 2 and why in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def _config(tmp: Path, **doc) -> Path:
    import yaml

    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump({"inbox": str(tmp / "inbox"), "state_dir": str(tmp / "state"),
                                    "mlflow": {"enabled": False}, **doc}))
    return path


@pytest.mark.parametrize("what", ["not a model folder", "missing", "empty file", "fp8 base", "probe data missing",
                                  "port taken"])
def test_what_can_be_checked_at_start_is_refused_at_start(tmp_path, what):
    """`run` refuses in one line with exit 2 (and `init` refuses a base that is not a model),
    instead of reporting ready and failing every expert."""
    import socket

    bpath, _ = _experts(tmp_path, 0)
    doc: dict = {"base": str(bpath), "metrics": {"enabled": False}}
    expect = "base"
    sock = None
    if what == "not a model folder":
        (tmp_path / "notes").mkdir()
        (tmp_path / "notes" / "README.txt").write_text("hello")
        doc["base"] = str(tmp_path / "notes")
    elif what == "missing":
        doc["base"] = str(tmp_path / "nowhere")
    elif what == "empty file":
        (tmp_path / "empty.safetensors").write_bytes(b"")
        doc["base"] = str(tmp_path / "empty.safetensors")
    elif what == "fp8 base":
        import torch
        from safetensors.torch import save_file

        save_file({"w": torch.zeros(4, 4).to(torch.float8_e4m3fn)}, tmp_path / "fp8.safetensors")
        doc["base"] = str(tmp_path / "fp8.safetensors")
    elif what == "probe data missing":
        doc["probes"] = [{"type": "sentence_similarity", "params": {"data": str(tmp_path / "nope.tsv")}}]
        expect = "probes"
    else:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        doc["metrics"] = {"enabled": True, "host": "127.0.0.1", "port": sock.getsockname()[1]}
        expect = f"metrics.port {sock.getsockname()[1]}"
    try:
        bad = run_cli("run", "--config", str(_config(tmp_path, **doc)), check=False)
    finally:
        if sock is not None:
            sock.close()
    assert bad.returncode == 2, bad.stderr
    assert expect in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert not (tmp_path / "state" / "versions").exists()
    if what in ("not a model folder", "empty file"):
        init = run_cli("init", str(tmp_path / "d"), "--base", doc["base"], check=False)
        assert init.returncode == 2 and len(init.stderr.strip().splitlines()) == 1, init.stderr
        assert not (tmp_path / "d" / "config.yaml").exists()


def test_junk_in_the_inbox_is_rejected_visibly_and_a_renamed_copy_is_a_duplicate(tmp_path):
    """notes.txt and random bytes named .safetensors (no READY marker) are rejected with their
    reasons and shown in `status`; the same weights under a new file name are not folded twice."""
    import os
    import time

    bpath, experts = _experts(tmp_path, 1)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    shutil.copy(experts[0], inbox / "sst2.safetensors")
    shutil.copy(experts[0], inbox / "sst2copy.safetensors")
    (inbox / "notes.txt").write_text("fold sst2 first")
    (inbox / "junk.safetensors").write_bytes(os.urandom(2048))
    svc = _service(tmp_path, bpath, watch_sources=True, watch={"settle_seconds": 0.3})
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            svc.step()
            st = _status(svc)
            if len(st) == 3 and "pending" not in st.values() and "folding" not in st.values() and \
                    any(f["kind"] == "duplicate" for f in svc.ledger.folds()):
                break
            time.sleep(0.2)
        rows = {r.expert_id: r for r in svc.ledger.experts()}
        assert {rows["notes.txt"].status, rows["junk"].status} == {"rejected"}, rows
        assert "UnsupportedCheckpointError" in rows["notes.txt"].reason
        assert "CorruptCheckpointError" in rows["junk"].reason
        folded = [e for e in ("sst2", "sst2copy") if e in rows]
        assert len(folded) == 1 and rows[folded[0]].status == "accepted" and svc.store.current() == 1
        dup = [f for f in svc.ledger.folds() if f["kind"] == "duplicate"]
        assert len(dup) == 1 and dup[0]["decision"] == "rejected" and f"expert {folded[0]}" in dup[0]["reason"]
        assert svc.metrics.experts_rejected.labels(stage="duplicate")._value.get() == 1
    finally:
        svc.shutdown()
    out = run_cli("status", "--config", str(_config(tmp_path, base=str(bpath))))
    assert "junk" in out.stdout and "rejected" in out.stdout and "CorruptCheckpointError" in out.stdout


def test_rough_edges_prefix_ids_operator_rollback_counter_404_and_empty_outputs(tmp_path):
    import urllib.error
    import urllib.request

    from mergestream.daemon.metrics import Metrics, MetricsServer

    bpath, experts = _experts(tmp_path, 3)
    cfg_path = _config(tmp_path, base=str(bpath), metrics={"enabled": False})
    assert "current version: none yet" in run_cli("status", "--config", str(cfg_path)).stdout
    assert run_cli("history", "--config", str(cfg_path)).stdout.strip() == "no folds yet"
    svc = _service(tmp_path, bpath)
    try:
        # ids like the demo's cache copies: name-hash
        _fold_each(svc, experts, [f"{'ab'[i % 2]}ta-{i}f00d{i}" for i in range(len(experts))])
        assert sorted(_status(svc)) == ["ata-0f00d0", "ata-2f00d2", "bta-1f00d1"]
        assert "bta-1f00d1 unmerged" in _ok(svc, "unmerge", "bta")  # a unique prefix
        import json

        res = json.loads(svc.execute("retry", "ata"))
        assert not res["ok"] and "ata-0f00d0" in res["message"] and "ata-2f00d2" in res["message"]
        assert "already accepted" in _ok(svc, "retry", "ata-0")  # idempotent: nothing to do, not an error
        assert _status(svc)["ata-0f00d0"] == "accepted"
        _ok(svc, "rollback", 2)
        _ok(svc, "rollback", 4)
        assert svc.metrics.operator_rollbacks._value.get() == 2
        assert svc.metrics.rollbacks._value.get() == 0  # the gate rejected nothing
    finally:
        svc.shutdown()
    server = MetricsServer(Metrics(), "127.0.0.1", 0)
    server.start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        assert b"mergestream_operator_rollbacks_total" in urllib.request.urlopen(base + "/metrics").read()
        for path in ("/", "/metric", "/favicon.ico"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(base + path)
            assert err.value.code == 404
    finally:
        server.stop()


def test_second_round_of_rough_edges(tmp_path):
    """A duplicate is reported once (not again on every rescan or restart); `name` picks `name-<hash>`
    among longer ids; unknown experts read the same for unmerge and retry; a misspelt policy
    parameter is named with the closest known one."""
    import json

    bpath, experts = _experts(tmp_path, 2)
    copy = tmp_path / "copy.safetensors"
    shutil.copy(experts[0], copy)
    svc = _service(tmp_path, bpath)
    try:
        svc.on_expert_ready(ExpertReady(source="folder", uri=str(experts[0]), expert_id="sst2-a49c2982"))
        svc.on_expert_ready(ExpertReady(source="folder", uri=str(experts[1]), expert_id="sst2_lr3e-3-baea1e"))
        assert svc.step() and svc.step()
        for _ in range(3):  # rescans and restarts re-emit what sits in the inbox
            svc.on_expert_ready(ExpertReady(source="folder", uri=str(copy), expert_id="copy"))
        assert svc.ledger.queue_depth() == 1  # one arrival, queued once under its arrival key
        assert svc.step()  # its fold reads it: the content of sst2-a49c2982, discarded before the probes
        assert svc.ledger.queue_depth() == 0 and svc.store.current() == 2
        assert "copy" not in _status(svc)
        for _ in range(3):  # known by its arrival key now: not queued, not read, not reported again
            svc.on_expert_ready(ExpertReady(source="folder", uri=str(copy), expert_id="copy"))
        assert svc.ledger.queue_depth() == 0
    finally:
        svc.shutdown()
    svc = _service(tmp_path, bpath)
    try:
        svc.on_expert_ready(ExpertReady(source="folder", uri=str(copy), expert_id="copy"))
        assert svc.ledger.queue_depth() == 0
        dup = [f for f in svc.ledger.folds() if f["kind"] == "duplicate"]
        assert len(dup) == 1 and "sst2-a49c2982" in dup[0]["reason"]
        assert svc.metrics.experts_rejected.labels(stage="duplicate")._value.get() == 0  # counted before the restart
        assert svc.ledger.resolve_id("sst2") == "sst2-a49c2982"
        for verb in ("unmerge", "retry"):
            res = json.loads(svc.execute(verb, "nosuch"))
            assert not res["ok"] and res["message"] == "unknown expert 'nosuch'"
    finally:
        svc.shutdown()
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="did you mean 'rho'"):
        Config(base=bpath, policy={"name": "safe_merge", "params": {"rhoo": 0.2}})


def test_the_current_version_gauge_is_set_when_the_publish_is_logged_and_before_tracking(tmp_path):
    """`mergestream_current_version` follows a publish (and a rollback) at once: it is already the new
    number when the `published version=N` line is logged and when the tracker (MLflow: seconds of
    calls) is asked to record it — the new-user trial saw the old value for seconds after the line."""
    import logging

    bpath, experts = _experts(tmp_path, 2)
    svc = _service(tmp_path, bpath)
    seen: list[tuple[str, float]] = []

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("published version="):
                seen.append(("log", svc.metrics.current_version._value.get()))

    submit = svc.tracker.submit

    def watched_submit(kind, payload):  # the real tracker still runs (disabled here: returns at once)
        seen.append((kind, svc.metrics.current_version._value.get()))
        return submit(kind, payload)

    svc.tracker.submit = watched_submit
    handler, logger = Watch(), logging.getLogger("mergestream.service")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        _fold_each(svc, experts, ["a", "b"])
        _ok(svc, "rollback", 1)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        svc.shutdown()
    assert [v for k, v in seen if k == "log"] == [1.0, 2.0]
    assert [v for k, v in seen if k == "fold"] == [1.0, 2.0]
    assert [v for k, v in seen if k == "alias"] == [1.0, 2.0, 1.0]  # the last: after the rollback
