"""The source protocol: what every source gives the service, and what the service gives it.

A source turns raw signals (file-system events, registry versions, bucket listings) into one
domain event, :class:`ExpertReady`, and hands it to ``emit``. The service's ledger deduplicates (same
content hash or same registry key), so an event emitted twice is harmless.

Naming: a source's :attr:`Source.name` is its label in metrics (``source_errors{source=...}``,
``experts_seen{source=...}``) and in the ledger, and it prefixes the registry keys it emits
(``"mlflow:<model>:<version>"``): the service asks the source named by a key's prefix whether that
key is still available, and tells it when one of its events was enqueued.

Notes: a source that cannot do its job as configured (a registered model that does not exist, the
inbox polled because inotify ran out of watches) says so through :meth:`SourceContext.note`; the
note is kept in the ledger's meta table (key ``source_note:<source>:<subject>``) and ``mergestream
status`` shows it (:func:`source_notes`) until the source clears it or the daemon starts again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from ...redaction import redact_uris
from ..notes import NOTE_PREFIX, source_notes  # noqa: F401 - re-exported: the notes' home is ..notes

if TYPE_CHECKING:
    from ...config import Config

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class ExpertReady:
    """One expert, complete and readable, found by a source.

    Attributes:
        source: the emitting source's :attr:`Source.name` (``"folder"``, ``"mlflow"``).
        uri: local filesystem path of the expert: a ``.safetensors`` (or ``.bin``/``.pt``) file, a
            Hugging Face model folder, or a PEFT adapter folder.
        expert_id: folder: :func:`mergestream.io.checkpoints.default_expert_id` of the path; mlflow:
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


#: The callback a source hands each ready expert to (the service's ``on_expert_ready``).
Emit = Callable[[ExpertReady], None]


@runtime_checkable
class Source(Protocol):
    """A running producer of :class:`ExpertReady` events.

    Subclass it to inherit the defaults of :meth:`still_available` and :meth:`on_enqueued`; any
    class with the same members also conforms.

    Attributes:
        name: label in metrics and the ledger, and the prefix of the registry keys it emits.
    """

    name: str

    def start(self) -> None:
        """Start watching (background threads); may emit at once.

        Raises:
            RuntimeError: already started.
            OSError: what it watches cannot be reached at all.
        """
        ...

    def stop(self) -> None:
        """Stop watching and wait for its threads (idempotent)."""
        ...

    def still_available(self, registry_key: str) -> bool:
        """False if the expert behind ``registry_key`` (one this source emitted) was withdrawn
        since, so the service rejects it instead of folding it. Default: True. Never raises."""
        return True

    def on_enqueued(self, ev: ExpertReady) -> None:
        """Called by the service (on the emitting thread) once ``ev``, an event of this source, is
        in the ledger: the place to advance a durable cursor. Default: nothing."""


class Cursors(Protocol):
    """Durable per-source positions (the ledger's ``sources`` table)."""

    def get_cursor(self, key: str, default: str | None = None) -> str | None:
        """The stored value of ``key``, or ``default``."""
        ...

    def set_cursor(self, key: str, value: str) -> None:
        """Store ``value`` under ``key`` (durably)."""
        ...


class NoteStore(Protocol):
    """Small durable key/value facts (the ledger's ``meta`` table), JSON values."""

    def get_meta(self, key: str) -> Any:
        """The value stored under ``key``, or None."""
        ...

    def set_meta(self, key: str, value: Any) -> None:
        """Store ``value`` under ``key`` (None clears it)."""
        ...

    def meta_items(self, prefix: str) -> dict[str, Any]:
        """Every non-null value whose key starts with ``prefix``."""
        ...


@dataclass(frozen=True)
class SourceContext:
    """What the service lends the sources it builds, besides the config and ``emit``.

    Attributes:
        cursors: durable positions, e.g. the last registry version taken per model.
        on_error: called with the source's name and the error each time a source fails to poll,
            watch or download (the service counts ``source_errors{source=name}``).
        notes: where :meth:`note` keeps what ``status`` shows; None: ``cursors`` when it keeps
            notes too (the ledger does), else notes are only logged.
    """

    cursors: Cursors
    on_error: Callable[[str, Exception], None] = lambda name, exc: None
    notes: NoteStore | None = None

    def _note_store(self) -> NoteStore | None:
        if self.notes is not None:
            return self.notes
        has = all(callable(getattr(self.cursors, m, None)) for m in ("get_meta", "set_meta", "meta_items"))
        return self.cursors if has else None  # type: ignore[return-value]

    def note(self, source: str, subject: str, message: str | None,
             level: Literal["error", "warning"] = "error") -> None:
        """Keep (or, with ``message=None``, clear) what ``status`` shows about ``subject`` of
        ``source`` (e.g. ``"mlflow"``, ``"model:experts"``). An unchanged message keeps its
        ``since``; URIs in it are redacted (:func:`~mergestream.redaction.redact_uris`). Never
        raises (a store failure is logged)."""
        store = self._note_store()
        if store is None:
            return
        message = None if message is None else redact_uris(message)
        key = f"{NOTE_PREFIX}{source}:{subject}"
        try:
            old = store.get_meta(key)
            if message is None:
                if old is not None:
                    store.set_meta(key, None)
            elif not (isinstance(old, dict) and old.get("message") == message and old.get("level") == level):
                store.set_meta(key, {"source": source, "subject": subject, "level": level, "message": message,
                                     "since": time.time()})
        except Exception:
            log.warning("cannot store the status note %s", key, exc_info=True)

    def clear_notes(self, source: str) -> None:
        """Forget every note of ``source`` (its builder calls this: a new start describes itself
        afresh). Never raises."""
        store = self._note_store()
        if store is None:
            return
        try:
            for key in store.meta_items(f"{NOTE_PREFIX}{source}:"):
                store.set_meta(key, None)
        except Exception:
            log.warning("cannot clear the status notes of %s", source, exc_info=True)


#: Builds the sources one config section enables (none when it is disabled).
Builder = Callable[["Config", Emit, SourceContext], list[Source]]

#: Checks a registry key of a source's scheme when no such source runs (one-shot folds, or the
#: source was disabled while its experts were still queued): ``check(cfg, registry_key) -> bool``.
OfflineCheck = Callable[["Config", str], bool]


@dataclass(frozen=True)
class SourceKind:
    """One registry entry: how to build a kind of source from the config.

    Attributes:
        build: the builder (reads its own config section; returns ``[]`` when it is disabled).
        still_available: the check of its registry keys without a running source (None: keys of
            this kind never go stale).
    """

    build: Builder
    still_available: OfflineCheck | None = None
