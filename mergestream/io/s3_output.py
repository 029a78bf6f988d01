"""A model output in object storage, written by the tasks of a remote executor and committed once
by the driver.

Layout under the output URI ``s3://bucket/root/`` (the publish mirror's, :mod:`mergestream.daemon.mirror`)::

    versions/000003/model/...      the model of one fold or merge (shards, index, config, tokenizer, card)
    current                        JSON: {"version", "prefix", "files": {rel: bytes}}, replaced last
    .staging-<hex>/<shard>         while a pass runs: each shard's tensor data (no header), one object
                                   per shard, written by the one task that owns the shard

Each output is a new version (the number after ``current``'s and after every listed version's, 1
for an empty root); earlier versions are kept. Readers read ``current`` and then the files it names; S3 replaces an object atomically, so
they never see half a version.

Who carries what
    Tasks (:class:`StagingWriter`) spool their shards' data in a local temporary file (one shard's
    bytes of local disk per shard a task owns) and upload it as one staging object: a retried task
    overwrites only its own staging objects. The driver (:class:`S3Output`) keeps the plan in a local
    folder (the shards as sparse files holding only their headers, the index, the aux files), so
    the final header (it carries the experts' content hashes, known only after every task) is
    written there as in a local pass. At the commit each final shard is one multipart upload: part 1
    is the final header plus the first ``PART_MIN - header`` bytes of the staged data (one ranged
    GET), the other parts are server-side copies (``UploadPartCopy`` with ``CopySourceRange``) of
    the staged object. The driver's traffic is at most :data:`PART_MIN` bytes down and ``PART_MIN``
    up per shard (a shard smaller than that: its size), plus the small files; never the model.
    Then the index, the aux files and the card, then ``current``, then the staging objects are deleted.

Without remote tasks
    The local executor writes the shards into the planning folder itself, and the upload sends
    them as files: every byte passes through this process (as it does to a folder). A policy whose
    output the driver rewrites after the map (a coefficient search, OPCM ``scope=global``) does
    the same on Ray: its tasks then stage nothing (they write only the state).

Failures
    A failed pass (a task, the driver, a validation) aborts the multipart uploads it started and
    deletes its staging objects and whatever it put under its version's prefix: ``current`` and
    the earlier versions are untouched. Two passes writing to one root at the same time are not
    supported (each reads ``current`` to number its version).

The client is :func:`mergestream.io.s3_checkpoint.make_client` with boto3's default chain
(``AWS_ENDPOINT_URL``, credentials): the driver and every worker need the same environment.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import MergestreamError
from .s3_checkpoint import error_code, make_client, split_uri
from .versions import POINTER, pointer_body, version_prefix
from .writers import PartWriter

log = logging.getLogger(__name__)

#: S3's smallest part of a multipart upload (every part but the last): what the driver carries per shard
PART_MIN = 5 * 1024**2
#: bytes per server-side copy part of a final shard (S3 allows 5 GiB)
COPY_PART = 1024**3


class OutputStorageError(MergestreamError):
    """An object storage call of an ``s3://`` output failed (endpoint down, access denied, a task's
    shard missing); nothing was published."""


def _root(uri: str) -> tuple[str, str]:
    bucket, key = split_uri(uri)
    return bucket, (key if not key or key.endswith("/") else key + "/")


@dataclass(frozen=True)
class S3Target:
    """Where a pass's tasks stage their shards (picklable, for :class:`StagingWriter`).

    Attributes:
        bucket: the bucket. staging: the key prefix of the staging objects (ends with ``/``).
        shards: ``{shard file name: (header bytes, data bytes)}`` of the planned output.
        upload: False when the driver writes the output itself after the map (a coefficient search,
            a global scale): the tasks' writes are then dropped, nothing is staged.
    """

    bucket: str
    staging: str
    shards: dict[str, tuple[int, int]]
    upload: bool = True

    def key(self, shard: str) -> str:
        """The staging object of shard file ``shard`` (its data, without header)."""
        return f"{self.staging}{shard}"


class StagingWriter(PartWriter):
    """A task's writer of the shards it owns, staged as objects: the :class:`PartWriter` API over
    local spool files (each shard's data region, the header left out), uploaded at :meth:`close`.

    Args:
        plan: :meth:`~mergestream.io.writers.ModelWriter.plan` of the driver's folder.
        target: the pass's :class:`S3Target`.

    Raises:
        From :meth:`close`: OutputStorageError when a shard it touched was not written completely
        (the plan gave its tensors to several tasks) or the upload failed.
    """

    def __init__(self, plan: dict[str, tuple[str, int, tuple[int, ...], str]], target: S3Target):
        self.target = target
        self._spool = Path(tempfile.mkdtemp(prefix="mergestream-shards-"))
        local = {}
        for name, (path, offset, shape, dtype) in plan.items():
            shard = Path(path).name
            local[name] = (str(self._spool / shard), offset - target.shards[shard][0], shape, dtype)
        super().__init__(local)
        self._sizes: dict[str, int] = {}

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            self._fds[path] = fd
            self._sizes[path] = 0
        return fd

    def write_range(self, name: str, start: int, data) -> None:
        """Write raw bytes ``data`` at byte ``start`` of planned tensor ``name``'s data (in its spool)."""
        super().write_range(name, start, data)
        self._sizes[self._plan[name][0]] += memoryview(data).nbytes

    def close(self) -> None:
        """Upload every shard this task wrote as its staging object (replacing a failed attempt's).

        Raises:
            OutputStorageError: a shard is incomplete, or an upload failed.
        """
        while self._fds:  # a spool file: no fsync, it is read back at once and then deleted
            os.close(self._fds.popitem()[1])
        if not self.target.upload:
            shutil.rmtree(self._spool, ignore_errors=True)
            return
        client = make_client()
        try:
            for path, written in sorted(self._sizes.items()):
                shard = Path(path).name
                want = self.target.shards[shard][1]
                if written != want:
                    raise OutputStorageError(f"{shard}: this task wrote {written} of its {want} bytes; with s3:// "
                                             "output one task must own each shard")
                key = self.target.key(shard)
                try:  # boto3's managed transfer: multipart for big shards, bounded memory
                    client.upload_file(path, self.target.bucket, key)
                except Exception as exc:
                    raise OutputStorageError(f"s3://{self.target.bucket}/{key}: upload failed: "
                                             f"{error_code(exc) or type(exc).__name__}") from exc
                log.debug("s3 staged %s bytes=%d", key, want)
        finally:
            shutil.rmtree(self._spool, ignore_errors=True)

    def abort(self) -> None:
        """Drop the spool files (the driver deletes staging objects already uploaded)."""
        super().abort()
        shutil.rmtree(self._spool, ignore_errors=True)


class S3Output:
    """The driver's side of an ``s3://`` output (see the module docstring): a local planning folder,
    the staging prefix, the commit and the pointer.

    Use::

        out = S3Output(uri)
        with out.staged() as folder:      # plan a ModelWriter in folder; out.target(writer.layout())
            ...                           # tasks stage their shards; the driver finishes folder
        # here the version's files are uploaded; then (after the state's commit):
        out.point()                       # ``current`` names the new version; staging deleted

    Args:
        uri: ``s3://bucket/root/`` (the root of the versions and of ``current``).

    Attributes:
        number: the version this output becomes. uri_out: its model's URI
            (``s3://bucket/root/versions/000003/model/``). files: ``{rel: bytes}`` after the upload.
        driver_bytes: bytes the driver sent and received for the model files (ranged GETs, uploaded
            parts and files; server-side copies not counted: they never reach it).

    Raises:
        OutputStorageError: the bucket cannot be read (``current`` unreadable, access denied).
    """

    def __init__(self, uri: str):
        self.bucket, self.root = _root(uri)
        self.client = make_client()
        self.number = max(self._current_number(), self._last_listed()) + 1
        self.vprefix = f"{self.root}{version_prefix(self.number)}"
        self.staging = f"{self.root}.staging-{uuid.uuid4().hex[:12]}/"
        self.uri_out = f"s3://{self.bucket}/{self.vprefix}model/"
        self.files: dict[str, int] = {}
        self.driver_bytes = 0
        self._target: S3Target | None = None
        self._whole = False
        self._committed = False

    def _current_number(self) -> int:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=f"{self.root}{POINTER}")["Body"].read()
        except Exception as exc:
            if error_code(exc) in ("NoSuchKey", "404"):
                return 0
            raise OutputStorageError(f"s3://{self.bucket}/{self.root}{POINTER}: cannot read the pointer: "
                                     f"{error_code(exc) or type(exc).__name__}") from exc
        try:
            return int(json.loads(body)["version"])
        except (ValueError, KeyError, TypeError):
            raise OutputStorageError(f"s3://{self.bucket}/{self.root}{POINTER} is not a version pointer") from None

    def _last_listed(self) -> int:
        """The highest version number with objects under ``root/versions/`` (0: none), so that a
        root whose ``current`` was lost is never written over."""
        top = 0
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=f"{self.root}versions/", Delimiter="/")
            for page in pages:
                for p in page.get("CommonPrefixes", []):
                    name = p["Prefix"].rstrip("/").rsplit("/", 1)[-1]
                    if name.isdigit():
                        top = max(top, int(name))
        except Exception as exc:
            raise OutputStorageError(f"s3://{self.bucket}/{self.root}versions/: cannot list the versions: "
                                     f"{error_code(exc) or type(exc).__name__}") from exc
        return top

    def target(self, layout: list[tuple[Path, int, int]], upload: bool = True) -> S3Target:
        """The tasks' :class:`S3Target` for a planned output (``ModelWriter.layout()``: each shard's
        path, header bytes and data bytes). ``upload`` False: the driver writes the output after
        the map (then also call :meth:`written_here`); the tasks stage nothing."""
        self._target = S3Target(self.bucket, self.staging, {p.name: (head, data) for p, head, data in layout}, upload)
        return self._target

    def written_here(self) -> None:
        """Say that the planning folder holds every shard in full (the local executor wrote it, or the
        driver rewrote the output after the map): :meth:`upload` then uploads the shards as files
        and ignores the staging objects (deleted with the staging prefix)."""
        self._whole = True

    @contextlib.contextmanager
    def staged(self) -> Iterator[Path]:
        """Yield a local planning folder; at a normal exit upload the version's files (:meth:`upload`),
        on an error discard everything this output wrote (:meth:`discard`). The folder is removed
        either way."""
        folder = Path(tempfile.mkdtemp(prefix="mergestream-s3out-"))
        try:
            yield folder
            self.upload(folder)
        except BaseException:
            self.discard()
            raise
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _key(self, rel: str) -> str:
        return f"{self.vprefix}model/{rel}"

    def upload(self, folder: Path) -> dict[str, int]:
        """Assemble every final shard from its staging object and the header in ``folder``, then
        upload the other files of ``folder`` (index, config, tokenizer, card); without staged
        shards (no :meth:`target`, or :meth:`written_here`) every file of ``folder`` is uploaded
        as it is (boto3's managed transfer: multipart, bounded memory). ``current`` is not
        touched. Returns ``{rel: bytes}`` (rel under the version's prefix, ``model/...``).

        Raises:
            OutputStorageError: a staging object is missing or a call failed.
        """
        shards = self._target.shards if self._target is not None and not self._whole else {}
        files: dict[str, int] = {}
        try:
            for name, (head, data) in sorted(shards.items()):
                with open(folder / name, "rb") as fh:
                    header = fh.read(head)
                self._assemble(name, header, data)
                files[f"model/{name}"] = head + data
            for p in sorted(folder.rglob("*")):
                rel = p.relative_to(folder).as_posix()
                if p.is_file() and rel not in shards:
                    self.client.upload_file(str(p), self.bucket, self._key(rel))
                    size = p.stat().st_size
                    self.driver_bytes += size
                    log.debug("s3 PUT %s bytes=%d", self._key(rel), size)
                    files[f"model/{rel}"] = size
        except OutputStorageError:
            raise
        except Exception as exc:
            raise OutputStorageError(f"s3://{self.bucket}/{self.vprefix}: upload failed: "
                                     f"{error_code(exc) or type(exc).__name__}: {exc}") from exc
        self.files = files
        return files

    def _assemble(self, name: str, header: bytes, data: int) -> None:
        """Final shard ``name`` = ``header`` + the staged object's ``data`` bytes (see the module docstring)."""
        c, key, src = self.client, self._key(name), self._target.key(name)
        first = max(0, min(data, PART_MIN - len(header)))
        head = header
        if first:
            head += c.get_object(Bucket=self.bucket, Key=src, Range=f"bytes=0-{first - 1}")["Body"].read()
            if len(head) != len(header) + first:
                raise OutputStorageError(f"s3://{self.bucket}/{src}: staged shard shorter than planned")
            log.debug("s3 GET %s bytes=0-%d", src, first - 1)
        self.driver_bytes += len(head) + first
        if first == data:  # the whole shard fits one part: one PUT
            size = c.head_object(Bucket=self.bucket, Key=src)["ContentLength"]
            if size != data:
                raise OutputStorageError(f"s3://{self.bucket}/{src}: {size} bytes staged, {data} planned")
            c.put_object(Bucket=self.bucket, Key=key, Body=head)
            log.debug("s3 PUT %s bytes=%d", key, len(head))
            return
        up = c.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        try:
            parts = [{"PartNumber": 1, "ETag": c.upload_part(Bucket=self.bucket, Key=key, UploadId=up, PartNumber=1,
                                                             Body=head)["ETag"]}]
            log.debug("s3 UploadPart %s part=1 bytes=%d", key, len(head))
            pos = first
            while pos < data:
                end = min(data, pos + COPY_PART)
                r = c.upload_part_copy(Bucket=self.bucket, Key=key, UploadId=up, PartNumber=len(parts) + 1,
                                       CopySource={"Bucket": self.bucket, "Key": src},
                                       CopySourceRange=f"bytes={pos}-{end - 1}")
                parts.append({"PartNumber": len(parts) + 1, "ETag": r["CopyPartResult"]["ETag"]})
                pos = end
            c.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=up, MultipartUpload={"Parts": parts})
        except BaseException:
            with contextlib.suppress(Exception):
                c.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=up)
            raise
        size = c.head_object(Bucket=self.bucket, Key=key)["ContentLength"]
        if size != len(header) + data:
            raise OutputStorageError(f"s3://{self.bucket}/{key}: {size} bytes assembled, {len(header) + data} planned "
                                     "(a staged shard of the wrong size)")

    def point(self) -> None:
        """Replace ``current`` with this version (one PUT, the last write of the output), then delete
        the staging objects (a failure there is logged: they are outside every version).

        Raises:
            OutputStorageError: the PUT failed (``current`` did not move; the version's files stay,
                since the caller's state may already name them).
        """
        key = f"{self.root}{POINTER}"
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=pointer_body(self.number, self.files),
                                   ContentType="application/json")
        except Exception as exc:
            raise OutputStorageError(f"s3://{self.bucket}/{key}: cannot replace the pointer: "
                                     f"{error_code(exc) or type(exc).__name__}") from exc
        finally:
            self._committed = True  # the version's files stay: the state may name them already
            self._delete(self.staging)
        log.info("s3 output current -> version %d in s3://%s/%s files=%d bytes=%d driver_bytes=%d", self.number,
                 self.bucket, self.root, len(self.files), sum(self.files.values()), self.driver_bytes)

    def _delete(self, prefix: str) -> None:
        try:
            self._delete_prefix(prefix)
        except Exception as exc:
            log.warning("s3 output: objects under s3://%s/%s not deleted: %s", self.bucket, prefix,
                        error_code(exc) or type(exc).__name__)

    def discard(self) -> None:
        """Abort this output's multipart uploads and delete its staging objects and its version's
        objects (never after :meth:`point`). Best effort: a failure is logged."""
        if self._committed:
            return
        for prefix in (self.staging, self.vprefix):
            self._delete(prefix)

    def _delete_prefix(self, prefix: str) -> None:
        c = self.client
        for page in c.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=prefix):
            for u in page.get("Uploads", []):
                c.abort_multipart_upload(Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"])
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                c.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})


__all__ = ["PART_MIN", "OutputStorageError", "S3Output", "S3Target", "StagingWriter"]
