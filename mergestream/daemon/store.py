"""The version store: immutable ``versions/NNNNNN/``, an atomic ``current`` pointer, staging, retention.

The versions and ``current`` follow the layout of :mod:`mergestream.io.versions` (read there by the
feed builder and the CLI without the daemon). Besides them, under the state folder::

    staging/<name>/               candidates being built; removed at start-up (stale after a crash)
    experts/<id>/<name>           every accepted expert as it arrived (:class:`KeptExperts`)
    ri/<id>/                      an accepted expert's RI-adapted copy (:mod:`.prestep`)
    daemon.lock                   one daemon per state folder (filelock, exclusive)

Policy state is carried from version to version as hard links (state files are immutable once
written; the manifest is replaced, never edited), so a fold copies no tensor data.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Protocol

from filelock import FileLock, Timeout

from ..errors import MergestreamError, OutsideRootError, StateError
from ..io.paths import confined_files
from ..io.st import fsync_dir, link_or_copy, naming
from ..io.versions import Versions

log = logging.getLogger(__name__)


class LockedError(MergestreamError):
    """Another daemon holds this state folder."""


class Publisher(Protocol):
    """Told after each local switch of ``current`` (publish, rollback), e.g. the object-storage
    mirror (:class:`mergestream.daemon.mirror.Mirror`) or the signed feed
    (:class:`mergestream.daemon.feed_publish.FeedPublisher`)."""

    def point(self, number: int, folder: Path) -> None:
        """``current`` is now version ``number`` (its folder ``versions/NNNNNN``). Must never raise:
        the local commit is done, and a publisher's failure never touches the store."""


class Store(Versions):
    """Versions, ``current`` and staging inside ``state_dir``; the read side is :class:`Versions`.

    Args:
        state_dir: the daemon's state folder.
        publishers: told in order after every switch of ``current`` (see :class:`Publisher`);
            more can be appended to :attr:`publishers` before the daemon starts.
    """

    def __init__(self, state_dir: str | os.PathLike, publishers: list[Publisher] | None = None):
        super().__init__(state_dir)
        self.staging_dir = self.root / "staging"
        self.kept = KeptExperts(self.root)
        self._lock: FileLock | None = None
        self.publishers: list[Publisher] = list(publishers or [])

    # -- locking ----------------------------------------------------------------------------------
    def lock(self) -> None:
        """Take the exclusive daemon lock.

        Raises:
            LockedError: another process holds it (message names the lock file and its holder).
        """
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / "daemon.lock"
        lock = FileLock(str(path), timeout=0)
        try:
            lock.acquire()
        except Timeout:
            holder = (self.root / "daemon.pid").read_text().strip() if (self.root / "daemon.pid").exists() else "?"
            raise LockedError(f"another mergestream daemon (pid {holder}) holds {path}; "
                              "only one daemon may run per state folder") from None
        (self.root / "daemon.pid").write_text(str(os.getpid()))
        self._lock = lock

    def unlock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def is_locked(self) -> bool:
        """True when some process (maybe this one) holds the daemon lock."""
        if self._lock is not None:
            return True
        probe = FileLock(str(self.root / "daemon.lock"), timeout=0)
        try:
            probe.acquire()
        except Timeout:
            return True
        probe.release()
        return False

    # -- versions -----------------------------------------------------------------------------------
    def next_number(self) -> int:
        """The number the next published version will get."""
        return (self.numbers() or [0])[-1] + 1

    def new_staging(self) -> Path:
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        p = self.staging_dir / uuid.uuid4().hex[:12]
        p.mkdir()
        return p

    def clean_staging(self) -> int:
        """Remove stale staging folders (after a crash); returns how many."""
        if not self.staging_dir.exists():
            return 0
        n = 0
        for p in self.staging_dir.iterdir():
            shutil.rmtree(p, ignore_errors=True)
            n += 1
        return n

    def carry_state(self, dest: Path) -> None:
        """Hard-link the current version's policy state into ``dest`` (an empty folder if none)."""
        cur = self.current_path()
        dest.mkdir(parents=True, exist_ok=True)
        if cur is None or not (cur / "state").exists():
            return
        for src in (cur / "state").rglob("*"):
            target = dest / src.relative_to(cur / "state")
            if src.is_dir():
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(src, target)

    def publish(self, staging: Path, fold: dict[str, Any]) -> int:
        """Move a complete candidate into ``versions/`` (next number) and point ``current`` at it.

        Returns:
            The new version number.

        Raises:
            OSError: the disk is full, the state folder read-only or gone: nothing is published
                (the candidate is back in ``staging``, or gone with it), ``current`` is unchanged.
        """
        from ..io.state import StateDir  # torch: not loaded by the ledger verbs, which publish nothing

        number = self.next_number()
        fold = dict(fold, version=number)
        # the published state names its own version's model, not the staging folder it was built in
        StateDir(staging / "state").set_backbone(self.path(number) / "model")
        with naming(staging / "fold.json"), open(staging / "fold.json", "w") as fh:
            json.dump(fold, fh, indent=2, default=str)
            fh.flush()
            os.fsync(fh.fileno())
        fsync_dir(staging)
        self.versions_dir.mkdir(parents=True, exist_ok=True)
        os.rename(staging, self.path(number))
        try:
            fsync_dir(self.versions_dir)
            self.point_current(number)
        except OSError:  # not published after all: no version that was never current is left
            try:
                os.rename(self.path(number), staging)
            except OSError:
                shutil.rmtree(self.path(number), ignore_errors=True)
            raise
        return number

    def point_current(self, number: int) -> None:
        """Switch ``current`` atomically to version ``number`` (symlink + rename + fsync)."""
        if not self.path(number).exists():
            raise MergestreamError(f"version {number} does not exist in {self.versions_dir}")
        tmp = self.root / f".current-{uuid.uuid4().hex[:8]}"
        os.symlink(os.path.join("versions", f"{number:06d}"), tmp)
        try:
            os.replace(tmp, self.current_link)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.root)
        for publisher in self.publishers:  # after the local commit: a publisher never touches the store
            publisher.point(number, self.path(number))

    def retain(self, keep: int, protect: set[int] | None = None) -> list[int]:
        """Delete all but the newest ``keep`` versions; ``current`` and ``protect`` are never deleted."""
        nums = self.numbers()
        cur = self.current()
        protect = set(protect or ()) | ({cur} if cur is not None else set())
        doomed = [n for n in nums[:-keep] if n not in protect] if keep > 0 else []
        for n in doomed:
            shutil.rmtree(self.path(n), ignore_errors=True)
        return doomed

    def experts_in_versions(self) -> set[str] | None:
        """The ids of the experts some kept version holds (its state manifest's fold records, what
        its replay refolds); None when a manifest cannot be read (then nothing may be pruned)."""
        from ..io.state import StateDir

        ids: set[str] = set()
        for n in self.numbers():
            try:
                ids.update(StateDir(self.path(n) / "state").manifest.ids())
            except StateError as exc:
                log.warning("version %d: %s; kept experts are not pruned", n, exc)
                return None
        return ids

    def prune_kept(self) -> list[str]:
        """Remove the kept files of experts no kept version holds (see :class:`KeptExperts`);
        returns their ids."""
        wanted = self.experts_in_versions()
        return [] if wanted is None else self.kept.prune(wanted)


class KeptExperts:
    """What replay needs of each accepted expert, kept inside the state folder: a rename or a
    deletion where the expert arrived (the inbox, a registry cache) never breaks an unmerge.

    ``experts/<id>/<name>`` holds the expert as it arrived, under its own name: a hard link of the
    file, or of each file of a folder expert (subfolders kept), when it is on the state folder's
    filesystem, else a copy. ``ri/<id>/`` holds the RI pre-step's adapted copy (written by
    :mod:`.prestep`). The daemon folds from the kept path, so what is kept is what was folded (its
    content hash is checked on the fold's own pass) and the state manifest records that path.
    Files stay while some kept version holds the expert (:meth:`Store.prune_kept`).

    A hard link shares its bytes with the original: editing the original in place (rather than
    replacing it) changes the kept copy too; replay's content-hash check then refuses it.
    """

    KINDS = ("experts", "ri")

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def dir(self, expert_id: str, kind: str = "experts") -> Path:
        """``<state>/<kind>/<expert_id>``: where an expert's kept files live."""
        return self.root / kind / expert_id

    def path(self, expert_id: str) -> Path | None:
        """The kept copy of an expert (``experts/<id>/<name>``), or None when none is kept."""
        home = self.dir(expert_id)
        kept = [p for p in home.iterdir() if not p.name.startswith(".")] if home.is_dir() else []
        return kept[0] if len(kept) == 1 else None

    def keep(self, src: str | os.PathLike, expert_id: str, root: str | os.PathLike | None = None) -> Path:
        """Link or copy the expert at ``src`` (a file or a folder) into ``experts/<id>/``, or reuse
        the copy already kept for this id (an id names one content: a retried expert whose
        original is gone still folds). The copy appears complete or not at all (built in a hidden
        folder, fsynced, renamed). Symlinks are resolved (a relative link inside ``root`` stays
        valid in the copy) and must stay inside ``root`` (:func:`mergestream.io.paths.confined_files`).

        Args:
            root: where the expert arrived (the inbox); None: ``src`` itself (its folder for a file).

        Returns:
            The kept path: ``experts/<id>/<src's name>``.

        Raises:
            FileNotFoundError: ``src`` is gone and nothing is kept for this id.
            OutsideRootError: a file of ``src`` resolves outside ``root`` through a symlink (nothing kept).
            OSError: the copy failed (nothing is left behind).
        """
        src, home = Path(src), self.dir(expert_id)
        if home.is_dir():
            if (kept := self.path(expert_id)) is not None:
                return kept
            shutil.rmtree(home)  # not ours (never renamed into place half-done): start again
        if not src.exists():
            raise FileNotFoundError(errno.ENOENT, "expert is gone", str(src))
        home.parent.mkdir(parents=True, exist_ok=True)
        tmp = home.parent / f".{expert_id}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            _link_tree(src, tmp / src.name, Path(root) if root is not None else src if src.is_dir() else src.parent)
            os.rename(tmp, home)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_dir(home.parent)
        return home / src.name

    def prune(self, wanted: set[str]) -> list[str]:
        """Remove every kept expert whose id is not in ``wanted`` (and leftovers of interrupted
        copies); returns the ids removed."""
        gone = []
        for kind in self.KINDS:
            folder = self.root / kind
            if not folder.is_dir():
                continue
            for p in folder.iterdir():
                if p.name in wanted:
                    continue
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
                if not p.name.startswith("."):
                    gone.append(p.name)
        if gone:
            log.info("kept experts removed (no kept version holds them): %s", sorted(set(gone)))
        return sorted(set(gone))


def _link_tree(src: Path, dest: Path, root: Path) -> None:
    """Hard-link ``src`` (a file, or every file under a folder, symlinks followed and resolved, each
    inside ``root``) to ``dest``; a file that cannot be linked (another filesystem, links not
    supported) is copied and fsynced. The folders created are fsynced.

    Raises:
        OutsideRootError: a symlink under ``src`` leaves ``root`` (before anything is linked).
    """
    found = confined_files(src, root, f"expert {src.name}", error=OutsideRootError)
    if src.is_dir():
        files = [(real, dest / rel) for rel, real in found]
        dest.mkdir(parents=True)
    else:
        files = [(found[0][1], dest)]
    folders = {dest.parent, dest} if src.is_dir() else {dest.parent}
    for a, b in files:
        b.parent.mkdir(parents=True, exist_ok=True)
        folders.add(b.parent)
        link_or_copy(a, b)
    for d in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(d)


def arrival_root(source: str, uri: str, inbox: Path | None) -> Path | None:
    """Where the links of an expert may resolve to: the inbox for an entry of the folder source
    that sits in it (its links may point elsewhere in the inbox, never out of it), else None (the
    expert's own folder)."""
    if source != "folder" or inbox is None:
        return None
    try:
        Path(os.path.abspath(uri)).relative_to(os.path.abspath(inbox))
    except ValueError:
        return None
    return Path(inbox)
