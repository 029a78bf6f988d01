"""Every bad input gets its own specific error, a one-line CLI message, a non-zero exit, and no output."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mergestream import engine
from mergestream.errors import (
    CorruptCheckpointError,
    DtypeMismatchError,
    ExtraKeyError,
    FrozenTensorMismatchError,
    MissingKeyError,
    MissingShardError,
    NonFiniteError,
    ShapeMismatchError,
    StateError,
    UnsupportedCheckpointError,
    VocabularyGrownError,
)
from mergestream.io.checkpoints import open_checkpoint

from .conftest import perturb, random_model, run_cli, save_tensors


def _truncate(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def _bad_expert(tmp_path, kind):
    """Write a base and an expert broken in one way; return (base, expert, expected error, words)."""
    base = random_model(0)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    e = perturb(base, 0.01, 1)
    name = "layer.0.attn.weight"
    words = [name]
    if kind == "missing_key":
        del e[name]
        err = MissingKeyError
    elif kind == "extra_key":
        e["layer.9.new.weight"] = torch.zeros(3)
        err, words = ExtraKeyError, ["layer.9.new.weight"]
    elif kind == "shape":
        e[name] = torch.zeros(48, 41)
        err, words = ShapeMismatchError, [name, "[48, 41]", "[48, 40]"]
    elif kind == "vocab_grown":
        e["embed.word_embeddings.weight"] = torch.zeros(35, 40)
        err, words = VocabularyGrownError, ["embed.word_embeddings.weight", "35", "30", "vocabulary"]
    elif kind == "dtype":
        e[name] = e[name].to(torch.float16)
        err, words = DtypeMismatchError, [name, "float16", "float32"]
    elif kind == "frozen_int":
        e["position_ids"] = e["position_ids"] + 1
        err, words = FrozenTensorMismatchError, ["position_ids", "never merged"]
    elif kind == "nan":
        e[name][3, 4] = float("nan")
        err = NonFiniteError
    elif kind == "inf":
        e["layer.0.attn.bias"][0] = float("-inf")
        err, words = NonFiniteError, ["layer.0.attn.bias"]
    else:
        raise AssertionError(kind)
    epath = save_tensors(tmp_path / "expert.safetensors", e)
    return bpath, epath, err, words


KINDS = ["missing_key", "extra_key", "shape", "vocab_grown", "dtype", "frozen_int", "nan", "inf"]


@pytest.mark.parametrize("kind", KINDS)
def test_bad_expert_raises_specific_error_and_writes_nothing(tmp_path, kind):
    bpath, epath, err, words = _bad_expert(tmp_path, kind)
    with pytest.raises(err) as info:
        engine.fold(bpath, None, epath, "task_arithmetic", state_dir=tmp_path / "state", out=tmp_path / "out")
    for w in words:
        assert w in str(info.value)
    assert str(bpath) in str(info.value) or kind in ("nan", "inf")
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "state" / "manifest.json").exists()
    assert not list(tmp_path.glob(".out.staging-*"))


@pytest.mark.parametrize("kind", KINDS)
def test_bad_expert_cli_exits_nonzero_with_one_line(tmp_path, kind):
    bpath, epath, err, words = _bad_expert(tmp_path, kind)
    proc = run_cli("fold", "--base", bpath, "--expert", epath, "--policy", "ties", "--state", tmp_path / "st",
                   "--out", tmp_path / "out", check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and err.__name__ in lines[0]
    for w in words:
        assert w in lines[0]
    assert not (tmp_path / "out").exists()


def _hf_sharded(tmp_path, tensors):
    """A sharded HF folder (two shards + index) written by our own writer."""
    from mergestream.io.checkpoints import TensorMeta
    from mergestream.io.writers import ModelWriter

    folder = tmp_path / "sharded"
    folder.mkdir()
    metas = [TensorMeta(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    w = ModelWriter(folder, metas, {"format": "pt"}, max_shard_bytes=8000)
    for k, v in tensors.items():
        w.write(k, v)
    w.close()
    (folder / "config.json").write_text(json.dumps({"model_type": "toy"}))
    return folder


@pytest.mark.parametrize("kind", ["truncated", "garbage_header", "missing_shard", "empty_file"])
def test_unreadable_expert_files(tmp_path, kind):
    base = random_model(0)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    if kind == "missing_shard":
        epath = _hf_sharded(tmp_path, perturb(base, 0.01, 1))
        shard = sorted(epath.glob("model-*.safetensors"))[-1]
        shard.unlink()
        err, word = MissingShardError, shard.name
    else:
        epath = save_tensors(tmp_path / "expert.safetensors", perturb(base, 0.01, 1))
        err, word = CorruptCheckpointError, "expert.safetensors"
        if kind == "truncated":
            _truncate(epath, epath.stat().st_size - 100)
        elif kind == "garbage_header":
            epath.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + b"\0" * 50)
        else:
            epath.write_bytes(b"")
    with pytest.raises(err, match=word):
        engine.fold(bpath, None, epath, "task_arithmetic", state_dir=tmp_path / "st", out=tmp_path / "out")
    proc = run_cli("fold", "--base", bpath, "--expert", epath, "--policy", "task_arithmetic", "--state",
                   tmp_path / "st", "--out", tmp_path / "out", check=False)
    assert proc.returncode == 2 and err.__name__ in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_sharded_folder_reads_like_single_file(tmp_path):
    base = random_model(0)
    folder = _hf_sharded(tmp_path, base)
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    engine.fold(bpath, None, folder, "task_arithmetic", {"lambda": 1}, state_dir=tmp_path / "s", out=tmp_path / "o")
    from mergestream.io.checkpoints import read_state_dict

    got = read_state_dict(tmp_path / "o")
    for k, v in base.items():
        assert torch.equal(got[k], v)


def test_missing_base_and_unknown_format_are_clean_errors(tmp_path):
    proc = run_cli("fold", "--base", tmp_path / "nope.safetensors", "--expert", tmp_path / "e.safetensors",
                   "--policy", "ties", "--state", tmp_path / "s", "--out", tmp_path / "o", check=False)
    assert proc.returncode == 2 and "nope.safetensors" in proc.stderr
    (tmp_path / "weights.npz").write_bytes(b"x")
    with pytest.raises(UnsupportedCheckpointError):
        open_checkpoint(tmp_path / "weights.npz")


def test_legacy_pickle_is_loaded_weights_only(tmp_path):
    base = random_model(0)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    torch.save(perturb(base, 0.01, 1), tmp_path / "expert.bin")
    engine.fold(bpath, None, tmp_path / "expert.bin", "task_arithmetic", state_dir=tmp_path / "s", out=tmp_path / "o")

    class Evil:
        def __reduce__(self):
            return (shutil.rmtree, (str(tmp_path / "victim"),))

    (tmp_path / "victim").mkdir()
    torch.save({"w": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(CorruptCheckpointError, match="weights_only"):
        open_checkpoint(tmp_path / "evil.pt")
    assert (tmp_path / "victim").exists()


def test_backbone_that_does_not_match_the_state_is_refused(tmp_path):
    base = random_model(0)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    e1 = save_tensors(tmp_path / "e1.safetensors", perturb(base, 0.01, 1))
    e2 = save_tensors(tmp_path / "e2.safetensors", perturb(base, 0.01, 2))
    engine.fold(bpath, None, e1, "ties", state_dir=tmp_path / "s", out=tmp_path / "o1")
    with pytest.raises(StateError, match="fold"):  # state has 1 fold, backbone is θ₀
        engine.fold(bpath, None, e2, "ties", state_dir=tmp_path / "s", out=tmp_path / "o2")
    with pytest.raises(StateError, match="already folded"):
        engine.fold(bpath, tmp_path / "o1", e1, "ties", state_dir=tmp_path / "s", out=tmp_path / "o2")
    assert not (tmp_path / "o2").exists()
    from mergestream.errors import PolicyError

    with pytest.raises(PolicyError, match="belongs to policy"):
        engine.fold(bpath, tmp_path / "o1", e2, "task_arithmetic", state_dir=tmp_path / "s", out=tmp_path / "o2")
