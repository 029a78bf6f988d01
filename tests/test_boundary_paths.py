"""Every path an input names stays inside its root (issue #36, T3-03), the whole class: the rules of
:mod:`mergestream.io.paths`, then each reader that applies them: a sharded folder's index and a model
folder's files (the real ``fold`` and ``inspect``), an adapter's files, the patch apply side, an S3
folder's index and the S3 source's download (the real S3 test server), the MLflow copy check and
the device agent's full-model files and hashes. A refusal is exit 2 with one line naming the
offending name; nothing is written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import urllib3
from tuf.api.metadata import TargetFile

from mergestream.agent.errors import TargetRefused
from mergestream.agent.fetch import download
from mergestream.agent.pull import _apply, _check_names
from mergestream.agent.slots import Device
from mergestream.daemon.s3client import make_client
from mergestream.daemon.sources.mlflow_download import DownloadIncomplete, verify_copy
from mergestream.daemon.sources.s3 import S3Source
from mergestream.errors import OutsideRootError
from mergestream.feed.plan import Plan, Target
from mergestream.io.checkpoints import open_checkpoint
from mergestream.io.paths import confined, confined_files, confined_key, escaping_link, relative_name
from mergestream.patches import PatchError, Weights, apply_patch

from .conftest import random_model, run_cli, save_tensors
from .s3_server import TEST_CREDENTIALS, s3  # noqa: F401 - s3: a fixture
from .test_patches import forge

BAD_NAMES = ["/etc/passwd", "../x.safetensors", "a/../../x", "~/x", "~root/x", "C:/x", "C:x", "a\\..\\x",
             "a\x00b", "", None, 3, "x" * 256 + ".safetensors", "sub/" + "é" * 128]


# -- the rules -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_relative_name_refuses_every_name_that_can_leave_its_folder(name):
    with pytest.raises(OutsideRootError, match="shard"):
        relative_name(name, "shard", error=OutsideRootError)


@pytest.mark.parametrize("name", ["model.safetensors", "sub/model-00001.safetensors", "a..b", "..x", "x.."])
def test_relative_name_takes_plain_relative_names(name):
    assert relative_name(name, "shard", error=OutsideRootError) == name


def test_confined_follows_links_and_refuses_one_out(tmp_path):
    root, out = tmp_path / "root", tmp_path / "private"
    (root / "sub").mkdir(parents=True)
    out.mkdir()
    (out / "x").write_text("secret")
    (root / "sub" / "y").write_text("mine")
    os.symlink("../private/x", root / "leak")                # a file link out
    os.symlink(out, root / "dir")                            # a folder link out (absolute)
    os.symlink("sub/y", root / "alias")                      # a link that stays inside
    assert confined(root, "sub/y", "file", error=OutsideRootError) == root / "sub" / "y"
    assert confined(root, "alias", "file", error=OutsideRootError) == root / "alias"
    for name in ("leak", "dir/x"):
        with pytest.raises(OutsideRootError, match="resolves outside"):
            confined(root, name, "file", error=OutsideRootError)
    for name in ("../private/x", str(out / "x")):
        with pytest.raises(OutsideRootError):
            confined(root, name, "file", error=OutsideRootError)
    # a sibling whose name starts like the root is not inside it
    (tmp_path / "root2").mkdir()
    os.symlink("../root2", root / "twin")
    with pytest.raises(OutsideRootError):
        confined(root, "twin", "file", error=OutsideRootError)


@pytest.mark.parametrize("name", ["a//b", "./a", "a/./b", "a/", "/a", "a/../b", "..", "a\\b"])
def test_confined_key_refuses_empty_dot_and_dotdot_components(name):
    with pytest.raises(OutsideRootError):
        confined_key("experts/e1/", name, "key", error=OutsideRootError)


def test_confined_key_joins_a_plain_name():
    assert confined_key("experts/e1/", "sub/model.safetensors", "key", error=OutsideRootError) == \
        "experts/e1/sub/model.safetensors"
    assert confined_key("", "model.safetensors", "key", error=OutsideRootError) == "model.safetensors"


def test_escaping_link_and_confined_files_name_the_link(tmp_path):
    root = tmp_path / "inbox"
    (root / "e1" / "deep").mkdir(parents=True)
    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "w").write_text("secret")
    (root / "e1" / "a").write_text("a")
    os.symlink("../a", root / "e1" / "deep" / "ok")          # inside: fine
    os.symlink("..", root / "e1" / "deep" / "cycle")         # a folder cycle: walked once
    assert escaping_link(root / "e1", root) is None
    assert sorted(str(r) for r, _ in confined_files(root / "e1", root, "e1", error=OutsideRootError)) == \
        ["a", "deep/ok"]  # deep/cycle is e1 again: walked once
    os.symlink("../../../private/w", root / "e1" / "deep" / "leak")
    why = escaping_link(root / "e1", root)
    assert why is not None and "e1/deep/leak" in why and "../../../private/w" in why
    with pytest.raises(OutsideRootError, match="e1/deep/leak"):
        confined_files(root / "e1", root, "expert e1", error=OutsideRootError)


# -- the real CLI on local checkpoints -------------------------------------------------------------
@pytest.fixture
def world(tmp_path) -> dict:
    base = random_model(0)
    save_tensors(tmp_path / "base.safetensors", base)
    secret = {k: (v + 7 if v.is_floating_point() else v) for k, v in base.items()}
    save_tensors(tmp_path / "private" / "secret.safetensors", secret)
    return {"root": tmp_path, "base": tmp_path / "base.safetensors", "secret": tmp_path / "private" / "secret.safetensors",
            "tensors": base}


def _sharded(w: dict, name: str, shard: str, link_to: Path | None = None) -> Path:
    e = w["root"] / name
    e.mkdir()
    if link_to is not None:
        os.symlink(link_to, e / shard)
    (e / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: shard for k in w["tensors"]}}))
    return e


def _one_line_exit_2(proc, *words: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def _fold(w: dict, expert: Path, tag: str):
    return run_cli("fold", "--base", w["base"], "--expert", expert, "--policy", "task_arithmetic", "--set",
                   "lambda=1", "--state", w["root"] / f"st-{tag}", "--out", w["root"] / f"out-{tag}", check=False)


@pytest.mark.parametrize("variant", ["dotdot", "absolute", "link_out"])
def test_fold_and_inspect_refuse_a_shard_outside_the_folder(world, variant):
    w = world
    if variant == "dotdot":
        e, named = _sharded(w, "e", "../private/secret.safetensors"), "../private/secret.safetensors"
    elif variant == "absolute":
        e, named = _sharded(w, "e", str(w["secret"])), str(w["secret"])
    else:  # an in-folder shard name that is a symlink out of the folder
        e, named = _sharded(w, "e", "model-00001.safetensors", link_to=w["secret"]), "model-00001.safetensors"
    _one_line_exit_2(_fold(w, e, variant), named)
    assert not (w["root"] / f"out-{variant}").exists() and not (w["root"] / f"st-{variant}").exists()
    _one_line_exit_2(run_cli("inspect", e, check=False), named)
    _one_line_exit_2(run_cli("inspect", "--base", w["base"], e, check=False), named)


def test_a_model_folder_file_that_links_out_is_refused(world):
    w = world
    e = w["root"] / "single"
    e.mkdir()
    os.symlink(w["secret"], e / "model.safetensors")
    _one_line_exit_2(_fold(w, e, "single"), "model.safetensors")
    assert not (w["root"] / "out-single").exists()
    with pytest.raises(OutsideRootError):
        open_checkpoint(e)


def test_a_shard_link_that_stays_inside_the_folder_folds(world):
    w = world
    e = w["root"] / "inside"
    save_tensors(e / "blobs" / "abc.safetensors", {k: v + 0.01 if v.is_floating_point() else v
                                                    for k, v in w["tensors"].items()})
    os.symlink("blobs/abc.safetensors", e / "model-00001.safetensors")
    (e / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: "model-00001.safetensors" for k in w["tensors"]}}))
    assert _fold(w, e, "inside").returncode == 0
    assert (w["root"] / "out-inside" / "model.safetensors").is_file()


def test_a_hugging_face_cache_snapshot_folds_and_its_links_stay_in_its_repository(world):
    """``models--org--name/snapshots/<rev>/`` holds links to ``../../blobs/<hash>``: its root is
    the repository folder, so it folds; a link out of the repository folder is still refused."""
    w = world
    repo = w["root"] / "hub" / "models--org--tiny"
    save_tensors(repo / "blobs" / "0123abcd", {k: v + 0.01 if v.is_floating_point() else v
                                               for k, v in w["tensors"].items()})
    snap = repo / "snapshots" / "rev1"
    snap.mkdir(parents=True)
    os.symlink("../../blobs/0123abcd", snap / "model.safetensors")
    assert _fold(w, snap, "hf").returncode == 0
    assert (w["root"] / "out-hf" / "model.safetensors").is_file()
    out = repo / "snapshots" / "rev2"
    out.mkdir()
    os.symlink(w["secret"], out / "model.safetensors")
    _one_line_exit_2(_fold(w, out, "hf2"), "model.safetensors")


@pytest.mark.parametrize("member", ["adapter_model.safetensors", "adapter_config.json"])
def test_an_adapter_file_that_links_out_is_refused(world, member):
    w = world
    from safetensors.torch import save_file

    outside = w["root"] / "private"
    g = torch.Generator().manual_seed(1)
    save_file({"base_model.model.layer.0.attn.lora_A.weight": torch.randn(2, 40, generator=g),
               "base_model.model.layer.0.attn.lora_B.weight": torch.randn(48, 2, generator=g)},
              str(outside / "adapter_model.safetensors"))
    (outside / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                             "target_modules": ["attn"]}))
    ad = w["root"] / "adapter"
    ad.mkdir()
    for f in ("adapter_model.safetensors", "adapter_config.json"):
        if f == member:
            os.symlink(outside / f, ad / f)
        else:
            (ad / f).write_bytes((outside / f).read_bytes())
    _one_line_exit_2(_fold(w, ad, member), member)
    assert not (w["root"] / f"out-{member}").exists()
    _one_line_exit_2(run_cli("inspect", ad, check=False), member)


def test_a_sharded_legacy_bin_index_is_refused_by_name(world):
    e = world["root"] / "legacy"
    e.mkdir()
    (e / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"w": "../private/x.bin"}}))
    _one_line_exit_2(_fold(world, e, "legacy"), "pytorch_model.bin.index.json")


# -- patches -------------------------------------------------------------------------------------
def test_the_patch_apply_side_refuses_an_index_shard_outside_the_model_folder(world, tmp_path):
    w = world
    model = _sharded(w, "model", "../private/secret.safetensors")
    with pytest.raises(PatchError, match=r"\.\./private/secret\.safetensors"):
        Weights(model)
    a, b = tmp_path / "a", tmp_path / "b"
    save_tensors(a / "model.safetensors", w["tensors"])
    save_tensors(b / "model.safetensors", {k: v + 1 if v.is_floating_point() else v for k, v in w["tensors"].items()})
    patch = tmp_path / "p.safetensors"
    run_cli("make-patch", "--from-dir", a, "--to-dir", b, "--out", patch)
    _one_line_exit_2(run_cli("apply-patch", model, patch, "--out", tmp_path / "out", check=False),
                     "../private/secret.safetensors")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field", ["file", "index"])
def test_a_patch_naming_an_output_file_outside_is_refused(world, tmp_path, field):
    w = world
    a, b = tmp_path / "a", tmp_path / "b"
    save_tensors(a / "model.safetensors", w["tensors"])
    save_tensors(b / "model.safetensors", {k: v + 1 if v.is_floating_point() else v for k, v in w["tensors"].items()})
    patch = tmp_path / "p.safetensors"
    run_cli("make-patch", "--from-dir", a, "--to-dir", b, "--out", patch)

    def evil(obj, _payload):
        layout = json.loads(obj["__metadata__"]["target_layout"])
        if field == "file":
            layout["files"][0]["name"] = "../escaped.safetensors"
        else:
            layout["index"] = {"name": "../escaped.index.json", "text": "{}"}
        obj["__metadata__"]["target_layout"] = json.dumps(layout)

    bad = forge(patch, tmp_path / "bad.safetensors", data=evil)
    out = tmp_path / "out"
    line = _one_line_exit_2(run_cli("apply-patch", a, bad, "--out", out, check=False), "../escaped")
    assert "error:" in line
    with pytest.raises(PatchError, match="escaped"):
        apply_patch(a, bad, out)
    assert not out.exists() and not list(tmp_path.glob("escaped*"))


# -- S3 ------------------------------------------------------------------------------------------
@pytest.fixture
def aws_env(monkeypatch, s3):  # noqa: F811
    for k, v in TEST_CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)


@pytest.mark.parametrize("shard", ["../private/secret.safetensors", "/abs/secret.safetensors",
                                   "sub//secret.safetensors", "./secret.safetensors"])
def test_an_s3_index_naming_a_shard_outside_its_prefix_is_refused(s3, aws_env, world, shard):  # noqa: F811
    w = world
    bucket, c = s3.new_bucket("idx"), s3.client()
    c.put_object(Bucket=bucket, Key="private/secret.safetensors", Body=w["secret"].read_bytes())
    c.put_object(Bucket=bucket, Key="experts/e1/model.safetensors.index.json",
                 Body=json.dumps({"metadata": {}, "weight_map": {k: shard for k in w["tensors"]}}).encode())
    uri = f"s3://{bucket}/experts/e1/"
    with pytest.raises(OutsideRootError, match="shard"):
        open_checkpoint(uri)
    _one_line_exit_2(_fold(w, uri, "s3"), "shard")
    assert not (w["root"] / "out-s3").exists()


@pytest.mark.parametrize("cache", [True, False])
def test_the_s3_source_refuses_an_object_key_that_leaves_the_folder(s3, aws_env, world, tmp_path, cache):  # noqa: F811
    """A folder expert holding a key with a ``..`` component is refused as a whole (kind
    ``outside``, once, with a note), downloaded or referenced (``s3.cache: false``); nothing is
    written outside the cache."""
    w = world
    bucket, c = s3.new_bucket("keys"), s3.client()
    body = save_tensors(tmp_path / "w.safetensors", w["tensors"]).read_bytes()
    c.put_object(Bucket=bucket, Key="experts/e1/model.safetensors", Body=body)
    c.put_object(Bucket=bucket, Key="experts/e1/sub/../../../../escaped.safetensors", Body=body)
    c.put_object(Bucket=bucket, Key="experts/e1/READY", Body=b"")
    assert any(".." in o["Key"] for o in c.list_objects_v2(Bucket=bucket)["Contents"])  # kept as written
    errors, notes = [], []
    src = S3Source(bucket, "experts/", lambda ev: None, client=lambda: make_client(s3.endpoint),
                   cache_dir=tmp_path / "s3" / "cache",
                   on_error=errors.append, note=lambda *a: notes.append(a), cache=cache,
                   refs_dir=tmp_path / "s3" / "refs")
    before = {p for p in tmp_path.rglob("*")}
    assert src.poll() == []
    assert [e.kind for e in errors] == ["outside"] and "sub/../../../../escaped.safetensors" in str(errors[0])
    assert any(n[0] == "object:experts/e1/" and n[1] and "outside" in n[1] for n in notes), notes
    assert src.poll() == [] and len(errors) == 1  # reported once, not on every poll
    new = {p for p in tmp_path.rglob("*")} - before
    assert all(tmp_path / "s3" in p.parents for p in new), new
    assert not any(p.name == "escaped.safetensors" for p in tmp_path.rglob("*"))


# -- MLflow --------------------------------------------------------------------------------------
@pytest.mark.parametrize("rel", ["../x.safetensors", "/etc/passwd", "a/../../x"])
def test_an_mlflow_listing_naming_a_file_outside_the_copy_is_incomplete(tmp_path, rel):
    art = tmp_path / "v1" / "expert"
    save_tensors(art / "model.safetensors", random_model(1))
    (tmp_path / "v1" / "x.safetensors").write_bytes(b"12345")  # exists outside with the listed size
    listing = {"model.safetensors": (art / "model.safetensors").stat().st_size, rel: 5}
    with pytest.raises(DownloadIncomplete, match=rel.replace(".", r"\.")):
        verify_copy(art, listing, "download")


def test_an_mlflow_copy_whose_file_links_out_is_incomplete(tmp_path):
    art = tmp_path / "v1" / "expert"
    art.mkdir(parents=True)
    outside = save_tensors(tmp_path / "private" / "w.safetensors", random_model(1))
    os.symlink(outside, art / "model.safetensors")
    with pytest.raises(DownloadIncomplete, match="model.safetensors"):
        verify_copy(art, {"model.safetensors": outside.stat().st_size}, "download")


# -- the device agent ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["../x.safetensors", "/etc/x.safetensors", "a/../../x", None, ""])
def test_a_full_model_plan_naming_a_file_outside_the_model_is_refused(tmp_path, name):
    plan = Plan("full", [Target("models/v1/config.json", 2, {"file": "config.json"}),
                         Target("models/v1/evil", 5, {"file": name})], 7, 1, "0" * 64)
    with pytest.raises(TargetRefused, match="models/v1/evil"):
        _check_names(plan)
    dev = Device(tmp_path / "device")
    dev.prepare()
    blob = tmp_path / "blob"
    blob.write_bytes(b"12345")
    with pytest.raises(TargetRefused, match="models/v1/evil"):  # the apply step refuses it too
        _apply(dev, plan, {t.path: blob for t in plan.steps}, None, "v1")
    assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "device" / "x.safetensors").exists()
    _check_names(Plan("full", [Target("models/v1/model.safetensors", 5, {"file": "sub/model.safetensors"})]))


@pytest.mark.parametrize("sha", ["../../x", "A" * 64, "0" * 63, "0" * 65, "", "g" * 64, "/" + "0" * 63])
def test_a_signed_hash_that_is_not_64_hex_digits_is_refused_before_any_download(tmp_path, sha):
    tf = TargetFile(5, {"sha256": sha}, "models/v1/model.safetensors")
    downloads = tmp_path / "downloads"
    # the server address is never contacted: the refusal comes first
    with pytest.raises(TargetRefused, match="not 64 hex digits"):
        download(urllib3.PoolManager(), "http://127.0.0.1:9/", tf, downloads)
    assert not downloads.exists() or not any(downloads.iterdir())
