"""The version layout of a daemon's state folder, read-only: numbers, paths, ``current``, fold.json.

Layout under the state folder (written by :class:`mergestream.daemon.store.Store`, read here)::

    versions/000001/model/        the backbone (sharded safetensors + the base's config/tokenizer)
    versions/000001/state/        the policy state after this version (mergestream.io.state layout)
    versions/000001/fold.json     what produced it: expert, policy, parameters, probes, decision
    versions/000002/patch-from-000001.safetensors   the version patch, when the daemon writes one
    current -> versions/000001    symlink, switched with rename(2) + fsync of the folder

The same layout in object storage (the publish mirror, :mod:`mergestream.daemon.mirror`, and an
``s3://`` fold output, :mod:`mergestream.io.s3_output`) has no symlink: ``current`` is an object
holding :func:`pointer_body`.

Standard library only: the daemon's store writes this layout, and the feed builder
(:mod:`mergestream.feed.build`), ``mergestream status`` and ``mergestream patch`` read it without
importing the daemon.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .st import load_json


#: the pointer's name under a root, a symlink in a folder and a JSON object in a bucket
POINTER = "current"


def version_prefix(number: int) -> str:
    """The key prefix (or relative folder, with ``/``) of version ``number``: ``versions/000003/``."""
    return f"versions/{number:06d}/"


def pointer_body(number: int, files: dict[str, int]) -> bytes:
    """The content of the ``current`` object in a bucket: JSON ``{"version", "prefix", "files":
    {rel: bytes}}``, each ``rel`` relative to the version's prefix."""
    return json.dumps({"version": number, "prefix": version_prefix(number), "files": files}, indent=1).encode()


class Versions:
    """The published versions under ``state_dir`` (nothing is created or changed).

    Args:
        state_dir: the daemon's state folder (need not exist: then there are no versions).
    """

    def __init__(self, state_dir: str | os.PathLike):
        self.root = Path(state_dir)
        self.versions_dir = self.root / "versions"
        self.current_link = self.root / "current"

    def numbers(self) -> list[int]:
        """The kept version numbers, ascending (``[]`` before the first publish)."""
        if not self.versions_dir.exists():
            return []
        return sorted(int(p.name) for p in self.versions_dir.iterdir() if p.name.isdigit())

    def path(self, number: int) -> Path:
        """``versions/NNNNNN``: the folder of version ``number`` (whether or not it exists)."""
        return self.versions_dir / f"{number:06d}"

    def current(self) -> int | None:
        """The current version number, or None before the first publish."""
        if not self.current_link.is_symlink():
            return None
        return int(Path(os.readlink(self.current_link)).name)

    def current_path(self) -> Path | None:
        """The folder ``current`` points at, or None before the first publish."""
        n = self.current()
        return None if n is None else self.path(n)

    def fold_json(self, number: int) -> dict[str, Any]:
        """What produced version ``number`` (its ``fold.json``); ``{}`` when it has none.

        Raises:
            ValueError: the file is not valid JSON.
        """
        p = self.path(number) / "fold.json"
        return load_json(p.read_bytes(), str(p), error=ValueError) if p.exists() else {}
