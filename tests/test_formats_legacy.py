"""Legacy pickles (.bin/.pt/.pth/.ckpt): training-checkpoint containers and wrapper prefixes are
unwrapped (and said so), never guessed; tensors are read positionally into fresh memory; experts
that carry known recomputed buffers (rotary inv_freq, position ids) the base lacks have them
dropped, while any other extra tensor is still refused."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file

from mergestream import engine
from mergestream.errors import (
    ExtraKeyError,
    MissingKeyError,
    UnsupportedCheckpointError,
)
from mergestream.io.checkpoints import LEGACY_SUFFIXES, default_expert_id, open_checkpoint, read_state_dict
from mergestream.io.expert_readers import content_sha256
from mergestream.io.input_formats import RECOMPUTED_BUFFERS, recomputed_buffer

from .conftest import perturb, random_model, run_cli, save_tensors


def _lightning(sd: dict[str, torch.Tensor]) -> dict:
    """What a Lightning ``.ckpt`` holds when the LightningModule keeps the network in ``self.model``."""
    first = next(iter(sd.values()))
    return {"epoch": 3, "global_step": 120, "pytorch-lightning_version": "2.4.0",
            "state_dict": {f"model.{k}": v for k, v in sd.items()},
            "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 3}}}},
            "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": torch.tensor(0.5),
                                                               "best_model_path": "/x/last.ckpt"}},
            "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros_like(first)}},
                                  "param_groups": [{"lr": 1e-3, "params": [0]}]}],
            "lr_schedulers": []}


#: container -> (wrap(state dict) -> object to torch.save, words the log names)
CONTAINERS = {
    "flat": (lambda sd: sd, None),
    "state_dict": (lambda sd: {"state_dict": sd, "epoch": 2}, "['state_dict']"),
    "model": (lambda sd: {"model": sd, "optimizer": {"state": {}, "param_groups": []}, "epoch": 5}, "['model']"),
    "model_state_dict": (lambda sd: {"model_state_dict": sd, "optimizer_state_dict": {"state": {}}},
                         "['model_state_dict']"),
    "module": (lambda sd: {"module": sd, "global_steps": 7}, "['module']"),
    "nested": (lambda sd: {"model": {"state_dict": sd}}, "['model']['state_dict']"),
    "dataparallel": (lambda sd: {f"module.{k}": v for k, v in sd.items()}, "'module.'"),
    "compiled": (lambda sd: {"state_dict": {f"_orig_mod.{k}": v for k, v in sd.items()}}, "'_orig_mod.'"),
    "lightning": (_lightning, "'model.'"),
    "dataparallel_in_lightning": (lambda sd: _lightning({f"module.{k}": v for k, v in sd.items()}), "'model.module.'"),
}


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".ckpt"])
@pytest.mark.parametrize("container", sorted(CONTAINERS))
def test_every_common_container_folds_like_the_plain_expert(tmp_path, caplog, container, suffix):
    base = random_model(0)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    sd = perturb(base, 0.01, 1)
    wrap, words = CONTAINERS[container]
    epath = tmp_path / f"expert{suffix}"
    torch.save(wrap(sd), epath)
    with caplog.at_level(logging.INFO, logger="mergestream"):
        rep = engine.fold(bpath, None, epath, "task_arithmetic", {"lambda": 1.0}, state_dir=tmp_path / "s",
                          out=tmp_path / "o")
    got = read_state_dict(tmp_path / "o")
    assert set(got) == set(base)
    for k, v in sd.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-6, msg=k)
    if words:  # which container / prefix was used is said
        assert any(words in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert rep.sha256 == [content_sha256(epath)]  # a pickle's hash is its file's


def test_merge_and_inspect_read_containers_too(tmp_path):
    base = random_model(0)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    e1, e2 = perturb(base, 0.01, 1), perturb(base, 0.01, 2)
    torch.save(_lightning(e1), tmp_path / "e1.ckpt")
    torch.save({f"module.{k}": v for k, v in e2.items()}, tmp_path / "e2.pth")
    engine.merge(bpath, [tmp_path / "e1.ckpt", tmp_path / "e2.pth"], "task_arithmetic", {"lambda": 1.0},
                 out=tmp_path / "m")
    got = read_state_dict(tmp_path / "m")
    name = "layer.0.attn.weight"
    torch.testing.assert_close(got[name], e1[name] + e2[name] - base[name], rtol=0, atol=1e-6)
    stats = engine.task_vector_stats(bpath, [tmp_path / "e1.ckpt", tmp_path / "e2.pth"])
    want = float(torch.linalg.vector_norm(torch.cat([(e1[k] - base[k]).reshape(-1) for k in base
                                                     if base[k].is_floating_point()])))
    assert stats["norms"][0] == pytest.approx(want, rel=1e-5)


def test_ckpt_is_a_legacy_format_everywhere(tmp_path):
    from mergestream.daemon.sources.readiness import expert_complete

    assert ".ckpt" in LEGACY_SUFFIXES and default_expert_id(tmp_path / "run-7.ckpt") == "run-7"
    base = random_model(0)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    torch.save(_lightning(perturb(base, 0.01, 1)), tmp_path / "run-7.ckpt")
    assert expert_complete(tmp_path / "run-7.ckpt")  # an inbox .ckpt is folded, not ignored
    run_cli("fold", "--base", bpath, "--expert", tmp_path / "run-7.ckpt", "--policy", "ties", "--state",
            tmp_path / "s", "--out", tmp_path / "o")
    assert (tmp_path / "o" / "model.safetensors").exists()
    info = run_cli("inspect", tmp_path / "run-7.ckpt").stdout
    assert "6 tensors" in info


def test_a_base_in_a_container_keeps_its_names(tmp_path):
    """Without a reference nothing is stripped: a Lightning base and expert fold with their names."""
    base = random_model(0)
    torch.save(_lightning(base), tmp_path / "base.ckpt")
    sd = perturb(base, 0.01, 1)
    torch.save(_lightning(sd), tmp_path / "e.ckpt")
    engine.fold(tmp_path / "base.ckpt", None, tmp_path / "e.ckpt", "task_arithmetic", {"lambda": 1.0},
                state_dir=tmp_path / "s", out=tmp_path / "o")
    got = read_state_dict(tmp_path / "o")
    assert set(got) == {f"model.{k}" for k in base}
    torch.testing.assert_close(got["model.layer.0.mlp.weight"], sd["layer.0.mlp.weight"], rtol=0, atol=1e-6)


def _refusal(tmp_path, obj, err, words):
    base = random_model(0)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    torch.save(obj, tmp_path / "e.bin")
    with pytest.raises(err) as info:
        engine.fold(bpath, None, tmp_path / "e.bin", "task_arithmetic", state_dir=tmp_path / "s", out=tmp_path / "o")
    for w in words:
        assert w in str(info.value)
    proc = run_cli("fold", "--base", bpath, "--expert", tmp_path / "e.bin", "--policy", "ties", "--state",
                   tmp_path / "s", "--out", tmp_path / "o", check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and err.__name__ in proc.stderr
    assert not (tmp_path / "o").exists() and not (tmp_path / "s" / "manifest.json").exists()


def test_two_state_dicts_in_one_file_are_not_guessed(tmp_path):
    sd = perturb(random_model(0), 0.01, 1)
    _refusal(tmp_path, {"state_dict": sd, "model": dict(sd)}, UnsupportedCheckpointError,
             ["several state dicts", "'state_dict'", "'model'"])


def test_a_non_tensor_among_tensors_is_refused(tmp_path):
    sd = perturb(random_model(0), 0.01, 1)
    _refusal(tmp_path, {**sd, "epoch": 3}, UnsupportedCheckpointError, ["'epoch'", "int"])


def test_a_prefix_on_only_some_keys_is_not_stripped(tmp_path):
    sd = perturb(random_model(0), 0.01, 1)
    obj = {(f"module.{k}" if "layer" in k else k): v for k, v in sd.items()}
    _refusal(tmp_path, obj, MissingKeyError, ["layer.0"])


def test_a_stripped_prefix_must_still_match_the_base(tmp_path):
    sd = perturb(random_model(0), 0.01, 1)
    del sd["layer.0.mlp.weight"]
    _refusal(tmp_path, {f"module.{k}": v for k, v in sd.items()}, MissingKeyError,
             ["layer.0.mlp.weight", "prefix 'module.' stripped"])  # the one line says what was read


def test_legacy_reads_are_fresh_positional_copies_of_every_layout(tmp_path):
    g = torch.Generator().manual_seed(0)
    big = torch.randn(64, 48, generator=g)
    sd = {"big": big, "view": big[8:16], "transposed": torch.randn(40, 24, generator=g).T,
          "bf16": torch.randn(33, generator=g).to(torch.bfloat16), "half": torch.randn(5, 7, generator=g).half(),
          "ints": torch.arange(17), "flags": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5),
          "count": torch.tensor(7), "empty": torch.zeros(0, 4)}
    torch.save(sd, tmp_path / "m.pt")
    with open_checkpoint(tmp_path / "m.pt") as ck:
        assert set(ck._legacy_at) == set(sd) - {"empty"}  # located in the file: read with pread
        for k, v in sd.items():
            got = ck.get(k)
            assert got.dtype == v.dtype and got.shape == v.shape and got.is_contiguous()
            assert torch.equal(got, v), k
            if got.numel():
                got.view(-1)[0] = 1  # callers compute in place in what they get
                assert torch.equal(ck.get(k), v), k
        buf = torch.empty(100, dtype=torch.uint8)
        flat = big.reshape(-1).view(torch.uint8)
        assert torch.equal(ck.read_into("big", buf, 1000), flat[1000:1100])
        assert torch.equal(ck.read_into("transposed", buf, 40), sd["transposed"].contiguous().view(-1)
                           .view(torch.uint8)[40:140])
        with pytest.raises(ValueError):
            ck.read_into("count", buf)


def test_an_old_style_pickle_still_loads(tmp_path, caplog):
    sd = random_model(0)
    torch.save(sd, tmp_path / "old.bin", _use_new_zipfile_serialization=False)
    with caplog.at_level(logging.WARNING, logger="mergestream"), open_checkpoint(tmp_path / "old.bin") as ck:
        for k, v in sd.items():
            assert torch.equal(ck.get(k), v)
    assert any("old-style pickle" in r.getMessage() for r in caplog.records)


# -- B05: recomputed buffers --------------------------------------------------------------------------
ROPE = "model.layers.{}.self_attn.rotary_emb.inv_freq"


def _with_buffers(src: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    out = dict(src)
    for n in names:
        out[n] = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    return out


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_rotary_inv_freq_is_dropped_logged_and_hashed(tmp_path, tiny_llama, caplog, fmt):
    base = load_file(tiny_llama / "model.safetensors")
    assert not any("inv_freq" in k for k in base)
    sd = perturb(base, 0.01, 1)
    # before the first name, between names and after the last one in canonical order
    extra = ["lm_head.rotary_emb.inv_freq", ROPE.format(0), ROPE.format(1), "zz.rotary_emb.inv_freq"]
    plain = save_tensors(tmp_path / "plain" / "model.safetensors", sd)
    if fmt == "safetensors":
        epath = save_tensors(tmp_path / "old" / "model.safetensors", _with_buffers(sd, extra)).parent
    else:
        epath = tmp_path / "old.bin"
        torch.save(_with_buffers(sd, extra), epath)
    with caplog.at_level(logging.WARNING, logger="mergestream"):
        rep = engine.fold(tiny_llama, None, epath, "ties", state_dir=tmp_path / "s", out=tmp_path / "o")
    engine.fold(tiny_llama, None, plain.parent, "ties", state_dir=tmp_path / "s2", out=tmp_path / "o2")
    got, want = load_file(tmp_path / "o" / "model.safetensors"), load_file(tmp_path / "o2" / "model.safetensors")
    assert set(got) == set(want) and not any("inv_freq" in k for k in got)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert rep.sha256 == [content_sha256(epath)]  # the content hash covers every tensor, the dropped ones too
    warned = [r.getMessage() for r in caplog.records if "recomputed buffer" in r.getMessage()]
    assert len(warned) == 1 and all(n in warned[0] for n in extra)
    # offline merge and inspect take the same expert
    engine.merge(tiny_llama, [epath, plain.parent], "task_arithmetic", {"lambda": 0.5}, out=tmp_path / "m")
    assert not any("inv_freq" in k for k in load_file(tmp_path / "m" / "model.safetensors"))
    stats = engine.task_vector_stats(tiny_llama, [epath, plain.parent])
    assert stats["norms"][0] == pytest.approx(stats["norms"][1], rel=1e-6)


def test_bert_position_ids_are_dropped_when_the_base_lacks_them(tmp_path, tiny_bert):
    base = load_file(tiny_bert / "model.safetensors")
    assert "embeddings.position_ids" not in base
    sd = perturb(base, 0.01, 1)
    sd["embeddings.position_ids"] = torch.arange(64)[None]
    epath = save_tensors(tmp_path / "e" / "model.safetensors", sd).parent
    run_cli("fold", "--base", tiny_bert, "--expert", epath, "--policy", "task_arithmetic", "--state",
            tmp_path / "s", "--out", tmp_path / "o")
    assert set(load_file(tmp_path / "o" / "model.safetensors")) == set(base)


@pytest.mark.parametrize("name,tensor", [
    ("layer.0.unknown_buffer", torch.zeros(4)),
    ("layer.0.rotary_emb.inv_freq", torch.zeros(4, 4)),  # not the shape of a frequency vector
    ("h.0.attn.bias", torch.zeros(40)),  # a real bias, not GPT-2's 4-D causal mask
    ("embeddings.position_ids", torch.zeros(1, 16)),  # float: not ids
])
def test_other_extra_tensors_are_still_refused(tmp_path, name, tensor):
    base = random_model(0)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    epath = save_tensors(tmp_path / "e.safetensors", {**perturb(base, 0.01, 1), name: tensor})
    with pytest.raises(ExtraKeyError, match=name.replace(".", r"\.")):
        engine.fold(bpath, None, epath, "task_arithmetic", state_dir=tmp_path / "s", out=tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_the_documented_buffer_list_is_what_is_dropped():
    assert len(RECOMPUTED_BUFFERS) >= 5
    assert recomputed_buffer(ROPE.format(3), (64,), torch.float32)
    assert recomputed_buffer("gpt_neox.layers.0.attention.rotary_emb.cos_cached", (1, 1, 64, 16), torch.float16)
    assert recomputed_buffer("transformer.h.0.attn.bias", (1, 1, 1024, 1024), torch.bool)
    assert recomputed_buffer("transformer.h.0.attn.masked_bias", (), torch.float32)
    assert recomputed_buffer("text_model.embeddings.position_ids", (1, 77), torch.int64)
    assert not recomputed_buffer("model.layers.0.self_attn.q_proj.weight", (8, 8), torch.float32)
