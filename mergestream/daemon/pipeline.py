"""One attempt at a new backbone version: fold (or unmerge) -> probe -> gate -> publish | discard.

The service's loop hands the pipeline one claimed expert (:meth:`Pipeline.fold`) or one operator
unmerge (:meth:`Pipeline.unmerge`). Each builds a candidate in a staging folder, probes it, asks
the gate, and concludes: an accepted candidate becomes the next published version; anything else
is discarded with its reason. Every attempt, whatever its end, is recorded the same way (the
ledger, ``fold.json``, Prometheus metrics, an MLflow run) by :meth:`Pipeline.conclude` from an
:class:`Attempt` and its :class:`Outcome`.

Pre-steps and data-driven extras of a fold: the RI pre-step (``policy.preprocess: [ri]``), the
distil post-step (``policy.postprocess: [distill]``, after the fold or unmerge, before the probes) and the
coefficient search's probe objective (a policy whose ``searches_coefficients()`` is true) live in
:mod:`.prestep`, the per-fold strength choice (``policy.strength: auto``) in :mod:`.strength`; the
probes themselves in :mod:`.probes` (run through :class:`.probing.Prober`).

An expert is folded from its kept copy in the state folder (:class:`.store.KeptExperts`), which the
state manifest records, so replay never depends on the original staying where it arrived; kept
copies of experts no kept version holds are removed after each attempt.

The probe gauges show exactly the current version's probes (``mergestream_probe_value``) and the
last probed candidate's (``mergestream_candidate_probe_value``): series of probes a version no
longer has (a task unmerged or rolled back) are removed, see :func:`show_probe_values`.
"""

from __future__ import annotations

import errno
import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import Gauge

from .. import engine
from ..config import Config
from ..engine import ExecOptions
from ..engine.executors import make_executor
from ..errors import CheckpointError, MergestreamError, ValidationError, os_error_text
from ..io.expert_readers import arrival_key, content_sha256
from ..io.model_card import write_model_card
from ..io.state import StateDir
from ..policies import is_budgeted
from . import gate
from .ledger import Ledger
from .metrics import Metrics
from .prestep import PreStepRejected, PreSteps, StopRequested
from .probing import Prober
from .records import ARRIVAL_PREFIX, Attempt, ExpertRow, Outcome
from .store import Store, arrival_root
from .strength import fold_at_best_strength
from .tracking import Tracker

log = logging.getLogger("mergestream.service")

#: rows registered with the one content hash say so (rows of older versions used a file hash)
#: the ledger's tag of the hash it recorded (weights hash version 2); rows tagged ``weights/1`` (written
#: before it) are still checked: the fold accepts a version-1 match (:func:`mergestream.engine.fold`)
HASH_KEY, HASH_KIND = "mergestream.hash", "weights/2"
HASH_KINDS = ("weights/1", HASH_KIND)
#: the tag of a row queued under its arrival key: its content hash is learnt by its fold
ARRIVAL_KIND = "arrival/1"


class _Duplicate(Exception):
    """The fold read content another expert already has (raised before probing)."""

    def __init__(self, of: ExpertRow):
        super().__init__(of.expert_id)
        self.of = of


def show_probe_values(gauge: Gauge, values: dict[str, float]) -> None:
    """Make a ``probe``-labelled gauge export exactly ``values``: each is set, then every other
    series is removed (set first, so a scrape never sees a current probe missing)."""
    for k, v in values.items():
        gauge.labels(probe=k).set(v)
    shown = {s.labels["probe"] for m in gauge.collect() for s in m.samples}
    for k in shown - set(values):
        gauge.remove(k)


class Pipeline:
    """Fold / unmerge, probe, gate, publish or discard; one attempt at a time (the service's loop).

    Args:
        cfg, store, ledger, metrics, tracker: the service's parts.
        stopping: set when a stop was asked: a fold in progress is abandoned at its next tensor
            (or RI step, or objective evaluation) and its expert stays queued.
        still_available: ``registry_key -> bool``; False when the expert's registry version was
            deleted before it was folded.
        tensor_delay: seconds to sleep per tensor (a testing aid: a slow fold to interrupt).
    """

    def __init__(self, cfg: Config, store: Store, ledger: Ledger, metrics: Metrics, tracker: Tracker, *,
                 stopping: threading.Event, still_available: Callable[[str], bool], tensor_delay: float = 0.0):
        self.cfg, self.store, self.ledger, self.metrics, self.tracker = cfg, store, ledger, metrics, tracker
        self.stopping = stopping
        self.still_available = still_available
        self.tensor_delay = tensor_delay
        self.prober = Prober(cfg, ledger, store)
        self.presteps = PreSteps(cfg, self.prober, self.heartbeat, store.kept)
        self._options: ExecOptions | None = None

    def options(self) -> ExecOptions:
        """The engine's execution options from the config (``device``, ``fold_threads``,
        ``max_shard_bytes``, ``executor``), built once, at the first fold or unmerge, and passed
        whole to every engine call.

        Raises:
            MergestreamError: ``executor.kind: ray`` without the ``ray`` package (tried again at
                the next attempt).
        """
        if self._options is None:
            cfg = self.cfg
            self._options = ExecOptions(device=cfg.device, threads=cfg.fold_threads,
                                        max_shard_bytes=cfg.max_shard_bytes,
                                        executor=make_executor(cfg.executor.kind, cfg.executor.address))
        return self._options

    def heartbeat(self, *_: Any) -> None:
        """Called per tensor / RI step / objective evaluation: liveness, and a pending stop."""
        self.metrics.beat()
        if self.stopping.is_set():
            raise StopRequested()

    # -- the fold ---------------------------------------------------------------------------------------
    def fold(self, row: ExpertRow) -> str:
        """Fold one claimed expert; returns its final status (accepted, rejected, failed,
        pending when a stop interrupted it, or duplicate).

        An expert queued under its arrival key gets its content hash from the fold's own pass
        (its only read); content another expert already has is a ``duplicate``
        (:meth:`report_duplicate`): the fold is discarded before probing and its ledger row removed.

        With ``policy.preprocess: [ri]`` the expert is first adapted (:mod:`.prestep`); a policy
        that searches its coefficients gets the data probes' objective. Both are recorded in the
        fold's timings (MLflow metrics) and in ``fold.json``.

        An operating-system error (a full disk, a read-only or lost state folder) ends the attempt
        as ``failed`` with one line naming the path and the cause (:meth:`storage_failure`); the
        published versions and ``current`` stay as they were.
        """
        try:
            staging = self.store.new_staging()
        except OSError as exc:
            return self.storage_failure(row.expert_id, None, exc)
        att = Attempt("fold", row.expert_id, staging, time.time(), row=row, params=dict(self.cfg.policy.params),
                      candidate_expert=Path(row.uri) if Path(row.uri).is_dir() else None)
        try:
            outcome = self._build_fold(att) or self.probe_and_gate(att)
        except _Duplicate as dup:  # its row is gone; the copy's fold is thrown away, nothing published
            shutil.rmtree(att.staging, ignore_errors=True)
            self.store.prune_kept()
            self.report_duplicate(row.expert_id, row.uri, dup.of)
            return "duplicate"
        except StopRequested:
            shutil.rmtree(att.staging, ignore_errors=True)
            self.store.prune_kept()
            self.ledger.requeue_interrupted()
            log.warning("fold of %s abandoned: stop requested; it stays queued for the next start", row.expert_id)
            return "pending"
        except OSError as exc:  # the probes' or the gate's disk
            return self.storage_failure(row.expert_id, att, exc)
        before = self.store.current()
        try:
            self.conclude(att, outcome)
        except OSError as exc:
            if outcome.decision == "accepted" and self.store.current() != before:  # published; a later step failed
                self.metrics.storage_errors.labels(errno=errno.errorcode.get(exc.errno or 0, "other")).inc()
                log.error("after publishing expert=%s: %s: %s", row.expert_id, type(exc).__name__, os_error_text(exc))
                return outcome.decision
            return self.storage_failure(row.expert_id, att, exc)
        return outcome.decision

    def storage_failure(self, expert_id: str, att: Attempt | None, exc: OSError) -> str:
        """End a fold that an operating-system error stopped: the staging folder removed, one error
        line naming the path and the cause, ``mergestream_storage_errors_total{errno}`` and
        ``mergestream_folds_total{outcome="failed"}`` counted, the expert marked ``failed`` with
        that reason (``mergestream retry`` queues it again once the cause is fixed), the attempt in
        the history when the ledger can still be written. Returns ``"failed"``."""
        reason = f"{type(exc).__name__}: {os_error_text(exc)}"
        if att is not None:
            shutil.rmtree(att.staging, ignore_errors=True)
        self.metrics.storage_errors.labels(errno=errno.errorcode.get(exc.errno or 0, "other")).inc()
        self.metrics.folds.labels(policy=self.cfg.policy.name, outcome="failed").inc()
        log.error("fold failed expert=%s reason=%s (current is unchanged; `mergestream retry %s` once fixed)",
                  expert_id, reason, expert_id)
        try:
            if att is not None:
                self.ledger.record_fold(att, Outcome("failed", reason), policy=self.cfg.policy.name,
                                        seconds=time.time() - att.started)
            self.ledger.set_status(expert_id, "failed", reason)
        except Exception as again:  # the ledger's disk too: it stays folding, requeued on the next start
            log.error("cannot record the failure of expert=%s in the ledger: %s", expert_id, again)
        return "failed"

    def _build_fold(self, att: Attempt) -> Outcome | None:
        """Fold the expert into ``att.staging``; an :class:`Outcome` when that already ends the
        attempt (rejected or failed), None when the candidate is ready to probe."""
        row, pol = att.row, self.cfg.policy
        cur = self.store.current_path()
        backbone = cur / "model" if cur else None
        log.info("fold start expert=%s policy=%s backbone=%s", row.expert_id, pol.name, backbone)
        if row.registry_key and not self.still_available(row.registry_key):
            return Outcome("rejected", "the expert was deleted or replaced in its source before it was folded", "validation")
        try:
            policy = pol.make()  # this attempt's one Policy object: for the objective and the fold
            arrived_in = arrival_root(row.source, row.uri, self.cfg.inbox)  # its links stay inside it
            self._check_arrival(row, arrived_in)
            src = self.presteps.adapt(row, att) if "ri" in pol.preprocess else row.uri
            raw = Path(src) == Path(row.uri)
            if raw:  # fold (and record for replay) the kept copy, whatever becomes of the original
                src = str(self.store.kept.keep(row.uri, row.expert_id, root=arrived_in))
                att.candidate_expert = Path(src) if Path(src).is_dir() else None
            objective = self.presteps.objective(att.candidate_expert, policy) if policy.searches_coefficients() \
                else None
            delay = self.tensor_delay

            def hook(_name: str) -> None:
                self.heartbeat()
                if delay:
                    time.sleep(delay)

            # the ledger's hash is the one the fold computes on its own pass: an expert changed since
            # it was registered is refused (unless RI replaced it with its adapted copy)
            checked = raw and row.metadata.get(HASH_KEY) in HASH_KINDS
            arrival = row.sha256[len(ARRIVAL_PREFIX):] if row.sha256.startswith(ARRIVAL_PREFIX) else None

            def fold_one(policy, state_dir: Path, out: Path) -> engine.FoldReport:
                return engine.fold(self.cfg.base, backbone, src, policy, state_dir=state_dir, out=out,
                                   expert_id=row.expert_id, tensor_hook=hook, objective=objective,
                                   expect_sha256=row.sha256 if checked else None, options=self.options())

            # the files folded must not change under the fold (a rewrite in place of the original,
            # which the kept hard link shares): its hash would name a mix of two contents
            folded_key = arrival_key(src, within=Path(src).parent) if raw and arrival is not None else None

            if pol.strength.mode == "auto":  # one fold per candidate strength, the best kept (.strength)
                rep, att.extra["strength"] = fold_at_best_strength(
                    pol, self.presteps.probe_objective(att.candidate_expert), fold_one, self.store.carry_state,
                    att.staging)
                att.timings["strength_seconds"] = att.extra["strength"]["seconds"]
            else:
                self.store.carry_state(att.staging / "state")
                rep = fold_one(policy, att.staging / "state", att.staging / "model")
        except StopRequested:
            raise
        except PreStepRejected as exc:
            return Outcome("rejected", str(exc), "preprocess")
        except (ValidationError, CheckpointError, FileNotFoundError) as exc:
            text = os_error_text(exc) if isinstance(exc, OSError) else str(exc)
            return Outcome("rejected", self._as_arrived(row, f"{type(exc).__name__}: {text}"), "validation")
        except MergestreamError as exc:
            return Outcome("failed", self._as_arrived(row, f"{type(exc).__name__}: {exc}"))
        except OSError as exc:  # the disk, not the expert: one line, counted, the daemon goes on
            self.metrics.storage_errors.labels(errno=errno.errorcode.get(exc.errno or 0, "other")).inc()
            return Outcome("failed", self._as_arrived(row, f"{type(exc).__name__}: {os_error_text(exc)}"))
        except Exception as exc:  # a bug or an environment problem: record it, keep serving
            log.exception("fold of %s failed", row.expert_id)
            return Outcome("failed", self._as_arrived(row, f"{type(exc).__name__}: {exc}"))
        if arrival is not None:  # what the fold read (RI folded its adapted copy: the original, read again)
            try:
                if folded_key is not None and arrival_key(src, within=Path(src).parent) != folded_key:
                    raise CheckpointError(f"expert {row.uri} changed while it was folded; nothing was published")
                sha = rep.sha256[0] if raw else content_sha256(row.uri, within=arrived_in)
            except (CheckpointError, OSError) as exc:
                return Outcome("rejected", self._as_arrived(row, f"{type(exc).__name__}: {exc}"), "validation")
            dup = self.ledger.settle_identity(row.expert_id, arrival, sha, {**row.metadata, HASH_KEY: HASH_KIND})
            if dup is not None:
                raise _Duplicate(dup)
        if "distill" in pol.postprocess:  # the backbone trained toward each task's expert (.prestep)
            try:
                # under a patch budget the step trains only what the fold changed: the bound holds
                self.presteps.distill(att, (row.expert_id, att.candidate_expert),
                                      within_patch_from=backbone if is_budgeted(pol.params) else None)
            except PreStepRejected as exc:
                return Outcome("rejected", self._as_arrived(row, str(exc)), "postprocess")
            except (StopRequested, OSError):
                raise
            except Exception as exc:  # a bug or an environment problem (memory): record it, keep serving
                log.exception("distil post-step of %s failed", row.expert_id)
                return Outcome("failed", self._as_arrived(row, f"distil post-step: {type(exc).__name__}: {exc}"))
        att.timings["fold_seconds"] = rep.seconds
        self.metrics.bytes_read.inc(rep.bytes_read)
        self.metrics.bytes_written.inc(rep.bytes_written)
        att.params = dict(rep.params)
        if rep.coefficients is not None:
            att.params["coefficients_all"] = [round(c, 6) for c in rep.coefficients]
        if rep.search is not None:
            kind = str(rep.params.get("coefficients") or "cmaes")  # which search: cmaes | adamerging
            att.timings.update({f"{kind}_{k}": float(v) for k, v in rep.search.items()})
            att.extra[kind] = {**rep.search, "coefficients": rep.coefficients,
                                  "evaluations_log": [{"alphas": a, **v} for a, v in objective.evaluations]}
        return None

    def _check_arrival(self, row: ExpertRow, arrived_in: Path | None) -> None:
        """Refuse an expert queued under its arrival key whose files changed since it arrived (a
        rewrite in place, a replacement): the content the fold would read is not what was queued
        (the new content is announced, and queued, by its source). A missing original is left to
        the kept copy (a retried expert whose original is gone still folds). An expert with a
        registry version is identified by it: its source may fetch its local copy again (a damaged
        cache), so new files there are not a change.

        Raises:
            CheckpointError: the arrival key of ``row.uri`` is not the queued one.
        """
        if not row.sha256.startswith(ARRIVAL_PREFIX) or row.registry_key or not Path(row.uri).exists():
            return
        if arrival_key(row.uri, within=arrived_in) != row.sha256[len(ARRIVAL_PREFIX):]:
            raise CheckpointError(f"expert {row.uri} changed since it was registered (its files' sizes, times "
                                  "or inodes); nothing was folded")

    def report_duplicate(self, expert_id: str, uri: str, of: ExpertRow) -> None:
        """Record that ``expert_id`` at ``uri`` has the same weights as ``of``: a rejected
        ``duplicate`` event in the history, ``mergestream_experts_rejected_total{stage="duplicate"}``
        and one warning — once per content and location, not on every rescan or restart."""
        seen = f"duplicate:{of.sha256}:{uri}"
        if self.ledger.get_meta(seen) is not None:
            return
        self.ledger.set_meta(seen, {"of": of.expert_id, "time": time.time()})
        # the same weights under another name: identity is the content, so it is not published again
        reason = f"duplicate: same weights as expert {of.expert_id} ({of.uri}); not published again"
        self.metrics.experts_rejected.labels(stage="duplicate").inc()
        self.ledger.record_event("duplicate", expert_id=expert_id, policy=self.cfg.policy.name,
                                 params={"uri": uri}, decision="rejected", reason=reason)
        log.warning("expert %s at %s rejected: %s", expert_id, uri, reason)

    def _as_arrived(self, row: ExpertRow, reason: str) -> str:
        """A reason that names the expert where it arrived (the inbox file, the registry download),
        not the daemon's kept copy of it."""
        return reason.replace(str(self.store.kept.dir(row.expert_id) / Path(row.uri).name), row.uri)

    # -- the unmerge ------------------------------------------------------------------------------------
    def unmerge(self, expert_id: str) -> str:
        """Build a version without ``expert_id`` from the current one, probe, gate and conclude it;
        returns the decision.

        Raises:
            MergestreamError: the engine could not unmerge (nothing was published or recorded).
            OSError: a full disk, a read-only or lost state folder (nothing was published).
        """
        cur = self.store.current_path()
        mode = self.cfg.policy.unmerge_mode
        att = Attempt("unmerge", expert_id, self.store.new_staging(), time.time(), params={"mode": mode})
        try:  # an OSError (a full disk) leaves no staging folder and current as it was
            self.store.carry_state(att.staging / "state")
            engine.unmerge(att.staging / "state", expert_id, mode, out=att.staging / "model",
                           backbone=cur / "model", base=self.cfg.base, options=self.options())
            if "distill" in self.cfg.policy.postprocess:  # the remaining tasks, toward their experts
                self.presteps.distill(att, None, exclude=expert_id)
            outcome = self.probe_and_gate(att)
            self.conclude(att, outcome)
        except (MergestreamError, OSError):
            shutil.rmtree(att.staging, ignore_errors=True)
            raise
        return outcome.decision

    # -- probe and gate ---------------------------------------------------------------------------------
    def probe_and_gate(self, att: Attempt) -> Outcome:
        """Probe the staged candidate and ask the gate (against the current version, θ₀'s values
        and the history of accepted versions)."""
        cur = self.store.current_path()
        try:
            tp = time.time()
            values = self.prober.run(att.staging / "model", cur / "model" if cur else None, att.staging / "state",
                                     att.candidate_expert)
            att.timings["probe_seconds"] = time.time() - tp
        except Exception as exc:
            log.exception("probes failed")
            show_probe_values(self.metrics.candidate_probe_value, {})
            return Outcome("failed", f"probes failed: {type(exc).__name__}: {exc}")
        show_probe_values(self.metrics.candidate_probe_value, values)
        base_values = self.ledger.get_meta("base_probes")
        decision = gate.evaluate(self.cfg.gate.rules, values, self.prober.current(),
                                 base_values["values"] if base_values else None, self.ledger.accepted_probe_history())
        if not decision.accepted:
            return Outcome("rejected", decision.reason, "gate", values)
        return Outcome("accepted", None, "", values)

    # -- conclude ---------------------------------------------------------------------------------------
    def conclude(self, att: Attempt, outcome: Outcome) -> int | None:
        """Publish or discard the candidate and record the attempt everywhere; the new version
        number when one was published."""
        seconds = time.time() - att.started
        if outcome.decision == "accepted":
            version, patch_path = self._publish(att, outcome, seconds)
        else:
            version, patch_path = None, None
            self._discard(att, outcome)
        pol = self.cfg.policy.name
        self.metrics.folds.labels(policy=pol, outcome=outcome.decision).inc()
        self.metrics.fold_duration.labels(policy=pol).observe(seconds)
        self._track(att, outcome, version, patch_path)
        self.refresh_gauges()
        self.store.prune_kept()  # after retention: what no kept version holds any more
        return version

    def _publish(self, att: Attempt, outcome: Outcome, seconds: float) -> tuple[int, Path | None]:
        pol = self.cfg.policy.name
        prev = self.store.current()
        # the version's own card (its number, the change, the probe values) before the patch, which
        # carries it to devices that update by patch
        write_model_card(att.staging / "model", base=self.cfg.base,
                         release={"version": self.store.next_number(), "kind": att.kind, "expert": att.expert_id,
                                  "previous": prev, "probes": outcome.probes})
        patch_path = self._write_patch(prev, att.staging) if prev is not None and self.cfg.write_patches else None
        state = att.staging / "state"
        experts_in = StateDir(state).manifest.ids() if (state / "manifest.json").exists() else []
        fold_doc = {"kind": att.kind, "expert": att.expert_id, "policy": pol, "params": att.params,
                    "probes": outcome.probes, "timings": att.timings, "decision": "accepted", "experts": experts_in,
                    "previous": prev, "time": time.time(), **att.extra}
        version = self.store.publish(att.staging, fold_doc)
        # recorded once published: a publish that failed (a full disk) is recorded as failed instead
        fold_row = self.ledger.record_fold(att, outcome, policy=pol, seconds=seconds)
        self.ledger.add_version(version, str(self.store.path(version)), experts_in, fold_row)
        if att.kind == "fold":
            self.ledger.set_status(att.expert_id, "accepted", None, version)
            if att.candidate_expert is not None:
                self.prober.keep_task_probe(att.expert_id, att.candidate_expert)
        self.metrics.last_success.set(time.time())
        self.metrics.current_version.set(version)  # now, not after the tracking calls (MLflow: seconds)
        self.show_current_probes()
        removed = self.store.retain(self.cfg.retention)
        if removed:
            log.info("retention removed versions %s", removed)
        log.info("published version=%d expert=%s kind=%s seconds=%.2f", version, att.expert_id, att.kind, seconds)
        return version, patch_path

    def _discard(self, att: Attempt, outcome: Outcome) -> None:
        shutil.rmtree(att.staging, ignore_errors=True)
        self.ledger.record_fold(att, outcome, policy=self.cfg.policy.name, seconds=time.time() - att.started)
        if att.kind == "fold":
            self.ledger.set_status(att.expert_id, outcome.decision, outcome.reason)
        if outcome.decision == "rejected":
            self.metrics.experts_rejected.labels(stage=outcome.stage or "gate").inc()
            if outcome.stage == "gate":
                self.metrics.rollbacks.inc()
        log.warning("%s %s expert=%s reason=%s", att.kind, outcome.decision, att.expert_id, outcome.reason)

    def _write_patch(self, prev: int, staging: Path) -> Path | None:
        try:
            from ..patches.build import build_patch
        except ImportError:  # pragma: no cover - patches are optional
            return None
        out = staging / f"patch-from-{prev:06d}.safetensors"
        try:
            stats = build_patch(self.store.path(prev) / "model", staging / "model", out,
                                source_version=str(prev), target_version=str(self.store.next_number()),
                                policy=self.cfg.policy.name, patch_format=self.cfg.patch_format,
                                zstd_level=self.cfg.patch_zstd_level)
        except Exception:
            log.exception("patch from version %d failed (the version is published without it)", prev)
            return None
        self.metrics.patch_bytes.set(stats["patch_bytes"])
        self.metrics.patch_ratio.set(stats["ratio"])
        return out

    def _track(self, att: Attempt, outcome: Outcome, version: int | None, patch_path: Path | None) -> None:
        artifacts = []
        if version is not None:
            artifacts.append(str(self.store.path(version) / "fold.json"))
            if patch_path is not None:
                artifacts.append(str(self.store.path(version) / patch_path.name))
        payload = {"kind": att.kind, "expert_id": att.expert_id, "decision": outcome.decision, "started": att.started,
                   "run_name": f"{att.kind}-{att.expert_id}", "params": {"policy": self.cfg.policy.name, **att.params},
                   "metrics": {**outcome.probes, **att.timings}, "tags": {"mergestream.reason": outcome.reason or ""},
                   "artifacts": artifacts}
        if version is not None:
            payload.update(register_version=version, version_path=str(self.store.path(version)))
        self.tracker.submit("fold", payload)
        if version is not None:
            self.tracker.submit("alias", {})

    def show_current_probes(self) -> None:
        """``mergestream_probe_value``: exactly the probes recorded for the current version (none
        before the first); after a publish, a rollback and at start."""
        show_probe_values(self.metrics.probe_value, self.prober.current() or {})

    def refresh_gauges(self) -> None:
        """Current version and queue depth gauges from the store and the ledger."""
        self.metrics.current_version.set(self.store.current() or 0)
        self.metrics.queue_depth.set(self.ledger.queue_depth())
