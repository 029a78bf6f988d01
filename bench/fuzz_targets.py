"""The parsers of outside bytes, as fuzz targets: one function per entry point, bytes in.

Shared by the coverage-guided fuzzer (``bench/fuzz.py``, atheris) and the property tests of the
suite (``tests/test_fuzz_properties.py``, hypothesis), so both exercise the same code paths. The
contract each target checks: any input ends in a value or in one of :data:`ALLOWED` (the project's
own exceptions); anything else -- another exception, a 5xx answer, a dropped connection -- is a
crash. Hangs and memory are bounded by the fuzzer (``-timeout``, ``-rss_limit_mb``).

Targets (name: what the bytes are, and the entry point they go through):

* ``st_header``: a whole ``.safetensors`` file -> :func:`mergestream.io.st.read_header`, then
  :func:`~mergestream.io.checkpoints.open_checkpoint` and every tensor read;
* ``shard_index``: ``model.safetensors.index.json`` of a folder holding one real shard ->
  ``open_checkpoint(folder)`` and every tensor read;
* ``adapter_config``: ``adapter_config.json`` of a LoRA folder with real adapter weights ->
  :func:`~mergestream.io.expert_readers.open_expert`, validation against θ₀ and every task vector;
* ``legacy_pickle``: a ``pytorch_model.bin`` -> ``open_checkpoint`` (``torch.load(weights_only=True)``);
* ``config_yaml``: a daemon config -> :func:`mergestream.config.load_config`;
* ``webhook``: a signed MLflow webhook delivery body, POSTed to a live
  :class:`~mergestream.daemon.sources.webhook.WebhookReceiver` (the answer must be < 500);
* ``s3_notify``: a bucket notification body, POSTed to a live
  :class:`~mergestream.daemon.sources.s3_notify.NotificationReceiver` (the answer must be < 500);
* ``feed_custom``: the ``custom.mergestream`` fields the device agent reads from verified TUF
  metadata (``{"latest": {...}, "targets": {path: {...}}, "installed": sha}``) ->
  :func:`mergestream.feed.layout.custom_of` and :func:`mergestream.feed.plan.shortest`, as
  ``mergestream.agent.pull`` does.

:func:`seeds` writes a valid input per target (the fuzzer's starting corpus); :func:`make` builds a
target (its fixtures live in a private folder until :meth:`Target.close`).
"""

from __future__ import annotations

import http.client
import io
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save as save_bytes

from mergestream.errors import MergestreamError
from mergestream.feed.plan import NoPathError
from mergestream.io.st import FormatError

#: what a target may raise: the project's own exceptions
ALLOWED: tuple[type[BaseException], ...] = (MergestreamError, FormatError, NoPathError)

TARGET_NAMES = ("st_header", "shard_index", "adapter_config", "legacy_pickle", "config_yaml", "webhook",
                "s3_notify", "feed_custom")

_BASE = {"layer.weight": torch.arange(16, dtype=torch.float32).reshape(4, 4) / 16,
         "layer.bias": torch.zeros(4), "head.weight": torch.ones(2, 4)}
_ADAPTER = {"base_model.model.layer.lora_A.weight": torch.full((2, 4), 0.1),
            "base_model.model.layer.lora_B.weight": torch.full((4, 2), 0.2)}
_SHA_A, _SHA_B, _SHA_C = "a" * 64, "b" * 64, "c" * 64
_SECRET = "fuzz-secret"


class Target:
    """One fuzz target: ``run(data)`` feeds it ``data``; fixtures in :attr:`root` until :meth:`close`."""

    def __init__(self, name: str, run: Callable[[bytes], object], root: Path, cleanup: Callable[[], None] = None):
        self.name, self.run, self.root, self._cleanup = name, run, root, cleanup

    def close(self) -> None:
        """Stop what the target started (servers) and remove its folder."""
        if self._cleanup is not None:
            self._cleanup()
        shutil.rmtree(self.root, ignore_errors=True)


def _drain(ck) -> None:
    """Read every tensor of an opened checkpoint (and close it)."""
    try:
        for name in ck.keys():
            ck.get(name)
    finally:
        ck.close()


def seeds() -> dict[str, list[bytes]]:
    """Valid inputs of every target (a few each), the starting corpus of the fuzzer."""
    legacy_zip, legacy_old = io.BytesIO(), io.BytesIO()
    torch.save(_BASE, legacy_zip)
    torch.save({"state_dict": _BASE, "epoch": 3}, legacy_old, _use_new_zipfile_serialization=False)
    index = {"metadata": {"total_size": 96}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in _BASE}}
    adapter = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["layer"], "fan_in_fan_out": False,
               "use_rslora": False, "init_lora_weights": True, "alpha_pattern": {"layer": 8}, "rank_pattern": {}}
    config = ("base: base.safetensors\nstate_dir: state\ninbox: inbox\npolicy:\n  name: ties\n"
              "  params: {lambda: 1.0, k: 0.2}\nwatch: {settle_seconds: 1.0, polling: false}\n"
              "gate:\n  rules:\n    - {metric: step_drift, direction: lower, max_ratio_to_history: 10}\n"
              "mlflow:\n  enabled: false\n  tracking_uri: http://127.0.0.1:5000\n"
              "  registry: {enabled: false, models: [experts]}\n"
              "metrics: {enabled: true, host: 127.0.0.1, port: 0}\nretention: 3\n"
              "probes:\n  - type: weight_space\n")
    webhook = {"entity": "model_version", "action": "created", "data": {"name": "experts", "version": "3"}}
    notify = {"EventName": "s3:ObjectCreated:Put",
              "Records": [{"eventName": "s3:ObjectCreated:Put", "s3": {"object": {"key": "inbox/e1.safetensors"}}}]}
    feed = {"installed": _SHA_A,
            "latest": {"kind": "latest", "version": 3, "weights_sha256": _SHA_C, "release": 7, "rollback": False},
            "targets": {
                "patches/000001-000002.safetensors": {"length": 100, "custom": {"mergestream": {
                    "kind": "patch", "from_version": 1, "to_version": 2, "from_sha256": _SHA_A, "to_sha256": _SHA_B}}},
                "patches/000002-000003.safetensors": {"length": 120, "custom": {"mergestream": {
                    "kind": "patch", "from_version": 2, "to_version": 3, "from_sha256": _SHA_B, "to_sha256": _SHA_C}}},
                "models/000003/model.safetensors": {"length": 5000, "custom": {"mergestream": {
                    "kind": "model", "version": 3, "weights_sha256": _SHA_C, "file": "model.safetensors"}}}}}
    return {
        "st_header": [save_bytes(_BASE), save_bytes(_ADAPTER, metadata={"format": "pt"})],
        "shard_index": [json.dumps(index).encode()],
        "adapter_config": [json.dumps(adapter).encode()],
        "legacy_pickle": [legacy_zip.getvalue(), legacy_old.getvalue()],
        "config_yaml": [config.encode()],
        "webhook": [json.dumps(webhook).encode()],
        "s3_notify": [json.dumps(notify).encode()],
        "feed_custom": [json.dumps(feed).encode()],
    }


def _file_target(name: str, root: Path, filename: str, consume: Callable[[Path], object]) -> Target:
    path = root / filename

    def run(data: bytes) -> object:
        path.write_bytes(data)
        return consume(path)

    return Target(name, run, root)


def _post(port: int, headers: dict[str, str], body: bytes) -> int:
    """POST ``body`` to ``127.0.0.1:port`` and return the status (raises on a dropped connection)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", "/", body=body, headers={"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


class ServerError(AssertionError):
    """A receiver answered 5xx: an input it could not handle."""


def make(name: str) -> Target:
    """Build target ``name`` (one of :data:`TARGET_NAMES`), its fixtures in a fresh folder.

    Raises:
        KeyError: an unknown name.
    """
    root = Path(tempfile.mkdtemp(prefix=f"ms-fuzz-{name}-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    from safetensors.torch import save_file

    from mergestream.io.checkpoints import open_checkpoint

    if name == "st_header":
        from mergestream.io.st import read_header

        def consume(p: Path) -> None:
            read_header(p)
            _drain(open_checkpoint(p))

        return _file_target(name, root, "model.safetensors", consume)
    if name == "shard_index":
        save_file(_BASE, root / "model-00001-of-00001.safetensors")
        return _file_target(name, root, "model.safetensors.index.json", lambda p: _drain(open_checkpoint(root)))
    if name == "adapter_config":
        from mergestream.io.expert_readers import open_expert

        save_file(_BASE, root / "base.safetensors")
        (root / "adapter").mkdir()
        save_file(_ADAPTER, root / "adapter" / "adapter_model.safetensors")
        base = open_checkpoint(root / "base.safetensors")

        def consume(p: Path) -> None:
            ex = open_expert(root / "adapter", base)
            try:
                ex.validate_against(base)
                for k in ex.keys():
                    ex.task_vector(k, base.get(k))
            finally:
                ex.close()

        t = _file_target(name, root / "adapter", "adapter_config.json", consume)
        t.root, t._cleanup = root, base.close
        return t
    if name == "legacy_pickle":
        return _file_target(name, root, "pytorch_model.bin", lambda p: _drain(open_checkpoint(p)))
    if name == "config_yaml":
        from mergestream.config import load_config

        save_file(_BASE, root / "base.safetensors")
        (root / "inbox").mkdir()
        return _file_target(name, root, "config.yaml", load_config)
    if name == "webhook":
        from mergestream.daemon.sources.webhook import WebhookReceiver, sign_webhook

        rx = WebhookReceiver("127.0.0.1", 0, _SECRET, lambda: None)
        rx.start()

        def run(data: bytes) -> int:
            body = data.decode("utf-8", "replace").encode("utf-8")  # a signed body is text (else 401)
            ts = str(int(time.time()))
            headers = {"X-MLflow-Delivery-Id": "d1", "X-MLflow-Timestamp": ts,
                       "X-MLflow-Signature": sign_webhook(_SECRET, "d1", ts, body)}
            status = _post(rx.port, headers, body)
            if status >= 500:
                raise ServerError(f"webhook answered {status}")
            return status

        return Target(name, run, root, rx.stop)
    if name == "s3_notify":
        from mergestream.daemon.sources.s3_notify import NotificationReceiver

        rx = NotificationReceiver("127.0.0.1", 0, _SECRET, lambda: None)
        rx.start()

        def run(data: bytes) -> int:
            status = _post(rx.port, {"Authorization": f"Bearer {_SECRET}"}, data)
            if status >= 500:
                raise ServerError(f"s3 notification receiver answered {status}")
            return status

        return Target(name, run, root, rx.stop)
    if name == "feed_custom":
        return Target(name, _feed_custom, root)
    shutil.rmtree(root, ignore_errors=True)
    raise KeyError(f"no fuzz target {name!r} (known: {', '.join(TARGET_NAMES)})")


def _feed_custom(data: bytes):
    """What ``mergestream.agent.pull`` does with the custom fields of verified metadata."""
    from mergestream.feed.layout import custom_of
    from mergestream.feed.plan import Target as FeedTarget
    from mergestream.feed.plan import shortest

    try:  # TUF itself parses the metadata JSON (and refuses what is not JSON): not ours to fuzz
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    latest = custom_of({"custom": {"mergestream": doc.get("latest")}})
    if latest is None or latest.get("kind") != "latest":
        return None  # the agent refuses such a feed (MetadataRefused)
    targets = []
    for path, fields in (doc.get("targets") if isinstance(doc.get("targets"), dict) else {}).items():
        info = custom_of(fields if isinstance(fields, dict) else None)
        length = fields.get("length") if isinstance(fields, dict) else None
        if info is not None and isinstance(length, int) and length >= 0:  # TUF: a verified length
            targets.append(FeedTarget(path, length, info))
    installed = doc.get("installed")
    plan = shortest(targets, installed if isinstance(installed, str) else None, latest["version"],
                    latest["weights_sha256"])
    plan.describe()
    return plan


def check(target: Target, data: bytes) -> None:
    """Run ``target`` on ``data``; an exception of :data:`ALLOWED` is a normal outcome (swallowed),
    anything else propagates (a crash)."""
    try:
        target.run(data)
    except ALLOWED:
        pass
