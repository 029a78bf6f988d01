"""MLflow webhook receiver: a signed ``model_version.created`` event triggers an immediate registry poll.

MLflow >= 3.3 posts registry events as JSON ``{"entity", "action", "timestamp", "data"}`` with
headers ``X-MLflow-Delivery-Id``, ``X-MLflow-Timestamp`` (Unix seconds) and
``X-MLflow-Signature: v1,<base64(HMAC-SHA256(secret, f"{delivery_id}.{timestamp}.{body}"))>``.
A valid ``model_version.created`` event only triggers an immediate poll; polling stays the source of
truth. Bad or missing signature, or a timestamp more than 5 minutes away: 401. Built by the MLflow
source's builder (:func:`mergestream.daemon.sources.mlflow.build`) when ``mlflow.webhook.enabled``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import time
from collections.abc import Callable

from ...errors import MalformedInputError
from ...io.st import load_json
from ..http import BackgroundHTTPServer, JsonPostHandler
from .base import Source

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-MLflow-Signature"
TIMESTAMP_HEADER = "X-MLflow-Timestamp"
DELIVERY_ID_HEADER = "X-MLflow-Delivery-Id"
#: Largest accepted request body (bytes).


def sign_webhook(secret: str, delivery_id: str, timestamp: str, body: bytes | str) -> str:
    """MLflow's webhook signature: ``"v1," + base64(HMAC-SHA256(secret, f"{delivery_id}.{timestamp}.{body}"))``."""
    if isinstance(body, bytes):
        body = body.decode("utf-8")
    mac = hmac.new(secret.encode("utf-8"), f"{delivery_id}.{timestamp}.{body}".encode("utf-8"), hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode("ascii")


def verify_webhook(secret: str, headers, body: bytes, *, tolerance_seconds: float = 300.0,
                   now: float | None = None) -> bool:
    """True if ``headers`` carry a valid MLflow signature of ``body`` made with ``secret`` and a
    timestamp within ``tolerance_seconds`` of ``now`` (replay protection). Never raises.

    ``headers`` is any mapping with ``.get`` (case-insensitive for ``http.server``'s message).
    The signature header may hold several space-separated ``v1,<sig>`` entries (Standard Webhooks).
    """
    delivery_id = headers.get(DELIVERY_ID_HEADER)
    timestamp = headers.get(TIMESTAMP_HEADER)
    signature = headers.get(SIGNATURE_HEADER)
    if not (delivery_id and timestamp and signature):
        return False
    try:
        ts = int(timestamp)
        text = body.decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return False
    if abs((time.time() if now is None else now) - ts) > tolerance_seconds:
        return False
    expected = sign_webhook(secret, delivery_id, timestamp, text).split(",", 1)[1]
    for part in signature.split():
        version, _, sig = part.partition(",")
        if version != "v1":
            continue
        try:
            base64.b64decode(sig, validate=True)
        except (binascii.Error, ValueError):
            continue
        if hmac.compare_digest(sig.encode("ascii", "replace"), expected.encode("ascii")):
            return True
    return False


class _WebhookHandler(JsonPostHandler):
    log_label = "webhook"
    server_version = "mergestream-webhook"
    receiver: WebhookReceiver  # set on the per-receiver subclass

    def do_POST(self):  # noqa: N802 - http.server's naming
        """Verify, parse and dispatch one delivery (replies: see :class:`WebhookReceiver`)."""
        body = self.read_body()
        if body is None:
            return None
        rx = self.receiver
        if not verify_webhook(rx.secret, self.headers, body, tolerance_seconds=rx.tolerance_seconds):
            log.warning("webhook rejected: bad or missing signature from %s", self.client_address[0])
            return self.reply(401, "invalid signature")
        try:
            payload = load_json(body, "webhook body", error=MalformedInputError)
        except MalformedInputError as exc:
            log.warning("webhook rejected from %s: %s", self.client_address[0], exc)
            return self.reply(400, "body is not a JSON object")
        entity, action = payload.get("entity"), payload.get("action")
        if not (isinstance(entity, str) and isinstance(action, str)):
            return self.reply(400, "entity and action must be strings")
        event = f"{entity}.{action}"
        if event != "model_version.created":
            log.debug("webhook event ignored: %s", event)
            return self.reply(200, f"ignored {event}")
        data = payload.get("data") or {}
        log.info("webhook model_version.created model=%s version=%s: polling now",
                 data.get("name") if isinstance(data, dict) else None,
                 data.get("version") if isinstance(data, dict) else None)
        try:
            rx.on_event()
        except Exception:
            log.exception("webhook on_event failed")
            return self.reply(500, "on_event failed")
        return self.reply(200, "poll triggered")


class WebhookReceiver(Source):
    """HTTP endpoint for MLflow (>= 3.3) webhooks: a valid ``model_version.created`` calls
    ``on_event()`` (typically :meth:`RegistrySource.trigger`).

    Any path is accepted (POST only). Replies: 200 (triggered or ignored event), 400 (not JSON),
    401 (missing/bad signature or timestamp older than ``tolerance_seconds``), 413 (body over
    :data:`MAX_BODY_BYTES`), 500 (``on_event`` raised). Served by the standard library's
    ``ThreadingHTTPServer`` on a daemon thread. Create the MLflow webhook with the same secret,
    e.g. ``MlflowClient.create_webhook(name, url, events=["model_version.created"], secret=...)``;
    an MLflow server only delivers to ``http://`` or private addresses when it runs with
    ``MLFLOW_WEBHOOK_ALLOWED_SCHEMES=http,https`` and ``MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS=true``.

    A :class:`~.base.Source` that never emits: the service starts and stops it with the others.

    Args:
        host: interface to bind (e.g. ``127.0.0.1``).
        port: TCP port; 0 picks a free one (see :attr:`port`).
        secret: the shared HMAC secret (non-empty).
        on_event: called on each valid event, on the request thread; keep it quick.
        tolerance_seconds: accepted clock difference for ``X-MLflow-Timestamp`` (seconds).
    """

    name = "mlflow-webhook"
    config_section = "mlflow.webhook"  # where its host and port are set (named when it cannot listen)

    def __init__(self, host: str, port: int, secret: str, on_event: Callable[[], None], *,
                 tolerance_seconds: float = 300.0):
        if not secret:
            raise ValueError("WebhookReceiver needs a non-empty secret")
        self.host = host
        self.secret = secret
        self.on_event = on_event
        self.tolerance_seconds = float(tolerance_seconds)
        handler = type("BoundWebhookHandler", (_WebhookHandler,), {"receiver": self})
        self._http = BackgroundHTTPServer(host, port, handler, name="mlflow-webhook", poll_interval=0.2)

    @property
    def port(self) -> int:
        """The bound port once started (the requested one before)."""
        return self._http.port

    def start(self) -> None:
        """Bind and serve on a background thread.

        Raises:
            ListenError: the address cannot be bound (an ``OSError``).
            RuntimeError: already started.
        """
        if self._http.serving:
            raise RuntimeError("WebhookReceiver already started")
        self._http.start()
        log.info("webhook receiver listening on %s", self._http.url)

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        if not self._http.serving:
            return
        self._http.stop()
        log.info("webhook receiver stopped")
