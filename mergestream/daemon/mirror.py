"""The publish mirror: every published version copied to object storage, the pointer ``current`` last.

Layout under ``publish.uri`` (``s3://bucket/prefix/``)::

    versions/000003/model/...                       the backbone (shards, index, config, tokenizer)
    versions/000003/patch-from-000002.safetensors   the edge patch, when one was written
    versions/000003/fold.json                       uploaded last of the version
    current                                         JSON: {"version", "prefix", "files": {rel: bytes}}

The policy state (``state/``) stays local. The store calls :meth:`Mirror.point` after its own
commit, for a publish and for a rollback: the version's files are uploaded first (unless the
bucket already holds them: its ``fold.json`` is there), then ``current`` is replaced in one PUT. S3
PUTs are atomic per object, so a reader that reads ``current`` and then the files it names never
sees a half-published version. A rollback only rewrites ``current`` (uploading the version first if
the bucket lacks it).

A mirror failure (endpoint down, access denied) is logged, counted
(``mergestream_mirror_errors_total{kind}``) and leaves ``current`` in the bucket where it was; the
local store is never touched. The next :meth:`point` catches up (it uploads what is missing).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..io.versions import POINTER, pointer_body, version_prefix
from .s3client import classify, describe, make_client, parse_s3_uri

if TYPE_CHECKING:
    from ..config import Config
    from .metrics import Metrics

log = logging.getLogger(__name__)

#: Folders of a version that are not mirrored.
LOCAL_ONLY = ("state",)


def version_files(folder: Path) -> list[str]:
    """The files of a local version folder to mirror, relative (POSIX), ``fold.json`` last."""
    rels = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    rels = [r for r in rels if r.split("/", 1)[0] not in LOCAL_ONLY and r != "fold.json"]
    return rels + (["fold.json"] if (folder / "fold.json").is_file() else [])


class Mirror:
    """Mirror versions to ``s3://bucket/prefix`` (see the module docstring).

    Args:
        bucket, prefix: the destination (``prefix`` empty or ending in ``/``).
        client: returns the boto3 S3 client (called lazily, once).
        metrics: where uploads and errors are counted (None: nowhere).
    """

    def __init__(self, bucket: str, prefix: str, client: Callable[[], Any], metrics: Metrics | None = None):
        self.bucket, self.prefix = bucket, prefix
        self._client_factory = client
        self._client = None
        self.metrics = metrics

    def _get_client(self):
        if self._client is None:
            self._client = self._client_factory()
        return self._client

    def key(self, rel: str) -> str:
        """The object key of ``rel`` under the mirror's prefix."""
        return f"{self.prefix}{rel}"

    def _has_version(self, vprefix: str) -> bool:
        try:
            self._get_client().head_object(Bucket=self.bucket, Key=self.key(f"{vprefix}fold.json"))
            return True
        except Exception as exc:
            if classify(exc).kind == "not_found":
                return False
            raise

    def upload_version(self, number: int, folder: Path) -> dict[str, int]:
        """Upload version ``number`` from ``folder`` (``fold.json`` last) unless the bucket already
        holds it; returns its files (relative name -> bytes).

        Raises:
            Exception: the upload failed (boto3/botocore errors).
        """
        vprefix = version_prefix(number)
        files = {rel: (folder / rel).stat().st_size for rel in version_files(folder)}
        if self._has_version(vprefix):
            return files
        client = self._get_client()
        for rel in files:  # boto3's managed transfer: multipart for big shards, bounded memory
            client.upload_file(str(folder / rel), self.bucket, self.key(vprefix + rel))
        if self.metrics is not None:
            self.metrics.mirror_versions.inc()
        log.info("mirrored version %d to s3://%s/%s%s (%d files)", number, self.bucket, self.prefix, vprefix,
                 len(files))
        return files

    def point(self, number: int, folder: Path) -> bool:
        """Make the bucket's ``current`` name version ``number`` (uploading it first if needed).
        Returns True on success. Never raises: a failure is logged and counted, and ``current`` in
        the bucket stays where it was."""
        try:
            files = self.upload_version(number, folder)
            body = pointer_body(number, files)  # the format an s3:// fold output writes too
            self._get_client().put_object(Bucket=self.bucket, Key=self.key(POINTER), Body=body,
                                          ContentType="application/json")
        except Exception as exc:
            err = classify(exc)
            log.error("mirror of version %d to s3://%s/%s failed (the local store is unchanged): %s", number,
                      self.bucket, self.prefix, describe(err))
            if self.metrics is not None:
                self.metrics.mirror_errors.labels(kind=err.kind).inc()
            return False
        log.info("mirror current -> version %d in s3://%s/%s", number, self.bucket, self.prefix)
        return True


def build_mirror(cfg: Config, metrics: Metrics | None = None) -> Mirror | None:
    """The mirror of ``cfg.publish`` (None without ``publish.uri``); endpoint and region default to
    the ``s3`` section's. boto3 is imported on first use only."""
    p = cfg.publish
    if not p.uri:
        return None
    bucket, prefix = parse_s3_uri(p.uri)
    endpoint, region = p.endpoint_url or cfg.s3.endpoint_url, p.region or cfg.s3.region
    return Mirror(bucket, prefix, lambda: make_client(endpoint, region), metrics)
