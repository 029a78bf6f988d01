"""The class of T3-02: every parser of outside bytes turns a malformed document (a JSON bomb, the
wrong type at any level, bad offsets, not UTF-8) into one project error: exit 2 and one line on the
CLI, a 400 from the HTTP receivers, a counted rejection in the daemon that is listed in ``status``,
never retried while unchanged, and never blocks the good expert next to it."""
from __future__ import annotations

import json
import logging
import struct
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as hst

from mergestream.io import st

from .conftest import perturb, random_model, run_cli, save_tensors

DEEP = '{"x":' + "[" * 1000 + "]" * 1000 + "}"
BOMB = "[" * 100_000 + "]" * 100_000


def st_file(path: Path, header: str | bytes | dict, data: bytes = b"") -> Path:
    raw = header if isinstance(header, bytes) else (header if isinstance(header, str) else json.dumps(header)).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


T = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
#: malformed safetensors headers: (name, header, data bytes)
HEADERS = [
    ("deep", DEEP, b""),
    ("bomb", BOMB, b""),
    ("list", "[1, 2, 3]", b""),
    ("string", '"weights"', b""),
    ("not-json", "{'w': 1}", b""),
    ("not-utf8", b'{"w": "\xff\xfe"}', b""),
    ("entry-list", {"w": [1, 2]}, b"\0" * 8),
    ("dtype-list", {"w": {**T, "dtype": ["F32"]}}, b"\0" * 8),
    ("dtype-deep", {"w": {**T, "dtype": json.loads("[" * 60 + "]" * 60)}}, b"\0" * 8),
    ("shape-float", {"w": {**T, "shape": [2.0]}}, b"\0" * 8),
    ("shape-negative", {"w": {**T, "shape": [-2]}}, b"\0" * 8),
    ("shape-bool", {"w": {**T, "shape": [True, True]}}, b"\0" * 8),
    ("offsets-strings", {"w": {**T, "data_offsets": ["0", "8"]}}, b"\0" * 8),
    ("offsets-three", {"w": {**T, "data_offsets": [0, 4, 8]}}, b"\0" * 8),
    ("offsets-negative", {"w": {**T, "data_offsets": [-8, 0]}}, b"\0" * 8),
    ("offsets-overlap", {"a": T, "b": T}, b"\0" * 16),
    ("offsets-gap", {"a": T, "b": {**T, "data_offsets": [16, 24]}}, b"\0" * 24),
    ("offsets-past-end", {"w": {**T, "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
    ("metadata-list", {"__metadata__": {"k": [1]}, "w": T}, b"\0" * 8),
    ("huge-int", '{"w": {"dtype": "F32", "shape": [' + "9" * 5000 + '], "data_offsets": [0, 8]}}', b"\0" * 8),
]


def _one_line_exit_2(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


# -- the parsers, in process ---------------------------------------------------------------------------
@pytest.mark.parametrize("name,header,data", HEADERS, ids=[h[0] for h in HEADERS])
def test_every_malformed_safetensors_header_is_a_format_error(tmp_path, name, header, data):
    path = st_file(tmp_path / f"{name}.safetensors", header, data)
    with pytest.raises(st.FormatError):
        st.read_header(path)
    from mergestream.daemon.sources.readiness import expert_complete, never_an_expert

    assert expert_complete(path) is False
    never_an_expert(path)  # never raises


@settings(max_examples=200, deadline=None)
@given(hst.binary(max_size=512) | hst.recursive(hst.none() | hst.integers() | hst.text(max_size=4),
                                                lambda c: hst.lists(c, max_size=3) | hst.dictionaries(hst.text(max_size=3), c, max_size=3),
                                                max_leaves=20).map(lambda v: json.dumps(v).encode()))
def test_any_bytes_end_in_a_value_or_a_format_error(data):
    """Property: load_json, parse_header_text and parse_index end in a value or FormatError."""
    for fn in (lambda: st.load_json(data, "x", expect=None), lambda: st.parse_index(data, "x"),
               lambda: st.parse_header_text(data.decode("utf-8", "replace"), Path("x"), "x")):
        try:
            fn()
        except st.FormatError:
            pass


def test_load_json_bounds_nesting_and_types():
    with pytest.raises(st.FormatError, match="nested 1001 levels"):
        st.load_json(DEEP, "h")
    with pytest.raises(st.FormatError, match="expected a JSON object, got array"):
        st.load_json("[]", "h")
    with pytest.raises(st.FormatError, match="not UTF-8"):
        st.load_json(b"\xff{}", "h")
    assert st.load_json('{"a": "[[[[[[", "b": [[1]]}', "h") == {"a": "[[[[[[", "b": [[1]]}
    assert st.json_depth("[" * 64 + "]" * 64) == 64 and st.load_json("[" * 64 + "]" * 64, "h", expect=list)


BAD_JSON = [DEEP, "[1]", "\"x\"", "{", "null"]


@pytest.mark.parametrize("doc", BAD_JSON, ids=["deep", "list", "string", "truncated", "null"])
def test_every_reader_of_outside_json_raises_its_own_error(tmp_path, doc):
    """Shard index, s3 reference, adapter config, config.json, state manifest, fold.json, the
    agent's slot files, feed keys, patch metadata, probe and RI data files."""
    from mergestream import patches
    from mergestream.agent.slots import read_json
    from mergestream.daemon.probes.base import (
        TASK_PROBE_DATA,
        TASK_PROBE_DIR,
        TASK_PROBE_HEAD,
        TASK_PROBE_META,
        discover_task_probe,
    )
    from mergestream.engine.passes import untie_config
    from mergestream.errors import CorruptCheckpointError, ProbeError, StateError
    from mergestream.feed.keys import FeedKeyError, public_key
    from mergestream.io.s3_checkpoint import S3Ref
    from mergestream.io.state import StateDir
    from mergestream.io.versions import Versions
    from mergestream.datasteps.ri import RIError, read_aux
    from mergestream.datasteps.text import read_labelled_jsonl

    f = tmp_path / "doc.json"
    f.write_text(doc)
    with pytest.raises(st.FormatError):
        st.parse_index(f.read_bytes(), "index")
    with pytest.raises(CorruptCheckpointError):
        S3Ref.read(f)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(doc)
    with pytest.raises(CorruptCheckpointError):
        untie_config(tmp_path / "m")
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "manifest.json").write_text(doc)
    with pytest.raises(StateError):
        StateDir(tmp_path / "s")
    (tmp_path / "state" / "versions" / "000001").mkdir(parents=True)
    (tmp_path / "state" / "versions" / "000001" / "fold.json").write_text(doc)
    with pytest.raises(ValueError):
        Versions(tmp_path / "state").fold_json(1)
    assert read_json(f) is None
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "root.pub.json").write_text(doc)
    with pytest.raises(FeedKeyError):
        public_key(tmp_path / "keys", "root")
    if doc in (DEEP, "{"):  # patch metadata values may be any JSON value
        with pytest.raises(patches.PatchError):
            patches._meta_json({"k": doc}, "k", "patch")
    tp = tmp_path / "expert" / TASK_PROBE_DIR
    tp.mkdir(parents=True)
    for name in (TASK_PROBE_HEAD, TASK_PROBE_DATA):
        (tp / name).write_bytes(b"x")
    (tp / TASK_PROBE_META).write_text(doc)
    with pytest.raises(ProbeError):
        discover_task_probe(tmp_path / "expert")
    line = tmp_path / "data.jsonl"
    line.write_text(doc.replace("\n", " ") + "\n")
    with pytest.raises(ProbeError):
        read_labelled_jsonl(line)
    with pytest.raises(RIError):
        read_aux(line)


# -- the CLI: exit 2, one line -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    base = random_model(0, m=8, n=8)
    save_tensors(root / "base.safetensors", base)
    save_tensors(root / "good.safetensors", perturb(base, 0.01, 1))
    return root


CLI_HEADERS = [h for h in HEADERS if h[0] in ("deep", "list", "dtype-list", "offsets-overlap", "offsets-past-end",
                                              "not-utf8", "huge-int")]


@pytest.mark.parametrize("name,header,data", CLI_HEADERS, ids=[h[0] for h in CLI_HEADERS])
def test_cli_refuses_malformed_headers_in_one_line(tmp_path, models, name, header, data):
    path = st_file(tmp_path / f"{name}.safetensors", header, data)
    _one_line_exit_2(run_cli("inspect", str(path), check=False))
    if name in ("deep", "list"):
        _one_line_exit_2(run_cli("fold", "--base", str(models / "base.safetensors"), "--expert", str(path),
                                 "--policy", "task_arithmetic", "--state", str(tmp_path / "st"),
                                 "--out", str(tmp_path / "out"), check=False))
        assert not (tmp_path / "out").exists()


def _hf_folder(root: Path, models: Path, extra: dict[str, str]) -> Path:
    root.mkdir()
    (root / "model-00001-of-00001.safetensors").write_bytes((models / "good.safetensors").read_bytes())
    for name, text in extra.items():
        (root / name).write_text(text)
    return root


FOLDERS = {
    "index-deep": {"model.safetensors.index.json": DEEP},
    "index-list": {"model.safetensors.index.json": "[]"},
    "index-map-list": {"model.safetensors.index.json": '{"weight_map": ["a"]}'},
    "index-shard-int": {"model.safetensors.index.json": '{"weight_map": {"w": 3}}'},
    "adapter-deep": {"adapter_config.json": DEEP, "adapter_model.safetensors": ""},
    "adapter-alpha-string": {"adapter_config.json": '{"peft_type": "LORA", "lora_alpha": "big", "r": 2}'},
}


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_cli_refuses_malformed_indexes_and_adapter_configs(tmp_path, models, name):
    folder = _hf_folder(tmp_path / name, models, FOLDERS[name])
    if name.startswith("adapter"):
        (folder / "adapter_model.safetensors").write_bytes((models / "good.safetensors").read_bytes())
    _one_line_exit_2(run_cli("fold", "--base", str(models / "base.safetensors"), "--expert", str(folder),
                             "--policy", "task_arithmetic", "--state", str(tmp_path / "st"),
                             "--out", str(tmp_path / "out"), check=False))
    if name != "adapter-alpha-string":  # inspect reads no LoRA field
        _one_line_exit_2(run_cli("inspect", str(folder), check=False))


# -- the HTTP receivers: 400, and they keep serving ----------------------------------------------------
def _post(port: int, body: bytes, headers: dict[str, str]) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


BODIES = [DEEP.encode(), BOMB.encode(), b"[1]", b"\xff\xfe", b'{"entity": ["model_version"], "action": "created"}']


def test_webhook_answers_400_to_malformed_payloads_and_keeps_serving():
    from mergestream.daemon.sources import WebhookReceiver, sign_webhook

    calls = []
    rx = WebhookReceiver("127.0.0.1", 0, "s3cret", lambda: calls.append(1))
    rx.start()
    try:
        def signed(body: bytes) -> dict[str, str]:
            ts, did = str(int(time.time())), "d1"
            text = body.decode("utf-8", "replace")
            return {"X-MLflow-Signature": sign_webhook("s3cret", did, ts, text), "X-MLflow-Timestamp": ts,
                    "X-MLflow-Delivery-Id": did, "Content-Type": "application/json"}
        for body in BODIES:
            code = _post(rx.port, body, signed(body))
            assert code in (400, 401), (body[:40], code)  # not UTF-8 cannot carry a valid signature: 401
            assert code == 400 or body == b"\xff\xfe"
        good = json.dumps({"entity": "model_version", "action": "created", "data": {}}).encode()
        assert _post(rx.port, good, signed(good)) == 200 and calls == [1]
    finally:
        rx.stop()


def test_bucket_notifications_answer_400_to_malformed_payloads_and_keep_serving():
    from mergestream.daemon.sources.s3_notify import NotificationReceiver

    calls = []
    rx = NotificationReceiver("127.0.0.1", 0, "tok", lambda: calls.append(1))
    rx.start()
    try:
        auth = {"Authorization": "Bearer tok"}
        for body in BODIES[:2] + [b"\xff\xfe", b"{"]:
            assert _post(rx.port, body, auth) == 400, body[:40]
        assert _post(rx.port, b'{"Records": [{"eventName": "s3:ObjectCreated:Put"}]}', auth) == 200
        assert calls == [1]
    finally:
        rx.stop()


# -- the daemon: rejected, listed, counted, not retried; the good neighbour folds ---------------------------
def test_daemon_rejects_malformed_inbox_files_once_and_folds_the_good_one(tmp_path, models, caplog):
    from mergestream.config import load_config
    from mergestream.daemon.service import Service
    from mergestream.daemon.sources.base import source_notes

    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "base": str(models / "base.safetensors"), "policy": {"name": "task_arithmetic"},
        "inbox": str(tmp_path / "inbox"), "state_dir": str(tmp_path / "state"),
        "watch": {"settle_seconds": 0.3}, "metrics": {"enabled": False}, "mlflow": {"enabled": False}}))
    svc = Service(load_config(cfg_path), serve_metrics=False, watch_sources=True)
    caplog.set_level(logging.INFO, logger="mergestream")
    svc.start()
    try:
        inbox = tmp_path / "inbox"
        st_file(inbox / "deep.safetensors", DEEP)
        st_file(inbox / "listhdr.safetensors", "[1, 2]")
        st_file(inbox / "overlap.safetensors", {"a": T, "b": T}, b"\0" * 16)
        (inbox / "good.safetensors").write_bytes((models / "good.safetensors").read_bytes())
        deadline = time.time() + 30
        while time.time() < deadline:
            svc.step()
            status = {r.expert_id: r.status for r in svc.ledger.experts()}
            if len(status) == 4 and "pending" not in status.values() and "folding" not in status.values():
                break
            time.sleep(0.1)
        assert status == {"deep": "rejected", "listhdr": "rejected", "overlap": "rejected", "good": "accepted"}
        assert svc.metrics.registry.get_sample_value("mergestream_experts_rejected_total",
                                                     {"stage": "validation"}) == 3
        notes = {n["subject"]: n for n in source_notes(svc.ledger)}
        for name in ("deep", "listhdr", "overlap"):
            assert notes[f"inbox:{name}.safetensors"]["level"] == "error"
            assert "rejected" in notes[f"inbox:{name}.safetensors"]["message"]
        time.sleep(2.0)  # unchanged: not looked at again
        text = caplog.text
        for name in ("deep", "listhdr", "overlap"):
            rejected = [r for r in caplog.records if "inbox entry rejected" in r.getMessage()
                        and f"{name}.safetensors" in r.getMessage()]
            assert len(rejected) == 1, text[-3000:]
        assert "Traceback" not in text and "RecursionError" not in text
        out = run_cli("status", "--config", str(cfg_path))
        assert "deep.safetensors: rejected" in out.stdout and "good" in out.stdout
    finally:
        svc.shutdown()
