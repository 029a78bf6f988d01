"""Every Prometheus metric of the daemon, defined once on an injected registry, and the HTTP endpoint.

Names follow Prometheus conventions (prefix ``mergestream_``, counters end in ``_total``, units
``_seconds`` / ``_bytes``). Labels are bounded: policy names, outcomes, source kinds and probe
metric names — never an expert id.

The endpoint (``wsgiref`` + ``prometheus_client.make_wsgi_app``) serves ``/metrics``,
``/healthz`` (200 while the service loop has beaten within ``stale_after`` seconds) and
``/readyz`` (200 once the daemon has finished starting: lock, base probes, sources).
"""

from __future__ import annotations

import socketserver
import threading
import time
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

FOLD_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


class Metrics:
    """The daemon's metrics on ``registry`` (a fresh ``CollectorRegistry`` by default)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        ns = "mergestream"
        self.experts_seen = Counter("experts_seen", "Distinct experts enqueued", ["source"], namespace=ns, registry=r)
        self.experts_rejected = Counter("experts_rejected", "Experts rejected (validation or gate)", ["stage"],
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
        self.up = Gauge("up", "1 while the daemon runs", namespace=ns, registry=r)
        self.heartbeat = Gauge("heartbeat_timestamp_seconds", "Last beat of the service loop", namespace=ns,
                               registry=r)
        for outcome in ("accepted", "rejected", "failed"):
            self.folds.labels(policy="-", outcome=outcome)
        self.rollbacks.inc(0)
        self._last_beat = 0.0
        self.ready = False

    def beat(self) -> None:
        self._last_beat = time.time()
        self.heartbeat.set(self._last_beat)

    def healthy(self, stale_after: float = 60.0) -> bool:
        return time.time() - self._last_beat < stale_after


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - signature from the stdlib
        pass


class _ThreadingWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class MetricsServer:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` for ``metrics`` on host:port (0 = any free port)."""

    def __init__(self, metrics: Metrics, host: str = "127.0.0.1", port: int = 9108, stale_after: float = 60.0):
        self.metrics = metrics
        prom = make_wsgi_app(metrics.registry)

        def app(environ, start_response):
            path = environ.get("PATH_INFO", "/")
            if path == "/healthz":
                ok = metrics.healthy(stale_after)
                start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
                return [b"ok\n" if ok else b"stale\n"]
            if path == "/readyz":
                ok = metrics.ready and metrics.healthy(stale_after)
                start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
                return [b"ready\n" if ok else b"not ready\n"]
            return prom(environ, start_response)

        self._server = make_server(host, port, app, server_class=_ThreadingWSGIServer, handler_class=_QuietHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_port

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
