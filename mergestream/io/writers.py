"""Write safetensors models and state files atomically, one tensor (or one chunk) at a time.

:class:`ModelWriter` writes a sharded model whose header is computed up front from the known
shapes, then puts each tensor (or a byte range of it) at its final offset with ``os.pwrite``, so
tensors may arrive in any order from any thread and nothing is buffered. :class:`AppendWriter`
writes one file whose tensors are only known as they are produced (policy state, unmerge
residuals): it reserves room for the header, appends data right after it, and writes the header
into the reserved room at close (no spool, no second copy). :func:`staged_output` gives a sibling
temporary folder that is renamed into place on success and removed on failure, so a crash never
leaves a half model. :func:`copy_aux_files` copies a base's non-weight files.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch

from ..errors import OutputExistsError
from . import st
from .checkpoints import DEFAULT_SHARD_BYTES, TORCH_TO_ST, Checkpoint, TensorMeta

__all__ = ["ModelWriter", "PartWriter", "AppendWriter", "staged_output", "copy_aux_files", "tensor_bytes"]


#: writes of at least this many bytes start their writeback at once (:func:`mergestream.io.st.start_writeback`)
WRITEBACK_MIN_BYTES = 1 << 20


def _header(entries: list[tuple[str, tuple[int, ...], torch.dtype, int, int]], metadata: dict[str, str] | None,
            pad_to: int = 0) -> bytes:
    """8-byte length + header JSON, padded with spaces to a multiple of 8 (and to ``pad_to`` bytes)."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, shape, dtype, start, end in entries:
        header[name] = {"dtype": TORCH_TO_ST[dtype], "shape": list(shape), "data_offsets": [start, end]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format aligns tensor data on 8 bytes
    if pad_to:
        raw += b" " * max(0, pad_to - 8 - len(raw))
    return len(raw).to_bytes(8, "little") + raw


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's stored bytes (CPU, C order) as a flat memoryview (a copy only if needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


class ModelWriter:
    """Write a (sharded) safetensors model whose tensors' shapes and dtypes are known in advance.

    Shards are planned at construction (greedy, in the given order, at most ``max_shard_bytes`` of
    tensor data each); every shard's header is written immediately, and :meth:`write` /
    :meth:`write_range` put bytes at their final offsets. One shard: ``{prefix}.safetensors``;
    several: ``{prefix}-0000i-of-0000n.safetensors`` plus ``{prefix}.safetensors.index.json``.

    Args:
        folder: an existing (staging) folder.
        metas: every tensor to be written, in file order.
        metadata: string metadata stored in every shard's header.
        max_shard_bytes: byte cap of tensor data per shard (a larger single tensor gets its own shard).

    Raises:
        KeyError/ValueError from :meth:`write` for an unplanned tensor or a wrong shape/dtype;
        RuntimeError from :meth:`close` if a planned tensor was never written.
    """

    def __init__(self, folder: Path, metas: list[TensorMeta], metadata: dict[str, str] | None = None,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES, prefix: str = "model"):
        self.folder = Path(folder)
        shards: list[list[TensorMeta]] = [[]]
        size = 0
        for m in metas:
            if shards[-1] and size + m.nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(m)
            size += m.nbytes
        n = len(shards)
        self._shards = shards
        self._prefix = prefix
        self._heads: list[int] = []
        self.files: list[Path] = []
        self._where: dict[str, tuple[int, int, TensorMeta]] = {}
        self._fds: list[int] = []
        try:
            for i, group in enumerate(shards):
                fname = f"{prefix}.safetensors" if n == 1 else f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors"
                entries, off = [], 0
                for m in group:
                    entries.append((m.name, m.shape, m.dtype, off, off + m.nbytes))
                    off += m.nbytes
                head = _header(entries, metadata)
                path = self.folder / fname
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                self._fds.append(fd)  # closed by abort() if what follows fails
                with st.naming(path):
                    st.pwrite_all(fd, head, 0)
                    os.ftruncate(fd, len(head) + off)
                for m, (_, _, _, start, _) in zip(group, entries):
                    self._where[m.name] = (len(self._fds) - 1, len(head) + start, m)
                self._heads.append(len(head))
                self.files.append(path)
            self._remaining = {name: w[2].nbytes for name, w in self._where.items()}
            self._lock = threading.Lock()
            self.bytes_written = 0
            self._write_index(metadata)
        except BaseException:
            self.abort()  # the shards opened so far
            raise

    def _write_index(self, metadata: dict[str, str] | None) -> None:
        if len(self._shards) > 1:
            weight_map = {m.name: self.files[i].name for i, g in enumerate(self._shards) for m in g}
            total = sum(m.nbytes for g in self._shards for m in g)
            index = {"metadata": {"total_size": total, **(metadata or {})}, "weight_map": weight_map}
            path = self.folder / f"{self._prefix}.safetensors.index.json"
            with st.naming(path):
                path.write_text(json.dumps(index, indent=2))

    def set_metadata(self, metadata: dict[str, str]) -> None:
        """Replace the string metadata of every shard (and the index) before :meth:`close`.

        The new header must fit in the planned one (e.g. the planned metadata held same-length
        placeholders such as a 64-character hash of zeros); it is padded with spaces.

        Raises:
            ValueError: the new header is longer than the planned one.
        """
        for i, group in enumerate(self._shards):
            entries, off = [], 0
            for m in group:
                entries.append((m.name, m.shape, m.dtype, off, off + m.nbytes))
                off += m.nbytes
            head = _header(entries, metadata, pad_to=self._heads[i])
            if len(head) != self._heads[i]:
                raise ValueError(f"{self.files[i].name}: new metadata does not fit the planned header")
            with st.naming(self.files[i]):
                st.pwrite_all(self._fds[i], head, 0)
        self._write_index(metadata)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write one planned tensor (must match the planned shape and dtype exactly)."""
        meta = self._where[name][2]
        if tuple(tensor.shape) != meta.shape or tensor.dtype != meta.dtype:
            raise ValueError(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, planned {meta.shape} {meta.dtype}")
        self.write_range(name, 0, tensor_bytes(tensor))

    def write_range(self, name: str, start: int, data) -> None:
        """Write raw bytes ``data`` at byte ``start`` of planned tensor ``name``'s data (chunked writes)."""
        shard, offset, meta = self._where[name]
        data = memoryview(data).cast("B")
        if start < 0 or start + len(data) > meta.nbytes:
            raise ValueError(f"{name}: bytes [{start}, {start + len(data)}) outside the planned {meta.nbytes}")
        with st.naming(self.files[shard]):
            st.pwrite_all(self._fds[shard], data, offset + start)
            if len(data) >= WRITEBACK_MIN_BYTES:
                st.start_writeback(self._fds[shard], offset + start, len(data))
        with self._lock:  # called from worker threads
            self.bytes_written += len(data)
            self._remaining[name] -= len(data)

    def plan(self) -> dict[str, tuple[str, int, tuple[int, ...], str]]:
        """Where every planned tensor's bytes go, as data for a :class:`PartWriter` in another process
        (picklable, tensor-free): ``{name: (shard path, absolute offset, shape, safetensors dtype)}``."""
        return {name: (str(self.files[shard]), offset, tuple(m.shape), TORCH_TO_ST[m.dtype])
                for name, (shard, offset, m) in self._where.items()}

    def layout(self) -> list[tuple[Path, int, int]]:
        """Each shard as ``(path, header bytes, data bytes)``, in file order (the header's size is fixed
        at construction: :meth:`set_metadata` pads to it)."""
        return [(path, head, sum(m.nbytes for m in group))
                for path, head, group in zip(self.files, self._heads, self._shards)]

    def mark_written(self, names, nbytes: int) -> None:
        """Account for tensors a :class:`PartWriter` wrote (whole tensors), ``nbytes`` in all, so that
        :meth:`close` knows they are there."""
        with self._lock:
            for name in names:
                self._remaining[name] = 0
            self.bytes_written += nbytes

    def close(self) -> None:
        """fsync and close every shard; raises RuntimeError if a planned tensor is missing."""
        while self._fds:  # one by one: abort() then closes only what is still open
            with st.naming(self.files[len(self._fds) - 1]):
                os.fsync(self._fds[-1])
            os.close(self._fds.pop())
        missing = sorted(n for n, left in self._remaining.items() if left > 0)
        if missing:
            raise RuntimeError(f"tensors planned but never written: {missing[:5]}")

    def abort(self) -> None:
        """Close without syncing (the staging folder is about to be removed)."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []


class PartWriter:
    """Write some planned tensors of a :class:`ModelWriter`'s shards from another process or host: the
    writer API (:meth:`write`, :meth:`write_range`) on the shard files the driver created (shared
    storage), each byte at its planned offset with ``pwrite``. The driver writes the headers and
    commits; tasks write disjoint byte ranges, so any number of them may write into one shard.

    Args:
        plan: :meth:`ModelWriter.plan` (the whole plan: a tensor may be written with its tied aliases,
            which can sit in other shards).

    Attributes:
        written: the names written completely; bytes_written: their bytes.

    Raises:
        KeyError/ValueError from :meth:`write` for an unplanned tensor or a wrong shape/dtype; OSError
        (naming the shard) when a shard cannot be opened or written.
    """

    def __init__(self, plan: dict[str, tuple[str, int, tuple[int, ...], str]]):
        self._plan = plan
        self._fds: dict[str, int] = {}
        self._left: dict[str, int] = {}
        self.written: list[str] = []
        self.bytes_written = 0

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            with st.naming(path):
                fd = self._fds[path] = os.open(path, os.O_WRONLY)  # never created here: the driver plans the shards
        return fd

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write one planned tensor (its planned shape and dtype exactly)."""
        _, _, shape, dtype = self._plan[name]
        if tuple(tensor.shape) != tuple(shape) or TORCH_TO_ST[tensor.dtype] != dtype:
            raise ValueError(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, planned {tuple(shape)} {dtype}")
        self.write_range(name, 0, tensor_bytes(tensor))

    def write_range(self, name: str, start: int, data) -> None:
        """Write raw bytes ``data`` at byte ``start`` of planned tensor ``name``'s data."""
        path, offset, shape, dtype = self._plan[name]
        nbytes = st.DTYPE_SIZES[dtype]
        for d in shape:
            nbytes *= d
        data = memoryview(data).cast("B")
        if start < 0 or start + len(data) > nbytes:
            raise ValueError(f"{name}: bytes [{start}, {start + len(data)}) outside the planned {nbytes}")
        fd = self._fd(path)
        with st.naming(path):
            st.pwrite_all(fd, data, offset + start)
            if len(data) >= WRITEBACK_MIN_BYTES:
                st.start_writeback(fd, offset + start, len(data))
        left = self._left.setdefault(name, nbytes) - len(data)
        self._left[name] = left
        self.bytes_written += len(data)
        if left <= 0:
            self.written.append(name)

    def close(self) -> None:
        """fsync and close every shard this part wrote into (its bytes are durable when it returns)."""
        while self._fds:
            path, fd = self._fds.popitem()
            try:
                with st.naming(path):
                    os.fsync(fd)
            finally:
                os.close(fd)

    def abort(self) -> None:
        """Close without syncing."""
        while self._fds:
            os.close(self._fds.popitem()[1])


class AppendWriter:
    """Write one safetensors file whose tensors are only known as they are produced.

    Room for the header is reserved at the start of the file (``header_bytes``, a guess the caller
    can make generous); data is appended after it with ``pwrite`` (threads may append
    concurrently: offsets are handed out under a lock), and :meth:`close` writes the header into
    the reserved room, padded with spaces (valid JSON whitespace), then fsyncs. Only if the header
    outgrows the room is the data moved once (chunked copy). Tensors may also be :meth:`reserve`-d
    first and filled in byte ranges later (:meth:`write_range`).

    Args:
        path: the file to create. metadata: string metadata of the header.
        header_bytes: bytes reserved for the header (rounded up to 8).
    """

    def __init__(self, path: Path, metadata: dict[str, str] | None = None, header_bytes: int = 1 << 16):
        self.path = Path(path)
        self._metadata = metadata
        self._room = max(16, header_bytes + (-header_bytes % 8))
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._entries: list[tuple[str, tuple[int, ...], torch.dtype, int, int]] = []
        self._offset = 0
        self._lock = threading.Lock()
        self.bytes_written = 0

    def reserve(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Plan tensor ``name`` now (its bytes come through :meth:`write_range`); returns its data start."""
        nbytes = 1
        for d in shape:
            nbytes *= d
        nbytes *= dtype.itemsize
        with self._lock:
            start = self._offset
            self._entries.append((name, tuple(shape), dtype, start, start + nbytes))
            self._offset += nbytes
        return start

    def write_range(self, data_start: int, data) -> None:
        """Write raw bytes at ``data_start`` of the data region (inside a reserved tensor)."""
        data = memoryview(data).cast("B")
        with st.naming(self.path):
            st.pwrite_all(self._fd, data, self._room + data_start)
            if len(data) >= WRITEBACK_MIN_BYTES:
                st.start_writeback(self._fd, self._room + data_start, len(data))
        with self._lock:
            self.bytes_written += len(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append one tensor (any dtype and shape)."""
        start = self.reserve(name, tuple(tensor.shape), tensor.dtype)
        self.write_range(start, tensor_bytes(tensor))

    def close(self) -> None:
        """Write the header, fsync and close."""
        with st.naming(self.path):
            self._close()

    def _close(self) -> None:
        head = _header(sorted(self._entries, key=lambda e: e[3]), self._metadata)
        if len(head) <= self._room:
            st.pwrite_all(self._fd, _header(sorted(self._entries, key=lambda e: e[3]), self._metadata,
                                            pad_to=self._room), 0)
            os.ftruncate(self._fd, self._room + self._offset)
        else:  # rare: move the data once to make room for a larger header
            tmp = self.path.with_name(self.path.name + ".grow")
            with open(tmp, "wb") as out:
                out.write(head)
                pos = self._room
                while pos < self._room + self._offset:
                    chunk = os.pread(self._fd, min(16 << 20, self._room + self._offset - pos), pos)
                    if not chunk:
                        break
                    out.write(chunk)
                    pos += len(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.close(self._fd)
            self._fd = -1
            os.replace(tmp, self.path)
            return
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1

    def abort(self) -> None:
        """Close and delete the file."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


@contextlib.contextmanager
def staged_output(out: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a sibling temporary folder; rename it to ``out`` on success, delete it on error.

    Raises:
        OutputExistsError: ``out`` exists and ``overwrite`` is False (checked before any work).
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise OutputExistsError(f"{out} already exists; choose a new output path")
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]  # removed again on error
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.staging-", dir=out.parent))
    except BaseException:
        _remove_empty(made)
        raise
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(stage, 0o777 & ~umask)  # mkdtemp makes 0700; outputs get the usual folder mode
    try:
        yield stage
        st.fsync_dir(stage)
        if out.exists() and overwrite:
            trash = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(out, trash)
            os.rename(stage, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(stage, out)
        st.fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        _remove_empty(made)
        raise


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders an output created for itself (deepest first), where still empty."""
    for p in folders:
        with contextlib.suppress(OSError):
            p.rmdir()


def copy_aux_files(src: Checkpoint, dest: Path) -> list[str]:
    """Copy the base's non-weight files into ``dest``: config.json, tokenizer files and whole
    subfolders such as sentence-transformers' ``1_Pooling/`` (:func:`mergestream.io.st.aux_files`).
    Returns the relative names copied."""
    return st.copy_aux_files(src.path, dest)
