"""The registry source against a real MLflow registry (a SQLite store, ``file://`` artifacts) and a
real ledger: a registered model that does not exist (N8), versions stuck PENDING_REGISTRATION or
FAILED (B15), downloads that end early and damaged cached copies (R2).

Statuses and timestamps MLflow's client cannot set (a version stuck pending, registered an hour
ago) are written into the registry's own ``model_versions`` table, as a registry in that state holds
them; a download that ends early is MLflow's real download with the file cut short afterwards, as
a stream cut by a proxy leaves it."""

from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path

import mlflow.artifacts
import pytest
import yaml

from mergestream.config import Config, load_config
from mergestream.daemon.ledger import Ledger
from mergestream.daemon.sources import (
    DownloadIncomplete,
    ExpertReady,
    RegisteredModelMissing,
    SourceContext,
    VersionSkipped,
    safetensors_complete,
    source_notes,
)
from mergestream.daemon.sources import mlflow as registry_source
from mergestream.daemon.sources.mlflow_download import REFETCHES

from .conftest import run_cli, save_tensors
from .test_daemon import scaled_expert, tiny_base


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    """A SQLite registry with an experiment whose artifacts are local files."""
    from mlflow import MlflowClient

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        mp.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        root = tmp_path_factory.mktemp("registry")
        uri = f"sqlite:///{root}/mlflow.db"
        client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        exp = client.create_experiment("experts", artifact_location=(root / "artifacts").as_uri())
        yield {"uri": uri, "db": root / "mlflow.db", "client": client, "exp": exp, "root": root}


def publish(reg, model: str, seed: int, *, single_file: bool = False) -> int:
    """Register a new version of ``model`` (created if needed): a two-file expert folder logged as
    ``runs:/<run>/expert``, or (``single_file``) one safetensors file named by its artifact URI."""
    client = reg["client"]
    if not client.search_registered_models(f"name = '{model}'"):
        client.create_registered_model(model)
    src = reg["root"] / "src" / f"{model}-{seed}"
    save_tensors(src / "model.safetensors", scaled_expert(tiny_base(), seed))
    (src / "config.json").write_text('{"architectures": ["Tiny"], "hidden_size": 48}')
    run = client.create_run(reg["exp"])
    client.log_artifacts(run.info.run_id, str(src), "expert")
    client.set_terminated(run.info.run_id)
    source = (f"{run.info.artifact_uri}/expert/model.safetensors" if single_file
              else f"runs:/{run.info.run_id}/expert")
    return int(client.create_model_version(model, source, run_id=run.info.run_id).version)


def set_state(reg, model: str, version: int, status: str, age_seconds: float = 0.0) -> None:
    """Put a version in ``status``, registered and last updated ``age_seconds`` ago."""
    ms = int((time.time() - age_seconds) * 1000)
    with sqlite3.connect(reg["db"]) as db:
        n = db.execute("UPDATE model_versions SET status = ?, creation_time = ?, last_updated_time = ?"
                       " WHERE name = ? AND version = ?", (status, ms, ms, model, version)).rowcount
    assert n == 1


class Harness:
    """A registry source built from the config by its builder, on a real ledger: emitted events are
    enqueued as the service does (``on_enqueued`` moves the cursor)."""

    def __init__(self, tmp_path: Path, reg, models: list[str], ledger: Ledger | None = None, **registry):
        self.ledger = ledger or Ledger(tmp_path / "ledger.sqlite")
        self.errors: list[Exception] = []
        self.events: list[ExpertReady] = []
        cfg = Config(base=tmp_path / "base.safetensors", inbox=tmp_path / "inbox", state_dir=tmp_path / "state",
                     watch={"enabled": False}, metrics={"enabled": False},
                     mlflow={"enabled": False, "registry": {"enabled": True, "models": models, "tracking_uri": reg["uri"],
                                                            "max_retries": 0, **registry}})
        ctx = SourceContext(cursors=self.ledger, on_error=lambda name, exc: self.errors.append(exc))
        (self.src,) = registry_source.build(cfg, self._emit, ctx)

    def _emit(self, ev: ExpertReady) -> None:
        self.events.append(ev)
        self.src.on_enqueued(ev)

    def poll(self) -> list[str]:
        return [e.registry_key for e in self.src.poll()]

    def notes(self) -> dict[str, tuple[str, str]]:
        return {n["subject"]: (n["level"], n["message"]) for n in source_notes(self.ledger)}


# ------------------------------------------------------------------------------------------
# N8: a registered model that does not exist
# ------------------------------------------------------------------------------------------
def test_a_missing_registered_model_is_an_error_on_every_poll_until_it_exists(tmp_path, reg, caplog):
    publish(reg, "team-experts", 1)
    h = Harness(tmp_path, reg, ["team-experts", "team-exprets"])
    with caplog.at_level(logging.WARNING, logger="mergestream.daemon.sources"):
        assert h.poll() == ["mlflow:team-experts:1"]  # the other model goes on
        assert h.poll() == []
    assert len(h.errors) == 2 and all(isinstance(e, RegisteredModelMissing) for e in h.errors)
    assert "'team-exprets' does not exist" in str(h.errors[0]) and "'team-experts'" in str(h.errors[0])  # a hint
    assert sum("team-exprets" in r.getMessage() for r in caplog.records) == 2  # a warning on each poll
    assert list(h.notes()) == ["model:team-exprets"] and h.notes()["model:team-exprets"][0] == "error"
    reg["client"].create_registered_model("team-exprets")  # fixed: it exists (with no version yet)
    assert h.poll() == [] and len(h.errors) == 2
    assert h.notes() == {}


def test_a_renamed_registered_model_is_reported_with_its_new_name(tmp_path, reg):
    publish(reg, "renamed-src", 1)
    h = Harness(tmp_path, reg, ["renamed-src"])
    assert h.poll() == ["mlflow:renamed-src:1"] and h.errors == []
    reg["client"].rename_registered_model("renamed-src", "renamed-src-team-a")
    publish(reg, "renamed-src-team-a", 2)
    for _ in range(3):
        assert h.poll() == []
    assert len(h.errors) == 3 and "'renamed-src-team-a'" in str(h.errors[-1])
    assert "renamed or misspelt" in h.notes()["model:renamed-src"][1]


def test_the_service_counts_a_missing_model_and_status_shows_it(tmp_path, reg):
    from mergestream.daemon.service import Service

    save_tensors(tmp_path / "base.safetensors", tiny_base())
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "base": "base.safetensors", "watch": {"enabled": False}, "metrics": {"enabled": False},
        "mlflow": {"enabled": False, "registry": {"enabled": True, "models": ["no-such-model"],
                                                  "tracking_uri": reg["uri"], "interval_seconds": 3600}}}))
    svc = Service(load_config(cfg_path), serve_metrics=False)
    svc.start()
    try:
        end = time.time() + 30
        count = lambda: svc.metrics.registry.get_sample_value("mergestream_source_errors_total", {"source": "mlflow"})
        while not count() and time.time() < end:
            time.sleep(0.1)
        assert count() == 1
        doc = yaml.safe_load(run_cli("status", "--config", cfg_path, "--json").stdout)
        assert {"current_version", "versions", "policy", "queue_depth", "daemon_running", "tracking_pending",
                "experts"} <= set(doc)  # the existing fields stay
        (note,) = doc["sources"]["mlflow"]
        assert note["subject"] == "model:no-such-model" and note["level"] == "error" and note["since"] > 0
        text = run_cli("status", "--config", cfg_path).stdout
        assert "source mlflow error: registered model 'no-such-model' does not exist" in text
    finally:
        svc.stop()
        svc.shutdown()


# ------------------------------------------------------------------------------------------
# B15: versions stuck pending, failed versions
# ------------------------------------------------------------------------------------------
def test_a_version_pending_too_long_is_skipped_once_and_later_ones_flow(tmp_path, reg, caplog):
    for seed in (1, 2, 3):
        publish(reg, "pend", seed)
    set_state(reg, "pend", 2, "PENDING_REGISTRATION")
    h = Harness(tmp_path, reg, ["pend"])
    assert h.src.pending_timeout_seconds == 3600  # the default
    assert h.poll() == ["mlflow:pend:1"] and h.errors == []  # 3 waits behind the pending 2
    assert h.poll() == []
    set_state(reg, "pend", 2, "PENDING_REGISTRATION", age_seconds=2 * 3600)
    with caplog.at_level(logging.WARNING, logger="mergestream.daemon.sources"):
        assert h.poll() == ["mlflow:pend:3"]
        assert h.poll() == []
    assert len(h.errors) == 1 and isinstance(h.errors[0], VersionSkipped)
    assert "PENDING_REGISTRATION" in str(h.errors[0]) and "pending_timeout_seconds" in str(h.errors[0])
    assert sum("skipped" in r.getMessage() for r in caplog.records) == 1
    assert h.notes()["skipped:pend"][0] == "warning"


def test_failed_versions_are_warned_once_across_polls_and_restarts(tmp_path, reg, caplog):
    for seed in (1, 2, 3):
        publish(reg, "failing", seed)
    set_state(reg, "failing", 2, "FAILED_REGISTRATION")
    set_state(reg, "failing", 3, "FAILED_REGISTRATION")
    h = Harness(tmp_path, reg, ["failing"])
    with caplog.at_level(logging.WARNING, logger="mergestream.daemon.sources"):
        assert h.poll() == ["mlflow:failing:1"]
        for _ in range(3):
            assert h.poll() == []
        assert len(h.errors) == 2 and {str(e).split(" of ")[0] for e in h.errors} == {"version 2", "version 3"}
        restarted = Harness(tmp_path, reg, ["failing"], ledger=h.ledger)  # the daemon starts again
        assert restarted.poll() == [] and restarted.errors == []
    assert sum("skipped" in r.getMessage() for r in caplog.records) == 2
    publish(reg, "failing", 4)
    assert restarted.poll() == ["mlflow:failing:4"] and restarted.errors == []


def test_a_skipped_pending_version_that_turns_ready_before_a_later_one_is_taken(tmp_path, reg):
    publish(reg, "late-ready", 1)
    set_state(reg, "late-ready", 1, "PENDING_REGISTRATION", age_seconds=120)
    h = Harness(tmp_path, reg, ["late-ready"], pending_timeout_seconds=60)
    assert h.poll() == [] and len(h.errors) == 1  # skipped after the configured 60 s
    set_state(reg, "late-ready", 1, "READY", age_seconds=120)
    assert h.poll() == ["mlflow:late-ready:1"] and len(h.errors) == 1


# ------------------------------------------------------------------------------------------
# R2: downloads that end early, damaged cached copies
# ------------------------------------------------------------------------------------------
@pytest.fixture
def cut_downloads(monkeypatch):
    """MLflow's real download, with its safetensors files cut to 80 % in the first ``state["cut"]``
    downloads (a stream that ended early without an error)."""
    state = {"cut": 0, "downloads": 0}
    real = mlflow.artifacts.download_artifacts

    def download(*args, **kwargs):
        out = real(*args, **kwargs)
        state["downloads"] += 1
        if state["downloads"] <= state["cut"]:
            for p in Path(kwargs["dst_path"]).rglob("*.safetensors"):
                data = p.read_bytes()
                p.write_bytes(data[: int(len(data) * 0.8)])
        return out

    monkeypatch.setattr(mlflow.artifacts, "download_artifacts", download)
    return state


def _whole(uri: str) -> bool:
    p = Path(uri)
    files = [p] if p.is_file() else list(p.rglob("*.safetensors"))
    return bool(files) and all(safetensors_complete(f) for f in files)


@pytest.mark.parametrize("single_file", [False, True], ids=["folder", "file"])
@pytest.mark.parametrize("cut", [1, REFETCHES])
def test_a_download_that_ends_early_is_fetched_again_before_it_is_emitted(tmp_path, reg, cut_downloads, single_file,
                                                                          cut):
    model = f"short-{int(single_file)}-{cut}"
    publish(reg, model, 1, single_file=single_file)
    cut_downloads["cut"] = cut
    h = Harness(tmp_path, reg, [model])
    assert h.poll() == [f"mlflow:{model}:1"] and h.errors == []
    assert cut_downloads["downloads"] == cut + 1 and _whole(h.events[0].uri)


def test_a_download_that_never_matches_is_an_error_and_the_next_poll_fetches_it(tmp_path, reg, cut_downloads):
    publish(reg, "always-short", 1)
    cut_downloads["cut"] = 10**6
    h = Harness(tmp_path, reg, ["always-short"])
    assert h.poll() == [] and len(h.errors) == 1 and isinstance(h.errors[0], DownloadIncomplete)
    assert "bytes, the listing says" in str(h.errors[0])
    assert h.ledger.get_cursor("mlflow:always-short") is None  # not taken, so not passed over
    assert not (tmp_path / "state" / "cache" / "always-short" / "1").exists()  # nothing cached
    assert "download failed" in h.notes()["model:always-short"][1]
    cut_downloads["cut"] = 0
    assert h.poll() == ["mlflow:always-short:1"] and _whole(h.events[0].uri)
    assert h.notes() == {}


def test_a_damaged_cached_copy_is_discarded_and_fetched_again(tmp_path, reg, cut_downloads):
    """A copy cached before downloads were checked, or damaged on disk since: a poll that reuses
    it, and the check before a fold (what `retry` goes through), both fetch it again."""
    publish(reg, "cached", 1)
    h = Harness(tmp_path, reg, ["cached"])
    assert h.poll() == ["mlflow:cached:1"]
    uri = Path(h.events[0].uri)
    weights = uri / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated in the cache
    again = Harness(tmp_path / "again", reg, ["cached"])
    again.src.cache_dir = again.src._downloads.cache_dir = h.src.cache_dir  # same cache, empty ledger
    assert again.poll() == ["mlflow:cached:1"] and again.events[0].uri == str(uri) and _whole(str(uri))
    (uri / "config.json").unlink()  # a file of the folder gone
    weights.write_bytes(weights.read_bytes()[:-1])
    n = cut_downloads["downloads"]
    assert h.src.still_available("mlflow:cached:1") and h.errors == []
    assert cut_downloads["downloads"] == n + 1 and (uri / "config.json").is_file() and _whole(str(uri))


def test_the_service_folds_a_version_whose_first_download_ended_early_and_retry_fetches_again(
        tmp_path, reg, cut_downloads):
    """The R2 report end to end: the first download is cut short, yet the version is queued whole
    and accepted. Then a cached copy damaged while the registry cannot serve a whole one: the fold
    is rejected; `retry` once the registry serves it again downloads it anew and folds it."""
    from mergestream.daemon.service import Service

    for seed in (1, 2):
        publish(reg, "svc-short", seed)
    cut_downloads["cut"] = 1
    save_tensors(tmp_path / "base.safetensors", tiny_base())
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "base": "base.safetensors", "watch": {"enabled": False}, "metrics": {"enabled": False},
        "policy": {"name": "task_arithmetic"},
        "mlflow": {"enabled": False, "registry": {"enabled": True, "models": ["svc-short"], "tracking_uri": reg["uri"],
                                                  "interval_seconds": 3600, "max_retries": 0}}}))
    svc = Service(load_config(cfg_path), serve_metrics=False)
    svc.start()
    errors = lambda: svc.metrics.registry.get_sample_value("mergestream_source_errors_total", {"source": "mlflow"})
    try:
        def status(eid: str, *, fold: bool = True):
            for _ in range(300):
                if fold:
                    svc.step()
                row = svc.ledger.expert(eid)
                if row is not None and row.status not in ("pending", "folding"):
                    return row
                if row is not None and not fold:
                    return row
                time.sleep(0.1)
            raise AssertionError(f"{eid} not settled")

        second = status("svc-short-v2", fold=False)  # the poll queued both; nothing folded yet
        assert cut_downloads["downloads"] == 3  # version 1 short then whole, version 2 whole
        first = status("svc-short-v1")
        assert first.status == "accepted", first.reason
        weights = Path(second.uri) / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-10])
        cut_downloads["cut"] = 10**6  # every download now ends early
        second = status("svc-short-v2")
        assert second.status == "rejected", second.reason
        assert "expert is gone" in second.reason  # the damaged copy was discarded, none came back
        assert errors() == 1  # the fetch before the fold failed, counted
        cut_downloads["cut"] = 0
        svc.retry(second.expert_id)
        second = status("svc-short-v2")
        assert second.status == "accepted", second.reason
        assert safetensors_complete(weights) and errors() == 1
    finally:
        svc.stop()
        svc.shutdown()
