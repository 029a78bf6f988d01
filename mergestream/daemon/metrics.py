"""Every Prometheus metric of the daemon, defined once on an injected registry, and the HTTP endpoint.

Names follow Prometheus conventions (prefix ``mergestream_``, counters end in ``_total``, units
``_seconds`` / ``_bytes``). Labels are bounded: policy names, outcomes, source kinds and probe
metric names — never an expert id.

The endpoint (:class:`mergestream.daemon.http.BackgroundHTTPServer` + ``prometheus_client``'s
``MetricsHandler``) serves ``/metrics`` (any other path is 404),
``/healthz`` (200 while the service loop has beaten within ``stale_after`` seconds) and
``/readyz`` (200 once the daemon has finished starting: lock, base probes, sources).
"""

from __future__ import annotations

import time
from urllib.parse import unquote, urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import MetricsHandler

from .http import BackgroundHTTPServer, send_body

FOLD_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


class Metrics:
    """The daemon's metrics on ``registry`` (a fresh ``CollectorRegistry`` by default)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        ns = "mergestream"
        self.experts_seen = Counter("experts_seen", "Distinct experts enqueued", ["source"], namespace=ns, registry=r)
        self.experts_rejected = Counter("experts_rejected", "Experts rejected, by the stage that refused them", ["stage"],
                                        namespace=ns, registry=r)
        self.folds = Counter("folds", "Fold attempts by policy and outcome (accepted, rejected, failed)",
                             ["policy", "outcome"], namespace=ns, registry=r)
        self.fold_duration = Histogram("fold_duration_seconds", "Wall time of a fold including probes",
                                       ["policy"], buckets=FOLD_BUCKETS, namespace=ns, registry=r)
        self.bytes_read = Counter("read_bytes", "Tensor bytes read by folds", namespace=ns, registry=r)
        self.bytes_written = Counter("written_bytes", "Tensor bytes written by folds", namespace=ns, registry=r)
        self.queue_depth = Gauge("queue_depth", "Experts pending or folding", namespace=ns, registry=r)
        self.current_version = Gauge("current_version", "Published version `current` points to (0: none)",
                                     namespace=ns, registry=r)
        self.last_success = Gauge("last_successful_fold_timestamp_seconds", "Unix time of the last accepted fold",
                                  namespace=ns, registry=r)
        self.probe_value = Gauge("probe_value", "Probe values of the current version", ["probe"], namespace=ns,
                                 registry=r)
        self.candidate_probe_value = Gauge("candidate_probe_value", "Probe values of the last candidate", ["probe"],
                                           namespace=ns, registry=r)
        self.rollbacks = Counter("rollbacks", "Candidates rejected by the gate (current stays where it was)", namespace=ns,
                                 registry=r)
        self.operator_rollbacks = Counter("operator_rollbacks", "`rollback --to N` commands that moved current",
                                          namespace=ns, registry=r)
        self.unmerges = Counter("unmerges", "Experts removed from the backbone", namespace=ns, registry=r)
        self.source_errors = Counter("source_errors", "Errors polling or watching sources", ["source"], namespace=ns,
                                     registry=r)
        self.tracking_errors = Counter("tracking_errors", "MLflow calls that failed (retried later)", namespace=ns,
                                       registry=r)
        self.tracking_pending = Gauge("tracking_pending", "MLflow calls waiting for a retry", namespace=ns, registry=r)
        self.patch_bytes = Gauge("patch_bytes", "Size of the current version's patch from the previous one",
                                 namespace=ns, registry=r)
        self.patch_ratio = Gauge("patch_ratio", "Patch size / full model size for the current version",
                                 namespace=ns, registry=r)
        self.mirror_versions = Counter("mirror_versions", "Versions uploaded to the publish mirror (publish.uri)",
                                       namespace=ns, registry=r)
        self.mirror_errors = Counter("mirror_errors", "Publish mirror failures by kind (access_denied, not_found, "
                                     "unreachable, other); the local store is unaffected", ["kind"], namespace=ns,
                                     registry=r)
        self.feed_releases = Counter("feed_releases", "Signed feed releases the daemon published (feed.dir)",
                                     namespace=ns, registry=r)
        self.feed_refreshes = Counter("feed_timestamp_refreshes", "Feed timestamps re-signed with nothing new",
                                      namespace=ns, registry=r)
        self.feed_errors = Counter("feed_errors", "Feed builds or timestamp refreshes that failed (kind: build, "
                                   "refresh); the local store is unaffected", ["kind"], namespace=ns, registry=r)
        self.feed_release = Gauge("feed_release", "Release number of the published feed (0: none)", namespace=ns,
                                  registry=r)
        self.feed_latest = Gauge("feed_latest_version", "Version the feed tells devices to run", namespace=ns,
                                 registry=r)
        self.feed_timestamp_expiry = Gauge("feed_timestamp_expiry_timestamp_seconds", "When the feed's signed "
                                           "timestamp expires (devices refuse a frozen feed after it)", namespace=ns,
                                           registry=r)
        self.feed_version_bytes = Gauge("feed_version_bytes", "Bytes the feed holds per version (patches to it "
                                        "and its full model files)", ["version"], namespace=ns, registry=r)
        self.feed_bytes_to_latest = Gauge("feed_bytes_to_latest", "Bytes a device at from_version downloads to "
                                          "reach the feed's latest (from_version=none: a fresh device)",
                                          ["from_version"], namespace=ns, registry=r)
        self.storage_errors = Counter("storage_errors", "Operating-system errors the daemon reported and went on from "
                                      "(full disk, read-only or lost mount, permission), by errno name (ENOSPC, EROFS...)",
                                      ["errno"], namespace=ns, registry=r)
        self.up = Gauge("up", "1 while the daemon runs", namespace=ns, registry=r)
        self.heartbeat = Gauge("heartbeat_timestamp_seconds", "Last beat of the service loop", namespace=ns,
                               registry=r)
        for outcome in ("accepted", "rejected", "failed"):
            self.folds.labels(policy="-", outcome=outcome)
        self.rollbacks.inc(0)
        self.operator_rollbacks.inc(0)
        self._last_beat = 0.0
        self.ready = False

    def beat(self) -> None:
        """Record that the service loop is alive (now)."""
        self._last_beat = time.time()
        self.heartbeat.set(self._last_beat)

    def healthy(self, stale_after: float = 60.0) -> bool:
        """True if the loop beat within the last ``stale_after`` seconds."""
        return time.time() - self._last_beat < stale_after


class _HealthHandler(MetricsHandler):
    """``/healthz`` and ``/readyz`` for ``metrics``, ``/metrics`` as ``prometheus_client``'s exposition
    of ``registry`` (set with ``metrics`` and ``stale_after`` on a per-server subclass); any other
    path is 404."""

    metrics: Metrics
    stale_after: float

    def do_GET(self) -> None:
        """Answer ``/healthz`` and ``/readyz`` (200 or 503, text), anything else with the metrics."""
        path = unquote(urlsplit(self.path).path)
        if path == "/healthz":
            ok = self.metrics.healthy(self.stale_after)
            return send_body(self, 200 if ok else 503, b"ok\n" if ok else b"stale\n", "text/plain")
        if path == "/readyz":
            ok = self.metrics.ready and self.metrics.healthy(self.stale_after)
            return send_body(self, 200 if ok else 503, b"ready\n" if ok else b"not ready\n", "text/plain")
        if path == "/metrics":
            return super().do_GET()
        return send_body(self, 404, b"not found: the paths are /metrics, /healthz and /readyz\n", "text/plain")


class MetricsServer:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` for ``metrics`` on host:port (0 = any free port).

    The socket is bound here, so a taken port fails at construction.

    Args:
        metrics: what to serve. host: interface to bind. port: TCP port (0: a free one, see
        :attr:`port`). stale_after: seconds without a :meth:`Metrics.beat` after which ``/healthz``
        and ``/readyz`` answer 503.

    Raises:
        ListenError: the address cannot be bound (an ``OSError``: :mod:`mergestream.daemon.http`).
    """

    def __init__(self, metrics: Metrics, host: str = "127.0.0.1", port: int = 9108, stale_after: float = 60.0):
        self.metrics = metrics
        handler = type("BoundHealthHandler", (_HealthHandler,),
                       {"registry": metrics.registry, "metrics": metrics, "stale_after": float(stale_after)})
        self._http = BackgroundHTTPServer(host, port, handler, name="metrics-http")
        self._http.bind()

    @property
    def port(self) -> int:
        """The bound TCP port."""
        return self._http.port

    @property
    def url(self) -> str:
        """``http://host:port`` it serves (IPv6 hosts in brackets)."""
        return self._http.url

    def start(self) -> None:
        """Serve on a background daemon thread.

        Raises:
            RuntimeError: already started.
        """
        self._http.start()

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        self._http.stop()
