"""The weights hash, version 2 (issue 37): sha256 over the ordered per-tensor digests, so that the
digests are computed where the bytes are read (Ray tasks) and combined by whoever knows the frames;
every implementation gives the same value; records written with version 1 stay verifiable (state
records, ledger hashes a fold checks, patches, a device's installed model)."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch

from mergestream import engine
from mergestream.engine import ExecOptions
from mergestream.errors import CorruptCheckpointError
from mergestream.io import st
from mergestream.io.checkpoints import open_checkpoint
from mergestream.io.expert_readers import content_sha256, hash_matches
from mergestream.io.state import StateDir
from mergestream.patches import apply_patch, canonical_header, weights_match, weights_sha256
from mergestream.patches.build import build_patch

from .conftest import perturb, random_model, save_tensors

DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64"}


def by_hand(tensors: dict[str, torch.Tensor], version: int) -> str:
    """The module docstring's definition, written out independently of the package's code."""
    u64 = lambda n: struct.pack("<Q", n)  # noqa: E731
    h = hashlib.sha256(f"mergestream-weights-sha256/{version}\0".encode() + u64(len(tensors)))
    for name in sorted(tensors, key=lambda n: n.encode()):
        t = tensors[name].contiguous()
        data = t.view(-1).view(torch.uint8).numpy().tobytes()
        dt = DTYPE[t.dtype].encode()
        h.update(u64(len(name.encode())) + name.encode() + u64(len(dt)) + dt + u64(t.dim())
                 + b"".join(u64(d) for d in t.shape) + u64(len(data)))
        h.update(hashlib.sha256(data).digest() if version == 2 else data)
    return h.hexdigest()


@pytest.fixture
def model(tmp_path):
    t = random_model(1, torch.bfloat16)
    return t, save_tensors(tmp_path / "m.safetensors", t)


def test_every_implementation_computes_the_documented_version_2(model, tmp_path):
    tensors, path = model
    want = by_hand(tensors, 2)
    with open_checkpoint(path) as ck:
        assert ck.sha256() == want
        combined = st.WeightsHash(len(ck.keys()))  # as the driver of a remote fold combines digests
        for name in st.name_order(ck.keys()):
            combined.add_digest(ck.entry(name), ck.digest(name))
        assert combined.hexdigest() == want
    assert weights_sha256(path) == want  # the numpy-only apply side
    assert content_sha256(path) == want
    # independent of sharding: the same tensors in two files
    names = sorted(tensors)
    folder = tmp_path / "sharded"
    save_tensors(folder / "model-00001-of-00002.safetensors", {n: tensors[n] for n in names[:3]})
    save_tensors(folder / "model-00002-of-00002.safetensors", {n: tensors[n] for n in names[3:]})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f"model-0000{1 if i < 3 else 2}-of-00002.safetensors" for i, n in enumerate(names)}}))
    assert content_sha256(folder) == want and weights_sha256(folder) == want


def test_version_1_is_still_computed_for_older_records(model):
    tensors, path = model
    v1 = by_hand(tensors, 1)
    assert v1 != by_hand(tensors, 2)
    with open_checkpoint(path) as ck:
        assert ck.sha256(1) == v1
    assert weights_sha256(path, version=1) == v1 and content_sha256(path, version=1) == v1
    assert hash_matches(path, v1) and hash_matches(path, by_hand(tensors, 2))
    assert hash_matches(path, v1, kind="weights") and not hash_matches(path, v1, kind="weights2")
    assert not hash_matches(path, "0" * 64)
    assert weights_match(path, v1) and not weights_match(path, "0" * 64)


def test_a_digest_cannot_stand_in_for_a_version_1_stream():
    h = st.WeightsHash(1, version=1)
    with pytest.raises(st.FormatError, match="version 1"):
        h.add_digest(st.TensorEntry("a", "F32", (1,), Path("x"), 0, 4), bytes(32))
    h2 = st.WeightsHash(2)
    with pytest.raises(st.FormatError, match="out of order"):
        h2.add_digest(st.TensorEntry("b", "F32", (1,), Path("x"), 0, 4), bytes(32))
        h2.add_digest(st.TensorEntry("a", "F32", (1,), Path("x"), 0, 4), bytes(32))


def _as_version_1(state: Path) -> None:
    """Rewrite a state's fold records as a state written before version 2 held them."""
    sd = StateDir(state)
    man = sd.manifest
    for f in man.folds:
        f.sha256, f.sha256_kind = content_sha256(f.expert, version=1), "weights"
    sd.commit(man, [])


def _chain(tmp: Path, tag: str) -> Path:
    base = random_model(0, torch.bfloat16)
    bpath = save_tensors(tmp / "base.safetensors", base)
    state, backbone = tmp / f"{tag}-state", None
    for i in range(2):
        e = save_tensors(tmp / f"e{i}.safetensors", perturb(base, 0.05, 10 + i))
        engine.fold(bpath, backbone, e, "task_arithmetic", {"lambda": 0.5}, state_dir=state,
                    out=tmp / f"{tag}-{i}", expert_id=f"e{i}", options=ExecOptions(threads=1))
        backbone = tmp / f"{tag}-{i}"
    assert [f.sha256_kind for f in StateDir(state).manifest.folds] == ["weights2", "weights2"]
    _as_version_1(state)
    return state


def test_a_state_written_with_version_1_subtracts_after_checking_the_kept_expert(tmp_path):
    state = _chain(tmp_path, "s")
    sd = StateDir(state)
    man = sd.manifest
    good = man.folds[1].sha256
    man.folds[1].sha256 = "ab" * 32  # a version-1 record the kept expert no longer matches
    sd.commit(man, [])
    with pytest.raises(CorruptCheckpointError, match="changed since it was folded"):
        engine.unmerge(state, "e1", "subtract", out=tmp_path / "bad", options=ExecOptions(threads=1))
    man.folds[1].sha256 = good
    sd.commit(man, [])
    engine.unmerge(state, "e1", "subtract", out=tmp_path / "sub", options=ExecOptions(threads=1))
    assert [f.id for f in StateDir(state).manifest.folds] == ["e0"]


def test_a_state_written_with_version_1_replays(tmp_path):
    state = _chain(tmp_path, "r")
    engine.unmerge(state, "e0", "replay", out=tmp_path / "rep", options=ExecOptions(threads=1))  # refolds e1, v1 hash checked
    assert [(f.id, f.sha256_kind) for f in StateDir(state).manifest.folds] == [("e1", "weights2")]


def test_a_fold_checks_a_version_1_ledger_hash_and_refuses_a_changed_expert(tmp_path):
    base = random_model(0, torch.bfloat16)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    e = save_tensors(tmp_path / "e.safetensors", perturb(base, 0.05, 3))
    v1 = content_sha256(e, version=1)
    rep = engine.fold(bpath, None, e, "ties", {"k": 30}, state_dir=tmp_path / "s", out=tmp_path / "o",
                      expect_sha256=v1, options=ExecOptions(threads=1))
    assert rep.sha256 == [content_sha256(e)]  # what is recorded from now on: version 2
    with pytest.raises(CorruptCheckpointError, match="changed since it was registered"):
        engine.fold(bpath, None, e, "ties", {"k": 30}, state_dir=tmp_path / "s2", out=tmp_path / "o2",
                    expect_sha256="ab" * 32, options=ExecOptions(threads=1))


def _rewrite_as_version_1(patch: Path, src: Path, dst: Path) -> None:
    """A patch as written before version 2: version-1 hashes, no ``weights_hash`` key."""
    raw = patch.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    meta = header["__metadata__"]
    del meta["weights_hash"]
    meta["source_sha256"], meta["target_sha256"] = weights_sha256(src, 1), weights_sha256(dst, 1)
    meta.pop("payload_sha256")
    meta["payload_sha256"] = hashlib.sha256(data + canonical_header(header)).hexdigest()
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    patch.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_a_patch_written_with_version_1_still_applies(tmp_path):
    base = random_model(0, torch.bfloat16)
    src = save_tensors(tmp_path / "v1" / "model.safetensors", base).parent
    dst = save_tensors(tmp_path / "v2" / "model.safetensors", perturb(base, 0.05, 4)).parent
    p = tmp_path / "p.safetensors"
    build_patch(src, dst, p, source_version="1", target_version="2")
    _rewrite_as_version_1(p, src, dst)
    rep = apply_patch(src, p, tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (dst / "model.safetensors").read_bytes()
    assert rep["target_sha256"] == weights_sha256(dst, 1)


def test_the_ledger_tags_its_hashes_with_the_current_version_and_still_checks_version_1_rows():
    """The daemon's ledger records which hash it holds; the tag follows the definition (a stale tag
    would make the fold skip its 'changed since registered' check), and version-1 rows stay checked."""
    from mergestream.daemon.pipeline import HASH_KIND, HASH_KINDS

    assert HASH_KIND == f"weights/{st.WEIGHTS_HASH_VERSION}"
    assert set(HASH_KINDS) == {"weights/1", HASH_KIND}
