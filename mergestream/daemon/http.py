"""One home for the daemon's small HTTP endpoints (metrics and health, the MLflow webhook).

:class:`BackgroundHTTPServer` serves a ``http.server.BaseHTTPRequestHandler`` subclass with the
standard library's ``ThreadingHTTPServer`` (one daemon thread per request) from a daemon thread, with
an idempotent :meth:`~BackgroundHTTPServer.stop` and the bound :attr:`~BackgroundHTTPServer.port`
(port 0 picks a free one); :func:`send_body` writes one whole reply; :class:`JsonPostHandler` is
the base of the receivers of small JSON deliveries (the MLflow webhook, S3 bucket notifications).

IPv4 and IPv6 alike: the socket's address family is the first ``getaddrinfo`` answer for the host
(``127.0.0.1``, ``0.0.0.0``, ``::1``, ``::``, a name; ``[::1]`` in brackets too), and ``::`` also
accepts IPv4 clients where the OS allows dual-stack sockets. A refusal is a :class:`ListenError`
naming the host, the port and the system's own reason.
"""

from __future__ import annotations

import contextlib
import errno
import http.server
import json
import logging
import socket
import threading

log = logging.getLogger(__name__)

#: the largest request body a :class:`JsonPostHandler` reads (bytes)
MAX_BODY_BYTES = 1024 * 1024


def send_body(handler: http.server.BaseHTTPRequestHandler, code: int, body: bytes, content_type: str) -> None:
    """Reply to the request ``handler`` serves: status ``code``, ``Content-Type`` and
    ``Content-Length`` headers, then ``body``."""
    handler.send_response(code)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


class JsonPostHandler(http.server.BaseHTTPRequestHandler):
    """A request handler for small JSON POST deliveries: replies are ``{"message": ...}`` JSON, the
    body is read only when its ``Content-Length`` is valid and at most :data:`MAX_BODY_BYTES`, and
    the server's per-request log lines go to this module's debug log under ``log_label``."""

    log_label = "http"

    def log_message(self, format, *args):  # noqa: A002 - http.server's signature
        log.debug("%s %s %s", self.log_label, self.address_string(), format % args)

    def reply(self, code: int, message: str) -> None:
        """Reply ``code`` with ``{"message": message}``."""
        send_body(self, code, json.dumps({"message": message}).encode(), "application/json")

    def read_body(self) -> bytes | None:
        """The request body (bytes), or None after replying 400 (unreadable ``Content-Length``) or
        413 (a body above :data:`MAX_BODY_BYTES`)."""
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            self.reply(400, "bad Content-Length")
            return None
        if length < 0 or length > MAX_BODY_BYTES:
            self.reply(413, "body too large")
            return None
        return self.rfile.read(length)


class ListenError(OSError):
    """A server cannot listen on ``host:port``: the host does not resolve or is no address of this
    machine, the port is taken or privileged... The text names both and the system's reason
    (``strerror``); ``errno`` is the system's."""

    def __init__(self, host: str, port: int, exc: OSError):
        reason = exc.strerror or str(exc) or type(exc).__name__
        super().__init__(exc.errno, reason)
        self.host, self.port = host, port

    def __str__(self) -> str:
        return f"cannot listen on {host_port(self.host, self.port)}: {self.strerror}"


def listen_hint(exc: ListenError, section: str) -> str:
    """What to change in config ``section`` (e.g. ``metrics``, ``mlflow.webhook``) when ``exc``
    refused its ``host`` and ``port``: the port when it is taken or privileged, else the host."""
    env = "MERGESTREAM_" + section.upper().replace(".", "__")
    if exc.errno == errno.EADDRINUSE:
        return (f"{section}.port {exc.port} is taken: set {section}.port (or {env}__PORT) to a free port, "
                "or 0 for any free one")
    if exc.errno == errno.EACCES:
        return f"ports below 1024 need privileges: set {section}.port (or {env}__PORT) above 1023"
    return (f"set {section}.host (or {env}__HOST) to an address of this machine: 127.0.0.1 or ::1, "
            "0.0.0.0 (all IPv4) or :: (all IPv6, and IPv4 where the OS allows)")


def host_port(host: str, port: int) -> str:
    """``host:port`` as a URL writes it: ``127.0.0.1:9108``, ``[::1]:9108``."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Server(http.server.ThreadingHTTPServer):
    """``ThreadingHTTPServer`` whose IPv6 socket accepts IPv4 clients too where the OS allows."""

    daemon_threads = True

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6 and hasattr(socket, "IPV6_V6ONLY"):
            with contextlib.suppress(OSError):  # dual-stack unsupported: IPv6 only
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def _listening_server(host: str, port: int, handler: type[http.server.BaseHTTPRequestHandler]) -> _Server:
    """A bound :class:`_Server` for ``host:port``, of the address family ``getaddrinfo`` gives first.

    Raises:
        ListenError: the host does not resolve, or the address cannot be bound.
    """
    try:
        family, _, _, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
        cls = type(f"_Server{family.name}", (_Server,), {"address_family": family})
        return cls(address, handler)
    except OSError as exc:
        raise ListenError(host, port, exc) from None


class BackgroundHTTPServer:
    """A ``ThreadingHTTPServer`` for ``handler`` on ``host:port``, served on a daemon thread.

    Args:
        host: interface to bind (e.g. ``127.0.0.1``, ``::1``; ``0.0.0.0`` for all of IPv4, ``::``
            for all of IPv6 and, where the OS allows, IPv4).
        port: TCP port; 0 picks a free one (see :attr:`port`).
        handler: the request handler class (one instance per request, on its own thread).
        name: the serving thread's name.
        poll_interval: how often (seconds) the serving loop checks for :meth:`stop`.
    """

    def __init__(self, host: str, port: int, handler: type[http.server.BaseHTTPRequestHandler], *, name: str,
                 poll_interval: float = 0.5):
        self.host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        self._port = int(port)
        self.handler = handler
        self.name = name
        self.poll_interval = float(poll_interval)
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port once bound (the requested one before)."""
        return self._server.server_address[1] if self._server is not None else self._port

    @property
    def url(self) -> str:
        """``http://host:port`` of this server (IPv6 hosts in brackets; the bound port once bound)."""
        return f"http://{host_port(self.host, self.port)}"

    @property
    def serving(self) -> bool:
        """True between :meth:`start` and :meth:`stop`."""
        return self._thread is not None

    def bind(self) -> None:
        """Bind the socket now, without serving yet (idempotent; :meth:`start` binds if needed).

        Raises:
            ListenError: the address cannot be bound (in use, unknown host, not of this machine,
                no permission); an ``OSError``.
        """
        if self._server is None:
            self._server = _listening_server(self.host, self._port, self.handler)

    def start(self) -> None:
        """Bind (unless done) and serve on a background daemon thread.

        Raises:
            ListenError: the address cannot be bound (an ``OSError``).
            RuntimeError: already serving.
        """
        if self._thread is not None:
            raise RuntimeError(f"{self.name} already started")
        self.bind()
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": self.poll_interval}, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving, close the socket and join the thread (waits up to 10 s); idempotent, and
        safe on a server that was bound but never started."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        if thread is not None:
            server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=10)
