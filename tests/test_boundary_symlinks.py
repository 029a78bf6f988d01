"""Symlinks in the inbox (issue #36, T3-09): a link that leaves the inbox is refused with its reason
and shown in ``status``; one that stays inside works, also for the kept copy and a replay.

A real daemon (``mergestream run`` subprocess, real inotify, real ledger, metrics over HTTP) on an
inbox holding every kind of link: a file link out, a folder expert with a link out inside, a folder
link out, relative links that stay inside (a file, and inside a folder expert), and a plain
expert. Then :meth:`~mergestream.daemon.store.KeptExperts.keep` on its own."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from mergestream.daemon.store import KeptExperts, Store
from mergestream.errors import OutsideRootError

from .conftest import run_cli, save_tensors
from .test_daemon import Daemon, scaled_expert, tiny_base

ERRORS = 'mergestream_source_errors_total{source="folder"}'
REFUSED = {"a_file.safetensors": "a_file.safetensors", "b_folder": "b_folder/model.safetensors",
           "c_dirlink": "c_dirlink"}  # entry -> the link its note names


def _notes(d: Daemon) -> dict[str, dict]:
    return {n["subject"]: n for n in d.status()["sources"].get("folder", [])}


def _experts(d: Daemon) -> dict[str, str]:
    return {e["id"]: e["status"] for e in d.status()["experts"]}


@pytest.fixture
def world(tmp_path):
    """A daemon (replay unmerge) and, outside its inbox, private experts; nothing dropped yet."""
    base = tiny_base()
    private = tmp_path / "private"
    for i in (1, 2, 3):
        save_tensors(private / f"secret{i}.safetensors", scaled_expert(base, 10 + i))
    save_tensors(private / "expdir" / "model.safetensors", scaled_expert(base, 14))
    d = Daemon(tmp_path, extra={"policy": {"name": "task_arithmetic", "params": {"lambda": 0.3},
                                           "unmerge_mode": "replay"}})
    yield d, base, private
    d.stop()


def test_links_out_of_the_inbox_are_refused_links_inside_fold_and_replay(world, tmp_path):
    d, base, private = world
    inbox = tmp_path / "inbox"
    d.start()
    # (d) the targets of the links that stay inside: a hidden folder of the inbox (not an expert itself)
    blob1 = save_tensors(inbox / ".blobs" / "d1.safetensors", scaled_expert(base, 1))
    blob2 = save_tensors(inbox / ".blobs" / "d2.safetensors", scaled_expert(base, 2))
    # (a) a file link out (relative), (b) a folder expert holding a link out (absolute), (c) a folder link out
    os.symlink(os.path.join("..", "private", "secret1.safetensors"), inbox / "a_file.safetensors")
    (inbox / "b_folder").mkdir()
    os.symlink(private / "secret2.safetensors", inbox / "b_folder" / "model.safetensors")
    (inbox / "b_folder" / "READY").touch()
    os.symlink(private / "expdir", inbox / "c_dirlink")
    # (d) relative links inside: a file expert, and inside a folder expert
    os.symlink(os.path.join(".blobs", "d1.safetensors"), inbox / "d_file.safetensors")
    (inbox / "d_folder").mkdir()
    os.symlink(os.path.join("..", ".blobs", "d2.safetensors"), inbox / "d_folder" / "model.safetensors")
    (inbox / "d_folder" / "READY").touch()
    # (e) a plain expert
    save_tensors(inbox / "e_good.safetensors", scaled_expert(base, 3))

    d.wait(lambda: sorted(k for k, v in _experts(d).items() if v == "accepted") == ["d_file", "d_folder", "e_good"],
           90, "the experts with links inside and the good one did not all fold")
    d.wait(lambda: all(f"inbox:{n}" in _notes(d) for n in REFUSED), 30, "not every refused entry has a note")
    notes = _notes(d)
    for entry, link in REFUSED.items():
        n = notes[f"inbox:{entry}"]
        assert n["level"] == "error" and "refused" in n["message"] and link in n["message"], n
    assert d.metric(ERRORS) == 3.0
    time.sleep(3)  # many checker passes later: still one error per entry, nothing else taken
    assert d.metric(ERRORS) == 3.0
    assert set(_experts(d)) == {"d_file", "d_folder", "e_good"}
    kept_root = d.root / "state" / "experts"
    assert sorted(p.name for p in kept_root.iterdir() if not p.name.startswith(".")) == ["d_file", "d_folder", "e_good"]

    # the kept copies are real files with the bytes the links pointed at (not links, never dangling)
    for kept, blob in ((kept_root / "d_file" / "d_file.safetensors", blob1),
                       (kept_root / "d_folder" / "d_folder" / "model.safetensors", blob2)):
        assert kept.is_file() and not kept.is_symlink(), kept
        assert kept.read_bytes() == blob.read_bytes()
    private_inodes = {os.stat(p).st_ino for p in private.rglob("*") if p.is_file()}
    assert not any(os.stat(p).st_ino in private_inodes for p in (d.root / "state").rglob("*") if p.is_file())

    # a replay from the kept copies, with the link targets gone from the inbox
    shutil.rmtree(inbox / ".blobs")
    out = run_cli("unmerge", "e_good", "--config", d.config)
    assert "e_good unmerged" in out.stdout + out.stderr, out
    store = Store(d.root / "state")
    assert sorted(store.fold_json(store.current())["experts"]) == ["d_file", "d_folder"]
    assert _experts(d)["e_good"] == "unmerged"

    # fixing an entry clears its note: the links out removed, b_folder's replaced by a real file
    (inbox / "a_file.safetensors").unlink()
    (inbox / "c_dirlink").unlink()
    (inbox / "b_folder" / "model.safetensors").unlink()
    shutil.copyfile(private / "secret2.safetensors", inbox / "b_folder" / "model.safetensors")
    d.wait(lambda: not any(f"inbox:{n}" in _notes(d) for n in REFUSED), 60, "the notes of the fixed entries stay")
    d.wait(lambda: _experts(d).get("b_folder") == "accepted", 60, "b_folder, fixed, did not fold")
    assert d.metric(ERRORS) == 3.0


def test_a_link_that_leaves_the_inbox_after_it_arrived_is_refused_at_keep(tmp_path):
    """:meth:`KeptExperts.keep` with ``root`` (the daemon passes the inbox): a file link, a link
    inside a folder and a folder link out are refused with OutsideRootError and nothing is left in
    ``state/experts``; a relative link inside is kept as a real file."""
    inbox, private = tmp_path / "inbox", tmp_path / "private"
    base = tiny_base()
    secret = save_tensors(private / "secret.safetensors", scaled_expert(base, 1))
    save_tensors(private / "dir" / "model.safetensors", scaled_expert(base, 2))
    inbox.mkdir()
    os.symlink(secret, inbox / "a.safetensors")
    (inbox / "b").mkdir()
    save_tensors(inbox / "b" / "config.safetensors", scaled_expert(base, 3))
    os.symlink("../../private/secret.safetensors", inbox / "b" / "model.safetensors")
    os.symlink(private / "dir", inbox / "c")
    kept = KeptExperts(tmp_path / "state")
    for name, link in (("a.safetensors", "a.safetensors"), ("b", "b/model.safetensors"), ("c", "c")):
        with pytest.raises(OutsideRootError, match=link):
            kept.keep(inbox / name, name.split(".")[0], root=inbox)
    assert not (tmp_path / "state" / "experts").exists() or not any((tmp_path / "state" / "experts").iterdir())
    # without root, a folder's own root is the folder: a link out of it is refused as well
    with pytest.raises(OutsideRootError):
        kept.keep(inbox / "b", "b")
    # a link that stays inside the inbox is resolved into a real file
    blob = save_tensors(inbox / ".blobs" / "x.safetensors", scaled_expert(base, 4))
    (inbox / "d").mkdir()
    os.symlink("../.blobs/x.safetensors", inbox / "d" / "model.safetensors")
    got = kept.keep(inbox / "d", "d", root=inbox)
    assert got == tmp_path / "state" / "experts" / "d" / "d"
    f = got / "model.safetensors"
    assert f.is_file() and not f.is_symlink() and f.read_bytes() == blob.read_bytes()
    assert os.stat(f).st_ino == os.stat(blob).st_ino  # a hard link of the target, no bytes copied
    assert sorted(p.name for p in (tmp_path / "state" / "experts").iterdir()) == ["d"]


def test_status_lists_a_refused_link_in_text_form(world, tmp_path):
    """The plain ``status`` (no --json) shows the refusal as an error line of the folder source."""
    d, base, private = world
    os.symlink(private / "secret1.safetensors", tmp_path / "inbox" / "x.safetensors")
    d.start()
    d.wait(lambda: "inbox:x.safetensors" in _notes(d), 30, "no note for the link out")
    out = run_cli("status", "--config", d.config).stdout
    [line] = [ln for ln in out.splitlines() if "x.safetensors" in ln]
    assert line.startswith("source folder error:") and "refused" in line
    assert "x" not in _experts(d)
