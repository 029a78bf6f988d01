"""A real MLflow tracking server for tests: ``mlflow server`` in a subprocess on 127.0.0.1.

Two ways to use it:

* the pytest fixture :func:`mlflow_server` (module scope: one server per test module), which
  yields an :class:`MlflowServer` whose ``uri`` is the tracking (and registry) URI::

      from tests.mlflow_server import mlflow_server  # noqa: F401  (re-export the fixture)

      def test_something(mlflow_server):
          client = mlflow.MlflowClient(mlflow_server.uri)

* the context manager :func:`run_mlflow_server` for anything that is not a pytest fixture::

      with run_mlflow_server(tmp_path) as server:
          ...

The server runs ``sys.executable -m mlflow server`` (the interpreter of the current virtual
environment) with a SQLite store, proxied artifacts under ``<root>/artifacts``
(``--artifacts-destination``; new experiments get ``mlflow-artifacts:/`` as their artifact root,
so clients upload and download through the server), ``--workers 1`` and
``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false``. It is started in its own process group and the whole
group (uvicorn and its worker) is terminated at exit, then killed if it lingers.

Webhooks: the server only delivers webhooks to ``https`` URLs with public IPs by default. With
``allow_local_webhooks=True`` (the default here) the server gets
``MLFLOW_WEBHOOK_ALLOWED_SCHEMES=http,https`` and ``MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS=true`` so it can
call a receiver on ``http://127.0.0.1``, ``MLFLOW_WEBHOOK_CACHE_TTL=0`` (the server otherwise
caches the list of webhooks per event for 60 s, so a webhook created after an event of the same
kind would be ignored for up to a minute), and a fixed ``MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY``.
The URL checks run in the server (the store and the delivery code), so a client talking to this
server needs nothing; a process that uses a SQLite store *directly* (no server) must set
:data:`LOCAL_WEBHOOK_ENV` itself.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import stop_process_group

log = logging.getLogger(__name__)

#: Environment that lets an MLflow server (and client) accept webhooks to http://127.0.0.1.
LOCAL_WEBHOOK_ENV = {
    "MLFLOW_WEBHOOK_ALLOWED_SCHEMES": "http,https",
    "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS": "true",
}
#: Server-only: no caching of the webhook list (default 60 s), so a webhook created by a test is
#: used by the very next event.
_SERVER_WEBHOOK_ENV = {"MLFLOW_WEBHOOK_CACHE_TTL": "0"}

#: Seconds to wait for ``/health`` before giving up (a cold start creates the SQLite schema).
DEFAULT_START_TIMEOUT = 120.0


@dataclass(frozen=True)
class MlflowServer:
    """A running test server.

    Attributes:
        uri: ``http://127.0.0.1:<port>``: the tracking and registry URI.
        port: the TCP port it listens on.
        root: the folder holding its SQLite database, artifacts and log file.
        log_path: the server's combined stdout/stderr.
        pid: process id of the ``mlflow server`` process (leader of its process group).
    """

    uri: str
    port: int
    root: Path
    log_path: Path
    pid: int


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _healthy(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def run_mlflow_server(root: str | os.PathLike | None = None, *, port: int | None = None,
                      start_timeout: float = DEFAULT_START_TIMEOUT, allow_local_webhooks: bool = True,
                      extra_env: dict[str, str] | None = None) -> Iterator[MlflowServer]:
    """Start ``mlflow server`` on 127.0.0.1, wait until ``/health`` answers, yield, then stop it.

    Args:
        root: folder for the SQLite database (``mlflow.db``), proxied artifacts (``artifacts/``) and
            the server log (``server.log``); a fresh temporary folder (removed at exit) if None.
        port: TCP port; a free one if None.
        start_timeout: seconds to wait for ``/health``.
        allow_local_webhooks: let the server deliver webhooks to http://127.0.0.1 (see module doc).
        extra_env: more environment variables for the server process.

    Yields:
        An :class:`MlflowServer`.

    Raises:
        RuntimeError: the server exited or did not become healthy within ``start_timeout``
            seconds (the message ends with the tail of its log).
    """
    with contextlib.ExitStack() as stack:
        if root is None:
            root = stack.enter_context(tempfile.TemporaryDirectory(prefix="mlflow-server-"))
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        (root / "artifacts").mkdir(exist_ok=True)
        port = port or free_port()
        uri = f"http://127.0.0.1:{port}"
        env = dict(os.environ)
        env.update({
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "DO_NOT_TRACK": "true",
            # Fernet key (32 url-safe base64 bytes) so webhook secrets stay decryptable.
            "MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY": base64.urlsafe_b64encode(os.urandom(32)).decode(),
        })
        if allow_local_webhooks:
            env.update(LOCAL_WEBHOOK_ENV)
            env.update(_SERVER_WEBHOOK_ENV)
        env.update(extra_env or {})
        cmd = [
            sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
            "--default-artifact-root", "mlflow-artifacts:/",
            "--serve-artifacts",
            "--artifacts-destination", str(root / "artifacts"),
            "--host", "127.0.0.1",
            "--port", str(port),
            "--workers", "1",
        ]
        log_path = root / "server.log"
        log_file = stack.enter_context(open(log_path, "wb"))
        log.info("starting mlflow server: %s", " ".join(cmd))
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=root,
                                start_new_session=True)
        stack.callback(stop_process_group, proc)
        deadline = time.monotonic() + start_timeout
        while not _healthy(uri):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-4000:]
                why = f"exited with status {proc.returncode}" if proc.poll() is not None \
                    else f"not healthy after {start_timeout:.0f} s"
                raise RuntimeError(f"mlflow server {why}; log tail:\n{tail}")
            time.sleep(0.25)
        log.info("mlflow server ready at %s (pid %d)", uri, proc.pid)
        yield MlflowServer(uri=uri, port=port, root=root, log_path=log_path, pid=proc.pid)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory) -> Iterator[MlflowServer]:
    """One real MLflow tracking server per test module (see :func:`run_mlflow_server`)."""
    with run_mlflow_server(tmp_path_factory.mktemp("mlflow-server")) as server:
        yield server
