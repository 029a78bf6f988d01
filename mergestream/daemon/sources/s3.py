"""S3 source: poll a bucket + prefix (any S3-compatible store) and emit each expert once it is whole.

Each poll lists every object under ``s3.prefix`` (``list_objects_v2`` through boto3's paginator, so
any number of pages). What lies under the prefix:

* ``<prefix><name>.safetensors`` (directly under the prefix): one single-file expert. It is ready
  when its ETag and size were the same in two consecutive listings *and* its size equals what its
  safetensors header declares (8 + header length + end of the last tensor; read with two ranged
  GETs, parsed by :func:`mergestream.io.st.parse_header_text`). An object shorter (or longer) than
  its header declares is a truncated object: reported once (error log, ``on_error``, status note)
  and never folded; a re-upload fixes it.
* ``<prefix><name>/...`` (a folder-like prefix): one folder expert (a Hugging Face folder, a PEFT
  adapter), ready once its ``READY`` marker object ``<prefix><name>/READY`` exists. Its files are
  those :func:`~.readiness.folder_member` takes (one definition for the listing, the folder tag,
  the download and the pre-fold check): hidden and temporary names inside it (``.gitattributes``,
  ``.cache/...``, ``*.part``) are not part of the expert.
* anything else (hidden or temporary names, other files at the top) is ignored.

A multipart upload in progress is not listed by S3 until it completes, so it is simply not seen.

Identity: an expert version is (key, ETag): the key of the file, or of the folder with a tag made
from every object's key, size and ETag under it. Its registry key is ``s3:<bucket>/<key>#<tag>``;
the newest tag taken per key is the ledger cursor ``s3:<bucket>/<key>``, advanced by
:meth:`S3Source.on_enqueued`, so each version is taken once, across restarts too, and a re-upload
with new content (a new ETag) is a new expert.

Reading, ``s3.cache: true`` (the default): every object is streamed into
``<state>/cache/s3/<bucket>/<version id>/`` (a temporary folder renamed into place when whole),
with ``IfMatch: <ETag>`` (a replaced object fails instead of mixing versions), its byte count
checked against the listing and, for single-part uploads, its MD5 against the ETag; safetensors
files are then checked complete with :func:`mergestream.io.st.read_header`. Then an
:class:`~.base.ExpertReady` with the local path is emitted, as the MLflow source does; the service
hashes and folds it.

Reading, ``s3.cache: false``: nothing is downloaded. The source writes a reference file
``<state>/s3-refs/<bucket>/<version id>/<name>.s3ref.json`` (:class:`mergestream.io.s3_checkpoint.S3Ref`:
the URI, the endpoint, and the key, ETag and size of every object of that version) and emits its
path; the service hashes the expert and the engine folds it through it with ranged GETs
(:mod:`mergestream.io.s3_checkpoint`), every read pinned to the listed ETag. The size was verified
before (single files: the header's declared size, at readiness; every object: at open against
the reference), the content hash on the fold's own pass. The daemon's kept copy of an accepted
expert (``state/experts/<id>/``) is then that reference (a few hundred bytes): replay re-reads
the objects from the bucket and refuses, with :class:`~mergestream.errors.ObjectChangedError` or
:class:`~mergestream.errors.ObjectGoneError`, when they were replaced or deleted since. A PEFT
adapter folder (``adapter_config.json``; small) is downloaded to the cache in both modes.

Errors (endpoint unreachable, access denied, bucket missing, an object deleted or replaced while
read, a truncated object): an error log line that names the bucket, key and kind, ``on_error``
(``mergestream_source_errors_total{source="s3"}``), a ``status`` note; the poll stops or skips
that expert and the next poll tries again. The daemon keeps running.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import struct
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import MergestreamError
from ...io import st
from ...io.paths import confined_key
from ...io.s3_checkpoint import REF_SUFFIX, S3Ref
from ..s3client import (
    ObjectError,
    classify,
    describe,
    download_object,
    make_client,
    quoted,
    read_range,
)
from .base import Cursors, Emit, ExpertReady, Source, SourceContext
from .readiness import MARKER_NAME, folder_member, is_temporary_name

if TYPE_CHECKING:
    from ...config import Config

log = logging.getLogger(__name__)

NAME = "s3"
#: The safetensors format's own header limit (bytes).
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class Listed:
    """One object of a listing: ``key``, ``size`` (bytes) and ``etag`` (quotes stripped)."""

    key: str
    size: int
    etag: str


@dataclass(frozen=True)
class Candidate:
    """One expert version found in a listing.

    Attributes:
        key: the object key (single file) or the folder prefix ending in ``/``.
        tag: the object's ETag, or a folder's tag (sha256 of its objects' keys, sizes, ETags).
        objects: what to download (the folder's objects without the marker, or the one file).
        name: the expert id (file name without ``.safetensors``, or the folder name).
    """

    key: str
    tag: str
    objects: tuple[Listed, ...]
    name: str

    @property
    def folder(self) -> bool:
        """True for a folder expert."""
        return self.key.endswith("/")


def registry_key(bucket: str, key: str, tag: str) -> str:
    """The ledger's registry key of one expert version: ``s3:<bucket>/<key>#<tag>``."""
    return f"{NAME}:{bucket}/{key}#{tag}"


def parse_key(rkey: str) -> tuple[str, str, str] | None:
    """``(bucket, key, tag)`` of a key made by :func:`registry_key`; None for another source's."""
    scheme, _, rest = rkey.partition(":")
    path, _, tag = rest.rpartition("#")
    bucket, _, key = path.partition("/")
    if scheme != NAME or not (bucket and key and tag):
        return None
    return bucket, key, tag


def folder_tag(objects: list[Listed]) -> str:
    """The version tag of a folder expert: sha256 (first 32 hex) of its objects' keys, sizes and
    ETags, in key order; any object replaced, added or removed gives a new tag."""
    h = hashlib.sha256()
    for o in sorted(objects, key=lambda o: o.key):
        h.update(f"{o.key}\0{o.size}\0{o.etag}\n".encode())
    return h.hexdigest()[:32]


def list_objects(client: Any, bucket: str, prefix: str, page_size: int = 1000) -> list[Listed]:
    """Every object under ``prefix`` (all pages of ``list_objects_v2``, ``page_size`` keys each).

    Raises:
        ObjectError: the listing failed (kind: ``access_denied``, ``not_found``, ``unreachable``...).
    """
    try:
        out = []
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix,
                                                                  PaginationConfig={"PageSize": page_size})
        for page in pages:
            for o in page.get("Contents", []):
                out.append(Listed(o["Key"], int(o["Size"]), str(o.get("ETag", "")).strip('"')))
        return out
    except Exception as exc:
        raise classify(exc) from exc


def folder_candidate(key: str, objects: list[Listed]) -> Candidate | None:
    """The folder expert at ``key`` (``<prefix><name>/``) made of ``objects`` (those listed under
    it): its files are the objects :func:`~.readiness.folder_member` takes (hidden and temporary
    names such as ``.gitattributes`` are not part of it), its tag is :func:`folder_tag` of those
    files and the ``READY`` marker. None while the marker is absent or there is no file.

    A key with a ``..`` component is kept among the files (not ignored as hidden), so that the
    download refuses the whole folder with its reason (``outside``).

    The listing and the pre-fold check (:func:`version_exists`) both build the expert here."""
    marker = [o for o in objects if o.key == key + MARKER_NAME]
    files = tuple(o for o in objects if o.key.startswith(key) and (folder_member(o.key[len(key):])
                                                                   or ".." in o.key[len(key):].split("/")))
    if not marker or not files:
        return None
    return Candidate(key, folder_tag([*files, *marker]), files, key.rstrip("/").rpartition("/")[2])


def candidates(objects: list[Listed], prefix: str) -> tuple[list[Candidate], list[Listed]]:
    """Split a listing into folder experts whose READY marker exists (:func:`folder_candidate`),
    and single-file ``.safetensors`` objects (not yet checked for readiness). See the module
    docstring."""
    folders: dict[str, list[Listed]] = {}
    singles: list[Listed] = []
    for o in objects:
        rel = o.key[len(prefix):]
        parts = rel.split("/")
        if not rel or is_temporary_name(parts[0]):
            continue
        if len(parts) > 1:
            folders.setdefault(parts[0], []).append(o)
        elif rel.endswith(".safetensors"):
            singles.append(o)
    ready = [c for name, objs in sorted(folders.items()) if (c := folder_candidate(f"{prefix}{name}/", objs))]
    return ready, singles


def declared_size(client: Any, bucket: str, key: str, etag: str) -> int:
    """The file size (bytes) a safetensors object's header declares: ``8 + header length + end
    of the last tensor``, from two ranged GETs (8 bytes, then the header).

    Raises:
        ObjectError: ``truncated`` (shorter than its header), ``corrupt`` (not a safetensors
            header), or a read error.
    """
    where = f"s3://{bucket}/{key}"
    head = read_range(client, bucket, key, 0, 8, etag)
    if len(head) < 8:
        raise ObjectError("truncated", f"{where}: {len(head)} bytes, shorter than a safetensors header")
    n = struct.unpack("<Q", head)[0]
    if n < 2 or n > MAX_HEADER_BYTES:
        raise ObjectError("corrupt", f"{where}: not a safetensors file (header length {n})")
    text = read_range(client, bucket, key, 8, n, etag)
    if len(text) < n:
        raise ObjectError("truncated", f"{where}: the object ends inside its safetensors header")
    try:
        hdr = st.parse_header_text(text.decode("utf-8"), Path(key), where)
    except (UnicodeDecodeError, st.FormatError) as exc:
        raise ObjectError("corrupt", f"{where}: {exc}") from None
    return hdr.data_start + hdr.data_len


class S3Source(Source):
    """Poll ``s3://bucket/prefix`` and emit each new expert version once (see the module docstring).

    Args:
        bucket, prefix: where experts are uploaded (``prefix`` empty or ending in ``/``).
        emit: called once per ready, downloaded and verified expert.
        client: returns the boto3 S3 client (called once, lazily, on the poll thread).
        cache_dir: downloads land in ``cache_dir/<bucket>/<version id>/``.
        interval_seconds: seconds between polls (a :meth:`trigger` polls at once).
        on_error: called with each :class:`~mergestream.daemon.s3client.ObjectError`; its own
            exceptions are logged and swallowed.
        cursors: the newest tag taken per key (None: remembered while this source lives).
        note: ``note(subject, message_or_None, level)`` keeps what ``status`` shows.
        cache: False: emit a reference file (under ``refs_dir``) instead of a download (see the
            module docstring); ``endpoint_url`` and ``region`` are written into it for the readers.

    Raises:
        ValueError: ``interval_seconds`` <= 0 or a prefix that does not end in ``/``.
    """

    name = NAME
    #: keys per listing page (S3's maximum is 1000).
    PAGE_SIZE = 1000

    def __init__(self, bucket: str, prefix: str, emit: Emit, *, client: Callable[[], Any], cache_dir: Path,
                 interval_seconds: float = 30.0, on_error: Callable[[Exception], None] | None = None,
                 cursors: Cursors | None = None, note: Callable[[str, str | None, str], None] | None = None,
                 cache: bool = True, refs_dir: Path | None = None, endpoint_url: str | None = None,
                 region: str | None = None):
        if interval_seconds <= 0:
            raise ValueError(f"interval_seconds must be > 0, got {interval_seconds}")
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"prefix {prefix!r} must be empty or end with '/'")
        self.bucket, self.prefix, self.emit = bucket, prefix, emit
        self.cache_dir = Path(cache_dir)
        self.cache, self.endpoint_url, self.region = cache, endpoint_url, region
        self.refs_dir = Path(refs_dir) if refs_dir is not None else self.cache_dir.parent / "s3-refs"
        self.interval_seconds = float(interval_seconds)
        self.on_error, self.cursors, self.note = on_error, cursors, note
        self._client_factory = client
        self._client = None
        self._previous: dict[str, tuple[int, str]] = {}   # single file key -> (size, etag) last listing
        self._reported: set[tuple[str, str]] = set()       # (key, tag) whose error was reported
        self._taken: dict[str, str] = {}                   # key -> newest tag emitted
        self._poll_lock = threading.Lock()
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        #: polls finished so far (listing made or failed).
        self.polls = 0

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the poll thread; the first poll runs at once.

        Raises:
            RuntimeError: already started.
        """
        if self._thread is not None:
            raise RuntimeError("S3Source already started")
        self._stopping.clear()
        for tmp in self.cache_dir.glob(".*.tmp-*") if self.cache_dir.is_dir() else []:
            shutil.rmtree(tmp, ignore_errors=True)
        self._thread = threading.Thread(target=self._loop, name="s3-poll", daemon=True)
        self._thread.start()
        log.info("s3 source started bucket=%s prefix=%s interval_seconds=%.1f", self.bucket, self.prefix,
                 self.interval_seconds)

    def stop(self) -> None:
        """Stop polling and wait for a running poll to end (idempotent)."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None

    def trigger(self) -> None:
        """Ask for a poll now (thread-safe; a bucket notification calls it)."""
        self._wake.set()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self.poll()
            except Exception:  # pragma: no cover - poll reports its own errors
                log.exception("s3 poll failed")
            self._wake.wait(self.interval_seconds)
            self._wake.clear()

    # -- what the service asks --------------------------------------------------------------------
    def still_available(self, registry_key: str) -> bool:
        """False when the expert version behind ``registry_key`` was deleted or replaced in the
        bucket since it was emitted (see :func:`version_exists`). Never raises."""
        return version_exists(self._get_client, registry_key)

    def on_enqueued(self, ev: ExpertReady) -> None:
        """Record the event's (key, tag) as taken: in the ledger cursor ``s3:<bucket>/<key>``."""
        parsed = parse_key(ev.registry_key or "")
        if parsed is None:
            return
        bucket, key, tag = parsed
        self._taken[key] = tag
        if self.cursors is not None:
            self.cursors.set_cursor(f"{NAME}:{bucket}/{key}", tag)

    # -- polling ----------------------------------------------------------------------------------
    def _get_client(self):
        if self._client is None:
            self._client = self._client_factory()
        return self._client

    def _error(self, err: ObjectError) -> None:
        if self.on_error is not None:
            try:
                self.on_error(err)
            except Exception:
                log.exception("on_error callback failed")

    def _note(self, subject: str, message: str | None) -> None:
        if self.note is not None:
            try:
                self.note(subject, message, "error")
            except Exception:
                log.exception("note callback failed")

    def _was_taken(self, key: str, tag: str) -> bool:
        if self._taken.get(key) == tag:
            return True
        return self.cursors is not None and self.cursors.get_cursor(f"{NAME}:{self.bucket}/{key}") == tag

    def _report(self, cand_key: str, tag: str, err: ObjectError) -> None:
        """Log, count and note a problem with one expert version, once per (key, tag) and kind."""
        if (cand_key, f"{tag}:{err.kind}") in self._reported:
            return
        self._reported.add((cand_key, f"{tag}:{err.kind}"))
        log.error("s3 expert s3://%s/%s not taken: %s", self.bucket, cand_key, describe(err))
        self._error(err)
        self._note(f"object:{cand_key}", f"{err.kind}: {err}")

    def poll(self) -> list[ExpertReady]:
        """One synchronous poll; returns the events emitted, in key order.

        Never raises for storage errors: a failed listing is logged, counted and noted (subject
        ``bucket``) and ends the poll; a failed expert is reported once and skipped.
        """
        with self._poll_lock:
            try:
                return self._poll()
            finally:
                self.polls += 1

    def _poll(self) -> list[ExpertReady]:
        try:
            objects = list_objects(self._get_client(), self.bucket, self.prefix, self.PAGE_SIZE)
        except ObjectError as err:
            log.error("s3 listing of s3://%s/%s failed: %s", self.bucket, self.prefix, describe(err))
            self._error(err)
            self._note("bucket", f"listing s3://{self.bucket}/{self.prefix} failed: {err.kind}: {err}")
            return []
        self._note("bucket", None)
        folders, singles = candidates(objects, self.prefix)
        ready = list(folders) + self._ready_singles(singles)
        out = []
        for cand in sorted(ready, key=lambda c: c.key):
            if self._stopping.is_set():
                break
            if self._was_taken(cand.key, cand.tag):
                continue
            ev = self._take(cand)
            if ev is not None:
                out.append(ev)
        return out

    def _ready_singles(self, singles: list[Listed]) -> list[Candidate]:
        """The single files whose (size, ETag) match the previous listing and whose size is the
        one their header declares; remembers this listing for the next poll."""
        previous, self._previous = self._previous, {o.key: (o.size, o.etag) for o in singles}
        out = []
        for o in singles:
            if self._was_taken(o.key, o.etag):
                continue
            if previous.get(o.key) != (o.size, o.etag):
                log.info("s3 object s3://%s/%s (%d bytes) seen; taken when the next listing (in %.0f s) shows "
                         "the same size and ETag", self.bucket, o.key, o.size, self.interval_seconds)
                continue
            if (o.key, f"{o.etag}:ok") not in self._reported:
                try:
                    want = declared_size(self._get_client(), self.bucket, o.key, o.etag)
                except ObjectError as err:
                    self._report(o.key, o.etag, err)
                    continue
                if want != o.size:
                    kind = "truncated" if o.size < want else "corrupt"
                    self._report(o.key, o.etag, ObjectError(kind, f"s3://{self.bucket}/{o.key} is {o.size} bytes, "
                                                                  f"its safetensors header declares {want}"))
                    continue
                self._reported.add((o.key, f"{o.etag}:ok"))
            name = o.key[len(self.prefix):].removesuffix(".safetensors")
            out.append(Candidate(o.key, o.etag, (o,), name))
        return out

    def _take(self, cand: Candidate) -> ExpertReady | None:
        """Download, verify and emit one expert version; None if it failed (reported)."""
        try:
            self._local_names(cand)  # a key that leaves the folder: refused, downloaded or referenced
            path = self._download(cand) if self.cache or _is_adapter(cand) else self._reference(cand)
        except ObjectError as err:
            if err.kind in ("unreachable", "changed"):  # transient: said each time, not remembered
                log.error("s3 download of s3://%s/%s failed: %s", self.bucket, cand.key, describe(err))
                self._error(err)
            else:
                self._report(cand.key, cand.tag, err)
            return None
        except OSError as exc:
            self._report(cand.key, cand.tag, ObjectError("other", f"local cache: {exc}"))
            return None
        self._note(f"object:{cand.key}", None)
        meta = {"s3.bucket": self.bucket, "s3.key": cand.key, "s3.etag": cand.tag}
        ev = ExpertReady(source=self.name, uri=str(path), expert_id=cand.name,
                         registry_key=registry_key(self.bucket, cand.key, cand.tag), metadata=meta)
        try:
            self.emit(ev)
        except Exception:
            log.exception("emit failed for s3://%s/%s", self.bucket, cand.key)
            return None
        self._taken[cand.key] = cand.tag  # durable once enqueued (on_enqueued)
        log.info("expert ready source=s3 id=%s key=%s uri=%s", ev.expert_id, cand.key, ev.uri)
        return ev

    def _reference(self, cand: Candidate) -> Path:
        """The reference file of ``cand`` (``s3.cache: false``): written, not downloaded.

        Raises:
            OSError: the reference cannot be written.
        """
        vid = hashlib.sha256(f"{cand.key}\0{cand.tag}".encode()).hexdigest()[:24]
        objects = {o.key: {"etag": o.etag, "size": o.size} for o in cand.objects}
        ref = S3Ref(f"s3://{self.bucket}/{cand.key}", objects, self.endpoint_url, self.region)
        return ref.write(self.refs_dir / self.bucket / vid / f"{cand.name}{REF_SUFFIX}")

    def _local_names(self, cand: Candidate) -> dict[str, str]:
        """``{object key: name under the version's cache folder}`` for each object of ``cand``.

        Raises:
            ObjectError: ``outside``: a key whose name under the prefix has ``..``, a leading ``/``
                or an empty component (:func:`mergestream.io.paths.confined_key`): it would leave
                the cache folder.
        """
        return {o.key: confined_key("", o.key[len(self.prefix):], f"s3://{self.bucket}/{o.key}: object key",
                                    error=lambda m: ObjectError("outside", m)) for o in cand.objects}

    def _download(self, cand: Candidate) -> Path:
        """The verified local copy of ``cand`` in the cache (downloaded unless already there):
        the file, or the folder (without its marker).

        Raises:
            ObjectError: a read failed or the copy does not verify; ``outside``: an object key that
            would leave the cache folder (:func:`mergestream.io.paths.confined_key`). OSError: the cache.
        """
        vid = hashlib.sha256(f"{cand.key}\0{cand.tag}".encode()).hexdigest()[:24]
        final = self.cache_dir / self.bucket / vid
        top = cand.key[len(self.prefix):].rstrip("/")
        rels = self._local_names(cand)  # every local name checked before the first byte is written
        if final.is_dir() and all((final / rels[o.key]).is_file() and
                                  (final / rels[o.key]).stat().st_size == o.size for o in cand.objects):
            return final / top
        tmp = self.cache_dir / f".{vid}.tmp-{uuid.uuid4().hex[:8]}"
        client = self._get_client()
        try:
            for o in cand.objects:
                dest = tmp / rels[o.key]
                download_object(client, self.bucket, o.key, dest, size=o.size, etag=o.etag)
                if dest.name.endswith(".safetensors"):
                    try:
                        st.read_header(dest)
                    except st.FormatError as exc:
                        kind = "truncated" if isinstance(exc, st.IncompleteFileError) else "corrupt"
                        raise ObjectError(kind, f"s3://{self.bucket}/{o.key}: {exc}") from None
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            st.fsync_dir(final.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("downloaded s3://%s/%s (%d objects) to %s", self.bucket, cand.key, len(cand.objects), final)
        return final / top


def _is_adapter(cand: Candidate) -> bool:
    """True for a PEFT adapter folder (always downloaded: small, and read as local files)."""
    return cand.folder and any(o.key == f"{cand.key}adapter_config.json" for o in cand.objects)


def version_exists(client: Callable[[], Any], rkey: str) -> bool:
    """Whether the expert version behind ``rkey`` (:func:`registry_key`) is still in the bucket:
    False when the object (or a folder's marker) is gone or its ETag/folder tag changed. True for
    other sources' keys and when the store cannot be asked (what was downloaded is folded).
    Never raises."""
    parsed = parse_key(rkey)
    if parsed is None:
        return True
    bucket, key, tag = parsed
    try:
        c = client()
        if key.endswith("/"):
            cand = folder_candidate(key, list_objects(c, bucket, key))
            gone = cand is None or cand.tag != tag
        else:
            try:
                c.head_object(Bucket=bucket, Key=key, IfMatch=quoted(tag))
                gone = False
            except Exception as exc:
                err = classify(exc)
                if err.kind not in ("not_found", "changed"):
                    raise err from exc
                gone = True
    except Exception as exc:
        log.warning("cannot ask whether %s still exists (%s); folding the downloaded copy", rkey, describe(exc))
        return True
    if gone:
        log.warning("skipping %s: deleted or replaced in the bucket before it was folded", rkey)
    return not gone


def _client_of(cfg: Config) -> Callable[[], Any]:
    s = cfg.s3
    return lambda: make_client(s.endpoint_url, s.region)


def offline_check(cfg: Config, rkey: str) -> bool:
    """:func:`version_exists` with a client made from ``cfg.s3`` (no running source)."""
    return version_exists(_client_of(cfg), rkey)


def build(cfg: Config, emit: Emit, context: SourceContext) -> list[Source]:
    """The S3 source of ``cfg.s3`` (none unless enabled), and its notification receiver when
    ``s3.notify.enabled``.

    Raises:
        MergestreamError: notifications are enabled without a token.
    """
    context.clear_notes(NAME)
    s = cfg.s3
    if not s.enabled:
        return []
    src = S3Source(s.bucket or "", s.prefix, emit, client=_client_of(cfg), cache_dir=cfg.state_dir / "cache" / "s3",
                   interval_seconds=s.interval_seconds, on_error=lambda exc: context.on_error(NAME, exc),
                   cache=s.cache, refs_dir=cfg.state_dir / "s3-refs", endpoint_url=s.endpoint_url, region=s.region,
                   cursors=context.cursors,
                   note=lambda subject, message, level: context.note(NAME, subject, message, level))
    n = s.notify
    if not n.enabled:
        return [src]
    if n.token is None:
        raise MergestreamError("s3.notify.enabled needs a token (MERGESTREAM_S3__NOTIFY__TOKEN)")
    from .s3_notify import NotificationReceiver

    return [src, NotificationReceiver(n.host, n.port, n.token.get_secret_value(), src.trigger)]
