"""Folder source: watch an inbox folder and emit each expert that becomes ready.

A watchdog observer (inotify on Linux; :class:`PollingObserver` with ``polling=True`` for network
filesystems where inotify sees nothing) notes every top-level inbox entry an event touches. What a
candidate is, which names are ignored, and when it is complete are in
:mod:`mergestream.daemon.sources.readiness`. Writers should stage under a temporary name and rename
into place: the rename's destination is watched (``on_moved`` dest_path), and a renamed-in entry
whose files are older than the settle time is ready at once.

A candidate is ready when

(a) its marker exists (``READY`` inside a folder, ``NAME.safetensors.READY`` beside a file). The
    marker is the producer's promise: the expert is emitted at once, without completeness or
    settle checks; or
(b) it is complete **and** settled: the sizes and mtimes of all its files were observed unchanged
    for ``settle_seconds``, or the newest mtime is already ``settle_seconds`` old by the local clock
    (what arrived while the daemon was down, or was renamed into place), **and** it shows no sign of
    a preallocating writer (:func:`.readiness.unwritten_reason`: a hole in a weight file's data, or
    its last bytes all zero) written to less than ``unwritten_seconds`` ago. With a network
    filesystem whose clock is behind the daemon's by more than these windows, only (a) or the
    completeness check protect against a half written expert: prefer markers or rename-into-place
    there; or
(c) it is settled and can never be an expert (:func:`.readiness.never_an_expert`: not a weight
    file, random bytes, a header that is all there and invalid, a declared size beyond its disk), or
    it stayed incomplete and unchanged for ``incomplete_timeout_seconds`` (a copy that stopped for
    good): it is emitted so that the daemon rejects it with its reason (the ledger, ``status``,
    ``mergestream_experts_rejected_total``), instead of it waiting unseen.

What waits (settled but incomplete, or possibly unwritten) and what the source rejected is shown
in ``status`` as a note per entry (subject ``inbox:<name>``: level ``warning`` "waiting: ..." with
the time it started waiting, level ``error`` "rejected: ..."), cleared when the entry is emitted,
changes or goes away. An entry whose check fails unexpectedly is logged once, noted, and not looked
at again until its files change (its signature: relative names, sizes, mtimes).

The signature is taken again after the completeness check; if the files changed meanwhile (a
writer stalled past the settle time and then went on), the candidate waits to settle anew instead of
being emitted with a signature it no longer has, which would emit it a second time once the change
is seen. After an expert was emitted it is not emitted again unless its files change (size or mtime of any
file) and become ready again, or it is deleted and arrives anew. A copy of the same content under
another name is another candidate (emitted; the ledger dedups by content hash).

Event handlers only record the candidate's name; a checker thread (ticks of ``settle_seconds / 4``,
between 0.05 and 0.5 s) stats pending candidates, runs the cheap completeness check only once their
files are settled, and emits. A candidate found settled but incomplete leaves the pending set until
an event touches it again. Every 30 s the checker also lists the inbox, in case an event was lost
(e.g. an inotify queue overflow). :meth:`FolderSource.start` starts the observer first, then runs
:meth:`FolderSource.scan` (what arrived while the daemon was down), then the checker.

Symlinks: an entry that is, or holds, a symlink resolving outside the inbox is never emitted: it is
refused with its reason (a warning, ``on_error``, a ``status`` note ``inbox:<name>``) until it is
gone or fixed. Links that stay inside the inbox work; the daemon's kept copy resolves them
(:meth:`mergestream.daemon.store.KeptExperts.keep`).

inotify limits: the per-user inotify instances (``fs.inotify.max_user_instances``) and watches
(``fs.inotify.max_user_watches``) are shared by every process and container of a node running as
the same uid. When the native observer cannot get an instance, or a watch for the inbox or for a
folder that appears in it later (:func:`inotify_exhausted`: errno EMFILE, ENFILE, ENOSPC, ENOMEM),
the source switches to watchdog's :class:`PollingObserver` (``poll_interval``) for the rest of its
run: one warning, one ``on_error`` call (``mergestream_source_errors_total{source="folder"}``), a
``status`` note, and a full inbox listing at once (events in the unwatched folder were lost). It
never stops the daemon.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import OutsideRootError
from ...io.checkpoints import default_expert_id
from ...io.paths import escaping_link
from .base import Emit, ExpertReady, Source, SourceContext
from .readiness import (
    MARKER_NAME,
    MARKER_SUFFIX,
    Signature,
    expert_complete,
    file_signature,
    has_marker,
    incomplete_reason,
    is_temporary_name,
    never_an_expert,
    unwritten_reason,
)

if TYPE_CHECKING:
    from ...config import Config

log = logging.getLogger(__name__)

#: How often the folder checker lists the whole inbox in case an event was lost (seconds).
RESCAN_SECONDS = 30.0

#: errno values of an exhausted inotify: instances (EMFILE), open files (ENFILE), watches (ENOSPC),
#: kernel memory (ENOMEM).
INOTIFY_LIMIT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOSPC, errno.ENOMEM})


def inotify_exhausted(exc: BaseException) -> bool:
    """True if ``exc`` says inotify ran out of instances or watches (see :data:`INOTIFY_LIMIT_ERRNOS`):
    the case for falling back to polling, not for giving up."""
    return isinstance(exc, OSError) and exc.errno in INOTIFY_LIMIT_ERRNOS


def _discard_observer(observer) -> None:
    """Stop a watchdog observer that may never have started (its threads are joined). Never raises."""
    try:
        observer.stop()
        if observer.is_alive():
            observer.join(timeout=10)
    except Exception:  # pragma: no cover - best effort on a half-started observer
        log.debug("stopping a half-started observer", exc_info=True)


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


class FolderSource(Source):
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
        poll_interval: seconds between polling snapshots (``polling=True``, or after falling back).
        on_error: called once with the OSError when inotify is exhausted and the source falls back
            to polling; its own exceptions are logged and swallowed.
        note: called with the ``status`` note while polling replaces inotify (None: no note).
        unwritten_seconds: how long after its last write a complete-looking entry with signs of a
            preallocating writer (see the module docstring) waits before it is ready (seconds).
        incomplete_timeout_seconds: an entry settled but incomplete and unchanged this long
            (seconds, as observed by this source) is handed on to be rejected.
        entry_note: ``entry_note(subject, message, level)`` keeps the ``status`` note of one inbox
            entry (subject ``inbox:<name>``; ``message=None`` clears it); None: only logged.

    Attributes:
        fallback: why the inbox is polled although ``polling`` is false (the inotify error), or None.
    """

    name = "folder"

    def __init__(self, inbox: Path, emit: Emit, *, settle_seconds: float = 2.0,
                 polling: bool = False, poll_interval: float = 1.0,
                 on_error: Callable[[Exception], None] | None = None,
                 note: Callable[[str | None], None] | None = None,
                 unwritten_seconds: float = 300.0, incomplete_timeout_seconds: float = 3600.0,
                 entry_note: Callable[[str, str | None, str], None] | None = None):
        if settle_seconds < 0:
            raise ValueError(f"settle_seconds must be >= 0, got {settle_seconds}")
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be > 0, got {poll_interval}")
        self.inbox = Path(inbox)
        self.emit = emit
        self.settle_seconds = float(settle_seconds)
        self.polling = polling
        self.poll_interval = float(poll_interval)
        self.unwritten_seconds = float(unwritten_seconds)
        self.incomplete_timeout_seconds = float(incomplete_timeout_seconds)
        self.entry_note = entry_note
        self._recheck = max(1.0, self.settle_seconds)  # seconds between checks of a waiting entry
        self._tick = max(0.05, min(0.5, self.settle_seconds / 4))
        self._noted: set[str] = set()           # names recorded by handlers since the last pass
        self._noted_lock = threading.Lock()
        self._wake = threading.Event()
        self._check_lock = threading.Lock()     # one check pass at a time (checker thread or scan())
        self._pending: dict[str, _Candidate] = {}
        self._emitted: dict[str, Signature] = {}
        self._incomplete: dict[str, tuple[Signature, str]] = {}  # settled but incomplete: (signature, why)
        self._unwritten: dict[str, tuple[Signature, str | None]] = {}  # unwritten_reason per signature
        self._failed: dict[str, Signature] = {}  # its check raised: not looked at again until it changes
        self.on_error = on_error
        self.note = note
        self._refused: dict[str, Signature | None] = {}  # entries with a symlink out of the inbox
        self.fallback: str | None = None
        self._observer = None
        self._observer_lock = threading.Lock()  # start/stop/switch of the observer
        self._native_error: OSError | None = None  # a watch inotify refused, seen on watchdog's thread
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

        An exhausted inotify (see the module docstring) starts a polling observer instead.

        Raises:
            RuntimeError: already started.
            OSError: the inbox cannot be created or watched (other than inotify's limits).
        """
        if self._observer is not None:
            raise RuntimeError("FolderSource already started")
        self.inbox.mkdir(parents=True, exist_ok=True)
        self._stopping.clear()
        self.fallback, self._native_error = None, None
        if self.note is not None:
            self.note(None)
        with self._observer_lock:
            self._observer = self._start_observer()
        try:
            self.scan()
        except BaseException:
            self.stop()
            raise
        self._thread = threading.Thread(target=self._run, name=f"inbox-checker:{self.inbox.name}", daemon=True)
        self._thread.start()
        log.info("folder source started inbox=%s observer=%s settle_seconds=%.2f", self.inbox,
                 type(self._observer).__name__, self.settle_seconds)

    def stop(self) -> None:
        """Stop the observer and the checker thread (waits for both; idempotent)."""
        self._stopping.set()
        self._wake.set()
        with self._observer_lock:
            observer, self._observer = self._observer, None
        if observer is not None:
            observer.stop()
            observer.join(timeout=10)
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        log.info("folder source stopped inbox=%s", self.inbox)

    # -- observers ---------------------------------------------------------------------------
    def _start_observer(self):
        """A started observer on the inbox: polling when configured or when inotify is exhausted.

        Raises:
            OSError: the native observer failed for another reason, or polling cannot start.
        """
        if not self.polling:
            try:
                return self._start_native()
            except OSError as exc:
                if not inotify_exhausted(exc):
                    raise
                self._native_error = None
                self._fall_back(exc)
        return self._start_polling()

    def _start_native(self):
        from watchdog.observers import Observer

        observer = Observer()  # inotify: raises OSError(EMFILE) when no instance is left
        try:
            observer.schedule(_InboxHandler(self), str(self.inbox), recursive=True)
            self._report_refused_watches(observer)  # watchdog >= 7 opens its inotify reader in schedule
            observer.daemon = True
            observer.start()  # raises OSError(ENOSPC) when the inbox itself cannot be watched
        except BaseException:
            _discard_observer(observer)
            raise
        return observer

    def _start_polling(self):
        from watchdog.observers.polling import PollingObserver

        observer = PollingObserver(timeout=self.poll_interval)
        observer.schedule(_InboxHandler(self), str(self.inbox), recursive=True)
        observer.daemon = True
        observer.start()
        return observer

    def _report_refused_watches(self, observer) -> None:
        """Hear about watches inotify refuses later (a folder created in the inbox): watchdog's
        inotify observer skips such a folder silently, so its ``add_callback`` is wrapped to record
        the error (on watchdog's thread; :meth:`_run` then switches to polling). Observers without
        that method (other platforms, other watchdog versions) are left as they are."""
        fd = getattr(observer, "_inotify_fd", None)
        add = getattr(fd, "add_callback", None)
        if add is None:
            return

        def add_callback(*args, **kwargs):
            try:
                return add(*args, **kwargs)
            except OSError as exc:
                if inotify_exhausted(exc) and self._native_error is None:
                    self._native_error = exc
                    self._wake.set()
                raise

        fd.add_callback = add_callback

    def _fall_back(self, exc: OSError) -> None:
        """Say once (warning, ``on_error``, ``status`` note) that polling replaces inotify."""
        self.fallback = f"{exc.strerror or exc} (errno {exc.errno})"
        log.warning("inotify exhausted for inbox %s: %s; polling the inbox every %.1f s instead (raise "
                    "fs.inotify.max_user_watches / max_user_instances, or set watch.polling: true)",
                    self.inbox, self.fallback, self.poll_interval)
        if self.note is not None:
            self.note(f"inbox polled every {self.poll_interval:g} s ({self.fallback}); raise "
                      "fs.inotify.max_user_watches / max_user_instances or set watch.polling: true")
        if self.on_error is not None:
            try:
                self.on_error(exc)
            except Exception:
                log.exception("on_error callback failed")

    def _switch_to_polling(self) -> None:
        """Replace the native observer by a polling one after inotify refused a watch, then list
        the whole inbox at the next pass (events inside the unwatched folder were lost)."""
        with self._observer_lock:
            exc, self._native_error = self._native_error, None
            old = self._observer
            if exc is None or old is None or self.fallback is not None or self._stopping.is_set():
                return
            self._fall_back(exc)
            try:
                self._observer = self._start_polling()
            except OSError:
                log.exception("cannot start polling inbox %s; keeping the inotify observer", self.inbox)
                return
        _discard_observer(old)
        self._last_rescan = 0.0

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(timeout=self._tick if self._pending or self._noted else RESCAN_SECONDS / 4)
            self._wake.clear()
            if self._stopping.is_set():
                break
            try:
                if self._native_error is not None:
                    self._switch_to_polling()
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
                try:
                    ev = self._check_one(name)
                except Exception as exc:  # one entry must never stop (or spin) the checker
                    self._check_failed(name, exc)
                    continue
                if ev is not None:
                    out.append(ev)
            return out

    def _check_failed(self, name: str, exc: Exception) -> None:
        cand = self._pending.pop(name, None)
        sig = cand.signature if cand is not None and cand.signature is not None else file_signature(self.inbox / name)
        if sig is not None:
            self._failed[name] = sig
        log.error("inbox entry check failed path=%s: %s: %s; not checked again until it changes",
                  self.inbox / name, type(exc).__name__, exc, exc_info=True)
        self._entry_note(name, f"{name}: cannot be checked ({type(exc).__name__}: {exc}); not checked again "
                               "until it changes", "error")

    def _entry_note(self, name: str, message: str | None, level: str = "warning") -> None:
        if self.entry_note is None:
            return
        try:
            self.entry_note(f"inbox:{name}", message, level)
        except Exception:
            log.warning("cannot keep the status note of inbox entry %s", name, exc_info=True)

    def _leaves_inbox(self, name: str, path: Path, sig: Signature | None) -> bool:
        """True if entry ``name`` is (or holds) a symlink that resolves outside the inbox
        (:func:`mergestream.io.paths.escaping_link`): never emitted, refused once per signature (a
        warning, ``on_error`` with an :class:`~mergestream.errors.OutsideRootError`, the entry's
        ``status`` note), looked at again when it changes; the note goes once it is gone or fixed."""
        why = escaping_link(path, self.inbox) if sig is not None or os.path.islink(path) else None
        if why is None:
            if self._refused.pop(name, False) is not False:
                self._entry_note(name, None)
            return False
        self._pending.pop(name, None)
        if name not in self._refused or self._refused[name] != sig:
            self._refused[name] = sig
            log.warning("inbox entry refused path=%s reason=%s", path, why)
            if self.on_error is not None:
                try:
                    self.on_error(OutsideRootError(f"inbox entry {name} refused: {why}"))
                except Exception:
                    log.exception("on_error callback failed")
            self._entry_note(name, f"{name}: refused: {why}", "error")
        return True

    def _check_one(self, name: str) -> ExpertReady | None:
        path = self.inbox / name
        cand = self._pending[name]
        sig = file_signature(path)
        if self._leaves_inbox(name, path, sig):
            return None
        if sig is None:  # deleted or moved away: forget it (a new arrival is a new expert)
            del self._pending[name]
            self._emitted.pop(name, None)
            self._incomplete.pop(name, None)
            self._failed.pop(name, None)
            self._unwritten.pop(name, None)
            self._entry_note(name, None)
            return None
        if sig == self._emitted.get(name) or sig == self._failed.get(name):  # unchanged since: nothing new
            del self._pending[name]
            return None
        now = time.monotonic()
        if sig != cand.signature:
            cand.signature, cand.since, cand.retry_at = sig, now, 0.0
        if now < cand.retry_at:
            return None
        hopeless = None
        if has_marker(path):
            why = "marker"
        else:
            age = time.time() - max((m for _, _, m in sig), default=0) / 1e9  # since the newest mtime
            settled = now - cand.since >= self.settle_seconds or (age >= self.settle_seconds and bool(sig))
            if not settled:
                return None
            wait, hopeless = self._not_ready(path, name, sig, now - cand.since, age)
            if wait is not None:
                if cand.retry_at == 0.0:
                    log.info("inbox entry waiting (%s) path=%s", wait, path)
                self._entry_note(name, f"{name}: waiting: {wait}")
                cand.retry_at = now + self._recheck
                return None
            why = "settled"
            if hopeless is not None:  # handed on so the daemon rejects it with its reason
                log.warning("inbox entry rejected (%s) path=%s", hopeless, path)
                why = "settled, never an expert"
            after = file_signature(path)
            if after != sig:  # written to while it was checked: what was checked is not what is there
                cand.signature, cand.since = after, now
                return None
        ev = ExpertReady(source=self.name, uri=str(path), expert_id=default_expert_id(path),
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
        self._unwritten.pop(name, None)
        del self._pending[name]
        self._entry_note(name, None if hopeless is None else f"{name}: rejected: {hopeless}", "error")
        log.info("expert ready source=folder id=%s uri=%s reason=%s", ev.expert_id, ev.uri, why)
        return ev

    def _not_ready(self, path: Path, name: str, sig: Signature, observed: float,
                   age: float) -> tuple[str | None, str | None]:
        """For a settled entry without a marker: ``(why it waits, None)``, ``(None, why it can never
        be an expert)``, or ``(None, None)`` when it is ready. ``observed``: seconds this source has
        seen its files unchanged; ``age``: seconds since their newest mtime."""
        inc = self._incomplete.get(name)
        if inc is None or inc[0] != sig:
            self._incomplete.pop(name, None)
            if not expert_complete(path):
                hopeless = never_an_expert(path)
                if hopeless is not None:
                    return None, hopeless
                inc = self._incomplete[name] = (sig, incomplete_reason(path))
        if inc is not None:
            limit = self.incomplete_timeout_seconds
            if observed >= limit:  # observed only: an old mtime is not a copy that stopped
                return None, f"{inc[1]}, and unchanged for {limit:g} s (watch.incomplete_timeout_seconds)"
            return f"{inc[1]}; rejected if unchanged for {limit:g} s", None
        if self._unwritten.get(name, (None,))[0] != sig:  # the check reads: once per signature
            self._unwritten[name] = (sig, unwritten_reason(path))
        unwritten = self._unwritten[name][1]
        if unwritten is not None and max(observed, age) < self.unwritten_seconds:
            return (f"{unwritten}, as in a preallocated file still being written; folded once unchanged for "
                    f"{self.unwritten_seconds:g} s (watch.unwritten_seconds), at once with a READY marker"), None
        return None, None


def build(cfg: Config, emit: Emit, context: SourceContext) -> list[Source]:
    """The folder source of ``cfg.watch`` on ``cfg.inbox`` (none when ``watch.enabled`` is false);
    its inotify fallback is reported through ``context`` (``on_error``, the ``watch`` note)."""
    name = FolderSource.name
    context.clear_notes(name)
    w = cfg.watch
    if not w.enabled:
        return []
    return [FolderSource(cfg.inbox, emit, settle_seconds=w.settle_seconds, polling=w.polling,
                         poll_interval=w.poll_interval, on_error=lambda exc: context.on_error(name, exc),
                         note=lambda message: context.note(name, "watch", message, level="warning"),
                         unwritten_seconds=w.unwritten_seconds, incomplete_timeout_seconds=w.incomplete_timeout_seconds,
                         entry_note=lambda subject, message, level: context.note(name, subject, message, level=level))]
