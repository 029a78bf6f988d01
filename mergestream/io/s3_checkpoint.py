"""Checkpoints in S3-compatible object storage, read with ranged GETs: no local copy, no whole
object in memory.

What opens
    ``s3://bucket/key.safetensors`` (one object), ``s3://bucket/folder/`` (a model folder:
    ``model.safetensors.index.json`` with its shards, else ``model.safetensors``), or a reference
    file ``<name>.s3ref.json`` (:class:`S3Ref`: the URI, the endpoint and the ETag and size of every
    object, as the daemon's S3 source wrote them when it saw the expert). :func:`open_objects`
    returns what :func:`mergestream.io.checkpoints.open_checkpoint` needs to build an ordinary
    :class:`~mergestream.io.checkpoints.Checkpoint` over them: the files and an :class:`S3Objects`
    byte source. Headers are fetched with ranged GETs and parsed by :mod:`mergestream.io.st`; tensor
    bytes are fetched with one ranged GET per read, streamed in :data:`CHUNK_BYTES` pieces straight
    into the caller's buffer. The content hash is the one of :class:`mergestream.io.st.WeightsHash`
    (the checkpoint's own ``sha256()`` and the fold's single pass read through the same source).

Consistency
    Every object is pinned at open: its ETag (and its VersionId on a versioned bucket) from a HEAD
    (``IfMatch`` the reference's ETag when there is one). Every later GET carries ``IfMatch`` (and
    ``VersionId``), so an object replaced mid-read raises :class:`~mergestream.errors.ObjectChangedError`
    instead of mixing two versions; a deleted object raises
    :class:`~mergestream.errors.ObjectGoneError`; an object shorter (or longer) than its header
    declares raises :class:`~mergestream.errors.CorruptCheckpointError` at open, a range that comes
    back short raises it at the read.

Client
    :func:`make_client` (boto3, imported lazily: only when an S3 path is opened) with credentials
    from boto3's default chain only. The endpoint: the reference's, else boto3's own configuration
    (``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` or ``endpoint_url`` in the shared config file),
    else AWS. Retries are botocore's (standard mode), never a loop here.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    MergestreamError,
    MissingShardError,
    ObjectChangedError,
    ObjectGoneError,
    OutsideRootError,
    UnsupportedCheckpointError,
)
from . import st
from .paths import confined_key
from .st import load_json

log = logging.getLogger(__name__)

#: Suffix of a reference file (:class:`S3Ref`).
REF_SUFFIX = ".s3ref.json"
#: Bytes per read of a response body (bounded memory whatever the tensor size).
CHUNK_BYTES = 8 * 1024 * 1024
#: botocore's total attempts per GET/HEAD of a read (its standard retry mode: throttling, 5xx,
#: dropped connections before the body)
READ_ATTEMPTS = 5
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def make_client(endpoint_url: str | None = None, region: str | None = None, *, connect_timeout: float = 5.0,
                read_timeout: float = 30.0, max_attempts: int = 2):
    """A boto3 S3 client with credentials from the default AWS chain.

    Args:
        endpoint_url: an S3-compatible endpoint (MinIO, Ceph, R2, a moto server); None: boto3's
            own configuration (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, the config file), else AWS.
        region: the region name; None: the chain's (``AWS_DEFAULT_REGION``, config file), else
            ``us-east-1``.
        connect_timeout, read_timeout: seconds, so an unreachable endpoint fails quickly.
        max_attempts: botocore's total attempts per call (its standard retry mode).

    Raises:
        ImportError: boto3 is not installed (with the extra to install).
    """
    try:
        import boto3
        from botocore.config import Config as BotoConfig
    except ImportError:
        raise ImportError("object storage needs boto3: pip install 'mergestream[s3]'") from None
    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    cfg = BotoConfig(connect_timeout=connect_timeout, read_timeout=read_timeout,
                     retries={"max_attempts": max_attempts, "mode": "standard"},
                     s3={"addressing_style": "path"} if endpoint_url else None)
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, region_name=region, config=cfg)


def error_code(exc: BaseException) -> str:
    """The S3 error code of a botocore ``ClientError`` (``NoSuchKey``, ``PreconditionFailed``,
    or the HTTP status as text), ``""`` for anything else."""
    resp = getattr(exc, "response", None)
    if isinstance(resp, dict):
        err = resp.get("Error") or {}
        return str(err.get("Code") or resp.get("ResponseMetadata", {}).get("HTTPStatusCode") or "")
    return ""


def is_s3_uri(path: Any) -> bool:
    """True for an ``s3://`` URI (a string; a ``Path`` would already have folded ``//`` into ``/``)."""
    return isinstance(path, str) and path.startswith("s3://")


def is_s3_path(path: Any) -> bool:
    """True for an ``s3://`` URI and for a reference file name (``*.s3ref.json``)."""
    return is_s3_uri(path) or str(path).endswith(REF_SUFFIX)


def split_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> ``("bucket", "key")`` (the key may be empty or end in ``/``).

    Raises:
        UnsupportedCheckpointError: not an ``s3://`` URI with a bucket.
    """
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    if not uri.startswith("s3://") or not bucket:
        raise UnsupportedCheckpointError(f"{uri!r} is not an s3://bucket/key URI")
    return bucket, key.lstrip("/")


@dataclass(frozen=True)
class S3Ref:
    """A checkpoint in object storage, as one version: what a reference file holds (JSON).

    Attributes:
        uri: ``s3://bucket/key.safetensors`` or ``s3://bucket/folder/``.
        objects: ``{key: {"etag": ..., "size": bytes}}`` of the objects of that version (the ETags
            the reads are pinned to; a key absent here is pinned to what is there at open).
        endpoint_url, region: where the store is (None: boto3's configuration). Never credentials.
    """

    uri: str
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    endpoint_url: str | None = None
    region: str | None = None

    def write(self, path: str | os.PathLike) -> Path:
        """Write this reference to ``path`` (must end in :data:`REF_SUFFIX`), atomically, fsynced."""
        p = Path(path)
        if not p.name.endswith(REF_SUFFIX):
            raise ValueError(f"{p}: a reference file's name ends in {REF_SUFFIX}")
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.tmp")
        with open(tmp, "w") as fh:
            json.dump({"format": "mergestream-s3ref/1", "uri": self.uri, "objects": self.objects,
                       "endpoint_url": self.endpoint_url, "region": self.region}, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
        return p

    @classmethod
    def read(cls, path: str | os.PathLike) -> S3Ref:
        """Read a reference file.

        Raises:
            FileNotFoundError: no such file. CorruptCheckpointError: not a reference file.
        """
        try:
            obj = load_json(Path(path).read_bytes(), str(path), error=ValueError)
            if obj.get("format") != "mergestream-s3ref/1":
                raise ValueError(f"format {obj.get('format')!r}")
            return cls(str(obj["uri"]), dict(obj.get("objects") or {}), obj.get("endpoint_url"), obj.get("region"))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpointError(f"{path}: not a mergestream S3 reference ({exc})") from None


@dataclass(frozen=True)
class Pinned:
    """One object as pinned at open: ``key``, ``etag`` (quoted, as HTTP wants it), ``size``
    (bytes), ``version_id`` (None on an unversioned bucket)."""

    key: str
    etag: str
    size: int
    version_id: str | None = None


class S3Objects:
    """The byte source of a checkpoint's objects in one bucket (thread-safe; one shared client).

    A checkpoint's "files" are ``Path(bucket) / key``; :meth:`header` and :meth:`pread_into` take
    those. A header costs two GETs (its length, then its bytes: never tensor data), a tensor read
    one. Every GET is logged at DEBUG (``s3 GET <uri> bytes=<a>-<b>``) and counted in
    :attr:`bytes_fetched`.

    Args:
        client: a boto3 S3 client. bucket: the bucket. uri: what the user named (for messages).
        owned: close the client's connections in :meth:`close`.
    """

    def __init__(self, client: Any, bucket: str, uri: str, owned: bool = True):
        self.client, self.bucket, self.uri = client, bucket, uri
        self._owned = owned
        self._pinned: dict[str, Pinned] = {}
        self._lock = threading.Lock()
        #: bytes received from GETs so far
        self.bytes_fetched = 0

    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _fail(self, key: str, exc: Exception) -> Exception:
        """``exc`` from a call on ``key`` as the specific error of :mod:`mergestream.errors`."""
        code, name = error_code(exc), type(exc).__name__
        where, pin = self._where(key), self._pinned.get(key)
        if code in ("PreconditionFailed", "412"):
            return ObjectChangedError(f"{where} was replaced since it was opened (pinned ETag {pin.etag if pin else '?'}); "
                                      "nothing read from the new version was used")
        if code == "NoSuchBucket":
            return ObjectGoneError(f"{where}: no such bucket {self.bucket!r} at this endpoint")
        if code in ("NoSuchKey", "NoSuchVersion", "404", "NotFound"):
            return ObjectGoneError(f"{where}: no such object (deleted, or never uploaded)")
        if code in ("InvalidRange", "416"):
            return CorruptCheckpointError(f"{where}: the object is now shorter than when it was opened (truncated)")
        if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"):
            return CheckpointError(f"{where}: access denied ({code})")
        if name in ("IncompleteReadError", "ResponseStreamingError"):  # the connection, not the object
            return MergestreamError(f"{where}: the transfer was interrupted ({name}: {exc})")
        return MergestreamError(f"{where}: object storage read failed ({name}: {exc})")

    def pin(self, key: str, etag: str | None = None, size: int | None = None) -> Pinned:
        """HEAD ``key`` and pin it: its ETag (``IfMatch`` ``etag`` when given) and size.

        Raises:
            ObjectChangedError: ``etag`` given and the object is another version now.
            ObjectGoneError: no such object. CorruptCheckpointError: ``size`` given and differs.
        """
        kw = {"IfMatch": f'"{etag.strip(chr(34))}"'} if etag else {}
        try:
            h = self.client.head_object(Bucket=self.bucket, Key=key, **kw)
        except Exception as exc:
            err = self._fail(key, exc)
            if isinstance(err, ObjectGoneError) and not self._bucket_exists():
                err = ObjectGoneError(f"{self._where(key)}: no such bucket {self.bucket!r} at this endpoint")
            if isinstance(err, ObjectChangedError):
                err = ObjectChangedError(f"{self._where(key)} is no longer the version recorded (ETag {etag})")
            raise err from exc
        p = Pinned(key, str(h["ETag"]), int(h["ContentLength"]), h.get("VersionId"))
        if size is not None and p.size != size:
            raise CorruptCheckpointError(f"{self._where(key)}: {p.size} bytes, the recorded version has {size}")
        with self._lock:
            self._pinned[key] = p
        return p

    def _bucket_exists(self) -> bool:
        """False only when the endpoint says the bucket does not exist (a HEAD's 404 names neither)."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as exc:  # noqa: BLE001 - any other answer: do not claim the bucket is missing
            return error_code(exc) not in ("NoSuchBucket", "404", "NotFound")
        return True

    def get(self, key: str, start: int, buf) -> int:
        """Fill ``buf`` (any writable buffer) with bytes ``[start, start + len(buf))`` of pinned
        ``key`` from one ranged GET, in :data:`CHUNK_BYTES` pieces; returns the bytes received
        (fewer only at the object's end). Raises the errors of :meth:`_fail`."""
        mv = memoryview(buf).cast("B")
        if not len(mv):
            return 0
        p = self._pinned[key]
        rng = f"bytes={start}-{start + len(mv) - 1}"
        kw = {"VersionId": p.version_id} if p.version_id else {}
        log.debug("s3 GET %s %s", self._where(key), rng)
        got = 0
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=key, Range=rng, IfMatch=p.etag, **kw)["Body"]
            try:
                while got < len(mv):
                    chunk = body.read(min(CHUNK_BYTES, len(mv) - got))
                    if not chunk:
                        break
                    mv[got:got + len(chunk)] = chunk
                    got += len(chunk)
            finally:
                body.close()
        except Exception as exc:
            raise self._fail(key, exc) from exc
        finally:
            with self._lock:
                self.bytes_fetched += got
        return got

    def fetch(self, key: str, etag: str | None = None, size: int | None = None) -> bytes:
        """A whole small object (an index), pinned first. Raises as :meth:`pin` and :meth:`get`."""
        p = self.pin(key, etag, size)
        buf = bytearray(p.size)
        if self.get(key, 0, buf) != p.size:
            raise CorruptCheckpointError(f"{self._where(key)}: read fewer bytes than its {p.size}")
        return bytes(buf)

    def key_of(self, f: Path) -> str:
        """The object key of checkpoint file ``f`` (``Path(bucket) / key``)."""
        return f.relative_to(self.bucket).as_posix()

    def header(self, f: Path) -> st.Header:
        """The safetensors header of pinned file ``f``, checked against the object's size.

        Raises:
            st.IncompleteFileError: the object is shorter than its header declares (truncated).
            st.FormatError: not a safetensors object, or trailing bytes. And what :meth:`get` raises.
        """
        key = self.key_of(f)
        size, where = self._pinned[key].size, self._where(key)
        first = bytearray(min(size, 8))
        self.get(key, 0, first)
        n = struct.unpack("<Q", first)[0] if len(first) == 8 else -1
        if n < 2 or n > _MAX_HEADER or 8 + n > size:
            kind = st.IncompleteFileError if len(first) < 8 or 2 <= n <= _MAX_HEADER else st.FormatError
            raise kind(f"{where}: not a safetensors object, or truncated (header length {n}, object {size} bytes)")
        raw = bytearray(n)
        self.get(key, 8, raw)
        try:
            hdr = st.parse_header_text(raw.decode("utf-8"), f, where)
        except UnicodeDecodeError:
            raise st.FormatError(f"{where}: safetensors header is not UTF-8") from None
        held = size - hdr.data_start
        if hdr.data_len != held:
            kind = st.IncompleteFileError if hdr.data_len > held else st.FormatError
            raise kind(f"{where}: object is {'truncated' if hdr.data_len > held else 'followed by trailing bytes'}: "
                       f"its header declares {hdr.data_len} data bytes, the object holds {held}")
        return hdr

    def pread_into(self, f: Path, buf, offset: int) -> None:
        """Fill ``buf`` from file ``f`` at ``offset`` (what a local positional read does).

        Raises:
            st.FormatError: the object ended first. ObjectChangedError, ObjectGoneError,
            CheckpointError, MergestreamError: see :meth:`_fail`.
        """
        n = memoryview(buf).nbytes
        if self.get(self.key_of(f), offset, buf) != n:
            raise st.FormatError(f"{self._where(self.key_of(f))}: unexpected end of object at byte {offset}")

    def close(self) -> None:
        """Close the client's connections (when this source made the client)."""
        if self._owned and hasattr(self.client, "close"):
            self.client.close()


def open_objects(path: str | os.PathLike, client: Any = None) -> tuple[str, dict[str, Path] | None, list[Path],
                                                                      S3Objects]:
    """Find and pin the objects of the checkpoint at ``path`` (an ``s3://`` URI or a reference file).

    Args:
        client: a boto3 S3 client to use (not closed); None: :func:`make_client` with the
            reference's endpoint and region, or boto3's configuration.

    Returns:
        ``(uri, weight_map or None, files, source)`` for :func:`mergestream.io.checkpoints.open_checkpoint`.

    Raises:
        ObjectGoneError: the object (or the folder's index and ``model.safetensors``) is absent.
        ObjectChangedError: a reference's object is another version now.
        MissingShardError: the index names a shard that is absent.
        OutsideRootError: the index names a shard key outside the folder's prefix (absolute, ``..``,
            an empty or ``.`` component: :func:`mergestream.io.paths.confined_key`).
        UnsupportedCheckpointError: a PEFT adapter folder (download it first) or not a URI.
        CorruptCheckpointError: an unreadable index or reference; a size that differs from the reference's.
    """
    ref = S3Ref(path) if is_s3_uri(path) else S3Ref.read(path)
    bucket, key = split_uri(ref.uri)
    owned = client is None
    src = S3Objects(client or make_client(ref.endpoint_url, ref.region, read_timeout=60.0, max_attempts=READ_ATTEMPTS),
                    bucket, ref.uri, owned)
    try:
        return _find(src, ref, key)
    except BaseException:
        src.close()
        raise


def _find(src: S3Objects, ref: S3Ref, key: str) -> tuple[str, dict[str, Path] | None, list[Path], S3Objects]:
    def pin(k: str) -> Path:
        rec = ref.objects.get(k) or {}
        src.pin(k, rec.get("etag"), rec.get("size"))
        return Path(src.bucket) / k

    if key.endswith(".safetensors"):
        return ref.uri, None, [pin(key)], src
    folder = key.rstrip("/") + "/" if key else ""
    try:
        raw = src.fetch(folder + _INDEX, **{k: v for k, v in (ref.objects.get(folder + _INDEX) or {}).items()
                                            if k in ("etag", "size")})
    except ObjectGoneError:
        raw = None
    if raw is None:
        try:
            return ref.uri, None, [pin(folder + _SINGLE)], src
        except ObjectGoneError:
            try:
                src.pin(folder + "adapter_config.json")
            except ObjectGoneError:
                raise ObjectGoneError(f"{ref.uri}: no {_INDEX} or {_SINGLE} under this prefix") from None
            raise UnsupportedCheckpointError(
                f"{ref.uri}: a PEFT adapter folder is not read in place; download it first (s3.cache: true)") from None
    try:
        weight_map = st.parse_index(raw, f"s3://{src.bucket}/{folder}{_INDEX}")
    except st.FormatError as exc:
        raise CorruptCheckpointError(str(exc)) from None
    shards = sorted(set(weight_map.values()))
    keys = {s: confined_key(folder, s, f"s3://{src.bucket}/{folder}{_INDEX}: shard", error=OutsideRootError)
            for s in shards}  # every key checked before the first request for one
    files = {}
    for shard in shards:
        try:
            files[shard] = pin(keys[shard])
        except ObjectGoneError:
            raise MissingShardError(f"{ref.uri}: shard named in {_INDEX} is absent: {shard}") from None
    return ref.uri, {k: files[v] for k, v in weight_map.items()}, list(files.values()), src
