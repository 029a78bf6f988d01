"""Sources: turn raw signals (file-system events, registry versions) into one "expert ready" event.

Every source calls ``emit(ExpertReady(...))`` once per expert it finds complete. The service's
ledger deduplicates (same content hash or same registry version), so an event emitted twice is
harmless; the sources still avoid needless duplicates.

Folder source (:class:`FolderSource`)
    Watches an inbox folder with a watchdog observer (inotify on Linux; :class:`PollingObserver`
    with ``polling=True`` for network filesystems where inotify sees nothing). Each *top-level*
    entry of the inbox is one candidate expert:

    * a single weight file ``NAME.safetensors``, ``NAME.bin``, ``NAME.pt`` or ``NAME.pth``;
    * a folder: a Hugging Face model folder (``model.safetensors``, or
      ``model.safetensors.index.json`` plus every shard it names, or one ``*.safetensors``, or a
      legacy ``pytorch_model.bin``/``model.bin``/``model.pt``), or a PEFT adapter folder
      (``adapter_config.json`` + ``adapter_model.safetensors`` or ``adapter_model.bin``).

    Ignored names (temporary or hidden): a leading ``.``; a trailing ``~``; the suffixes ``.tmp``,
    ``.part``, ``.partial``, ``.crdownload``, ``.incomplete``. They are ignored at the top level
    (the whole entry) and inside folders (not part of the expert). Writers should stage under such
    a name and rename into place: the rename's destination is watched (``on_moved`` dest_path), and
    a renamed-in entry whose files are older than the settle time is ready at once.

    A candidate is ready when

    (a) its marker exists: ``READY`` inside a folder, or ``NAME.safetensors.READY`` (the full file
        name plus ``.READY``) next to a single file. The marker is the producer's promise: the
        expert is emitted at once, without completeness or settle checks; or
    (b) it is complete **and** settled. Complete: a ``.safetensors`` file's header parses and
        the file size equals ``8 + header length + end of the last tensor`` (a truncated or
        still-growing file fails); a ``.bin``/``.pt`` zip archive (``torch.save``'s format) has
        its end-of-archive record; an old-style pickle ``.bin`` cannot be checked (settle only);
        a sharded folder's index parses and every shard it names exists and is complete; an
        adapter folder's ``adapter_config.json`` parses and its weights are complete; a
        ``config.json`` in the folder, if present, parses. Settled: the sizes and mtimes of all
        its files were observed unchanged for ``settle_seconds``, or the newest mtime is already
        ``settle_seconds`` old by the local clock (what arrived while the daemon was down, or was
        renamed into place). With a network filesystem whose clock is behind the daemon's by
        more than the settle time, only (a) or the completeness check protect against a half
        written expert: prefer markers or rename-into-place there.

    After an expert was emitted it is not emitted again unless its files change (size or mtime of
    any file) and become ready again, or it is deleted and arrives anew. A copy of the same content
    under another name is another candidate (emitted; the ledger dedups by content hash).

    Event handlers only record the candidate's name; a checker thread (ticks of
    ``settle_seconds / 4``, between 0.05 and 0.5 s) stats pending candidates, runs the cheap
    completeness check only once their files are settled, and emits. A candidate found settled but
    incomplete leaves the pending set until an event touches it again. Every 30 s the checker also
    lists the inbox, in case an event was lost (e.g. an inotify queue overflow). :meth:`FolderSource.start`
    starts the observer first, then runs :meth:`FolderSource.scan` (what arrived while the daemon was
    down), then the checker.

Registry source (:class:`RegistrySource`)
    An apscheduler ``BackgroundScheduler`` interval job (``coalesce=True``, ``max_instances=1``,
    first run at once) calls :meth:`RegistrySource.poll`. Per registered model it pages through
    ``MlflowClient.search_model_versions`` (``name = '<model>' AND version_number > <last>``,
    ordered by ``version_number ASC``; MLflow returns a ``PagedList`` whose ``token`` names the next
    page), then walks the versions above the last one in integer order (9 before 10):

    * a tag filter mismatch is skipped (note: a tag set on an older version *after* a newer one was
      emitted is never seen: the cursor only moves forward);
    * ``PENDING_REGISTRATION`` stops the model for this poll (a later version must not overtake it);
    * ``FAILED_REGISTRATION`` is skipped with a warning;
    * ``READY`` is downloaded (see below) and emitted; a download that still fails after
      ``max_retries`` retries with exponential backoff (``backoff_seconds · 2^i``, capped at 60 s)
      stops the model for this poll (``on_error`` is called; the next poll retries it);
    * a version deleted before it was folded (absent from the search, or gone when its download URI
      is asked for) is skipped with a log line.

    The cursor is ``max(last_version(model), highest version this source emitted)``; the service's
    ledger remembers it across restarts.

    Download: ``MlflowClient.get_model_version_download_uri`` (the version's storage location or its
    source: ``runs:/<run>/<path>``, ``mlflow-artifacts:/...``, a cloud or local path) is handed to
    ``mlflow.artifacts.download_artifacts(..., tracking_uri=, registry_uri=)`` into a temporary
    folder ``cache_dir/<model>/.<version>.tmp-*`` that is renamed to ``cache_dir/<model>/<version>/``
    (atomic: a folder there is complete, and is reused without downloading). ``models:/`` URIs are
    never passed to ``download_artifacts``: MLflow 3.17 resolves them with the *global* registry URI,
    ignoring ``registry_uri`` (it silently opens ``./mlflow.db``). The emitted ``uri`` is, inside the
    version folder: the folder itself if the checkpoint reader can open it (HF folder, one
    ``*.safetensors``, adapter folder); else its single entry, recursively (``runs:/<run>/expert``
    downloads as ``<version>/expert``); else its single weight file; else the folder (the service's
    validation then rejects it with a reason). MLflow model *flavors* (``MLmodel`` + ``data/``) are
    not unpacked: log experts as plain artifacts.

Webhook receiver (:class:`WebhookReceiver`)
    MLflow >= 3.3 posts registry events as JSON ``{"entity", "action", "timestamp", "data"}`` with
    headers ``X-MLflow-Delivery-Id``, ``X-MLflow-Timestamp`` (Unix seconds) and
    ``X-MLflow-Signature: v1,<base64(HMAC-SHA256(secret, f"{delivery_id}.{timestamp}.{body}"))>``.
    A valid ``model_version.created`` event only triggers an immediate poll; polling stays the
    source of truth. Bad or missing signature, or a timestamp more than 5 minutes away: 401.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import http.server
import json
import logging
import os
import re
import shutil
import struct
import threading
import time
import uuid
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from ..checkpoints import INDEX_NAME, SINGLE_NAME, default_expert_id

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------
# The domain event
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertReady:
    """One expert, complete and readable, found by a source.

    Attributes:
        source: ``"folder"`` or ``"mlflow"``.
        uri: local filesystem path of the expert: a ``.safetensors`` (or ``.bin``/``.pt``) file, a
            Hugging Face model folder, or a PEFT adapter folder.
        expert_id: folder: :func:`mergestream.checkpoints.default_expert_id` of the path; mlflow:
            ``f"{model_name}-v{version}"``.
        registry_key: mlflow: ``f"mlflow:{model_name}:{version}"``; folder: None.
        metadata: provenance strings. mlflow: ``mlflow.model``, ``mlflow.version``,
            ``mlflow.run_id``, ``mlflow.source``, ``mlflow.download_uri`` and ``tag.<key>`` per
            version tag; folder: ``{}``.
    """

    source: str
    uri: str
    expert_id: str
    registry_key: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------
# Readiness checks (pure functions on paths)
# ------------------------------------------------------------------------------------------
MARKER_NAME = "READY"
MARKER_SUFFIX = ".READY"
TEMP_SUFFIXES = (".tmp", ".part", ".partial", ".crdownload", ".incomplete")
FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
LEGACY_FOLDER_WEIGHTS = ("pytorch_model.bin", "model.bin", "model.pt")
_ZIP_MAGIC = b"PK\x03\x04"
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on the JSON header

#: How often the folder checker lists the whole inbox in case an event was lost (seconds).
RESCAN_SECONDS = 30.0


def is_temporary_name(name: str) -> bool:
    """True for names a writer uses while staging: leading ``.``, trailing ``~``, or a temporary
    suffix (``.tmp .part .partial .crdownload .incomplete``, any case)."""
    low = name.lower()
    return name.startswith(".") or name.endswith("~") or low.endswith(TEMP_SUFFIXES)


def safetensors_complete(path: Path) -> bool:
    """True if ``path`` is a whole safetensors file: its header parses and the file size equals
    ``8 + header length + end offset of the last tensor`` (what safetensors itself requires).

    Never raises: an unreadable, truncated or growing file is simply not complete.
    """
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            if len(head) < 8:
                return False
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER_BYTES or 8 + n > size:
                return False
            header = json.loads(fh.read(n))
    except (OSError, ValueError):
        return False
    if not isinstance(header, dict):
        return False
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            end = max(end, int(info["data_offsets"][1]))
        except (TypeError, KeyError, IndexError, ValueError):
            return False
    return size == 8 + n + end


def torch_file_complete(path: Path) -> bool:
    """True if a ``.bin``/``.pt`` file looks whole: a zip archive (``torch.save``'s format since
    1.6) must have its end-of-archive record; an old-style pickle cannot be checked (True)."""
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError:
        return False
    if magic == _ZIP_MAGIC:
        return zipfile.is_zipfile(path)
    return len(magic) == 4


def weight_file_complete(path: Path) -> bool:
    """Completeness of one weight file by its suffix (see :func:`safetensors_complete`,
    :func:`torch_file_complete`); False if it is not a regular file."""
    if not path.is_file():
        return False
    if path.name.endswith(".safetensors"):
        return safetensors_complete(path)
    return torch_file_complete(path)


def _json_ok(path: Path) -> bool:
    try:
        json.loads(path.read_text())
        return True
    except (OSError, ValueError):
        return False


def expert_complete(path: Path) -> bool:
    """True if the inbox entry ``path`` holds a complete expert (see the module docstring, rule b).

    Never raises.
    """
    try:
        if path.is_file():
            return path.name.endswith(FILE_SUFFIXES) and weight_file_complete(path)
        if not path.is_dir():
            return False
        if (path / "config.json").exists() and not _json_ok(path / "config.json"):
            return False
        if (path / ADAPTER_CONFIG).exists():
            if not _json_ok(path / ADAPTER_CONFIG):
                return False
            return any(weight_file_complete(path / w) for w in ADAPTER_WEIGHTS)
        index = path / INDEX_NAME
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                shards = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return False
            return bool(shards) and all(weight_file_complete(path / s) for s in shards)
        if (path / SINGLE_NAME).exists():
            return weight_file_complete(path / SINGLE_NAME)
        singles = [p for p in path.glob("*.safetensors") if not is_temporary_name(p.name)]
        if len(singles) == 1:
            return weight_file_complete(singles[0])
        for legacy in LEGACY_FOLDER_WEIGHTS:
            if (path / legacy).exists():
                return weight_file_complete(path / legacy)
        return False
    except OSError:
        return False


def has_marker(path: Path) -> bool:
    """True if the producer marked ``path`` ready: ``path/READY`` for a folder,
    ``<path>.READY`` beside a single file."""
    if path.is_dir():
        return (path / MARKER_NAME).exists()
    return path.with_name(path.name + MARKER_SUFFIX).exists()


#: (relative name, size, mtime_ns) of every non-temporary file of a candidate, sorted.
Signature = tuple[tuple[str, int, int], ...]


def file_signature(path: Path) -> Signature | None:
    """Sizes and mtimes of the candidate's files (recursively for a folder; temporary names and
    the folder's ``READY`` marker excluded, so a marker added later is not a change); None if
    ``path`` does not exist."""
    try:
        st = path.stat()
    except OSError:
        return None
    if not path.is_dir():
        return ((path.name, st.st_size, st.st_mtime_ns),)
    out = []
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if not is_temporary_name(d)]
        for f in files:
            if is_temporary_name(f):
                continue
            p = os.path.join(root, f)
            try:
                s = os.stat(p)
            except OSError:
                continue
            rel = os.path.relpath(p, path)
            if rel != MARKER_NAME:
                out.append((rel, s.st_size, s.st_mtime_ns))
    return tuple(sorted(out))


# ------------------------------------------------------------------------------------------
# Folder source
# ------------------------------------------------------------------------------------------
@dataclass
class _Candidate:
    signature: Signature | None = None
    since: float = 0.0            # monotonic time the current signature was first seen
    retry_at: float = 0.0         # monotonic time before which a failed emit is not retried


class _InboxHandler:
    """watchdog handler: maps every event to its top-level inbox name and records it (nothing more)."""

    _IGNORED = frozenset({"opened", "closed_no_write"})

    def __init__(self, source: FolderSource):
        self._source = source

    def dispatch(self, event) -> None:  # watchdog calls dispatch(event) on its emitter thread
        if event.event_type in self._IGNORED:
            return
        self._source._note(os.fsdecode(event.src_path))
        if getattr(event, "dest_path", ""):
            self._source._note(os.fsdecode(event.dest_path))


class FolderSource:
    """Watch an inbox folder and emit :class:`ExpertReady` for each expert that becomes ready.

    Readiness rules are in the module docstring. Thread-safe; ``emit`` is called from the checker
    thread (or from the caller of :meth:`scan`), one call at a time.

    Args:
        inbox: the folder to watch (created if missing).
        emit: called once per ready expert; an exception from it is logged and the expert is
            retried after ``max(settle_seconds, 1)`` seconds.
        settle_seconds: how long (seconds) a complete candidate's file sizes and mtimes must stay
            unchanged before it is ready.
        polling: use watchdog's ``PollingObserver`` (stat every ``poll_interval``) instead of the
            native observer: for NFS/SMB/FUSE mounts where inotify sees nothing.
        poll_interval: seconds between polling snapshots (``polling=True`` only).
    """

    def __init__(self, inbox: Path, emit: Callable[[ExpertReady], None], *, settle_seconds: float = 2.0,
                 polling: bool = False, poll_interval: float = 1.0):
        if settle_seconds < 0:
            raise ValueError(f"settle_seconds must be >= 0, got {settle_seconds}")
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be > 0, got {poll_interval}")
        self.inbox = Path(inbox)
        self.emit = emit
        self.settle_seconds = float(settle_seconds)
        self.polling = polling
        self.poll_interval = float(poll_interval)
        self._tick = max(0.05, min(0.5, self.settle_seconds / 4))
        self._noted: set[str] = set()           # names recorded by handlers since the last pass
        self._noted_lock = threading.Lock()
        self._wake = threading.Event()
        self._check_lock = threading.Lock()     # one check pass at a time (checker thread or scan())
        self._pending: dict[str, _Candidate] = {}
        self._emitted: dict[str, Signature] = {}
        self._incomplete: dict[str, Signature] = {}  # settled but incomplete: recheck when it changes
        self._observer = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._last_rescan = 0.0

    # -- event side (tiny) -------------------------------------------------------------------
    def _note(self, path: str) -> None:
        """Record the top-level inbox name that ``path`` belongs to (called by the handler)."""
        try:
            rel = Path(path).relative_to(self.inbox)
        except ValueError:
            return
        if not rel.parts:
            return
        name = self._candidate_name(rel.parts[0])
        if name is None:
            return
        with self._noted_lock:
            self._noted.add(name)
        self._wake.set()

    @staticmethod
    def _candidate_name(top: str) -> str | None:
        """The candidate a top-level name belongs to (``x.safetensors.READY`` -> ``x.safetensors``),
        or None for temporary names and a bare ``READY``."""
        if top.endswith(MARKER_SUFFIX):
            top = top[: -len(MARKER_SUFFIX)]
        if not top or top == MARKER_NAME or is_temporary_name(top):
            return None
        return top

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the observer, run :meth:`scan` (emits what is already ready), start the checker.

        Raises:
            RuntimeError: already started.
            OSError: the inbox cannot be created or watched.
        """
        if self._observer is not None:
            raise RuntimeError("FolderSource already started")
        from watchdog.observers import Observer
        from watchdog.observers.polling import PollingObserver

        self.inbox.mkdir(parents=True, exist_ok=True)
        self._stopping.clear()
        observer = PollingObserver(timeout=self.poll_interval) if self.polling else Observer()
        observer.schedule(_InboxHandler(self), str(self.inbox), recursive=True)
        observer.daemon = True
        observer.start()
        self._observer = observer
        try:
            self.scan()
        except BaseException:
            self.stop()
            raise
        self._thread = threading.Thread(target=self._run, name=f"inbox-checker:{self.inbox.name}", daemon=True)
        self._thread.start()
        log.info("folder source started inbox=%s observer=%s settle_seconds=%.2f", self.inbox,
                 type(observer).__name__, self.settle_seconds)

    def stop(self) -> None:
        """Stop the observer and the checker thread (waits for both; idempotent)."""
        self._stopping.set()
        self._wake.set()
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=10)
            self._observer = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        log.info("folder source stopped inbox=%s", self.inbox)

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(timeout=self._tick if self._pending or self._noted else RESCAN_SECONDS / 4)
            self._wake.clear()
            if self._stopping.is_set():
                break
            try:
                rescan = time.monotonic() - self._last_rescan >= RESCAN_SECONDS
                self._check(rescan=rescan)
            except Exception:  # pragma: no cover - keep watching whatever happens
                log.exception("folder source check failed inbox=%s", self.inbox)

    # -- checks ------------------------------------------------------------------------------
    def scan(self) -> list[ExpertReady]:
        """One synchronous pass over the whole inbox: emit and return what is ready now.

        Candidates that are complete but not yet settled stay pending for the checker thread
        (when started). Never raises for inbox contents; OSError if the inbox cannot be listed.
        """
        return self._check(rescan=True, raise_on_list=True)

    def _list_inbox(self) -> set[str]:
        names = set()
        for entry in os.scandir(self.inbox):
            name = self._candidate_name(entry.name)
            if name is not None:
                names.add(name)
        return names

    def _check(self, *, rescan: bool, raise_on_list: bool = False) -> list[ExpertReady]:
        with self._check_lock:
            with self._noted_lock:
                noted, self._noted = self._noted, set()
            if rescan:
                self._last_rescan = time.monotonic()
                try:
                    listed = self._list_inbox()
                except OSError:
                    if raise_on_list:
                        raise
                    log.warning("cannot list inbox %s", self.inbox, exc_info=True)
                    listed = set()
                # emitted entries are rechecked on events only
                noted |= {n for n in listed if n not in self._emitted}
            for name in noted:
                self._pending.setdefault(name, _Candidate())
            out = []
            for name in sorted(self._pending):
                ev = self._check_one(name)
                if ev is not None:
                    out.append(ev)
            return out

    def _check_one(self, name: str) -> ExpertReady | None:
        path = self.inbox / name
        cand = self._pending[name]
        sig = file_signature(path)
        if sig is None:  # deleted or moved away: forget it (a new arrival is a new expert)
            del self._pending[name]
            self._emitted.pop(name, None)
            self._incomplete.pop(name, None)
            return None
        if sig == self._emitted.get(name):  # an event on an unchanged, already emitted expert
            del self._pending[name]
            return None
        now = time.monotonic()
        if sig != cand.signature:
            cand.signature, cand.since = sig, now
        if now < cand.retry_at:
            return None
        if has_marker(path):
            why = "marker"
        else:
            newest_ns = max((m for _, _, m in sig), default=0)
            at_rest = newest_ns / 1e9 <= time.time() - self.settle_seconds
            settled = now - cand.since >= self.settle_seconds or (at_rest and bool(sig))
            if not settled:
                return None
            if sig == self._incomplete.get(name):  # checked before, unchanged: wait for an event
                del self._pending[name]
                return None
            if not expert_complete(path):
                self._incomplete[name] = sig
                del self._pending[name]
                log.info("inbox entry settled but incomplete, waiting for changes path=%s", path)
                return None
            why = "settled"
        ev = ExpertReady(source="folder", uri=str(path), expert_id=default_expert_id(path),
                         registry_key=None, metadata={})
        try:
            self.emit(ev)
        except Exception:
            delay = max(self.settle_seconds, 1.0)
            log.exception("emit failed for %s; retrying in %.1f s", path, delay)
            cand.retry_at = now + delay
            return None
        self._emitted[name] = sig
        self._incomplete.pop(name, None)
        del self._pending[name]
        log.info("expert ready source=folder id=%s uri=%s reason=%s", ev.expert_id, ev.uri, why)
        return ev


# ------------------------------------------------------------------------------------------
# MLflow registry source
# ------------------------------------------------------------------------------------------
class _VersionDeleted(Exception):
    """The model version no longer exists in the registry."""


def _is_not_found(exc: Exception) -> bool:
    return getattr(exc, "error_code", None) == "RESOURCE_DOES_NOT_EXIST"


def _safe_dirname(name: str) -> str:
    """A folder name for a registered model name (which may hold '/', spaces, ...)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    if safe != name or safe.startswith("."):
        safe = f"{safe.lstrip('.')}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"
    return safe


def _quote(value: str) -> str:
    """A string literal for an MLflow search filter."""
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise ValueError(f"registered model name {value!r} holds both quote characters; cannot search for it")


def _loadable_folder(p: Path) -> bool:
    if (p / INDEX_NAME).is_file() or (p / SINGLE_NAME).is_file() or (p / ADAPTER_CONFIG).is_file():
        return True
    if len(list(p.glob("*.safetensors"))) == 1:
        return True
    return any((p / n).is_file() for n in LEGACY_FOLDER_WEIGHTS)


def resolve_expert_path(p: Path) -> Path:
    """What to hand the checkpoint reader inside a downloaded artifact tree (see module docstring)."""
    for _ in range(16):  # depth bound
        if p.is_file() or _loadable_folder(p):
            return p
        entries = [e for e in p.iterdir() if not e.name.startswith(".")]
        if len(entries) == 1:
            p = entries[0]
            continue
        weights = [e for e in entries if e.is_file() and e.name.endswith(FILE_SUFFIXES)]
        return weights[0] if len(weights) == 1 else p
    return p


class RegistrySource:
    """Poll an MLflow model registry and emit each new READY version, in version order.

    Behaviour (ordering, tag filter, pending/failed/deleted versions, download and cache) is in the
    module docstring.

    Args:
        models: registered model names to follow.
        emit: called once per new version; an exception from it counts as an error (``on_error``)
            and stops that model for this poll (the version is retried next poll).
        last_version: the highest version already taken for a model (0 if none); usually read from
            the ledger.
        cache_dir: downloads land in ``cache_dir/<model>/<version>/``.
        tracking_uri, registry_uri: MLflow URIs (None: MLflow's defaults; the registry defaults to
            the tracking URI).
        interval_seconds: seconds between scheduled polls.
        tag_filter: only versions whose tags include all these key/value pairs.
        max_retries: download retries after the first attempt.
        backoff_seconds: first retry delay in seconds; doubles each retry, capped at 60 s.
        on_error: called with each error (registry unreachable, download failed after retries,
            emit failed); its own exceptions are logged and swallowed.

    Registry calls use MLflow's own HTTP retries (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, default 7
    with exponential backoff, ``MLFLOW_HTTP_REQUEST_TIMEOUT``): an unreachable server can hold one
    poll for minutes unless those are lowered.
    """

    JOB_ID = "mergestream-mlflow-poll"
    #: ``max_results`` of each ``search_model_versions`` page.
    PAGE_SIZE = 1000

    def __init__(self, models: list[str], emit: Callable[[ExpertReady], None], *, last_version: Callable[[str], int],
                 cache_dir: Path, tracking_uri: str | None = None, registry_uri: str | None = None,
                 interval_seconds: float = 30.0, tag_filter: dict[str, str] | None = None,
                 max_retries: int = 5, backoff_seconds: float = 1.0,
                 on_error: Callable[[Exception], None] | None = None):
        if not models:
            raise ValueError("RegistrySource needs at least one registered model name")
        for m in models:
            _quote(m)
        if interval_seconds <= 0:
            raise ValueError(f"interval_seconds must be > 0, got {interval_seconds}")
        if max_retries < 0 or backoff_seconds < 0:
            raise ValueError("max_retries and backoff_seconds must be >= 0")
        self.models = list(models)
        self.emit = emit
        self.last_version = last_version
        self.cache_dir = Path(cache_dir)
        self.tracking_uri = tracking_uri
        self.registry_uri = registry_uri or tracking_uri
        self.interval_seconds = float(interval_seconds)
        self.tag_filter = dict(tag_filter or {})
        self.max_retries = int(max_retries)
        self.backoff_seconds = float(backoff_seconds)
        self.on_error = on_error
        self._client = None
        self._high: dict[str, int] = {}
        self._poll_lock = threading.Lock()
        self._stopping = threading.Event()
        self._again = threading.Event()      # a trigger arrived since the running poll started
        self._running = False                # the scheduled job is running (guarded by _flag_lock)
        self._flag_lock = threading.Lock()
        self._scheduler = None
        self._server_side_filter = True

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the background scheduler; the first poll runs at once.

        Raises:
            RuntimeError: already started.
        """
        if self._scheduler is not None:
            raise RuntimeError("RegistrySource already started")
        from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_EXECUTED
        from apscheduler.schedulers.background import BackgroundScheduler
        from apscheduler.triggers.interval import IntervalTrigger

        self._stopping.clear()
        self._running = False
        self._clean_stale_downloads()
        sched = BackgroundScheduler(timezone=timezone.utc)
        sched.add_job(self._job, IntervalTrigger(seconds=self.interval_seconds, timezone=timezone.utc),
                      id=self.JOB_ID, coalesce=True, max_instances=1, misfire_grace_time=None,
                      next_run_time=datetime.now(timezone.utc))
        sched.add_listener(self._on_job_done, EVENT_JOB_EXECUTED | EVENT_JOB_ERROR)
        self._scheduler = sched
        sched.start()
        log.info("registry source started models=%s tracking_uri=%s interval_seconds=%.1f",
                 self.models, self.tracking_uri, self.interval_seconds)

    def stop(self) -> None:
        """Stop the scheduler, waiting for a running poll (its backoff sleeps are cut short);
        idempotent."""
        self._stopping.set()
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=True)
            self._scheduler = None
        log.info("registry source stopped models=%s", self.models)

    def trigger(self) -> None:
        """Ask for an immediate poll (thread-safe, returns at once). A poll that is already running
        is followed by one more as soon as it ends. Without :meth:`start`, does nothing."""
        with self._flag_lock:
            self._again.set()
            if self._running:  # _on_job_done reschedules when the running poll has ended
                return
        self._run_now()

    def _run_now(self) -> None:
        sched = self._scheduler
        if sched is None or self._stopping.is_set():
            return
        try:
            sched.modify_job(self.JOB_ID, next_run_time=datetime.now(timezone.utc))
        except Exception:  # scheduler shutting down
            log.debug("immediate poll not scheduled: scheduler not running", exc_info=True)

    def _job(self) -> None:
        with self._flag_lock:
            self._running = True
            self._again.clear()  # this poll starts after every trigger so far: it serves them
        self.poll()

    def _on_job_done(self, event) -> None:
        """apscheduler listener, called after the executor released the job's instance slot (so a
        run scheduled from here is not skipped by ``max_instances=1``)."""
        if event.job_id != self.JOB_ID:
            return
        with self._flag_lock:
            self._running = False
            again = self._again.is_set()
        if again:
            self._run_now()

    # -- polling -----------------------------------------------------------------------------
    def _get_client(self):
        if self._client is None:
            from mlflow import MlflowClient

            self._client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.registry_uri)
        return self._client

    def _error(self, exc: Exception) -> None:
        if self.on_error is not None:
            try:
                self.on_error(exc)
            except Exception:
                log.exception("on_error callback failed")

    def poll(self) -> list[ExpertReady]:
        """One synchronous poll of every model; returns the events emitted, in order.

        Never raises for registry or download errors: each is logged and passed to ``on_error``;
        the model it happened on stops for this poll, the other models go on.
        """
        out: list[ExpertReady] = []
        with self._poll_lock:
            for model in self.models:
                if self._stopping.is_set():
                    break
                try:
                    out.extend(self._poll_model(model))
                except Exception as exc:
                    log.warning("registry poll failed model=%s tracking_uri=%s: %s: %s", model,
                                self.tracking_uri, type(exc).__name__, exc)
                    self._error(exc)
        return out

    def _search(self, model: str, last: int) -> list:
        """Every non-deleted version of ``model`` above ``last`` (any status), all pages."""
        from mlflow.exceptions import MlflowException

        client = self._get_client()
        name = f"name = {_quote(model)}"
        while True:
            if self._server_side_filter:
                flt, order = f"{name} AND version_number > {last}", ["version_number ASC"]
            else:
                flt, order = name, None
            versions, token = [], None
            try:
                while True:
                    page = client.search_model_versions(flt, max_results=self.PAGE_SIZE, order_by=order,
                                                        page_token=token)
                    versions.extend(page)
                    token = page.token
                    if not token:
                        return versions
            except MlflowException as exc:
                if self._server_side_filter and getattr(exc, "error_code", None) == "INVALID_PARAMETER_VALUE":
                    log.info("registry rejects version_number filter/order (%s); filtering client-side", exc)
                    self._server_side_filter = False
                    continue
                raise

    def _poll_model(self, model: str) -> list[ExpertReady]:
        last = max(int(self.last_version(model)), self._high.get(model, 0))
        versions = [mv for mv in self._search(model, last) if int(mv.version) > last]
        versions.sort(key=lambda mv: int(mv.version))
        present = {int(mv.version) for mv in versions}
        if present:
            gone = [v for v in range(last + 1, max(present)) if v not in present]
            if gone:
                log.info("registry versions absent (deleted before folding), skipped model=%s versions=%s",
                         model, gone)
        out = []
        for mv in versions:
            v = int(mv.version)
            tags = dict(mv.tags or {})
            if any(tags.get(k) != val for k, val in self.tag_filter.items()):
                log.debug("version skipped by tag filter model=%s version=%d", model, v)
                continue
            if mv.status == "PENDING_REGISTRATION":
                log.info("version pending registration; later versions wait model=%s version=%d", model, v)
                break
            if mv.status != "READY":
                log.warning("version not READY (status=%s), skipped model=%s version=%d", mv.status, model, v)
                continue
            try:
                path, download_uri = self._fetch(model, v)
            except _VersionDeleted:
                log.warning("version deleted before it was folded, skipped model=%s version=%d", model, v)
                continue
            except Exception as exc:
                log.error("download failed after %d retries model=%s version=%d: %s: %s; later versions wait",
                          self.max_retries, model, v, type(exc).__name__, exc)
                self._error(exc)
                break
            meta = {"mlflow.model": model, "mlflow.version": str(v), "mlflow.run_id": mv.run_id or "",
                    "mlflow.source": mv.source or "", "mlflow.download_uri": download_uri}
            meta.update({f"tag.{k}": str(val) for k, val in tags.items()})
            ev = ExpertReady(source="mlflow", uri=str(path), expert_id=f"{model}-v{v}",
                             registry_key=f"mlflow:{model}:{v}", metadata=meta)
            try:
                self.emit(ev)
            except Exception as exc:
                log.exception("emit failed model=%s version=%d; later versions wait", model, v)
                self._error(exc)
                break
            self._high[model] = v
            out.append(ev)
            log.info("expert ready source=mlflow id=%s uri=%s", ev.expert_id, ev.uri)
        return out

    # -- download ----------------------------------------------------------------------------
    def _model_dir(self, model: str) -> Path:
        return self.cache_dir / _safe_dirname(model)

    def _clean_stale_downloads(self) -> None:
        for model in self.models:
            d = self._model_dir(model)
            if d.is_dir():
                for tmp in d.glob(".*.tmp-*"):
                    shutil.rmtree(tmp, ignore_errors=True)

    def _fetch(self, model: str, version: int) -> tuple[Path, str]:
        """Download (with retries) or reuse the cached copy; returns (expert path, download URI).

        Raises:
            _VersionDeleted: the version is gone from the registry.
            Exception: the last download error after ``max_retries`` retries.
        """
        attempt = 0
        while True:
            try:
                return self._fetch_once(model, version)
            except _VersionDeleted:
                raise
            except Exception as exc:
                if attempt >= self.max_retries or self._stopping.is_set():
                    raise
                delay = min(60.0, self.backoff_seconds * 2 ** attempt)
                attempt += 1
                log.warning("download attempt %d failed model=%s version=%d: %s: %s; retrying in %.1f s",
                            attempt, model, version, type(exc).__name__, exc, delay)
                if self._stopping.wait(delay):
                    raise

    def _fetch_once(self, model: str, version: int) -> tuple[Path, str]:
        import mlflow.artifacts

        client = self._get_client()
        try:
            uri = client.get_model_version_download_uri(model, str(version))
        except Exception as exc:
            if _is_not_found(exc):
                raise _VersionDeleted() from exc
            raise
        if uri.startswith("models:/"):
            uri = self._resolve_models_uri(uri)
        final = self._model_dir(model) / str(version)
        if final.is_dir():
            log.debug("cache hit model=%s version=%d path=%s", model, version, final)
            return resolve_expert_path(final), uri
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{version}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(tmp),
                                                tracking_uri=self.tracking_uri, registry_uri=self.registry_uri)
            if not any(f.is_file() for f in tmp.rglob("*")):
                raise FileNotFoundError(f"downloading {uri} produced no files")
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir():
                    raise
                log.debug("cache folder appeared concurrently: %s", final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        log.info("downloaded model=%s version=%d from %s to %s", model, version, uri, final)
        return resolve_expert_path(final), uri

    def _resolve_models_uri(self, uri: str) -> str:
        """``models:/m-<id>[/path]`` (an MLflow 3 logged model) -> its artifact location, through our
        client (see the module docstring: MLflow resolves ``models:/`` with the global registry)."""
        rest = uri[len("models:/"):]
        model_id, _, sub = rest.partition("/")
        if not model_id.startswith("m-"):
            raise ValueError(f"cannot resolve registry download URI {uri!r}")
        loc = self._get_client().get_logged_model(model_id).artifact_location.rstrip("/")
        return f"{loc}/{sub}" if sub else loc


# ------------------------------------------------------------------------------------------
# Webhook receiver
# ------------------------------------------------------------------------------------------
SIGNATURE_HEADER = "X-MLflow-Signature"
TIMESTAMP_HEADER = "X-MLflow-Timestamp"
DELIVERY_ID_HEADER = "X-MLflow-Delivery-Id"
#: Largest accepted request body (bytes).
MAX_BODY_BYTES = 1024 * 1024


def sign_webhook(secret: str, delivery_id: str, timestamp: str, body: bytes | str) -> str:
    """MLflow's webhook signature: ``"v1," + base64(HMAC-SHA256(secret, f"{delivery_id}.{timestamp}.{body}"))``."""
    if isinstance(body, bytes):
        body = body.decode("utf-8")
    mac = hmac.new(secret.encode("utf-8"), f"{delivery_id}.{timestamp}.{body}".encode("utf-8"), hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode("ascii")


def verify_webhook(secret: str, headers, body: bytes, *, tolerance_seconds: float = 300.0,
                   now: float | None = None) -> bool:
    """True if ``headers`` carry a valid MLflow signature of ``body`` made with ``secret`` and a
    timestamp within ``tolerance_seconds`` of ``now`` (replay protection). Never raises.

    ``headers`` is any mapping with ``.get`` (case-insensitive for ``http.server``'s message).
    The signature header may hold several space-separated ``v1,<sig>`` entries (Standard Webhooks).
    """
    delivery_id = headers.get(DELIVERY_ID_HEADER)
    timestamp = headers.get(TIMESTAMP_HEADER)
    signature = headers.get(SIGNATURE_HEADER)
    if not (delivery_id and timestamp and signature):
        return False
    try:
        ts = int(timestamp)
        text = body.decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return False
    if abs((time.time() if now is None else now) - ts) > tolerance_seconds:
        return False
    expected = sign_webhook(secret, delivery_id, timestamp, text).split(",", 1)[1]
    for part in signature.split():
        version, _, sig = part.partition(",")
        if version != "v1":
            continue
        try:
            base64.b64decode(sig, validate=True)
        except (binascii.Error, ValueError):
            continue
        if hmac.compare_digest(sig.encode("ascii", "replace"), expected.encode("ascii")):
            return True
    return False


class _WebhookHandler(http.server.BaseHTTPRequestHandler):
    server_version = "mergestream-webhook"
    receiver: WebhookReceiver  # set on the per-receiver subclass

    def log_message(self, format, *args):  # noqa: A002 - http.server's signature
        log.debug("webhook %s %s", self.address_string(), format % args)

    def _reply(self, code: int, message: str) -> None:
        body = json.dumps({"message": message}).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802 - http.server's naming
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            return self._reply(400, "bad Content-Length")
        if length < 0 or length > MAX_BODY_BYTES:
            return self._reply(413, "body too large")
        body = self.rfile.read(length)
        rx = self.receiver
        if not verify_webhook(rx.secret, self.headers, body, tolerance_seconds=rx.tolerance_seconds):
            log.warning("webhook rejected: bad or missing signature from %s", self.client_address[0])
            return self._reply(401, "invalid signature")
        try:
            payload = json.loads(body)
            event = f"{payload.get('entity')}.{payload.get('action')}"
        except (ValueError, AttributeError):
            return self._reply(400, "body is not a JSON object")
        if event != "model_version.created":
            log.debug("webhook event ignored: %s", event)
            return self._reply(200, f"ignored {event}")
        data = payload.get("data") or {}
        log.info("webhook model_version.created model=%s version=%s: polling now",
                 data.get("name") if isinstance(data, dict) else None,
                 data.get("version") if isinstance(data, dict) else None)
        try:
            rx.on_event()
        except Exception:
            log.exception("webhook on_event failed")
            return self._reply(500, "on_event failed")
        return self._reply(200, "poll triggered")


class WebhookReceiver:
    """HTTP endpoint for MLflow (>= 3.3) webhooks: a valid ``model_version.created`` calls
    ``on_event()`` (typically :meth:`RegistrySource.trigger`).

    Any path is accepted (POST only). Replies: 200 (triggered or ignored event), 400 (not JSON),
    401 (missing/bad signature or timestamp older than ``tolerance_seconds``), 413 (body over
    :data:`MAX_BODY_BYTES`), 500 (``on_event`` raised). Served by the standard library's
    ``ThreadingHTTPServer`` on a daemon thread. Create the MLflow webhook with the same secret,
    e.g. ``MlflowClient.create_webhook(name, url, events=["model_version.created"], secret=...)``;
    an MLflow server only delivers to ``http://`` or private addresses when it runs with
    ``MLFLOW_WEBHOOK_ALLOWED_SCHEMES=http,https`` and ``MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS=true``.

    Args:
        host: interface to bind (e.g. ``127.0.0.1``).
        port: TCP port; 0 picks a free one (see :attr:`port`).
        secret: the shared HMAC secret (non-empty).
        on_event: called on each valid event, on the request thread; keep it quick.
        tolerance_seconds: accepted clock difference for ``X-MLflow-Timestamp`` (seconds).
    """

    def __init__(self, host: str, port: int, secret: str, on_event: Callable[[], None], *,
                 tolerance_seconds: float = 300.0):
        if not secret:
            raise ValueError("WebhookReceiver needs a non-empty secret")
        self.host = host
        self._port = int(port)
        self.secret = secret
        self.on_event = on_event
        self.tolerance_seconds = float(tolerance_seconds)
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port once started (the requested one before)."""
        return self._server.server_address[1] if self._server is not None else self._port

    def start(self) -> None:
        """Bind and serve on a background thread.

        Raises:
            OSError: the address cannot be bound.
            RuntimeError: already started.
        """
        if self._server is not None:
            raise RuntimeError("WebhookReceiver already started")
        handler = type("BoundWebhookHandler", (_WebhookHandler,), {"receiver": self})
        server = http.server.ThreadingHTTPServer((self.host, self._port), handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="mlflow-webhook", daemon=True)
        self._thread.start()
        log.info("webhook receiver listening on http://%s:%d", self.host, self.port)

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server = None
        self._thread = None
        log.info("webhook receiver stopped")
