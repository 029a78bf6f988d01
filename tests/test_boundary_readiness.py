"""The classes of T3-08 and N6 in the folder source: an entry that can never complete (a declared
size beyond its disk, a copy stopped for good) is rejected with its reason and shown; a waiting one
is shown as waiting, with since when; a preallocated file (final size first, filled later) is never
folded half-written. Real folders, real files, the real FolderSource and readiness checks."""
from __future__ import annotations

import json
import os
import struct
import threading
import time
from pathlib import Path

from mergestream.daemon.sources import FolderSource
from mergestream.daemon.sources.base import SourceContext, source_notes
from mergestream.daemon.sources.readiness import cannot_complete, expert_complete, never_an_expert, unwritten_reason

from .test_sources import Collector, backdate, st_bytes, started  # noqa: F401 - started: a fixture

SETTLE = 0.3


class Notes:
    """A NoteStore (the ledger's meta table) in memory."""

    def __init__(self):
        self.d: dict = {}
        self.lock = threading.Lock()

    def get_meta(self, key):
        with self.lock:
            return self.d.get(key)

    def set_meta(self, key, value):
        with self.lock:
            if value is None:
                self.d.pop(key, None)
            else:
                self.d[key] = value

    def meta_items(self, prefix):
        with self.lock:
            return {k: v for k, v in self.d.items() if k.startswith(prefix)}


def source(inbox: Path, got, notes: Notes, **kw) -> FolderSource:
    ctx = SourceContext(cursors=notes, notes=notes)
    kw.setdefault("settle_seconds", SETTLE)
    return FolderSource(inbox, got, entry_note=lambda subject, message, level: ctx.note("folder", subject, message,
                                                                                        level=level), **kw)


def note(notes: Notes, name: str) -> dict | None:
    return next((n for n in source_notes(notes) if n["subject"] == f"inbox:{name}"), None)


def wait_until(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def huge_header_file(path: Path) -> Path:
    shape = [2 ** 40, 2 ** 20]
    hdr = json.dumps({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 4 * shape[0] * shape[1]]}})
    hdr += " " * (-len(hdr) % 8)
    path.write_bytes(struct.pack("<Q", len(hdr)) + hdr.encode() + b"\0" * 16)
    return path


# -- T3-08 ------------------------------------------------------------------------------------------------
def test_a_declared_size_beyond_the_disk_is_rejected_with_its_reason(tmp_path, started):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    huge = huge_header_file(inbox / "huge.safetensors")
    assert "free space" in never_an_expert(huge) and "free space" in cannot_complete(huge)
    folder = inbox / "sharded"
    folder.mkdir()
    huge_header_file(folder / "model.safetensors")
    assert "model.safetensors" in never_an_expert(folder)
    (inbox / "ok.safetensors").write_bytes(st_bytes(1)[:-8])  # merely short: may still arrive
    assert never_an_expert(inbox / "ok.safetensors") is None
    got, notes = Collector(), Notes()
    started(source(inbox, got, notes))
    got.wait_for(2, timeout=10)
    assert sorted(Path(u).name for u in got.uris) == ["huge.safetensors", "sharded"]
    assert note(notes, "huge.safetensors")["level"] == "error"
    assert "rejected" in note(notes, "huge.safetensors")["message"]
    waiting = note(notes, "ok.safetensors")
    assert waiting["level"] == "warning" and "waiting: incomplete" in waiting["message"]
    assert waiting["since"] <= time.time()


def test_an_incomplete_copy_stopped_for_good_is_rejected_after_the_timeout_and_only_once(tmp_path, started):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    full = st_bytes(2)
    (inbox / "stalled.safetensors").write_bytes(full[: len(full) // 2])
    (inbox / "folder").mkdir()  # a folder that never gets its weights
    (inbox / "folder" / "config.json").write_text("{}")
    got, notes = Collector(), Notes()
    started(source(inbox, got, notes, incomplete_timeout_seconds=1.5))
    assert wait_until(lambda: note(notes, "stalled.safetensors") is not None)
    first = note(notes, "stalled.safetensors")
    assert first["level"] == "warning" and "rejected if unchanged for 1.5 s" in first["message"]
    assert not got.events
    got.wait_for(2, timeout=10)
    assert sorted(Path(u).name for u in got.uris) == ["folder", "stalled.safetensors"]
    rejected = note(notes, "stalled.safetensors")
    assert rejected["level"] == "error" and "unchanged for 1.5 s" in rejected["message"]
    time.sleep(4 * SETTLE + 1.0)
    assert len(got.events) == 2  # unchanged: not emitted again
    with open(inbox / "stalled.safetensors", "ab") as fh:  # the copy resumes and completes
        fh.write(full[len(full) // 2:])
    got.wait_for(3, timeout=10)
    assert Path(got.uris[-1]).name == "stalled.safetensors" and note(notes, "stalled.safetensors") is None


def test_the_waiting_note_keeps_its_since_while_the_file_grows(tmp_path, started):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    full = st_bytes(3)
    path = inbox / "slow.safetensors"
    path.write_bytes(full[:200])
    got, notes = Collector(), Notes()
    started(source(inbox, got, notes))
    assert wait_until(lambda: note(notes, "slow.safetensors") is not None)
    since = note(notes, "slow.safetensors")["since"]
    with open(path, "ab") as fh:
        fh.write(full[200:400])
    time.sleep(4 * SETTLE)
    assert note(notes, "slow.safetensors")["since"] == since
    with open(path, "ab") as fh:
        fh.write(full[400:])
    got.wait_for(1, timeout=10)
    assert note(notes, "slow.safetensors") is None


# -- N6 ---------------------------------------------------------------------------------------------------
def preallocated(path: Path, data: bytes, written: int, sparse: bool = True) -> None:
    """What a preallocating downloader leaves: the final size at once, only ``written`` bytes filled
    (the rest a hole, or zeros written out when ``sparse`` is false)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if sparse:
            os.ftruncate(fd, len(data))
            os.pwrite(fd, data[:written], 0)
        else:
            os.pwrite(fd, data[:written] + b"\0" * (len(data) - written), 0)
    finally:
        os.close(fd)


def test_readiness_sees_holes_and_zero_tails(tmp_path):
    data = st_bytes(4)
    for sparse in (True, False):
        p = tmp_path / f"pre-{sparse}.safetensors"
        preallocated(p, data, len(data) // 2, sparse)
        assert expert_complete(p)  # size alone says complete ...
        assert unwritten_reason(p)  # ... the content does not
    (tmp_path / "whole.safetensors").write_bytes(data)
    assert unwritten_reason(tmp_path / "whole.safetensors") is None
    shard = tmp_path / "hf"
    shard.mkdir()
    preallocated(shard / "model.safetensors", data, len(data) // 2)
    assert "model.safetensors" in unwritten_reason(shard)


def test_a_preallocated_download_is_folded_once_complete_never_half_written(tmp_path, started):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    data = st_bytes(5)
    got, notes = Collector(), Notes()
    started(source(inbox, got, notes, unwritten_seconds=30))
    for sparse in (True, False):
        path = inbox / f"download-{sparse}.safetensors"
        preallocated(path, data, len(data) // 2, sparse)
    time.sleep(8 * SETTLE)  # the download stalls far past the settle time
    assert not got.events
    for sparse in (True, False):
        w = note(notes, f"download-{sparse}.safetensors")
        assert w["level"] == "warning" and "preallocated" in w["message"], w
        fd = os.open(inbox / f"download-{sparse}.safetensors", os.O_WRONLY)
        os.pwrite(fd, data[len(data) // 2:], len(data) // 2)
        os.close(fd)
    got.wait_for(2, timeout=10)
    time.sleep(4 * SETTLE)
    assert len(got.events) == 2
    for ev in got.events:
        assert Path(ev.uri).read_bytes() == data


def test_zero_tensors_at_the_end_are_ready_and_a_zero_run_inside_a_tensor_waits_for_the_window(tmp_path, started):
    import torch
    from safetensors.torch import save

    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "zero-tensor.safetensors").write_bytes(save({"a.weight": torch.randn(8, 8), "z.bias": torch.zeros(2048)}))
    zeros = save({"a.weight": torch.randn(8, 8), "z.bias": torch.cat([torch.randn(100), torch.zeros(2048)])})
    (inbox / "legit.safetensors").write_bytes(zeros)
    (inbox / "marked.safetensors").write_bytes(zeros)
    (inbox / "marked.safetensors.READY").touch()
    (inbox / "old.safetensors").write_bytes(zeros)
    backdate(inbox / "old.safetensors")
    got, notes = Collector(), Notes()
    t0 = time.monotonic()
    started(source(inbox, got, notes, unwritten_seconds=2.0))
    got.wait_for(3, timeout=10)
    assert sorted(Path(u).name for u in got.uris[:3]) == ["marked.safetensors", "old.safetensors",
                                                          "zero-tensor.safetensors"]
    got.wait_for(4, timeout=10)
    assert Path(got.uris[3]).name == "legit.safetensors" and got.times[3] - t0 >= 1.0
