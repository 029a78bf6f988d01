"""The daemon publishes its own signed feed (issue 16): a real `mergestream run` folds experts, the
feed folder is served over loopback HTTP, and a device agent (a subprocess without torch) follows
it to the latest version, back to an earlier one after an operator rollback, and through a period
with nothing new (the timestamp is re-signed, so the feed never looks frozen). The publisher's
failure handling and the config/CLI options run in process on real files."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from prometheus_client import CollectorRegistry
from tuf.api.metadata import Metadata

from mergestream.config import ConfigError, load_config
from mergestream.daemon.feed_publish import FeedPublisher, build_feed_publisher
from mergestream.daemon.metrics import Metrics
from mergestream.feed.build import feed_report, feed_status
from mergestream.feed.keys import generate
from mergestream.patches import read_patch, weights_sha256

from .conftest import run_cli, save_tensors
from .test_agent import agent, same_files
from .test_daemon import Daemon, tiny_base
from .test_feed import FeedServer, make_store


def _sparse_expert(seed: int, density: float = 0.03) -> dict[str, torch.Tensor]:
    """The daemon's tiny base with ``density`` of each float tensor's entries fine-tuned (an edge
    update whose patch is far smaller than the model)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in tiny_base().items():
        if v.is_floating_point():
            v = torch.where(torch.rand(v.shape, generator=g) < density, v + torch.randn(v.shape, generator=g), v)
        out[k] = v
    return out


def _drop(tmp_path: Path, name: str, seed: int) -> None:
    """An expert renamed into the daemon's inbox (complete on arrival)."""
    src = save_tensors(tmp_path / "src" / f"{name}.safetensors", _sparse_expert(seed))
    os.replace(src, tmp_path / "inbox" / f"{name}.safetensors")


def _ts_version(feed: Path) -> int:
    return Metadata.from_file(str(feed / "metadata" / "timestamp.json")).signed.version


@pytest.mark.slow
def test_devices_follow_the_daemons_feed_through_publishes_a_rollback_and_quiet_time(tmp_path):
    generate(tmp_path / "keys")
    feed = tmp_path / "feed"
    d = Daemon(tmp_path, extra={"patch_format": 2, "patch_zstd_level": 3, "retention": 2,  # v1 is deleted at v3
                                "feed": {"dir": "feed", "keys": "keys", "expires": {"timestamp": "6s"},
                                         "refresh_seconds": 1.5}})
    server = FeedServer(feed)
    device = tmp_path / "device"
    state = tmp_path / "state" / "versions"

    def pull(*extra):
        proc = agent("pull", "--feed", server.url, "--model-dir", device, "--root", feed / "metadata" / "1.root.json",
                     "--json", *extra)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    def feed_names(version: int) -> None:
        d.wait(lambda: d.metric("mergestream_feed_latest_version") == version, 90,
               f"the feed never named version {version}")

    try:
        d.start()
        _drop(tmp_path, "e1", 11)
        feed_names(1)
        assert pull()["current"]["version"] == 1
        _drop(tmp_path, "e2", 12)
        d.wait(lambda: d.metric("mergestream_current_version") == 2, 90, "no version 2")
        _drop(tmp_path, "e3", 13)
        feed_names(3)
        st = pull()
        v3 = weights_sha256(state / "000003" / "model")
        assert st["plan"].startswith("patches 1->2->3") and st["current"]["weights_sha256"] == v3
        assert same_files(device / "current", state / "000003" / "model")
        assert not (state / "000001").exists()  # retention removed v1; its patch to v2 lives in v2's folder
        own = read_patch(state / "000003" / "patch-from-000002.safetensors")
        assert own.metadata["patch_format"] == "mergestream-patch/2"
        served = next((feed / "targets" / "patches").glob("*000002-000003*"))  # published as the daemon wrote it
        assert served.read_bytes() == (state / "000003" / "patch-from-000002.safetensors").read_bytes()
        # feed metrics: the size per version and what a device at each version needs
        for v in ("2", "3"):  # patches to 2 and 3, the full model of 3 (v1 is reached from, not to)
            assert d.metric(f'mergestream_feed_version_bytes{{version="{v}"}}') > 0
        fresh = d.metric('mergestream_feed_bytes_to_latest{from_version="none"}')
        assert 0 < d.metric('mergestream_feed_bytes_to_latest{from_version="1"}') < fresh
        assert d.metric('mergestream_feed_bytes_to_latest{from_version="3"}') == 0

        # the operator rolls back: a new signed release pointing at version 2, which devices follow
        releases = d.metric("mergestream_feed_releases_total")
        assert "-> 2" in run_cli("rollback", "--config", d.config, "--to", "2").stdout
        feed_names(2)
        assert feed_status(feed)["rollback"] and d.metric("mergestream_feed_releases_total") > releases
        st = pull()
        assert st["current"]["version"] == 2 and st["plan"].startswith("patches 3->2")
        assert same_files(device / "current", state / "000002" / "model")

        # nothing new for longer than the timestamp's 6 s lifetime: re-signed, so not frozen
        before = _ts_version(feed)
        time.sleep(7)
        assert _ts_version(feed) > before and d.metric("mergestream_feed_timestamp_refreshes_total") >= 2
        proc = agent("pull", "--feed", server.url, "--model-dir", device)
        assert proc.returncode == 0 and proc.stdout.startswith("up to date"), proc.stderr
        assert d.metric('mergestream_feed_errors_total{kind="build"}') == 0
    finally:
        server.close()
        assert d.stop() == 0


def _publisher(tmp_path: Path, **feed) -> tuple[FeedPublisher, Metrics, Path]:
    store = make_store(tmp_path / "state", versions=3)
    keys = tmp_path / "keys"
    generate(keys)
    cfg_file = tmp_path / "config.yaml"
    save_tensors(tmp_path / "base.safetensors", tiny_base())
    cfg_file.write_text(json.dumps({"base": "base.safetensors", "state_dir": "state",
                                    "feed": {"dir": "feed", "keys": "keys", "retry_seconds": 0.2, **feed}}))
    metrics = Metrics(CollectorRegistry())
    pub = build_feed_publisher(load_config(cfg_file), metrics)
    assert pub is not None and store.current() == 3
    return pub, metrics, tmp_path / "feed"


def _wait(cond, timeout: float = 30) -> None:
    end = time.time() + timeout
    while not cond():
        assert time.time() < end, "timed out"
        time.sleep(0.05)


def _value(metrics: Metrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels or None) or 0.0


def test_a_failing_feed_build_is_counted_retried_and_never_touches_the_store(tmp_path):
    pub, metrics, feed = _publisher(tmp_path)
    keys, state = tmp_path / "keys", tmp_path / "state"
    before = {p: p.stat().st_mtime_ns for p in state.rglob("*")}
    os.replace(keys / "snapshot.pem", tmp_path / "snapshot.pem")  # the key vanishes after start
    pub.start(3)
    try:
        _wait(lambda: _value(metrics, "mergestream_feed_errors_total", kind="build") >= 1)
        assert feed_status(feed) is None and not pub.idle()  # no half release; still wanted
        assert {p: p.stat().st_mtime_ns for p in state.rglob("*")} == before
        os.replace(tmp_path / "snapshot.pem", keys / "snapshot.pem")
        _wait(lambda: pub.idle() and feed_status(feed) is not None)
        assert feed_status(feed)["latest"] == 3 and _value(metrics, "mergestream_feed_releases_total") == 1
        pub.point(1)  # the store's hook after a rollback: returns at once, built in the background
        _wait(lambda: pub.idle() and feed_status(feed)["latest"] == 1)
        assert feed_status(feed)["rollback"] and _value(metrics, "mergestream_feed_release") == 2
        assert _value(metrics, "mergestream_feed_version_bytes", version="3") > 0
    finally:
        pub.close()


def test_close_finishes_a_pending_build(tmp_path):
    pub, _, feed = _publisher(tmp_path)
    pub.start(None)  # no build wanted at start
    pub.point(2)
    pub.close()
    assert feed_status(feed)["latest"] == 2


def test_refresh_resigns_the_timestamp_without_a_new_release(tmp_path):
    pub, metrics, feed = _publisher(tmp_path, expires={"timestamp": "1h"})
    assert pub.publish(3)
    st = feed_status(feed)
    assert pub.refresh() and _value(metrics, "mergestream_feed_timestamp_refreshes_total") == 1
    again = feed_status(feed)
    assert again["release"] == st["release"] and again["timestamp_version"] == st["timestamp_version"] + 1
    assert pub.publish(3)  # the next release's timestamp still goes up
    assert feed_status(feed)["timestamp_version"] == again["timestamp_version"] + 1


def test_a_restarted_daemon_shows_the_feeds_sizes_without_rebuilding(tmp_path):
    pub, metrics, feed = _publisher(tmp_path)
    assert pub.publish(3)
    release = feed_status(feed)["release"]
    rep = feed_report(feed)
    for v, n in rep["bytes_to_latest"].items():  # the report read back equals what the build measured
        assert _value(metrics, "mergestream_feed_bytes_to_latest", from_version=v) == n
    for v, n in rep["bytes_per_version"].items():
        assert _value(metrics, "mergestream_feed_version_bytes", version=v) == n
    assert set(rep["bytes_to_latest"]) == {"none", "1", "2", "3"} and rep["bytes_to_latest"]["3"] == 0
    again = Metrics(CollectorRegistry())
    restarted = FeedPublisher(tmp_path / "state", pub.fc, again)
    restarted.start(3)  # in step with current: nothing to build
    restarted.close()
    assert feed_status(feed)["release"] == release and _value(again, "mergestream_feed_releases_total") == 0
    assert _value(again, "mergestream_feed_bytes_to_latest", from_version="1") == rep["bytes_to_latest"]["1"] > 0


def test_feed_config_is_checked(tmp_path):
    save_tensors(tmp_path / "base.safetensors", tiny_base())
    cases = [({"dir": "feed"}, "needs feed.keys"),
             ({"dir": "feed", "keys": "k", "zstd_level": 3}, "needs feed.patch_format: 2"),
             ({"dir": "feed", "keys": "k", "expires": {"timstamp": "1d"}}, "unknown role"),
             ({"dir": "feed", "keys": "k", "expires": {"timestamp": "10m"}, "refresh_seconds": 900}, "shorter"),
             ({"dir": "feed", "keys": "k", "expires": {"timestamp": "soon"}}, "not a duration")]
    for feed, words in cases:
        (tmp_path / "c.yaml").write_text(json.dumps({"base": "base.safetensors", "feed": feed}))
        with pytest.raises(ConfigError, match=words):
            load_config(tmp_path / "c.yaml")
    (tmp_path / "c.yaml").write_text(json.dumps({"base": "base.safetensors", "patch_zstd_level": 3}))
    with pytest.raises(ConfigError, match="needs patch_format: 2"):
        load_config(tmp_path / "c.yaml")
    (tmp_path / "c.yaml").write_text(json.dumps({"base": "base.safetensors", "feed": {"dir": "f", "keys": "nokeys"}}))
    cfg = load_config(tmp_path / "c.yaml")
    assert cfg.feed.dir == tmp_path / "f" and cfg.feed.keys == tmp_path / "nokeys"
    with pytest.raises(ConfigError, match="feed.keys: .*no public key"):
        build_feed_publisher(cfg)


def test_make_patch_format_option(tmp_path):
    from mergestream.patches.cli import patch_cli

    store = make_store(tmp_path / "state", versions=2)
    a, b = store.path(1) / "model", store.path(2) / "model"
    run = CliRunner().invoke
    r1 = run(patch_cli, ["make-patch", "--from-dir", str(a), "--to-dir", str(b), "--out", str(tmp_path / "p1"),
                         "--json"])
    r2 = run(patch_cli, ["make-patch", "--from-dir", str(a), "--to-dir", str(b), "--out", str(tmp_path / "p2"),
                         "--format", "2", "--zstd", "3", "--json"])
    assert r1.exit_code == 0 and r2.exit_code == 0, (r1.output, r2.output)
    assert read_patch(tmp_path / "p1").metadata["patch_format"] == "mergestream-patch/1"
    assert read_patch(tmp_path / "p2").metadata["patch_format"] == "mergestream-patch/2"
    applied = run(patch_cli, ["apply-patch", str(a), str(tmp_path / "p2"), "--out", str(tmp_path / "b2")])
    assert applied.exit_code == 0, applied.output
    assert weights_sha256(tmp_path / "b2") == weights_sha256(b)
    bad = run(patch_cli, ["make-patch", "--from-dir", str(a), "--to-dir", str(b), "--out", str(tmp_path / "p3"),
                          "--zstd", "3"])
    assert bad.exit_code == 2 and "zstd needs format 2" in bad.output
