"""The signed feed (issue 16): keys, releases, rollback, key rotation; plus the helpers the agent
tests share: a daemon-style version store with five versions and a loopback HTTP server with
Range support and a request log."""

from __future__ import annotations

import http.server
import json
import re
import stat
import threading
from pathlib import Path

import pytest
import torch
from tuf.api.metadata import Metadata

from mergestream.daemon.store import Store
from mergestream.feed.build import FeedBuildError, build_feed
from mergestream.feed.keys import FeedKeyError, generate, rotate_key, signer
from mergestream.feed.layout import custom_of, parse_duration
from mergestream.patches import weights_sha256
from mergestream.patches.build import build_patch

from .conftest import random_model, run_cli, save_tensors


# -- a daemon-style store -----------------------------------------------------------------------------
def _next_model(prev: dict[str, torch.Tensor], seed: int, density: float = 0.02) -> dict[str, torch.Tensor]:
    """The next version: ``density`` of each float tensor's entries moved (a sparse fold)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in prev.items():
        if v.is_floating_point():
            mask = torch.rand(v.shape, generator=g) < density
            out[k] = torch.where(mask, v + 0.01 * torch.randn(v.shape, generator=g).to(v.dtype), v)
        else:
            out[k] = v.clone()
    return out


def make_store(root: Path, versions: int = 5, dtype: torch.dtype = torch.float32, density: float = 0.02) -> Store:
    """``versions`` published versions laid out as the daemon does: ``versions/N/model``,
    ``versions/N/patch-from-<N-1>.safetensors``, ``fold.json``, ``current`` -> the last one
    (``density``: the fraction of each float tensor a version changes)."""
    store = Store(root)
    model = random_model(seed=1, dtype=dtype, m=64, n=48)
    for n in range(1, versions + 1):
        if n > 1:
            model = _next_model(model, seed=n, density=density)
        d = store.path(n)
        save_tensors(d / "model" / "model.safetensors", model, {"mergestream.policy": "ties"})
        (d / "model" / "config.json").write_text('{"model_type": "toy"}')
        (d / "fold.json").write_text(json.dumps({"version": n, "policy": "ties"}))
        if n > 1:
            build_patch(store.path(n - 1) / "model", d / "model", d / f"patch-from-{n - 1:06d}.safetensors",
                        source_version=str(n - 1), target_version=str(n), policy="ties")
        store.point_current(n)
    return store


# -- a loopback HTTP server with Range and a request log -------------------------------------------
class FeedServer:
    """Serves a folder on 127.0.0.1 (a real ``ThreadingHTTPServer``): ``Range: bytes=N-`` answered
    with 206, every request logged as ``(path, Range header or None)``; ``cut_once[name] = n``
    closes the connection after ``n`` body bytes of the first request whose path ends with ``name``."""

    def __init__(self, root: Path):
        self.root = root
        self.log: list[tuple[str, str | None]] = []
        self.cut_once: dict[str, int] = {}
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                rng = self.headers.get("Range")
                server.log.append((self.path, rng))
                path = server.root / self.path.lstrip("/")
                if not path.is_file():
                    self.send_error(404)
                    return
                data = path.read_bytes()
                start = 0
                if rng and (m := re.fullmatch(r"bytes=(\d+)-", rng)):
                    start = int(m[1])
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                body = data[start:]
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                for name, n in list(server.cut_once.items()):
                    if self.path.endswith(name):
                        del server.cut_once[name]
                        self.wfile.write(body[:n])
                        self.wfile.flush()
                        self.close_connection = True
                        return
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        """Stop serving."""
        self.httpd.shutdown()
        self.httpd.server_close()


def served_feed(tmp_path: Path, latest: int | None = None) -> dict:
    """A store with five versions, keys, a feed at release 1 (``latest``: the version it names;
    default the newest) and a server for it: ``{store, keys, feed, server, root}`` (close the server)."""
    store = make_store(tmp_path / "state")
    keys = tmp_path / "keys"
    generate(keys)
    feed = tmp_path / "feed"
    build_feed(store.root, feed, keys, **({} if latest is None else {"latest": latest}))
    return {"store": store, "keys": keys, "feed": feed, "server": FeedServer(feed),
            "root": feed / "metadata" / "1.root.json"}


@pytest.fixture
def fleet(tmp_path):
    """A store with five versions, keys, a feed at release 1 (latest v5) and its server."""
    w = served_feed(tmp_path)
    yield w
    w["server"].close()


def signed_targets(feed: Path) -> dict:
    """``{target path: TargetFile}`` of the feed's newest targets metadata."""
    ts = Metadata.from_file(str(feed / "metadata" / "timestamp.json"))
    snap = Metadata.from_file(str(feed / "metadata" / f"{ts.signed.snapshot_meta.version}.snapshot.json"))
    tg = Metadata.from_file(str(feed / "metadata" / f"{snap.signed.meta['targets.json'].version}.targets.json"))
    return dict(tg.signed.targets)


def targets_of(feed: Path) -> dict[str, dict]:
    """``{target path: custom.mergestream}`` of the feed's newest targets metadata."""
    return {p: custom_of(t.unrecognized_fields) for p, t in signed_targets(feed).items()}


# -- tests ------------------------------------------------------------------------------------------
def test_keygen_writes_private_keys_0600_and_refuses_to_overwrite(tmp_path):
    ids = generate(tmp_path / "keys")
    assert set(ids) == {"root", "targets", "snapshot", "timestamp"}
    for role in ids:
        assert stat.S_IMODE((tmp_path / "keys" / f"{role}.pem").stat().st_mode) == 0o600
    with pytest.raises(FeedKeyError, match="already exist"):
        generate(tmp_path / "keys")


def test_encrypted_keys_need_the_passphrase_and_errors_show_no_key(tmp_path, monkeypatch):
    monkeypatch.setenv("MERGESTREAM_FEED_KEY_PASSPHRASE", "s3cret-pass")
    generate(tmp_path / "keys")
    pem = (tmp_path / "keys" / "targets.pem").read_text()
    assert "ENCRYPTED" in pem
    assert signer(tmp_path / "keys", "targets").public_key.keytype == "ed25519"
    monkeypatch.delenv("MERGESTREAM_FEED_KEY_PASSPHRASE")
    with pytest.raises(FeedKeyError, match="encrypted") as info:
        signer(tmp_path / "keys", "targets")
    assert "BEGIN" not in str(info.value)


def test_feed_lists_patches_full_latest_model_and_latest_pointer(fleet):
    t = targets_of(fleet["feed"])
    patches = sorted((i["from_version"], i["to_version"]) for i in t.values() if i["kind"] == "patch")
    assert patches == [(1, 2), (2, 3), (3, 4), (4, 5)]
    v5 = weights_sha256(fleet["store"].path(5) / "model")
    model_files = sorted(i["file"] for i in t.values() if i["kind"] == "model")
    assert model_files == ["config.json", "model.safetensors"]
    assert all(i["version"] == 5 and i["weights_sha256"] == v5 for i in t.values() if i["kind"] == "model")
    assert t["latest.json"] == {"kind": "latest", "version": 5, "weights_sha256": v5, "release": 1, "rollback": False}
    # consistent snapshots: every target file is stored under <sha256>.<name>
    tg = Metadata.from_file(str(fleet["feed"] / "metadata" / "1.targets.json")).signed.targets
    for path, tf in tg.items():
        d, _, name = path.rpartition("/")
        assert (fleet["feed"] / "targets" / d / f"{tf.hashes['sha256']}.{name}").stat().st_size == tf.length


def test_each_build_is_a_new_release_and_rollback_points_back(fleet):
    rep = build_feed(fleet["store"].root, fleet["feed"], fleet["keys"], latest=3)
    assert rep["release"] == 2 and rep["latest"]["rollback"] is True
    t = targets_of(fleet["feed"])
    assert t["latest.json"]["version"] == 3
    assert any(i["kind"] == "patch" and (i["from_version"], i["to_version"]) == (5, 3) for i in t.values())
    assert {i["version"] for i in t.values() if i["kind"] == "model"} == {3}
    ts = Metadata.from_file(str(fleet["feed"] / "metadata" / "timestamp.json")).signed
    assert ts.version == 2 and ts.snapshot_meta.version == 2
    # bytes a device needs: the 5 -> 3 patch for v5, less than the full model
    assert 0 < rep["bytes_to_latest"]["5"] < rep["full_model_bytes"] == rep["bytes_to_latest"]["none"]


def test_rotating_a_key_publishes_a_new_root_signed_by_the_old_root_key(fleet):
    rotate_key(fleet["keys"], "root")
    rotate_key(fleet["keys"], "targets")
    rep = build_feed(fleet["store"].root, fleet["feed"], fleet["keys"])
    assert rep["root_version"] == 2
    old = Metadata.from_file(str(fleet["feed"] / "metadata" / "1.root.json"))
    new = Metadata.from_file(str(fleet["feed"] / "metadata" / "2.root.json"))
    old.verify_delegate("root", new)  # the old root's threshold of keys signed the new root
    new.verify_delegate("root", new)
    assert new.signed.roles["targets"].keyids != old.signed.roles["targets"].keyids


def test_build_refuses_an_unknown_latest_and_an_empty_store(fleet, tmp_path):
    with pytest.raises(FeedBuildError, match="version 9 is not kept"):
        build_feed(fleet["store"].root, fleet["feed"], fleet["keys"], latest=9)
    with pytest.raises(FeedBuildError, match="no published version"):
        build_feed(tmp_path / "empty", tmp_path / "f2", fleet["keys"])


def test_cli_keygen_and_build_never_print_key_material(tmp_path):
    store = make_store(tmp_path / "state", versions=2)
    out = run_cli("feed", "keygen", "--keys", tmp_path / "keys")
    (tmp_path / "daemon.yaml").write_text("base: base\nstate_dir: state\n")
    proc = run_cli("feed", "build", "--config", tmp_path / "daemon.yaml", "--out", tmp_path / "feed",
                   "--keys", tmp_path / "keys", "--timestamp-expires", "2h", "--patch-format", "2", "--zstd", "3", "--json")
    rep = json.loads(proc.stdout)
    assert rep["latest"]["version"] == 2 and set(rep["bytes_to_latest"]) == {"none", "1", "2"}
    for text in (out.stdout + out.stderr, proc.stdout + proc.stderr):
        assert "PRIVATE KEY" not in text
    bad = run_cli("feed", "build", "--state-dir", store.root, "--out", tmp_path / "feed", "--keys", tmp_path / "nokeys",
                  check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and len(bad.stderr.strip().splitlines()) == 1


def test_build_warns_when_patches_save_a_device_nothing(tmp_path, caplog):
    """A policy that changes every weight at each fold makes patches as large as the model: the
    build says so (logged, in the report, on the command line); sparse versions build silently."""
    generate(tmp_path / "keys")
    sparse = build_feed(make_store(tmp_path / "sparse", versions=3).root, tmp_path / "f1", tmp_path / "keys")
    assert sparse["patch_warning"] is None
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    dense = make_store(tmp_path / "dense", versions=3, density=1.0)
    with caplog.at_level("WARNING", logger="mergestream.feed.build"):
        rep = build_feed(dense.root, tmp_path / "f2", tmp_path / "keys")
    assert rep["patch_warning"] and "at least 90% of a full download (2 patch(es)" in rep["patch_warning"]
    assert any(rep["patch_warning"] in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    proc = run_cli("feed", "build", "--state-dir", dense.root, "--out", tmp_path / "f3", "--keys", tmp_path / "keys")
    assert f"warning: {rep['patch_warning']}" in proc.stdout


def test_parse_duration():
    assert parse_duration("10m") == 600 and parse_duration("2h") == 7200 and parse_duration("45") == 45
    with pytest.raises(ValueError):
        parse_duration("soon")
