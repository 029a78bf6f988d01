"""No credential of a URI reaches anything mergestream writes for people to read (T3-05): log lines,
exception texts, ``status`` / ``history``, metric labels, MLflow params and tags, ``fold.json``, the
ledger. One function redacts (:func:`mergestream.redaction.redact_uris`); the logging setup adds a
filter as a safety net, and :class:`~mergestream.errors.MergestreamError` redacts its own text.

End to end: a real daemon whose tracking server (userinfo), S3 endpoint (userinfo) and mirror
endpoint (a signature parameter) are unreachable, with a webhook secret and a notification token;
and (slow) one whose tracking URI carries userinfo to a real MLflow server (its runs' params and
tags are read back). The secret string must appear nowhere."""

from __future__ import annotations

import json
import logging
import pickle
import socket
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from mergestream.config import ConfigError, load_config
from mergestream.daemon.ledger import Ledger
from mergestream.daemon.s3client import ObjectError, classify, make_client, parse_s3_uri
from mergestream.daemon.sources.base import SourceContext, source_notes
from mergestream.errors import CheckpointError, MergestreamError
from mergestream.logs import setup_logging
from mergestream.redaction import MASK, is_credential_name, redact_uris

from .conftest import run_cli
from .mlflow_server import mlflow_server  # noqa: F401  (fixture)
from .s3_server import TEST_CREDENTIALS
from .test_daemon import Daemon, scaled_expert, tiny_base

TOKEN = "tok-9f8e7d6c5b4a"


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the one function -------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    (f"http://alice:{TOKEN}@127.0.0.1:5000/api", "http://***@127.0.0.1:5000/api"),
    (f"https://{TOKEN}@github.com/o/r.git", "https://***@github.com/o/r.git"),
    (f"postgresql://user:p@ss{TOKEN}@db:5432/mlflow?sslmode=require",
     "postgresql://***@db:5432/mlflow?sslmode=require"),
    (f"mysql+pymysql://u:{TOKEN}@[::1]:3306/x", "mysql+pymysql://***@[::1]:3306/x"),
    (f"s3://AKIA:{TOKEN}@bucket/prefix/", "s3://***@bucket/prefix/"),
    (f"https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={TOKEN}"
     f"&X-Amz-Signature={TOKEN}&X-Amz-Security-Token={TOKEN}&X-Amz-Expires=60",
     "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***"
     "&X-Amz-Signature=***&X-Amz-Security-Token=***&X-Amz-Expires=60"),
    (f"https://acct.blob.core.windows.net/c/b?sv=2022-11-02&sig={TOKEN}&se=2030",
     "https://acct.blob.core.windows.net/c/b?sv=2022-11-02&sig=***&se=2030"),
    (f"http://h/feed?token={TOKEN}&access_key={TOKEN}&api-key={TOKEN}&key={TOKEN}&password={TOKEN}",
     "http://h/feed?token=***&access_key=***&api-key=***&key=***&password=***"),
    (f"API request to http://alice:{TOKEN}@127.0.0.1:1/api/2.0 failed; retry http://bob:{TOKEN}@h/",
     "API request to http://***@127.0.0.1:1/api/2.0 failed; retry http://***@h/"),
    (f"Could not connect to the endpoint URL: \"http://bob:{TOKEN}@127.0.0.1:9/x?list-type=2\"",
     "Could not connect to the endpoint URL: \"http://***@127.0.0.1:9/x?list-type=2\""),
])
def test_redact_uris_hides_userinfo_and_credential_parameters(text, expected):
    assert redact_uris(text) == expected
    assert redact_uris(expected) == expected  # idempotent


@pytest.mark.parametrize("text", [
    "http://127.0.0.1:5000/api/2.0/mlflow/runs/get?run_id=abc&experiment_id=1",
    "s3://bucket/experts/a.safetensors", "sqlite:////var/lib/mergestream/mlflow.db",
    "expert ready source=s3 id=a key=experts/a uri=/state/cache/a.safetensors",
    "mail alice@example.com about version 3", "policy ties params {'k': 20, 'lambda': 1.0}",
    "s3://bucket/prefix/?region=eu-west-1&versionId=3",
])
def test_redact_uris_keeps_what_is_no_credential(text):
    assert redact_uris(text) == text


_USERINFO_CHARS = string.ascii_letters + string.digits + "-._~!$&'()*+,;=:%@"
_VALUE_CHARS = string.ascii_letters + string.digits + "-._~+/=%:"


@settings(max_examples=200, deadline=None)
@given(user=st.text(_USERINFO_CHARS.replace(":", "").replace("@", ""), max_size=12),
       secret=st.text(_USERINFO_CHARS, min_size=1, max_size=40),
       scheme=st.sampled_from(["http", "https", "postgresql", "mysql+pymysql", "s3", "databricks"]),
       before=st.sampled_from(["", "error: ", "uri='", "(", "url: \""]))
def test_no_userinfo_survives(user, secret, scheme, before):
    secret = f"S3CR3T{secret}"
    out = redact_uris(f"{before}{scheme}://{user}:{secret}@example.com:8080/api?x=1 tail")
    assert secret not in out and f"{scheme}://{MASK}@example.com:8080/api?x=1 tail" in out


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(["token", "X-Amz-Signature", "X-Amz-Credential", "X-Amz-Security-Token", "sig",
                             "access_key", "AWSAccessKeyId", "api_key", "apikey", "client_secret", "password",
                             "X-Goog-Signature", "auth", "session_token", "key", "secret"]),
       value=st.text(_VALUE_CHARS, min_size=1, max_size=40), first=st.booleans())
def test_no_credential_parameter_survives(name, value, first):
    value = f"S3CR3T{value}"
    query = f"{name}={value}&region=eu" if first else f"region=eu&{name}={value}"
    out = redact_uris(f"GET https://host.example/p/a.bin?{query}#frag done")
    assert value not in out and "region=eu" in out and out.startswith("GET https://host.example/p/a.bin?")
    assert is_credential_name(name)


# -- exception texts ----------------------------------------------------------------------------------
def test_every_mergestream_error_and_object_error_redacts_its_text():
    uri = f"http://alice:{TOKEN}@127.0.0.1:1/x?sig={TOKEN}"
    for exc in (MergestreamError(f"cannot reach {uri}"), ConfigError(f"bad: {uri}"),
                CheckpointError(f"open {uri}"), ObjectError("other", f"boto: {uri}")):
        assert TOKEN not in str(exc) and "127.0.0.1:1" in str(exc), exc
        assert TOKEN not in str(pickle.loads(pickle.dumps(exc)))  # across processes (Ray) too
    with pytest.raises(ValueError) as info:
        parse_s3_uri(f"https://u:{TOKEN}@host/b")
    assert TOKEN not in str(info.value)


def test_a_real_botocore_error_from_an_endpoint_with_userinfo_is_redacted(monkeypatch):
    for k, v in TEST_CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    client = make_client(f"http://bob:{TOKEN}@127.0.0.1:{closed_port()}", max_attempts=1, connect_timeout=2)
    with pytest.raises(Exception) as info:
        client.list_objects_v2(Bucket="experts")
    assert TOKEN in str(info.value)  # botocore's own text names the endpoint, userinfo and all
    err = classify(info.value)
    assert err.kind == "unreachable" and TOKEN not in str(err) and "***@127.0.0.1" in str(err)


# -- the logging safety net ---------------------------------------------------------------------------
@pytest.fixture
def root_logging():
    root = logging.getLogger()
    handlers, level, factory = root.handlers[:], root.level, logging.getLogRecordFactory()
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.setLogRecordFactory(factory)


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_setup_logging_redacts_every_record(fmt, root_logging, capfd):
    uri = f"http://alice:{TOKEN}@127.0.0.1:1/api?token={TOKEN}"
    import mlflow  # noqa: F401  (as in the daemon: mlflow gives its logger a handler of its own, not propagating)

    setup_logging(fmt)
    logging.getLogger("mergestream.daemon.tracking").warning("tracking failed: %s", RuntimeError(uri))
    logging.getLogger("mlflow.utils.rest_utils").warning(f"API request to {uri} failed")  # a library's own line
    logging.getLogger("botocore").info("endpoint %(e)s", {"e": uri})
    try:
        raise ConnectionError(f"Max retries exceeded with url {uri}")
    except ConnectionError:
        logging.getLogger("mergestream").exception("poll failed")
    logging.getLogger("x").warning("bad format %s %s", uri)  # a broken call still prints no secret
    err = capfd.readouterr().err
    assert err.count("***@127.0.0.1:1") >= 4, err
    assert TOKEN not in err, err
    if fmt == "json":
        lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
        assert any("ConnectionError" in d.get("exc", "") for d in lines)


def test_source_notes_shown_by_status_are_redacted(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    SourceContext(cursors=ledger).note("mlflow", "model:experts",
                                       f"registry at http://alice:{TOKEN}@127.0.0.1:1 unreachable")
    (note,) = source_notes(ledger)
    assert note["message"] == "registry at http://***@127.0.0.1:1 unreachable"


# -- config errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("body", [
    f'publish: {{uri: "s3://AKIA:{TOKEN}@bucket/p/"}}\n',
    f'publish: {{uri: "https://bucket.example/p/?X-Amz-Signature={TOKEN}"}}\n',
    f'mlflow: {{tracking_uri: "http://alice:{TOKEN}@127.0.0.1:5000\n',  # YAML syntax: a quote left open
    f'mlflow: {{tracking_uri: {{nested: "http://alice:{TOKEN}@h"}}}}\n',  # not a string
    f'mlflow:\n  tracking_uri: "http://alice:{TOKEN}@h"\n  tracking_uri: "http://alice:{TOKEN}@h2"\n',
])
def test_a_config_error_names_no_secret(tmp_path, body):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("base: base.safetensors\n" + body)
    with pytest.raises(ConfigError) as info:
        load_config(cfg)
    assert TOKEN not in str(info.value), info.value
    assert "mlflow" in str(info.value) or "publish" in str(info.value) or "line 2" in str(info.value)


def test_the_cli_prints_no_secret_of_a_refused_config_or_environment(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f'base: base.safetensors\npublish: {{uri: "s3://AKIA:{TOKEN}@bucket/p/"}}\n')
    bad = run_cli("status", "--config", cfg, check=False)
    assert bad.returncode == 2 and "publish.uri" in bad.stderr and TOKEN not in bad.stdout + bad.stderr, bad.stderr
    cfg.write_text("base: base.safetensors\n")
    import os

    env = {**os.environ, "MERGESTREAM_PUBLISH__URI": f"gs://u:{TOKEN}@bucket/?sig={TOKEN}"}
    bad = run_cli("status", "--config", cfg, check=False, env=env)
    assert bad.returncode == 2 and "publish.uri" in bad.stderr and TOKEN not in bad.stdout + bad.stderr, bad.stderr


# -- the daemon end to end ------------------------------------------------------------------------------
def _everything(d: Daemon) -> dict[str, str]:
    """All a person or a scraper reads of a daemon: its log, `status` (JSON and text), `history`,
    /metrics, and every file under its state folder (fold.json, the ledger, MLflow's store)."""
    out = {"log": d.log.read_text(), "metrics": d.http("/metrics")[1]}
    for args in (("status", "--json"), ("status",), ("history", "--json")):
        p = run_cli(*args, "--config", d.config, check=False)
        out[" ".join(args)] = p.stdout + p.stderr
    for f in (d.root / "state").rglob("*"):
        if f.is_file():
            out[str(f.relative_to(d.root))] = f.read_bytes().decode("latin-1")
    return out


def _assert_nowhere(d: Daemon) -> dict[str, str]:
    seen = _everything(d)
    leaks = {k: v[max(0, v.index(TOKEN) - 120): v.index(TOKEN) + 20] for k, v in seen.items() if TOKEN in v}
    assert not leaks, leaks
    return seen


def test_a_daemon_with_secret_uris_everywhere_writes_none_of_them(tmp_path):
    """Tracking (userinfo) and the registry down, the S3 endpoint (userinfo) down, the mirror's
    endpoint with a signature parameter: every failure is logged, noted and retried, one expert
    is folded and published, and the secret is nowhere."""
    mlflow_port, s3_port = closed_port(), closed_port()
    d = Daemon(tmp_path, extra={
        "mlflow": {"enabled": True, "tracking_uri": f"http://alice:{TOKEN}@127.0.0.1:{mlflow_port}",
                   "retry_seconds": 1,
                   "registry": {"enabled": True, "models": ["experts"], "interval_seconds": 1,
                                "max_retries": 0},
                   "webhook": {"enabled": True, "host": "127.0.0.1", "port": 0}},
        "s3": {"enabled": True, "bucket": "experts", "endpoint_url": f"http://bob:{TOKEN}@127.0.0.1:{s3_port}",
               "interval_seconds": 1, "notify": {"enabled": True, "host": "127.0.0.1", "port": 0}},
        "publish": {"uri": "s3://mirror/versions/", "endpoint_url": f"http://127.0.0.1:{s3_port}/?X-Amz-Signature={TOKEN}"},
    }, env={**TEST_CREDENTIALS, "MERGESTREAM_MLFLOW__WEBHOOK__SECRET": TOKEN,
            "MERGESTREAM_S3__NOTIFY__TOKEN": TOKEN + "-n", "MLFLOW_HTTP_REQUEST_TIMEOUT": "2"})
    d.start()
    try:
        save_file(scaled_expert(tiny_base(), 1), str(tmp_path / "inbox" / "e1.safetensors"))
        d.wait(lambda: d.status()["current_version"] == 1, 90, "the inbox expert was not published")
        d.wait(lambda: "tracking fold failed" in d.log.read_text() and "mirror of version 1" in d.log.read_text()
               and {"mlflow", "s3"} <= set(d.status()["sources"]), 60, "the failures were not all reported")
        seen = _assert_nowhere(d)
        # the failures were reported, naming the hosts (so the checks above saw the URIs' places)
        assert f"***@127.0.0.1:{mlflow_port}" in seen["log"] and f"***@127.0.0.1:{s3_port}" in seen["log"]
        assert "X-Amz-Signature=***" in seen["log"]
        assert f"***@127.0.0.1:{s3_port}" in seen["status --json"]
        assert json.loads(seen["status --json"])["tracking_pending"] >= 1
        assert "mergestream_source_errors_total" in seen["metrics"]
        assert (tmp_path / "state" / "versions" / "000001" / "fold.json").is_file()
    finally:
        d.stop()


@pytest.mark.slow
def test_runs_logged_through_a_tracking_uri_with_userinfo_carry_no_secret(tmp_path, mlflow_server):  # noqa: F811
    """A real MLflow server reached as http://alice:TOKEN@host: the fold's run, its params, tags and
    fold.json artifact, the registered version, the registry note of a missing model, the log and
    status hold no secret."""
    from mlflow import MlflowClient

    uri = mlflow_server.uri.replace("http://", f"http://alice:{TOKEN}@")
    d = Daemon(tmp_path, extra={"mlflow": {"tracking_uri": uri, "registered_model": "backbone",
                                           "registry": {"enabled": True, "models": ["no-such-model"],
                                                        "interval_seconds": 1}}},
               env={"MLFLOW_DISABLE_TELEMETRY": "true"})
    d.start()
    try:
        save_file(scaled_expert(tiny_base(), 2), str(tmp_path / "inbox" / "e1.safetensors"))
        d.wait(lambda: d.status()["current_version"] == 1 and d.status()["tracking_pending"] == 0, 120,
               "the fold was not published and tracked")
        d.wait(lambda: "mlflow" in d.status()["sources"], 30, "the missing registered model was not noted")
        seen = _assert_nowhere(d)
        assert f"***@127.0.0.1:{mlflow_server.port}" in seen["status --json"]  # the registry named, redacted
        client = MlflowClient(tracking_uri=mlflow_server.uri, registry_uri=mlflow_server.uri)
        (run,) = client.search_runs([client.get_experiment_by_name("mergestream").experiment_id])
        assert run.data.params and run.data.tags.get("mergestream.expert") == "e1"
        texts = [*run.data.params.values(), *run.data.tags.values(), *run.data.params, *run.data.tags]
        (mv,) = client.search_model_versions("name='backbone'")
        texts += [mv.source or "", *mv.tags.values()]
        fold = client.download_artifacts(run.info.run_id, "fold.json", str(tmp_path / "dl"))
        texts.append(open(fold).read())
        assert not [t for t in texts if TOKEN in t]
    finally:
        d.stop()


def test_a_library_logger_with_its_own_handler_prints_no_secret(root_logging, capfd):
    """A library that configures its own handler and stops propagation (MLflow's ``mlflow``
    logger does) is covered too: the record is redacted where it is made, whatever prints it."""
    import sys

    lib = logging.getLogger("some.library")
    own = logging.StreamHandler(sys.stderr)
    own.setFormatter(logging.Formatter("LIB %(message)s"))
    lib.addHandler(own)
    lib.propagate = False
    try:
        setup_logging("text")
        uri = f"https://bob:{TOKEN}@registry.example/api?X-Amz-Signature={TOKEN}"
        lib.warning("calling %s", uri)
        try:
            raise RuntimeError(uri)
        except RuntimeError:
            lib.exception("failed")
        err = capfd.readouterr().err
        assert "LIB calling https://***@registry.example/api?X-Amz-Signature=***" in err, err
        assert TOKEN not in err, err
    finally:
        lib.removeHandler(own)
        lib.propagate = True
