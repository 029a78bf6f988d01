"""Where the notes sources leave for ``mergestream status`` are kept, readable without the sources.

A source that cannot do its job as configured says so through
:meth:`mergestream.daemon.sources.base.SourceContext.note`; the note is a JSON value in the ledger's
meta table under ``source_note:<source>:<subject>``. This module (standard library only) is the
one home of that key layout, so that ``status`` reads the notes without importing the sources
(which import the checkpoint readers and torch).
"""

from __future__ import annotations

from typing import Any

#: Prefix of the ledger meta keys that hold source notes: ``source_note:<source>:<subject>``.
NOTE_PREFIX = "source_note:"


def source_notes(store: Any) -> list[dict[str, Any]]:
    """The notes sources left (see :meth:`~mergestream.daemon.sources.base.SourceContext.note`),
    sorted by source and subject: dicts with ``source``, ``subject``, ``level`` (``error`` |
    ``warning``), ``message`` and ``since`` (Unix time, seconds).

    Args:
        store: a :class:`~mergestream.daemon.sources.base.NoteStore` (the ledger).
    """
    return [v for _, v in sorted(store.meta_items(NOTE_PREFIX).items()) if isinstance(v, dict)]
