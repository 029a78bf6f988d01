"""Tensors θ₀ ties (an LM head equal to the embedding) are written as one only while every input
keeps them tied: an expert (dense or LoRA) or a backbone that unties them is folded tensor by
tensor, never silently dropped, and the output says it is untied (B02, the whole class: fold,
later folds, offline merge, subtract-unmerge, LoRA, and loading with transformers)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mergestream import engine
from mergestream.io.checkpoints import read_state_dict

EMB, HEAD, MLP = "model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.weight"


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tied_base(tmp: Path) -> Path:
    emb = torch.randn(64, 16, generator=_g(1)) * 0.02
    folder = tmp / "base"
    folder.mkdir()
    save_file({EMB: emb.clone(), HEAD: emb.clone(), MLP: torch.randn(16, 16, generator=_g(2)) * 0.02},
              folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"tie_word_embeddings": True, "model_type": "llama"}))
    return folder


def _expert(base: Path, dest: Path, seed: int, tied: bool) -> Path:
    t = load_file(base / "model.safetensors")
    for i, k in enumerate(sorted(t)):
        t[k] = t[k] + torch.randn(t[k].shape, generator=_g(seed * 10 + i)) * 0.01
    if tied:
        t[HEAD] = t[EMB].clone()
    dest.mkdir()
    save_file(t, dest / "model.safetensors")
    return dest


def _tie_flag(folder: Path):
    return json.loads((folder / "config.json").read_text()).get("tie_word_embeddings")


def test_untied_expert_folds_its_own_head_and_the_output_says_untied(tmp_path):
    base = _tied_base(tmp_path)
    b = load_file(base / "model.safetensors")
    untied = _expert(base, tmp_path / "untied", 1, tied=False)
    tied = _expert(base, tmp_path / "tied", 2, tied=True)
    # a tied expert into a tied base stays tied (written as one) and the config is unchanged
    engine.fold(base, None, tied, "task_arithmetic", {"lambda": 0.5}, state_dir=tmp_path / "s0", out=tmp_path / "t1")
    out = read_state_dict(tmp_path / "t1")
    assert torch.equal(out[HEAD], out[EMB]) and _tie_flag(tmp_path / "t1") is True
    # the untied expert: each tensor θ₀ + λτ of its own
    engine.fold(base, None, untied, "task_arithmetic", {"lambda": 0.5}, state_dir=tmp_path / "s", out=tmp_path / "v1")
    e = load_file(untied / "model.safetensors")
    out = read_state_dict(tmp_path / "v1")
    for k in (EMB, HEAD, MLP):
        torch.testing.assert_close(out[k], b[k] + 0.5 * (e[k] - b[k]), rtol=0, atol=1e-7)
    assert not torch.equal(out[HEAD], out[EMB]) and _tie_flag(tmp_path / "v1") is False
    # a later tied expert folds into the untied backbone tensor by tensor
    engine.fold(base, tmp_path / "v1", tied, "task_arithmetic", {"lambda": 0.5}, state_dir=tmp_path / "s",
                out=tmp_path / "v2")
    t = load_file(tied / "model.safetensors")
    out2 = read_state_dict(tmp_path / "v2")
    torch.testing.assert_close(out2[HEAD], out[HEAD] + 0.5 * (t[HEAD] - b[HEAD]), rtol=0, atol=1e-7)
    assert _tie_flag(tmp_path / "v2") is False
    # subtract-unmerge of the last fold restores v1 byte for byte, head included
    engine.unmerge(tmp_path / "s", "tied", "subtract", out=tmp_path / "back")
    back = read_state_dict(tmp_path / "back")
    assert all(torch.equal(back[k], out[k]) for k in out)


def test_offline_merge_and_lora_keep_an_untied_head(tmp_path):
    base = _tied_base(tmp_path)
    b = load_file(base / "model.safetensors")
    e1 = _expert(base, tmp_path / "e1", 1, tied=True)
    e2 = _expert(base, tmp_path / "e2", 2, tied=False)
    engine.merge(base, [e1, e2], "task_arithmetic", {"lambda": 1.0}, out=tmp_path / "m")
    m = read_state_dict(tmp_path / "m")
    t1, t2 = load_file(e1 / "model.safetensors"), load_file(e2 / "model.safetensors")
    torch.testing.assert_close(m[HEAD], t1[HEAD] + t2[HEAD] - b[HEAD], rtol=0, atol=1e-6)
    assert _tie_flag(tmp_path / "m") is False
    # a LoRA adapter on the head only (PEFT's layout) unties it; the embedding keeps θ₀'s values
    ad = tmp_path / "lora"
    ad.mkdir()
    (ad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2,
                                                         "target_modules": ["lm_head"]}))
    a, bb = torch.randn(2, 16, generator=_g(7)), torch.randn(64, 2, generator=_g(8))
    save_file({"base_model.model.lm_head.lora_A.weight": a, "base_model.model.lm_head.lora_B.weight": bb},
              ad / "adapter_model.safetensors")
    engine.fold(base, None, ad, "task_arithmetic", {"lambda": 1.0}, state_dir=tmp_path / "sl", out=tmp_path / "l1")
    out = read_state_dict(tmp_path / "l1")
    torch.testing.assert_close(out[HEAD], b[HEAD] + bb @ a, rtol=0, atol=1e-6)
    assert torch.equal(out[EMB], b[EMB]) and _tie_flag(tmp_path / "l1") is False


def test_untied_output_loads_with_transformers_keeping_the_folded_head(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    shutil.copytree(tiny_llama, base)
    t = load_file(base / "model.safetensors")
    assert HEAD not in t  # transformers saves a tied head once; store it explicitly, tied by content
    t[HEAD] = t[EMB].clone()
    save_file(t, base / "model.safetensors", metadata={"format": "pt"})
    expert = _expert(base, tmp_path / "e", 3, tied=False)
    shutil.copy(base / "config.json", expert / "config.json")
    engine.fold(base, None, expert, "task_arithmetic", {"lambda": 1.0}, state_dir=tmp_path / "s", out=tmp_path / "o")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "o")
    want = load_file(expert / "model.safetensors")
    assert torch.equal(model.lm_head.weight.detach(), want[HEAD])
    assert not torch.equal(model.lm_head.weight.detach(), model.model.embed_tokens.weight.detach())
