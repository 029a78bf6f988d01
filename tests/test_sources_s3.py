"""Object storage as an expert source and as a mirror of published versions, against a real S3 API
server (moto's standalone server in a subprocess on a loopback port; :mod:`tests.s3_server`).

The source is driven poll by poll (:meth:`S3Source.poll`) for the readiness and failure cases,
and the daemon end to end (a real ``mergestream run`` subprocess) for folding, gating and the
mirror; a reader thread polls the bucket meanwhile and must never see a partial version."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from mergestream.config import ConfigError, load_config
from mergestream.daemon.metrics import Metrics
from mergestream.daemon.mirror import Mirror
from mergestream.daemon.s3client import EtagCheck, make_client, parse_s3_uri
from mergestream.daemon.sources import REGISTRY
from mergestream.daemon.sources.s3 import S3Source, version_exists
from mergestream.daemon.sources.s3_notify import NotificationReceiver
from mergestream.daemon.store import Store

from .conftest import load_dir, random_model, save_tensors
from .s3_server import TEST_CREDENTIALS, free_port, run_s3_server, s3  # noqa: F401 - s3: a fixture
from .test_daemon import Daemon, scaled_expert, tiny_base

pytestmark = pytest.mark.usefixtures("aws_env")


@pytest.fixture
def aws_env(monkeypatch):
    for k, v in TEST_CREDENTIALS.items():
        monkeypatch.setenv(k, v)


@pytest.fixture
def bucket(s3) -> str:
    return s3.new_bucket("bkt")


class Recorder:
    """What a source emitted and reported; its ``emit`` also tells the source (as the service does)."""

    def __init__(self):
        self.events, self.errors = [], []
        self.src: S3Source | None = None

    def emit(self, ev) -> None:
        self.events.append(ev)
        self.src.on_enqueued(ev)


def source(s3, bucket: str, tmp_path: Path, prefix: str = "experts/", **kw) -> tuple[S3Source, Recorder]:
    rec = Recorder()
    rec.src = S3Source(bucket, prefix, rec.emit, client=lambda: make_client(s3.endpoint), cache_dir=tmp_path / "cache",
                       on_error=rec.errors.append, **kw)
    return rec.src, rec


def expert_bytes(tmp_path: Path, seed: int) -> bytes:
    return save_tensors(tmp_path / f"src-{seed}.safetensors", random_model(seed)).read_bytes()


# ------------------------------------------------------------------------------------------
# Readiness, identity, reading
# ------------------------------------------------------------------------------------------
def test_single_file_is_taken_after_two_stable_listings_once_per_etag(s3, bucket, tmp_path):
    c = s3.client()
    src, rec = source(s3, bucket, tmp_path)
    data = expert_bytes(tmp_path, 1)
    c.put_object(Bucket=bucket, Key="experts/e1.safetensors", Body=data)
    assert src.poll() == []                      # seen once: not yet stable
    [ev] = src.poll()
    assert ev.expert_id == "e1" and Path(ev.uri).read_bytes() == data
    assert ev.registry_key.startswith(f"s3:{bucket}/experts/e1.safetensors#")
    assert src.poll() == [] and src.poll() == []  # the same (key, ETag) is taken once
    new = expert_bytes(tmp_path, 2)
    c.put_object(Bucket=bucket, Key="experts/e1.safetensors", Body=new)  # re-upload, new content
    assert src.poll() == []
    [ev2] = src.poll()
    assert ev2.registry_key != ev.registry_key and Path(ev2.uri).read_bytes() == new
    assert rec.errors == []


def test_taken_versions_survive_a_restart_through_the_cursor(s3, bucket, tmp_path):
    cursors: dict[str, str] = {}

    class Cur:
        def get_cursor(self, key, default=None):
            return cursors.get(key, default)

        def set_cursor(self, key, value):
            cursors[key] = value

    s3.client().put_object(Bucket=bucket, Key="experts/e.safetensors", Body=expert_bytes(tmp_path, 3))
    src, _ = source(s3, bucket, tmp_path, cursors=Cur())
    src.poll()
    assert len(src.poll()) == 1
    again, _ = source(s3, bucket, tmp_path, cursors=Cur())  # a new process
    assert again.poll() == [] and again.poll() == []


def test_folder_expert_waits_for_its_ready_marker(s3, bucket, tmp_path):
    c = s3.client()
    src, _ = source(s3, bucket, tmp_path)
    weights = expert_bytes(tmp_path, 4)
    c.put_object(Bucket=bucket, Key="experts/hf/model.safetensors", Body=weights)
    c.put_object(Bucket=bucket, Key="experts/hf/config.json", Body=b"{}")
    assert src.poll() == [] and src.poll() == []
    c.put_object(Bucket=bucket, Key="experts/hf/READY", Body=b"")
    [ev] = src.poll()
    folder = Path(ev.uri)
    assert ev.expert_id == "hf" and folder.is_dir() and not (folder / "READY").exists()
    assert (folder / "model.safetensors").read_bytes() == weights
    assert set(load_dir(folder)) == set(random_model(4))
    assert src.poll() == []


def test_listing_follows_every_page(s3, bucket, tmp_path):
    c = s3.client()
    for i in range(5):
        c.put_object(Bucket=bucket, Key=f"experts/p{i}.safetensors", Body=expert_bytes(tmp_path, 10 + i))
    src, _ = source(s3, bucket, tmp_path)
    src.PAGE_SIZE = 2  # three pages
    src.poll()
    assert sorted(ev.expert_id for ev in src.poll()) == [f"p{i}" for i in range(5)]


def test_multipart_upload_in_progress_is_invisible_until_completed(s3, bucket, tmp_path):
    c = s3.client()
    src, rec = source(s3, bucket, tmp_path)
    g = torch.Generator().manual_seed(0)
    data = save_tensors(tmp_path / "big.safetensors", {"w": torch.randn(1_400_000, generator=g)}).read_bytes()
    key, cut = "experts/big.safetensors", 5 * 1024 * 1024  # two parts: 5 MiB (S3's minimum) + the rest
    up = c.create_multipart_upload(Bucket=bucket, Key=key)
    parts = [c.upload_part(Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=n, Body=body)
             for n, body in ((1, data[:cut]), (2, data[cut:]))]
    assert src.poll() == [] and src.poll() == []
    assert c.list_multipart_uploads(Bucket=bucket)["Uploads"]  # really in progress on the server
    c.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up["UploadId"], MultipartUpload={
        "Parts": [{"ETag": p["ETag"], "PartNumber": n} for n, p in enumerate(parts, 1)]})
    src.poll()
    [ev] = src.poll()
    etag = ev.metadata["s3.etag"]
    assert etag.endswith("-2") and Path(ev.uri).read_bytes() == data and rec.errors == []
    check = EtagCheck(etag, cut)  # what the download verified, fed in chunks that straddle the parts
    for i in range(0, len(data), 3 * 1024 * 1024):
        check.update(data[i:i + 3 * 1024 * 1024])
    assert check.computed() == etag
    wrong = EtagCheck(etag, cut)
    wrong.update(data[:-1] + b"x")
    assert wrong.computed() != etag


# ------------------------------------------------------------------------------------------
# Failures: reported clearly, counted, never fatal
# ------------------------------------------------------------------------------------------
def test_truncated_object_is_reported_once_and_never_taken(s3, bucket, tmp_path, caplog):
    data = expert_bytes(tmp_path, 6)
    s3.client().put_object(Bucket=bucket, Key="experts/cut.safetensors", Body=data[:-100])
    src, rec = source(s3, bucket, tmp_path)
    for _ in range(4):
        assert src.poll() == []
    assert [e.kind for e in rec.errors] == ["truncated"]
    assert "cut.safetensors" in caplog.text and "declares" in caplog.text
    s3.client().put_object(Bucket=bucket, Key="experts/cut.safetensors", Body=data)  # fixed by a re-upload
    src.poll()
    assert [ev.expert_id for ev in src.poll()] == ["cut"]


def test_object_deleted_between_listing_and_read_is_an_error_not_a_crash(s3, bucket, tmp_path):
    c = s3.client()
    c.put_object(Bucket=bucket, Key="experts/gone/model.safetensors", Body=expert_bytes(tmp_path, 7))
    c.put_object(Bucket=bucket, Key="experts/gone/READY", Body=b"")
    client = make_client(s3.endpoint)

    def delete_first(**_):  # the server really deletes it after the listing, before the GET
        c.delete_object(Bucket=bucket, Key="experts/gone/model.safetensors")

    client.meta.events.register_first("before-call.s3.GetObject", delete_first)
    rec = Recorder()
    rec.src = src = S3Source(bucket, "experts/", rec.emit, client=lambda: client, cache_dir=tmp_path / "cache",
                             on_error=rec.errors.append)
    assert src.poll() == []
    assert [e.kind for e in rec.errors] == ["not_found"]
    assert not list((tmp_path / "cache").rglob("*.safetensors"))  # no partial copy left


def test_still_available_is_false_once_deleted_or_replaced(s3, bucket, tmp_path):
    c = s3.client()
    c.put_object(Bucket=bucket, Key="experts/a.safetensors", Body=expert_bytes(tmp_path, 8))
    src, _ = source(s3, bucket, tmp_path)
    src.poll()
    [ev] = src.poll()
    assert src.still_available(ev.registry_key)
    c.put_object(Bucket=bucket, Key="experts/a.safetensors", Body=expert_bytes(tmp_path, 9))
    assert not src.still_available(ev.registry_key)
    c.delete_object(Bucket=bucket, Key="experts/a.safetensors")
    assert not version_exists(lambda: make_client(s3.endpoint), ev.registry_key)
    assert version_exists(lambda: make_client(s3.endpoint), "mlflow:m:1")


def test_unreachable_endpoint_is_an_error_per_poll(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    rec = Recorder()
    rec.src = src = S3Source("bkt-x", "", rec.emit, client=lambda: make_client(dead, connect_timeout=1, max_attempts=1),
                             cache_dir=tmp_path / "cache", on_error=rec.errors.append)
    t0 = time.time()
    assert src.poll() == [] and src.poll() == []
    assert [e.kind for e in rec.errors] == ["unreachable", "unreachable"] and time.time() - t0 < 20


def test_access_denied_bucket_is_reported_and_the_source_keeps_polling(tmp_path, monkeypatch):
    with run_s3_server() as server:
        server.client().create_bucket(Bucket="locked")
        creds = server.deny_all()
        for k, v in creds.items():
            monkeypatch.setenv(k, v)
        notes = []
        rec = Recorder()
        rec.src = src = S3Source("locked", "", rec.emit, client=lambda: make_client(server.endpoint),
                                 cache_dir=tmp_path / "c", on_error=rec.errors.append, interval_seconds=0.2,
                                 note=lambda subject, msg, level: notes.append((subject, msg)))
        src.start()
        try:
            deadline = time.time() + 20
            while len(rec.errors) < 2 and time.time() < deadline:
                time.sleep(0.1)
        finally:
            src.stop()
        assert len(rec.errors) >= 2 and {e.kind for e in rec.errors} == {"access_denied"}
        assert notes[0][0] == "bucket" and "AccessDenied" in notes[0][1]
        assert creds["AWS_SECRET_ACCESS_KEY"] not in notes[0][1]


def test_bucket_notification_triggers_a_poll(s3, bucket, tmp_path):
    c = s3.client()
    src, rec = source(s3, bucket, tmp_path, interval_seconds=3600)
    rx = NotificationReceiver("127.0.0.1", 0, "tok", src.trigger)
    src.start()
    rx.start()
    try:
        deadline = time.time() + 10
        while src.polls < 1 and time.time() < deadline:  # the first poll, at start, saw nothing
            time.sleep(0.02)
        c.put_object(Bucket=bucket, Key="experts/n/model.safetensors", Body=expert_bytes(tmp_path, 11))
        c.put_object(Bucket=bucket, Key="experts/n/READY", Body=b"")
        time.sleep(0.3)
        assert rec.events == []  # the first poll ran before the upload; the next is an hour away

        def post(token: str, body: dict) -> int:
            req = urllib.request.Request(f"http://127.0.0.1:{rx.port}/", data=json.dumps(body).encode(),
                                         headers={"Authorization": f"Bearer {token}"}, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    return r.status
            except urllib.error.HTTPError as e:
                return e.code

        minio = {"EventName": "s3:ObjectCreated:Put", "Key": f"{bucket}/experts/n/READY", "Records": []}
        assert post("wrong", minio) == 401
        time.sleep(0.3)
        assert rec.events == []
        assert post("tok", minio) == 200
        deadline = time.time() + 10
        while not rec.events and time.time() < deadline:
            time.sleep(0.05)
        assert [ev.expert_id for ev in rec.events] == ["n"]
    finally:
        rx.stop()
        src.stop()


# ------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------
def test_config_sections_and_their_errors(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("base: b.safetensors\ns3: {enabled: true, bucket: bk, prefix: x}\npublish: {uri: 's3://m/p'}\n")
    cfg = load_config(p)
    assert cfg.s3.prefix == "x/" and parse_s3_uri(cfg.publish.uri) == ("m", "p/")
    assert "s3" in REGISTRY
    p.write_text("base: b.safetensors\ns3: {enabled: true, bucket: bk, cache: false}\n")
    assert load_config(p).s3.cache is False  # read in place (tests/test_s3_checkpoint.py)
    for bad, words in [("s3: {enabled: true}", "s3.bucket"),
                       ("publish: {uri: 'http://x'}", "s3://bucket/prefix/")]:
        p.write_text(f"base: b.safetensors\n{bad}\n")
        with pytest.raises(ConfigError, match=words):
            load_config(p)


def test_core_does_not_import_boto3_without_s3(tmp_path):
    import subprocess
    import sys

    code = ("import sys; import mergestream.daemon.service, mergestream.daemon.sources; "
            "assert 'boto3' not in sys.modules and 'botocore' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------------------
# The publish mirror
# ------------------------------------------------------------------------------------------
def _fake_version(store: Store, tmp_path: Path, seed: int) -> int:
    staging = store.new_staging()
    save_tensors(staging / "model" / "model.safetensors", random_model(seed))
    (staging / "state").mkdir()
    (staging / "state" / "manifest.json").write_text(json.dumps({"folds": []}))
    (staging / "patch-from-000000.safetensors").write_bytes(b"p" * seed)
    return store.publish(staging, {"expert": f"e{seed}"})


def _pointer(client, bucket: str, prefix: str) -> dict:
    return json.loads(client.get_object(Bucket=bucket, Key=f"{prefix}current")["Body"].read())


def test_mirror_uploads_each_version_then_moves_current_and_rollback_moves_it(s3, bucket, tmp_path):
    metrics = Metrics(CollectorRegistry())
    store = Store(tmp_path / "state")
    c = s3.client()
    client = make_client(s3.endpoint)
    views = []

    def reader_view(**_):  # before every upload: what a reader of `current` would find now
        try:
            ptr = _pointer(c, bucket, "pub/")
        except c.exceptions.NoSuchKey:
            return
        have = {o["Key"]: o["Size"] for o in c.list_objects_v2(Bucket=bucket, Prefix="pub/")["Contents"]}
        views.append(all(have.get(f"pub/{ptr['prefix']}{rel}") == n for rel, n in ptr["files"].items()))

    client.meta.events.register("before-call.s3.PutObject", reader_view)
    store.publishers.append(Mirror(bucket, "pub/", lambda: client, metrics))
    v1 = _fake_version(store, tmp_path, 1)
    v2 = _fake_version(store, tmp_path, 2)
    ptr = _pointer(c, bucket, "pub/")
    assert ptr["version"] == v2 and ptr["prefix"] == "versions/000002/"
    assert set(ptr["files"]) == {"model/model.safetensors", "patch-from-000000.safetensors", "fold.json"}
    for rel, size in ptr["files"].items():
        assert c.head_object(Bucket=bucket, Key=f"pub/versions/000002/{rel}")["ContentLength"] == size
    keys = [o["Key"] for o in c.list_objects_v2(Bucket=bucket, Prefix="pub/")["Contents"]]
    assert not any("/state/" in k for k in keys)
    store.point_current(v1)  # a rollback moves only the pointer
    assert _pointer(c, bucket, "pub/")["version"] == v1
    assert metrics.registry.get_sample_value("mergestream_mirror_versions_total") == 2
    assert len(views) >= 3 and all(views)  # current never named a file not yet (fully) uploaded


def test_mirror_failure_is_counted_and_never_touches_the_local_store(tmp_path):
    metrics = Metrics(CollectorRegistry())
    store = Store(tmp_path / "state")
    dead = f"http://127.0.0.1:{free_port()}"
    store.publishers.append(Mirror("bkt-x", "", lambda: make_client(dead, connect_timeout=1, max_attempts=1), metrics))
    v = _fake_version(store, tmp_path, 3)
    assert store.current() == v and (store.path(v) / "model" / "model.safetensors").is_file()
    assert metrics.registry.get_sample_value("mergestream_mirror_errors_total", {"kind": "unreachable"}) == 1


# ------------------------------------------------------------------------------------------
# The daemon end to end
# ------------------------------------------------------------------------------------------
class Reader(threading.Thread):
    """Polls the mirror like a consumer would: read ``current``, then every file it names. Any
    missing file or wrong size is a partial version seen."""

    def __init__(self, client, bucket: str, prefix: str):
        super().__init__(daemon=True)
        self.client, self.bucket, self.prefix = client, bucket, prefix
        self.stop_flag = threading.Event()
        self.partial: list[str] = []
        self.versions: set[int] = set()

    def run(self) -> None:
        while not self.stop_flag.is_set():
            try:
                ptr = _pointer(self.client, self.bucket, self.prefix)
            except Exception:
                time.sleep(0.05)
                continue
            self.versions.add(ptr["version"])
            for rel, size in ptr["files"].items():
                key = f"{self.prefix}{ptr['prefix']}{rel}"
                try:
                    if self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"] != size:
                        self.partial.append(f"{key}: size")
                except Exception as exc:
                    self.partial.append(f"{key}: {exc}")
            time.sleep(0.02)


@pytest.mark.slow
def test_daemon_folds_from_the_bucket_rejects_a_harmful_expert_and_mirrors_versions(s3, bucket, tmp_path):
    c = s3.client()
    base = tiny_base()
    d = Daemon(tmp_path, extra={"s3": {"enabled": True, "bucket": bucket, "prefix": "experts/",
                                       "endpoint_url": s3.endpoint, "interval_seconds": 0.3},
                                "publish": {"uri": f"s3://{bucket}/mirror/"}}, env=TEST_CREDENTIALS)
    reader = Reader(c, bucket, "mirror/")
    reader.start()
    try:
        d.start()
        ok0 = save_tensors(tmp_path / "up" / "ok0.safetensors", scaled_expert(base, 20))
        c.upload_file(str(ok0), bucket, "experts/ok0.safetensors")
        d.wait(lambda: d.status()["current_version"] == 1, 60, "ok0 not folded")
        ok1 = save_tensors(tmp_path / "up" / "ok1" / "model.safetensors", scaled_expert(base, 21))
        c.upload_file(str(ok1), bucket, "experts/ok1/model.safetensors")
        c.put_object(Bucket=bucket, Key="experts/ok1/READY", Body=b"")
        d.wait(lambda: d.status()["current_version"] == 2, 60, "ok1 not folded")
        bad = save_tensors(tmp_path / "up" / "harmful.safetensors", scaled_expert(base, 30, factor=50.0))
        c.upload_file(str(bad), bucket, "experts/harmful.safetensors")
        d.wait(lambda: any(x["id"] == "harmful" and x["status"] == "rejected" for x in d.status()["experts"]),
               60, "harmful expert not rejected")
        st = d.status()
        assert st["current_version"] == 2
        assert d.metric('mergestream_experts_seen_total{source="s3"}') == 3.0
        assert d.metric("mergestream_rollbacks_total") == 1.0
        assert d.metric("mergestream_mirror_versions_total") == 2.0
        ptr = _pointer(c, bucket, "mirror/")
        assert ptr["version"] == 2
        current_time = c.head_object(Bucket=bucket, Key="mirror/current")["LastModified"]
        for o in c.list_objects_v2(Bucket=bucket, Prefix="mirror/versions/000002/")["Contents"]:
            assert o["LastModified"] <= current_time  # the pointer was written last
        mirrored = c.get_object(Bucket=bucket, Key="mirror/versions/000002/model/model.safetensors")["Body"].read()
        local = (tmp_path / "state" / "versions" / "000002" / "model" / "model.safetensors").read_bytes()
        assert mirrored == local
        from .conftest import run_cli

        run_cli("rollback", "--config", d.config, "--to", "1")
        deadline = time.time() + 30
        while _pointer(c, bucket, "mirror/")["version"] != 1 and time.time() < deadline:
            time.sleep(0.2)
        assert _pointer(c, bucket, "mirror/")["version"] == 1
    finally:
        reader.stop_flag.set()
        reader.join(5)
        d.stop()
    assert reader.partial == [] and {1, 2} <= reader.versions


@pytest.mark.slow
def test_daemon_keeps_running_when_the_bucket_denies_access(tmp_path):
    with run_s3_server() as server:
        server.client().create_bucket(Bucket="locked")
        creds = server.deny_all()
        d = Daemon(tmp_path, extra={"s3": {"enabled": True, "bucket": "locked", "endpoint_url": server.endpoint,
                                           "interval_seconds": 0.3}}, env=creds)
        try:
            d.start()
            d.wait(lambda: (d.metric('mergestream_source_errors_total{source="s3"}') or 0) >= 2, 30,
                   "access denied not counted")
            assert d.http("/healthz")[0] == 200 and d.proc.poll() is None
            # the inbox still works while the bucket is refused
            save_tensors(tmp_path / "inbox" / "local.safetensors", scaled_expert(tiny_base(), 40))
            d.wait(lambda: d.status()["current_version"] == 1, 60, "inbox expert not folded")
            [note] = d.status()["sources"]["s3"]  # `mergestream status` says why
            assert note["subject"] == "bucket" and "access_denied" in note["message"]
            assert "AccessDenied" in note["message"] and creds["AWS_SECRET_ACCESS_KEY"] not in note["message"]
        finally:
            d.stop()
        text = d.log.read_text()
        assert "access_denied" in text and creds["AWS_SECRET_ACCESS_KEY"] not in text
