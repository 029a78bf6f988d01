"""The policy state folder: what a sequence of folds carries, persisted next to the backbone.

Layout of a state folder::

    manifest.json                     policy, parameters, base, current backbone, one record per fold
    state-<gen>.safetensors           per-tensor policy state, keys "<tensor>::<field>" (float32/int; MDM-OC's
                                      unit directions in bfloat16 for 16-bit checkpoints)
    contrib/<id>-<gen>.safetensors    each fold's applied residual (for subtract-unmerge; see
                                      mergestream.engine.residuals)

A fold run by a remote executor writes each of these two as a pieces folder of the same name
(``part-NNNNN.safetensors``, one per task, :func:`mergestream.io.checkpoints.open_safetensors_file`),
so that no task's bytes pass through the driver; readers see the same keys and bytes.

Files are written under new names and the manifest is replaced atomically last (write to a
temporary file, fsync, ``os.replace``), so a crash leaves the previous manifest and files intact;
unreferenced files are garbage-collected at the next commit.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import StateError
from .checkpoints import Checkpoint, open_safetensors_file
from .st import fsync_dir, load_json, naming

MANIFEST = "manifest.json"
SEP = "::"


@dataclass
class FoldRecord:
    """One accepted fold as the state remembers it.

    Attributes:
        sha256: the expert's content hash; ``sha256_kind`` says which definition: ``"weights2"``
            (:func:`mergestream.io.expert_readers.content_sha256`, the one definition, weights hash
            version 2), ``"weights"`` (weights hash version 1: states written before 2026-12-06,
            still verified) or ``"files"`` (older states: the weight files' bytes).
        contribution: the residual file subtract-unmerge uses (:mod:`mergestream.engine.residuals`).
        exact_restore: the current backbone is still exactly this fold's output, so subtracting
            it restores the previous backbone byte for byte (cleared when an earlier fold is
            subtracted).
    """

    id: str
    expert: str
    sha256: str
    params: dict[str, Any]
    coefficient: float | None = None
    contribution: str | None = None
    time: float = field(default_factory=time.time)
    exact_restore: bool = False
    sha256_kind: str = "files"


@dataclass
class Manifest:
    """The state folder's manifest (JSON)."""

    policy: str | None = None
    base: str | None = None
    base_tensors: int | None = None
    backbone: str | None = None
    state_file: str | None = None
    folds: list[FoldRecord] = field(default_factory=list)
    format: int = 1

    def ids(self) -> list[str]:
        return [f.id for f in self.folds]

    def index_of(self, expert_id: str) -> int:
        """Position of ``expert_id`` in the fold order; raises StateError if it was never folded."""
        try:
            return self.ids().index(expert_id)
        except ValueError:
            raise StateError(f"expert {expert_id!r} is not in this state (folded: {', '.join(self.ids()) or 'none'})") from None

    def coefficients(self) -> list[float]:
        return [f.coefficient if f.coefficient is not None else 0.0 for f in self.folds]


class StateDir:
    """Read and atomically update a policy state folder (created on first commit)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.manifest = self._load()
        self._state: Checkpoint | None = None
        self._fields: dict[str, list[str]] | None = None

    def _load(self) -> Manifest:
        mpath = self.path / MANIFEST
        if not mpath.exists():
            return Manifest()
        try:
            raw = load_json(mpath.read_bytes(), str(mpath), error=ValueError)
            folds = [FoldRecord(**f) for f in raw.pop("folds", [])]
            return Manifest(**raw, folds=folds)
        except (ValueError, TypeError) as exc:
            raise StateError(f"{mpath}: unreadable state manifest ({exc})") from exc

    # -- per-tensor state -------------------------------------------------------------------
    def _open_state(self) -> None:
        if self._fields is not None:
            return
        self._fields = {}
        if self.manifest.state_file:
            p = self.path / self.manifest.state_file
            if not p.exists():
                raise StateError(f"{p}: state file named in the manifest is missing")
            self._state = open_safetensors_file(p)  # a file, or a remote fold's pieces folder
            for key in self._state.keys():
                tensor, _, fld = key.rpartition(SEP)
                self._fields.setdefault(tensor, []).append(fld)

    def tensor_state(self, name: str) -> dict[str, torch.Tensor]:
        """The stored state fields of one tensor (empty dict when none)."""
        self._open_state()
        assert self._fields is not None
        return {f: self._state.get(f"{name}{SEP}{f}") for f in self._fields.get(name, [])}

    def new_file(self, kind: str, expert_id: str | None = None) -> Path:
        """A fresh, unique path inside the folder for a state or contribution file."""
        gen = uuid.uuid4().hex[:10]
        if kind == "state":
            self.path.mkdir(parents=True, exist_ok=True)
            return self.path / f"state-{gen}.safetensors.tmp"
        (self.path / "contrib").mkdir(parents=True, exist_ok=True)
        return self.path / "contrib" / f"{expert_id}-{gen}.safetensors.tmp"

    def new_pieces(self, kind: str, expert_id: str | None = None) -> Path:
        """A fresh pieces folder (created) for a state or contribution written by a remote fold's tasks,
        one ``part-NNNNN.safetensors`` each (see the module docstring); committed like a file."""
        p = self.new_file(kind, expert_id)
        p.mkdir()
        return p
    def commit(self, manifest: Manifest, new_files: list[Path]) -> None:
        """Rename ``*.tmp`` files into place, replace the manifest atomically, collect garbage.

        ``manifest`` must reference the new files by their final names (without ``.tmp``).

        Raises:
            OSError: a full disk, a read-only or lost folder before the manifest was replaced: the
                state is as it was (``new_files`` are removed, under either name).
        """
        tmp = self.path / f".{MANIFEST}.{uuid.uuid4().hex[:8]}"
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            for f in new_files:
                os.replace(f, f.with_suffix(""))
            with naming(tmp), open(tmp, "w") as fh:
                json.dump(asdict(manifest), fh, indent=2)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path / MANIFEST)
        except BaseException:
            tmp.unlink(missing_ok=True)
            for f in new_files:
                remove_file(f)
                remove_file(f.with_suffix(""))
            raise
        fsync_dir(self.path)
        self.close()
        self.manifest = manifest
        self.collect_garbage()

    def set_backbone(self, backbone: str | os.PathLike) -> None:
        """Record that the backbone this state describes now lives at ``backbone`` (it was moved,
        e.g. a staged candidate published as a version); the manifest is replaced atomically."""
        if not (self.path / MANIFEST).exists():
            return
        manifest = self._load()
        manifest.backbone = str(Path(backbone).resolve())
        self.commit(manifest, [])

    def collect_garbage(self) -> None:
        """Delete state/contribution files the manifest does not reference (leftovers of crashes)."""
        keep = {self.manifest.state_file} | {f.contribution for f in self.manifest.folds}
        for p in list(self.path.glob("state-*.safetensors*")) + list(self.path.glob("contrib/*")):
            rel = str(p.relative_to(self.path))
            if rel not in keep:
                remove_file(p)

    def close(self) -> None:
        if self._state is not None:
            self._state.close()
        self._state, self._fields = None, None


def remove_file(p: Path) -> None:
    """Remove a state or contribution file, or a pieces folder; nothing if it is gone."""
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def final_name(p: Path, root: Path) -> str:
    """Relative name of a ``*.tmp`` file once committed."""
    return str(p.with_suffix("").relative_to(root))
