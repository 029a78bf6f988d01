"""Downloads of MLflow registry versions into a local cache, with retries (used by :mod:`.mlflow`).

``MlflowClient.get_model_version_download_uri`` (the version's storage location or its source:
``runs:/<run>/<path>``, ``mlflow-artifacts:/...``, a cloud or local path) is handed to
``mlflow.artifacts.download_artifacts(..., tracking_uri=, registry_uri=)`` into a temporary folder
``cache_dir/<model>/.<version>.tmp-*`` that is renamed to ``cache_dir/<model>/<version>/`` (atomic: a
folder there is complete, and is reused without downloading). ``models:/`` URIs are never passed to
``download_artifacts``: MLflow 3.17 resolves them with the *global* registry URI, ignoring
``registry_uri`` (it silently opens ``./mlflow.db``). The expert path is, inside the version folder:
the folder itself if the checkpoint reader can open it (HF folder, one ``*.safetensors``, adapter
folder); else its single entry, recursively (``runs:/<run>/expert`` downloads as
``<version>/expert``); else its single weight file; else the folder (the service's validation then
rejects it with a reason). MLflow model *flavors* (``MLmodel`` + ``data/``) are not unpacked: log
experts as plain artifacts.

Verification: a download can end early without an error (a proxy or a store cutting the stream).
Every copy is compared with the artifact listing of its URI (:func:`artifact_listing`: every file
with its size in bytes; MLflow's listing carries no hashes, so sizes are what is compared, and a
file whose size the store does not give is only checked to exist): a fresh download before it is
renamed into the cache, and a cached copy each time it is reused. A copy that does not match
(:class:`DownloadIncomplete`) is discarded and fetched again at once, up to :data:`REFETCHES` times,
then it counts as a failed attempt of the ordinary retries.
"""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
import re
import shutil
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import OutsideRootError
from ...io.paths import confined
from ...redaction import redact_uris
from .readiness import FILE_SUFFIXES, folder_member, loadable_folder

log = logging.getLogger(__name__)


#: Fresh downloads made at once after a copy that does not match the artifact listing.
REFETCHES = 2


class VersionDeleted(Exception):
    """The model version no longer exists in the registry."""


class DownloadIncomplete(Exception):
    """A downloaded or cached copy does not match the artifact listing (a file missing or of
    another size than listed)."""


def is_not_found(exc: Exception) -> bool:
    """True if an MLflow error says the thing asked for does not exist (``RESOURCE_DOES_NOT_EXIST``)."""
    return "RESOURCE_DOES_NOT_EXIST" in str(getattr(exc, "error_code", ""))


def artifact_listing(uri: str, *, tracking_uri: str | None, registry_uri: str | None) -> dict[str, int | None]:
    """Every file of the artifact at ``uri`` as the store lists it: path relative to the artifact
    (``""`` when the artifact is a single file) -> size in bytes, or None where the store gives no
    size. ``{}`` when nothing is listed there.

    Raises:
        Exception: the store cannot be asked (MLflow's errors, network errors).
    """
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    repo = get_artifact_repository(uri, tracking_uri=tracking_uri, registry_uri=registry_uri)
    out: dict[str, int | None] = {}

    def walk(path: str | None) -> None:
        for fi in repo.list_artifacts(path):
            if fi.is_dir:
                walk(fi.path)
            else:
                out[fi.path] = fi.file_size

    walk(None)
    if out:
        return out
    parent, _, name = uri.rstrip("/").rpartition("/")  # a single file lists as nothing: ask its folder
    if parent and name:
        prepo = get_artifact_repository(parent, tracking_uri=tracking_uri, registry_uri=registry_uri)
        for fi in prepo.list_artifacts(None):
            if not fi.is_dir and posixpath.basename(fi.path) == name:
                return {"": fi.file_size}
    return {}


def verify_copy(local: Path, listing: dict[str, int | None], what: str) -> None:
    """Check the local copy ``local`` (the file or folder a download produced) against ``listing``
    (:func:`artifact_listing`): every listed file of the expert exists with the listed size (for a
    folder, the files :func:`~.readiness.folder_member` takes: ``.gitattributes`` and other hidden
    or temporary names are not part of the expert).

    Raises:
        DownloadIncomplete: the listing is empty, or a file is missing or of another size (the
            first few named, with both sizes in bytes), or named outside the copy
            (:func:`mergestream.io.paths.confined`).
    """
    if not listing:
        raise DownloadIncomplete(f"{what}: the artifact listing names no files")
    problems = []
    for rel, size in sorted(listing.items()):
        try:
            path = confined(local, rel, "artifact", error=OutsideRootError) if rel else local
        except OutsideRootError as exc:  # never stat (or trust) a file the listing names outside the copy
            problems.append(str(exc))
            continue
        if rel and not folder_member(rel):
            continue
        try:
            have = path.stat().st_size if path.is_file() else None
        except OSError:
            have = None
        if have is None:
            problems.append(f"{rel or local.name} is missing")
        elif size is not None and have != size:
            problems.append(f"{rel or local.name} is {have} bytes, the listing says {size}")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise DownloadIncomplete(f"{what}: {'; '.join(problems[:3])}{more}")


def _safe_dirname(name: str) -> str:
    """A folder name for a registered model name (which may hold '/', spaces, ...)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    if safe != name or safe.startswith("."):
        safe = f"{safe.lstrip('.')}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"
    return safe


def resolve_expert_path(p: Path) -> Path:
    """What to hand the checkpoint reader inside the downloaded version folder ``p`` (see the
    module docstring); ``p`` itself when nothing narrower fits."""
    for _ in range(16):  # depth bound
        if p.is_file() or loadable_folder(p):
            return p
        entries = [e for e in p.iterdir() if folder_member(e.name)]
        if len(entries) == 1:
            p = entries[0]
            continue
        weights = [e for e in entries if e.is_file() and e.name.endswith(FILE_SUFFIXES)]
        return weights[0] if len(weights) == 1 else p
    return p


class VersionDownloads:
    """Fetch registry versions into ``cache_dir/<model>/<version>/``, retrying failed downloads.

    Args:
        cache_dir: root of the cache (created on first download).
        client: returns the ``MlflowClient`` to ask for download URIs and logged models.
        tracking_uri, registry_uri: handed to ``mlflow.artifacts.download_artifacts``.
        max_retries: download retries after the first attempt.
        backoff_seconds: first retry delay (seconds); doubles each retry, capped at 60 s.
        stopping: once set, no further retry is made and a backoff sleep ends early.
    """

    def __init__(self, cache_dir: Path, client: Callable[[], Any], *, tracking_uri: str | None,
                 registry_uri: str | None, max_retries: int, backoff_seconds: float, stopping: threading.Event):
        self.cache_dir = Path(cache_dir)
        self.client = client
        self.tracking_uri = tracking_uri
        self.registry_uri = registry_uri
        self.max_retries = int(max_retries)
        self.backoff_seconds = float(backoff_seconds)
        self.stopping = stopping
        self._locks: dict[tuple[str, int], threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def model_dir(self, model: str) -> Path:
        """``cache_dir/<model as a safe folder name>``."""
        return self.cache_dir / _safe_dirname(model)

    def clean_stale(self, models: list[str]) -> None:
        """Remove the temporary folders of downloads interrupted earlier (a crash, a kill)."""
        for model in models:
            d = self.model_dir(model)
            if d.is_dir():
                for tmp in d.glob(".*.tmp-*"):
                    shutil.rmtree(tmp, ignore_errors=True)

    def fetch(self, model: str, version: int, *, retries: int | None = None) -> tuple[Path, str]:
        """Download (with retries) or reuse the cached copy, verified against the artifact listing
        (a copy that does not match is discarded and fetched again); returns (expert path,
        download URI). One fetch of a version at a time (the poll and the service's check).

        Args:
            retries: retries after the first attempt (None: ``max_retries``).

        Raises:
            VersionDeleted: the version is gone from the registry.
            Exception: the last error after the retries (:class:`DownloadIncomplete` when the
                copies never matched the listing).
        """
        retries = self.max_retries if retries is None else int(retries)
        with self._locks_guard:
            lock = self._locks.setdefault((model, version), threading.Lock())
        with lock:
            attempt = refetched = 0
            while True:
                try:
                    return self._fetch_once(model, version)
                except VersionDeleted:
                    raise
                except DownloadIncomplete as exc:
                    if refetched < REFETCHES and not self.stopping.is_set():
                        refetched += 1
                        log.warning("incomplete copy discarded, fetching model=%s version=%d again: %s",
                                    model, version, exc)
                        continue
                    err: Exception = exc
                except Exception as exc:
                    err = exc
                if attempt >= retries or self.stopping.is_set():
                    raise err
                delay = min(60.0, self.backoff_seconds * 2 ** attempt)
                attempt += 1
                log.warning("download attempt %d failed model=%s version=%d: %s: %s; retrying in %.1f s",
                            attempt, model, version, type(err).__name__, err, delay)
                if self.stopping.wait(delay):
                    raise err

    def _fetch_once(self, model: str, version: int) -> tuple[Path, str]:
        import mlflow.artifacts

        client = self.client()
        try:
            uri = client.get_model_version_download_uri(model, str(version))
        except Exception as exc:
            if is_not_found(exc):
                raise VersionDeleted() from exc
            raise
        if uri.startswith("models:/"):
            uri = self._resolve_models_uri(uri)
        listing = artifact_listing(uri, tracking_uri=self.tracking_uri, registry_uri=self.registry_uri)
        shown = redact_uris(uri)  # how the location is named in messages and logs
        final = self.model_dir(model) / str(version)
        if final.is_dir():
            entries = [e for e in final.iterdir() if not e.name.startswith(".")]
            try:
                if len(entries) != 1:
                    raise DownloadIncomplete(f"cached copy {final} holds {len(entries)} entries, not 1")
                verify_copy(entries[0], listing, f"cached copy of {shown}")
                log.debug("cache hit model=%s version=%d path=%s", model, version, final)
                return resolve_expert_path(final), uri
            except DownloadIncomplete as exc:
                log.warning("cached copy discarded model=%s version=%d: %s; downloading it again", model, version, exc)
                shutil.rmtree(final, ignore_errors=True)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{version}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            local = mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(tmp),
                                                        tracking_uri=self.tracking_uri,
                                                        registry_uri=self.registry_uri)
            if not any(f.is_file() for f in tmp.rglob("*")):
                raise FileNotFoundError(f"downloading {shown} produced no files")
            verify_copy(Path(local), listing, f"download of {shown}")
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir():
                    raise
                log.debug("cache folder appeared concurrently: %s", final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        log.info("downloaded model=%s version=%d from %s to %s", model, version, shown, final)
        return resolve_expert_path(final), uri

    def _resolve_models_uri(self, uri: str) -> str:
        """``models:/m-<id>[/path]`` (an MLflow 3 logged model) -> its artifact location, through our
        client (see the module docstring: MLflow resolves ``models:/`` with the global registry)."""
        rest = uri[len("models:/"):]
        model_id, _, sub = rest.partition("/")
        if not model_id.startswith("m-"):
            raise ValueError(f"cannot resolve registry download URI {redact_uris(uri)!r}")
        loc = self.client().get_logged_model(model_id).artifact_location.rstrip("/")
        return f"{loc}/{sub}" if sub else loc
