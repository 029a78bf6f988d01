"""The daemon reads an expert once per fold (issue 37): it is queued under its arrival key (file
metadata, no byte read) and its content hash comes from the fold's own pass; content duplicates
are found then, before probing, and an arrival whose content a fold already read is known at once."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from mergestream.config import Config
from mergestream.daemon.records import ARRIVAL_PREFIX
from mergestream.daemon.service import Service
from mergestream.daemon.sources import ExpertReady
from mergestream.io.expert_readers import arrival_key, content_sha256

from .conftest import opened_during, perturb, random_model, run_cli, save_tensors

def _setup(tmp: Path, n: int) -> tuple[Path, list[Path]]:
    base = random_model(0)
    bpath = save_tensors(tmp / "base.safetensors", base)
    inbox = tmp / "inbox"
    return bpath, [save_tensors(inbox / f"e{i}.safetensors", perturb(base, 0.01, seed=i + 1)) for i in range(n)]


def _service(tmp: Path, base: Path) -> Service:
    cfg = Config(base=base, inbox=tmp / "inbox", state_dir=tmp / "state", metrics={"enabled": False},
                 mlflow={"enabled": False}, gate={"rules": []})
    svc = Service(cfg, serve_metrics=False, watch_sources=False)
    svc.start()
    return svc


def _ready(svc: Service, path: Path, eid: str) -> None:
    svc.on_expert_ready(ExpertReady(source="folder", uri=str(path), expert_id=eid))


def _config_file(tmp: Path, base: Path) -> Path:
    import yaml

    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump({"base": str(base), "inbox": str(tmp / "inbox"), "state_dir": str(tmp / "state"),
                                    "mlflow": {"enabled": False}, "metrics": {"enabled": False}}))
    return path


def test_queueing_opens_no_file_of_the_expert_and_the_fold_records_its_content_hash(tmp_path):
    bpath, (e0,) = _setup(tmp_path, 1)
    svc = _service(tmp_path, bpath)
    try:
        opened = opened_during(lambda: _ready(svc, e0, "e0"))
        assert not [p for p in opened if Path(p).name == e0.name], opened  # stat only
        row = svc.ledger.expert("e0")
        assert row.sha256 == ARRIVAL_PREFIX + arrival_key(e0) and row.content_sha256 is None
        doc = json.loads(run_cli("status", "--config", str(_config_file(tmp_path, bpath)), "--json").stdout)
        assert [x["sha256"] for x in doc["experts"]] == [None]  # no half-identity shown as a hash
        assert svc.step()
        row = svc.ledger.expert("e0")
        assert row.status == "accepted" and row.sha256 == content_sha256(e0)  # the fold's own pass
        assert row.metadata["mergestream.hash"] == "weights/2"
        assert svc.ledger.known_arrival(arrival_key(e0)) == row.sha256
    finally:
        svc.shutdown()


def test_a_copy_under_another_name_is_found_by_its_fold_and_never_published(tmp_path):
    bpath, (e0, e1) = _setup(tmp_path, 2)
    copy = shutil.copy(e0, tmp_path / "inbox" / "e0-copy.safetensors")
    svc = _service(tmp_path, bpath)
    try:
        for p, eid in ((e0, "e0"), (Path(copy), "e0-copy"), (e1, "e1")):
            _ready(svc, p, eid)
        assert svc.ledger.queue_depth() == 3  # different arrivals: not known to be one content yet
        while svc.step():
            pass
        assert {r.expert_id: r.status for r in svc.ledger.experts()} == {"e0": "accepted", "e1": "accepted"}
        assert svc.store.current() == 2  # the copy published nothing
        dup = [f for f in svc.ledger.folds() if f["kind"] == "duplicate"]
        assert len(dup) == 1 and dup[0]["expert_id"] == "e0-copy" and "expert e0" in dup[0]["reason"]
        assert svc.metrics.experts_rejected.labels(stage="duplicate")._value.get() == 1
        assert not list((tmp_path / "state" / "staging").iterdir())
        assert not (tmp_path / "state" / "experts" / "e0-copy").exists()  # its kept link went with it
        # a rescan or restart announces it again: known by its arrival key, nothing queued or read
        opened = opened_during(lambda: _ready(svc, Path(copy), "e0-copy"))
        assert svc.ledger.queue_depth() == 0 and not [p for p in opened if p.endswith("e0-copy.safetensors")]
        assert len([f for f in svc.ledger.folds() if f["kind"] == "duplicate"]) == 1
    finally:
        svc.shutdown()


@pytest.mark.parametrize("how", ["rewritten in place", "replaced"])
def test_an_expert_changed_after_it_was_queued_is_refused_and_its_new_content_folds(tmp_path, how):
    bpath, (e0, e1) = _setup(tmp_path, 2)
    svc = _service(tmp_path, bpath)
    try:
        _ready(svc, e0, "e0")
        st = os.stat(e0)
        if how == "rewritten in place":
            with open(e0, "r+b") as fh:  # same inode and size, new bytes and mtime
                fh.write(e1.read_bytes())
            os.utime(e0, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        else:  # another file renamed over it (the inode changes)
            tmp = tmp_path / "inbox" / ".e0.part"
            shutil.copy(e1, tmp)
            os.replace(tmp, e0)
        assert svc.step()
        row = svc.ledger.expert("e0")
        assert row.status == "rejected" and "changed since it was registered" in row.reason
        assert str(tmp_path / "state") not in row.reason and svc.store.current() is None
        _ready(svc, e0, "e0")  # the source announces the new content: a new arrival, a new row
        assert svc.step()
        assert svc.ledger.expert("e0-2").status == "accepted"
        assert svc.ledger.expert("e0-2").sha256 == content_sha256(e1)
    finally:
        svc.shutdown()


def test_a_sharded_folder_expert_is_queued_by_its_files_and_survives_a_restart_queued(tmp_path):
    """A folder's arrival key covers every file (a READY marker excepted); a row queued under it
    stays queued over a restart and folds then."""
    base = random_model(0)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    folder = tmp_path / "inbox" / "big"
    tensors = perturb(base, 0.01, seed=5)
    names = sorted(tensors)
    half = len(names) // 2
    save_tensors(folder / "model-00001-of-00002.safetensors", {k: tensors[k] for k in names[:half]})
    save_tensors(folder / "model-00002-of-00002.safetensors", {k: tensors[k] for k in names[half:]})
    weight_map = {k: f"model-0000{1 if i < half else 2}-of-00002.safetensors" for i, k in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    key = arrival_key(folder)
    (folder / "READY").write_text("")
    assert arrival_key(folder) == key
    os.utime(folder / "model-00002-of-00002.safetensors", ns=(0, 10**18))
    assert arrival_key(folder) != key
    svc = _service(tmp_path, bpath)
    try:
        _ready(svc, folder, "big")
    finally:
        svc.shutdown()
    svc = _service(tmp_path, bpath)
    try:
        assert svc.ledger.queue_depth() == 1 and svc.step()
        row = svc.ledger.expert("big")
        assert row.status == "accepted" and row.sha256 == content_sha256(folder)
    finally:
        svc.shutdown()


def test_an_expert_rewritten_while_it_is_folded_is_refused_and_nothing_is_published(tmp_path):
    """The fold reads the kept hard link of the inbox file: a rewrite in place during the fold
    would give a hash of a mix of two contents; the files folded are checked after the pass."""
    import threading
    import time

    bpath, (e0, e1) = _setup(tmp_path, 2)
    svc = _service(tmp_path, bpath)
    svc.pipeline.tensor_delay = 0.3  # seconds per tensor: the fold takes ~2 s
    try:
        _ready(svc, e0, "e0")
        new = e1.read_bytes()

        def rewrite() -> None:
            time.sleep(0.6)
            with open(e0, "r+b") as fh:
                fh.write(new)

        t = threading.Thread(target=rewrite)
        t.start()
        assert svc.step()
        t.join()
        row = svc.ledger.expert("e0")
        assert row.status == "rejected" and "changed while it was folded" in row.reason, row.reason
        assert svc.store.current() is None and not list((tmp_path / "state" / "staging").iterdir())
    finally:
        svc.shutdown()


def test_a_registry_expert_fetched_again_before_its_fold_is_not_a_change(tmp_path):
    """An expert with a registry version is identified by it: new files at its cache path (the
    source fetched a damaged copy again) fold normally."""
    bpath, (e0,) = _setup(tmp_path, 1)
    svc = _service(tmp_path, bpath)
    try:
        svc.on_expert_ready(ExpertReady(source="folder", uri=str(e0), expert_id="m-v1", registry_key="m/1"))
        tmp = e0.with_name(".again")
        shutil.copy(e0, tmp)
        os.replace(tmp, e0)  # the same bytes, another inode
        assert svc.step()
        row = svc.ledger.expert("m-v1")
        assert row.status == "accepted" and row.sha256 == content_sha256(e0)
    finally:
        svc.shutdown()
