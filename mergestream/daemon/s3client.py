"""What the S3 source and the publish mirror share: the client, ``s3://`` URIs, error wording, and
verified downloads of objects.

boto3 is an optional extra (``pip install 'mergestream[s3]'``) and is imported inside the functions
here and in :mod:`mergestream.io.s3_checkpoint` (the client, :func:`make_client`, and reading
checkpoints in place), so the daemon never imports it unless ``s3`` or ``publish.uri`` is configured.

Credentials come only from boto3's default chain (environment, shared config/credentials files,
container or instance roles); nothing here reads, logs or counts a secret. :func:`describe` words
an error from its code and message only (never the request's headers), URIs redacted.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path
from typing import Any

from ..io.s3_checkpoint import error_code as _code
from ..io.s3_checkpoint import make_client  # noqa: F401  (the one home of the client; re-exported here)
from ..redaction import redact_uris

log = logging.getLogger(__name__)

#: Bytes per read of an object body while it is downloaded (bounded memory).
CHUNK_BYTES = 8 * 1024 * 1024
_MD5_ETAG = re.compile(r"^[0-9a-f]{32}$")


class ObjectError(Exception):
    """An object storage call failed; :attr:`kind` says how (a bounded set, fit for a metric label).

    Attributes:
        kind: ``access_denied``, ``not_found`` (bucket or object; deleted), ``changed`` (the object
            was replaced while it was read), ``truncated`` (fewer bytes than listed, or a
            safetensors file shorter than its header declares), ``corrupt`` (content hash differs
            from the ETag), ``unreachable`` (endpoint down, DNS, timeouts), ``outside`` (an object key
            that leaves its prefix: ``..``, a leading ``/``, an empty component) or ``other``.
    """

    def __init__(self, kind: str, message: str):
        super().__init__(redact_uris(message))  # botocore names the endpoint URL, userinfo and all
        self.kind = kind

    def __reduce__(self):  # pickled across processes (Ray workers) with both arguments
        return type(self), (self.kind, str(self))


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/prefix/`` -> ``("bucket", "prefix/")`` (the prefix ends with ``/`` unless empty).

    Raises:
        ValueError: not an ``s3://`` URI with a bucket.
    """
    if not uri.startswith("s3://"):
        raise ValueError(f"{redact_uris(uri)!r} is not an s3:// URI")
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    if not bucket:
        raise ValueError(f"{redact_uris(uri)!r} names no bucket")
    prefix = prefix.lstrip("/")
    return bucket, (prefix if not prefix or prefix.endswith("/") else prefix + "/")


def classify(exc: BaseException) -> ObjectError:
    """``exc`` (a botocore error, an :class:`ObjectError`, an ``OSError``) as an
    :class:`ObjectError` with a kind (see there) and a message without secrets. Never raises."""
    if isinstance(exc, ObjectError):
        return exc
    code = _code(exc)
    name = type(exc).__name__
    if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled",
                "ExpiredToken", "InvalidToken"):
        kind = "access_denied"
    elif code in ("NoSuchKey", "NoSuchBucket", "404", "NotFound"):
        kind = "not_found"
    elif code in ("PreconditionFailed", "412"):
        kind = "changed"
    elif name in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError") \
            or isinstance(exc, ConnectionError):
        kind = "unreachable"
    elif name in ("IncompleteReadError", "ResponseStreamingError"):
        kind = "truncated"
    else:
        kind = "other"
    msg = str(exc)
    return ObjectError(kind, f"{name}: {msg}" if msg else name)


def describe(exc: BaseException) -> str:
    """One line for a log or a status note: the kind and the error's own words."""
    err = classify(exc)
    return f"{err.kind}: {err}"


_MULTIPART_ETAG = re.compile(r"^([0-9a-f]{32})-([0-9]+)$")


def etag_md5(etag: str) -> str | None:
    """The MD5 hex digest a single-part upload's ETag stands for, or None when it is not one (a
    multipart upload's ``<md5>-<parts>``, or an opaque tag)."""
    tag = etag.strip('"').lower()
    return tag if _MD5_ETAG.match(tag) else None


def quoted(etag: str) -> str:
    """An ETag as HTTP conditions (``If-Match``) want it: in double quotes."""
    return f'"{etag.strip(chr(34))}"'


class EtagCheck:
    """Recompute an S3 ETag from the content, fed in order, in chunks of any size.

    Single-part upload: the MD5 of the content. Multipart upload with parts of ``part_size`` bytes
    (the last one shorter): ``MD5(MD5(part 1) || ... || MD5(part n)) + "-n"``. Objects encrypted
    with SSE-KMS or SSE-C have ETags that are not content hashes; do not check those.

    Args:
        etag: the listed ETag (quotes allowed).
        part_size: bytes per part of a multipart upload (``head_object(PartNumber=1)``'s length);
            None for a single-part upload.
    """

    def __init__(self, etag: str, part_size: int | None = None):
        self.etag = etag.strip('"').lower()
        self.part_size = part_size
        self._parts: list[bytes] = []
        self._md5 = hashlib.md5(usedforsecurity=False)
        self._in_part = 0

    def update(self, chunk: bytes) -> None:
        """Feed the next bytes of the content."""
        if self.part_size is None:
            self._md5.update(chunk)
            return
        view = memoryview(chunk)
        while len(view):
            take = min(len(view), self.part_size - self._in_part)
            self._md5.update(view[:take])
            self._in_part += take
            view = view[take:]
            if self._in_part == self.part_size:
                self._close_part()

    def _close_part(self) -> None:
        self._parts.append(self._md5.digest())
        self._md5 = hashlib.md5(usedforsecurity=False)
        self._in_part = 0

    def computed(self) -> str:
        """The ETag of what was fed (call once, after the last chunk)."""
        if self.part_size is None:
            return self._md5.hexdigest()
        if self._in_part:
            self._close_part()
        return f"{hashlib.md5(b''.join(self._parts), usedforsecurity=False).hexdigest()}-{len(self._parts)}"


def etag_check(client: Any, bucket: str, key: str, etag: str, response: dict) -> EtagCheck | None:
    """The :class:`EtagCheck` of an object being read (``response``: its ``get_object`` answer), or
    None when its ETag is no content hash (SSE-KMS, SSE-C, an unknown form) or the store does not
    tell a multipart upload's part size."""
    if response.get("SSECustomerAlgorithm") or str(response.get("ServerSideEncryption", "")).startswith("aws:kms"):
        return None
    if etag_md5(etag):
        return EtagCheck(etag)
    m = _MULTIPART_ETAG.match(etag.strip('"').lower())
    if not m:
        return None
    try:
        part = client.head_object(Bucket=bucket, Key=key, PartNumber=1, IfMatch=quoted(etag))
        return EtagCheck(etag, int(part["ContentLength"]))
    except Exception as exc:  # a store without PartNumber support: size checks only
        log.debug("no part size for s3://%s/%s (%s): its ETag is not checked", bucket, key, describe(exc))
        return None


def download_object(client: Any, bucket: str, key: str, dest: Path, *, size: int, etag: str) -> None:
    """Stream object ``key`` (the version with ``etag``) into ``dest`` (created; fsynced), in
    :data:`CHUNK_BYTES` reads, and verify it.

    Verified: the byte count equals ``size`` (the listing's, bytes) and the content hashes to the
    ETag (:class:`EtagCheck`: single-part and multipart uploads; not for SSE-KMS/SSE-C objects,
    whose ETags are no content hash). ``IfMatch`` makes a replaced object fail rather than mix two
    versions.

    Raises:
        ObjectError: ``not_found`` (deleted), ``changed`` (replaced), ``truncated`` (fewer or more
            bytes), ``corrupt`` (the content does not hash to the ETag), ``access_denied``,
            ``unreachable`` or ``other``. A partial ``dest`` is removed.
    """
    got = 0
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        resp = client.get_object(Bucket=bucket, Key=key, IfMatch=quoted(etag))
        check = etag_check(client, bucket, key, etag, resp)
        body = resp["Body"]
        with open(dest, "wb") as fh:
            for chunk in iter(lambda: body.read(CHUNK_BYTES), b""):
                fh.write(chunk)
                if check is not None:
                    check.update(chunk)
                got += len(chunk)
            fh.flush()
            os.fsync(fh.fileno())
        if got != size:
            raise ObjectError("truncated", f"s3://{bucket}/{key}: read {got} bytes, the listing says {size}")
        if check is not None and check.computed() != check.etag:
            raise ObjectError("corrupt", f"s3://{bucket}/{key}: the content hashes to ETag {check.computed()}, "
                                         f"the store says {check.etag}")
    except BaseException as exc:
        dest.unlink(missing_ok=True)
        if isinstance(exc, Exception):
            raise classify(exc) from exc
        raise


def read_range(client: Any, bucket: str, key: str, start: int, length: int, etag: str | None = None) -> bytes:
    """Bytes ``[start, start + length)`` of an object (one ranged GET; fewer at its end).

    Raises:
        ObjectError: as :func:`download_object`.
    """
    try:
        kw = {"IfMatch": quoted(etag)} if etag else {}
        resp = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{start + length - 1}", **kw)
        return resp["Body"].read()
    except Exception as exc:
        raise classify(exc) from exc
