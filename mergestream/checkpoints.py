"""Read checkpoints lazily, one tensor (or one byte range) at a time, and validate them.

Readers
    :func:`open_checkpoint` opens a dense checkpoint: a single ``.safetensors`` file, a Hugging Face
    model folder (single file or sharded with ``model.safetensors.index.json``), or a legacy
    ``.bin``/``.pt`` file (only through ``torch.load(weights_only=True)``). Safetensors headers are
    parsed by :mod:`mergestream.st` (a truncated file is refused at open) and tensors are read with
    positional reads into memory the caller owns, so a tensor that has been used and dropped leaves
    no resident pages behind: peak RSS stays at a few tensors whatever the model size.
    :func:`open_expert` also accepts a PEFT LoRA adapter folder and presents it as task vectors
    ``τ = scaling · B @ A`` per target weight. :func:`content_sha256` is the one content hash of an
    expert (the ledger's, the manifest's, the output metadata's).

Validation
    :func:`validate_against_base` checks keys, shapes and dtypes from the headers before any heavy
    work, and (``deep``) frozen integer tensors and finiteness, raising the specific errors of
    :mod:`mergestream.errors`. The engine does the deep checks on its own single pass instead.

Writers live in :mod:`mergestream.writers`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from . import st

from .errors import (
    CorruptCheckpointError,
    DtypeMismatchError,
    ExtraKeyError,
    FrozenTensorMismatchError,
    MissingKeyError,
    MissingShardError,
    NonFiniteError,
    ShapeMismatchError,
    UnsupportedCheckpointError,
    VocabularyGrownError,
)

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
LEGACY_SUFFIXES = (".bin", ".pt", ".pth")
WEIGHT_SUFFIXES = (".safetensors", *LEGACY_SUFFIXES, ".ckpt", ".h5", ".msgpack", ".onnx")
DEFAULT_SHARD_BYTES = 5 * 1024**3

_EMBEDDING_NAME = re.compile(r"(embed|wte|wpe|lm_head|shared\.weight$)")


def is_float_dtype(dtype: torch.dtype) -> bool:
    """True for floating dtypes (merged); integer and bool tensors are frozen (copied from θ₀)."""
    return dtype.is_floating_point


def count_non_finite(t: torch.Tensor, chunk: int = 1 << 20) -> int:
    """Number of NaN/±Inf entries, checked in chunks so temporaries stay small.

    ``torch.isfinite`` on a whole float tensor allocates a same-sized float temporary (|x|) plus
    boolean masks; chunking bounds that at ``chunk`` elements.
    """
    if not t.is_floating_point():
        return 0
    flat = t.reshape(-1)
    return sum(int((~torch.isfinite(flat[i:i + chunk])).sum()) for i in range(0, flat.numel(), chunk))


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
    return CorruptCheckpointError(f"{path}: unreadable or truncated safetensors file ({exc})")


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
                 files: list[Path] | None = None):
        self.path = path
        self._metas = metas
        self._entries = entries
        self._legacy = legacy
        self._metadata = metadata or {}
        found = files if files is not None else [e.file for e in (entries or {}).values()]
        self.weight_files: list[Path] = sorted(set(found), key=lambda p: p.name)
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        self._sha256: str | None = None

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
            flat = self._legacy[name].contiguous().reshape(-1).view(torch.uint8)
            out.copy_(flat[start:start + nbytes])
            return out
        e = self._entries[name]
        if start + nbytes > e.nbytes:
            raise ValueError(f"{name}: read of bytes [{start}, {start + nbytes}) past {e.nbytes}")
        try:
            st.pread_into(self._fd(e.file), out.numpy(), e.offset + start, str(e.file))
        except (st.FormatError, OSError) as exc:
            raise _wrap_open_error(e.file, exc) from exc
        return out

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor into fresh memory (CPU, stored dtype and shape), never shared with others.

        Raises:
            KeyError: ``name`` is not in the checkpoint.
            CorruptCheckpointError: the file cannot be read.
        """
        m = self._metas[name]
        if self._legacy is not None:
            # a clone: legacy state dicts may tie several names to one storage, and callers
            # compute in place in what they get
            return self._legacy[name].clone()
        buf = self.read_into(name, torch.empty(m.nbytes, dtype=torch.uint8))
        return buf.view(m.dtype).reshape(m.shape)

    def entry(self, name: str) -> st.TensorEntry:
        """Where ``name``'s raw bytes live (file, offset, nbytes, dtype code); raw checkpoints only."""
        if self._entries is None:
            raise UnsupportedCheckpointError(f"{self.path}: a legacy checkpoint has no raw entries")
        return self._entries[name]

    def sha256(self) -> str:
        """The content hash (cached): the weights hash of :mod:`mergestream.st` for safetensors
        checkpoints; for a legacy pickle, sha256 of its file bytes (see :func:`content_sha256`)."""
        if self._sha256 is None:
            if self._entries is None:
                self._sha256 = file_sha256(self.weight_files)
            else:
                h = st.WeightsHash(len(self._entries))
                buf = torch.empty(min(_HASH_CHUNK, max((e.nbytes for e in self._entries.values()), default=0)),
                                  dtype=torch.uint8)
                for name in st.name_order(self._entries):
                    e = self._entries[name]
                    h.begin(e)
                    for off in range(0, e.nbytes, _HASH_CHUNK):
                        n = min(_HASH_CHUNK, e.nbytes - off)
                        h.data(self.read_into(name, buf[:n], off).numpy())
                self._sha256 = h.hexdigest()
        return self._sha256

    def aux_files(self) -> list[Path]:
        """Non-weight files of a model folder (config, tokenizer, generation config, ...)."""
        folder = self.path if self.path.is_dir() else None
        if folder is None:
            return []
        out = []
        for p in sorted(folder.iterdir()):
            if p.is_file() and not p.name.startswith(".") and not p.name.endswith(WEIGHT_SUFFIXES) \
                    and not p.name.endswith(".index.json"):
                out.append(p)
        return out

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

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


def _open_safetensors_files(path: Path, weight_map: dict[str, Path] | None,
                            files: list[Path]) -> Checkpoint:
    metas: dict[str, TensorMeta] = {}
    entries: dict[str, st.TensorEntry] = {}
    metadata: dict[str, str] | None = None
    for f in files:
        try:
            hdr = st.read_header(f)
        except st.FormatError as exc:
            raise CorruptCheckpointError(f"{f}: unreadable or truncated safetensors file ({exc})") from exc
        if metadata is None:
            metadata = hdr.metadata
        for e in hdr.entries:  # file (offset) order
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
    return Checkpoint(path, metas, entries=entries, metadata=metadata, files=list(files))


def open_safetensors_file(path: str | os.PathLike) -> Checkpoint:
    """Open one safetensors file whatever its name (e.g. a ``*.tmp`` staged file)."""
    p = Path(path)
    return _open_safetensors_files(p, None, [p])


def _open_legacy(path: Path) -> Checkpoint:
    try:
        sd = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises many types for pickles it refuses
        raise CorruptCheckpointError(
            f"{path}: cannot load with torch.load(weights_only=True) ({type(exc).__name__}: {exc})"
        ) from exc
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise UnsupportedCheckpointError(f"{path}: not a flat state dict of tensors")
    metas = {k: TensorMeta(k, tuple(v.shape), v.dtype) for k, v in sd.items()}
    return Checkpoint(path, metas, legacy=dict(sd), files=[path])


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open a dense checkpoint lazily.

    Args:
        path: a ``.safetensors`` file, a Hugging Face model folder (``model.safetensors``, or
            ``model.safetensors.index.json`` with its shards, or a single other ``*.safetensors``),
            or a legacy ``.bin``/``.pt``/``.pth`` state dict (loaded with ``weights_only=True``).

    Returns:
        A :class:`Checkpoint`; no tensor data has been read.

    Raises:
        FileNotFoundError: the path does not exist.
        MissingShardError: the index names a shard that is absent.
        CorruptCheckpointError: a file is truncated or its header is unreadable.
        UnsupportedCheckpointError: nothing loadable was found.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or folder")
    if p.is_file():
        if p.suffix == ".safetensors":
            return _open_safetensors_files(p, None, [p])
        if p.suffix in LEGACY_SUFFIXES:
            return _open_legacy(p)
        raise UnsupportedCheckpointError(f"{p}: not a .safetensors, .bin or .pt file")
    index = p / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise CorruptCheckpointError(f"{index}: unreadable index ({exc})") from exc
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (p / s).is_file()]
        if missing:
            raise MissingShardError(f"{p}: shard(s) named in {INDEX_NAME} are absent: {', '.join(missing)}")
        return _open_safetensors_files(p, {k: p / v for k, v in weight_map.items()}, [p / s for s in shards])
    if (p / SINGLE_NAME).is_file():
        return _open_safetensors_files(p, None, [p / SINGLE_NAME])
    singles = sorted(p.glob("*.safetensors"))
    if len(singles) == 1 and not (p / "adapter_config.json").exists():
        return _open_safetensors_files(p, None, singles)
    for legacy in ("pytorch_model.bin", "model.pt", "model.bin"):
        if (p / legacy).is_file():
            return _open_legacy(p / legacy)
    raise UnsupportedCheckpointError(
        f"{p}: no model.safetensors, {INDEX_NAME}, single *.safetensors or pytorch_model.bin found")


# ------------------------------------------------------------------------------------------
# Experts: dense checkpoints or LoRA adapters, both seen as task vectors τ = θ − θ₀.
# ------------------------------------------------------------------------------------------
class Expert(Protocol):
    """What the engine needs of an expert: its tensors' metadata and its task vector per tensor."""

    path: Path

    def keys(self) -> list[str]: ...

    def meta(self, name: str) -> TensorMeta: ...

    def task_vector(self, name: str, base: torch.Tensor) -> torch.Tensor:
        """τ for ``name`` as float32, given θ₀'s tensor (any dtype, same shape)."""
        ...

    def sha256(self) -> str: ...

    def close(self) -> None: ...


class DenseExpert:
    """A full fine-tuned checkpoint used as an expert: τ = θ − θ₀ computed in float32."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self.path = ckpt.path

    def keys(self) -> list[str]:
        return self.ckpt.keys()

    def meta(self, name: str) -> TensorMeta:
        return self.ckpt.meta(name)

    def get(self, name: str) -> torch.Tensor:
        return self.ckpt.get(name)

    def task_vector(self, name: str, base: torch.Tensor) -> torch.Tensor:
        """τ = θ − θ₀ in float32 (computed in place in the freshly read expert buffer)."""
        t = self.ckpt.get(name)
        t = t.float() if t.dtype != torch.float32 else t
        return t.sub_(base.to(t.device, torch.float32))

    def sha256(self) -> str:
        return self.ckpt.sha256()

    def close(self) -> None:
        self.ckpt.close()


_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B)"
                       r"(?:\.(?P<adapter>[^.]+))?(?:\.weight)?$")
_LORA_UNSUPPORTED_FLAGS = {
    "use_dora": "DoRA (weight-decomposed LoRA) cannot be represented as a dense additive delta",
    "lora_bias": "LoRA with a trained bias term is not supported",
    "layer_replication": "layer replication changes the architecture",
    "target_parameters": "LoRA on raw parameters (target_parameters) is not supported",
}


class LoraExpert:
    """A PEFT LoRA adapter folder presented as dense task vectors.

    For each target weight W (out × in): τ = scaling · B @ A with scaling = lora_alpha / r, or
    lora_alpha / √r with ``use_rslora`` (Kalajdzievski 2023, rsLoRA). ``fan_in_fan_out`` transposes
    the delta (Conv1D-style weights stored in × out); embedding adapters use τ = (B @ A)ᵀ. Weights
    the adapter does not target have τ = 0. ``alpha_pattern`` and ``rank_pattern`` are honoured
    (r is read from A's shape).

    Raises:
        UnsupportedCheckpointError: DoRA, a non-LORA ``peft_type``, ``modules_to_save``, trained
            LoRA biases, conv LoRA, or any other variant that is not ``scale · B @ A``.
    """

    def __init__(self, folder: Path, base_keys: list[str], base_meta):
        self.path = folder
        cfg_path = folder / "adapter_config.json"
        try:
            cfg = json.loads(cfg_path.read_text())
        except ValueError as exc:
            raise CorruptCheckpointError(f"{cfg_path}: unreadable JSON ({exc})") from exc
        self.config = cfg
        peft_type = str(cfg.get("peft_type", "LORA")).upper()
        if peft_type != "LORA":
            raise UnsupportedCheckpointError(f"{folder}: peft_type {peft_type} is not LoRA; only LoRA adapters fold")
        for flag, why in _LORA_UNSUPPORTED_FLAGS.items():
            if cfg.get(flag):
                raise UnsupportedCheckpointError(f"{folder}: adapter sets {flag}: {why}")
        if cfg.get("modules_to_save"):
            raise UnsupportedCheckpointError(
                f"{folder}: adapter has modules_to_save {cfg['modules_to_save']}: full module copies are "
                "not a LoRA delta; merge them into a dense expert first")
        weights = folder / "adapter_model.safetensors"
        if not weights.is_file():
            legacy = folder / "adapter_model.bin"
            if legacy.is_file():
                self._ckpt = _open_legacy(legacy)
            else:
                raise UnsupportedCheckpointError(f"{folder}: adapter_model.safetensors is missing")
        else:
            self._ckpt = _open_safetensors_files(weights, None, [weights])
        self.fan_in_fan_out = bool(cfg.get("fan_in_fan_out", False))
        self.use_rslora = bool(cfg.get("use_rslora", False))
        self.lora_alpha = float(cfg.get("lora_alpha", 8))
        self.alpha_pattern: dict[str, float] = cfg.get("alpha_pattern") or {}
        pairs: dict[str, dict[str, str]] = {}
        #: copies of base weights PEFT saves for targeted embeddings ({base key: adapter key});
        #: validation requires them to equal θ₀.
        self.base_layer_copies: dict[str, str] = {}
        base_set = set(base_keys)
        for k in self._ckpt.keys():
            if ".base_layer." in k:
                target = self._resolve(k.removeprefix("base_model.model.").replace(".base_layer.", "."), base_set)
                if target is None:
                    raise ExtraKeyError(f"adapter {folder} ships {k!r}, which matches no tensor of the base")
                self.base_layer_copies[target] = k
                continue
            m = _LORA_KEY.match(k)
            if not m:
                raise UnsupportedCheckpointError(f"{folder}: adapter tensor {k!r} is not a LoRA A/B matrix")
            module = m["module"]
            if module.startswith("base_model.model."):
                module = module[len("base_model.model."):]
            kind = m["kind"].replace("embedding_", "")
            pairs.setdefault(module, {})[kind] = k
            if "embedding" in m["kind"]:
                pairs[module]["embedding"] = "1"
        self._targets: dict[str, dict[str, str]] = {}
        for module, kinds in pairs.items():
            if "lora_A" not in kinds or "lora_B" not in kinds:
                raise CorruptCheckpointError(f"{folder}: module {module!r} has only one of lora_A / lora_B")
            a_shape = self._ckpt.meta(kinds["lora_A"]).shape
            if len(a_shape) != 2:
                raise UnsupportedCheckpointError(
                    f"{folder}: module {module!r} has a {len(a_shape)}-D LoRA matrix (conv LoRA is not supported)")
            target = self._resolve(module + ".weight", base_set)
            if target is None:
                raise ExtraKeyError(
                    f"LoRA target {module}.weight (adapter {folder}) has no matching tensor in the base")
            self._targets[target] = kinds
        self._base_meta = base_meta
        self._sha: str | None = None

    @staticmethod
    def _resolve(key: str, base_set: set[str]) -> str | None:
        if key in base_set:
            return key
        hits = [b for b in base_set if b.endswith("." + key) or key.endswith("." + b)]
        return hits[0] if len(hits) == 1 else None

    def _scaling(self, module: str, r: int) -> float:
        alpha = self.lora_alpha
        for pattern, value in self.alpha_pattern.items():
            if re.fullmatch(rf"(.*\.)?{pattern}", module):
                alpha = float(value)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def adapter_meta(self, key: str) -> TensorMeta:
        """Shape/dtype of a raw adapter tensor."""
        return self._ckpt.meta(key)

    def adapter_tensor(self, key: str) -> torch.Tensor:
        """A raw adapter tensor as stored."""
        return self._ckpt.get(key)

    def keys(self) -> list[str]:
        """The base weights this adapter changes (others have τ = 0)."""
        return list(self._targets)

    def meta(self, name: str) -> TensorMeta:
        return self._base_meta(name)

    def delta_shape(self, name: str) -> tuple[int, ...]:
        kinds = self._targets[name]
        a = self._ckpt.meta(kinds["lora_A"]).shape
        b = self._ckpt.meta(kinds["lora_B"]).shape
        shape = (b[0], a[1])
        if self.fan_in_fan_out or "embedding" in kinds:
            shape = shape[::-1]
        return shape

    def task_vector(self, name: str, base: torch.Tensor) -> torch.Tensor:
        """τ = scaling · B @ A (float32) for a target; zeros of θ₀'s shape otherwise."""
        kinds = self._targets.get(name)
        if kinds is None:
            return torch.zeros(base.shape, dtype=torch.float32, device=base.device)
        a = self._ckpt.get(kinds["lora_A"]).to(base.device, torch.float32)
        b = self._ckpt.get(kinds["lora_B"]).to(base.device, torch.float32)
        delta = (b @ a).mul_(self._scaling(name.rsplit(".", 1)[0], a.shape[0]))
        if self.fan_in_fan_out or "embedding" in kinds:
            delta = delta.T.contiguous()
        return delta

    def sha256(self) -> str:
        """The adapter's content hash (:func:`content_sha256`)."""
        if self._sha is None:
            self._sha = content_sha256(self.path)
        return self._sha

    def close(self) -> None:
        self._ckpt.close()


def is_lora_adapter(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "adapter_config.json").is_file()


def open_expert(path: str | os.PathLike, base: Checkpoint) -> DenseExpert | LoraExpert:
    """Open an expert against its base θ₀: a dense checkpoint or a PEFT LoRA adapter folder."""
    if is_lora_adapter(path):
        return LoraExpert(Path(path), base.keys(), base.meta)
    return DenseExpert(open_checkpoint(path))


def content_sha256(path: str | os.PathLike) -> str:
    """The one content hash of an expert (64 hex characters), whatever its form.

    - a dense safetensors checkpoint (file, folder, sharded): the weights hash of
      :mod:`mergestream.st` (independent of file names, sharding, header layout and metadata);
    - a PEFT LoRA adapter folder: sha256 of a tag, ``adapter_config.json``'s bytes and the
      adapter weights' content hash;
    - anything else (legacy pickle, a file that does not parse): sha256 of a tag and the bytes of
      its files (a folder's files in relative-name order, a ``READY`` marker excluded), so a corrupt
      expert still gets one stable identity.

    The engine computes the same value for a dense expert on the fold's own pass.
    """
    p = Path(path)
    try:
        if is_lora_adapter(p):
            cfg = (p / "adapter_config.json").read_bytes()
            weights = p / "adapter_model.safetensors"
            inner = content_sha256(weights if weights.is_file() else p / "adapter_model.bin")
            return hashlib.sha256(b"mergestream-adapter-sha256/1\x00" + cfg + bytes.fromhex(inner)).hexdigest()
        with open_checkpoint(p) as ck:
            return ck.sha256()
    except (CorruptCheckpointError, UnsupportedCheckpointError, MissingShardError, FileNotFoundError, OSError):
        pass
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and f.name != "READY")
    return file_sha256(files)


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
def validate_against_base(base: Checkpoint, other: Checkpoint | DenseExpert | LoraExpert, *,
                          role: str = "expert", check_finite: bool = True, deep: bool = True) -> None:
    """Check that ``other`` fits θ₀ before any heavy work.

    Order of checks: key sets, then per tensor shape, dtype (headers only); then, with ``deep``, a
    streaming pass that compares integer/bool tensors with θ₀ bit for bit and (``check_finite``)
    rejects NaN/±Inf. The engine passes ``deep=False`` and does those checks on its own pass
    (:func:`check_frozen`, :func:`check_finite_tensor`), so an expert is read once per fold.

    Raises:
        MissingKeyError, ExtraKeyError, ShapeMismatchError, VocabularyGrownError,
        DtypeMismatchError, FrozenTensorMismatchError, NonFiniteError: each names the tensor and
        both sides.
    """
    where = str(other.path)
    if isinstance(other, LoraExpert):
        for name, key in other.base_layer_copies.items():
            want, got = base.meta(name), other.adapter_meta(key)
            if got.shape != want.shape:
                if is_embedding_name(name):
                    raise VocabularyGrownError(
                        f"tensor {name}: {role} {where} ships a base layer with {got.shape[0]} rows, base "
                        f"{base.path} has {want.shape[0]}: the vocabulary was resized. Hint: resize the base's "
                        "embeddings the same way before merging")
                raise ShapeMismatchError(f"tensor {name}: shape {list(got.shape)} in {role} {where} vs "
                                         f"{list(want.shape)} in base {base.path}")
            if not torch.equal(other.adapter_tensor(key), base.get(name)):
                raise UnsupportedCheckpointError(
                    f"tensor {name}: {role} {where} ships a modified copy of the base layer; only scale·B@A deltas fold")
        for name in other.keys():
            want = base.meta(name).shape
            got = other.delta_shape(name)
            if got != want:
                raise ShapeMismatchError(
                    f"LoRA delta for {name}: shape {list(got)} in {role} {where} vs {list(want)} in base {base.path}")
        if check_finite:
            for name in other.keys():
                tau = other.task_vector(name, torch.zeros(()))
                if count_non_finite(tau):
                    raise NonFiniteError(f"tensor {name}: LoRA delta of {role} {where} holds NaN or Inf")
        return
    base_keys, other_keys = set(base.keys()), set(other.keys())
    missing = [k for k in base.keys() if k not in other_keys]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise MissingKeyError(f"tensor {missing[0]} is in base {base.path} but missing from {role} {where}{more}")
    extra = [k for k in other.keys() if k not in base_keys]
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
    reader = other.ckpt if isinstance(other, DenseExpert) else other
    for name in base.keys():
        dtype = base.meta(name).dtype
        if not is_float_dtype(dtype):
            check_frozen(name, reader.get(name), base.get(name), f"{role} {where}", base.path)
        elif check_finite:
            check_finite_tensor(name, reader.get(name), f"{role} {where}")


def check_frozen(name: str, got: torch.Tensor, want: torch.Tensor, where: str, base_path: Path) -> None:
    """Raise FrozenTensorMismatchError unless integer/bool tensor ``got`` equals θ₀'s bit for bit."""
    if not torch.equal(got, want):
        raise FrozenTensorMismatchError(
            f"tensor {name} ({want.dtype}) differs between {where} and base {base_path}; "
            "integer/bool tensors are never merged and must equal the base")


def check_finite_tensor(name: str, t: torch.Tensor, where: str) -> None:
    """Raise NonFiniteError if float tensor ``t`` holds NaN/±Inf.

    Fast path: one float32 reduction (NaN and ±Inf propagate through a sum); only when the sum is
    not finite (which finite values can also cause, by overflow) are entries counted in chunks.
    """
    if not t.is_floating_point() or t.numel() == 0:
        return
    if bool(torch.isfinite(t.sum(dtype=torch.float32))):
        return
    bad = count_non_finite(t)
    if bad:
        raise NonFiniteError(f"tensor {name}: {where} holds {bad} NaN/Inf value(s)")


def tied_groups(ckpt: Checkpoint) -> dict[str, str]:
    """Aliases among tensors that share storage in the base (e.g. embeddings tied to the LM head).

    Only candidate pairs (an embedding-like name and an LM-head-like name of equal shape and dtype)
    are compared, so this reads at most a few tensors.

    Returns:
        ``{alias: primary}``: the alias is written as an exact copy of the primary's result.
    """
    metas = ckpt.metas()
    heads = [m for m in metas if re.search(r"(lm_head|embed_out|output)\.weight$", m.name)]
    embeds = [m for m in metas if re.search(r"(embed_tokens|word_embeddings|wte|shared)\.weight$", m.name)]
    out: dict[str, str] = {}
    for h in heads:
        for e in embeds:
            if h.shape == e.shape and h.dtype == e.dtype and torch.equal(ckpt.get(h.name), ckpt.get(e.name)):
                out[h.name] = e.name
    return out


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Load a whole (small) checkpoint into memory; meant for tests and small models only."""
    with open_checkpoint(path) as ck:
        return {k: ck.get(k) for k in ck.keys()}
