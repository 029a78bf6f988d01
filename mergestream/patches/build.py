"""Build weight patches between two model versions (the daemon / server side).

:func:`build_patch` compares two models tensor by tensor on raw bytes (bit-exact, every dtype,
bf16 included) and writes the smallest exact encoding of "source -> target" per tensor: unchanged
tensors omitted, a sparse change as ascending flat indices (``I32``/``I64``) + new values in the
tensor's own dtype, a dense change (or an added tensor, or a changed dtype/shape) as the new
tensor; removed tensors are listed in the metadata. The file format, the weights hash and the
apply side are in :mod:`mergestream.patches` (standalone, numpy only), which this module reuses
so both sides share one reader and one definition of the hashes.

Memory: the source and target tensors being compared (two tensors) plus comparison temporaries
bounded by a chunk of 4 Mi elements; tensor data of the patch goes to a spool file next to the
output, which is then written after the header to a temporary file renamed into place.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ..errors import MergestreamError, OutputExistsError
from ..io.st import TensorEntry, WeightsHash, encode_header, fsync_dir, naming, weights_hash_kind
from . import (
    CARD_NAME,
    DENSE,
    SPARSE_INDICES,
    SPARSE_VALUES,
    PatchError,
    PatchFormat,
    Weights,
    canonical_header,
)
from .codec import MASK, ZSTD, compress, encode_mask, mask_bytes

log = logging.getLogger(__name__)

_CMP_CHUNK = 4 * 1024 * 1024  # elements per comparison chunk
_I32_LIMIT = 2**31  # flat indices up to numel − 1 fit in int32 when numel ≤ 2³¹


class PatchBuildError(MergestreamError):
    """A patch cannot be built (unreadable source or target model)."""


def _changed_mask_chunks(a: np.ndarray, b: np.ndarray):
    """Yield (start, boolean mask of a[start:start+chunk] != b[...]) over flat raw views."""
    for start in range(0, a.size, _CMP_CHUNK):
        yield start, a[start:start + _CMP_CHUNK] != b[start:start + _CMP_CHUNK]


class _Spool:
    """Append tensor data to a spool file, hashing it, and record safetensors header entries."""

    def __init__(self, fh: BinaryIO):
        self.fh = fh
        self.hash = hashlib.sha256()
        self.entries: dict[str, dict[str, Any]] = {}
        self.compressed: dict[str, list] = {}
        self.offset = 0

    def put(self, name: str, dtype: str, shape: list[int], data: np.ndarray, zstd_level: int | None) -> None:
        """Spool one whole payload; with ``zstd_level``, as ``zstd/<name>`` when that is smaller
        (its dtype/shape recorded in ``self.compressed``)."""
        raw = memoryview(np.ascontiguousarray(data)).cast("B")
        if zstd_level is not None:
            packed = compress(raw, zstd_level)
            if len(packed) < len(raw):
                self.compressed[name] = [dtype, shape]
                self.begin(ZSTD + name, "U8", [len(packed)])
                self.write(ZSTD + name, np.frombuffer(packed, np.uint8))
                return
        self.begin(name, dtype, shape)
        self.write(name, data)

    def begin(self, name: str, dtype: str, shape: list[int]) -> None:
        self.entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [self.offset, self.offset]}

    def write(self, name: str, data: np.ndarray) -> None:
        mv = memoryview(np.ascontiguousarray(data)).cast("B")
        self.fh.write(mv)
        self.hash.update(mv)
        self.offset += len(mv)
        self.entries[name]["data_offsets"][1] = self.offset


def _encode_tensor(spool: _Spool, name: str, s: np.ndarray, d: np.ndarray, e: TensorEntry) -> str:
    """Compare raw views ``s`` (source) and ``d`` (target) of one tensor; spool its entry.

    Returns ``"unchanged"``, ``"sparse"`` or ``"dense"``.
    """
    nnz = sum(int(np.count_nonzero(m)) for _, m in _changed_mask_chunks(s, d))
    if nnz == 0:
        return "unchanged"
    itemsize = d.dtype.itemsize
    idx_code, idx_dtype = ("I32", np.dtype("<i4")) if d.size <= _I32_LIMIT else ("I64", np.dtype("<i8"))
    if nnz * (idx_dtype.itemsize + itemsize) >= e.nbytes:
        spool.begin(DENSE + name, e.dtype, list(e.shape))
        spool.write(DENSE + name, d)
        return "dense"
    spool.begin(SPARSE_INDICES + name, idx_code, [nnz])
    for start, m in _changed_mask_chunks(s, d):
        spool.write(SPARSE_INDICES + name, (np.flatnonzero(m) + start).astype(idx_dtype))
    spool.begin(SPARSE_VALUES + name, e.dtype, [nnz])
    for start, m in _changed_mask_chunks(s, d):
        spool.write(SPARSE_VALUES + name, d[start:start + _CMP_CHUNK][m])
    return "sparse"


def _encode_tensor_v2(spool: _Spool, name: str, s: np.ndarray, d: np.ndarray, e: TensorEntry,
                      zstd_level: int | None) -> str:
    """Format 2: the smallest of index list, bitmask and dense for one changed tensor (each payload
    optionally zstd-compressed). Returns ``"unchanged"``, ``"sparse"`` or ``"dense"``."""
    changed = np.concatenate([m for _, m in _changed_mask_chunks(s, d)]) if d.size else np.zeros(0, bool)
    nnz = int(np.count_nonzero(changed))
    if nnz == 0:
        return "unchanged"
    itemsize = d.dtype.itemsize
    idx_code, idx_dtype = ("I32", np.dtype("<i4")) if d.size <= _I32_LIMIT else ("I64", np.dtype("<i8"))
    costs = {"dense": e.nbytes, "indices": nnz * (idx_dtype.itemsize + itemsize),
             "mask": mask_bytes(d.size) + nnz * itemsize}
    best = min(costs, key=costs.get)
    if best == "dense":
        spool.put(DENSE + name, e.dtype, list(e.shape), d, zstd_level)
        return "dense"
    if best == "indices":
        spool.put(SPARSE_INDICES + name, idx_code, [nnz], np.flatnonzero(changed).astype(idx_dtype), zstd_level)
    else:
        spool.put(MASK + name, "U8", [mask_bytes(d.size)], encode_mask(changed), zstd_level)
    spool.put(SPARSE_VALUES + name, e.dtype, [nnz], d[changed], zstd_level)
    return "sparse"


def _open(path: str | os.PathLike, role: str) -> Weights:
    try:
        return Weights(path)
    except PatchError as exc:
        raise PatchBuildError(f"{role}: {exc}") from None


def _layout(w: Weights) -> dict[str, Any]:
    files = [{"name": f.name, "header": w.headers[f].text} for f in w.files]
    index = {"name": w.index.name, "text": w.index.read_text()} if w.index is not None else None
    return {"files": files, "index": index}


def build_patch(src_model_dir: str | os.PathLike, dst_model_dir: str | os.PathLike, out_file: str | os.PathLike,
                *, source_version: str, target_version: str, policy: str = "",
                overwrite: bool = False, patch_format: int = 1, zstd_level: int | None = None) -> dict[str, Any]:
    """Write the patch "source -> target" to ``out_file`` (safetensors; format in :mod:`mergestream.patches`).

    Streams tensor by tensor over the union of both models' tensor names in canonical order,
    hashing both models on the way (the weights hash of :func:`mergestream.patches.weights_sha256`).
    The file is written to a temporary sibling and renamed into place.

    Args:
        src_model_dir: the source model (version A): folder or ``.safetensors`` file.
        dst_model_dir: the target model (version B); its weight files' headers and index are
            recorded verbatim so that applying the patch rebuilds them byte for byte.
        out_file: the patch file to write.
        source_version / target_version: recorded as strings in the metadata.
        policy: recorded in the metadata; empty: the target's ``mergestream.policy`` metadata, if any.
        overwrite: replace an existing ``out_file`` (atomically) instead of refusing.
        patch_format: 1 (index lists; every agent applies it) or 2 (adds bitmasks and zstd;
            :mod:`mergestream.patches.codec`).
        zstd_level: format 2 only: compress each payload with Zstandard at this level (1-22)
            when that makes it smaller; None: no compression.

    Returns:
        ``{"patch_bytes"`` (size of the patch file), ``"model_bytes"`` (size of the target's weight
        files), ``"ratio"`` (patch_bytes / model_bytes), ``"payload_bytes"``, ``"tensors"``,
        ``"tensors_changed"``, ``"tensors_sparse"``, ``"tensors_dense"``, ``"tensors_added"``,
        ``"tensors_removed"``, ``"tensors_unchanged"``, ``"source_sha256"``, ``"target_sha256"``,
        ``"path"}``.

    Raises:
        OutputExistsError: ``out_file`` exists and ``overwrite`` is False.
        PatchBuildError: a model cannot be read (missing, truncated, malformed).
    """
    out = Path(out_file)
    try:
        patch_format = PatchFormat(patch_format)
    except ValueError:
        raise PatchBuildError(f"patch format {patch_format}: the formats are "
                              + ", ".join(str(f.value) for f in PatchFormat)) from None
    if zstd_level is not None and patch_format is not PatchFormat.BITMASKS:
        raise PatchBuildError(f"patch format {patch_format.value} with zstd level {zstd_level}: zstd needs format 2")
    if out.exists() and not overwrite:
        raise OutputExistsError(f"{out} already exists; choose a new output path")
    out.parent.mkdir(parents=True, exist_ok=True)
    with _open(src_model_dir, "source model") as src, _open(dst_model_dir, "target model") as dst:
        if not policy:
            policy = next(iter(dst.headers.values())).metadata.get("mergestream.policy", "")
        names = sorted(set(src.entries) | set(dst.entries), key=lambda n: n.encode("utf-8"))
        h_src = WeightsHash(len(src.entries))
        h_dst = WeightsHash(len(dst.entries))
        counts = {"unchanged": 0, "sparse": 0, "dense": 0, "added": 0}
        removed: list[str] = []
        spool_fh = tempfile.NamedTemporaryFile(prefix=f".{out.name}.spool-", dir=out.parent, delete=False)
        tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:12]}")
        try:
            with naming(spool_fh.name), spool_fh:
                spool = _Spool(spool_fh)
                for name in names:
                    se, de = src.entries.get(name), dst.entries.get(name)
                    s = d = None
                    if se is not None:
                        s = src.read_raw(name)
                        h_src.begin(se)
                        h_src.data(memoryview(s).cast("B"))
                    if de is not None:
                        d = dst.read_raw(name)
                        h_dst.begin(de)
                        h_dst.data(memoryview(d).cast("B"))
                    if de is None:
                        removed.append(name)
                    elif se is None or (se.dtype, se.shape) != (de.dtype, de.shape):
                        if patch_format is PatchFormat.BITMASKS:
                            spool.put(DENSE + name, de.dtype, list(de.shape), d, zstd_level)
                        else:
                            spool.begin(DENSE + name, de.dtype, list(de.shape))
                            spool.write(DENSE + name, d)
                        counts["added" if se is None else "dense"] += 1
                    elif patch_format is PatchFormat.BITMASKS:
                        counts[_encode_tensor_v2(spool, name, s, d, de, zstd_level)] += 1
                    else:
                        counts[_encode_tensor(spool, name, s, d, de)] += 1
                    del s, d
                spool_fh.flush()
            model_bytes = dst.file_bytes
            changed = counts["sparse"] + counts["dense"] + counts["added"]
            stats = {"tensors": len(dst.entries), "tensors_changed": changed,
                     "tensors_sparse": counts["sparse"], "tensors_dense": counts["dense"] + counts["added"],
                     "tensors_added": counts["added"], "tensors_removed": len(removed),
                     "tensors_unchanged": counts["unchanged"]}
            meta = {
                "patch_format": patch_format.tag,
                "source_version": str(source_version),
                "target_version": str(target_version),
                "source_sha256": h_src.hexdigest(),
                "target_sha256": h_dst.hexdigest(),
                "weights_hash": weights_hash_kind(h_dst.version),
                "policy": policy,
                "payload_bytes": str(spool.offset),
                "model_bytes": str(model_bytes),
                "removed": json.dumps(removed),
                "target_layout": json.dumps(_layout(dst)),
                "stats": json.dumps(stats, sort_keys=True),
            }
            if spool.compressed:
                meta["compressed"] = json.dumps(spool.compressed, sort_keys=True)
            card = Path(dst_model_dir) / CARD_NAME
            if card.is_file():  # the target version's own model card, written by apply_patch
                meta["target_card"] = card.read_text(encoding="utf-8", errors="replace")
            header = {"__metadata__": meta, **spool.entries}
            spool.hash.update(canonical_header(header))
            meta["payload_sha256"] = spool.hash.hexdigest()
            with naming(tmp), open(tmp, "wb") as fh, open(spool_fh.name, "rb") as data:
                fh.write(encode_header(header))
                shutil.copyfileobj(data, fh, 16 * 1024 * 1024)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, out)
            fsync_dir(out.parent)
        except BaseException as exc:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            if isinstance(exc, PatchError):  # a model file went bad while being read
                raise PatchBuildError(str(exc)) from None
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(spool_fh.name)
    patch_bytes = out.stat().st_size
    result = {"path": str(out), "patch_bytes": patch_bytes, "model_bytes": model_bytes,
              "ratio": patch_bytes / model_bytes if model_bytes else 0.0, "payload_bytes": spool.offset,
              "source_sha256": meta["source_sha256"], "target_sha256": meta["target_sha256"], **stats}
    log.info("patch source=%s target=%s bytes=%d ratio=%.4f sparse=%d dense=%d path=%s", source_version,
             target_version, patch_bytes, result["ratio"], stats["tensors_sparse"], stats["tensors_dense"], out)
    return result


__all__ = ["build_patch", "PatchBuildError"]
