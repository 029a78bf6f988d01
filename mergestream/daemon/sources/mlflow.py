"""MLflow registry source: poll registered models and emit each new READY version, in version order.

An apscheduler ``BackgroundScheduler`` interval job (``coalesce=True``, ``max_instances=1``, first
run at once) calls :meth:`RegistrySource.poll`. Per registered model it pages through
``MlflowClient.search_model_versions`` (``name = '<model>' AND version_number > <last>``, ordered by
``version_number ASC``; MLflow returns a ``PagedList`` whose ``token`` names the next page), then
walks the versions above the last one in integer order (9 before 10):

* a tag filter mismatch is skipped (note: a tag set on an older version *after* a newer one was
  emitted is never seen: the cursor only moves forward);
* ``PENDING_REGISTRATION`` stops the model for this poll (a later version must not overtake it),
  until the version is older than ``pending_timeout_seconds`` (by the registry's
  ``last_updated_timestamp``, else ``creation_timestamp``, else when this source first saw it): then
  it is skipped like a failed one (if it turns READY before a later version was taken, it is still
  taken; after that, never);
* ``FAILED_REGISTRATION`` (or any other status that is not READY) is skipped. A skipped version is
  warned about and passed to ``on_error`` once, not on every poll: the skipped versions above the
  cursor are remembered in the ledger (cursor ``mlflow-skipped:<model>``), so also across restarts;
* ``READY`` is downloaded (:mod:`.mlflow_download`: verified against the artifact listing) and
  emitted; a download that still fails after ``max_retries`` retries with exponential backoff
  (``backoff_seconds · 2^i``, capped at 60 s) stops the model for this poll (``on_error`` is called;
  the next poll retries it);
* a version deleted before it was folded (absent from the search, or gone when its download URI is
  asked for) is skipped with a log line.

A registered model that does not exist (a typo in ``mlflow.registry.models``, or renamed) is an
error on every poll: a warning naming the closest existing names, ``on_error``, and a ``status``
note. Every other poll failure of a model (registry unreachable, download failed) is a note too,
cleared by the model's next clean poll.

Keys and cursor: each event's registry key is ``mlflow:<model>:<version>``; the cursor of a model is
the ledger entry ``mlflow:<model>`` (the highest version enqueued), advanced by
:meth:`RegistrySource.on_enqueued`. A poll starts above ``max(cursor, highest version this source
emitted)``. Before a queued version is folded, :meth:`RegistrySource.still_available` (or
:func:`version_exists` when no registry source runs) asks the registry whether it was deleted since;
the running source also checks the cached download against the artifact listing again and fetches
it anew when it is not whole (so ``retry`` of a version rejected for a damaged copy downloads it).

With ``mlflow.webhook.enabled`` the builder adds a :class:`~.webhook.WebhookReceiver` whose valid
``model_version.created`` events trigger an immediate poll; polling stays the source of truth.
"""

from __future__ import annotations

import difflib
import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import MergestreamError
from ...redaction import redact_uris
from .base import Cursors, Emit, ExpertReady, Source, SourceContext
from .mlflow_download import VersionDeleted, VersionDownloads, is_not_found
from .webhook import WebhookReceiver

if TYPE_CHECKING:
    from ...config import Config

log = logging.getLogger(__name__)

NAME = "mlflow"


# ------------------------------------------------------------------------------------------
# Keys, cursors, the deleted-version check
# ------------------------------------------------------------------------------------------
def version_key(model: str, version: int) -> str:
    """The ledger's registry key of one model version: ``mlflow:<model>:<version>``."""
    return f"{NAME}:{model}:{version}"


def parse_key(key: str) -> tuple[str, int] | None:
    """``(model, version)`` of a registry key made by :func:`version_key`; None for another
    source's key or a malformed one (no model, or a version that is not an integer). Never raises."""
    scheme, _, rest = key.partition(":")
    model, _, version = rest.rpartition(":")
    if scheme != NAME or not model or not version.isdigit():
        return None
    return model, int(version)


def cursor_version(cursors: Cursors, model: str) -> int:
    """The highest version of ``model`` already enqueued (0 if none), from the ledger cursor
    ``mlflow:<model>``."""
    return int(cursors.get_cursor(f"{NAME}:{model}", "0"))


class RegisteredModelMissing(LookupError):
    """A registered model named in ``mlflow.registry.models`` does not exist in the registry."""


class VersionSkipped(Exception):
    """A registry version that will not be taken (FAILED_REGISTRATION, or pending too long)."""


def advance_cursor(cursors: Cursors, key: str) -> None:
    """Move the cursor of the key's model up to its version (never down; other keys: nothing)."""
    parsed = parse_key(key)
    if parsed is not None and parsed[1] > cursor_version(cursors, parsed[0]):
        cursors.set_cursor(f"{NAME}:{parsed[0]}", str(parsed[1]))


def registry_server_uri(cfg: Config) -> str:
    """The registry server of ``cfg``: ``mlflow.registry.tracking_uri``, else the tracking URI."""
    return cfg.mlflow.registry.tracking_uri or cfg.tracking_uri()


def _key_still_registered(key: str, client_factory) -> bool:
    """False only if the registry says the key's version no longer exists (see :func:`version_exists`)."""
    parsed = parse_key(key)
    if parsed is None:
        return True
    model, version = parsed
    try:
        client_factory().get_model_version(model, str(version))
        return True
    except Exception as exc:
        if is_not_found(exc) or "not found" in str(exc).lower():
            log.warning("skipping %s: version %s of %s was deleted from the registry", key, version, model)
            return False
        return True  # registry unreachable: fold what we already downloaded


def version_exists(cfg: Config, key: str) -> bool:
    """Whether the registry version behind ``key`` still exists, asked of the registry server of
    ``cfg`` without a running source (one-shot folds). True for other sources' keys and when the
    registry cannot be reached (what was downloaded is folded). Never raises."""
    def client():
        from mlflow import MlflowClient

        uri = registry_server_uri(cfg)
        return MlflowClient(tracking_uri=uri, registry_uri=uri)

    return _key_still_registered(key, client)


# ------------------------------------------------------------------------------------------
# The source
# ------------------------------------------------------------------------------------------
def _quote(value: str) -> str:
    """A string literal for an MLflow search filter."""
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise ValueError(f"registered model name {value!r} holds both quote characters; cannot search for it")


class RegistrySource(Source):
    """Poll an MLflow model registry and emit each new READY version, in version order.

    Behaviour (ordering, tag filter, pending/failed/deleted versions) is in the module docstring;
    downloads and the cache in :mod:`.mlflow_download`.

    Args:
        models: registered model names to follow.
        emit: called once per new version; an exception from it counts as an error (``on_error``)
            and stops that model for this poll (the version is retried next poll).
        last_version: the highest version already taken for a model (0 if none); usually read from
            the ledger.
        cache_dir: downloads land in ``cache_dir/<model>/<version>/``.
        tracking_uri, registry_uri: MLflow URIs (None: MLflow's defaults; the registry defaults to
            the tracking URI).
        interval_seconds: seconds between scheduled polls.
        tag_filter: only versions whose tags include all these key/value pairs.
        max_retries: download retries after the first attempt.
        backoff_seconds: first retry delay in seconds; doubles each retry, capped at 60 s.
        on_error: called with each error (registry unreachable, a registered model that does not
            exist, download failed after retries, emit failed; once per skipped version); its own
            exceptions are logged and swallowed.
        cursors: where :meth:`on_enqueued` advances the model cursors and the skipped versions are
            remembered (None: nowhere; skipped versions are then remembered while this source lives).
        pending_timeout_seconds: seconds after which a PENDING_REGISTRATION version is skipped.
        note: ``note(subject, message_or_None, level)`` keeps what ``status`` shows about a model
            (subjects ``model:<name>``, ``skipped:<name>``); None: nothing is kept.

    Registry calls use MLflow's own HTTP retries (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, default 7
    with exponential backoff, ``MLFLOW_HTTP_REQUEST_TIMEOUT``): an unreachable server can hold one
    poll for minutes unless those are lowered.
    """

    name = NAME
    JOB_ID = "mergestream-mlflow-poll"
    #: ``max_results`` of each ``search_model_versions`` page.
    PAGE_SIZE = 1000

    def __init__(self, models: list[str], emit: Emit, *, last_version: Callable[[str], int],
                 cache_dir: Path, tracking_uri: str | None = None, registry_uri: str | None = None,
                 interval_seconds: float = 30.0, tag_filter: dict[str, str] | None = None,
                 max_retries: int = 5, backoff_seconds: float = 1.0,
                 on_error: Callable[[Exception], None] | None = None, cursors: Cursors | None = None,
                 pending_timeout_seconds: float = 3600.0,
                 note: Callable[[str, str | None, str], None] | None = None):
        if not models:
            raise ValueError("RegistrySource needs at least one registered model name")
        for m in models:
            _quote(m)
        if interval_seconds <= 0:
            raise ValueError(f"interval_seconds must be > 0, got {interval_seconds}")
        if max_retries < 0 or backoff_seconds < 0:
            raise ValueError("max_retries and backoff_seconds must be >= 0")
        if pending_timeout_seconds <= 0:
            raise ValueError(f"pending_timeout_seconds must be > 0, got {pending_timeout_seconds}")
        self.models = list(models)
        self.emit = emit
        self.last_version = last_version
        self.cache_dir = Path(cache_dir)
        self.tracking_uri = tracking_uri
        self.registry_uri = registry_uri or tracking_uri
        self.interval_seconds = float(interval_seconds)
        self.tag_filter = dict(tag_filter or {})
        self.max_retries = int(max_retries)
        self.backoff_seconds = float(backoff_seconds)
        self.on_error = on_error
        self.cursors = cursors
        self.pending_timeout_seconds = float(pending_timeout_seconds)
        self.note = note
        self._client = None
        self._high: dict[str, int] = {}
        self._skipped: dict[str, dict[int, str]] = {}    # per model: version -> why (above the cursor)
        self._pending_seen: dict[tuple[str, int], float] = {}  # first sight of a pending version (Unix s)
        self._poll_lock = threading.Lock()
        self._stopping = threading.Event()
        self._again = threading.Event()      # a trigger arrived since the running poll started
        self._running = False                # the scheduled job is running (guarded by _flag_lock)
        self._flag_lock = threading.Lock()
        self._scheduler = None
        self._server_side_filter = True
        self._downloads = VersionDownloads(self.cache_dir, self._get_client, tracking_uri=self.tracking_uri,
                                           registry_uri=self.registry_uri, max_retries=self.max_retries,
                                           backoff_seconds=self.backoff_seconds, stopping=self._stopping)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the background scheduler; the first poll runs at once.

        Raises:
            RuntimeError: already started.
        """
        if self._scheduler is not None:
            raise RuntimeError("RegistrySource already started")
        from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_EXECUTED
        from apscheduler.schedulers.background import BackgroundScheduler
        from apscheduler.triggers.interval import IntervalTrigger

        self._stopping.clear()
        self._running = False
        self._downloads.clean_stale(self.models)
        sched = BackgroundScheduler(timezone=timezone.utc)
        sched.add_job(self._job, IntervalTrigger(seconds=self.interval_seconds, timezone=timezone.utc),
                      id=self.JOB_ID, coalesce=True, max_instances=1, misfire_grace_time=None,
                      next_run_time=datetime.now(timezone.utc))
        sched.add_listener(self._on_job_done, EVENT_JOB_EXECUTED | EVENT_JOB_ERROR)
        self._scheduler = sched
        sched.start()
        log.info("registry source started models=%s tracking_uri=%s interval_seconds=%.1f",
                 self.models, redact_uris(self.tracking_uri), self.interval_seconds)

    def stop(self) -> None:
        """Stop the scheduler, waiting for a running poll (its backoff sleeps are cut short);
        idempotent."""
        self._stopping.set()
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=True)
            self._scheduler = None
        log.info("registry source stopped models=%s", self.models)

    def trigger(self) -> None:
        """Ask for an immediate poll (thread-safe, returns at once). A poll that is already running
        is followed by one more as soon as it ends. Without :meth:`start`, does nothing."""
        with self._flag_lock:
            self._again.set()
            if self._running:  # _on_job_done reschedules when the running poll has ended
                return
        self._run_now()

    def _run_now(self) -> None:
        sched = self._scheduler
        if sched is None or self._stopping.is_set():
            return
        try:
            sched.modify_job(self.JOB_ID, next_run_time=datetime.now(timezone.utc))
        except Exception:  # scheduler shutting down
            log.debug("immediate poll not scheduled: scheduler not running", exc_info=True)

    def _job(self) -> None:
        with self._flag_lock:
            self._running = True
            self._again.clear()  # this poll starts after every trigger so far: it serves them
        self.poll()

    def _on_job_done(self, event) -> None:
        """apscheduler listener, called after the executor released the job's instance slot (so a
        run scheduled from here is not skipped by ``max_instances=1``)."""
        if event.job_id != self.JOB_ID:
            return
        with self._flag_lock:
            self._running = False
            again = self._again.is_set()
        if again:
            self._run_now()

    # -- what the service asks ----------------------------------------------------------------
    def still_available(self, registry_key: str) -> bool:
        """False only if the registry says the key's version was deleted (see :func:`version_exists`);
        asked with a fresh client on the caller's thread. For a version of a followed model, the
        cached download is then checked against the artifact listing and fetched again (one
        attempt, no backoff) when it is not whole; a failure there is logged and passed to
        ``on_error``, and the fold then judges what is in the cache. Never raises."""
        if not _key_still_registered(registry_key, self._new_client):
            return False
        parsed = parse_key(registry_key)
        if parsed is None or parsed[0] not in self.models:
            return True
        try:
            self._downloads.fetch(*parsed, retries=0)
        except VersionDeleted:
            log.warning("skipping %s: the version was deleted from the registry", registry_key)
            return False
        except Exception as exc:
            log.warning("cannot verify or fetch again the download of %s: %s: %s", registry_key,
                        type(exc).__name__, exc)
            self._error(exc)
            self._note(f"model:{parsed[0]}", f"version {parsed[1]}: the cached copy could not be checked or "
                                             f"fetched again: {type(exc).__name__}: {exc}")
        return True

    def on_enqueued(self, ev: ExpertReady) -> None:
        """Advance the model's cursor to the enqueued version (see :func:`advance_cursor`)."""
        if self.cursors is not None and ev.registry_key:
            advance_cursor(self.cursors, ev.registry_key)

    # -- polling -----------------------------------------------------------------------------
    def _new_client(self):
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.registry_uri)

    def _get_client(self):
        if self._client is None:
            self._client = self._new_client()
        return self._client

    def _error(self, exc: Exception) -> None:
        if self.on_error is not None:
            try:
                self.on_error(exc)
            except Exception:
                log.exception("on_error callback failed")

    def _note(self, subject: str, message: str | None, level: str = "error") -> None:
        if self.note is not None:
            try:
                self.note(subject, message, level)
            except Exception:
                log.exception("note callback failed")

    def poll(self) -> list[ExpertReady]:
        """One synchronous poll of every model; returns the events emitted, in order.

        Never raises for registry or download errors: each is logged and passed to ``on_error``;
        the model it happened on stops for this poll, the other models go on.
        """
        out: list[ExpertReady] = []
        with self._poll_lock:
            for model in self.models:
                if self._stopping.is_set():
                    break
                try:
                    events, problem = self._poll_model(model)
                    out.extend(events)
                except Exception as exc:
                    log.warning("registry poll failed model=%s tracking_uri=%s: %s: %s", model,
                                redact_uris(self.tracking_uri), type(exc).__name__, redact_uris(exc))
                    self._error(exc)
                    problem = str(exc) if isinstance(exc, RegisteredModelMissing) else f"{type(exc).__name__}: {exc}"
                self._note(f"model:{model}", problem)
        return out

    def _check_model_exists(self, model: str) -> None:
        """Raises :class:`RegisteredModelMissing` (naming the closest existing names) if the
        registry has no registered model ``model``; other registry errors propagate."""
        client = self._get_client()
        try:
            client.get_registered_model(model)
            return
        except Exception as exc:
            if not is_not_found(exc):
                raise
        try:
            names = [m.name for m in client.search_registered_models(max_results=self.PAGE_SIZE)]
        except Exception:
            names = []
        close = difflib.get_close_matches(model, names, n=3, cutoff=0.5)
        hint = f" (closest names there: {', '.join(map(repr, close))})" if close else ""
        raise RegisteredModelMissing(f"registered model {model!r} does not exist in the registry at "
                                     f"{redact_uris(self.registry_uri)}{hint}: renamed or misspelt? "
                                     "fix mlflow.registry.models")

    # -- versions that are skipped ---------------------------------------------------------------
    def _skipped_of(self, model: str) -> dict[int, str]:
        """The versions of ``model`` skipped so far and still above its cursor (loaded once from
        the ledger cursor ``mlflow-skipped:<model>``)."""
        if model not in self._skipped:
            raw = self.cursors.get_cursor(f"{NAME}-skipped:{model}", "") if self.cursors is not None else ""
            self._skipped[model] = {int(v): "skipped before" for v in (raw or "").split(",") if v.isdigit()}
        return self._skipped[model]

    def _skip(self, model: str, version: int, why: str) -> None:
        """Skip ``version``: warned, counted (``on_error``) and noted the first time only."""
        skipped = self._skipped_of(model)
        if version in skipped:
            log.debug("version still skipped model=%s version=%d: %s", model, version, why)
            return
        floor = int(self.last_version(model))
        for v in [v for v in skipped if v <= floor]:
            del skipped[v]  # the cursor has passed them: they can never come back
        skipped[version] = why
        if self.cursors is not None:
            self.cursors.set_cursor(f"{NAME}-skipped:{model}", ",".join(map(str, sorted(skipped))))
        msg = f"version {version} of registered model {model!r} skipped: {why}"
        log.warning("%s", msg)
        self._error(VersionSkipped(msg))
        self._note(f"skipped:{model}", f"versions skipped: {', '.join(map(str, sorted(skipped)))} (latest: {msg})",
                   "warning")

    def _pending_too_long(self, model: str, mv) -> float | None:
        """How long (s) the pending version ``mv`` has been pending if that exceeds
        ``pending_timeout_seconds``, else None. By the registry's timestamps (ms), else by when this
        source first saw it pending."""
        v = int(mv.version)
        stamp = getattr(mv, "last_updated_timestamp", None) or getattr(mv, "creation_timestamp", None)
        since = stamp / 1000.0 if stamp else self._pending_seen.setdefault((model, v), time.time())
        age = time.time() - since
        return age if age > self.pending_timeout_seconds else None

    def _search(self, model: str, last: int) -> list:
        """Every non-deleted version of ``model`` above ``last`` (any status), all pages."""
        from mlflow.exceptions import MlflowException

        client = self._get_client()
        name = f"name = {_quote(model)}"
        while True:
            if self._server_side_filter:
                flt, order = f"{name} AND version_number > {last}", ["version_number ASC"]
            else:
                flt, order = name, None
            versions, token = [], None
            try:
                while True:
                    page = client.search_model_versions(flt, max_results=self.PAGE_SIZE, order_by=order,
                                                        page_token=token)
                    versions.extend(page)
                    token = page.token
                    if not token:
                        return versions
            except MlflowException as exc:
                if self._server_side_filter and getattr(exc, "error_code", None) == "INVALID_PARAMETER_VALUE":
                    log.info("registry rejects version_number filter/order (%s); filtering client-side", exc)
                    self._server_side_filter = False
                    continue
                raise

    def _poll_model(self, model: str) -> tuple[list[ExpertReady], str | None]:
        """The events of one model's poll, and the problem that stopped it early (or None).

        Raises:
            RegisteredModelMissing: the model does not exist.
            Exception: the registry could not be searched.
        """
        last = max(int(self.last_version(model)), self._high.get(model, 0))
        versions = [mv for mv in self._search(model, last) if int(mv.version) > last]
        if not versions:
            self._check_model_exists(model)
        versions.sort(key=lambda mv: int(mv.version))
        present = {int(mv.version) for mv in versions}
        if present:
            gone = [v for v in range(last + 1, max(present)) if v not in present]
            if gone:
                log.info("registry versions absent (deleted before folding), skipped model=%s versions=%s",
                         model, gone)
        out = []
        for mv in versions:
            v = int(mv.version)
            tags = dict(mv.tags or {})
            if any(tags.get(k) != val for k, val in self.tag_filter.items()):
                log.debug("version skipped by tag filter model=%s version=%d", model, v)
                continue
            if mv.status == "PENDING_REGISTRATION":
                age = self._pending_too_long(model, mv)
                if age is None:
                    log.info("version pending registration; later versions wait model=%s version=%d", model, v)
                    break
                self._skip(model, v, f"PENDING_REGISTRATION for {age:.0f} s, over "
                                     f"mlflow.registry.pending_timeout_seconds ({self.pending_timeout_seconds:g} s)")
                continue
            if mv.status != "READY":
                self._skip(model, v, f"status {mv.status}")
                continue
            try:
                path, download_uri = self._downloads.fetch(model, v)
            except VersionDeleted:
                log.warning("version deleted before it was folded, skipped model=%s version=%d", model, v)
                continue
            except Exception as exc:
                log.error("download failed after %d retries model=%s version=%d: %s: %s; later versions wait",
                          self.max_retries, model, v, type(exc).__name__, redact_uris(exc))
                self._error(exc)
                return out, f"version {v}: download failed: {type(exc).__name__}: {exc}"
            meta = {"mlflow.model": model, "mlflow.version": str(v), "mlflow.run_id": mv.run_id or "",
                    "mlflow.source": redact_uris(mv.source or ""), "mlflow.download_uri": redact_uris(download_uri)}
            meta.update({f"tag.{k}": str(val) for k, val in tags.items()})
            ev = ExpertReady(source=self.name, uri=str(path), expert_id=f"{model}-v{v}",
                             registry_key=version_key(model, v), metadata=meta)
            try:
                self.emit(ev)
            except Exception as exc:
                log.exception("emit failed model=%s version=%d; later versions wait", model, v)
                self._error(exc)
                return out, f"version {v}: could not be queued: {type(exc).__name__}: {exc}"
            self._high[model] = v
            out.append(ev)
            log.info("expert ready source=mlflow id=%s uri=%s", ev.expert_id, ev.uri)
        return out, None


def build(cfg: Config, emit: Emit, context: SourceContext) -> list[Source]:
    """The registry source of ``cfg.mlflow.registry`` (none unless enabled with models), and its
    webhook receiver when ``mlflow.webhook.enabled``.

    Raises:
        MergestreamError: the webhook is enabled without a secret.
    """
    context.clear_notes(NAME)
    r = cfg.mlflow.registry
    if not (r.enabled and r.models):
        return []
    uri = registry_server_uri(cfg)
    src = RegistrySource(r.models, emit, last_version=lambda model: cursor_version(context.cursors, model),
                         cache_dir=cfg.state_dir / "cache", tracking_uri=uri, registry_uri=uri,
                         interval_seconds=r.interval_seconds, tag_filter=r.tag_filter or None,
                         max_retries=r.max_retries, backoff_seconds=r.backoff_seconds,
                         on_error=lambda exc: context.on_error(NAME, exc), cursors=context.cursors,
                         pending_timeout_seconds=r.pending_timeout_seconds,
                         note=lambda subject, message, level: context.note(NAME, subject, message, level))
    wh = cfg.mlflow.webhook
    if not wh.enabled:
        return [src]
    if wh.secret is None:
        raise MergestreamError("mlflow.webhook.enabled needs a secret (MERGESTREAM_MLFLOW__WEBHOOK__SECRET)")
    return [src, WebhookReceiver(wh.host, wh.port, wh.secret.get_secret_value(), src.trigger)]
