"""Ray workers write their output shards to object storage (issue 37): a fold or merge to
``s3://bucket/root/`` on the two-node test cluster of :mod:`tests.test_executor_ray`, against the
loopback S3 server of :mod:`tests.s3_server`. The version it writes is byte for byte the local
executor's output folder; the driver's own S3 traffic stays within one part per shard plus the
small files (tensor data goes from the workers to the bucket and is assembled by server-side
copies); a failing task leaves no object behind and ``current`` where it was; ``current`` is
replaced last, earlier versions kept."""

from __future__ import annotations

import json

import pytest
import torch

ray = pytest.importorskip("ray")

from mergestream import engine  # noqa: E402
from mergestream.engine import ExecOptions, LocalExecutor  # noqa: E402
from mergestream.engine.executors import make_executor  # noqa: E402
from mergestream.errors import ValidationError  # noqa: E402
from mergestream.io import s3_output  # noqa: E402
from mergestream.io.state import StateDir  # noqa: E402

from .conftest import perturb, random_model, save_tensors  # noqa: E402
from .s3_server import TEST_CREDENTIALS, run_s3_server  # noqa: E402
from .test_executor_ray import KillOnce, _files, _state_bytes, cluster  # noqa: E402,F401 - cluster: a fixture

#: the part size the driver uses here (S3's is 5 MiB; the test server is told to accept this one),
#: so that models of a few hundred KiB have shards larger than a part
PART = 32 * 1024
SHARD = 128 * 1024
POLICIES = [("task_arithmetic", {"lambda": 0.7}), ("ties", {"k": 30}),
            ("safe_merge", {"steps": 3, "k": 4, "k_s": 4, "rank": 2, "k_old": 4})]


@pytest.fixture(scope="module")
def s3():
    """A server for this module that accepts multipart parts of :data:`PART` bytes."""
    mp = pytest.MonkeyPatch()
    mp.setenv("S3_UPLOAD_PART_MIN_SIZE", str(PART))
    try:
        with run_s3_server() as server:
            yield server
    finally:
        mp.undo()


@pytest.fixture(scope="module", autouse=True)
def aws_env(s3):
    """The standard AWS chain points at the server, set before the cluster starts: its workers
    inherit it (credentials and ``AWS_ENDPOINT_URL``)."""
    mp = pytest.MonkeyPatch()
    for k, v in TEST_CREDENTIALS.items():
        mp.setenv(k, v)
    mp.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    yield
    mp.undo()


@pytest.fixture
def part(monkeypatch):
    monkeypatch.setattr(s3_output, "PART_MIN", PART)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A bf16 base of about 540 KiB (several shards of :data:`SHARD`) and two experts."""
    tmp = tmp_path_factory.mktemp("s3out-models")
    base = random_model(0, torch.bfloat16, m=512, n=256)
    bpath = save_tensors(tmp / "base.safetensors", base)
    experts = [save_tensors(tmp / f"{c}.safetensors", perturb(base, 0.05, 10 + i)) for i, c in enumerate("AB")]
    return bpath, experts


def traffic(monkeypatch) -> list[tuple[str, str, int]]:
    """Record the driver's S3 requests (its output's client): ``(operation, direction, bytes)``,
    bytes as sent (request bodies) and received (GET bodies). Server-side copies carry none."""
    seen: list[tuple[str, str, int]] = []
    real = s3_output.make_client

    def sent(request, event_name, **_):
        n = int(request.headers.get("Content-Length") or 0)
        seen.append((event_name.rsplit(".", 1)[-1], "up", n))

    def received(parsed, event_name, **_):
        seen.append((event_name.rsplit(".", 1)[-1], "down", int(parsed.get("ContentLength") or 0)))

    def make(*a, **k):
        c = real(*a, **k)
        c.meta.events.register("before-send.s3", sent)
        c.meta.events.register("after-call.s3.GetObject", received)
        return c

    monkeypatch.setattr(s3_output, "make_client", make)
    return seen


def objects(s3, bucket: str, prefix: str = "") -> dict[str, bytes]:
    """Every object under ``prefix``, by key relative to it."""
    c, out = s3.client(), {}
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"][len(prefix):]] = c.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    return out


def uploads(s3, bucket: str) -> list[str]:
    return [u["Key"] for u in s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


def _fold(bpath, backbone, expert, policy, params, state, out, eid, executor, **kw):
    return engine.fold(bpath, backbone, expert, policy, params, state_dir=state, out=out, expert_id=eid,
                       options=ExecOptions(threads=1, executor=executor, max_shard_bytes=SHARD), **kw)


@pytest.mark.parametrize(("policy", "params"), POLICIES, ids=[p for p, _ in POLICIES])
def test_folds_to_s3_on_the_cluster_equal_local_folds_and_the_driver_carries_a_part_per_shard(
        cluster, s3, models, part, tmp_path, monkeypatch, policy, params):
    """Two folds: the second reads its backbone from the first version in the bucket and replaces
    ``current``; each version is the local executor's folder byte for byte, the state too."""
    bpath, experts = models
    bucket = s3.new_bucket("out")
    root = f"s3://{bucket}/models/"
    ex = make_executor("ray")
    seen = traffic(monkeypatch)
    backbone_l = backbone_r = None
    for i, e in enumerate(experts):
        out_l = tmp_path / f"local-{i}"
        _fold(bpath, backbone_l, e, policy, params, tmp_path / "st-l", out_l, f"e{i}", LocalExecutor())
        seen.clear()
        rep = _fold(bpath, backbone_r, e, policy, params, tmp_path / "st-r", root, f"e{i}", ex)
        assert rep.out == f"{root}versions/{i + 1:06d}/model/"
        want = _files(out_l)
        shards = [k for k in want if k.endswith(".safetensors")]
        assert len(shards) >= 3, "the output should have several shards"
        assert len(ex.tasks) == len(shards), "one task per shard"
        got = objects(s3, bucket, f"models/versions/{i + 1:06d}/model/")
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == want[k], k
        pointer = json.loads(objects(s3, bucket, "models/")["current"])
        assert pointer == {"version": i + 1, "prefix": f"versions/{i + 1:06d}/",
                           "files": {f"model/{k}": len(v) for k, v in want.items()}}
        assert sorted(objects(s3, bucket, "models/")) == sorted(
            ["current"] + [f"versions/{v:06d}/model/{k}" for v in range(1, i + 2) for k in want]), \
            "staging objects left, or an earlier version changed"
        assert not uploads(s3, bucket)
        # the driver: per shard at most one part each way (header + PART), plus the small files
        small = sum(len(v) for k, v in want.items() if k not in shards)
        up = sum(n for _, d, n in seen if d == "up")
        down = sum(n for _, d, n in seen if d == "down")
        heads = sum(int.from_bytes(want[k][:8], "little") + 8 for k in shards)
        model_bytes = sum(len(want[k]) for k in shards)
        print(f"{policy} fold {i + 1}: driver S3 bytes down {down}, up {up}; {len(shards)} shards, model {model_bytes}")
        assert down <= len(shards) * PART
        assert up <= len(shards) * PART + heads + small + 4096  # + current
        assert down + up < model_bytes / 2, (down, up, model_bytes)
        assert {op for op, _, _ in seen} >= {"UploadPartCopy", "UploadPart", "CompleteMultipartUpload"}
        backbone_l, backbone_r = out_l, rep.out
    assert _state_bytes(tmp_path / "st-r") == _state_bytes(tmp_path / "st-l")


def test_merge_to_s3_equals_the_local_merge(cluster, s3, models, part, tmp_path):
    bpath, experts = models
    bucket = s3.new_bucket("merge")
    opts = {"threads": 1, "max_shard_bytes": SHARD}
    engine.merge(bpath, experts, "ties", {"k": 30}, out=tmp_path / "local", options=ExecOptions(**opts))
    rep = engine.merge(bpath, experts, "ties", {"k": 30}, out=f"s3://{bucket}/m",
                       options=ExecOptions(executor=make_executor("ray"), **opts))
    assert rep.out == f"s3://{bucket}/m/versions/000001/model/"
    assert objects(s3, bucket, "m/versions/000001/model/") == _files(tmp_path / "local")


def test_a_failing_task_leaves_nothing_in_the_bucket_and_current_unchanged(cluster, s3, models, part, tmp_path):
    bpath, experts = models
    bucket = s3.new_bucket("fail")
    root = f"s3://{bucket}/r/"
    first = _fold(bpath, None, experts[0], "ties", {"k": 30}, tmp_path / "st", root, "e0", make_executor("ray"))
    before, state_before = objects(s3, bucket), _files(tmp_path / "st")

    def fail(names):  # runs in the worker; other tasks may have staged their shards already
        if any("mlp" in n for n in names):
            raise RuntimeError("disk on fire")

    ex = make_executor("ray", task_hook=fail, max_retries=1)
    with pytest.raises(RuntimeError, match="disk on fire"):
        _fold(bpath, first.out, experts[1], "ties", {"k": 30}, tmp_path / "st", root, "e1", ex)
    assert objects(s3, bucket) == before, "a staging object or a part of version 2 was left, or current moved"
    assert not uploads(s3, bucket)
    assert _files(tmp_path / "st") == state_before
    # every task staged its shard, then the driver refuses the fold (the expert is not the one recorded)
    from mergestream.errors import CorruptCheckpointError

    with pytest.raises(CorruptCheckpointError):
        _fold(bpath, first.out, experts[1], "ties", {"k": 30}, tmp_path / "st", root, "e1", make_executor("ray"),
              expect_sha256="0" * 64)
    assert objects(s3, bucket) == before and not uploads(s3, bucket)
    assert _files(tmp_path / "st") == state_before
    # a version whose pointer was lost is never written over: the next fold is version 3
    s3.client().put_object(Bucket=bucket, Key="r/versions/000002/model/stray", Body=b"x")
    rep = _fold(bpath, first.out, experts[1], "ties", {"k": 30}, tmp_path / "st", root, "e1", make_executor("ray"))
    assert rep.out == f"{root}versions/000003/model/"
    assert objects(s3, bucket, "r/versions/000002/") == {"model/stray": b"x"}
    assert json.loads(objects(s3, bucket, "r/")["current"])["version"] == 3


def test_the_local_executor_uploads_its_output_and_unmerge_refuses_a_bucket(s3, models, tmp_path, monkeypatch):
    """Without remote tasks the output is written here and uploaded as files: the same version."""
    bpath, experts = models
    bucket = s3.new_bucket("local")
    _fold(bpath, None, experts[0], "ties", {"k": 30}, tmp_path / "st-l", tmp_path / "local", "e0", LocalExecutor())
    seen = traffic(monkeypatch)
    rep = _fold(bpath, None, experts[0], "ties", {"k": 30}, tmp_path / "st", f"s3://{bucket}/r", "e0",
                LocalExecutor())
    assert rep.out == f"s3://{bucket}/r/versions/000001/model/"
    assert objects(s3, bucket, "r/versions/000001/model/") == _files(tmp_path / "local")
    assert sum(n for _, d, n in seen if d == "up") >= sum(len(v) for v in _files(tmp_path / "local").values())
    assert StateDir(tmp_path / "st").manifest.backbone == rep.out
    with pytest.raises(ValidationError, match="unmerge writes its output to a folder"):
        engine.unmerge(tmp_path / "st", "e0", "subtract", out="s3://b/r/")


def test_opcm_global_on_ray_is_rewritten_on_the_driver_and_uploaded(cluster, s3, models, part, tmp_path):
    """OPCM ``scope=global``: the driver writes the output from the state after the map (the tasks
    stage nothing); the version equals the local fold, no staging object is left."""
    bpath, experts = models
    bucket = s3.new_bucket("opcm")
    params = {"alpha": 0.5, "scope": "global"}
    _fold(bpath, None, experts[0], "opcm", params, tmp_path / "st-l", tmp_path / "local", "e0", LocalExecutor())
    _fold(bpath, None, experts[0], "opcm", params, tmp_path / "st-r", f"s3://{bucket}/o/", "e0",
          make_executor("ray"))
    want = _files(tmp_path / "local")
    assert objects(s3, bucket, "o/") == {"current": objects(s3, bucket, "o/")["current"],
                                         **{f"versions/000001/model/{k}": v for k, v in want.items()}}
    assert _state_bytes(tmp_path / "st-r") == _state_bytes(tmp_path / "st-l")


def test_a_killed_worker_is_retried_and_overwrites_only_its_own_staging_object(cluster, s3, models, part, tmp_path):
    """The worker of the first task to start dies (before it stages anything); Ray reruns the task,
    which stages its shard under the same key: the version is the local fold's bytes and only the
    version's objects and ``current`` are left."""
    bpath, experts = models
    bucket = s3.new_bucket("retry")
    marker = tmp_path / "killed-once"

    _fold(bpath, None, experts[0], "ties", {"k": 30}, tmp_path / "st-l", tmp_path / "local", "e0", LocalExecutor())
    ex = make_executor("ray", task_hook=KillOnce(marker), max_retries=2)
    rep = _fold(bpath, None, experts[0], "ties", {"k": 30}, tmp_path / "st-r", f"s3://{bucket}/r/", "e0", ex)
    assert marker.exists()
    assert objects(s3, bucket, "r/versions/000001/model/") == _files(tmp_path / "local")
    assert sorted(objects(s3, bucket, "r/")) == sorted(["current"] + [f"versions/000001/model/{k}"
                                                                      for k in _files(tmp_path / "local")])
    assert rep.sha256 == engine.fold(bpath, None, experts[0], "ties", {"k": 30}, state_dir=tmp_path / "st-x",
                                     out=tmp_path / "x", expert_id="e0").sha256


def test_tied_tensors_in_two_shards_are_written_by_one_task(cluster, s3, tmp_path, part):
    """θ₀ ties its LM head to its embeddings and the shard cap puts them in different shards: the
    task that folds the embeddings owns both shards (its staging objects), same bytes as local."""
    base = random_model(3, torch.bfloat16)
    base["lm_head.weight"] = base["embed.word_embeddings.weight"].clone()
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    e = perturb(base, 0.05, 20)
    e["lm_head.weight"] = e["embed.word_embeddings.weight"].clone()
    epath = save_tensors(tmp_path / "e.safetensors", e)
    bucket = s3.new_bucket("tied")
    opts = {"threads": 1, "max_shard_bytes": 2048}
    engine.fold(bpath, None, epath, "ties", {"k": 30}, state_dir=tmp_path / "st-l", out=tmp_path / "local",
                expert_id="e0", options=ExecOptions(**opts))
    ex = make_executor("ray")
    engine.fold(bpath, None, epath, "ties", {"k": 30}, state_dir=tmp_path / "st-r", out=f"s3://{bucket}/t/",
                expert_id="e0", options=ExecOptions(executor=ex, **opts))
    want = _files(tmp_path / "local")
    shards = [k for k in want if k.endswith(".safetensors")]
    assert len(shards) > 3 and len(ex.tasks) < len(shards)
    assert objects(s3, bucket, "t/versions/000001/model/") == want


@pytest.mark.slow
def test_with_s3s_own_part_size_the_driver_carries_5_mib_per_shard_of_a_larger_model(cluster, s3, tmp_path,
                                                                                       monkeypatch):
    """The real part size (5 MiB) on shards of 24 MiB: the driver's traffic is one part each way per
    shard, well under the model's 48 MiB."""
    g = torch.Generator().manual_seed(1)
    base = {f"layer.{i}.mlp.weight": (torch.randn(3072, 2048, generator=g) * 0.1).to(torch.bfloat16) for i in range(4)}
    base["position_ids"] = torch.arange(16)[None]
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    epath = save_tensors(tmp_path / "e.safetensors", perturb(base, 0.05, 2))
    bucket = s3.new_bucket("big")
    opts = {"threads": 1, "max_shard_bytes": 24 * 1024**2 + 1024}
    engine.fold(bpath, None, epath, "task_arithmetic", {"lambda": 0.5}, state_dir=tmp_path / "st-l",
                out=tmp_path / "local", expert_id="e0", options=ExecOptions(**opts))
    seen = traffic(monkeypatch)
    engine.fold(bpath, None, epath, "task_arithmetic", {"lambda": 0.5}, state_dir=tmp_path / "st-r",
                out=f"s3://{bucket}/big/", expert_id="e0", options=ExecOptions(executor=make_executor("ray"), **opts))
    want = _files(tmp_path / "local")
    shards = [k for k in want if k.endswith(".safetensors")]
    assert len(shards) == 2
    assert objects(s3, bucket, "big/versions/000001/model/") == want
    down = sum(n for _, d, n in seen if d == "down")
    up = sum(n for _, d, n in seen if d == "up")
    model_bytes = sum(len(want[k]) for k in shards)
    print(f"driver S3 bytes: down {down}, up {up}; model {model_bytes}")
    assert down <= 2 * s3_output.PART_MIN
    assert up <= 2 * s3_output.PART_MIN + sum(len(v) for k, v in want.items() if k not in shards) + 8192
    assert down + up < model_bytes / 2


def test_cli_folds_to_a_bucket_with_either_executor(cluster, s3, models, part, tmp_path):
    from click.testing import CliRunner

    from mergestream.cli import cli

    bpath, experts = models
    bucket = s3.new_bucket("cli")
    args = ["fold", "--base", str(bpath), "--expert", str(experts[0]), "--policy", "ties", "--set", "k=30",
            "--threads", "1", "-q", "--max-shard-size", str(SHARD), "--out", f"s3://{bucket}/c/"]
    r = CliRunner().invoke(cli, [*args, "--state", str(tmp_path / "s1"), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["out"] == f"s3://{bucket}/c/versions/000001/model/"
    r = CliRunner().invoke(cli, [*args, "--state", str(tmp_path / "s2"), "--executor", "ray", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["out"] == f"s3://{bucket}/c/versions/000002/model/"
    assert json.loads(objects(s3, bucket, "c/")["current"])["version"] == 2
    assert objects(s3, bucket, "c/versions/000001/") == objects(s3, bucket, "c/versions/000002/")
    r = CliRunner().invoke(cli, ["fold", "--base", str(bpath), "--expert", str(experts[0]), "--policy", "ties",
                                 "--state", str(tmp_path / "s3"), "-q", "--out", "s3://no-such-bucket/x/"])
    assert r.exit_code == 2 and "NoSuchBucket" in r.output and "Traceback" not in r.output, r.output
