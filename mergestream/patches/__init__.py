"""Apply weight patches ("version N−1 -> version N") exactly; standalone (stdlib + numpy only).

The device side of incremental updates: no torch; from mergestream only the standard-library
:mod:`mergestream.io.st` (the two can be copied onto a device next to ``numpy``). It moves raw bytes,
so every dtype works the same way (``BF16``, ``F8_*``): tensors are compared and patched as unsigned
integers of their itemsize, bit-exact (``-0.0`` differs from ``0.0``, NaN payloads count).

Weights hash (:func:`weights_sha256`)
    The project's one content hash of a model, defined in :mod:`mergestream.io.st` (versions 2 and 1).

Patch file (a safetensors file, format ``mergestream-patch/1`` or ``/2``)
    Tensors, for each target tensor that differs from the source (omitted when bit-identical):

    * ``dense/<name>``: the new tensor, in the target's dtype and shape (changed dtype or shape,
      added tensor, or a change where sparse is not smaller);
    * ``sparse.indices/<name>`` (``I32`` when numel ≤ 2³¹, else ``I64``; 1-D, ascending flat
      C-order indices) and ``sparse.values/<name>`` (target dtype, 1-D): used when
      ``nnz·(index bytes + itemsize) < nbytes``;
    * format 2 adds ``sparse.mask/<name>`` (a changed-entry bitmask, paired with
      ``sparse.values/<name>``) and ``zstd/<payload>`` (any payload above, Zstandard-compressed;
      metadata ``compressed`` gives its uncompressed dtype and shape): see :mod:`mergestream.patches.codec`.

    ``__metadata__`` (strings): ``patch_format``, ``source_version``, ``target_version``,
    ``source_sha256``, ``target_sha256`` (weights hashes; ``weights_hash``: their version, absent =
    1), ``policy``, ``payload_bytes`` (tensor bytes in the patch), ``model_bytes`` (the target's),
    ``removed`` (JSON list of source tensors absent from the target), ``target_layout`` (JSON:
    ``{"files": [{"name": file name, "header": the target file's verbatim safetensors header}],
    "index": {"name": ..., "text": verbatim index JSON} or null}``), ``stats`` (JSON counts), and
    ``target_card`` (optional: the target folder's ``README.md``, its model card, verbatim), and
    ``payload_sha256``: sha256 over the data region (every byte after the header) followed by
    the canonical JSON (``sort_keys``, compact separators, ASCII) of the parsed header without
    the ``payload_sha256`` key. Any flipped byte in the data or in the header's content, and any
    truncation, is detected before anything is written.

Output of :func:`apply_patch`
    The target's weight files with their verbatim headers (same names, shards, ``__metadata__``)
    and index: byte for byte the target version's files. Its model card (``README.md``) is the
    target's ``target_card`` (else the source's); other non-weight files are the source folder's.
    Staged in a sibling temporary folder and renamed into place; removed on any failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..io.paths import confined, relative_name
from ..io.st import (
    CARD_NAME,
    DTYPE_SIZES,
    FormatError,
    Header,
    TensorEntry,
    copy_aux_files,
    fsync_dir,
    load_json,
    naming,
    parse_header_text,
    parse_index,
    pwrite_all,
    read_header,
    WeightsHash,
    read_into,
    u64le,
    weights_hash_version,
)
from .codec import MASK, PatchFormat, decode_mask, decompress, logical_entries

INDEX_SUFFIX = ".safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: Files never copied as "non-weight files" of a model folder.

DENSE = "dense/"
SPARSE_INDICES = "sparse.indices/"
SPARSE_VALUES = "sparse.values/"

_RAW = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
_INDEX_DTYPES = {"I32": np.dtype("<i4"), "I64": np.dtype("<i8")}
_CHUNK = 16 * 1024 * 1024


#: A patch cannot be applied: corrupted, truncated, not a patch, made for another source model, or
#: the result does not match the recorded target. Nothing is written when raised. It is the format
#: error of :mod:`mergestream.io.st` (a malformed safetensors file is one of its causes).
PatchError = FormatError


def raw_dtype(dtype: str) -> np.dtype:
    """Unsigned little-endian integer numpy dtype of the same itemsize as safetensors ``dtype``.

    Raises:
        PatchError: unsupported dtype.
    """
    try:
        return _RAW[DTYPE_SIZES[dtype]]
    except KeyError:
        raise PatchError(f"unsupported safetensors dtype {dtype!r}") from None


# ------------------------------------------------------------------------------------------
# Reading safetensors files without a framework
# ------------------------------------------------------------------------------------------
class Weights:
    """The tensors of a model folder (or a single ``.safetensors`` file), read as raw bytes.

    Folder resolution: ``*.safetensors.index.json`` with its shards, else ``model.safetensors``,
    else the only ``*.safetensors`` file. Only headers are read at construction.

    Attributes:
        path: what was given. files: weight files, in name order. index: the index file or None.
        entries: ``{name: TensorEntry}`` in file order. headers: ``{file: Header}``.

    Raises:
        PatchError: nothing loadable, a missing shard, a shard named outside the folder
        (:func:`mergestream.io.paths.confined`), a malformed/truncated file, a tensor in two
        shards, or an index that disagrees with the shards.
    """

    def __init__(self, path: str | os.PathLike):
        p = Path(path)
        self.path = p
        self.index: Path | None = None
        weight_map: dict[str, str] | None = None
        if p.is_file():
            files = [p]
        elif p.is_dir():
            indexes = sorted(p.glob("*" + INDEX_SUFFIX))
            if len(indexes) > 1:
                raise PatchError(f"{p}: several index files ({', '.join(i.name for i in indexes)})")
            if indexes:
                self.index = indexes[0]
                shards = sorted(set(parse_index(self.index.read_bytes(), str(self.index)).values()))
                files = [confined(p, s, f"shard named in {self.index.name}", error=PatchError) for s in shards]
                missing = [s for s, f in zip(shards, files) if not f.is_file()]
                if missing:
                    raise PatchError(f"{p}: shard(s) named in {self.index.name} are absent: {', '.join(missing)}")
            elif (p / SINGLE_NAME).is_file():
                files = [p / SINGLE_NAME]
            else:
                singles = sorted(p.glob("*.safetensors"))
                if len(singles) != 1:
                    raise PatchError(f"{p}: no {SINGLE_NAME}, no *{INDEX_SUFFIX} and not exactly one *.safetensors")
                files = singles
        else:
            raise PatchError(f"{p}: no such file or folder")
        self.files: list[Path] = sorted(files, key=lambda f: f.name)
        self.headers: dict[Path, Header] = {}
        self.entries: dict[str, TensorEntry] = {}
        for f in self.files:
            hdr = read_header(f)
            self.headers[f] = hdr
            for e in hdr.entries:
                if e.name in self.entries:
                    raise PatchError(f"{p}: tensor {e.name!r} is in both {self.entries[e.name].file.name} and {f.name}")
                self.entries[e.name] = e
        if weight_map is not None:
            for name, shard in weight_map.items():
                e = self.entries.get(name)
                if e is None or e.file.name != shard:
                    raise PatchError(f"{self.index}: names tensor {name!r} in {shard}, but that shard does not hold it")
        self._handles: dict[Path, Any] = {}

    def names(self) -> list[str]:
        """Tensor names in canonical (sorted UTF-8) order."""
        return sorted(self.entries, key=lambda n: n.encode("utf-8"))

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data."""
        return sum(e.nbytes for e in self.entries.values())

    @property
    def file_bytes(self) -> int:
        """Bytes of the weight files (headers and data; the index excluded)."""
        return sum(f.stat().st_size for f in self.files)

    def _fh(self, f: Path):
        h = self._handles.get(f)
        if h is None:
            h = self._handles[f] = open(f, "rb")
        return h

    def read(self, name: str) -> np.ndarray:
        """One tensor's raw bytes in fresh, writable memory: 1-D ``uint8`` of length nbytes."""
        e = self.entries[name]
        buf = np.empty(e.nbytes, np.uint8)
        read_into(self._fh(e.file), e.offset, memoryview(buf))
        return buf

    def read_raw(self, name: str) -> np.ndarray:
        """One tensor as a flat array of unsigned integers of its itemsize (bit-exact view)."""
        return self.read(name).view(raw_dtype(self.entries[name].dtype))

    def chunks(self, name: str, size: int = _CHUNK) -> Iterator[memoryview]:
        """One tensor's raw bytes in chunks of at most ``size`` bytes (a reused buffer)."""
        e = self.entries[name]
        buf = memoryview(bytearray(min(size, e.nbytes)))
        fh = self._fh(e.file)
        for off in range(0, e.nbytes, size):
            n = min(size, e.nbytes - off)
            read_into(fh, e.offset + off, buf[:n])
            yield buf[:n]

    def sha256(self, version: int = 2) -> str:
        """The weights hash of this model, ``version`` 2 (or 1: older records); streams in chunks."""
        h = WeightsHash(len(self.entries), version)
        for name in self.names():
            h.begin(self.entries[name])
            for chunk in self.chunks(name):
                h.data(chunk)
        return h.hexdigest()

    def close(self) -> None:
        """Close the open file handles."""
        for h in self._handles.values():
            h.close()
        self._handles.clear()

    def __enter__(self) -> Weights:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def weights_sha256(model_dir: str | os.PathLike, version: int = 2) -> str:
    """The weights hash of a model folder or ``.safetensors`` file (64 hex characters; ``version`` 1
    for records written before version 2, :mod:`mergestream.io.st`), read 16 MiB at a time.

    Raises:
        PatchError: the model cannot be read.
    """
    with Weights(model_dir) as w:
        return w.sha256(version)


def weights_match(model_dir: str | os.PathLike, sha: str) -> bool:
    """Whether a model's weights hash is ``sha``: version 2, else version 1 (a record written before
    it; a second read only then). Raises PatchError as :func:`weights_sha256`."""
    with Weights(model_dir) as w:
        return w.sha256() == sha or w.sha256(1) == sha


def canonical_header(obj: dict[str, Any]) -> bytes:
    """The bytes the payload hash covers after the data: the header without ``payload_sha256``."""
    obj = dict(obj)
    meta = dict(obj.get("__metadata__") or {})
    meta.pop("payload_sha256", None)
    obj["__metadata__"] = meta
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _safe_name(name: Any, what: str) -> str:
    """``name`` when it is a plain file name in the output folder: the confinement rules of
    :func:`mergestream.io.paths.relative_name`, and flat (no ``/``, no leading ``.``).

    Raises:
        PatchError: any other name.
    """
    relative_name(name, f"patch names a {what} file", error=PatchError)
    if name in (".", "..") or "/" in name or name.startswith("."):
        raise PatchError(f"patch names an unsafe {what} file name {name!r}")
    return name


# ------------------------------------------------------------------------------------------
# Patches
# ------------------------------------------------------------------------------------------
@dataclass
class TargetFile:
    """One weight file of the target model, rebuilt from its verbatim header."""

    name: str
    header: Header


@dataclass
class Patch:
    """A verified patch: what it holds and what it was made for.

    Attributes:
        path: the patch file. metadata: its ``__metadata__``.
        source_sha256 / target_sha256: weights hashes. source_version / target_version / policy:
        strings as recorded. removed: source tensors absent from the target.
        files: the target's weight files (verbatim headers). index: ``(name, text)`` or None.
        target: ``{name: TensorEntry}`` of the target (``file`` is the target file's name).
        dense: ``{name: patch TensorEntry}``. sparse: ``{name: (indices entry, values entry)}``.
        masked: ``{name: (bitmask entry, values entry)}`` (format 2). compressed: ``{payload name:
        stored zstd entry}`` (format 2; the payload's own entry has its uncompressed dtype/shape).
        payload_bytes: bytes of tensor data in the patch. model_bytes: bytes of the target's
        weight files.
    """

    path: Path
    metadata: dict[str, str]
    source_sha256: str
    target_sha256: str
    source_version: str
    target_version: str
    policy: str
    removed: list[str]
    files: list[TargetFile]
    index: tuple[str, str] | None
    target: dict[str, TensorEntry]
    dense: dict[str, TensorEntry]
    sparse: dict[str, tuple[TensorEntry, TensorEntry]]
    payload_bytes: int
    model_bytes: int
    masked: dict[str, tuple[TensorEntry, TensorEntry]]
    compressed: dict[str, TensorEntry]

    def payload(self, pw: Weights, entry: TensorEntry) -> np.ndarray:
        """A payload's raw bytes (``uint8``, writable), decompressed when stored compressed."""
        stored = self.compressed.get(entry.name)
        if stored is None:
            return pw.read(entry.name)
        return decompress(pw.read(stored.name), entry.nbytes, f"patch {self.path}: {entry.name}")

    def summary(self) -> dict[str, Any]:
        """JSON-friendly description (versions, hashes, counts, byte sizes)."""
        return {"patch": str(self.path), "format": self.metadata.get("patch_format"),
                "source_version": self.source_version, "target_version": self.target_version,
                "source_sha256": self.source_sha256, "target_sha256": self.target_sha256,
                "policy": self.policy, "payload_bytes": self.payload_bytes, "model_bytes": self.model_bytes,
                "tensors_dense": len(self.dense), "tensors_sparse": len(self.sparse) + len(self.masked),
                "tensors_removed": len(self.removed), "target_tensors": len(self.target)}


def _meta_json(meta: dict[str, str], key: str, where: str) -> Any:
    if key not in meta:
        raise PatchError(f"{where}: metadata {key!r} is missing")
    return load_json(meta[key], f"{where}: metadata {key!r}", error=PatchError, expect=None)


def read_patch(patch_path: str | os.PathLike) -> Patch:
    """Open a patch and verify its integrity (payload sha256 over data and header) and structure.

    Reads the whole patch once (in chunks) to hash it; nothing is written.

    Raises:
        PatchError: not a safetensors file, truncated, not a mergestream patch or an unknown
        format version, corrupted (payload sha256 mismatch), or inconsistent (an entry for a
        tensor the target does not have, a dtype/shape that does not match the target, ...).
    """
    path = Path(patch_path)
    where = f"patch {path}"
    if not path.is_file():
        raise PatchError(f"{where}: no such file")
    hdr = read_header(path)
    meta = hdr.metadata
    fmt = PatchFormat.of_tag(meta.get("patch_format"))
    if fmt is None:
        raise PatchError(f"{where}: not a mergestream patch (patch_format {meta.get('patch_format')!r}, expected "
                         + " or ".join(repr(f.tag) for f in PatchFormat) + ")")
    for key in ("source_sha256", "target_sha256", "payload_sha256", "payload_bytes"):
        if key not in meta:
            raise PatchError(f"{where}: metadata {key!r} is missing")
    if meta["payload_bytes"] != str(hdr.data_len):
        raise PatchError(f"{where}: truncated or padded: {hdr.data_len} payload bytes, metadata records "
                         f"{meta['payload_bytes']}")
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        fh.seek(hdr.data_start)
        left = hdr.data_len
        while left:
            chunk = fh.read(min(_CHUNK, left))
            if not chunk:
                raise PatchError(f"{where}: truncated while hashing")
            h.update(chunk)
            left -= len(chunk)
    h.update(canonical_header(hdr.obj))
    if h.hexdigest() != meta["payload_sha256"]:
        raise PatchError(f"{where}: corrupted: payload sha256 is {h.hexdigest()}, the patch records "
                         f"{meta['payload_sha256']}")

    layout = _meta_json(meta, "target_layout", where)
    removed = _meta_json(meta, "removed", where)
    if not isinstance(layout, dict) or not isinstance(layout.get("files"), list) or not layout["files"] \
            or not isinstance(removed, list) or not all(isinstance(r, str) for r in removed):
        raise PatchError(f"{where}: malformed target_layout or removed list")
    files: list[TargetFile] = []
    target: dict[str, TensorEntry] = {}
    for item in layout["files"]:
        if not isinstance(item, dict) or not isinstance(item.get("header"), str):
            raise PatchError(f"{where}: malformed target_layout entry")
        name = _safe_name(item.get("name"), "target weight")
        if not name.endswith(".safetensors") or any(f.name == name for f in files):
            raise PatchError(f"{where}: bad or duplicate target weight file name {name!r}")
        th = parse_header_text(item["header"], Path(name), f"{where}: target file {name}")
        files.append(TargetFile(name, th))
        for e in th.entries:
            if e.name in target:
                raise PatchError(f"{where}: target tensor {e.name!r} is in two files")
            target[e.name] = e
    index = None
    if layout.get("index") is not None:
        idx = layout["index"]
        if not isinstance(idx, dict) or not isinstance(idx.get("text"), str):
            raise PatchError(f"{where}: malformed target index entry")
        iname = _safe_name(idx.get("name"), "index")
        if not iname.endswith(".index.json"):
            raise PatchError(f"{where}: bad target index file name {iname!r}")
        index = (iname, idx["text"])
    removed_set = set(removed)
    if removed_set & set(target):
        both = sorted(removed_set & set(target))[:3]
        raise PatchError(f"{where}: tensor(s) listed as removed are in the target: {both}")

    dense: dict[str, TensorEntry] = {}
    indices: dict[str, TensorEntry] = {}
    values: dict[str, TensorEntry] = {}
    masks: dict[str, TensorEntry] = {}
    entries, compressed = logical_entries(hdr, fmt is PatchFormat.INDEX_LISTS, where)
    for e in entries:
        for prefix, bucket in ((DENSE, dense), (SPARSE_INDICES, indices), (SPARSE_VALUES, values), (MASK, masks)):
            if e.name.startswith(prefix):
                bucket[e.name[len(prefix):]] = e
                break
        else:
            raise PatchError(f"{where}: unexpected tensor {e.name!r}")
    for name, e in dense.items():
        t = target.get(name)
        if t is None or (e.dtype, e.shape) != (t.dtype, t.shape):
            raise PatchError(f"{where}: dense entry {name!r} does not match the target tensor")
    if set(indices) | set(masks) != set(values) or set(indices) & set(masks):
        raise PatchError(f"{where}: sparse indices or bitmasks and values do not pair up: "
                         f"{sorted((set(indices) | set(masks)) ^ set(values))[:3]}")
    masked: dict[str, tuple[TensorEntry, TensorEntry]] = {}
    for name, m in masks.items():
        v, t = values[name], target.get(name)
        if t is None or name in dense or m.dtype != "U8" or len(v.shape) != 1 or v.dtype != t.dtype:
            raise PatchError(f"{where}: bitmask entry {name!r} does not match the target tensor")
        masked[name] = (m, v)
    sparse: dict[str, tuple[TensorEntry, TensorEntry]] = {}
    for name in indices:
        i, v, t = indices[name], values[name], target.get(name)
        if t is None or name in dense:
            raise PatchError(f"{where}: sparse entry {name!r} is not a target tensor or is also dense")
        if i.dtype not in _INDEX_DTYPES or len(i.shape) != 1 or v.shape != i.shape or v.dtype != t.dtype:
            raise PatchError(f"{where}: sparse entry {name!r} has indices {i.dtype} {list(i.shape)} and values "
                             f"{v.dtype} {list(v.shape)} for a {t.dtype} tensor")
        sparse[name] = (i, v)
    try:
        payload_bytes, model_bytes = int(meta["payload_bytes"]), int(meta.get("model_bytes", "0"))
    except ValueError:
        raise PatchError(f"{where}: malformed byte counts in metadata") from None
    return Patch(path=path, metadata=meta, source_sha256=meta["source_sha256"], target_sha256=meta["target_sha256"],
                 source_version=meta.get("source_version", ""), target_version=meta.get("target_version", ""),
                 policy=meta.get("policy", ""), removed=list(removed), files=files, index=index, target=target,
                 dense=dense, sparse=sparse, payload_bytes=payload_bytes, model_bytes=model_bytes, masked=masked,
                 compressed=compressed)



def _plan(patch: Patch, src: Weights) -> None:
    """Check before writing that every target tensor can be produced from the source + patch."""
    for name, t in patch.target.items():
        if name in patch.dense:
            continue
        s = src.entries.get(name)
        if s is None or (s.dtype, s.shape) != (t.dtype, t.shape):
            got = "absent" if s is None else f"{s.dtype} {list(s.shape)}"
            raise PatchError(f"tensor {name!r}: the patch needs the source's {t.dtype} {list(t.shape)}, "
                             f"the model has {got}")
    extra = sorted(set(src.entries) - set(patch.target) - set(patch.removed))
    if extra:
        raise PatchError(f"tensor {extra[0]!r} of the model is neither in the patch's target nor listed as removed")


def _apply_sparse(buf: np.ndarray, dtype: str, patch: Patch, patch_w: Weights, idx_e: TensorEntry,
                  val_e: TensorEntry, name: str) -> None:
    raw = buf.view(raw_dtype(dtype))
    if idx_e.name.startswith(MASK):
        changed = decode_mask(patch.payload(patch_w, idx_e), raw.size, f"tensor {name!r}")
        vals = patch.payload(patch_w, val_e).view(raw.dtype)
        if int(np.count_nonzero(changed)) != vals.size:
            raise PatchError(f"tensor {name!r}: bitmask marks {int(np.count_nonzero(changed))} entries, "
                             f"{vals.size} values follow")
        raw[changed] = vals
        return
    idx = patch.payload(patch_w, idx_e).view(_INDEX_DTYPES[idx_e.dtype])
    if idx.size:
        if int(idx.min()) < 0 or int(idx.max()) >= raw.size:
            raise PatchError(f"tensor {name!r}: sparse index out of range for {raw.size} elements")
        raw[idx] = patch.payload(patch_w, val_e).view(raw.dtype)


def apply_patch(model_dir: str | os.PathLike, patch_path: str | os.PathLike,
                out_dir: str | os.PathLike) -> dict[str, Any]:
    """Apply a patch to a model and write the target model atomically into ``out_dir``.

    Order: verify the patch (integrity and structure), hash the source weights and compare with
    the patch's source hash, check every target tensor can be produced, then write the target's
    weight files (verbatim headers, one tensor at a time, in canonical order, hashing the bytes
    as they are written), its index, and the source folder's non-weight files into a sibling
    staging folder; compare the target hash, then rename the staging folder to ``out_dir``.

    Args:
        model_dir: the source model (folder or ``.safetensors`` file), e.g. version N−1.
        patch_path: a patch file written by :func:`mergestream.patches.build.build_patch`.
        out_dir: the output folder; must not exist.

    Returns:
        ``{"out", "source_version", "target_version", "source_sha256", "target_sha256",
        "tensors", "tensors_copied", "tensors_sparse", "tensors_dense", "tensors_removed",
        "bytes_written", "files"}`` (bytes_written: tensor data bytes).

    Raises:
        PatchError: ``out_dir`` exists; the patch is corrupted, truncated or malformed; it was made
        for another source ("patch is for source sha256 X, this model has Y"); the result does not
        hash to the recorded target. Nothing is left in ``out_dir``'s parent in every case.
        OSError: a write failed (disk full...); the staging folder is removed.
    """
    out = Path(out_dir)
    if out.exists() or out.is_symlink():
        raise PatchError(f"{out} already exists; choose a new output path")
    patch = read_patch(patch_path)
    with Weights(model_dir) as src, Weights(patch.path) as pw:
        version = weights_hash_version(patch.metadata.get("weights_hash", "weights"))
        if version is None:
            raise PatchError(f"{patch.path}: unknown weights_hash {patch.metadata.get('weights_hash')!r}")
        have = src.sha256(version)
        if have != patch.source_sha256:
            raise PatchError(
                f"patch is for source sha256 {patch.source_sha256} (version {patch.source_version or '?'}), "
                f"this model has {have}: apply the patch to the version it was built from")
        _plan(patch, src)
        out.parent.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.staging-", dir=out.parent))
        fds: dict[str, int] = {}
        try:
            for tf in patch.files:
                fd = os.open(stage / tf.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                fds[tf.name] = fd
                raw = tf.header.text.encode("utf-8")
                with naming(stage / tf.name):
                    pwrite_all(fd, memoryview(u64le(len(raw)) + raw), 0)
                    os.ftruncate(fd, tf.header.data_start + tf.header.data_len)
            h = WeightsHash(len(patch.target), version)
            counts = {"copied": 0, "sparse": 0, "dense": 0}
            written = 0
            for name in sorted(patch.target, key=lambda n: n.encode("utf-8")):
                t = patch.target[name]
                if name in patch.dense:
                    buf = patch.payload(pw, patch.dense[name])
                    counts["dense"] += 1
                else:
                    buf = src.read(name)
                    pair = patch.sparse.get(name) or patch.masked.get(name)
                    if pair is not None:
                        _apply_sparse(buf, t.dtype, patch, pw, *pair, name)
                        counts["sparse"] += 1
                    else:
                        counts["copied"] += 1
                h.begin(t)
                data = memoryview(buf)
                h.data(data)
                with naming(stage / t.file.name):
                    pwrite_all(fds[t.file.name], data, t.offset)
                written += t.nbytes
                del buf, data
            for name, fd in list(fds.items()):
                with naming(stage / name):
                    os.fsync(fd)
                os.close(fd)
                del fds[name]
            got = h.hexdigest()
            if got != patch.target_sha256:
                raise PatchError(f"the patched model hashes to {got}, the patch records target sha256 "
                                 f"{patch.target_sha256}: refusing to publish it")
            if patch.index is not None:
                (stage / patch.index[0]).write_text(patch.index[1])
            taken = {tf.name for tf in patch.files} | ({patch.index[0]} if patch.index else set())
            card = patch.metadata.get("target_card")
            if isinstance(card, str):  # the target version's own model card, not the source's
                (stage / CARD_NAME).write_text(card, encoding="utf-8")
                taken.add(CARD_NAME)
            copy_aux_files(src.path, stage, skip=frozenset(taken))
            fsync_dir(stage)
            os.rename(stage, out)
            fsync_dir(out.parent)
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            shutil.rmtree(stage, ignore_errors=True)
            raise
    return {"out": str(out), "source_version": patch.source_version, "target_version": patch.target_version,
            "source_sha256": patch.source_sha256, "target_sha256": got, "tensors": len(patch.target),
            "tensors_copied": counts["copied"], "tensors_sparse": counts["sparse"], "tensors_dense": counts["dense"],
            "tensors_removed": len(patch.removed), "bytes_written": written,
            "files": [tf.name for tf in patch.files]}
