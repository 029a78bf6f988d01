"""Readiness checks: is an inbox entry a whole expert yet? Pure functions on paths, never raising.

Each *top-level* entry of an inbox is one candidate expert:

* a single weight file ``NAME.safetensors``, ``NAME.bin``, ``NAME.pt``, ``NAME.pth`` or ``NAME.ckpt``;
* a folder: a Hugging Face model folder (``model.safetensors``, or ``model.safetensors.index.json``
  plus every shard it names, or one ``*.safetensors``, or a legacy ``pytorch_model.bin``/
  ``model.bin``/``model.pt``), or a PEFT adapter folder (``adapter_config.json`` +
  ``adapter_model.safetensors`` or ``adapter_model.bin``).

Ignored names (temporary or hidden): a leading ``.``; a trailing ``~``; the suffixes ``.tmp``,
``.part``, ``.partial``, ``.crdownload``, ``.incomplete``. They are ignored at the top level (the
whole entry) and inside folders (not part of the expert).

Complete (:func:`expert_complete`): a ``.safetensors`` file is accepted by
:func:`mergestream.io.st.read_header` (its header parses and validates, and the file size equals
``8 + header length + end of the last tensor``: a truncated or still-growing file fails, and so does
a whole file the checkpoint reader would refuse); a ``.bin``/``.pt`` zip archive (``torch.save``'s
format) has its end-of-archive record; an old-style pickle ``.bin`` cannot be checked (settle only);
a sharded folder's index parses and every shard it names exists and is complete; an adapter
folder's ``adapter_config.json`` parses and its weights are complete; a ``config.json`` in the
folder, if present, parses. Marker (:func:`has_marker`): ``READY`` inside a folder, or
``NAME.safetensors.READY`` (the full file name plus ``.READY``) next to a single file.

Size alone does not prove a file written: a preallocating writer (aria2's ``--file-allocation``,
any ``ftruncate``-then-fill downloader) gives the file its final size first and fills it later.
:func:`unwritten_reason` names the signs of that on a complete-looking ``.safetensors`` file: a hole
in its data region (``SEEK_HOLE``: space reserved, never written) or a run of at least
:data:`TAIL_BYTES` zero bytes ending the data that begins inside a tensor (zero tensors at the end,
which begin at a tensor's start, are legitimate). The folder source waits while such a file was written to recently (``watch.unwritten_seconds``).

Never complete (:func:`cannot_complete`): a ``.safetensors`` file whose header declares more bytes
than the file holds plus the free space of its filesystem.
"""

from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path

from ...io import st
from ...io.checkpoints import INDEX_NAME, SINGLE_NAME
from ...io.paths import confined

MARKER_NAME = "READY"
MARKER_SUFFIX = ".READY"
TEMP_SUFFIXES = (".tmp", ".part", ".partial", ".crdownload", ".incomplete")
FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
LEGACY_FOLDER_WEIGHTS = ("pytorch_model.bin", "model.bin", "model.pt")
_ZIP_MAGIC = b"PK\x03\x04"
#: A run of zero bytes at least this long at the end of a weight file's data that does not begin at
#: a tensor's start is a sign of a preallocated file not filled yet.
TAIL_BYTES = 4096
#: How far back (bytes) the trailing zero run is followed; a longer one is always a sign.
ZERO_RUN_SCAN = 16 * 1024 * 1024


def _zero_run_start(fd: int, begin: int, end: int) -> int:
    """Where the run of zero bytes that ends the range [begin, end) of ``fd`` starts (``end``: none),
    followed back at most :data:`ZERO_RUN_SCAN` bytes."""
    pos, limit = end, max(begin, end - ZERO_RUN_SCAN - 1)
    while pos > limit:
        n = min(64 * 1024, pos - limit)
        chunk = os.pread(fd, n, pos - n)
        if len(chunk) != n:
            return end
        stripped = chunk.rstrip(b"\0")
        if stripped:
            return pos - n + len(stripped)
        pos -= n
    return pos


def is_temporary_name(name: str) -> bool:
    """True for names a writer uses while staging: leading ``.``, trailing ``~``, or a temporary
    suffix (``.tmp .part .partial .crdownload .incomplete``, any case)."""
    low = name.lower()
    return name.startswith(".") or name.endswith("~") or low.endswith(TEMP_SUFFIXES)


def folder_member(rel: str) -> bool:
    """True if the file at ``rel`` (a ``/``-separated path relative to a folder expert) is part of
    the expert: not the folder's ``READY`` marker, not a folder placeholder (ending in ``/``), and
    no part of it a temporary or hidden name (:func:`is_temporary_name`: ``.gitattributes``,
    ``.cache/huggingface/...``, ``x.part``).

    The one definition of a folder expert's files: the inbox's change signature
    (:func:`file_signature`), the S3 source's listing, folder tag, download and pre-fold check, and
    the MLflow source's copy check all use it.
    """
    parts = rel.split("/")
    return bool(rel) and rel != MARKER_NAME and all(parts) and not any(is_temporary_name(p) for p in parts)


def safetensors_complete(path: Path) -> bool:
    """True if ``path`` is a whole safetensors file, as :func:`mergestream.io.st.read_header` checks
    it: the header parses and validates and the file size equals ``8 + header length + end offset of
    the last tensor`` (bytes).

    Never raises: an unreadable, truncated, growing or malformed file is simply not complete.
    """
    try:
        st.read_header(path)
    except st.FormatError:
        return False
    return True


def cannot_complete(path: Path) -> str | None:
    """Why the ``.safetensors`` file ``path`` (or one of a folder's top-level ``*.safetensors``)
    can never become complete, or None: its header declares more bytes than the file holds plus the
    free space of its filesystem (a size no copy can reach). Never raises."""
    files = [path] if path.is_file() else sorted(p for p in path.glob("*.safetensors") if not is_temporary_name(p.name))
    for f in files:
        if not f.name.endswith(".safetensors"):
            continue
        try:
            st.read_header(f)
        except st.IncompleteFileError as exc:
            try:
                size, free = f.stat().st_size, shutil.disk_usage(f.parent).free
            except OSError:
                continue
            need = exc.expected_size
            if need is not None and need - size > free:
                where = f"{f.name}: its header" if f != path else "its header"
                return (f"{where} declares {need} bytes, more than the file ({size} bytes) and the free space "
                        f"of its disk ({free} bytes) can ever hold")
        except st.FormatError:
            continue
    return None


def unwritten_reason(path: Path) -> str | None:
    """A sign that the complete-looking ``.safetensors`` file ``path`` (or a folder's, shards
    included) is still being filled by a preallocating writer: a hole in its data region
    (``SEEK_HOLE``, where the filesystem supports it) or a trailing run of zero bytes, at least
    :data:`TAIL_BYTES` long, that begins inside a tensor. None when there is no such sign (or the file is not a valid safetensors file: the
    completeness check speaks for those). Never raises."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.safetensors") if not is_temporary_name(p.name))
    else:
        files = [path] if path.name.endswith(".safetensors") else []
    for f in files:
        try:
            why = _file_unwritten(f)
        except (OSError, st.FormatError):
            continue
        if why:
            return f"{f.relative_to(path) if f != path else f.name}: {why}"
    return None


def _file_unwritten(path: Path) -> str | None:
    hdr = st.read_header(path)
    if hdr.data_len == 0:
        return None
    end = hdr.data_start + hdr.data_len
    with open(path, "rb") as fh:
        try:
            hole = os.lseek(fh.fileno(), hdr.data_start, getattr(os, "SEEK_HOLE"))
        except (OSError, AttributeError):  # no SEEK_HOLE here: only the tail check
            hole = end
        if hole < end:
            return f"bytes from {hole} on were reserved but not written yet (a hole in the file)"
        start = _zero_run_start(fh.fileno(), hdr.data_start, end)
    if end - start < min(TAIL_BYTES, hdr.data_len):
        return None
    # zero tensors at the end are legitimate (a zero-initialised buffer): the run then begins at a tensor
    # start (up to 8 bytes earlier: the zero high bytes of the previous tensor's last element)
    if any(start <= e.offset <= start + 8 for e in hdr.entries) and end - start <= ZERO_RUN_SCAN:
        return None
    return f"its last {end - start}{'+' if end - start > ZERO_RUN_SCAN else ''} bytes are zero, from inside a tensor"


def never_an_expert(path: Path) -> str | None:
    """Why a settled inbox *file* can never become an expert however long it waits, or None when
    it may still be arriving (and for folders, which wait for their files or a marker).

    Never an expert: a file that is not a weight file by its suffix (``notes.txt``), or a weight
    format that is not folded (``.onnx``, ``.gguf``, ...); a
    ``.safetensors`` file whose header length is beyond the format's limit (random bytes), whose
    header is all there but does not parse or validate, or which has bytes after its data; a
    file (or a folder's top-level ``*.safetensors``) that :func:`cannot_complete`. A file whose
    header or data is shorter than it says, and could still grow to it, is still arriving. Never
    raises.
    """
    if path.is_dir():
        return cannot_complete(path)
    if not path.is_file():
        return None
    if not path.name.lower().endswith(st.WEIGHT_SUFFIXES):
        return f"{path.name} is not a checkpoint (experts are {', '.join(FILE_SUFFIXES)} files or model folders)"
    if not path.name.endswith(FILE_SUFFIXES):  # .h5, .msgpack, .onnx, .gguf: formats we do not fold
        return f"{path.name}: this weight format is not folded (only {', '.join(FILE_SUFFIXES)})"
    if not path.name.endswith(".safetensors"):
        return None
    try:
        st.read_header(path)
    except st.IncompleteFileError:
        return cannot_complete(path)
    except st.FormatError as exc:
        return f"not a safetensors file ({exc})"
    return None


def incomplete_reason(path: Path) -> str:
    """Why the entry ``path`` is not complete yet, in words that stay the same while it waits
    unchanged (for ``status``). Never raises."""
    if path.is_file() and path.name.endswith(".safetensors"):
        try:
            st.read_header(path)
        except st.IncompleteFileError as exc:
            if exc.expected_size:
                return f"incomplete: shorter than the {exc.expected_size} bytes its header declares"
        except st.FormatError:
            pass
        return "incomplete"
    if path.is_file():
        return "incomplete: no end-of-archive record yet"
    return "incomplete: not every file it needs (weights, shards, adapter or index) is there and complete"


def torch_file_complete(path: Path) -> bool:
    """True if a ``.bin``/``.pt`` file looks whole: a zip archive (``torch.save``'s format since
    1.6) must have its end-of-archive record; an old-style pickle cannot be checked (True).
    Never raises (an unreadable file is False)."""
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError:
        return False
    if magic == _ZIP_MAGIC:
        return zipfile.is_zipfile(path)
    return len(magic) == 4


def weight_file_complete(path: Path) -> bool:
    """Completeness of one weight file by its suffix (see :func:`safetensors_complete`,
    :func:`torch_file_complete`); False if it is not a regular file. Never raises."""
    if not path.is_file():
        return False
    if path.name.endswith(".safetensors"):
        return safetensors_complete(path)
    return torch_file_complete(path)


def _json_ok(path: Path) -> bool:
    try:
        st.load_json(path.read_bytes(), str(path))
        return True
    except (OSError, st.FormatError):
        return False


def expert_complete(path: Path) -> bool:
    """True if the inbox entry ``path`` holds a complete expert (see the module docstring).

    Never raises.
    """
    try:
        if path.is_file():
            return path.name.endswith(FILE_SUFFIXES) and weight_file_complete(path)
        if not path.is_dir():
            return False
        if (path / "config.json").exists() and not _json_ok(path / "config.json"):
            return False
        if (path / ADAPTER_CONFIG).exists():
            if not _json_ok(path / ADAPTER_CONFIG):
                return False
            return any(weight_file_complete(path / w) for w in ADAPTER_WEIGHTS)
        index = path / INDEX_NAME
        if index.exists():
            try:
                shards = sorted(set(st.parse_index(index.read_bytes(), str(index)).values()))
            except (OSError, st.FormatError):
                return False
            try:  # a shard named outside the folder is never read here: the fold refuses it with its reason
                files = [confined(path, s, "shard", error=ValueError) for s in shards]
            except ValueError:
                return True
            return bool(shards) and all(weight_file_complete(f) for f in files)
        if (path / SINGLE_NAME).exists():
            return weight_file_complete(path / SINGLE_NAME)
        singles = [p for p in path.glob("*.safetensors") if not is_temporary_name(p.name)]
        if len(singles) == 1:
            return weight_file_complete(singles[0])
        for legacy in LEGACY_FOLDER_WEIGHTS:
            if (path / legacy).exists():
                return weight_file_complete(path / legacy)
        return False
    except OSError:
        return False


def loadable_folder(path: Path) -> bool:
    """True if the checkpoint reader can open the folder ``path`` as it is (an index, a
    ``model.safetensors``, an adapter config, one ``*.safetensors`` or a legacy weight file)."""
    if (path / INDEX_NAME).is_file() or (path / SINGLE_NAME).is_file() or (path / ADAPTER_CONFIG).is_file():
        return True
    if len(list(path.glob("*.safetensors"))) == 1:
        return True
    return any((path / n).is_file() for n in LEGACY_FOLDER_WEIGHTS)


def has_marker(path: Path) -> bool:
    """True if the producer marked ``path`` ready: ``path/READY`` for a folder,
    ``<path>.READY`` beside a single file."""
    if path.is_dir():
        return (path / MARKER_NAME).exists()
    return path.with_name(path.name + MARKER_SUFFIX).exists()


#: (relative name, size in bytes, mtime in ns) of every non-temporary file of a candidate, sorted.
Signature = tuple[tuple[str, int, int], ...]


def file_signature(path: Path) -> Signature | None:
    """Sizes (bytes) and mtimes (ns) of the candidate's files (recursively for a folder: the files
    :func:`folder_member` takes, so a marker added later is not a change); None
    if ``path`` does not exist. Never raises."""
    try:
        stat = path.stat()
    except OSError:
        return None
    if not path.is_dir():
        return ((path.name, stat.st_size, stat.st_mtime_ns),)
    out = []
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if not is_temporary_name(d)]
        for f in files:
            if is_temporary_name(f):
                continue
            p = os.path.join(root, f)
            try:
                s = os.stat(p)
            except OSError:
                continue
            rel = os.path.relpath(p, path)
            if folder_member(rel.replace(os.sep, "/")):
                out.append((rel, s.st_size, s.st_mtime_ns))
    return tuple(sorted(out))
