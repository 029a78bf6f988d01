"""The daemon keeps what replay needs (issue 13, B14): every accepted expert is linked (or copied)
into the state folder and folded from there, so renaming or deleting the original after its fold
never breaks `unmerge` with replay; kept files go once no kept version holds the expert."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from mergestream import engine
from mergestream.daemon.sources import ExpertReady
from mergestream.daemon.store import KeptExperts
from mergestream.io.checkpoints import read_state_dict
from mergestream.io.state import StateDir

from .conftest import perturb, random_model, run_cli, save_tensors
from .test_operator import _config, _ok, _service, _status

REPLAY = {"name": "task_arithmetic", "params": {"lambda": 0.5}, "unmerge_mode": "replay"}


def _file_expert(base: dict, inbox: Path, name: str, seed: int) -> Path:
    return save_tensors(inbox / f"{name}.safetensors", perturb(base, 0.01, seed))


def _folder_expert(base: dict, inbox: Path, name: str, seed: int) -> Path:
    """A Hugging Face style folder: weights in two shards with an index, a config, a subfolder."""
    d = inbox / name
    t = perturb(base, 0.01, seed)
    names = sorted(t)
    half = {k: t[k] for k in names[: len(names) // 2]}
    rest = {k: t[k] for k in names[len(names) // 2:]}
    save_tensors(d / "model-00001-of-00002.safetensors", half)
    save_tensors(d / "model-00002-of-00002.safetensors", rest)
    weight_map = {**{k: "model-00001-of-00002.safetensors" for k in half},
                  **{k: "model-00002-of-00002.safetensors" for k in rest}}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (d / "config.json").write_text("{}")
    (d / "notes").mkdir()
    (d / "notes" / "card.md").write_text(name)
    return d


def _gone(path: Path, how: str) -> None:
    """The original disappears after its fold: deleted, or renamed inside the inbox."""
    if how == "deleted" and path.is_dir():
        shutil.rmtree(path)
    elif how == "deleted":
        path.unlink()
    else:
        path.rename(path.with_name("renamed-" + path.name))


def _files(p: Path) -> list[Path]:
    return sorted(f.relative_to(p) for f in p.rglob("*") if f.is_file()) if p.is_dir() else [Path(p.name)]


def _inode(p: Path) -> int:
    return os.stat(p).st_ino


@pytest.mark.parametrize("how", ["deleted", "renamed"])
@pytest.mark.parametrize("kind", ["file", "folder"])
def test_replay_unmerge_after_the_original_is_gone_gives_the_other_expert_alone(tmp_path, kind, how):
    """fold e1, e2 from the inbox; e2's original is deleted or renamed; `unmerge e1` (replay) gives
    a version holding only e2, byte-equal to folding e2 alone. The kept copies are hard links of
    the originals' files (same filesystem), and the state manifest names them."""
    base = random_model(0)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    make = _file_expert if kind == "file" else _folder_expert
    inbox = tmp_path / "inbox"
    originals = [make(base, inbox, f"e{i}", seed=i + 1) for i in (1, 2)]
    ref = tmp_path / "ref" / originals[1].name  # e2 as it arrived, outside the state and the inbox
    if kind == "folder":
        shutil.copytree(originals[1], ref)
    else:
        ref.parent.mkdir()
        shutil.copy(originals[1], ref)
    svc = _service(tmp_path, bpath, policy=REPLAY)
    try:
        for i, e in zip((1, 2), originals):
            svc.on_expert_ready(ExpertReady(source="folder", uri=str(e), expert_id=f"e{i}"))
            assert svc.step()
        assert _status(svc) == {"e1": "accepted", "e2": "accepted"}
        kept = [svc.store.kept.dir(f"e{i}") / e.name for i, e in zip((1, 2), originals)]
        man = StateDir(svc.store.current_path() / "state").manifest
        assert [Path(f.expert) for f in man.folds] == [k.resolve() for k in kept]
        for orig, k in zip(originals, kept):
            assert _files(k) == _files(orig)
            for rel in _files(orig):  # hard links: no bytes copied
                src = orig / rel if orig.is_dir() else orig
                assert _inode(k / rel if k.is_dir() else k) == _inode(src)
        _gone(originals[1], how)
        assert "e1 unmerged" in _ok(svc, "unmerge", "e1")
        cur = svc.store.current()
        assert svc.store.fold_json(cur)["experts"] == ["e2"] and _status(svc)["e1"] == "unmerged"
        got = read_state_dict(svc.store.current_path() / "model")
    finally:
        svc.shutdown()
    engine.fold(bpath, None, ref, "task_arithmetic", {"lambda": 0.5}, state_dir=tmp_path / "alone",
                out=tmp_path / "alone-model", expert_id="e2")
    want = read_state_dict(tmp_path / "alone-model")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_the_cli_unmerge_and_a_retry_work_without_the_originals(tmp_path):
    """`mergestream unmerge` (no daemon running: the command runs directly) replays from the kept
    copies after both originals were deleted; an unmerged expert retried later folds from its
    kept copy too (a kept version still holds it)."""
    base = random_model(0)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    inbox = tmp_path / "inbox"
    originals = [_folder_expert(base, inbox, "e1", 1), _file_expert(base, inbox, "e2", 2)]
    svc = _service(tmp_path, bpath, policy=REPLAY)
    try:
        for i, e in zip((1, 2), originals):
            svc.on_expert_ready(ExpertReady(source="folder", uri=str(e), expert_id=f"e{i}"))
            assert svc.step()
    finally:
        svc.shutdown()
    for e in originals:
        _gone(e, "deleted")
    cfg = _config(tmp_path, base=str(bpath), policy=REPLAY, metrics={"enabled": False}, gate={"rules": []})
    out = run_cli("unmerge", "e1", "--config", str(cfg))
    assert "e1 unmerged" in out.stdout + out.stderr
    svc = _service(tmp_path, bpath, policy=REPLAY)
    try:
        assert svc.store.fold_json(svc.store.current())["experts"] == ["e2"]
        _ok(svc, "retry", "e1")
        assert svc.step() and _status(svc) == {"e1": "accepted", "e2": "accepted"}
        assert svc.store.fold_json(svc.store.current())["experts"] == ["e2", "e1"]
    finally:
        svc.shutdown()


def test_kept_copies_go_when_no_kept_version_holds_the_expert(tmp_path):
    """A rejected expert's copy is removed at once; an unmerged one's once retention dropped every
    version that held it; an accepted one's stays."""
    base = random_model(0)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    inbox = tmp_path / "inbox"
    good = [_file_expert(base, inbox, f"e{i}", i) for i in (1, 2)]
    bad = save_tensors(inbox / "bad.safetensors", {**perturb(base, 0.01, 9), "layer.0.attn.bias": torch.zeros(3)})
    svc = _service(tmp_path, bpath, policy=REPLAY, retention=1)
    try:
        for e in good + [bad]:
            svc.on_expert_ready(ExpertReady(source="folder", uri=str(e), expert_id=e.stem))
            assert svc.step()
        assert _status(svc) == {"e1": "accepted", "e2": "accepted", "bad": "rejected"}
        kept = svc.store.kept
        assert kept.dir("e1").is_dir() and kept.dir("e2").is_dir() and not kept.dir("bad").exists()
        _ok(svc, "unmerge", "e1")
        assert svc.store.numbers() == [svc.store.current()]  # retention 1: only the version without e1
        assert not kept.dir("e1").exists() and kept.dir("e2").is_dir()
        assert not [p for p in (tmp_path / "state" / "experts").iterdir() if p.name.startswith(".")]
    finally:
        svc.shutdown()


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_an_expert_on_another_filesystem_is_copied(tmp_path, monkeypatch, kind):
    """Where a hard link cannot be made (another filesystem: EXDEV) the files are copied, with the
    same names and bytes; a second keep of the same id reuses the copy, even with the original gone."""
    base = random_model(0)
    src = (_file_expert if kind == "file" else _folder_expert)(base, tmp_path / "inbox", "e1", 1)

    def no_link(*_a, **_k):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_link)
    kept = KeptExperts(tmp_path / "state")
    path = kept.keep(src, "e1")
    assert path == tmp_path / "state" / "experts" / "e1" / src.name and _files(path) == _files(src)
    for rel in _files(src):
        a, b = (src / rel, path / rel) if src.is_dir() else (src, path)
        assert a.read_bytes() == b.read_bytes() and _inode(a) != _inode(b)
    _gone(src, "deleted")
    assert kept.keep(src, "e1") == path
    assert kept.prune({"e1"}) == [] and kept.prune(set()) == ["e1"] and not kept.dir("e1").exists()
    with pytest.raises(FileNotFoundError):
        kept.keep(src, "e1")
    assert not list((tmp_path / "state" / "experts").iterdir())  # nothing half-made left behind
