"""The device agent (``mergestream-agent``): pull signed updates from a feed, install them A/B.

Installable without torch: it imports only the standard library, numpy (via
:mod:`mergestream.patches`), python-tuf's client (``tuf.ngclient``, with urllib3 and
securesystemslib), click, and from mergestream only torch-free modules (:mod:`mergestream.io.st`,
:mod:`mergestream.patches`, :mod:`mergestream.feed` (the fleet contract: :mod:`~mergestream.feed.layout`,
:mod:`~mergestream.feed.plan`), :mod:`mergestream.errors`).

Modules: :mod:`.fetch` (resumable, verified downloads),
:mod:`.slots` (A/B slots, pointers, status, lock), :mod:`.pull` (one pull, one rollback),
:mod:`.cli` (the command line). Device layout, under ``--model-dir``::

    current -> slots/a      what the device runs (symlink, switched with rename(2))
    previous -> slots/b     the slot before; ``mergestream-agent rollback`` switches back to it
    slots/a  slots/a.json   a model folder and what it holds (version, weights hash), written
                            once the folder is complete and verified
    status.json             the last pull's outcome, for the device's own monitoring
    .agent/                 trusted-root.json, TUF metadata cache, downloads (resumable), lock
"""
