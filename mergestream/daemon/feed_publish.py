"""The daemon publishes its own signed update feed (``feed.dir``; issue 16).

The store tells :meth:`FeedPublisher.point` after each local switch of ``current`` (a published
version, an operator rollback), like the S3 mirror (:mod:`.mirror`). The publisher only records the
wish and returns: one background thread runs :func:`mergestream.feed.build.build_feed` (the one
home of the feed's format) for the newest wish, so a slow build (hashing a model, re-encoding
patches in format 2) never holds up a fold. Several wishes while a build runs collapse into one
build of the newest.

The same thread re-signs the feed's timestamp every ``feed.refresh_seconds`` (default: half the
timestamp's lifetime; :func:`mergestream.feed.build.refresh_timestamp`), so devices polling a feed
with nothing new never see it expire and refuse it as frozen. When the snapshot or targets metadata
would expire first, the refresh is a full build of the same latest version.

A failure (a key missing or unreadable, the disk full, a version removed by retention while the
build read it) is logged, counted in ``mergestream_feed_errors_total{kind}`` and retried after a
backoff (0.5 s, doubling up to ``feed.retry_seconds``); the feed stays at its last complete
release (the builder writes ``timestamp.json`` last) and the local store is never touched. On shutdown a pending build is
finished (up to ``close``'s timeout), so ``mergestream rollback`` without a running daemon also
republishes the feed.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import Config, FeedConfig
    from .metrics import Metrics

log = logging.getLogger(__name__)


class FeedPublisher:
    """Keep the feed in ``fc.dir`` in step with the daemon's ``current`` (see the module docstring).

    Args:
        state_dir: the daemon's state folder (its ``versions/``).
        fc: the ``feed`` config section (``dir`` and ``keys`` set).
        metrics: where releases, refreshes, errors and sizes are recorded (None: nowhere).
    """

    def __init__(self, state_dir: str | Path, fc: FeedConfig, metrics: Metrics | None = None):
        from ..feed.build import DEFAULT_EXPIRES

        self.state_dir, self.fc, self.metrics = Path(state_dir), fc, metrics
        self.expires = {r: timedelta(seconds=s) for r, s in fc.lifetimes().items()}
        self.timestamp_life = self.expires.get("timestamp", DEFAULT_EXPIRES["timestamp"])
        self.refresh_every = fc.refresh_seconds or self.timestamp_life.total_seconds() / 2
        self._cond = threading.Condition()
        self._want: int | None = None  # the version the feed should name next (None: nothing to build)
        self._not_before = 0.0  # after a failure: no retry before this time
        self._next_refresh = time.time() + self.refresh_every
        self._stopping = False
        self._busy = False
        self._failures = 0  # builds failed in a row: the retry waits 0.5 s, 1 s, 2 s ... up to retry_seconds
        self._thread: threading.Thread | None = None

    # -- called by the daemon --------------------------------------------------------------------
    def start(self, current: int | None) -> None:
        """Start the background thread; a feed behind ``current`` (or none yet) is built first,
        one whose timestamp is due is refreshed."""
        from ..feed.build import feed_report

        try:
            rep = feed_report(self.fc.dir)
        except Exception as exc:  # a damaged feed: the next build replaces its release
            log.warning("feed %s unreadable (%s); rebuilding it", self.fc.dir, exc)
            rep = None
        if rep is not None:
            self._show_report(rep)
            self._next_refresh = min(self._next_refresh, rep["timestamp_expires"] - self.refresh_every)
        if current is not None and (rep is None or rep["latest"]["version"] != current):
            self._want = current
        self._thread = threading.Thread(target=self._run, name="feed-publisher", daemon=True)
        self._thread.start()

    def point(self, number: int, folder: Path | None = None) -> bool:
        """The store's hook: the feed should now name version ``number`` (built in the background).
        Never raises; returns True (the wish is recorded)."""
        with self._cond:
            self._want = number
            self._not_before = 0.0
            self._cond.notify_all()
        return True

    def close(self, timeout: float = 300.0) -> None:
        """Finish a pending build (waiting up to ``timeout`` seconds), then stop the thread."""
        with self._cond:
            self._stopping = True
            self._not_before = 0.0
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("feed build still running after %.0f s at shutdown; the feed stays at its last "
                            "complete release", timeout)

    def idle(self) -> bool:
        """True when no build is running or waiting (a failed one waiting for its retry counts as waiting)."""
        with self._cond:
            return self._want is None and not self._busy

    # -- the thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    now = time.time()
                    build_ready = self._want is not None and (now >= self._not_before)
                    if build_ready or (self._stopping and (self._want is None or self._not_before > now)):
                        break
                    if not self._stopping and now >= self._next_refresh:
                        break
                    waits = [self._next_refresh - now] + ([self._not_before - now] if self._want is not None else [])
                    self._cond.wait(timeout=max(0.05, min(waits)))
                if self._stopping and not build_ready:
                    return
                want = self._want if build_ready else None
                if build_ready:
                    self._want = None
                self._busy = True
            ok = False
            try:  # neither raises; the finally only keeps the bookkeeping right whatever happens
                ok = self.publish(want) if want is not None else self.refresh()
            finally:
                with self._cond:
                    self._busy = False
                    self._failures = 0 if ok or want is None else self._failures + 1
                    if want is not None and not ok and self._want is None:
                        # retried with backoff (at once on a new wish; given up at close)
                        self._not_before = time.time() + min(self.fc.retry_seconds, 0.5 * 2 ** (self._failures - 1))
                        self._want = want
                    self._cond.notify_all()

    def publish(self, version: int | None) -> bool:
        """Build the next release naming ``version`` now (this thread). Never raises: a failure is
        logged and counted; returns True on success."""
        from ..feed.build import build_feed

        try:
            rep = build_feed(self.state_dir, self.fc.dir, self.fc.keys, latest=version, keep=self.fc.keep,
                             expires=self.expires, patch_format=self.fc.patch_format, zstd_level=self.fc.zstd_level)
        except Exception as exc:
            self._failed("build", f"feed build for version {version}", exc)
            return False
        self._next_refresh = time.time() + self.refresh_every
        lat = rep["latest"]
        log.info("feed release %d published: latest v%d%s", rep["release"], lat["version"],
                 " (operator rollback)" if lat["rollback"] else "")
        if self.metrics is not None:
            self.metrics.feed_releases.inc()
        self._show_report(rep)
        return True

    def _show_report(self, rep: dict[str, Any]) -> None:
        """Set the feed gauges from a :func:`mergestream.feed.build.build_feed` report."""
        if self.metrics is not None:
            m, lat = self.metrics, rep["latest"]
            m.feed_release.set(rep["release"])
            m.feed_latest.set(lat["version"])
            m.feed_timestamp_expiry.set(rep["timestamp_expires"])
            m.feed_version_bytes.clear()
            for v, n in rep["bytes_per_version"].items():
                m.feed_version_bytes.labels(version=v).set(n)
            m.feed_bytes_to_latest.clear()
            for v, n in rep["bytes_to_latest"].items():
                m.feed_bytes_to_latest.labels(from_version=v).set(n)

    def refresh(self) -> bool:
        """Re-sign the timestamp now (a full build of the same latest when snapshot or targets are
        about to expire). Never raises; returns True on success."""
        from ..feed.build import feed_status, refresh_timestamp

        if not (Path(self.fc.dir) / "metadata" / "timestamp.json").exists():  # nothing published yet
            self._next_refresh = time.time() + self.refresh_every
            return True
        try:
            st = refresh_timestamp(self.fc.dir, self.fc.keys, self.timestamp_life)
        except Exception as exc:
            self._failed("refresh", "feed timestamp refresh", exc)
            self._next_refresh = time.time() + min(self.fc.retry_seconds, self.refresh_every)
            return False
        if st is None:  # snapshot/targets expire first: a new release re-signs them all
            try:
                latest = feed_status(self.fc.dir)["latest"]
            except Exception as exc:
                self._failed("refresh", "feed status", exc)
                return False
            return self.publish(latest)
        self._next_refresh = time.time() + self.refresh_every
        if self.metrics is not None:
            self.metrics.feed_refreshes.inc()
        self._show_status(st)
        return True

    def _show_status(self, st: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.feed_release.set(st["release"])
            self.metrics.feed_latest.set(st["latest"] or 0)
            self.metrics.feed_timestamp_expiry.set(st["timestamp_expires"])

    def _failed(self, kind: str, what: str, exc: Exception) -> None:
        msg = " ".join(str(exc).split()) or type(exc).__name__
        log.error("%s failed (the local store is unchanged; retried later): %s: %s", what, type(exc).__name__, msg)
        if self.metrics is not None:
            self.metrics.feed_errors.labels(kind=kind).inc()


def build_feed_publisher(cfg: Config, metrics: Metrics | None = None) -> FeedPublisher | None:
    """The publisher of ``cfg.feed`` (None without ``feed.dir``).

    Raises:
        ConfigError: python-tuf is not installed, or a key the daemon signs with (targets, snapshot,
            timestamp; every role's public key) is missing or does not load. Root's private key is
            needed only for the first build and after a rotation (it may be kept offline otherwise).
    """
    from ..config import ConfigError

    fc = cfg.feed
    if fc.dir is None:
        return None
    try:
        from ..feed import keys as feed_keys
    except ImportError as exc:
        raise ConfigError(f"feed.dir needs python-tuf ({exc.name} is missing): pip install -e '.[feed]' from the checkout") \
            from None
    try:
        for role in feed_keys.ROLES:
            feed_keys.public_key(fc.keys, role)
        for role in ("targets", "snapshot", "timestamp"):
            feed_keys.signer(fc.keys, role)
    except feed_keys.FeedKeyError as exc:
        raise ConfigError(f"feed.keys: {exc}") from None
    for s in (metrics.feed_errors.labels(kind=k) for k in ("build", "refresh")) if metrics is not None else ():
        s.inc(0)
    return FeedPublisher(cfg.state_dir, fc, metrics)
