"""A/B model slots on the device: two folders, ``current``/``previous`` pointers, status, lock.

Layout: see :mod:`mergestream.agent`. Invariants, kept through a power loss at any point:

* ``current`` is switched with ``rename(2)`` of a fresh symlink (then the folder is fsynced), so it
  always names one complete slot or, before the first install, nothing;
* a slot's ``<slot>.json`` (version, weights hash) is written only after the slot folder is
  complete and its weights hash verified, and removed before the folder is touched again;
* the slot being rebuilt is never the one ``current`` names.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from ..io.st import fsync_dir, load_json
from .errors import LocalStateError

SLOTS = ("a", "b")


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` to ``path`` atomically (temporary sibling, fsync, rename, fsync of the folder)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w") as fh:
        json.dump(doc, fh, indent=2, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_json(path: Path) -> dict[str, Any] | None:
    """``path`` parsed, or None when absent or unreadable."""
    try:
        return load_json(path.read_bytes(), str(path), error=ValueError)
    except (OSError, ValueError):
        return None


class Device:
    """The agent's view of one model folder (``--model-dir``).

    Raises:
        LocalStateError: from :meth:`lock` when another agent holds the folder.
    """

    def __init__(self, model_dir: str | os.PathLike, status_file: str | os.PathLike | None = None):
        self.root = Path(model_dir)
        self.agent = self.root / ".agent"
        self.slots = self.root / "slots"
        self.status_file = Path(status_file) if status_file else self.root / "status.json"
        self.metadata = self.agent / "metadata"
        self.downloads = self.agent / "downloads"
        self.work = self.agent / "work"
        self.trusted_root = self.agent / "trusted-root.json"
        self.held_file = self.agent / "held-back.json"
        self._lock_fd: int | None = None

    def prepare(self) -> None:
        """Create the folders the agent writes to."""
        for d in (self.agent, self.slots, self.metadata, self.downloads, self.work):
            d.mkdir(parents=True, exist_ok=True)

    def lock(self) -> None:
        """Take the folder's exclusive lock (``flock``; released when the process dies)."""
        self.prepare()
        fd = os.open(self.agent / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LocalStateError(f"another mergestream-agent is working on {self.root}") from None
        self._lock_fd = fd

    def unlock(self) -> None:
        """Release the lock."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- pointers and slots -------------------------------------------------------------------------
    def pointer(self, name: str) -> str | None:
        """The slot ``current``/``previous`` names, or None."""
        link = self.root / name
        if not link.is_symlink():
            return None
        slot = Path(os.readlink(link)).name
        return slot if slot in SLOTS and (self.slots / slot).is_dir() else None

    def slot_dir(self, slot: str) -> Path:
        """The folder of ``slot``."""
        return self.slots / slot

    def slot_info(self, slot: str | None) -> dict[str, Any] | None:
        """What ``slot`` holds (``version``, ``weights_sha256``, ``installed_at``), None when unknown."""
        if slot is None:
            return None
        info = read_json(self.slots / f"{slot}.json")
        return info if info and isinstance(info.get("weights_sha256"), str) else None

    def other(self, slot: str | None) -> str:
        """The slot that is not ``slot`` (``a`` before the first install)."""
        return "b" if slot == "a" else "a"

    def clear_slot(self, slot: str) -> None:
        """Empty ``slot`` for a rebuild (its info first, then the folder; ``previous`` unlinked if it
        names it). Refuses the slot ``current`` names."""
        if self.pointer("current") == slot:
            raise LocalStateError(f"refusing to rebuild slot {slot}: it is the current one")
        if self.pointer("previous") == slot:
            (self.root / "previous").unlink()
        (self.slots / f"{slot}.json").unlink(missing_ok=True)
        fsync_dir(self.slots)
        shutil.rmtree(self.slots / slot, ignore_errors=True)
        for stale in self.slots.glob(f".{slot}.staging-*"):  # apply_patch's staging after a power loss
            shutil.rmtree(stale, ignore_errors=True)

    def mark_slot(self, slot: str, version: int, sha: str) -> None:
        """Record that ``slot`` holds a complete, verified model of ``version`` / ``sha``."""
        write_json(self.slots / f"{slot}.json", {"version": version, "weights_sha256": sha,
                                                 "installed_at": time.time()})

    def set_pointer(self, name: str, slot: str) -> None:
        """Point ``name`` (``current``/``previous``) at ``slot`` atomically (symlink + rename + fsync)."""
        tmp = self.root / f".{name}-{uuid.uuid4().hex[:8]}"
        os.symlink(os.path.join("slots", slot), tmp)
        os.replace(tmp, self.root / name)
        fsync_dir(self.root)

    # -- held-back versions and status ----------------------------------------------------------------
    def held_back(self) -> list[str]:
        """Weights hashes rolled back locally: ``pull`` does not reinstall them."""
        doc = read_json(self.held_file) or {}
        return [h for h in doc.get("weights_sha256", []) if isinstance(h, str)]

    def hold_back(self, sha: str) -> None:
        """Add ``sha`` to the held-back list."""
        held = self.held_back()
        if sha not in held:
            write_json(self.held_file, {"weights_sha256": held + [sha]})

    def status(self, **fields: Any) -> dict[str, Any]:
        """Write the status file: the given fields plus what ``current``/``previous`` hold."""
        cur, prev = self.pointer("current"), self.pointer("previous")
        doc = {"time": time.time(), "model_dir": str(self.root),
               "current": dict(self.slot_info(cur) or {}, slot=cur) if cur else None,
               "previous": dict(self.slot_info(prev) or {}, slot=prev) if prev else None, **fields}
        self.status_file.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.status_file, doc)
        return doc
