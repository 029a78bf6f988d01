"""The files of a folder expert are defined once (:func:`mergestream.daemon.sources.readiness.folder_member`)
and every step that looks at a folder agrees on them (issue #36, T3-15): the S3 source's listing,
folder tag, download and pre-fold check (``still_available``), the reference of ``s3.cache: false``,
the MLflow source's copy check, and the inbox's change signature.

A Hugging Face folder uploaded as it is (``.gitattributes``, ``README.md``, ``config.json``, tokenizer
files, even ``.cache/huggingface/...`` left by ``snapshot_download(local_dir=...)``) folds; a file of
the expert actually replaced, added or removed after it was taken is still detected. Against the
real S3 test server (:mod:`tests.s3_server`) and a real daemon."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mergestream.daemon.s3client import make_client
from mergestream.daemon.sources.mlflow_download import DownloadIncomplete, resolve_expert_path, verify_copy
from mergestream.daemon.sources.readiness import file_signature, folder_member
from mergestream.daemon.sources.s3 import S3Source, version_exists
from mergestream.io.s3_checkpoint import S3Ref

from .conftest import random_model, save_tensors
from .s3_server import TEST_CREDENTIALS, s3  # noqa: F401 - s3: a fixture
from .test_daemon import Daemon, scaled_expert, tiny_base

pytestmark = pytest.mark.usefixtures("aws_env")

#: what a Hugging Face folder holds besides its weights (hidden ones are not part of the expert).
HF_EXTRAS = {
    ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
    "README.md": b"---\nlicense: mit\n---\n# an expert\n",
    "config.json": b'{"model_type": "bert"}',
    "tokenizer.json": b'{"version": "1.0"}',
    "tokenizer_config.json": b"{}",
    "special_tokens_map.json": b"{}",
    "vocab.txt": b"[PAD]\n[UNK]\n",
    ".cache/huggingface/download/model.safetensors.metadata": b"abc\n123\n",
    ".cache/huggingface/.gitignore": b"*\n",
}
HIDDEN = {k for k in HF_EXTRAS if k.startswith(".")}


@pytest.fixture
def aws_env(monkeypatch):
    for k, v in TEST_CREDENTIALS.items():
        monkeypatch.setenv(k, v)


def upload_hf_folder(c, bucket: str, prefix: str, weights: bytes, marker: bool = True) -> None:
    for rel, body in {**HF_EXTRAS, "model.safetensors": weights}.items():
        c.put_object(Bucket=bucket, Key=f"{prefix}{rel}", Body=body)
    if marker:
        c.put_object(Bucket=bucket, Key=f"{prefix}READY", Body=b"")


def make_source(s3, bucket: str, tmp_path: Path, **kw) -> tuple[S3Source, list]:
    events: list = []
    src = S3Source(bucket, "experts/", lambda ev: (events.append(ev), src.on_enqueued(ev)),
                   client=lambda: make_client(s3.endpoint), cache_dir=tmp_path / "cache", **kw)
    return src, events


def test_folder_member_is_the_one_definition():
    for rel in ("model.safetensors", "config.json", "README.md", "sub/model-00001-of-00002.safetensors",
                "tokenizer.json", "mergestream_probe/head.pt"):
        assert folder_member(rel), rel
    for rel in (".gitattributes", ".cache/huggingface/download/x.metadata", "READY", "model.safetensors.part",
                "sub/.hidden", "notes~", "sub/", "", "a//b", ".tmp/model.safetensors"):
        assert not folder_member(rel), rel
    assert folder_member("sub/READY")  # only the folder's own marker is the marker


def test_hf_folder_with_hidden_files_is_taken_downloaded_and_still_available(s3, tmp_path):
    bucket, c = s3.new_bucket("hf"), s3.client()
    weights = save_tensors(tmp_path / "w.safetensors", random_model(1)).read_bytes()
    upload_hf_folder(c, bucket, "experts/e1/", weights)
    src, events = make_source(s3, bucket, tmp_path)
    [ev] = src.poll()
    folder = Path(ev.uri)
    got = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    assert got == (set(HF_EXTRAS) - HIDDEN) | {"model.safetensors"}
    assert src.still_available(ev.registry_key)                       # the pre-fold check agrees
    assert version_exists(lambda: make_client(s3.endpoint), ev.registry_key)
    assert src.poll() == []                                           # the same tag: taken once

    # hidden files changing, appearing or going are not a change of the expert
    c.put_object(Bucket=bucket, Key="experts/e1/.gitattributes", Body=b"changed\n")
    c.put_object(Bucket=bucket, Key="experts/e1/.cache/huggingface/new.lock", Body=b"")
    c.put_object(Bucket=bucket, Key="experts/e1/config.json.part", Body=b"half")
    assert src.still_available(ev.registry_key) and src.poll() == []


@pytest.mark.parametrize("change", ["replace_weights", "replace_config", "add_file", "remove_file", "remove_marker"])
def test_a_file_of_the_expert_changed_after_it_was_taken_is_detected(s3, tmp_path, change):
    bucket, c = s3.new_bucket("chg"), s3.client()
    weights = save_tensors(tmp_path / "w.safetensors", random_model(2)).read_bytes()
    upload_hf_folder(c, bucket, "experts/e1/", weights)
    src, _ = make_source(s3, bucket, tmp_path)
    [ev] = src.poll()
    key = "experts/e1/"
    if change == "replace_weights":
        c.put_object(Bucket=bucket, Key=key + "model.safetensors",
                     Body=save_tensors(tmp_path / "w2.safetensors", random_model(3)).read_bytes())
    elif change == "replace_config":
        c.put_object(Bucket=bucket, Key=key + "config.json", Body=b'{"model_type": "gpt2"}')
    elif change == "add_file":
        c.put_object(Bucket=bucket, Key=key + "generation_config.json", Body=b"{}")
    elif change == "remove_file":
        c.delete_object(Bucket=bucket, Key=key + "tokenizer.json")
    else:
        c.delete_object(Bucket=bucket, Key=key + "READY")
    assert not src.still_available(ev.registry_key)
    assert not version_exists(lambda: make_client(s3.endpoint), ev.registry_key)


def test_reference_of_cache_false_names_only_the_expert_files(s3, tmp_path):
    bucket, c = s3.new_bucket("ref"), s3.client()
    weights = save_tensors(tmp_path / "w.safetensors", random_model(4)).read_bytes()
    upload_hf_folder(c, bucket, "experts/e1/", weights)
    src, _ = make_source(s3, bucket, tmp_path, cache=False, refs_dir=tmp_path / "refs")
    [ev] = src.poll()
    ref = S3Ref.read(ev.uri)
    assert {k.removeprefix("experts/e1/") for k in ref.objects} == (set(HF_EXTRAS) - HIDDEN) | {"model.safetensors"}
    assert src.still_available(ev.registry_key)


def test_mlflow_copy_check_and_expert_path_use_the_same_files(tmp_path):
    art = tmp_path / "v1" / "expert"
    art.mkdir(parents=True)
    save_tensors(art / "model.safetensors", random_model(5))
    (art / "config.json").write_text("{}")
    listing = {"model.safetensors": (art / "model.safetensors").stat().st_size, "config.json": 2,
               ".gitattributes": 51, ".cache/huggingface/download/x.metadata": 9}
    verify_copy(art, listing, "download")                 # hidden files listed but not here: fine
    (art / "config.json").unlink()
    with pytest.raises(DownloadIncomplete, match="config.json is missing"):
        verify_copy(art, listing, "download")
    (art / "config.json").write_text("{}")
    (tmp_path / "v1" / ".gitattributes").write_text("x")  # beside the artifact: not a second entry
    assert resolve_expert_path(tmp_path / "v1") == art


def test_inbox_signature_ignores_hidden_files(tmp_path):
    folder = tmp_path / "e1"
    folder.mkdir()
    save_tensors(folder / "model.safetensors", random_model(6))
    before = file_signature(folder)
    (folder / ".gitattributes").write_text("x")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "lock").write_text("")
    (folder / "READY").write_text("")
    assert file_signature(folder) == before
    (folder / "config.json").write_text("{}")
    assert file_signature(folder) != before


@pytest.mark.slow
def test_daemon_folds_a_hugging_face_folder_uploaded_as_it_is(s3, tmp_path):
    bucket, c = s3.new_bucket("dmn"), s3.client()
    base = tiny_base()
    d = Daemon(tmp_path, extra={"s3": {"enabled": True, "bucket": bucket, "prefix": "experts/",
                                       "endpoint_url": s3.endpoint, "interval_seconds": 0.3}}, env=TEST_CREDENTIALS)
    try:
        d.start()
        weights = save_tensors(tmp_path / "up" / "model.safetensors", scaled_expert(base, 20)).read_bytes()
        upload_hf_folder(c, bucket, "experts/hf1/", weights)
        d.wait(lambda: d.status()["current_version"] == 1, 60, "the HF folder was not folded")
        [row] = [x for x in d.status()["experts"] if x["id"] == "hf1"]
        assert row["status"] == "accepted", json.dumps(row)
        assert "deleted or replaced" not in d.log.read_text()
    finally:
        d.stop()
