"""PEFT LoRA adapters fold as dense deltas scale·B@A, equal to what PEFT's own merge produces."""

from __future__ import annotations

import json

import pytest
import torch

from mergestream import engine
from mergestream.checkpoints import read_state_dict
from mergestream.errors import UnsupportedCheckpointError

from .conftest import check_merge_output, run_cli


def _adapter_and_dense(base_dir, tmp_path, model_cls, lora_kwargs, tag):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    model = model_cls.from_pretrained(base_dir)
    cfg = LoraConfig(init_lora_weights=False, **lora_kwargs)
    peft_model = get_peft_model(model, cfg)
    adapter = tmp_path / f"{tag}-adapter"
    peft_model.save_pretrained(adapter)
    dense = tmp_path / f"{tag}-dense"
    peft_model.merge_and_unload().save_pretrained(dense)
    return adapter, dense


CASES = {
    "llama": ("LlamaForCausalLM", "tiny_llama",
              dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj", "embed_tokens"])),
    "llama_rslora": ("LlamaForCausalLM", "tiny_llama",
                     dict(r=8, lora_alpha=4, use_rslora=True, target_modules=["k_proj", "up_proj"])),
    "llama_patterns": ("LlamaForCausalLM", "tiny_llama",
                       dict(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                            rank_pattern={"o_proj": 2}, alpha_pattern={"o_proj": 32})),
    "bert": ("BertModel", "tiny_bert", dict(r=2, lora_alpha=16, target_modules=["query", "value", "dense"])),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_folding_an_adapter_equals_folding_peft_merged_dense_model(tmp_path, request, case):
    import transformers

    cls_name, fixture, kwargs = CASES[case]
    base = request.getfixturevalue(fixture)
    adapter, dense = _adapter_and_dense(base, tmp_path, getattr(transformers, cls_name), kwargs, case)
    engine.fold(base, None, adapter, "task_arithmetic", {"lambda": 1.0}, state_dir=tmp_path / "s1", out=tmp_path / "a")
    engine.fold(base, None, dense, "task_arithmetic", {"lambda": 1.0}, state_dir=tmp_path / "s2", out=tmp_path / "d")
    got_a = check_merge_output(tmp_path / "a", base)
    got_d = read_state_dict(tmp_path / "d")
    base_sd = read_state_dict(base)
    changed = 0
    for k, v in got_d.items():
        torch.testing.assert_close(got_a[k], v, rtol=1e-5, atol=1e-6, msg=k)
        changed += int(not torch.equal(v, base_sd[k]))
    assert changed > 0


def test_fan_in_fan_out_adapter_on_conv1d_weights(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    base = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=32)).save_pretrained(base)
    adapter, dense = _adapter_and_dense(base, tmp_path, GPT2LMHeadModel,
                                        dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"],
                                             fan_in_fan_out=True), "gpt2")
    assert json.loads((adapter / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    engine.fold(base, None, adapter, "task_arithmetic", {"lambda": 1.0}, state_dir=tmp_path / "s1", out=tmp_path / "a")
    got, want = read_state_dict(tmp_path / "a"), read_state_dict(dense)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_dora_adapter_is_refused_with_a_clear_message(tmp_path, tiny_llama):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = get_peft_model(LlamaForCausalLM.from_pretrained(tiny_llama),
                           LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    model.save_pretrained(tmp_path / "dora")
    with pytest.raises(UnsupportedCheckpointError, match="DoRA"):
        engine.fold(tiny_llama, None, tmp_path / "dora", "ties", state_dir=tmp_path / "s", out=tmp_path / "o")
    proc = run_cli("fold", "--base", tiny_llama, "--expert", tmp_path / "dora", "--policy", "ties",
                   "--state", tmp_path / "s", "--out", tmp_path / "o", check=False)
    assert proc.returncode == 2 and "DoRA" in proc.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("flag,value,word", [("peft_type", "IA3", "IA3"), ("modules_to_save", ["lm_head"], "modules_to_save"),
                                             ("lora_bias", True, "bias")])
def test_other_unrepresentable_adapter_variants_are_refused(tmp_path, tiny_llama, flag, value, word):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = get_peft_model(LlamaForCausalLM.from_pretrained(tiny_llama), LoraConfig(r=2, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path / "ad")
    cfg_path = tmp_path / "ad" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg[flag] = value
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedCheckpointError, match=word):
        engine.fold(tiny_llama, None, tmp_path / "ad", "ties", state_dir=tmp_path / "s", out=tmp_path / "o")
