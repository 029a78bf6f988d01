"""MLflow tracking: one run per fold, accepted versions registered with an alias on the current one.

Every call goes through :meth:`Tracker.submit`: it is tried at once and, if MLflow is unreachable
or errors, stored in the ledger's outbox, counted, and retried by :meth:`Tracker.retry_pending`
from the service loop. Folding never waits for tracking.

Operations (``kind``, payload):
    ``fold``   log a run (parameters, probe metrics, timings, decision, the ``fold.json`` and patch
               artifacts); if accepted, register the version as a new model version of
               ``registered_model`` (``MlflowClient.create_model_version`` with the run's artifact
               URI as source and the local version path as a tag) and remember the mapping.
    ``alias``  point ``alias`` at the model version of the store's current version (read at
               execution time, so a late retry never moves the alias backwards).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import Config, MlflowConfig
from ..redaction import redact_uris
from .ledger import Ledger
from .metrics import Metrics

log = logging.getLogger(__name__)


def _error_text(exc: BaseException) -> str:
    """``Type: message`` of a failed call, as the outbox keeps it (URIs redacted)."""
    return redact_uris(f"{type(exc).__name__}: {exc}")


class TrackingNotReady(Exception):
    """An operation depends on another one still waiting in the outbox."""


class Tracker:
    """MLflow client wrapper with an outbox in the ledger."""

    def __init__(self, cfg: MlflowConfig, tracking_uri: str, ledger: Ledger, metrics: Metrics,
                 current_version: Callable[[], int | None], artifact_location: str | None = None):
        self.cfg = cfg
        self.uri = tracking_uri
        self.artifact_location = artifact_location
        self.ledger = ledger
        self.metrics = metrics
        self.current_version = current_version
        self._client = None
        self._experiment_id: str | None = None

    @property
    def client(self):
        if self._client is None:
            from mlflow import MlflowClient

            self._client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        return self._client

    def submit(self, kind: str, payload: dict[str, Any]) -> bool:
        """Run an operation now; on failure queue it in the outbox. Returns True if it ran."""
        if not self.cfg.enabled:
            return True
        try:
            self._run(kind, payload)
            return True
        except Exception as exc:  # any MLflow/network failure: retried later, never fatal
            self.metrics.tracking_errors.inc()
            self.ledger.outbox_add(kind, payload, _error_text(exc))
            self.metrics.tracking_pending.set(len(self.ledger.outbox()))
            log.warning("tracking %s failed, queued for retry: %s", kind, redact_uris(exc))
            return False

    def retry_pending(self) -> int:
        """Retry queued operations in order; stops at the first that still fails. Returns how many ran."""
        done = 0
        for item in self.ledger.outbox():
            try:
                self._run(item["kind"], item["payload"])
            except Exception as exc:
                if not isinstance(exc, TrackingNotReady):
                    self.metrics.tracking_errors.inc()
                self.ledger.outbox_failed(item["row"], _error_text(exc))
                break
            self.ledger.outbox_done(item["row"])
            done += 1
        self.metrics.tracking_pending.set(len(self.ledger.outbox()))
        return done

    # -- operations -------------------------------------------------------------------------------
    def _run(self, kind: str, payload: dict[str, Any]) -> None:
        if kind == "fold":
            self._log_fold(payload)
        elif kind == "alias":
            self._move_alias()
        else:
            raise ValueError(f"unknown tracking operation {kind!r}")

    def _experiment(self) -> str:
        if self._experiment_id is None:
            exp = self.client.get_experiment_by_name(self.cfg.experiment)
            self._experiment_id = exp.experiment_id if exp else self.client.create_experiment(
                self.cfg.experiment, artifact_location=self.artifact_location)
        return self._experiment_id

    def _log_fold(self, p: dict[str, Any]) -> None:
        from mlflow.entities import Metric, Param, RunTag

        c = self.client
        run_id = p.get("run_id")
        if run_id is None:
            run = c.create_run(self._experiment(), run_name=p.get("run_name"),
                               tags={"mergestream.kind": p.get("kind", "fold"),
                                     "mergestream.expert": str(p.get("expert_id")),
                                     "mergestream.decision": str(p.get("decision"))})
            run_id = run.info.run_id
            p["run_id"] = run_id  # a retry after a later failure reuses the run
            ts = int(p.get("started", 0) * 1000)
            params = [Param(k, redact_uris(v if isinstance(v, str) else json.dumps(v))[:6000])
                      for k, v in p.get("params", {}).items()]
            metrics = [Metric(k, float(v), ts, 0) for k, v in p.get("metrics", {}).items()]
            tags = [RunTag(k, redact_uris(v)[:5000]) for k, v in p.get("tags", {}).items()]
            c.log_batch(run_id, metrics=metrics, params=params, tags=tags)
            for art in p.get("artifacts", []):
                if Path(art).exists():
                    c.log_artifact(run_id, art)
            c.set_terminated(run_id, "FINISHED")
        if p.get("register_version") is not None:
            self._register(run_id, int(p["register_version"]), p.get("version_path", ""))

    def _register(self, run_id: str, version: int, path: str) -> None:
        c = self.client
        name = self.cfg.registered_model
        if not self._has_model(name):
            c.create_registered_model(name, description="mergestream backbone versions")
        run = c.get_run(run_id)
        mv = c.create_model_version(name, source=run.info.artifact_uri, run_id=run_id,
                                    tags={"mergestream.version": str(version), "mergestream.path": path})
        mapping = self.ledger.get_meta("mlflow_versions") or {}
        mapping[str(version)] = mv.version
        self.ledger.set_meta("mlflow_versions", mapping)

    def _has_model(self, name: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(name)
            return True
        except MlflowException as exc:
            if "RESOURCE_DOES_NOT_EXIST" in str(exc.error_code) or "not found" in str(exc).lower():
                return False
            raise

    def _move_alias(self) -> None:
        cur = self.current_version()
        if cur is None:
            return
        mapping = self.ledger.get_meta("mlflow_versions") or {}
        if str(cur) not in mapping:
            raise TrackingNotReady(f"version {cur} is not registered yet")
        self.client.set_registered_model_alias(self.cfg.registered_model, self.cfg.alias, mapping[str(cur)])


def make_tracker(cfg: Config, ledger: Ledger, metrics: Metrics, current_version: Callable[[], int | None]) -> Tracker:
    """The daemon's :class:`Tracker` for ``cfg`` (also an operator command's run without a daemon).

    MLflow is set up once here (environment defaults, which an operator's own settings override):
    no artifact progress bars, no database-setup lines in our log, and a tracking outage costs a
    fold seconds, not minutes of HTTP retries (failed calls go to the outbox, retried by the loop).
    The default sqlite store keeps its artifacts inside the state folder too (not in ``./mlruns``).
    """
    import os

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    artifacts = None if cfg.mlflow.tracking_uri else (cfg.state_dir / "mlartifacts").resolve().as_uri()
    return Tracker(cfg.mlflow, cfg.tracking_uri(), ledger, metrics, current_version, artifact_location=artifacts)
