"""The ledger: the durable record (SQLite, WAL mode) of every expert, fold and version; the queue.

Tables:
    experts   one row per distinct expert (same content hash or same registry version = one row);
              status pending -> folding -> accepted | rejected | failed; accepted -> unmerged.
    folds     one row per attempt (fold, unmerge, rollback): policy, parameters, timings, probe
              values, decision and reason.
    versions  every published version: number, path, the expert ids it holds, fold row.
    sources   per-source cursors (last registry version per model).
    commands  operator requests (rollback, unmerge, retry) for a running daemon to execute.
    outbox    tracking calls (MLflow) that failed and are retried later.
    arrivals  what each arrival turned out to hold: its arrival key
              (:func:`~mergestream.io.expert_readers.arrival_key`) -> the content hash its fold read.
    meta      small key/value facts (e.g. the base's probe values).

An expert is queued under its arrival key (``sha256`` = ``arrival:<key>``, no byte read) unless
``arrivals`` already knows the content behind that key; the fold's own pass computes the content
hash and :meth:`Ledger.settle_identity` records it (or finds the content already there: a duplicate).

One connection guarded by a lock serves all threads of the daemon; other processes (``status``,
``history``) open their own connections: WAL lets them read while the daemon writes.
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .records import Attempt, ExpertRow, Outcome

STATUSES = ("pending", "folding", "accepted", "rejected", "failed", "unmerged")

SCHEMA = """
CREATE TABLE IF NOT EXISTS experts (
    row INTEGER PRIMARY KEY AUTOINCREMENT,
    expert_id TEXT NOT NULL UNIQUE,
    source TEXT NOT NULL,
    uri TEXT NOT NULL,
    sha256 TEXT NOT NULL UNIQUE,
    registry_key TEXT UNIQUE,
    metadata TEXT NOT NULL DEFAULT '{}',
    status TEXT NOT NULL DEFAULT 'pending',
    reason TEXT,
    version INTEGER,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS folds (
    row INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    expert_id TEXT,
    policy TEXT,
    params TEXT,
    started REAL NOT NULL,
    seconds REAL,
    timings TEXT,
    probes TEXT,
    decision TEXT,
    reason TEXT,
    version INTEGER
);
CREATE TABLE IF NOT EXISTS versions (
    number INTEGER PRIMARY KEY,
    path TEXT NOT NULL,
    experts TEXT NOT NULL,
    fold_row INTEGER,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS sources (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS commands (
    row INTEGER PRIMARY KEY AUTOINCREMENT,
    verb TEXT NOT NULL,
    arg TEXT,
    created REAL NOT NULL,
    done REAL,
    result TEXT
);
CREATE TABLE IF NOT EXISTS outbox (
    row INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    payload TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS arrivals (key TEXT PRIMARY KEY, sha256 TEXT NOT NULL);
"""


#: SQLite's result codes for a storage failure, as the operating-system error they stand for
_STORAGE_CODES = {13: errno.ENOSPC, 8: errno.EROFS, 10: errno.EIO, 14: errno.EACCES, 3: errno.EACCES}


@contextmanager
def storage_errors(path: Path) -> Iterator[None]:
    """Raise SQLite's storage failures (a full disk, a read-only or lost file, an I/O error) as the
    :class:`OSError` they stand for, named by the ledger's ``path``: the CLI and the daemon report
    them as every other operating-system error (one line: path and cause). A read-only database on
    a writable filesystem is ``EACCES``. Other SQLite errors pass unchanged."""
    try:
        yield
    except sqlite3.OperationalError as exc:
        code = _STORAGE_CODES.get((getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF)
        if code is None:
            raise
        if code == errno.EROFS and not _on_read_only_fs(path):
            code = errno.EACCES
        raise OSError(code, f"{os.strerror(code)} (SQLite: {exc})", str(path)) from exc


def _on_read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path.parent).f_flag & os.ST_RDONLY)
    except OSError:
        return False


class Ledger:
    """SQLite ledger at ``path`` (created with its schema if absent).

    Raises (every method):
        OSError: the disk is full, the file or its folder is read-only or gone (see
            :func:`storage_errors`).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        with storage_errors(self.path):
            self._db = sqlite3.connect(str(self.path), check_same_thread=False, timeout=30, isolation_level=None)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock, storage_errors(self.path):
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:  # SQLite may have rolled back already (a full disk)
                    self._db.execute("ROLLBACK")
                raise

    def _q(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock, storage_errors(self.path):
            return self._db.execute(sql, args).fetchall()

    # -- experts / queue ----------------------------------------------------------------------
    @staticmethod
    def _expert(r: sqlite3.Row) -> ExpertRow:
        d = dict(r)
        d["metadata"] = json.loads(d["metadata"] or "{}")
        return ExpertRow(**d)

    def enqueue(self, expert_id: str, source: str, uri: str, sha256: str, registry_key: str | None = None,
                metadata: dict[str, Any] | None = None) -> tuple[ExpertRow, bool]:
        """Record an expert as pending, idempotently.

        The same content hash or the same registry key is one row however often it arrives; an id
        already used by other content gets a numeric suffix (``name-2``).

        Returns:
            (the row, True if it was new).
        """
        now = time.time()
        with self._tx() as db:
            found = db.execute("SELECT * FROM experts WHERE sha256 = ? OR (registry_key IS NOT NULL AND registry_key = ?)",
                               (sha256, registry_key)).fetchone()
            if found:
                return self._expert(found), False
            eid, n = expert_id, 1
            while db.execute("SELECT 1 FROM experts WHERE expert_id = ?", (eid,)).fetchone():
                n += 1
                eid = f"{expert_id}-{n}"
            db.execute("INSERT INTO experts (expert_id, source, uri, sha256, registry_key, metadata, status, created, updated)"
                       " VALUES (?, ?, ?, ?, ?, ?, 'pending', ?, ?)",
                       (eid, source, uri, sha256, registry_key, json.dumps(metadata or {}), now, now))
            row = db.execute("SELECT * FROM experts WHERE expert_id = ?", (eid,)).fetchone()
            return self._expert(row), True

    def known_arrival(self, key: str) -> str | None:
        """The content hash an earlier fold read behind arrival ``key``, or None."""
        rows = self._q("SELECT sha256 FROM arrivals WHERE key = ?", (key,))
        return str(rows[0][0]) if rows else None

    def settle_identity(self, expert_id: str, key: str, sha256: str,
                        metadata: dict[str, Any]) -> ExpertRow | None:
        """Record the content hash the fold of ``expert_id`` (queued under arrival ``key``) read.

        In one transaction: ``key`` -> ``sha256`` is remembered (the same arrival announced again
        is known without a read); if another expert already has this content, ``expert_id``'s row
        is removed and that expert's row returned (a duplicate: the caller discards the fold);
        else the row takes ``sha256`` and ``metadata`` (its hash tag) and None is returned.
        """
        with self._tx() as db:
            db.execute("INSERT INTO arrivals (key, sha256) VALUES (?, ?) "
                       "ON CONFLICT(key) DO UPDATE SET sha256 = excluded.sha256", (key, sha256))
            found = db.execute("SELECT * FROM experts WHERE sha256 = ? AND expert_id != ?",
                               (sha256, expert_id)).fetchone()
            if found is not None:
                db.execute("DELETE FROM experts WHERE expert_id = ?", (expert_id,))
                return self._expert(found)
            db.execute("UPDATE experts SET sha256 = ?, metadata = ?, updated = ? WHERE expert_id = ?",
                       (sha256, json.dumps(metadata), time.time(), expert_id))
            return None

    def next_pending(self) -> ExpertRow | None:
        """Claim the oldest pending expert (status -> folding), or None."""
        with self._tx() as db:
            r = db.execute("SELECT * FROM experts WHERE status = 'pending' ORDER BY row LIMIT 1").fetchone()
            if r is None:
                return None
            db.execute("UPDATE experts SET status = 'folding', updated = ? WHERE row = ?", (time.time(), r["row"]))
            return self._expert(db.execute("SELECT * FROM experts WHERE row = ?", (r["row"],)).fetchone())

    def set_status(self, expert_id: str, status: str, reason: str | None = None, version: int | None = None) -> None:
        if status not in STATUSES:
            raise ValueError(status)
        with self._tx() as db:
            db.execute("UPDATE experts SET status = ?, reason = ?, version = COALESCE(?, version), updated = ?"
                       " WHERE expert_id = ?", (status, reason, version, time.time(), expert_id))

    def requeue_interrupted(self) -> list[str]:
        """Experts left ``folding`` by a crash go back to pending (folded once, on restart)."""
        with self._tx() as db:
            ids = [r["expert_id"] for r in db.execute("SELECT expert_id FROM experts WHERE status = 'folding'")]
            db.execute("UPDATE experts SET status = 'pending', updated = ? WHERE status = 'folding'", (time.time(),))
            return ids

    def expert(self, expert_id: str) -> ExpertRow | None:
        """The row of ``expert_id`` (exactly), or None."""
        rows = self._q("SELECT * FROM experts WHERE expert_id = ?", (expert_id,))
        return self._expert(rows[0]) if rows else None

    def resolve_id(self, name: str) -> str:
        """The expert id an operator means: ``name`` itself if it is an id, else the one id that
        starts with ``name`` (``sst2`` for ``sst2-a49c298240bd``), or among several the one that is
        ``name-<suffix>`` (``sst2`` beside ``sst2_lr3e-3-…``); ``name`` unchanged when none does.

        Raises:
            ValueError: several ids start with ``name`` (they are listed).
        """
        if self.expert(name) is not None:
            return name
        hits = [r["expert_id"] for r in self._q("SELECT expert_id FROM experts ORDER BY row")
                if r["expert_id"].startswith(name)]
        named = [h for h in hits if h[len(name):].startswith("-")]  # name-<hash>, as cache copies are
        if len(hits) > 1 and len(named) == 1:
            return named[0]
        if len(hits) > 1:
            raise ValueError(f"{name!r} matches several experts: {', '.join(hits)}; give more of the id")
        return hits[0] if hits else name

    def experts(self) -> list[ExpertRow]:
        return [self._expert(r) for r in self._q("SELECT * FROM experts ORDER BY row")]

    def queue_depth(self) -> int:
        return int(self._q("SELECT COUNT(*) FROM experts WHERE status IN ('pending', 'folding')")[0][0])

    # -- folds and versions ---------------------------------------------------------------------
    def record_fold(self, att: Attempt, outcome: Outcome, *, policy: str, seconds: float) -> int:
        """One ``folds`` row for a pipeline attempt (a fold or an unmerge) and how it ended; the
        version is linked later by :meth:`add_version` when the attempt is published.

        Args:
            att: the attempt (kind, expert, parameters, start time, per-stage timings).
            outcome: its decision, reason and probe values.
            policy: the policy's registered name. seconds: the attempt's wall time (s).

        Returns:
            The row number (for :meth:`add_version`).
        """
        return self._insert_fold(att.kind, att.expert_id, policy, att.params, att.started, seconds, att.timings,
                                 outcome.probes, outcome.decision, outcome.reason, None)

    def record_event(self, kind: str, *, expert_id: str | None, policy: str, params: dict[str, Any], decision: str,
                     reason: str, version: int | None = None) -> int:
        """One ``folds`` row for what happened without an attempt: a ``duplicate`` expert turned
        away, an operator ``rollback`` (timed now, zero seconds, no probes). Returns the row."""
        return self._insert_fold(kind, expert_id, policy, params, time.time(), 0.0, {}, {}, decision, reason, version)

    def _insert_fold(self, *values: Any) -> int:
        kind, expert_id, policy, params, started, seconds, timings, probes, decision, reason, version = values
        with self._tx() as db:
            cur = db.execute("INSERT INTO folds (kind, expert_id, policy, params, started, seconds, timings, probes,"
                             " decision, reason, version) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                             (kind, expert_id, policy, json.dumps(params or {}), started, seconds, json.dumps(timings),
                              json.dumps(probes), decision, reason, version))
            return int(cur.lastrowid)

    def folds(self) -> list[dict[str, Any]]:
        out = []
        for r in self._q("SELECT * FROM folds ORDER BY row"):
            d = dict(r)
            for k in ("params", "timings", "probes"):
                d[k] = json.loads(d[k]) if d[k] else {}
            out.append(d)
        return out

    def add_version(self, number: int, path: str, experts: list[str], fold_row: int | None) -> None:
        """Record a published version and link the fold that produced it (one transaction)."""
        with self._tx() as db:
            db.execute("INSERT INTO versions (number, path, experts, fold_row, created) VALUES (?, ?, ?, ?, ?)",
                       (number, path, json.dumps(experts), fold_row, time.time()))
            if fold_row is not None:
                db.execute("UPDATE folds SET version = ? WHERE row = ?", (number, fold_row))

    def versions(self) -> list[dict[str, Any]]:
        return [dict(r) | {"experts": json.loads(r["experts"])} for r in self._q("SELECT * FROM versions ORDER BY number")]

    def accepted_probe_history(self) -> list[dict[str, float]]:
        """Probe values of every accepted fold, oldest first."""
        return [json.loads(r[0]) for r in self._q("SELECT probes FROM folds WHERE kind = 'fold' AND decision = 'accepted'"
                                                   " ORDER BY row")]

    # -- cursors, commands, outbox, meta ----------------------------------------------------------
    def get_cursor(self, key: str, default: str | None = None) -> str | None:
        rows = self._q("SELECT value FROM sources WHERE key = ?", (key,))
        return rows[0][0] if rows else default

    def set_cursor(self, key: str, value: str) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO sources (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                       (key, value))

    def add_command(self, verb: str, arg: str | None) -> int:
        with self._tx() as db:
            return int(db.execute("INSERT INTO commands (verb, arg, created) VALUES (?, ?, ?)",
                                  (verb, arg, time.time())).lastrowid)

    def pending_commands(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._q("SELECT * FROM commands WHERE done IS NULL ORDER BY row")]

    def finish_command(self, row: int, result: str) -> None:
        with self._tx() as db:
            db.execute("UPDATE commands SET done = ?, result = ? WHERE row = ?", (time.time(), result, row))

    def command(self, row: int) -> dict[str, Any] | None:
        rows = self._q("SELECT * FROM commands WHERE row = ?", (row,))
        return dict(rows[0]) if rows else None

    def outbox_add(self, kind: str, payload: dict[str, Any], error: str) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO outbox (kind, payload, attempts, last_error, created) VALUES (?, ?, 1, ?, ?)",
                       (kind, json.dumps(payload), error, time.time()))

    def outbox(self) -> list[dict[str, Any]]:
        return [dict(r) | {"payload": json.loads(r["payload"])} for r in self._q("SELECT * FROM outbox ORDER BY row")]

    def outbox_done(self, row: int) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM outbox WHERE row = ?", (row,))

    def outbox_failed(self, row: int, error: str) -> None:
        with self._tx() as db:
            db.execute("UPDATE outbox SET attempts = attempts + 1, last_error = ? WHERE row = ?", (error, row))

    def get_meta(self, key: str) -> Any:
        rows = self._q("SELECT value FROM meta WHERE key = ?", (key,))
        return json.loads(rows[0][0]) if rows else None

    def set_meta(self, key: str, value: Any) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                       (key, json.dumps(value)))

    def meta_items(self, prefix: str) -> dict[str, Any]:
        """Every meta value whose key starts with ``prefix`` (nulls left out), by key."""
        rows = self._q("SELECT key, value FROM meta WHERE substr(key, 1, ?) = ? ORDER BY key", (len(prefix), prefix))
        return {k: v for k, v in ((r[0], json.loads(r[1])) for r in rows) if v is not None}
