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
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .readiness import FILE_SUFFIXES, loadable_folder

log = logging.getLogger(__name__)


class VersionDeleted(Exception):
    """The model version no longer exists in the registry."""


def _is_not_found(exc: Exception) -> bool:
    return getattr(exc, "error_code", None) == "RESOURCE_DOES_NOT_EXIST"


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
        entries = [e for e in p.iterdir() if not e.name.startswith(".")]
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

    def fetch(self, model: str, version: int) -> tuple[Path, str]:
        """Download (with retries) or reuse the cached copy; returns (expert path, download URI).

        Raises:
            VersionDeleted: the version is gone from the registry.
            Exception: the last download error after ``max_retries`` retries.
        """
        attempt = 0
        while True:
            try:
                return self._fetch_once(model, version)
            except VersionDeleted:
                raise
            except Exception as exc:
                if attempt >= self.max_retries or self.stopping.is_set():
                    raise
                delay = min(60.0, self.backoff_seconds * 2 ** attempt)
                attempt += 1
                log.warning("download attempt %d failed model=%s version=%d: %s: %s; retrying in %.1f s",
                            attempt, model, version, type(exc).__name__, exc, delay)
                if self.stopping.wait(delay):
                    raise

    def _fetch_once(self, model: str, version: int) -> tuple[Path, str]:
        import mlflow.artifacts

        client = self.client()
        try:
            uri = client.get_model_version_download_uri(model, str(version))
        except Exception as exc:
            if _is_not_found(exc):
                raise VersionDeleted() from exc
            raise
        if uri.startswith("models:/"):
            uri = self._resolve_models_uri(uri)
        final = self.model_dir(model) / str(version)
        if final.is_dir():
            log.debug("cache hit model=%s version=%d path=%s", model, version, final)
            return resolve_expert_path(final), uri
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{version}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(tmp),
                                                tracking_uri=self.tracking_uri, registry_uri=self.registry_uri)
            if not any(f.is_file() for f in tmp.rglob("*")):
                raise FileNotFoundError(f"downloading {uri} produced no files")
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir():
                    raise
                log.debug("cache folder appeared concurrently: %s", final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        log.info("downloaded model=%s version=%d from %s to %s", model, version, uri, final)
        return resolve_expert_path(final), uri

    def _resolve_models_uri(self, uri: str) -> str:
        """``models:/m-<id>[/path]`` (an MLflow 3 logged model) -> its artifact location, through our
        client (see the module docstring: MLflow resolves ``models:/`` with the global registry)."""
        rest = uri[len("models:/"):]
        model_id, _, sub = rest.partition("/")
        if not model_id.startswith("m-"):
            raise ValueError(f"cannot resolve registry download URI {uri!r}")
        loc = self.client().get_logged_model(model_id).artifact_location.rstrip("/")
        return f"{loc}/{sub}" if sub else loc
