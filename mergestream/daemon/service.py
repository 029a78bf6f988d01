"""The service loop: dequeue -> fold -> probe -> gate -> publish | roll back; signals; resume.

One fold at a time, in arrival order. Sources (folder watcher, registry poller) only enqueue into
the ledger; the loop claims the oldest pending expert, folds it into a staging folder through the
engine, probes the candidate, asks the gate, and either publishes it as the next version (moving
``current`` atomically) or discards it. Operator commands (rollback, unmerge, retry) reach a running
daemon through the ledger's command table and run on the same loop, so nothing races a fold.

Crash safety: ``current`` always names a complete version. On start the service removes stale
staging folders and puts experts left ``folding`` back to pending, so an interrupted expert is
folded exactly once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

from .. import engine
from ..config import Config
from ..errors import CheckpointError, MergestreamError, ValidationError
from ..expert_readers import content_sha256
from ..state import StateDir
from . import gate
from .ledger import ExpertRow, Ledger
from .metrics import Metrics, MetricsServer
from .store import Store
from .tracking import Tracker

log = logging.getLogger("mergestream.service")


#: rows registered with the one content hash say so (rows of older versions used a file hash)
_HASH_KEY, _HASH_KIND = "mergestream.hash", "weights/1"


class _PreStepRejected(MergestreamError):
    """A pre-step (RI) refused the expert; it is rejected with this reason."""


class _StopRequested(Exception):
    """Raised inside a fold (per tensor, per RI step, per CMA-ES evaluation) once a stop was asked:
    the fold is abandoned and its expert stays queued for the next start."""


class Service:
    """The daemon. ``start()`` takes the lock and starts everything; ``run()`` loops until stopped."""

    def __init__(self, cfg: Config, *, registry=None, serve_metrics: bool = True, watch_sources: bool = True):
        self.cfg = cfg
        self.store = Store(cfg.state_dir)
        self.metrics = Metrics(registry)
        self.ledger: Ledger | None = None
        self.tracker: Tracker | None = None
        self.server: MetricsServer | None = None
        self.sources: list[Any] = []
        self.webhook = None
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self._serve_metrics = serve_metrics and cfg.metrics.enabled
        self._watch = watch_sources
        self._probes: list[Any] | None = None
        self._last_retry = 0.0
        self._delay = float(os.environ.get("MERGESTREAM_FOLD_DELAY_SECONDS", "0") or 0)  # testing aid

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Lock the state folder, open the ledger, clean up after a crash, start metrics and sources.

        Raises:
            LockedError: another daemon holds the state folder.
            ConfigError: ``policy.preprocess`` has ``ri`` and its auxiliary data cannot be read.
        """
        if "ri" in self.cfg.policy.preprocess:  # fail fast on a bad RI data file, before any work
            from ..config import ConfigError
            from ..ri import RIError, read_aux

            try:
                n = len(read_aux(self.cfg.policy.ri.data, self.cfg.policy.ri.max_examples))
            except RIError as exc:
                raise ConfigError(f"policy.ri.data: {exc}") from None
            log.info("ri pre-step enabled: %d auxiliary inputs from %s", n, self.cfg.policy.ri.data)
        self.store.lock()
        self.cfg.state_dir.mkdir(parents=True, exist_ok=True)
        self.cfg.inbox.mkdir(parents=True, exist_ok=True)
        self.ledger = Ledger(self.cfg.state_dir / "ledger.sqlite")
        stale = self.store.clean_staging()
        requeued = self.ledger.requeue_interrupted()
        if stale or requeued:
            log.warning("resumed after an interruption: removed %d staging folder(s), re-queued %s", stale, requeued)
        if self.cfg.torch_threads:
            import torch

            torch.set_num_threads(self.cfg.torch_threads)
        # the default sqlite store keeps its artifacts inside the state folder too (not in ./mlruns)
        artifacts = None if self.cfg.mlflow.tracking_uri else (self.cfg.state_dir / "mlartifacts").resolve().as_uri()
        self.tracker = Tracker(self.cfg.mlflow, self.cfg.tracking_uri(), self.ledger, self.metrics, self.store.current,
                               artifact_location=artifacts)
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        # a tracking outage must cost a fold seconds, not MLflow's minutes of HTTP retries: failed
        # calls go to the outbox and are retried by the loop instead
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        logging.getLogger("apscheduler").setLevel(logging.WARNING)
        self._refresh_gauges()
        self.metrics.beat()
        self.metrics.up.set(1)
        if self._serve_metrics:
            self.server = MetricsServer(self.metrics, self.cfg.metrics.host, self.cfg.metrics.port)
            self.server.start()
            log.info("metrics on http://%s:%d/metrics", self.cfg.metrics.host, self.server.port)
        self._base_probes()
        if self._watch:
            self._start_sources()
        self.metrics.ready = True
        log.info("daemon ready state_dir=%s policy=%s current=%s", self.cfg.state_dir, self.cfg.policy.name,
                 self.store.current())

    def _start_sources(self) -> None:
        from .sources import FolderSource, RegistrySource

        w = self.cfg.watch
        if w.enabled:
            src = FolderSource(self.cfg.inbox, self.on_expert_ready, settle_seconds=w.settle_seconds,
                               polling=w.polling, poll_interval=w.poll_interval)
            src.start()
            self.sources.append(src)
        r = self.cfg.mlflow.registry
        if r.enabled and r.models:
            reg = RegistrySource(r.models, self.on_expert_ready, last_version=self._last_registry_version,
                                 cache_dir=self.cfg.state_dir / "cache", tracking_uri=r.tracking_uri or self.cfg.tracking_uri(),
                                 registry_uri=r.tracking_uri or self.cfg.tracking_uri(),
                                 interval_seconds=r.interval_seconds, tag_filter=r.tag_filter or None,
                                 max_retries=r.max_retries, backoff_seconds=r.backoff_seconds,
                                 on_error=lambda exc: self.metrics.source_errors.labels(source="mlflow").inc())
            reg.start()
            self.sources.append(reg)
            wh = self.cfg.mlflow.webhook
            if wh.enabled:
                from .sources import WebhookReceiver

                if wh.secret is None:
                    raise MergestreamError("mlflow.webhook.enabled needs a secret (MERGESTREAM_MLFLOW__WEBHOOK__SECRET)")
                self.webhook = WebhookReceiver(wh.host, wh.port, wh.secret.get_secret_value(), reg.trigger)
                self.webhook.start()

    def stop(self) -> None:
        """Ask the loop to stop (signal-safe). A fold in progress is abandoned at its next tensor
        (or RI step, or CMA-ES evaluation): its staging is removed and the expert is folded again
        on the next start. Probes of a finished fold run to the end."""
        self.stopping.set()
        self.wake.set()

    def _check_stop(self) -> None:
        if self.stopping.is_set():
            raise _StopRequested()

    def shutdown(self) -> None:
        for s in self.sources:
            try:
                s.stop()
            except Exception:  # pragma: no cover - best effort on the way out
                log.exception("stopping source %s", s)
        if self.webhook is not None:
            self.webhook.stop()
        if self.server is not None:
            self.server.stop()
        self.metrics.up.set(0)
        if self.ledger is not None:
            self.ledger.close()
        self.store.unlock()
        log.info("daemon stopped")

    def run(self) -> None:
        """Start, then loop until SIGTERM/SIGINT; always shuts down cleanly."""
        def on_signal(signum, _frame) -> None:
            if not self.stopping.is_set():
                # os.write: no logging lock inside a signal handler
                os.write(2, f"mergestream: {signal.Signals(signum).name} received, stopping "
                            f"(a fold in progress is abandoned and redone on the next start)\n".encode())
            self.stop()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        self.start()
        try:
            while not self.stopping.is_set():
                if not self.step():
                    self.wake.wait(timeout=1.0)
                    self.wake.clear()
        finally:
            self.shutdown()

    def step(self) -> bool:
        """One loop iteration: commands, tracking retries, then at most one fold. True if it worked."""
        self.metrics.beat()
        worked = False
        for cmd in self.ledger.pending_commands():
            self.ledger.finish_command(cmd["row"], self.execute(cmd["verb"], cmd["arg"]))
            worked = True
        if time.time() - self._last_retry > self.cfg.mlflow.retry_seconds and self.ledger.outbox():
            self._last_retry = time.time()
            self.tracker.retry_pending()
        row = self.ledger.next_pending()
        if row is not None:
            self.fold_expert(row)
            worked = True
        self._refresh_gauges()
        return worked

    def execute(self, verb: str, arg: str | None) -> str:
        """Run an operator command; returns a JSON result {"ok": bool, "message": str}."""
        try:
            if verb == "rollback":
                msg = self.rollback(int(arg))
            elif verb == "unmerge":
                msg = self.unmerge(str(arg))
            elif verb == "retry":
                msg = self.retry(str(arg))
            else:
                raise MergestreamError(f"unknown command {verb!r}")
            return json.dumps({"ok": True, "message": msg})
        except MergestreamError as exc:
            return json.dumps({"ok": False, "message": str(exc)})

    # -- sources -> ledger ----------------------------------------------------------------------------
    def _last_registry_version(self, model: str) -> int:
        return int(self.ledger.get_cursor(f"mlflow:{model}", "0"))

    def on_expert_ready(self, ev) -> None:
        """Source callback (any thread): hash, enqueue idempotently, wake the loop."""
        try:
            sha = content_sha256(ev.uri)
        except OSError as exc:
            self.metrics.source_errors.labels(source=ev.source).inc()
            log.warning("cannot read expert %s: %s", ev.uri, exc)
            return
        meta = {**dict(ev.metadata), _HASH_KEY: _HASH_KIND}
        row, new = self.ledger.enqueue(ev.expert_id, ev.source, ev.uri, sha, ev.registry_key, meta)
        if ev.registry_key and ev.registry_key.startswith("mlflow:"):
            _, model, version = ev.registry_key.split(":", 2)
            if int(version) > self._last_registry_version(model):
                self.ledger.set_cursor(f"mlflow:{model}", version)
        if new:
            self.metrics.experts_seen.labels(source=ev.source).inc()
            log.info("expert queued id=%s source=%s uri=%s", row.expert_id, ev.source, ev.uri)
        self.metrics.queue_depth.set(self.ledger.queue_depth())
        self.wake.set()

    # -- probes -----------------------------------------------------------------------------------------
    def probes(self) -> list[Any]:
        if self._probes is None:
            from .probes import make_probe

            self._probes = [make_probe(p.type, **p.params) for p in self.cfg.probes]
        return self._probes

    def _task_specs(self, extra: Path | None = None) -> list[Any]:
        from .probes import discover_task_probe

        specs = []
        for row in self.ledger.experts():
            if row.status == "accepted":
                spec = discover_task_probe(self.cfg.state_dir / "tasks" / row.expert_id)
                if spec is not None:
                    specs.append(spec)
        if extra is not None and (spec := discover_task_probe(extra)) is not None:
            specs.append(spec)
        return specs

    def _run_probes(self, model_dir: Path, previous: Path | None, state_dir: Path | None,
                    candidate_expert: Path | None = None) -> dict[str, float]:
        from .probes import ProbeContext, run_probes

        contributions = []
        if state_dir is not None and (state_dir / "manifest.json").exists():
            sd = StateDir(state_dir)
            contributions = [state_dir / f.contribution for f in sd.manifest.folds if f.contribution]
        ctx = ProbeContext(base=Path(self.cfg.base), previous=previous, contributions=contributions,
                           tasks=self._task_specs(candidate_expert), device=self.cfg.device,
                           tokenizer=Path(self.cfg.base) if Path(self.cfg.base).is_dir() else None)
        return run_probes(self.probes(), model_dir, ctx)

    def _base_probes(self) -> dict[str, float]:
        key = hashlib.sha256(json.dumps([str(self.cfg.base), [p.model_dump() for p in self.cfg.probes]],
                                        sort_keys=True, default=str).encode()).hexdigest()[:16]
        cached = self.ledger.get_meta("base_probes")
        if cached and cached.get("key") == key:
            return cached["values"]
        values = self._run_probes(Path(self.cfg.base), None, None)
        self.ledger.set_meta("base_probes", {"key": key, "values": values})
        return values

    def _current_probes(self) -> dict[str, float] | None:
        cur = self.store.current()
        if cur is None:
            return None
        return self.store.fold_json(cur).get("probes")

    # -- the fold ---------------------------------------------------------------------------------------
    def fold_expert(self, row: ExpertRow) -> str:
        """Fold one claimed expert; returns its final status (accepted, rejected, failed).

        With ``policy.preprocess: [ri]`` the expert is first adapted by the RI pre-step
        (:meth:`_ri_pre_step`); with ``mdm_oc`` and ``coefficients: cmaes`` the coefficients are
        chosen by CMA-ES on the data probes (:meth:`_probe_objective`). Both are recorded in the
        fold's timings (MLflow metrics) and in ``fold.json``.
        """
        t0 = time.time()
        pol = self.cfg.policy
        staging = self.store.new_staging()
        cur = self.store.current_path()
        backbone = cur / "model" if cur else None
        timings: dict[str, float] = {}
        extra: dict[str, Any] = {}
        log.info("fold start expert=%s policy=%s backbone=%s", row.expert_id, pol.name, backbone)
        if row.registry_key and not self._registry_version_exists(row.registry_key):
            return self._finish(row, staging, t0, "rejected", "the registry version was deleted before it was folded",
                                {}, timings, stage="validation")
        candidate_expert = Path(row.uri) if Path(row.uri).is_dir() else None
        src = row.uri
        try:
            if "ri" in pol.preprocess:
                src = self._ri_pre_step(row, candidate_expert, timings, extra)
            objective = None
            if pol.name == "mdm_oc" and pol.params.get("coefficients") == "cmaes":
                objective = self._probe_objective(candidate_expert)
            self.store.carry_state(staging / "state")
            hook = self._tensor_hook()
            # the ledger's hash is the one the fold computes on its own pass: an expert changed since
            # it was registered is refused (unless RI replaced it with its adapted copy)
            rep = engine.fold(self.cfg.base, backbone, src, pol.name, pol.params, state_dir=staging / "state",
                              out=staging / "model", expert_id=row.expert_id, device=self.cfg.device,
                              threads=self.cfg.fold_threads, max_shard_bytes=self.cfg.max_shard_bytes,
                              tensor_hook=hook, objective=objective,
                              expect_sha256=row.sha256 if src == row.uri and
                              row.metadata.get(_HASH_KEY) == _HASH_KIND else None)
            timings["fold_seconds"] = rep.seconds
            self.metrics.bytes_read.inc(rep.bytes_read)
            self.metrics.bytes_written.inc(rep.bytes_written)
            params = dict(rep.params)
            if rep.coefficients is not None:
                params["coefficients_all"] = [round(c, 6) for c in rep.coefficients]
            if rep.search is not None:
                timings.update({f"cmaes_{k}": float(v) for k, v in rep.search.items()})
                extra["cmaes"] = {**rep.search, "coefficients": rep.coefficients,
                                  "evaluations_log": [{"alphas": a, **v} for a, v in objective.evaluations]}
        except _StopRequested:
            shutil.rmtree(staging, ignore_errors=True)
            self._drop_ri(row.expert_id)
            self.ledger.requeue_interrupted()
            log.warning("fold of %s abandoned: stop requested; it stays queued for the next start", row.expert_id)
            return "pending"
        except _PreStepRejected as exc:
            outcome = self._finish(row, staging, t0, "rejected", str(exc), {}, timings, stage="preprocess")
        except (ValidationError, CheckpointError, FileNotFoundError) as exc:
            outcome = self._finish(row, staging, t0, "rejected", f"{type(exc).__name__}: {exc}", {}, timings,
                                   stage="validation")
        except MergestreamError as exc:
            outcome = self._finish(row, staging, t0, "failed", f"{type(exc).__name__}: {exc}", {}, timings)
        except Exception as exc:  # a bug or an environment problem: record it, keep serving
            log.exception("fold of %s failed", row.expert_id)
            outcome = self._finish(row, staging, t0, "failed", f"{type(exc).__name__}: {exc}", {}, timings)
        else:
            outcome = self._probe_gate_publish(row, staging, t0, timings, params, kind="fold",
                                               candidate_expert=candidate_expert, extra=extra)
        if outcome != "accepted":
            self._drop_ri(row.expert_id)  # only an accepted expert's adapted copy is kept (for replay)
        return outcome

    # -- data-driven extras -----------------------------------------------------------------------------
    def _ri_dir(self, expert_id: str) -> Path:
        return self.cfg.state_dir / "ri" / expert_id

    def _drop_ri(self, expert_id: str) -> None:
        shutil.rmtree(self._ri_dir(expert_id), ignore_errors=True)

    def _ri_pre_step(self, row: ExpertRow, expert_dir: Path | None, timings: dict[str, float],
                     extra: dict[str, Any]) -> str:
        """Adapt the expert with RI; returns the path to fold (the adapted copy, kept under
        ``state_dir/ri/<expert>`` while the expert is in the backbone so replay can re-read it).

        Raises:
            _PreStepRejected: the expert has no task head and ``ri.on_missing_head`` is reject,
                or RI cannot run on it (bad auxiliary data, unloadable expert, mismatched head).
        """
        from ..ri import RIError, RIParams, adapt_expert, load_feature_model, read_aux
        from .probes import _has_tokenizer, discover_task_probe, load_head

        rc = self.cfg.policy.ri
        spec = discover_task_probe(expert_dir) if expert_dir is not None else None
        if spec is None:
            msg = "RI needs the expert's task head (mergestream_probe/) and it has none"
            if rc.on_missing_head == "reject":
                raise _PreStepRejected(msg)
            log.warning("%s: folding %s unadapted", msg, row.expert_id)
            extra["ri"] = {"skipped": msg}
            timings["ri_skipped"] = 1.0
            return row.uri
        others = [s for s in self._task_specs() if s.task != spec.task]
        try:
            aux = read_aux(rc.data, rc.max_examples)
            tok = expert_dir if _has_tokenizer(expert_dir) else Path(self.cfg.base)
            fm = load_feature_model(rc.forward, tokenizer=tok, pooling=spec.pooling, max_length=rc.max_length)
            params = RIParams(alpha=rc.alpha, steps=rc.steps, time_budget_seconds=rc.time_budget_seconds, lr=rc.lr,
                              batch_size=rc.batch_size, max_length=rc.max_length)

            def progress(step: int, loss: float) -> None:
                self.metrics.beat()
                self._check_stop()
                if step % 10 == 0 or step == params.steps:
                    log.info("ri expert=%s step=%d/%d loss=%.5g", row.expert_id, step, params.steps, loss)

            t = time.time()
            path, res = adapt_expert(expert_dir, self.cfg.base, self._ri_dir(row.expert_id),
                                     own_head=load_head(spec.head, spec.task),
                                     other_heads=[load_head(s.head, s.task) for s in others], aux=aux, params=params,
                                     feature_model=fm, cache_dir=self.cfg.state_dir / "cache", device=self.cfg.device,
                                     progress=progress)
        except RIError as exc:
            raise _PreStepRejected(f"RI pre-step: {exc}") from exc
        timings.update(ri_seconds=time.time() - t, ri_steps=float(res.steps), ri_loss_before=res.loss_before,
                       ri_loss_after=res.loss_after)
        extra["ri"] = {**res.to_json(), "other_tasks": [s.task for s in others]}
        return str(path)

    def _probe_objective(self, candidate_expert: Path | None):
        """The CMA-ES objective on the data probes (task heads incl. the candidate's, and the
        configured sentence_similarity probe), see :class:`mergestream.daemon.objective.ProbeObjective`."""
        from .objective import ProbeObjective
        from .probes import SentenceSimilarityProbe

        oc = self.cfg.policy.objective
        general = next((p for p in self.probes() if isinstance(p, SentenceSimilarityProbe)), None)
        base = Path(self.cfg.base)
        return ProbeObjective(base, self._task_specs(candidate_expert), general, tokenizer=base,
                              task_weight=oc.task_weight, general_weight=oc.general_weight,
                              examples_per_task=oc.examples_per_task, general_pairs=oc.general_pairs,
                              device=self.cfg.device, on_eval=lambda *_: (self.metrics.beat(), self._check_stop()))

    def _tensor_hook(self):
        delay = self._delay

        def hook(_name: str) -> None:
            self.metrics.beat()
            self._check_stop()
            if delay:
                time.sleep(delay)

        return hook

    def _registry_version_exists(self, key: str) -> bool:
        if not key.startswith("mlflow:"):
            return True
        _, model, version = key.split(":", 2)
        try:
            from mlflow import MlflowClient

            uri = self.cfg.mlflow.registry.tracking_uri or self.cfg.tracking_uri()
            MlflowClient(tracking_uri=uri, registry_uri=uri).get_model_version(model, version)
            return True
        except Exception as exc:
            if "RESOURCE_DOES_NOT_EXIST" in str(getattr(exc, "error_code", "")) or "not found" in str(exc).lower():
                log.warning("skipping %s: version %s of %s was deleted from the registry", key, version, model)
                return False
            return True  # registry unreachable: fold what we already downloaded

    def _probe_gate_publish(self, row: ExpertRow | None, staging: Path, t0: float, timings: dict[str, float],
                            params: dict[str, Any], kind: str, candidate_expert: Path | None = None,
                            unmerged: str | None = None, extra: dict[str, Any] | None = None) -> str:
        cur = self.store.current_path()
        try:
            tp = time.time()
            values = self._run_probes(staging / "model", cur / "model" if cur else None, staging / "state",
                                      candidate_expert)
            timings["probe_seconds"] = time.time() - tp
        except Exception as exc:
            log.exception("probes failed")
            return self._finish(row, staging, t0, "failed", f"probes failed: {type(exc).__name__}: {exc}", {}, timings,
                                kind=kind, params=params, subject=unmerged)
        for k, v in values.items():
            self.metrics.candidate_probe_value.labels(probe=k).set(v)
        base_values = self.ledger.get_meta("base_probes")
        decision = gate.evaluate(self.cfg.gate.rules, values, self._current_probes(),
                                 base_values["values"] if base_values else None, self.ledger.accepted_probe_history())
        if not decision.accepted:
            return self._finish(row, staging, t0, "rejected", decision.reason, values, timings, stage="gate",
                                kind=kind, params=params, subject=unmerged)
        return self._finish(row, staging, t0, "accepted", None, values, timings, kind=kind, params=params,
                            subject=unmerged, candidate_expert=candidate_expert, extra=extra)

    def _finish(self, row: ExpertRow | None, staging: Path, t0: float, outcome: str, reason: str | None,
                probes: dict[str, float], timings: dict[str, float], *, stage: str = "", kind: str = "fold",
                params: dict[str, Any] | None = None, subject: str | None = None,
                candidate_expert: Path | None = None, extra: dict[str, Any] | None = None) -> str:
        pol = self.cfg.policy
        seconds = time.time() - t0
        expert_id = row.expert_id if row else subject
        params = params or dict(pol.params)
        version = None
        patch_path = None
        if outcome == "accepted":
            prev = self.store.current()
            if prev is not None and self.cfg.write_patches:
                patch_path = self._write_patch(prev, staging, pol.name)
            fold_row = self.ledger.record_fold(kind, expert_id, pol.name, params, t0, seconds, timings, probes,
                                               outcome, reason, None)
            experts_in = StateDir(staging / "state").manifest.ids() if (staging / "state" / "manifest.json").exists() else []
            fold_doc = {"kind": kind, "expert": expert_id, "policy": pol.name, "params": params, "probes": probes,
                        "timings": timings, "decision": outcome, "experts": experts_in, "previous": prev,
                        "time": time.time(), **(extra or {})}
            version = self.store.publish(staging, fold_doc)
            self.ledger.add_version(version, str(self.store.path(version)), experts_in, fold_row)
            if kind == "fold" and row is not None:
                self.ledger.set_status(row.expert_id, "accepted", None, version)
                if candidate_expert is not None:
                    self._keep_task_probe(row.expert_id, candidate_expert)
            self.metrics.last_success.set(time.time())
            for k, v in probes.items():
                self.metrics.probe_value.labels(probe=k).set(v)
            removed = self.store.retain(self.cfg.retention)
            if removed:
                log.info("retention removed versions %s", removed)
            log.info("published version=%d expert=%s kind=%s seconds=%.2f", version, expert_id, kind, seconds)
        else:
            shutil.rmtree(staging, ignore_errors=True)
            self.ledger.record_fold(kind, expert_id, pol.name, params, t0, seconds, timings, probes, outcome, reason, None)
            if kind == "fold" and row is not None:
                self.ledger.set_status(row.expert_id, outcome, reason)
            if outcome == "rejected":
                self.metrics.experts_rejected.labels(stage=stage or "gate").inc()
                if stage == "gate":
                    self.metrics.rollbacks.inc()
            log.warning("%s %s expert=%s reason=%s", kind, outcome, expert_id, reason)
        self.metrics.folds.labels(policy=pol.name, outcome=outcome).inc()
        self.metrics.fold_duration.labels(policy=pol.name).observe(seconds)
        self._track(kind, expert_id, outcome, reason, params, probes, timings, t0, version, patch_path)
        self._refresh_gauges()
        return outcome

    def _write_patch(self, prev: int, staging: Path, policy: str) -> Path | None:
        try:
            from ..patch_build import build_patch
        except ImportError:  # pragma: no cover - patches are optional
            return None
        out = staging / f"patch-from-{prev:06d}.safetensors"
        try:
            stats = build_patch(self.store.path(prev) / "model", staging / "model", out,
                                source_version=str(prev), target_version=str(self.store.next_number()),
                                policy=policy)
        except Exception:
            log.exception("patch from version %d failed (the version is published without it)", prev)
            return None
        self.metrics.patch_bytes.set(stats["patch_bytes"])
        self.metrics.patch_ratio.set(stats["ratio"])
        return out

    def _keep_task_probe(self, expert_id: str, expert_dir: Path) -> None:
        from .probes import discover_task_probe

        try:
            spec = discover_task_probe(expert_dir)
        except MergestreamError as exc:
            log.warning("expert %s ships a malformed probe: %s", expert_id, exc)
            return
        if spec is None:
            return
        dest = self.cfg.state_dir / "tasks" / expert_id
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(expert_dir / "mergestream_probe", dest / "mergestream_probe")

    def _track(self, kind, expert_id, outcome, reason, params, probes, timings, t0, version, patch_path) -> None:
        artifacts = []
        if version is not None:
            artifacts.append(str(self.store.path(version) / "fold.json"))
            if patch_path is not None:
                artifacts.append(str(self.store.path(version) / patch_path.name))
        payload = {"kind": kind, "expert_id": expert_id, "decision": outcome, "started": t0,
                   "run_name": f"{kind}-{expert_id}", "params": {"policy": self.cfg.policy.name, **params},
                   "metrics": {**probes, **timings}, "tags": {"mergestream.reason": reason or ""},
                   "artifacts": artifacts}
        if version is not None:
            payload.update(register_version=version, version_path=str(self.store.path(version)))
        self.tracker.submit("fold", payload)
        if version is not None:
            self.tracker.submit("alias", {})

    def _refresh_gauges(self) -> None:
        self.metrics.current_version.set(self.store.current() or 0)
        if self.ledger is not None:
            self.metrics.queue_depth.set(self.ledger.queue_depth())

    # -- operator commands --------------------------------------------------------------------------------
    def rollback(self, version: int) -> str:
        """Point ``current`` at an earlier published version; experts folded after it become unmerged."""
        if version not in self.store.numbers():
            raise MergestreamError(f"version {version} does not exist (kept: {self.store.numbers()})")
        before = self.store.current()
        self.store.point_current(version)
        keep = set(self.store.fold_json(version).get("experts", []))
        for row in self.ledger.experts():
            if row.status == "accepted" and row.expert_id not in keep:
                self.ledger.set_status(row.expert_id, "unmerged", f"rolled back to version {version}")
        self.ledger.record_fold("rollback", None, self.cfg.policy.name, {"from": before, "to": version}, time.time(),
                                0.0, {}, {}, "accepted", f"operator rollback {before} -> {version}", version)
        probes = self.store.fold_json(version).get("probes", {})
        for k, v in probes.items():
            self.metrics.probe_value.labels(probe=k).set(v)
        self.tracker.submit("alias", {})
        self._refresh_gauges()
        return f"current: version {before} -> {version}"

    def unmerge(self, expert_id: str) -> str:
        """Publish a new version without ``expert_id`` (through the same probes and gate)."""
        row = self.ledger.expert(expert_id)
        cur = self.store.current_path()
        if row is None or row.status != "accepted" or cur is None:
            raise MergestreamError(f"expert {expert_id!r} is not part of the current backbone")
        t0 = time.time()
        staging = self.store.new_staging()
        self.store.carry_state(staging / "state")
        try:
            engine.unmerge(staging / "state", expert_id, self.cfg.policy.unmerge_mode, out=staging / "model",
                           backbone=cur / "model", base=self.cfg.base, device=self.cfg.device,
                           threads=self.cfg.fold_threads, max_shard_bytes=self.cfg.max_shard_bytes)
        except MergestreamError:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        outcome = self._probe_gate_publish(None, staging, t0, {}, {"mode": self.cfg.policy.unmerge_mode},
                                           kind="unmerge", unmerged=expert_id)
        if outcome != "accepted":
            raise MergestreamError(f"unmerge of {expert_id} was {outcome}: see `mergestream history`")
        self.ledger.set_status(expert_id, "unmerged", f"unmerged ({self.cfg.policy.unmerge_mode})")
        self.metrics.unmerges.inc()
        return f"{expert_id} unmerged: current is version {self.store.current()}"

    def retry(self, expert_id: str) -> str:
        """Put a rejected or failed expert back in the queue."""
        row = self.ledger.expert(expert_id)
        if row is None:
            raise MergestreamError(f"unknown expert {expert_id!r}")
        if row.status not in ("rejected", "failed", "unmerged"):
            raise MergestreamError(f"expert {expert_id} is {row.status}; only rejected, failed or unmerged ones retry")
        self.ledger.set_status(expert_id, "pending", None)
        self.wake.set()
        return f"{expert_id} queued again"
