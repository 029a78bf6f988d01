"""Bucket notifications: an ``ObjectCreated`` event posted over HTTP triggers an immediate S3 poll.

MinIO (``mc event add ... arn:minio:sqs::_:webhook``, with ``auth_token``) posts
``{"EventName": "s3:ObjectCreated:Put", "Key": ..., "Records": [...]}`` with the header
``Authorization: Bearer <token>``; AWS S3 event records (``{"Records": [{"eventName":
"ObjectCreated:Put", ...}]}``, e.g. relayed by a small Lambda or an EventBridge API destination)
are understood too. An event only triggers a poll: listing stays the source of truth, so a lost or
forged notification can never make a half-written expert look ready. Replies: 200 (triggered or
ignored), 400 (not a JSON object), 401 (token missing or wrong), 413 (body over
:data:`MAX_BODY_BYTES`).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable

from ...errors import MalformedInputError
from ...io.st import load_json
from ..http import BackgroundHTTPServer, JsonPostHandler
from .base import Source

log = logging.getLogger(__name__)

#: Largest accepted request body (bytes).


def event_names(payload: object) -> list[str]:
    """The event names in a MinIO or AWS S3 notification body (``[]`` for anything else)."""
    if not isinstance(payload, dict):
        return []
    names = [payload["EventName"]] if isinstance(payload.get("EventName"), str) else []
    records = payload.get("Records")
    for rec in records if isinstance(records, list) else []:
        if isinstance(rec, dict) and isinstance(rec.get("eventName"), str):
            names.append(rec["eventName"])
    return names


class _Handler(JsonPostHandler):
    log_label = "s3 notification"
    server_version = "mergestream-s3-notify"
    receiver: NotificationReceiver

    def do_POST(self):  # noqa: N802 - http.server's naming
        """Check the token, parse, and trigger a poll on an ObjectCreated event."""
        body = self.read_body()
        if body is None:
            return None
        given = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.receiver.token.encode()):
            log.warning("s3 notification rejected: missing or wrong token from %s", self.client_address[0])
            return self.reply(401, "invalid token")
        try:
            names = event_names(load_json(body, "s3 notification body", error=MalformedInputError, expect=None))
        except MalformedInputError as exc:
            log.warning("s3 notification rejected from %s: %s", self.client_address[0], exc)
            return self.reply(400, "body is not JSON")
        created = [n for n in names if "ObjectCreated" in n]
        if not created:
            return self.reply(200, "ignored")
        log.info("s3 notification %s: polling now", created[0])
        self.receiver.on_event()
        return self.reply(200, "poll triggered")


class NotificationReceiver(Source):
    """HTTP endpoint for bucket notifications; each ``ObjectCreated`` event calls ``on_event()``
    (the S3 source's :meth:`~.s3.S3Source.trigger`). A :class:`~.base.Source` that never emits.

    Args:
        host: interface to bind. port: TCP port (0: a free one, see :attr:`port`).
        token: the bearer token the notifier sends (MinIO's ``auth_token``); non-empty.
        on_event: called on the request thread; keep it quick.

    Raises:
        ValueError: an empty token.
    """

    name = "s3-notify"
    config_section = "s3.notify"  # where its host and port are set (named when it cannot listen)

    def __init__(self, host: str, port: int, token: str, on_event: Callable[[], None]):
        if not token:
            raise ValueError("NotificationReceiver needs a non-empty token")
        self.token = token
        self.on_event = on_event
        handler = type("BoundS3NotifyHandler", (_Handler,), {"receiver": self})
        self._http = BackgroundHTTPServer(host, port, handler, name="s3-notify", poll_interval=0.2)

    @property
    def port(self) -> int:
        """The bound port once started (the requested one before)."""
        return self._http.port

    def start(self) -> None:
        """Bind and serve on a background thread.

        Raises:
            ListenError: the address cannot be bound (an ``OSError``). RuntimeError: already started.
        """
        if self._http.serving:
            raise RuntimeError("NotificationReceiver already started")
        self._http.start()
        log.info("s3 notification receiver listening on %s", self._http.url)

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        if self._http.serving:
            self._http.stop()
