"""Read checkpoints lazily, one tensor (or one byte range) at a time, and validate them.

Readers
    :func:`open_checkpoint` opens a dense checkpoint: a single ``.safetensors`` file, a Hugging Face
    model folder (single file or sharded with ``model.safetensors.index.json``), or a legacy
    ``.bin``/``.pt``/``.pth``/``.ckpt`` file (only through ``torch.load(weights_only=True, mmap=True)``;
    training-checkpoint containers and wrapper prefixes are unwrapped by the rules of
    :mod:`mergestream.io.input_formats`). Safetensors headers are parsed by :mod:`mergestream.io.st` (a
    truncated file is refused at open) and tensors, legacy ones included, are read with positional
    reads into memory the caller owns (or, for checkpoints in object storage, ranged GETs:
    :mod:`mergestream.io.s3_checkpoint`), so a tensor that has been used and dropped leaves no
    resident pages behind: peak RSS stays at a few tensors whatever the model size.
    Experts (a dense checkpoint or a PEFT LoRA adapter, both seen as task vectors) are opened by
    :mod:`mergestream.io.expert_readers`, which also holds :func:`~mergestream.io.expert_readers.content_sha256`.

Validation
    :func:`validate_against_base` checks keys, shapes and dtypes from the headers before any heavy
    work (quantized checkpoints refused, known recomputed buffers an expert carries allowed), and
    (``deep``) frozen integer tensors and finiteness, raising the specific errors of
    :mod:`mergestream.errors`. The engine does the deep checks on its own single pass instead.

Writers live in :mod:`mergestream.io.writers`.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import (
    CorruptCheckpointError,
    DtypeMismatchError,
    ExtraKeyError,
    FrozenTensorMismatchError,
    MissingKeyError,
    MissingShardError,
    OutsideRootError,
    QuantizedCheckpointError,
    ShapeMismatchError,
    UnsupportedCheckpointError,
    VocabularyGrownError,
)
from . import s3_checkpoint, st
from .input_formats import (
    QUANTIZED_ST_CODES,
    check_not_quantized,
    dropped_buffers,
    mapped_locations,
    unwrap_container,
    wrapper_prefix,
)
from .finite import check_finite_tensor, count_non_finite, non_finite_error, sum_is_finite  # noqa: F401 (re-exported)
from .paths import confined

log = logging.getLogger(__name__)

#: safetensors dtype codes <-> torch dtypes.
ST_TO_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
TORCH_TO_ST: dict[torch.dtype, str] = {v: k for k, v in ST_TO_TORCH.items()}

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
LEGACY_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
DEFAULT_SHARD_BYTES = 5 * 1024**3

_EMBEDDING_NAME = re.compile(r"(embed|wte|wpe|lm_head|shared\.weight$)")


def is_float_dtype(dtype: torch.dtype) -> bool:
    """True for floating dtypes (merged); integer and bool tensors are frozen (copied from θ₀)."""
    return dtype.is_floating_point


def is_embedding_name(name: str) -> bool:
    """Heuristic: does this tensor name denote an embedding matrix or a (tied) LM head?"""
    return bool(_EMBEDDING_NAME.search(name))


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one stored tensor, known without reading its data."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return self.numel * self.dtype.itemsize


def _wrap_open_error(path: Path, exc: Exception) -> CorruptCheckpointError:
    detail = str(exc).removeprefix(f"{path}: ")  # the format error names the file too: once is enough
    return CorruptCheckpointError(f"{path}: unreadable or truncated safetensors file ({detail})")


#: bytes per read when hashing a whole checkpoint (one reused buffer)
_HASH_CHUNK = 16 * 1024 * 1024


class Checkpoint:
    """A dense checkpoint opened lazily: tensor names, shapes and dtypes up front, data on demand.

    Safetensors files are read with positional reads (``os.preadv``) straight into the memory the
    caller gets (or supplies, see :meth:`read_into`), so a tensor that has been used and dropped
    leaves no resident pages behind: peak RSS stays at a few tensors whatever the model size.
    Use :func:`open_checkpoint` to build one. Thread-safe for concurrent reads.

    Attributes:
        path: what the user named (file or folder).
        weight_files: the files holding tensor data, in a stable order.
    """

    def __init__(self, path: Path, metas: dict[str, TensorMeta], *, entries: dict[str, st.TensorEntry] | None = None,
                 legacy: dict[str, torch.Tensor] | None = None, metadata: dict[str, str] | None = None,
                 files: list[Path] | None = None, source: Any = None):
        self.path = path
        #: where a raw checkpoint's bytes come from when not local files (s3_checkpoint.S3Objects)
        self._source = source
        self._metas = metas
        self._entries = entries
        self._legacy = legacy
        #: where legacy tensors lie in their file ({name: (offset, span bytes)}), read positionally
        self._legacy_at: dict[str, tuple[int, int]] = {}
        self._metadata = metadata or {}
        found = files if files is not None else [e.file for e in (entries or {}).values()]
        self.weight_files: list[Path] = sorted(set(found), key=lambda p: p.name)
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        self._sha256: dict[int, str] = {}
        #: how a legacy file's tensors were found (container, stripped prefix); "" when as saved
        self.unwrapped = ""

    # -- mapping-like surface ---------------------------------------------------------------
    def keys(self) -> list[str]:
        """Tensor names in file order (shard by shard)."""
        return list(self._metas)

    def __contains__(self, name: str) -> bool:
        return name in self._metas

    def meta(self, name: str) -> TensorMeta:
        """Shape and dtype of ``name`` (no data read). Raises KeyError if absent."""
        return self._metas[name]

    def metas(self) -> list[TensorMeta]:
        return list(self._metas.values())

    @property
    def nbytes(self) -> int:
        """Total bytes of tensor data."""
        return sum(m.nbytes for m in self._metas.values())

    @property
    def raw(self) -> bool:
        """True when tensors are read as raw bytes from safetensors files (not a legacy pickle)."""
        return self._entries is not None

    def metadata(self) -> dict[str, str]:
        """The string metadata (``__metadata__``) of the first weight file."""
        return dict(self._metadata)

    def _fd(self, f: Path) -> int:
        fd = self._fds.get(f)
        if fd is None:
            with self._lock:
                fd = self._fds.get(f)
                if fd is None:
                    fd = self._fds[f] = os.open(f, os.O_RDONLY)
        return fd

    def read_into(self, name: str, out: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Read ``out.numel()`` bytes of tensor ``name``'s stored data, from byte ``start``, into ``out``.

        Args:
            out: a contiguous CPU ``uint8`` tensor (e.g. a reused buffer).
            start: byte offset inside the tensor's data (for reading a tensor in chunks).

        Returns:
            ``out``. Raises CorruptCheckpointError if the file ends early, ValueError past the end.
        """
        nbytes = out.numel()
        if self._entries is None:
            if start + nbytes > self._metas[name].nbytes:
                raise ValueError(f"{name}: read of bytes [{start}, {start + nbytes}) past {self._metas[name].nbytes}")
            at = self._legacy_at.get(name)
            if at is not None and self._legacy[name].is_contiguous():
                self._pread(self.weight_files[0], out, at[0] + start)
            else:
                out.copy_(self._legacy_copy(name).reshape(-1).view(torch.uint8)[start:start + nbytes])
            return out
        e = self._entries[name]
        if start + nbytes > e.nbytes:
            raise ValueError(f"{name}: read of bytes [{start}, {start + nbytes}) past {e.nbytes}")
        return self._pread(e.file, out, e.offset + start)

    def _pread(self, f: Path, out: torch.Tensor, offset: int) -> torch.Tensor:
        try:
            if self._source is not None:
                self._source.pread_into(f, out.numpy(), offset)
            else:
                st.pread_into(self._fd(f), out.numpy(), offset, str(f))
        except (st.FormatError, OSError) as exc:
            raise _wrap_open_error(f, exc) from exc
        return out

    def _legacy_copy(self, name: str) -> torch.Tensor:
        """A legacy tensor in fresh contiguous memory: read positionally from its file when it lies
        in the file's mapping (its mapped pages are never touched, so none stay resident), else a
        copy of the in-memory tensor (an old-style pickle)."""
        t = self._legacy[name]
        at = self._legacy_at.get(name)
        if at is None:
            return t.clone(memory_format=torch.contiguous_format)
        buf = self._pread(self.weight_files[0], torch.empty(at[1], dtype=torch.uint8), at[0]).view(t.dtype)
        if t.is_contiguous():
            return buf.reshape(t.shape)
        return buf.as_strided(t.shape, t.stride()).contiguous()

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor into fresh memory (CPU, stored dtype and shape), never shared with others.

        Raises:
            KeyError: ``name`` is not in the checkpoint.
            CorruptCheckpointError: the file cannot be read.
        """
        m = self._metas[name]
        if self._legacy is not None:
            # a fresh copy: legacy state dicts may tie several names to one storage, and callers
            # compute in place in what they get
            return self._legacy_copy(name)
        buf = self.read_into(name, torch.empty(m.nbytes, dtype=torch.uint8))
        return buf.view(m.dtype).reshape(m.shape)

    def entry(self, name: str) -> st.TensorEntry:
        """Where ``name``'s raw bytes live (file, offset, nbytes, dtype code); raw checkpoints only."""
        if self._entries is None:
            raise UnsupportedCheckpointError(f"{self.path}: a legacy checkpoint has no raw entries")
        return self._entries[name]

    def sha256(self, version: int = st.WEIGHTS_HASH_VERSION) -> str:
        """The content hash (cached): the weights hash of :mod:`mergestream.io.st` for safetensors
        checkpoints (``version`` 2, the current definition, or 1 to verify an older record); for a
        legacy pickle, sha256 of its file bytes whatever the version (see :func:`content_sha256`)."""
        if version not in self._sha256:
            if self._entries is None:
                self._sha256[version] = file_sha256(self.weight_files)
            else:
                h = st.WeightsHash(len(self._entries), version)
                for name in st.name_order(self._entries):
                    h.begin(self._entries[name])
                    for chunk in self._chunks(name):
                        h.data(chunk)
                self._sha256[version] = h.hexdigest()
        return self._sha256[version]

    def digest(self, name: str) -> bytes:
        """sha256 of tensor ``name``'s stored bytes: its digest in the weights hash (raw checkpoints)."""
        h = st.tensor_digest()
        for chunk in self._chunks(name):
            h.update(chunk)
        return h.digest()

    def _chunks(self, name: str):
        e = self.entry(name)
        buf = torch.empty(min(_HASH_CHUNK, e.nbytes), dtype=torch.uint8)
        for off in range(0, e.nbytes, _HASH_CHUNK):
            yield self.read_into(name, buf[:min(_HASH_CHUNK, e.nbytes - off)], off).numpy()

    def aux_files(self) -> list[Path]:
        """Non-weight files of a model folder, subfolders included (:func:`mergestream.io.st.aux_files`);
        none for a single file."""
        return [self.path / rel for rel in st.aux_files(self.path)]

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
        if self._source is not None:
            self._source.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, tensors={len(self._metas)}, bytes={self.nbytes})"


def file_sha256(files: list[Path]) -> str:
    """sha256 over files' bytes in the given order (the content hash of what does not parse as
    safetensors: legacy pickles, corrupt files)."""
    h = hashlib.sha256(b"mergestream-file-sha256/1\x00")
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(_HASH_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def _open_safetensors_files(path: Path, weight_map: dict[str, Path] | None, files: list[Path],
                            source: Any = None) -> Checkpoint:
    metas: dict[str, TensorMeta] = {}
    entries: dict[str, st.TensorEntry] = {}
    metadata: dict[str, str] | None = None
    for f in files:
        try:
            hdr = source.header(f) if source is not None else st.read_header(f)
        except st.FormatError as exc:
            raise CorruptCheckpointError(
                f"{f}: unreadable or truncated safetensors file ({str(exc).removeprefix(f'{f}: ')})") from exc
        if metadata is None:
            metadata = hdr.metadata
        for e in hdr.entries:  # file (offset) order
            if e.dtype not in ST_TO_TORCH and e.dtype.startswith(QUANTIZED_ST_CODES):
                raise QuantizedCheckpointError(
                    f"unsupported quantized checkpoint {f}: tensor {e.name!r} is stored as {e.dtype}")
            if e.dtype not in ST_TO_TORCH:
                raise UnsupportedCheckpointError(f"{f}: tensor {e.name!r} has unsupported dtype {e.dtype}")
            if e.name in entries:
                raise CorruptCheckpointError(f"{path}: tensor {e.name!r} is in both {entries[e.name].file.name} and {f.name}")
            metas[e.name] = TensorMeta(e.name, e.shape, ST_TO_TORCH[e.dtype])
            entries[e.name] = e
    if weight_map is not None:
        for k, f in weight_map.items():
            if k not in entries or entries[k].file != f:
                raise CorruptCheckpointError(
                    f"{path}: index names tensor {k!r} in {f.name}, but that shard does not hold it")
    return Checkpoint(path, metas, entries=entries, metadata=metadata, files=list(files), source=source)


def piece_name(index: int) -> str:
    """File ``index`` (from 0) of a pieces folder: what one task of a remote fold wrote of a state or residual."""
    return f"part-{index + 1:05d}.safetensors"


def open_safetensors_file(path: str | os.PathLike) -> Checkpoint:
    """Open one safetensors file whatever its name (e.g. a ``*.tmp`` staged file), or a pieces folder
    (:func:`piece_name` files, each with its tensors and the same ``__metadata__``)."""
    p = Path(path)
    return _open_safetensors_files(p, None, sorted(p.glob("part-*.safetensors")) if p.is_dir() else [p])


def _torch_load(path: Path) -> Any:
    try:
        try:
            return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap can only be used" not in str(exc):  # torch's words for a pre-zip pickle
                raise
            log.warning("legacy checkpoint %s: old-style pickle (no zip archive), loaded whole into memory; "
                        "re-save it with torch.save or as safetensors to stream it", path)
            return torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for pickles it refuses
        raise CorruptCheckpointError(
            f"{path}: cannot load with torch.load(weights_only=True) ({type(exc).__name__}: {exc}); only "
            "tensors and plain containers are read: save the state dict alone (torch.save(model.state_dict()))"
        ) from exc


def _open_legacy(path: Path, expect_keys: list[str] | None = None) -> Checkpoint:
    fd = os.open(path, os.O_RDONLY)  # before the load: positional reads are from the file it maps
    try:
        sd, how = unwrap_container(_torch_load(path), path)
    except BaseException:
        os.close(fd)
        raise
    prefix = wrapper_prefix(list(sd), set(expect_keys or ()))
    if prefix:
        sd = {k[len(prefix):]: v for k, v in sd.items()}
    said = "; ".join(([f"the state dict in {how}"] if how else []) +
                     ([f"wrapper prefix {prefix!r} stripped from all {len(sd)} names"] if prefix else []))
    if said:
        log.info("legacy checkpoint %s: read %s", path, said)
    metas = {k: TensorMeta(k, tuple(v.shape), v.dtype) for k, v in sd.items()}
    ck = Checkpoint(path, metas, legacy=sd, files=[path])
    ck._fds[path] = fd
    ck._legacy_at = mapped_locations(os.fstat(fd), sd)
    ck.unwrapped = said
    return ck


def open_checkpoint(path: str | os.PathLike, expect_keys: list[str] | None = None, *,
                    within: str | os.PathLike | None = None) -> Checkpoint:
    """Open a dense checkpoint lazily.

    Args:
        path: a ``.safetensors`` file, a Hugging Face model folder (``model.safetensors``, or
            ``model.safetensors.index.json`` with its shards, or a single other ``*.safetensors``),
            or a legacy ``.bin``/``.pt``/``.pth``/``.ckpt`` state dict (loaded with
            ``weights_only=True``), possibly inside a training checkpoint's container (logged);
            or an ``s3://`` URI or ``*.s3ref.json`` reference, read in place with ranged GETs
            (:mod:`mergestream.io.s3_checkpoint`, which adds its own errors).
        expect_keys: the base's tensor names, when opening an expert: a wrapper prefix on every
            name of a legacy state dict is stripped when the base's names lack it (logged;
            :func:`mergestream.io.input_formats.wrapper_prefix`).
        within: where a folder's files may resolve to through symlinks (default: the folder).

    Returns:
        A :class:`Checkpoint`; no tensor data has been read.

    Raises:
        FileNotFoundError: the path does not exist.
        MissingShardError: the index names a shard that is absent.
        OutsideRootError: the index names a shard outside the folder (absolute, ``..``), or a
            file read from the folder is a symlink that leaves it (:func:`mergestream.io.paths.confined`).
        CorruptCheckpointError: a file is truncated or its header is unreadable.
        UnsupportedCheckpointError: nothing loadable was found, or a legacy file holds no single
            state dict of tensors. QuantizedCheckpointError: a safetensors dtype of a quantized format.
    """
    if s3_checkpoint.is_s3_path(path):  # object storage, read in place (s3_checkpoint.open_objects)
        uri, weight_map, files, source = s3_checkpoint.open_objects(path)
        try:
            return _open_safetensors_files(uri, weight_map, files, source)
        except BaseException:
            source.close()
            raise
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or folder")
    if p.is_file():
        if p.suffix == ".safetensors":
            return _open_safetensors_files(p, None, [p])
        if p.suffix in LEGACY_SUFFIXES:
            return _open_legacy(p, expect_keys)
        raise UnsupportedCheckpointError(f"{p}: not a .safetensors, .bin, .pt, .pth or .ckpt file")
    index = p / INDEX_NAME
    if index.exists():
        try:
            weight_map = st.parse_index(folder_file(p, INDEX_NAME, within).read_bytes(), str(index))
        except st.FormatError as exc:
            raise CorruptCheckpointError(str(exc)) from None
        shards = sorted(set(weight_map.values()))
        files = {s: confined(p, s, f"{p}: shard named in {INDEX_NAME}", error=OutsideRootError, within=within)
                 for s in shards}
        missing = [s for s, f in files.items() if not f.is_file()]
        if missing:
            raise MissingShardError(f"{p}: shard(s) named in {INDEX_NAME} are absent: {', '.join(missing)}")
        return _open_safetensors_files(p, {k: files[v] for k, v in weight_map.items()}, list(files.values()))
    if (p / SINGLE_NAME).is_file():
        return _open_safetensors_files(p, None, [folder_file(p, SINGLE_NAME, within)])
    singles = sorted(p.glob("*.safetensors"))
    if len(singles) == 1 and not (p / "adapter_config.json").exists():
        return _open_safetensors_files(p, None, [folder_file(p, singles[0].name, within)])
    for legacy in ("pytorch_model.bin", "model.pt", "model.bin"):
        if (p / legacy).is_file():
            return _open_legacy(folder_file(p, legacy, within), expect_keys)
    if (p / "pytorch_model.bin.index.json").exists():
        raise UnsupportedCheckpointError(f"{p}: sharded legacy checkpoints (pytorch_model.bin.index.json) are not "
                                         "read; convert the shards to safetensors")
    raise UnsupportedCheckpointError(
        f"{p}: no model.safetensors, {INDEX_NAME}, single *.safetensors or pytorch_model.bin found")


def folder_file(folder: Path, name: str, within: str | os.PathLike | None = None) -> Path:
    """``folder / name``, a file the readers open in a model folder, checked to resolve inside
    ``within`` (default ``folder``; :func:`mergestream.io.paths.confined`). Raises OutsideRootError."""
    return confined(folder, name, f"{folder}: file", error=OutsideRootError, within=within)


def default_expert_id(path: str | os.PathLike) -> str:
    """``e2.safetensors`` -> ``e2``; a folder -> its name."""
    p = Path(path)
    name = p.name or p.resolve().name
    for suffix in (".safetensors", *LEGACY_SUFFIXES):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


# ------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------
def validate_against_base(base: Checkpoint, other: Any, *,
                          role: str = "expert", check_finite: bool = True, deep: bool = True) -> None:
    """Check that ``other`` fits θ₀ before any heavy work.

    ``other`` is a :class:`Checkpoint` (a backbone), a dense expert
    (:class:`~mergestream.io.expert_readers.DenseExpert`) or a LoRA adapter, which checks its own
    factors (:meth:`~mergestream.io.expert_readers.LoraExpert.validate_against`).

    Order of checks: neither side quantized (:func:`~mergestream.io.input_formats.check_not_quantized`),
    key sets (an expert's extra tensors allowed only when they are known recomputed buffers,
    :func:`~mergestream.io.input_formats.dropped_buffers`),
    then per tensor shape, dtype (headers only); then, with ``deep``, a streaming pass that compares
    integer/bool tensors with θ₀ bit for bit and (``check_finite``) rejects NaN/±Inf. The engine
    passes ``deep=False`` and does those checks on its own pass (:func:`check_frozen`,
    :func:`check_finite_tensor`), so an expert is read once per fold.

    Raises:
        QuantizedCheckpointError: θ₀ or ``other`` is quantized (fp8, scales, packed weights).
        MissingKeyError, ExtraKeyError, ShapeMismatchError, VocabularyGrownError,
        DtypeMismatchError, FrozenTensorMismatchError, NonFiniteError: each names the tensor and
        both sides.
    """
    unwrapped = getattr(getattr(other, "ckpt", other), "unwrapped", "")
    where = f"{other.path} (read: {unwrapped})" if unwrapped else str(other.path)
    check_not_quantized(base, "base")
    if getattr(other, "is_adapter", False):  # a LoRA adapter checks its own factors (expert_readers)
        other.validate_against(base, role=role, check_finite=check_finite)
        return
    check_not_quantized(other, role)
    allowed = set(dropped_buffers(base, other)) if role == "expert" else set()
    base_keys, other_keys = set(base.keys()), set(other.keys()) - allowed
    missing = [k for k in base.keys() if k not in other_keys]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise MissingKeyError(f"tensor {missing[0]} is in base {base.path} but missing from {role} {where}{more}")
    extra = [k for k in other.keys() if k not in base_keys and k not in allowed]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ExtraKeyError(f"tensor {extra[0]} is in {role} {where} but not in base {base.path}{more}")
    for name in base.keys():
        b, o = base.meta(name), other.meta(name)
        if b.shape != o.shape:
            if is_embedding_name(name) and len(b.shape) == 2 and b.shape[1:] == o.shape[1:]:
                raise VocabularyGrownError(
                    f"tensor {name}: {role} {where} has {o.shape[0]} embedding rows, base {base.path} has "
                    f"{b.shape[0]}: the vocabulary was resized. Hint: fine-tune from the base's tokenizer, "
                    "or resize the base's embeddings the same way before merging")
            raise ShapeMismatchError(
                f"tensor {name}: shape {list(o.shape)} in {role} {where} vs {list(b.shape)} in base {base.path}")
        if b.dtype != o.dtype:
            raise DtypeMismatchError(
                f"tensor {name}: dtype {o.dtype} in {role} {where} vs {b.dtype} in base {base.path}")
    if not deep:
        return
    for name in base.keys():
        dtype = base.meta(name).dtype
        if not is_float_dtype(dtype):
            check_frozen(name, other.get(name), base.get(name), f"{role} {where}", base.path)
        elif check_finite:
            check_finite_tensor(name, other.get(name), f"{role} {where}")


def check_frozen(name: str, got: torch.Tensor, want: torch.Tensor, where: str, base_path: Path) -> None:
    """Raise FrozenTensorMismatchError unless integer/bool tensor ``got`` equals θ₀'s bit for bit."""
    if not torch.equal(got, want):
        raise FrozenTensorMismatchError(
            f"tensor {name} ({want.dtype}) differs between {where} and base {base_path}; "
            "integer/bool tensors are never merged and must equal the base")


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Load a whole (small) checkpoint into memory; meant for tests and small models only."""
    with open_checkpoint(path) as ck:
        return {k: ck.get(k) for k in ck.keys()}
