"""Config, ledger, store and gate on their own (real SQLite, real filesystem, real HTTP)."""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import pytest

from mergestream.config import ConfigError, GateRule, load_config
from mergestream.starter import write_starter
from mergestream.daemon import gate
from mergestream.daemon.ledger import Ledger
from mergestream.daemon.metrics import Metrics, MetricsServer
from mergestream.daemon.store import LockedError, Store


def test_starter_config_validates_and_env_overrides(tmp_path, monkeypatch):
    (tmp_path / "base.safetensors").write_bytes(b"")
    path = write_starter(tmp_path / "d", str(tmp_path / "base.safetensors"), "ties")
    text = path.read_text()
    for key in ("base:", "policy:", "inbox:", "state_dir:", "metrics:", "mlflow:", "probes:", "gate:"):
        assert f"\n{key}" in text
    cfg = load_config(path)
    assert cfg.inbox == tmp_path / "d" / "inbox" and cfg.state_dir == tmp_path / "d" / "state"
    assert cfg.metrics.host == "127.0.0.1" and cfg.metrics.port == 9108
    assert cfg.tracking_uri().startswith("sqlite:///") and str(cfg.state_dir) in cfg.tracking_uri()
    assert cfg.policy.name == "ties"
    assert [p.type for p in cfg.probes] == ["weight_space"]
    monkeypatch.setenv("MERGESTREAM_MLFLOW__TRACKING_URI", "http://127.0.0.1:5999")
    monkeypatch.setenv("MERGESTREAM_METRICS__PORT", "9200")
    cfg = load_config(path)
    assert cfg.mlflow.tracking_uri == "http://127.0.0.1:5999" and cfg.metrics.port == 9200
    assert cfg.mlflow.experiment == "mergestream"  # the rest of the section still comes from the file
    with pytest.raises(ConfigError, match="already exists"):
        write_starter(tmp_path / "d", "x")


@pytest.mark.parametrize("extra,word", [("bogus: 1\n", "bogus"), ("metrics:\n  prot: 1\n", "prot"),
                                         ("retention: 0\n", "retention"), ("gate:\n  rules:\n    - direction: up\n", "metric")])
def test_bad_config_is_a_clear_error(tmp_path, extra, word):
    p = tmp_path / "c.yaml"
    p.write_text("base: b.safetensors\n" + extra)
    with pytest.raises(ConfigError, match=word):
        load_config(p)


def test_ledger_enqueue_is_idempotent_and_queue_is_ordered(tmp_path):
    led = Ledger(tmp_path / "l.sqlite")
    a, new_a = led.enqueue("e1", "folder", "/x/e1", "h1")
    again, new_again = led.enqueue("e1-copy", "folder", "/x/e1-copy", "h1")
    assert new_a and not new_again and again.expert_id == "e1"
    r1, _ = led.enqueue("m-v1", "mlflow", "/c/1", "h2", registry_key="mlflow:m:1")
    r1b, new = led.enqueue("m-v1", "mlflow", "/c/1b", "h-other", registry_key="mlflow:m:1")
    assert not new and r1b.row == r1.row
    clash, _ = led.enqueue("e1", "folder", "/y/e1", "h3")
    assert clash.expert_id == "e1-2"
    assert [e.expert_id for e in led.experts()] == ["e1", "m-v1", "e1-2"]
    assert led.next_pending().expert_id == "e1"
    assert led.queue_depth() == 3
    assert led.requeue_interrupted() == ["e1"]
    assert led.next_pending().expert_id == "e1"
    led.set_status("e1", "accepted", version=1)
    assert led.next_pending().expert_id == "m-v1"
    # a second connection (another process) reads while this one writes
    other = Ledger(tmp_path / "l.sqlite")
    assert other.expert("e1").status == "accepted" and other.expert("e1").version == 1
    with pytest.raises(ValueError):
        led.set_status("e1", "bogus")


def test_store_publish_current_retention_and_lock(tmp_path):
    st = Store(tmp_path / "s")
    st.lock()
    with pytest.raises(LockedError, match="only one daemon"):
        Store(tmp_path / "s").lock()
    assert st.current() is None
    for i in range(4):
        stage = st.new_staging()
        (stage / "model").mkdir()
        (stage / "model" / "w").write_text(str(i))
        assert st.publish(stage, {"expert": f"e{i}"}) == i + 1
    assert st.current() == 4 and os.path.islink(tmp_path / "s" / "current")
    assert st.fold_json(4)["expert"] == "e3" and st.fold_json(4)["version"] == 4
    st.point_current(2)
    assert st.retain(1) == [1, 3]  # keeps the newest and current
    assert st.numbers() == [2, 4] and st.current() == 2
    stage = st.new_staging()
    assert st.clean_staging() == 1 and not stage.exists()
    st.unlock()
    Store(tmp_path / "s").lock()


def test_gate_rules():
    rules = [GateRule(metric="sts", direction="higher", against="both", max_abs_drop=2.0),
             GateRule(metric="step_drift", direction="lower", max_ratio_to_history=10),
             GateRule(metric="relative_drift", direction="lower", max_value=0.5),
             GateRule(metric="acc", direction="higher", max_rel_drop=0.1, required=True)]
    hist = [{"step_drift": 0.01}, {"step_drift": 0.02}]
    ok = gate.evaluate(rules, {"sts": 80, "step_drift": 0.03, "relative_drift": 0.1, "acc": 70},
                       {"sts": 81, "acc": 75}, {"sts": 82}, hist)
    assert ok.accepted, ok.failures
    bad = gate.evaluate(rules, {"sts": 78, "step_drift": 0.5, "relative_drift": 0.6}, {"sts": 81}, {"sts": 82}, hist)
    assert not bad.accepted
    text = bad.reason
    for w in ("sts: candidate 78 vs current 81", "vs base 82", "step_drift", "median 0.015", "relative_drift",
              "acc: required"):
        assert w in text, text
    assert gate.evaluate(rules[1:2], {"step_drift": 5.0}, None, None, []).accepted  # no history yet


def test_metrics_endpoint_serves_metrics_health_and_readiness():
    m = Metrics()
    srv = MetricsServer(m, "127.0.0.1", 0, stale_after=5)
    srv.start()
    try:
        base = f"http://127.0.0.1:{srv.port}"
        m.rollbacks.inc()
        body = urllib.request.urlopen(base + "/metrics").read().decode()
        assert "mergestream_rollbacks_total 1.0" in body
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(base + "/readyz")
        assert info.value.code == 503
        m.beat()
        m.ready = True
        assert urllib.request.urlopen(base + "/healthz").status == 200
        assert urllib.request.urlopen(base + "/readyz").status == 200
    finally:
        srv.stop()


def test_metrics_server_binds_at_construction_and_stops_without_starting():
    srv = MetricsServer(Metrics(), "127.0.0.1", 0)
    assert srv.port > 0
    with pytest.raises(OSError):
        MetricsServer(Metrics(), "127.0.0.1", srv.port)  # taken
    srv.stop()  # never started: returns at once
    srv.stop()


# -- relative paths resolve against the config file's folder (N12) ------------------------------------
def _deploy(tmp_path, text: str):
    """``deploy/config.yaml`` holding ``text``, and an ``elsewhere/`` folder to run from."""
    (tmp_path / "deploy").mkdir()
    (tmp_path / "elsewhere").mkdir()
    cfg = tmp_path / "deploy" / "config.yaml"
    cfg.write_text(text)
    return cfg, tmp_path / "deploy"


def test_every_relative_path_resolves_against_the_config_folder_written_or_defaulted(tmp_path, monkeypatch):
    cfg, d = _deploy(tmp_path, """\
base: models/base.safetensors
policy: {preprocess: [ri], ri: {data: aux.txt}}
probes:
  - {type: sentence_similarity, params: {data: data/sts.tsv}}
  - {type: perplexity, params: {data: ./data/ppl.txt}}
  - {type: entrypoint, params: {target: "pkg.mod:fn", data: as-written}}
mlflow: {tracking_uri: "sqlite:///ml/mlflow.db", registry: {tracking_uri: "file:./mlruns"}}
""")
    monkeypatch.chdir(tmp_path / "elsewhere")
    c = load_config(cfg)
    assert c.base == d / "models" / "base.safetensors"
    assert c.inbox == d / "inbox" and c.state_dir == d / "state"  # defaults, not ./inbox and ./state
    assert c.policy.ri.data == d / "aux.txt"
    assert [p.params.get("data") for p in c.probes] == [None, str(d / "data" / "sts.tsv"), str(d / "data" / "ppl.txt"),
                                                         "as-written"]  # an entrypoint's params are its own
    assert c.mlflow.tracking_uri == f"sqlite:///{d / 'ml' / 'mlflow.db'}" == c.tracking_uri()
    assert c.mlflow.registry.tracking_uri == (d / "mlruns").as_uri()
    # the same config loaded from its own folder gives the same paths
    monkeypatch.chdir(d)
    assert load_config("config.yaml") == c


def test_environment_overrides_resolve_against_the_config_folder_too(tmp_path, monkeypatch):
    cfg, d = _deploy(tmp_path, "base: /abs/base.safetensors\n")
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.setenv("MERGESTREAM_STATE_DIR", "var/state")
    monkeypatch.setenv("MERGESTREAM_INBOX", "~/inbox")
    monkeypatch.setenv("MERGESTREAM_MLFLOW__TRACKING_URI", "mlruns")
    monkeypatch.setenv("MERGESTREAM_MLFLOW__REGISTRY__TRACKING_URI", "http://registry:5000")
    c = load_config(cfg)
    assert c.base == Path("/abs/base.safetensors")  # absolute stays as written
    assert c.state_dir == d / "var" / "state"
    assert c.inbox == Path(os.path.expanduser("~/inbox"))
    assert c.mlflow.tracking_uri == str(d / "mlruns")
    assert c.mlflow.registry.tracking_uri == "http://registry:5000"  # a server URI is not a path
    assert c.tracking_uri() == str(d / "mlruns")
    monkeypatch.delenv("MERGESTREAM_MLFLOW__TRACKING_URI")
    assert load_config(cfg).tracking_uri() == f"sqlite:///{d / 'var' / 'state' / 'mlflow.db'}"


def test_status_from_another_folder_reads_the_config_folders_state(tmp_path):
    from .conftest import run_cli

    cfg, d = _deploy(tmp_path, "base: base.safetensors\nmlflow: {enabled: false}\n")
    Ledger(d / "state" / "ledger.sqlite").enqueue("e1", "folder", str(d / "inbox" / "e1"), "h1")
    out = run_cli("status", "--config", cfg, "--json", cwd=tmp_path / "elsewhere").stdout
    assert [e["id"] for e in json.loads(out)["experts"]] == ["e1"]
    assert os.listdir(tmp_path / "elsewhere") == []  # no fresh state built beside the caller


def test_ledger_keeps_source_notes_for_status(tmp_path):
    from mergestream.daemon.sources import SourceContext, source_notes

    led = Ledger(tmp_path / "l.sqlite")
    ctx = SourceContext(cursors=led)
    ctx.note("mlflow", "model:a", "registered model 'a' does not exist")
    since = source_notes(led)[0]["since"]
    ctx.note("mlflow", "model:a", "registered model 'a' does not exist")  # unchanged: keeps since
    ctx.note("folder", "watch", "inbox polled", level="warning")
    other = Ledger(tmp_path / "l.sqlite")  # what `status` opens
    notes = source_notes(other)
    assert [(n["source"], n["subject"], n["level"]) for n in notes] == [("folder", "watch", "warning"),
                                                                          ("mlflow", "model:a", "error")]
    assert notes[1]["since"] == since
    ctx.note("mlflow", "model:a", None)
    assert [n["source"] for n in source_notes(other)] == ["folder"]
    ctx.clear_notes("folder")
    assert source_notes(other) == [] and led.meta_items("source_note:") == {}
    SourceContext(cursors=object()).note("x", "y", "kept nowhere")  # a context without a note store: a no-op
