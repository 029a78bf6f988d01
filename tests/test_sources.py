"""Sources with real parts: watchdog events in temporary inboxes, a real MLflow tracking server
(``tests/mlflow_server.py``), real HTTP posts to the webhook receiver. No mocks."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import urllib.error
import urllib.request
import uuid
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save, save_file

from mergestream.daemon.sources import (
    ExpertReady,
    FolderSource,
    RegistrySource,
    WebhookReceiver,
    expert_complete,
    is_temporary_name,
    safetensors_complete,
    sign_webhook,
    torch_file_complete,
)
from mergestream.io.checkpoints import open_checkpoint
from tests.mlflow_server import free_port, mlflow_server  # noqa: F401  (fixture)

SETTLE = 0.5


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------
class Collector:
    """An ``emit`` callback that records events and lets a test wait for them."""

    def __init__(self):
        self.events: list[ExpertReady] = []
        self.times: list[float] = []
        self._cond = threading.Condition()

    def __call__(self, ev: ExpertReady) -> None:
        with self._cond:
            self.events.append(ev)
            self.times.append(time.monotonic())
            self._cond.notify_all()

    def wait_for(self, n: int, timeout: float = 10.0) -> list[ExpertReady]:
        with self._cond:
            self._cond.wait_for(lambda: len(self.events) >= n, timeout=timeout)
            return list(self.events)

    @property
    def uris(self) -> list[str]:
        return [e.uri for e in self.events]


def tensors(seed: int = 0, n: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn(n, n, generator=g), "layer.bias": torch.randn(n, generator=g)}


def st_bytes(seed: int = 0, n: int = 64) -> bytes:
    return save(tensors(seed, n))


def backdate(path: Path, seconds: float = 3600) -> None:
    """Make every file under ``path`` look written ``seconds`` ago (arrived while the daemon was down)."""
    t = time.time() - seconds
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.utime(p, (t, t))


def write_hf_folder(folder: Path, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    (folder / "model.safetensors").write_bytes(st_bytes(seed))
    return folder


def write_adapter(folder: Path, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    g = torch.Generator().manual_seed(seed)
    save_file({"base_model.model.layer.lora_A.weight": torch.randn(2, 64, generator=g),
               "base_model.model.layer.lora_B.weight": torch.randn(64, 2, generator=g)},
              str(folder / "adapter_model.safetensors"))
    return folder


def sharded_parts(seed: int = 0) -> tuple[dict, bytes, bytes]:
    t = tensors(seed)
    a, b = {"layer.weight": t["layer.weight"]}, {"layer.bias": t["layer.bias"]}
    index = {"metadata": {}, "weight_map": {"layer.weight": "model-00001-of-00002.safetensors",
                                            "layer.bias": "model-00002-of-00002.safetensors"}}
    return index, save(a), save(b)


@pytest.fixture
def inbox(tmp_path) -> Path:
    p = tmp_path / "inbox"
    p.mkdir()
    return p


@pytest.fixture
def started():
    """Start FolderSources and always stop them."""
    sources = []

    def _start(src: FolderSource) -> FolderSource:
        src.start()
        sources.append(src)
        return src

    yield _start
    for s in sources:
        s.stop()


# ------------------------------------------------------------------------------------------
# readiness checks (pure functions)
# ------------------------------------------------------------------------------------------
def test_temporary_names_are_recognised():
    for name in (".e.safetensors", "e.safetensors.tmp", "e.part", "e.partial", "e.crdownload",
                 "e.INCOMPLETE", "e.safetensors~", ".e1.abc123"):
        assert is_temporary_name(name), name
    for name in ("e.safetensors", "e1", "model-00001-of-00002.safetensors", "adapter_config.json"):
        assert not is_temporary_name(name), name


def test_safetensors_complete_rejects_every_truncation(tmp_path):
    data = st_bytes(1, 16)
    full = tmp_path / "full.safetensors"
    full.write_bytes(data)
    assert safetensors_complete(full)
    for cut in (0, 4, 8, 20, len(data) // 2, len(data) - 1):
        p = tmp_path / f"cut{cut}.safetensors"
        p.write_bytes(data[:cut])
        assert not safetensors_complete(p), cut
    (tmp_path / "long.safetensors").write_bytes(data + b"\0")
    assert not safetensors_complete(tmp_path / "long.safetensors")


def test_safetensors_complete_never_raises_on_a_hostile_header(tmp_path):
    for header in ({"t": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, [1, 2], {"t": 3}):
        raw = json.dumps(header).encode()
        p = tmp_path / "bad.safetensors"
        p.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * 4)
        assert not safetensors_complete(p), header


def test_torch_zip_file_complete_only_with_end_record(tmp_path):
    p = tmp_path / "e.pt"
    torch.save(tensors(0, 8), p)
    assert zipfile.is_zipfile(p) and torch_file_complete(p)
    data = p.read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) - 30])
    assert not torch_file_complete(tmp_path / "cut.pt")


def test_expert_complete_for_each_layout(tmp_path):
    assert expert_complete(write_hf_folder(tmp_path / "hf"))
    assert expert_complete(write_adapter(tmp_path / "lora"))
    index, a, b = sharded_parts()
    sh = tmp_path / "sharded"
    sh.mkdir()
    (sh / "model.safetensors.index.json").write_text(json.dumps(index))
    (sh / "model-00001-of-00002.safetensors").write_bytes(a)
    assert not expert_complete(sh)
    (sh / "model-00002-of-00002.safetensors").write_bytes(b[:-3])
    assert not expert_complete(sh)
    (sh / "model-00002-of-00002.safetensors").write_bytes(b)
    assert expert_complete(sh)
    (sh / "config.json").write_text('{"model_type": ')  # half-written config
    assert not expert_complete(sh)
    only_cfg = tmp_path / "lora2"
    only_cfg.mkdir()
    (only_cfg / "adapter_config.json").write_text("{}")
    assert not expert_complete(only_cfg)


# ------------------------------------------------------------------------------------------
# folder source: real watchdog events
# ------------------------------------------------------------------------------------------
def test_file_written_slowly_in_chunks_is_emitted_once_after_it_is_complete(inbox, started):
    got = Collector()
    started(FolderSource(inbox, got, settle_seconds=SETTLE))
    data = st_bytes(1, 128)
    chunks = [data[i:i + len(data) // 6 + 1] for i in range(0, len(data), len(data) // 6 + 1)]
    target = inbox / "slow.safetensors"
    with open(target, "wb") as fh:
        for i, chunk in enumerate(chunks):
            if i:  # pauses shorter and longer than the settle time: stable but incomplete
                time.sleep(0.2 if i % 2 else 2 * SETTLE)
            # checked before the last chunk, not after it: once it is written (and its fsync, slow
            # on a loaded machine, returns) the source may rightly emit before the test looks
            assert got.events == [], f"emitted before chunk {i + 1} of {len(chunks)} was written"
            last_write = time.monotonic()
            fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())
    got.wait_for(1, timeout=10)
    time.sleep(3 * SETTLE)  # a second emission would show up here
    assert got.uris == [str(target)]
    assert got.events[0] == ExpertReady("folder", str(target), "slow", None, {})
    assert got.times[0] >= last_write


@pytest.mark.parametrize("layout", ["file", "folder"])
def test_writer_that_goes_on_while_the_candidate_is_checked_is_emitted_once(inbox, started, monkeypatch, layout):
    """A writer stalled past the settle time (here: a half-written expert that looks at rest) and
    going on while the source runs its completeness check: the candidate must not be emitted with
    the signature it had before the check (it would be emitted again once the change is seen),
    but once, after it settled whole. Regression: CI saw a folder expert emitted twice under load."""
    from mergestream.daemon.sources import folder as folder_module

    data = st_bytes(3, 128)
    if layout == "file":
        target = weights = inbox / "stalled.safetensors"
    else:
        target = inbox / "stalled-hf"
        target.mkdir()
        weights = target / "model.safetensors"
    weights.write_bytes(data[: len(data) // 2])
    backdate(target)
    real, finished = folder_module.expert_complete, []

    def writer_resumes_during_the_check(path):
        if not finished:  # the stalled writer finishes exactly while the source looks at the entry
            weights.write_bytes(data)
            finished.append(time.monotonic())
        return real(path)

    monkeypatch.setattr(folder_module, "expert_complete", writer_resumes_during_the_check)
    got = Collector()
    started(FolderSource(inbox, got, settle_seconds=SETTLE))
    got.wait_for(1, timeout=10)
    time.sleep(4 * SETTLE)  # a second emission would show up here
    assert finished and got.uris == [str(target)]
    assert got.times[0] - finished[0] >= SETTLE * 0.9  # emitted after it settled in its final form
    assert expert_complete(target)


def test_folder_with_ready_marker_is_emitted_without_waiting_to_settle(inbox, started):
    got = Collector()
    started(FolderSource(inbox, got, settle_seconds=60))  # only the marker can make it ready
    folder = write_hf_folder(inbox / "marked")
    time.sleep(0.5)
    assert got.events == []
    t0 = time.monotonic()
    (folder / "READY").touch()
    got.wait_for(1, timeout=5)
    assert got.uris == [str(folder)]
    assert got.events[0].expert_id == "marked"
    assert got.times[0] - t0 < 5
    (folder / "READY").write_text("again")  # touching the marker is not a change of the expert
    time.sleep(1.0)
    assert len(got.events) == 1


def test_single_file_with_ready_marker_beside_it(inbox, started):
    got = Collector()
    started(FolderSource(inbox, got, settle_seconds=60))
    (inbox / "e7.safetensors").write_bytes(st_bytes(7))
    time.sleep(0.3)
    assert got.events == []
    (inbox / "e7.safetensors.READY").touch()
    got.wait_for(1, timeout=5)
    time.sleep(0.5)
    assert got.uris == [str(inbox / "e7.safetensors")]
    assert got.events[0].expert_id == "e7"


def test_file_renamed_into_place_from_a_temporary_name(inbox, started):
    got = Collector()
    started(FolderSource(inbox, got, settle_seconds=SETTLE))
    tmp = inbox / ".e2.safetensors.tmp"
    tmp.write_bytes(st_bytes(2))
    time.sleep(3 * SETTLE)
    assert got.events == [], "a temporary name was emitted"
    t0 = time.monotonic()
    os.rename(tmp, inbox / "e2.safetensors")
    got.wait_for(1, timeout=5)
    time.sleep(2 * SETTLE)
    assert got.uris == [str(inbox / "e2.safetensors")]
    # written > settle seconds before the rename: ready at once, no extra settle wait
    assert got.times[0] - t0 < 5


def test_folder_renamed_into_place(inbox, started):
    got = Collector()
    started(FolderSource(inbox, got, settle_seconds=SETTLE))
    staging = write_adapter(inbox / ".lora1.partial")
    time.sleep(2 * SETTLE)
    assert got.events == []
    os.rename(staging, inbox / "lora1")
    got.wait_for(1, timeout=5)
    time.sleep(2 * SETTLE)
    assert got.uris == [str(inbox / "lora1")]


def test_temporary_names_are_ignored(inbox, started):
    got = Collector()
    src = started(FolderSource(inbox, got, settle_seconds=SETTLE))
    for name in (".hidden.safetensors", "a.safetensors.tmp", "b.part", "c.partial", "d.crdownload",
                 "e.incomplete", "f.safetensors~"):
        (inbox / name).write_bytes(st_bytes(3))
    write_hf_folder(inbox / ".staging")
    write_hf_folder(inbox / "g.tmp")
    time.sleep(4 * SETTLE)
    assert got.events == []
    for p in inbox.iterdir():
        backdate(p)
    assert src.scan() == []
    assert got.events == []


def test_sharded_folder_is_emitted_only_after_its_last_shard_arrives(inbox, started):
    got = Collector()
    started(FolderSource(inbox, got, settle_seconds=SETTLE))
    index, a, b = sharded_parts(4)
    folder = inbox / "sharded"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "model-00001-of-00002.safetensors").write_bytes(a)
    time.sleep(4 * SETTLE)
    assert got.events == [], "emitted with a shard missing"
    # the last shard is downloaded under a temporary name, then renamed
    part = folder / "model-00002-of-00002.safetensors.part"
    part.write_bytes(b[: len(b) // 2])
    time.sleep(3 * SETTLE)
    assert got.events == []
    with open(part, "ab") as fh:
        fh.write(b[len(b) // 2:])
    os.rename(part, folder / "model-00002-of-00002.safetensors")
    got.wait_for(1, timeout=10)
    time.sleep(3 * SETTLE)
    assert got.uris == [str(folder)]
    with open_checkpoint(got.events[0].uri) as ck:
        assert sorted(ck.keys()) == ["layer.bias", "layer.weight"]


def test_startup_scan_emits_what_arrived_while_down(inbox, started):
    write_hf_folder(inbox / "hf1", seed=1)
    write_adapter(inbox / "lora1", seed=2)
    (inbox / "e3.safetensors").write_bytes(st_bytes(3))
    torch.save(tensors(4, 8), inbox / "e4.pt")
    (inbox / "cut.safetensors").write_bytes(st_bytes(5)[:-10])  # truncated: never ready
    index, a, _ = sharded_parts(6)
    (inbox / "half").mkdir()
    (inbox / "half" / "model.safetensors.index.json").write_text(json.dumps(index))
    (inbox / "half" / "model-00001-of-00002.safetensors").write_bytes(a)
    for p in inbox.iterdir():
        backdate(p)
    expected = sorted(str(inbox / n) for n in ("hf1", "lora1", "e3.safetensors", "e4.pt"))

    got = Collector()
    assert sorted(e.uri for e in FolderSource(inbox, got, settle_seconds=SETTLE).scan()) == expected
    assert sorted(got.uris) == expected

    got2 = Collector()
    src = started(FolderSource(inbox, got2, settle_seconds=SETTLE))
    assert sorted(got2.uris) == expected, "start() must emit synchronously what is already there"
    assert src.scan() == [], "an emitted expert is not emitted twice"
    time.sleep(3 * SETTLE)
    assert sorted(got2.uris) == expected
    assert {e.expert_id for e in got2.events} == {"hf1", "lora1", "e3", "e4"}


def test_polling_observer_mode(inbox, started):
    got = Collector()
    started(FolderSource(inbox, got, settle_seconds=SETTLE, polling=True, poll_interval=0.2))
    data = st_bytes(8)
    with open(inbox / "polled.safetensors", "wb") as fh:
        fh.write(data[:100])
        fh.flush()
        time.sleep(3 * SETTLE)
        fh.write(data[100:])
    assert got.events == []
    got.wait_for(1, timeout=10)
    folder = write_hf_folder(inbox / "polled-folder")
    (folder / "READY").touch()
    got.wait_for(2, timeout=10)
    time.sleep(3 * SETTLE)
    assert got.uris == [str(inbox / "polled.safetensors"), str(folder)]


def test_emitted_expert_is_not_emitted_again_unless_it_changes(inbox, started):
    got = Collector()
    started(FolderSource(inbox, got, settle_seconds=SETTLE))
    path = inbox / "e9.safetensors"
    path.write_bytes(st_bytes(9))
    got.wait_for(1, timeout=10)
    with open_checkpoint(path) as ck:  # reading it (what the service does) is not a change
        ck.get("layer.bias")
    time.sleep(4 * SETTLE)
    assert len(got.events) == 1
    # a copy of the same content under another name is another path: emitted
    shutil.copyfile(path, inbox / "e9-copy.safetensors")
    got.wait_for(2, timeout=10)
    # the same name written again (copied twice): emitted again, the ledger dedups by content
    path.write_bytes(st_bytes(10))
    got.wait_for(3, timeout=10)
    # a folder emitted after settling, then marked READY by a late producer: not emitted again
    folder = write_hf_folder(inbox / "hf9")
    got.wait_for(4, timeout=10)
    (folder / "READY").touch()
    time.sleep(4 * SETTLE)
    assert got.uris == [str(path), str(inbox / "e9-copy.safetensors"), str(path), str(folder)]


def test_failing_emit_is_retried(inbox, started):
    calls, times = [], []

    def flaky(ev):
        calls.append(ev)
        times.append(time.monotonic())
        if len(calls) == 1:
            raise RuntimeError("ledger busy")

    started(FolderSource(inbox, flaky, settle_seconds=SETTLE))
    (inbox / "e11.safetensors").write_bytes(st_bytes(11))
    deadline = time.monotonic() + 10
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(3 * SETTLE)
    assert [c.uri for c in calls] == [str(inbox / "e11.safetensors")] * 2
    assert times[1] - times[0] >= 0.9  # retried after max(settle, 1 s), not at every tick


# ------------------------------------------------------------------------------------------
# webhook receiver: real HTTP
# ------------------------------------------------------------------------------------------
def _post(url: str, body: bytes, headers: dict[str, str]) -> int:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _mlflow_headers(secret: str, body: bytes, *, ts: int | None = None) -> dict[str, str]:
    """Headers exactly as MLflow's delivery code signs them (its own signing function)."""
    from mlflow.webhooks.delivery import _generate_hmac_signature

    delivery_id, stamp = str(uuid.uuid4()), str(int(time.time()) if ts is None else ts)
    return {"X-MLflow-Delivery-Id": delivery_id, "X-MLflow-Timestamp": stamp,
            "X-MLflow-Signature": _generate_hmac_signature(secret, delivery_id, stamp, body.decode())}


def test_webhook_signed_event_triggers_and_bad_signature_gets_401():
    hits = []
    rx = WebhookReceiver("127.0.0.1", 0, "s3cret", lambda: hits.append(1))
    rx.start()
    try:
        url = f"http://127.0.0.1:{rx.port}/hooks/mlflow"
        body = json.dumps({"entity": "model_version", "action": "created", "timestamp": "2026-01-01T00:00:00Z",
                           "data": {"name": "m", "version": "3", "source": "runs:/x/e", "run_id": "x",
                                    "tags": {}, "description": None}}).encode()
        good = _mlflow_headers("s3cret", body)
        assert good["X-MLflow-Signature"] == sign_webhook("s3cret", good["X-MLflow-Delivery-Id"],
                                                          good["X-MLflow-Timestamp"], body)
        assert _post(url, body, good) == 200 and hits == [1]
        assert _post(url, body, _mlflow_headers("wrong", body)) == 401
        tampered = body.replace(b'"3"', b'"4"')
        assert _post(url, tampered, good) == 401
        assert _post(url, body, {}) == 401
        assert _post(url, body, _mlflow_headers("s3cret", body, ts=int(time.time()) - 3600)) == 401  # replay
        other = json.dumps({"entity": "model_version_tag", "action": "set", "data": {}}).encode()
        assert _post(url, other, _mlflow_headers("s3cret", other)) == 200
        assert hits == [1]
    finally:
        rx.stop()


# ------------------------------------------------------------------------------------------
# registry source: a real MLflow tracking server
# ------------------------------------------------------------------------------------------
@pytest.fixture
def quiet_mlflow(monkeypatch):
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")


def _register(client, exp_id: str, model: str, n: int, tmp: Path, *, tags=None, seed0: int = 0) -> list[str]:
    """Register versions 1..n of ``model``: each a distinct tiny safetensors file logged as a run
    artifact; odd versions point at ``runs:/<run>/...``, even ones at the run's artifact URI."""
    from mlflow.entities.model_registry.model_version_status import ModelVersionStatus

    client.create_registered_model(model)
    run = client.create_run(exp_id)
    rid = run.info.run_id
    versions = []
    for i in range(1, n + 1):
        f = tmp / f"{model}-{i}" / "expert.safetensors"
        f.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors(seed0 + i, 8), str(f))
        client.log_artifact(rid, str(f), f"expert-{i}")
        source = f"runs:/{rid}/expert-{i}" if i % 2 else f"{run.info.artifact_uri}/expert-{i}/expert.safetensors"
        mv = client.create_model_version(model, source=source, run_id=rid,
                                         tags=(tags(i) if tags else None) or None)
        assert mv.status == ModelVersionStatus.to_string(ModelVersionStatus.READY)
        versions.append(mv.version)
    client.set_terminated(rid)
    return versions


@pytest.fixture(scope="module")
def registry(mlflow_server, tmp_path_factory):  # noqa: F811
    """The server with model ``expert-a`` (versions 1..10) registered."""
    from mlflow import MlflowClient

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        client = MlflowClient(mlflow_server.uri, mlflow_server.uri)
        exp_id = client.create_experiment("experts")
        tmp = tmp_path_factory.mktemp("artifacts")
        assert _register(client, exp_id, "expert-a", 10, tmp) == [str(i) for i in range(1, 11)]
        yield {"uri": mlflow_server.uri, "client": client, "exp": exp_id, "tmp": tmp}


@pytest.mark.slow
def test_registry_emits_ten_versions_in_integer_order(registry, tmp_path, quiet_mlflow):
    got, errors = Collector(), []
    src = RegistrySource(["expert-a"], got, last_version=lambda m: 0, cache_dir=tmp_path / "cache",
                         tracking_uri=registry["uri"], on_error=errors.append)
    src.PAGE_SIZE = 3  # four pages: the PagedList token loop is exercised
    events = src.poll()
    assert errors == []
    assert [e.registry_key for e in events] == [f"mlflow:expert-a:{v}" for v in range(1, 11)]
    assert [e.expert_id for e in events] == [f"expert-a-v{v}" for v in range(1, 11)]
    assert got.events == events
    for v, e in enumerate(events, start=1):
        assert e.source == "mlflow"
        assert Path(e.uri).is_relative_to(tmp_path / "cache" / "expert-a" / str(v))
        assert e.metadata["mlflow.version"] == str(v) and e.metadata["mlflow.run_id"]
        with open_checkpoint(e.uri) as ck:  # the reader opens what was emitted
            assert torch.equal(ck.get("layer.bias"), tensors(v, 8)["layer.bias"])
    # the ledger says 10: nothing new
    again = RegistrySource(["expert-a"], got, last_version=lambda m: 10, cache_dir=tmp_path / "cache",
                           tracking_uri=registry["uri"], on_error=errors.append)
    assert again.poll() == []
    # the source's own memory also stops duplicates while the ledger lags
    assert src.poll() == []
    # a restart with an empty ledger reuses the cache (same paths, no stray staging folders)
    fresh = RegistrySource(["expert-a"], Collector(), last_version=lambda m: 7, cache_dir=tmp_path / "cache",
                           tracking_uri=registry["uri"], on_error=errors.append)
    assert [e.uri for e in fresh.poll()] == [e.uri for e in events[7:]]
    assert not list((tmp_path / "cache" / "expert-a").glob(".*"))
    assert errors == []


@pytest.mark.slow
def test_registry_skips_a_version_deleted_before_it_was_folded(registry, tmp_path, quiet_mlflow, caplog):
    client = registry["client"]
    _register(client, registry["exp"], "expert-del", 4, registry["tmp"], seed0=100)
    client.delete_model_version("expert-del", "2")
    got, errors = Collector(), []
    src = RegistrySource(["expert-del"], got, last_version=lambda m: 0, cache_dir=tmp_path / "cache",
                         tracking_uri=registry["uri"], on_error=errors.append)
    with caplog.at_level(logging.INFO, logger="mergestream.daemon.sources"):
        events = src.poll()
    assert [e.metadata["mlflow.version"] for e in events] == ["1", "3", "4"]
    assert any("deleted" in r.getMessage() and "[2]" in r.getMessage() for r in caplog.records)
    assert errors == []


@pytest.mark.slow
def test_registry_download_failure_is_retried_then_blocks_later_versions(registry, tmp_path, quiet_mlflow, caplog):
    client = registry["client"]
    _register(client, registry["exp"], "expert-broken", 1, registry["tmp"], seed0=400)
    run = client.create_run(registry["exp"])
    client.create_model_version("expert-broken", source=f"runs:/{run.info.run_id}/missing", run_id=run.info.run_id)
    good_run = client.create_run(registry["exp"])
    f = tmp_path / "e.safetensors"
    save_file(tensors(403, 8), str(f))
    client.log_artifact(good_run.info.run_id, str(f), "expert")
    client.create_model_version("expert-broken", source=f"runs:/{good_run.info.run_id}/expert",
                                run_id=good_run.info.run_id)
    got, errors = Collector(), []
    src = RegistrySource(["expert-broken"], got, last_version=lambda m: 0, cache_dir=tmp_path / "cache",
                         tracking_uri=registry["uri"], max_retries=2, backoff_seconds=0.05, on_error=errors.append)
    with caplog.at_level(logging.WARNING, logger="mergestream.daemon.sources"):
        events = src.poll()
    assert [e.registry_key for e in events] == ["mlflow:expert-broken:1"]  # 3 must not overtake 2
    assert len(errors) == 1
    assert sum("download attempt" in r.getMessage() for r in caplog.records) == 2  # two retries
    assert not list((tmp_path / "cache" / "expert-broken").glob(".*")), "staging folder left behind"
    assert src.poll() == [] and len(errors) == 2  # still blocked on the next poll


@pytest.mark.slow
def test_registry_download_cut_short_through_the_server_is_fetched_again(registry, tmp_path, quiet_mlflow,
                                                                          monkeypatch):
    """Proxied artifacts (``mlflow-artifacts:/``, listed over HTTP): the first download of each
    version ends early without an error; both a folder version (odd) and a single-file version
    (even) are fetched again and emitted whole; a poll that finds a cached copy cut short does too."""
    import mlflow.artifacts

    _register(registry["client"], registry["exp"], "expert-cut", 2, registry["tmp"], seed0=600)
    real, calls = mlflow.artifacts.download_artifacts, []

    def cut_first_download_of_each_version(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(kwargs["artifact_uri"])
        if calls.count(kwargs["artifact_uri"]) == 1:
            for p in Path(kwargs["dst_path"]).rglob("*.safetensors"):
                p.write_bytes(p.read_bytes()[:-7])
        return out

    monkeypatch.setattr(mlflow.artifacts, "download_artifacts", cut_first_download_of_each_version)
    errors = []
    src = RegistrySource(["expert-cut"], Collector(), last_version=lambda m: 0, cache_dir=tmp_path / "cache",
                         tracking_uri=registry["uri"], max_retries=0, on_error=errors.append)
    events = src.poll()
    assert [e.registry_key for e in events] == ["mlflow:expert-cut:1", "mlflow:expert-cut:2"] and errors == []
    assert len(calls) == 4 and all(expert_complete(Path(e.uri)) for e in events)
    cached = next(Path(events[1].uri).parent.rglob("*.safetensors")) if Path(events[1].uri).is_dir() \
        else Path(events[1].uri)
    cached.write_bytes(cached.read_bytes()[:-1])
    fresh = RegistrySource(["expert-cut"], Collector(), last_version=lambda m: 1, cache_dir=tmp_path / "cache",
                           tracking_uri=registry["uri"], max_retries=0, on_error=errors.append)
    assert [e.uri for e in fresh.poll()] == [events[1].uri] and errors == []
    assert len(calls) == 5 and safetensors_complete(cached)


@pytest.mark.slow
def test_registry_tag_filter(registry, tmp_path, quiet_mlflow):
    _register(registry["client"], registry["exp"], "expert-tags", 5, registry["tmp"], seed0=200,
              tags=lambda i: {"team": "a" if i in (2, 5) else "b", "extra": str(i)})
    got = Collector()
    src = RegistrySource(["expert-tags"], got, last_version=lambda m: 0, cache_dir=tmp_path / "cache",
                         tracking_uri=registry["uri"], tag_filter={"team": "a"})
    events = src.poll()
    assert [e.registry_key for e in events] == ["mlflow:expert-tags:2", "mlflow:expert-tags:5"]
    assert events[0].metadata["tag.team"] == "a" and events[1].metadata["tag.extra"] == "5"


@pytest.mark.slow
def test_registry_webhook_from_the_server_triggers_an_immediate_poll(registry, tmp_path, quiet_mlflow):
    """End to end: scheduler running with a long interval; the server posts a signed
    model_version.created to our receiver, which triggers the poll that emits the new version."""
    client = registry["client"]
    _register(client, registry["exp"], "expert-hook", 1, registry["tmp"], seed0=300)
    got, errors = Collector(), []
    src = RegistrySource(["expert-hook"], got, last_version=lambda m: 0, cache_dir=tmp_path / "cache",
                         tracking_uri=registry["uri"], interval_seconds=3600, on_error=errors.append)
    rx = WebhookReceiver("127.0.0.1", 0, "hook-secret", src.trigger)
    src.start()
    rx.start()
    try:
        got.wait_for(1, timeout=30)  # the first run is immediate
        assert [e.registry_key for e in got.events] == ["mlflow:expert-hook:1"]
        client.create_webhook(name="mergestream", url=f"http://127.0.0.1:{rx.port}/hook",
                              events=["model_version.created"], secret="hook-secret")
        run = client.create_run(registry["exp"])
        f = tmp_path / "expert.safetensors"
        save_file(tensors(302, 8), str(f))
        client.log_artifact(run.info.run_id, str(f), "expert")
        client.create_model_version("expert-hook", source=f"runs:/{run.info.run_id}/expert", run_id=run.info.run_id)
        got.wait_for(2, timeout=30)
        assert [e.registry_key for e in got.events] == ["mlflow:expert-hook:1", "mlflow:expert-hook:2"]
        assert errors == []
    finally:
        rx.stop()
        src.stop()


@pytest.mark.slow
def test_registry_trigger_during_a_running_poll_is_not_lost(registry, tmp_path, quiet_mlflow):
    client = registry["client"]
    _register(client, registry["exp"], "expert-trig", 1, registry["tmp"], seed0=500)
    release, entered = threading.Event(), threading.Event()
    got = Collector()

    def slow_emit(ev):
        if ev.registry_key.endswith(":1"):
            entered.set()
            release.wait(10)  # the first poll is still running while a new version arrives
        got(ev)

    src = RegistrySource(["expert-trig"], slow_emit, last_version=lambda m: 0, cache_dir=tmp_path / "cache",
                         tracking_uri=registry["uri"], interval_seconds=3600)
    src.start()
    try:
        assert entered.wait(30)
        run = client.create_run(registry["exp"])
        f = tmp_path / "expert.safetensors"
        save_file(tensors(502, 8), str(f))
        client.log_artifact(run.info.run_id, str(f), "expert")
        client.create_model_version("expert-trig", source=f"runs:/{run.info.run_id}/expert", run_id=run.info.run_id)
        src.trigger()
        release.set()
        got.wait_for(2, timeout=30)
        assert [e.registry_key for e in got.events] == ["mlflow:expert-trig:1", "mlflow:expert-trig:2"]
    finally:
        src.stop()


def test_registry_unreachable_calls_on_error_and_does_not_raise(tmp_path, monkeypatch, quiet_mlflow):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    got, errors = Collector(), []
    src = RegistrySource(["m1", "m2"], got, last_version=lambda m: 0, cache_dir=tmp_path / "cache",
                         tracking_uri=f"http://127.0.0.1:{free_port()}", on_error=errors.append)
    t0 = time.monotonic()
    assert src.poll() == []
    assert len(errors) == 2 and all(isinstance(e, Exception) for e in errors)  # one per model
    assert time.monotonic() - t0 < 30
    assert got.events == []


# ------------------------------------------------------------------------------------------
# the source registry and the service's use of it
# ------------------------------------------------------------------------------------------
class Cursors(dict):
    """The ledger's cursor surface on a dict."""

    def get_cursor(self, key, default=None):
        return self.get(key, default)

    def set_cursor(self, key, value):
        self[key] = value


def _config(tmp_path: Path, **kw):
    from mergestream.config import Config

    kw.setdefault("mlflow", {"enabled": False})
    return Config(base=tmp_path / "base.safetensors", inbox=tmp_path / "inbox", state_dir=tmp_path / "state",
                  metrics={"enabled": False}, **kw)


def test_registry_builds_exactly_the_sources_the_config_enables(tmp_path):
    from mergestream.daemon.sources import SourceContext, build_sources
    from mergestream.errors import MergestreamError

    ctx = SourceContext(cursors=Cursors())
    kinds = lambda cfg: [type(s) for s in build_sources(cfg, Collector(), ctx)]
    assert kinds(_config(tmp_path)) == [FolderSource]
    assert kinds(_config(tmp_path, watch={"enabled": False})) == []
    registry = {"enabled": True, "models": ["experts"], "tracking_uri": "http://127.0.0.1:1"}
    assert kinds(_config(tmp_path, mlflow={"registry": registry})) == [FolderSource, RegistrySource]
    assert kinds(_config(tmp_path, watch={"enabled": False}, mlflow={"registry": registry})) == [RegistrySource]
    assert kinds(_config(tmp_path, mlflow={"registry": {**registry, "models": []}})) == [FolderSource]
    hook = {"enabled": True, "port": 0, "secret": "s"}
    assert kinds(_config(tmp_path, mlflow={"registry": registry, "webhook": hook})) == \
        [FolderSource, RegistrySource, WebhookReceiver]
    with pytest.raises(MergestreamError, match="needs a secret"):
        build_sources(_config(tmp_path, mlflow={"registry": registry, "webhook": {"enabled": True}}), Collector(), ctx)


def test_registry_source_advances_its_cursor_only_upwards():
    from mergestream.daemon.sources.mlflow import cursor_version

    cursors = Cursors()
    src = RegistrySource(["m"], Collector(), last_version=lambda m: cursor_version(cursors, m), cache_dir=Path("/nonexistent"),
                         cursors=cursors)
    for key in ("mlflow:m:3", "mlflow:m:2", "mlflow:other:1", "mlflow:m:x"):
        src.on_enqueued(ExpertReady("mlflow", "/x", "e", key))
    assert cursors == {"mlflow:m": "3", "mlflow:other": "1"}
    assert src.last_version("m") == 3


def test_running_source_answers_for_its_keys_and_no_source_means_available(tmp_path, monkeypatch):
    from mergestream.daemon.sources import Source, still_available

    class Withdrawn(Source):
        name = "mlflow"

        def start(self): ...

        def stop(self): ...

        def still_available(self, registry_key):
            return False

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    cfg = _config(tmp_path, mlflow={"registry": {"tracking_uri": f"http://127.0.0.1:{free_port()}"}})
    assert not still_available("mlflow:m:1", [Withdrawn()], cfg)
    assert still_available("mlflow:m:1", [], cfg)  # offline check: registry unreachable -> fold it
    assert still_available("folder:x", [Withdrawn()], cfg) and still_available("s3:b/k", [], cfg)


class CustomSource:
    """A minimal source, conforming to the protocol by shape only: it emits one expert when started."""

    name = "custom"

    def __init__(self, emit, expert: Path):
        self.emit, self.expert = emit, expert
        self.calls: list[str] = []

    def start(self) -> None:
        self.calls.append("start")
        self.emit(ExpertReady(self.name, str(self.expert), "custom-1", registry_key="custom:1"))

    def stop(self) -> None:
        self.calls.append("stop")

    def still_available(self, registry_key: str) -> bool:
        self.calls.append(f"available {registry_key}")
        return registry_key == "custom:1"

    def on_enqueued(self, ev: ExpertReady) -> None:
        self.calls.append(f"enqueued {ev.registry_key}")


def test_a_source_registered_in_the_registry_is_started_asked_and_stopped_by_the_service(tmp_path, monkeypatch):
    from mergestream.daemon import sources
    from mergestream.daemon.service import Service

    save_file(tensors(0, 8), str(tmp_path / "base.safetensors"))
    expert = tmp_path / "e.safetensors"
    save_file(tensors(1, 8), str(expert))
    built: list[CustomSource] = []

    def build(cfg, emit, context):
        built.append(CustomSource(emit, expert))
        return built[-1:]

    monkeypatch.setitem(sources.REGISTRY, "custom", sources.SourceKind(build))
    svc = Service(_config(tmp_path, watch={"enabled": False}), serve_metrics=False)
    assert isinstance(CustomSource(None, expert), sources.Source)
    svc.start()
    try:
        assert svc.sources == built and built[0].calls == ["start", "enqueued custom:1"]
        assert svc.ledger.expert("custom-1").registry_key == "custom:1"
        assert svc.metrics.registry.get_sample_value("mergestream_experts_seen_total", {"source": "custom"}) == 1
        assert svc._registry_version_exists("custom:1") and not svc._registry_version_exists("custom:2")
        assert svc._registry_version_exists("other:1")
    finally:
        svc.shutdown()
    assert built[0].calls[-1] == "stop"


def test_settled_files_that_can_never_be_experts_are_handed_on_not_left_unseen(inbox, started):
    """A file that is not a weight file, random bytes named .safetensors, or a safetensors file
    with bytes after its data is emitted once settled (the daemon then rejects it with its reason);
    a safetensors file whose data is still shorter than its header says keeps waiting."""
    from mergestream.daemon.sources import never_an_expert

    good = st_bytes(3, 64)
    (inbox / "notes.txt").write_text("remember to fold the sst2 expert")
    (inbox / "junk.safetensors").write_bytes(os.urandom(4096))
    (inbox / "trailing.safetensors").write_bytes(good + b"extra")
    (inbox / "arriving.safetensors").write_bytes(good[:-16])
    assert never_an_expert(inbox / "arriving.safetensors") is None
    assert never_an_expert(inbox / "notes.txt") and never_an_expert(inbox / "junk.safetensors")
    assert "bytes follow" in never_an_expert(inbox / "trailing.safetensors")
    (inbox / "model.onnx").write_bytes(b"onnx")  # a weight format that is never folded
    assert "not folded" in never_an_expert(inbox / "model.onnx")
    (inbox / "model.onnx").unlink()
    got = Collector()
    started(FolderSource(inbox, got, settle_seconds=SETTLE))
    got.wait_for(3, timeout=10)
    time.sleep(4 * SETTLE)
    assert sorted(Path(u).name for u in got.uris) == ["junk.safetensors", "notes.txt", "trailing.safetensors"]
    (inbox / "arriving.safetensors").write_bytes(good)  # the rest arrives: now it is an expert
    got.wait_for(4, timeout=10)
    assert Path(got.uris[-1]).name == "arriving.safetensors"
