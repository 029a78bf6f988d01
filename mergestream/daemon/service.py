"""The service: lifecycle, the loop, signals, resume and the operator commands.

One fold at a time, in arrival order. Sources (:mod:`.sources`) only enqueue into the ledger; the
loop claims the oldest pending expert and hands it to the pipeline (:mod:`.pipeline`: fold ->
probe -> gate -> publish as the next version, moving ``current`` atomically, or discard). Operator commands (rollback, unmerge, retry) reach a running
daemon through the ledger's command table and run on the same loop, so nothing races a fold.

Crash safety: ``current`` always names a complete version. On start the service removes stale
staging folders and puts experts left ``folding`` back to pending, so an interrupted expert is
folded exactly once.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import threading
import time

from ..config import Config, ConfigError
from ..errors import CheckpointError, MergestreamError, os_error_text
from ..io.checkpoints import open_checkpoint
from ..io.expert_readers import arrival_key, content_sha256
from ..io.input_formats import check_not_quantized
from .feed_publish import FeedPublisher, build_feed_publisher
from .http import ListenError, listen_hint
from .ledger import Ledger
from .metrics import Metrics, MetricsServer
from .mirror import build_mirror
from .pipeline import ARRIVAL_KIND, HASH_KEY, HASH_KIND, Pipeline
from .records import ARRIVAL_PREFIX
from .sources import ExpertReady, Source, SourceContext, build_sources, still_available
from .store import Store, arrival_root
from .rollback import roll_back
from .tracking import Tracker, make_tracker

log = logging.getLogger("mergestream.service")

#: seconds the loop waits after an operating-system error outside a fold (a full or lost disk)
STORAGE_RETRY_SECONDS = 10.0


class Service:
    """The daemon. ``start()`` takes the lock and starts everything; ``run()`` loops until stopped."""

    def __init__(self, cfg: Config, *, registry=None, serve_metrics: bool = True, watch_sources: bool = True):
        self.cfg = cfg
        self.store = Store(cfg.state_dir)
        self.metrics = Metrics(registry)
        self.ledger: Ledger | None = None
        self.tracker: Tracker | None = None
        self.server: MetricsServer | None = None
        self.feed: FeedPublisher | None = None  # also one of the store's publishers (started, closed here)
        self.sources: list[Source] = []
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self._serve_metrics = serve_metrics and cfg.metrics.enabled
        self._watch = watch_sources
        self.pipeline: Pipeline | None = None
        self._last_retry = 0.0

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Lock the state folder, open the ledger, clean up after a crash, start metrics and sources.

        Raises:
            LockedError: another daemon holds the state folder.
            ConfigError: the base is not a model, a probe cannot be built (unknown type, missing
                data file), the metrics port cannot be bound, ``policy.preprocess`` has ``ri``
                and its auxiliary data cannot be read, or an enabled step's ``forward`` (``ri``,
                ``distill``) cannot be built. Whatever was started is stopped again.
        """
        self._check_base()
        if "ri" in self.cfg.policy.preprocess:  # fail fast on a bad RI data file, before any work
            from ..datasteps.ri import RIError, read_aux

            try:
                n = len(read_aux(self.cfg.policy.ri.data, self.cfg.policy.ri.max_examples))
            except RIError as exc:
                raise ConfigError(f"policy.ri.data: {exc}") from None
            log.info("ri pre-step enabled: %d auxiliary inputs from %s", n, self.cfg.policy.ri.data)
        for key, on in (("ri", "ri" in self.cfg.policy.preprocess), ("distill", "distill" in self.cfg.policy.postprocess)):
            spec = getattr(self.cfg.policy, key).forward
            if on and spec:  # fail fast on a feature model that cannot be built, before any expert is blamed
                from ..datasteps.ri import RIError, load_feature_model

                try:
                    load_feature_model(spec, tokenizer=self.cfg.base, what=f"{key}.forward")
                except RIError as exc:
                    raise ConfigError(f"policy.{exc}") from None
        self.store.lock()
        try:
            self._start_locked()
        except BaseException:
            self.shutdown()
            raise

    def _start_locked(self) -> None:
        self.cfg.state_dir.mkdir(parents=True, exist_ok=True)
        self.cfg.inbox.mkdir(parents=True, exist_ok=True)
        self.ledger = Ledger(self.cfg.state_dir / "ledger.sqlite")
        mirror = build_mirror(self.cfg, self.metrics)  # publish.uri: versions to object storage
        self.feed = build_feed_publisher(self.cfg, self.metrics)  # feed.dir: the signed device feed
        self.store.publishers = [p for p in (mirror, self.feed) if p is not None]
        if self.feed is not None:
            self.feed.start(self.store.current())
        stale = self.store.clean_staging()
        requeued = self.ledger.requeue_interrupted()
        self.store.prune_kept()  # kept experts of folds a crash interrupted (folded again from the queue)
        if stale or requeued:
            log.warning("resumed after an interruption: removed %d staging folder(s), re-queued %s", stale, requeued)
        if self.cfg.torch_threads:
            import torch

            torch.set_num_threads(self.cfg.torch_threads)
        self.tracker = make_tracker(self.cfg, self.ledger, self.metrics, self.store.current)
        logging.getLogger("apscheduler").setLevel(logging.WARNING)
        self.pipeline = Pipeline(self.cfg, self.store, self.ledger, self.metrics, self.tracker,
                                 stopping=self.stopping, still_available=self._registry_version_exists,
                                 tensor_delay=float(os.environ.get("MERGESTREAM_FOLD_DELAY_SECONDS", "0") or 0))
        self.pipeline.refresh_gauges()
        self.pipeline.show_current_probes()
        self.metrics.beat()
        self.metrics.up.set(1)
        try:  # probes that cannot be built (unknown type, missing data file) are a config error
            self.pipeline.prober.probes()
        except MergestreamError as exc:
            raise ConfigError(f"probes: {exc}") from None
        if self._serve_metrics:
            m = self.cfg.metrics
            try:
                self.server = MetricsServer(self.metrics, m.host, m.port)
            except ListenError as exc:
                raise ConfigError(f"metrics: {exc}: {listen_hint(exc, 'metrics')}") from None
            self.server.start()
            log.info("metrics on %s/metrics", self.server.url)
        self.pipeline.prober.base()
        if self._watch:
            self._start_sources()
        self.metrics.ready = True
        log.info("daemon ready state_dir=%s policy=%s current=%s", self.cfg.state_dir, self.cfg.policy.name,
                 self.store.current())

    def _check_base(self) -> None:
        """The base θ₀ opens as a checkpoint and holds tensors (headers only; nothing is loaded).

        Raises:
            ConfigError: it does not, or it is quantized (the daemon refuses to start rather than
                fail every expert).
        """
        try:
            with open_checkpoint(self.cfg.base) as ck:
                if not ck.keys():
                    raise ConfigError(f"base {self.cfg.base}: the checkpoint holds no tensors")
                check_not_quantized(ck, "base")
        except (CheckpointError, FileNotFoundError, NotADirectoryError) as exc:
            raise ConfigError(f"base {self.cfg.base} cannot be used: {exc}") from None

    def _start_sources(self) -> None:
        ctx = SourceContext(cursors=self.ledger,
                            on_error=lambda name, exc: self.metrics.source_errors.labels(source=name).inc())
        self.sources.extend(build_sources(self.cfg, self.on_expert_ready, ctx))
        for src in self.sources:  # listed first: a source may emit (and be told) while it starts
            try:
                src.start()
            except ListenError as exc:  # a receiver (webhook, bucket notifications) cannot listen
                section = getattr(src, "config_section", src.name)
                raise ConfigError(f"{section}: {exc}: {listen_hint(exc, section)}") from None

    def stop(self) -> None:
        """Ask the loop to stop (signal-safe). A fold in progress is abandoned at its next tensor
        (or RI step, or CMA-ES evaluation): its staging is removed and the expert is folded again
        on the next start. Probes of a finished fold run to the end."""
        self.stopping.set()
        self.wake.set()

    def shutdown(self) -> None:
        for s in reversed(self.sources):
            try:
                s.stop()
            except Exception:  # pragma: no cover - best effort on the way out
                log.exception("stopping source %s", s)
        if self.server is not None:
            self.server.stop()
        if self.feed is not None:  # a pending build (e.g. a rollback run here) is finished first
            self.feed.close()
        self.metrics.up.set(0)
        if self.ledger is not None:
            self.ledger.close()
        self.store.unlock()
        if self.metrics.ready:  # not after a start that was refused (its one error line says why)
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
                try:
                    worked = self.step()
                except OSError as exc:  # e.g. the ledger's disk: reported, counted, tried again later
                    self._storage_error("service loop", exc)
                    self.wake.wait(timeout=STORAGE_RETRY_SECONDS)
                    continue
                if not worked:
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
            self.pipeline.fold(row)
            worked = True
        self.pipeline.refresh_gauges()
        return worked

    def execute(self, verb: str, arg: str | None) -> str:
        """Run an operator command; returns a JSON result {"ok": bool, "message": str}."""
        try:
            if verb == "rollback":
                msg = self.rollback(int(arg))
            elif verb in ("unmerge", "retry"):
                try:
                    expert_id = self.ledger.resolve_id(str(arg))  # a unique prefix will do
                except ValueError as exc:
                    raise MergestreamError(str(exc)) from None
                msg = self.unmerge(expert_id) if verb == "unmerge" else self.retry(expert_id)
            else:
                raise MergestreamError(f"unknown command {verb!r}")
            return json.dumps({"ok": True, "message": msg})
        except MergestreamError as exc:
            return json.dumps({"ok": False, "message": str(exc)})
        except OSError as exc:  # a full disk, a read-only state folder: the command fails, the daemon goes on
            self._storage_error(f"{verb} command", exc)
            return json.dumps({"ok": False, "message": f"{type(exc).__name__}: {os_error_text(exc)}"})

    def _storage_error(self, what: str, exc: OSError) -> None:
        """Report an operating-system error the daemon goes on from: one error line naming the path
        and the cause, counted in ``mergestream_storage_errors_total{errno}``."""
        self.metrics.storage_errors.labels(errno=errno.errorcode.get(exc.errno or 0, "other")).inc()
        log.error("%s failed: %s: %s", what, type(exc).__name__, os_error_text(exc))

    # -- sources -> ledger ----------------------------------------------------------------------------
    def on_expert_ready(self, ev: ExpertReady) -> None:
        """Source callback (any thread): identify, enqueue idempotently, wake the loop.

        An expert is queued under its arrival key (file names, sizes, mtimes, inodes:
        :func:`~mergestream.io.expert_readers.arrival_key`), so it is read once, by its fold, which
        computes its content hash; an arrival whose content an earlier fold read is known by that
        hash at once. The same content arriving again under another name (or path) is not
        published again: it is recorded in the history as a rejected ``duplicate`` and counted in
        ``mergestream_experts_rejected_total{stage="duplicate"}`` — here when the content is
        already known, else once its fold has read it (:meth:`Pipeline.fold`).
        """
        within = arrival_root(ev.source, ev.uri, self.cfg.inbox)
        try:
            # a folder expert's links may point elsewhere in the inbox (the source refused any that leave
            # it): identified as the fold will see its kept copy, links resolved
            key = arrival_key(ev.uri, within=within)
            known = self.ledger.known_arrival(key) if key is not None else None
            sha = known or (ARRIVAL_PREFIX + key if key is not None else content_sha256(ev.uri, within=within))
        except OSError as exc:
            self.metrics.source_errors.labels(source=ev.source).inc()
            log.warning("cannot read expert %s: %s", ev.uri, exc)
            return
        meta = {**dict(ev.metadata), HASH_KEY: ARRIVAL_KIND if sha.startswith(ARRIVAL_PREFIX) else HASH_KIND}
        row, new = self.ledger.enqueue(ev.expert_id, ev.source, ev.uri, sha, ev.registry_key, meta)
        for src in self.sources:
            if src.name == ev.source:
                src.on_enqueued(ev)  # e.g. the registry source advances its cursor
        if new:
            self.metrics.experts_seen.labels(source=ev.source).inc()
            log.info("expert queued id=%s source=%s uri=%s", row.expert_id, ev.source, ev.uri)
        elif row.uri != ev.uri and not (ev.registry_key and ev.registry_key == row.registry_key):
            self.pipeline.report_duplicate(ev.expert_id, ev.uri, row)
        self.metrics.queue_depth.set(self.ledger.queue_depth())
        self.wake.set()

    def _registry_version_exists(self, key: str) -> bool:
        return still_available(key, self.sources, self.cfg)

    # -- operator commands --------------------------------------------------------------------------------
    def rollback(self, version: int) -> str:
        """Point ``current`` at another published version (earlier or later).

        Expert status follows what that version contains: an expert in it is ``accepted`` (also
        one that an earlier rollback or unmerge had taken out), an accepted expert not in it
        becomes ``unmerged``. Rejected, failed and queued experts are left as they are. The probe
        gauges then show exactly that version's probes (:func:`~mergestream.daemon.rollback.roll_back`).
        """
        _, message = roll_back(self.store, self.ledger, version, self.cfg.policy.name)
        self.pipeline.show_current_probes()  # exactly version N's probes: no series of tasks it lacks
        self.pipeline.refresh_gauges()  # before the tracking call (MLflow: seconds)
        self.metrics.operator_rollbacks.inc()
        self.tracker.submit("alias", {})
        return message

    def unmerge(self, expert_id: str) -> str:
        """Publish a new version without ``expert_id`` (through the same probes and gate)."""
        row = self.ledger.expert(expert_id)
        if row is None:
            raise MergestreamError(f"unknown expert {expert_id!r}")
        if row.status != "accepted" or self.store.current_path() is None:
            raise MergestreamError(f"expert {expert_id!r} is not part of the current backbone")
        outcome = self.pipeline.unmerge(expert_id)
        if outcome != "accepted":
            raise MergestreamError(f"unmerge of {expert_id} was {outcome}: see `mergestream history`")
        self.ledger.set_status(expert_id, "unmerged", f"unmerged ({self.cfg.policy.unmerge_mode})")
        self.metrics.unmerges.inc()
        return f"{expert_id} unmerged: current is version {self.store.current()}"

    def retry(self, expert_id: str) -> str:
        """Put a rejected, failed or unmerged expert back in the queue. Idempotent: an expert that is
        already accepted or queued is left as it is, and the message says so.

        Raises:
            MergestreamError: unknown expert.
        """
        row = self.ledger.expert(expert_id)
        if row is None:
            raise MergestreamError(f"unknown expert {expert_id!r}")
        if row.status == "accepted":
            return f"{expert_id} is already accepted (version {row.version}): nothing to retry"
        if row.status in ("pending", "folding"):
            return f"{expert_id} is already queued ({row.status})"
        self.ledger.set_status(expert_id, "pending", None)
        self.wake.set()
        return f"{expert_id} queued again"
