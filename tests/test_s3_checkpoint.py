"""Checkpoints read in place from object storage (ranged GETs, no local copy), against a real S3
API server (moto's standalone server on a loopback port; :mod:`tests.s3_server`): the fold from
``s3://`` equals the fold from the same local file byte for byte, each tensor is fetched once,
a replaced, truncated or deleted object is a specific error with nothing written, and the daemon
with ``s3.cache: false`` folds an uploaded expert with nothing downloaded."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from mergestream import engine
from mergestream.errors import (
    CorruptCheckpointError,
    MissingShardError,
    ObjectChangedError,
    ObjectGoneError,
)
from mergestream.io import s3_checkpoint, st
from mergestream.io.checkpoints import open_checkpoint, open_safetensors_file, read_state_dict
from mergestream.io.expert_readers import content_sha256

from .conftest import perturb, random_model, run_cli, save_tensors
from .s3_server import TEST_CREDENTIALS, s3  # noqa: F401 - s3: a fixture
from .test_daemon import Daemon, scaled_expert, tiny_base

pytestmark = pytest.mark.usefixtures("aws_env")


@pytest.fixture
def aws_env(monkeypatch, s3):
    """The standard AWS chain points at the test server: credentials and ``AWS_ENDPOINT_URL``."""
    for k, v in TEST_CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)


@pytest.fixture
def bucket(s3) -> str:
    return s3.new_bucket("ckpt")


@pytest.fixture
def model(tmp_path) -> tuple[Path, Path]:
    """A local base and one expert of it (bf16 and fp32 tensors, an integer buffer)."""
    base = random_model(0)
    base["layer.1.big.weight"] = torch.randn(96, 80, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    return (save_tensors(tmp_path / "base.safetensors", base),
            save_tensors(tmp_path / "e1.safetensors", perturb(base, 0.05, 1)))


def upload(s3, bucket: str, path: Path, key: str) -> str:
    s3.client().upload_file(str(path), bucket, key)
    return f"s3://{bucket}/{key}"


def gets(caplog) -> list[tuple[str, int, int]]:
    """The ranged GETs the reader logged: (uri, first byte, last byte)."""
    out = []
    for r in caplog.records:
        if m := re.match(r"s3 GET (\S+) bytes=(\d+)-(\d+)$", r.getMessage()):
            out.append((m[1], int(m[2]), int(m[3])))
    return out


# ------------------------------------------------------------------------------------------
# The reader
# ------------------------------------------------------------------------------------------
def test_object_reads_equal_the_local_file_and_hash_the_same(s3, bucket, model, monkeypatch):
    monkeypatch.setattr(s3_checkpoint, "CHUNK_BYTES", 1000)  # tensors arrive in several pieces
    _, expert = model
    uri = upload(s3, bucket, expert, "x/e1.safetensors")
    with open_checkpoint(uri) as remote, open_checkpoint(expert) as local:
        assert remote.path == uri and remote.keys() == local.keys() and remote.metadata() == local.metadata()
        for name in local.keys():
            assert remote.meta(name) == local.meta(name)
            assert torch.equal(remote.get(name), local.get(name))
        name = "layer.0.attn.weight"
        part = remote.read_into(name, torch.empty(1500, dtype=torch.uint8), start=700)
        assert torch.equal(part, local.read_into(name, torch.empty(1500, dtype=torch.uint8), start=700))
        assert remote.sha256() == local.sha256()
    assert content_sha256(uri) == content_sha256(expert)


def test_sharded_folder_prefix_reads_like_the_local_folder(s3, bucket, tmp_path):
    t = random_model(3)
    names = sorted(t)
    folder = tmp_path / "hf"
    shards = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
    for shard, keys in shards.items():
        save_tensors(folder / shard, {k: t[k] for k in keys})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}))
    for f in folder.iterdir():
        upload(s3, bucket, f, f"models/hf/{f.name}")
    with open_checkpoint(f"s3://{bucket}/models/hf/") as remote, open_checkpoint(folder) as local:
        assert sorted(remote.keys()) == names and len(remote.weight_files) == 2
        assert all(torch.equal(remote.get(k), t[k]) for k in names)
        assert remote.sha256() == local.sha256()
    s3.client().delete_object(Bucket=bucket, Key="models/hf/model-00002-of-00002.safetensors")
    with pytest.raises(MissingShardError, match="model-00002-of-00002"):
        open_checkpoint(f"s3://{bucket}/models/hf")


def test_truncated_deleted_and_replaced_objects_are_specific_errors(s3, bucket, model, tmp_path):
    _, expert = model
    data = expert.read_bytes()
    c = s3.client()
    c.put_object(Bucket=bucket, Key="cut.safetensors", Body=data[:-100])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        open_checkpoint(f"s3://{bucket}/cut.safetensors")
    with pytest.raises(ObjectGoneError, match="no such object"):
        open_checkpoint(f"s3://{bucket}/never.safetensors")
    c.put_object(Bucket=bucket, Key="e.safetensors", Body=data)
    etag = c.head_object(Bucket=bucket, Key="e.safetensors")["ETag"].strip('"')
    ref = s3_checkpoint.S3Ref(f"s3://{bucket}/e.safetensors", {"e.safetensors": {"etag": etag, "size": len(data)}},
                              c.meta.endpoint_url).write(tmp_path / "e.s3ref.json")
    assert content_sha256(ref) == content_sha256(expert)  # the reference reads the version it names
    ck = open_checkpoint(ref)
    c.put_object(Bucket=bucket, Key="e.safetensors", Body=data)  # same bytes, same ETag: still that version
    ck.get("layer.0.attn.weight")
    c.put_object(Bucket=bucket, Key="e.safetensors", Body=save_tensors(tmp_path / "o.safetensors",
                                                                       random_model(9)).read_bytes())
    with pytest.raises(ObjectChangedError, match="replaced since it was opened"):
        ck.get("layer.0.attn.weight")  # an open checkpoint never mixes two versions
    ck.close()
    with pytest.raises(ObjectChangedError, match="no longer the version recorded"):
        content_sha256(ref)  # nor does a reference to a version that is gone
    c.delete_object(Bucket=bucket, Key="e.safetensors")
    with pytest.raises(ObjectGoneError):
        content_sha256(ref)


def test_on_a_versioned_bucket_the_opened_version_is_read_to_the_end(s3, bucket, model, tmp_path):
    _, expert = model
    c = s3.client()
    c.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    uri = upload(s3, bucket, expert, "v.safetensors")
    with open_checkpoint(uri) as ck:
        c.put_object(Bucket=bucket, Key="v.safetensors", Body=save_tensors(tmp_path / "o.safetensors",
                                                                           random_model(9)).read_bytes())
        assert ck.sha256() == content_sha256(expert)  # the VersionId pinned at open, not the new upload


# ------------------------------------------------------------------------------------------
# The fold
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["task_arithmetic", "ties"])
def test_fold_from_s3_equals_the_local_fold_and_fetches_each_tensor_once(s3, bucket, model, tmp_path, policy,
                                                                         caplog):
    base, expert = model
    uri = upload(s3, bucket, expert, "experts/e1.safetensors")
    local = engine.fold(base, None, expert, policy, {}, state_dir=tmp_path / "s-local", out=tmp_path / "o-local",
                        expert_id="e1")
    caplog.set_level(logging.DEBUG, logger="mergestream.io.s3_checkpoint")
    remote = engine.fold(base, None, uri, policy, {}, state_dir=tmp_path / "s-s3", out=tmp_path / "o-s3",
                         expert_id="e1", options=engine.ExecOptions(threads=2))
    assert remote.sha256 == local.sha256 == [content_sha256(expert)]
    for f in sorted((tmp_path / "o-local").iterdir()):
        assert (tmp_path / "o-s3" / f.name).read_bytes() == f.read_bytes(), f.name
    # bounded reads: the header (length, then text), then each tensor's bytes exactly once
    hdr = st.read_header(expert)
    fetched = sorted((a, b) for u, a, b in gets(caplog) if u == uri)
    want = sorted([(0, 7), (8, hdr.data_start - 1)] + [(e.offset, e.offset + e.nbytes - 1) for e in hdr.entries])
    assert fetched == want
    assert sum(b - a + 1 for a, b in fetched) == expert.stat().st_size  # nothing twice, and no whole-object GET
    assert all(b - a + 1 < expert.stat().st_size for a, b in fetched)


def test_cli_folds_base_and_expert_from_s3_with_the_endpoint_from_the_environment(s3, bucket, model, tmp_path):
    base, expert = model
    b, e = upload(s3, bucket, base, "base.safetensors"), upload(s3, bucket, expert, "e1.safetensors")
    run_cli("fold", "--base", b, "--expert", e, "--policy", "task_arithmetic", "--state", tmp_path / "s",
            "--out", tmp_path / "o", "--id", "e1")
    local = engine.fold(base, None, expert, "task_arithmetic", {}, state_dir=tmp_path / "s2",
                        out=tmp_path / "o2", expert_id="e1")
    assert content_sha256(tmp_path / "o") == content_sha256(tmp_path / "o2")  # the same weights
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["folds"][0]["sha256"] == local.sha256[0]


def test_raw_uris_are_recorded_as_uris_and_replay_reads_them_again(s3, bucket, model, tmp_path):
    """The manifest keeps an ``s3://`` input as the URI (not a local path made of it), so replay
    re-reads the bucket; a local fold of the same inputs gives the same bytes."""
    base, expert = model
    b = upload(s3, bucket, base, "base.safetensors")
    uris = [upload(s3, bucket, save_tensors(tmp_path / f"e{i}.safetensors", perturb(read_state_dict(base), 0.05, 30 + i)),
                   f"in/e{i}.safetensors") for i in range(2)]
    state, backbone = tmp_path / "s", None
    for i, uri in enumerate(uris):
        run_cli("fold", "--base", b, "--expert", uri, "--policy", "ties", "--state", state,
                "--out", tmp_path / f"v{i}", "--id", f"e{i}", *([] if backbone is None else ["--backbone", backbone]))
        backbone = tmp_path / f"v{i}"
    man = json.loads((state / "manifest.json").read_text())
    assert man["base"] == b and [f["expert"] for f in man["folds"]] == uris
    run_cli("unmerge", "--state", state, "--expert", "e0", "--mode", "replay", "--out", tmp_path / "r")
    only_e1 = engine.fold(base, None, tmp_path / "e1.safetensors", "ties", {}, state_dir=tmp_path / "s2",
                          out=tmp_path / "o2", expert_id="e1")
    assert content_sha256(tmp_path / "r") == content_sha256(tmp_path / "o2") and only_e1.experts == ["e1"]


def test_inspect_takes_uris_and_a_missing_bucket_is_named(s3, bucket, model):
    """Found by a fresh user: ``inspect s3://...`` turned the URI into a path ("s3:/..."), and a
    missing bucket was reported as a missing object."""
    _, expert = model
    uri = upload(s3, bucket, expert, "x/e1.safetensors")
    out = run_cli("inspect", uri, "--json")
    info = json.loads(out.stdout)["checkpoints"][0]
    with open_checkpoint(expert) as local:
        assert info["path"] == uri and info["tensors"] == len(local.keys()) and info["bytes"] == local.nbytes
    with pytest.raises(ObjectGoneError, match="no such bucket 'no-such-bucket'"):
        open_checkpoint("s3://no-such-bucket/e1.safetensors")
    with pytest.raises(ObjectGoneError, match="no such object"):
        open_checkpoint(f"s3://{bucket}/x/missing.safetensors")


def test_object_replaced_mid_fold_fails_and_writes_nothing(s3, bucket, model, tmp_path):
    base, expert = model
    uri = upload(s3, bucket, expert, "experts/e1.safetensors")
    other = save_tensors(tmp_path / "other.safetensors", perturb(read_state_dict(base), 0.05, 2))  # it would fit
    seen = []

    def replace_after_first(name: str) -> None:
        seen.append(name)
        if len(seen) == 1:  # the server really replaces it between two ranged reads
            s3.client().upload_file(str(other), bucket, "experts/e1.safetensors")

    with pytest.raises(ObjectChangedError, match="replaced since it was opened"):
        engine.fold(base, None, uri, "ties", {}, state_dir=tmp_path / "s", out=tmp_path / "o", expert_id="e1",
                    options=engine.ExecOptions(threads=1), tensor_hook=replace_after_first)
    assert not (tmp_path / "o").exists()
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").iterdir())


def test_source_without_cache_emits_references_and_still_downloads_adapters(s3, bucket, tmp_path):
    from mergestream.daemon.s3client import make_client
    from mergestream.daemon.sources.s3 import S3Source

    c = s3.client()
    weights = save_tensors(tmp_path / "w.safetensors", random_model(4))
    c.upload_file(str(weights), bucket, "in/hf/model.safetensors")
    c.put_object(Bucket=bucket, Key="in/hf/config.json", Body=b"{}")
    c.put_object(Bucket=bucket, Key="in/ad/adapter_config.json", Body=b"{}")
    c.put_object(Bucket=bucket, Key="in/ad/adapter_model.safetensors", Body=weights.read_bytes())
    for name in ("hf", "ad"):
        c.put_object(Bucket=bucket, Key=f"in/{name}/READY", Body=b"")
    events = []
    src = S3Source(bucket, "in/", events.append, client=lambda: make_client(s3.endpoint),
                   cache_dir=tmp_path / "state" / "cache" / "s3", cache=False, endpoint_url=s3.endpoint)
    src.poll()
    by_id = {ev.expert_id: Path(ev.uri) for ev in events}
    assert by_id["hf"].name == "hf.s3ref.json" and by_id["hf"].is_file()
    assert by_id["ad"].is_dir() and (by_id["ad"] / "adapter_config.json").is_file()  # small: downloaded
    with open_checkpoint(by_id["hf"]) as ck:
        assert ck.path == f"s3://{bucket}/in/hf/" and ck.sha256() == content_sha256(weights)
    assert not any((tmp_path / "state" / "cache" / "s3" / bucket).rglob("model.safetensors"))


def test_replay_rereads_referenced_experts_and_refuses_a_replaced_one(s3, bucket, model, tmp_path):
    base, _ = model
    c = s3.client()
    refs, backbone, state = [], None, tmp_path / "state"
    for i in range(3):
        local = save_tensors(tmp_path / f"e{i}.safetensors", perturb(read_state_dict(base), 0.05, 20 + i))
        c.upload_file(str(local), bucket, f"e{i}.safetensors")
        head = c.head_object(Bucket=bucket, Key=f"e{i}.safetensors")
        refs.append(s3_checkpoint.S3Ref(f"s3://{bucket}/e{i}.safetensors", {f"e{i}.safetensors": {
            "etag": head["ETag"].strip('"'), "size": head["ContentLength"]}}).write(tmp_path / f"e{i}.s3ref.json"))
        engine.fold(base, backbone, refs[i], "ties", {}, state_dir=state, out=tmp_path / f"v{i}", expert_id=f"e{i}")
        backbone = tmp_path / f"v{i}"
    rep = engine.unmerge(state, "e0", "replay", out=tmp_path / "r1", base=base)
    assert rep.experts == ["e1", "e2"]  # e1 and e2 refolded from the bucket
    c.put_object(Bucket=bucket, Key="e2.safetensors", Body=(tmp_path / "e0.safetensors").read_bytes())
    with pytest.raises(ObjectChangedError, match="no longer the version recorded"):
        engine.unmerge(state, "e1", "replay", out=tmp_path / "r2", base=base)
    assert not (tmp_path / "r2").exists()


# ------------------------------------------------------------------------------------------
# The daemon, s3.cache: false
# ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_daemon_without_cache_folds_in_place_and_keeps_a_reference(s3, bucket, tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # the daemon's endpoint is its config's, written into the reference
    c = s3.client()
    base = tiny_base()
    d = Daemon(tmp_path, extra={"s3": {"enabled": True, "bucket": bucket, "prefix": "experts/", "cache": False,
                                       "endpoint_url": s3.endpoint, "interval_seconds": 0.3}},
               env=TEST_CREDENTIALS)
    try:
        d.start()
        ok0 = save_tensors(tmp_path / "up" / "ok0.safetensors", scaled_expert(base, 20))
        c.upload_file(str(ok0), bucket, "experts/ok0.safetensors")
        d.wait(lambda: d.status()["current_version"] == 1, 60, "ok0 not folded")
        [row] = d.status()["experts"]
        assert row["status"] == "accepted" and row["sha256"] == content_sha256(ok0)
    finally:
        d.stop()
    state = tmp_path / "state"
    assert not [p for p in (state / "cache" / "s3").rglob("*") if p.is_file()]  # nothing downloaded
    [kept] = (state / "experts" / "ok0").iterdir()
    assert kept.name == "ok0.s3ref.json" and kept.stat().st_size < 2000
    manifest = json.loads((state / "versions" / "000001" / "state" / "manifest.json").read_text())
    assert manifest["folds"][0]["expert"] == str(kept.resolve())  # what replay re-reads from the bucket
    assert content_sha256(kept) == content_sha256(ok0)
    c.put_object(Bucket=bucket, Key="experts/ok0.safetensors", Body=b"replaced")
    with pytest.raises(ObjectChangedError):  # replay refuses a replaced object instead of folding it
        open_checkpoint(kept)


# ------------------------------------------------------------------------------------------
# Ray: tasks read their inputs from the bucket
# ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_ray_tasks_read_the_expert_from_the_bucket_through_a_reference(s3, bucket, model, tmp_path, caplog):
    """Each Ray task reopens the expert by its path: a reference file sends it to the bucket (the
    workers get the credentials from their environment and the endpoint from the reference). The
    driver fetches headers and the frozen integer buffer only: every float tensor's bytes go from the
    bucket to a task, which writes its shard bytes itself (issue 37); same output, same content hash."""
    ray = pytest.importorskip("ray")
    from mergestream.engine.executors import make_executor
    from mergestream.engine.executors.ray_cluster import loopback_only

    base, expert = model
    c = s3.client()
    uri = upload(s3, bucket, expert, "experts/e1.safetensors")
    head = c.head_object(Bucket=bucket, Key="experts/e1.safetensors")
    ref = s3_checkpoint.S3Ref(uri, {"experts/e1.safetensors": {"etag": head["ETag"].strip('"'),
                                                                "size": head["ContentLength"]}},
                              s3.endpoint).write(tmp_path / "e1.s3ref.json")
    local = engine.fold(base, None, expert, "ties", {}, state_dir=tmp_path / "s-l", out=tmp_path / "o-l",
                        expert_id="e1")
    if ray.is_initialized():
        pytest.skip("a Ray instance of another test is running; this one needs its own (credentials in its env)")
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_AUTH_MODE", "disabled")
    mp.delenv("AWS_ENDPOINT_URL")  # the workers find the endpoint in the reference
    loopback_only()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # inherits the credentials
    try:
        ex = make_executor("ray", group_bytes=6 * 1024)
        caplog.set_level(logging.DEBUG, logger="mergestream.io.s3_checkpoint")
        caplog.clear()
        remote = engine.fold(base, None, ref, "ties", {}, state_dir=tmp_path / "s-r", out=tmp_path / "o-r",
                             expert_id="e1", options=engine.ExecOptions(threads=1, executor=ex))
        assert len(ex.tasks) > 1
    finally:
        ray.shutdown()
        mp.undo()
    assert remote.sha256 == local.sha256
    for f in sorted((tmp_path / "o-l").iterdir()):
        assert (tmp_path / "o-r" / f.name).read_bytes() == f.read_bytes(), f.name
    with open_safetensors_file(expert) as ck:
        float_spans = [(e.offset, e.offset + e.nbytes) for n in ck.keys() if (e := ck.entry(n)).dtype != "I64"]
    fetched = [(a, b + 1) for _, a, b in gets(caplog)]
    assert fetched, "the driver's reads were not logged"
    overlap = sum(max(0, min(b, fb) - max(a, fa)) for a, b in fetched for fa, fb in float_spans)
    assert overlap == 0, "the driver read float tensor bytes of the expert"
    assert ex.received_bytes < expert.stat().st_size / 5
