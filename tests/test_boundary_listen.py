"""Every HTTP endpoint of the daemon listens on IPv4 and IPv6 hosts alike, and a refusal names the
real cause and the config key to change (issue #36, N9): the metrics/health server
(``metrics.host``/``port``), the MLflow webhook (``mlflow.webhook``) and the bucket notification
receiver (``s3.notify``). Real sockets, real HTTP (urllib, no proxy), a real ``mergestream run``."""

from __future__ import annotations

import os
import socket
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from mergestream.daemon.http import ListenError
from mergestream.daemon.metrics import Metrics, MetricsServer
from mergestream.daemon.sources.s3_notify import NotificationReceiver
from mergestream.daemon.sources.webhook import WebhookReceiver

from .conftest import run_cli, save_tensors
from .s3_server import free_port
from .test_daemon import tiny_base

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _can_bind(family: socket.AddressFamily, host: str) -> bool:
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
        return True
    except OSError:
        return False


HAS_IPV6 = socket.has_ipv6 and _can_bind(socket.AF_INET6, "::1")
needs_ipv6 = pytest.mark.skipif(not HAS_IPV6, reason="this machine has no IPv6 loopback (::1)")


def _dual_stack() -> bool:
    """Whether an IPv6 socket on ``::`` takes IPv4 clients here (IPV6_V6ONLY can be cleared)."""
    if not HAS_IPV6:
        return False
    with socket.socket(socket.AF_INET6) as s:
        try:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.bind(("::", 0))
        except OSError:
            return False
        return True


def get(url: str) -> tuple[int, str]:
    try:
        with OPENER.open(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def post(url: str, body: bytes = b"{}") -> int:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with OPENER.open(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


# ------------------------------------------------------------------------------------------
# Serving on each kind of host
# ------------------------------------------------------------------------------------------
HOSTS = [
    pytest.param("127.0.0.1", ["127.0.0.1"], id="127.0.0.1"),
    pytest.param("::1", ["[::1]"], id="::1", marks=needs_ipv6),
    pytest.param("[::1]", ["[::1]"], id="[::1]", marks=needs_ipv6),
    pytest.param("::", ["[::1]"], id="::", marks=needs_ipv6),
]


@pytest.mark.parametrize("host,clients", HOSTS)
def test_metrics_server_serves_on_the_host(host, clients):
    m = Metrics()
    m.beat()
    m.ready = True
    server = MetricsServer(m, host, 0)
    server.start()
    try:
        assert server.port > 0
        for client in clients:
            code, body = get(f"http://{client}:{server.port}/metrics")
            assert code == 200 and "mergestream_" in body
            assert get(f"http://{client}:{server.port}/readyz")[0] == 200
        assert server.url.endswith(f":{server.port}") and ("[" in server.url) == (":" in host)
    finally:
        server.stop()


@pytest.mark.skipif(not _dual_stack(), reason="no dual-stack IPv6 sockets on this machine")
def test_metrics_server_on_all_ipv6_also_answers_ipv4_clients():
    server = MetricsServer(Metrics(), "::", 0)
    server.start()
    try:
        assert get(f"http://127.0.0.1:{server.port}/metrics")[0] == 200
    finally:
        server.stop()


RECEIVERS: dict[str, Callable[[str, int], object]] = {
    "webhook": lambda host, port: WebhookReceiver(host, port, "s3cr3t", lambda: None),
    "s3-notify": lambda host, port: NotificationReceiver(host, port, "t0k3n", lambda: None),
}


@pytest.mark.parametrize("kind", sorted(RECEIVERS))
@pytest.mark.parametrize("host,clients", HOSTS)
def test_receivers_serve_on_the_host(kind, host, clients):
    rec = RECEIVERS[kind](host, 0)
    rec.start()
    try:
        for client in clients:  # unsigned: refused, but by the receiver itself, over HTTP
            assert post(f"http://{client}:{rec.port}/") in (401, 403)
    finally:
        rec.stop()


# ------------------------------------------------------------------------------------------
# Refusals name the real cause
# ------------------------------------------------------------------------------------------
@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_listen_error_in_process_names_host_port_and_reason(taken_port):
    with pytest.raises(ListenError) as info:
        MetricsServer(Metrics(), "127.0.0.1", taken_port)
    assert str(info.value) == f"cannot listen on 127.0.0.1:{taken_port}: Address already in use"
    with pytest.raises(ListenError, match=r"cannot listen on no-such-host\.invalid:0: "):
        MetricsServer(Metrics(), "no-such-host.invalid", 0)


def daemon_config(root: Path, extra: dict) -> Path:
    save_tensors(root / "base.safetensors", tiny_base())
    cfg = {"base": "base.safetensors", "inbox": "inbox", "state_dir": "state", "mlflow": {"enabled": False},
           "metrics": {"host": "127.0.0.1", "port": 0}, "log_format": "json"}
    for k, v in extra.items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    (root / "inbox").mkdir(exist_ok=True)
    p = root / "config.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def run_refused(config: Path) -> str:
    """``mergestream run`` exits 2 with one ``error:`` line (the last of stderr), no traceback."""
    proc = run_cli("run", "--config", config, check=False, timeout=60,
                   env={**os.environ, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ConfigError: "), last
    return last


def _dead() -> str:
    return f"http://127.0.0.1:{free_port()}"


SECTIONS = {  # config section -> (the extra config that puts the endpoint on (host, port))
    "metrics": lambda host, port: {"metrics": {"host": host, "port": port}},
    "mlflow.webhook": lambda host, port: {"mlflow": {
        "enabled": False, "registry": {"enabled": True, "models": ["m"], "tracking_uri": _dead()},
        "webhook": {"enabled": True, "host": host, "port": port, "secret": "s3cr3t"}}},
    "s3.notify": lambda host, port: {"s3": {
        "enabled": True, "bucket": "b", "endpoint_url": _dead(),
        "notify": {"enabled": True, "host": host, "port": port, "token": "t0k3n"}}},
}


@pytest.mark.slow
@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_a_taken_port_names_the_port_and_its_config_key(tmp_path, taken_port, section):
    last = run_refused(daemon_config(tmp_path, SECTIONS[section]("127.0.0.1", taken_port)))
    assert f"{section}: cannot listen on 127.0.0.1:{taken_port}: Address already in use" in last
    env = "MERGESTREAM_" + section.upper().replace(".", "__")
    assert f"set {section}.port (or {env}__PORT)" in last and f"{section}.host" not in last


@pytest.mark.slow
@pytest.mark.parametrize("section", sorted(SECTIONS))
@pytest.mark.parametrize("host", ["no-such-host.invalid", "192.0.2.1"])  # unresolvable; not of this machine
def test_an_unusable_host_names_the_host_and_its_config_key(tmp_path, section, host):
    last = run_refused(daemon_config(tmp_path, SECTIONS[section](host, 0)))
    assert f"{section}: cannot listen on {host}:0: " in last
    assert f"set {section}.host" in last and f"{section}.port" not in last


@pytest.mark.slow
@needs_ipv6
def test_the_daemon_serves_metrics_on_ipv6(tmp_path):
    from .test_daemon import Daemon

    d = Daemon(tmp_path)
    port = d.port
    d.config.write_text(d.config.read_text().replace("host: 127.0.0.1", "host: '::1'"))
    d.start(wait_ready=False)
    try:
        d.wait(lambda: _ok(f"http://[::1]:{port}/readyz"), 60, "daemon never served [::1]")
        assert "mergestream_" in get(f"http://[::1]:{port}/metrics")[1]
    finally:
        d.stop()


def _ok(url: str) -> bool:
    try:
        return get(url)[0] == 200
    except OSError:
        return False
