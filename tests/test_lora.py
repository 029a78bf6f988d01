"""PEFT LoRA adapters fold as dense deltas scale·B@A, equal to what PEFT's own merge produces."""

from __future__ import annotations

import json

import pytest
import torch

from mergestream import engine
from mergestream.errors import UnsupportedCheckpointError
from mergestream.io.checkpoints import read_state_dict

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


# -- N1: adapters whose initialisation rewrote the base ------------------------------------------------
def _toy_base(tmp_path):
    """A tiny torch module with two attention layers (q/v projections) and its safetensors base."""
    from safetensors.torch import save_file
    from torch import nn

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(16, 16, bias=False)
            self.v_proj = nn.Linear(16, 16, bias=False)

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.ModuleDict({"self_attn": Attn()}) for _ in range(2)])

    torch.manual_seed(0)
    model = Toy()
    path = tmp_path / "toy.safetensors"
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(path))
    return model, path


def _train_lora_b(peft_model, scale=0.01):
    """A stand-in for training: move every lora_B."""
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.add_(scale * torch.randn_like(p))


def _set_init(adapter, value):
    cfg_path = adapter / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["init_lora_weights"] = value
    cfg_path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_2", "olora", "corda", "loftq", "lora_ga", "mica", "new_init"])
def test_adapters_trained_on_a_rewritten_base_are_refused_on_every_path(tmp_path, init):
    import copy

    from peft import LoraConfig, get_peft_model

    from mergestream.errors import ModifiedBaseAdapterError

    model, base = _toy_base(tmp_path)
    real = init in ("pissa", "pissa_niter_2", "olora")  # built by PEFT; the others by their config
    pm = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                                         init_lora_weights=init if real else True))
    _train_lora_b(pm)
    adapter = tmp_path / "ad"
    pm.save_pretrained(adapter)
    if not real:
        _set_init(adapter, init)
    assert json.loads((adapter / "adapter_config.json").read_text())["init_lora_weights"] == init
    for call in (lambda: engine.fold(base, None, adapter, "task_arithmetic", state_dir=tmp_path / "s", out=tmp_path / "o"),
                 lambda: engine.merge(base, [adapter], "task_arithmetic", out=tmp_path / "o"),
                 lambda: engine.task_vector_stats(base, [adapter])):
        with pytest.raises(ModifiedBaseAdapterError, match=f"init_lora_weights='{init}'"):
            call()
    proc = run_cli("fold", "--base", base, "--expert", adapter, "--policy", "ties", "--state", tmp_path / "s",
                   "--out", tmp_path / "o", check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and init in lines[0] and "ModifiedBaseAdapterError" in lines[0]
    assert not (tmp_path / "o").exists() and not (tmp_path / "s").exists()


def _assert_folds_to(base, adapter, truth: dict, tmp_path, *, rtol: float, atol: float) -> None:
    """Fold ``adapter`` into ``base`` with λ = 1 and compare every tensor with PEFT's ``truth``."""
    engine.fold(base, None, adapter, "task_arithmetic", {"lambda": 1.0}, state_dir=tmp_path / "s",
                out=tmp_path / "o")
    got = read_state_dict(tmp_path / "o")
    for k, v in truth.items():
        torch.testing.assert_close(got[k], v, rtol=rtol, atol=atol, msg=k)


@pytest.mark.parametrize("init", [True, False, "gaussian", "eva", "orthogonal"])
def test_inits_that_keep_the_base_fold_as_plain_lora(tmp_path, init):
    import copy

    from peft import LoraConfig, get_peft_model

    model, base = _toy_base(tmp_path)
    pm = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                         init_lora_weights=False))
    pm.save_pretrained(tmp_path / "ad")
    _set_init(tmp_path / "ad", init)
    truth = pm.merge_and_unload().state_dict()
    _assert_folds_to(base, tmp_path / "ad", truth, tmp_path, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_a_converted_pissa_or_olora_adapter_folds_to_the_fine_tuned_model(tmp_path, init):
    """PEFT's conversion (path_initial_model_for_weight_conversion) makes a plain LoRA on the original
    base; folding it gives the model PEFT's merge_and_unload builds."""
    import copy

    from peft import LoraConfig, get_peft_model

    model, base = _toy_base(tmp_path)
    pm = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                                         init_lora_weights=init))
    pm.peft_config["default"].init_lora_weights = True  # PEFT's recipe for the initial adapter
    pm.save_pretrained(tmp_path / "initial")
    pm.peft_config["default"].init_lora_weights = init
    _train_lora_b(pm)
    pm.save_pretrained(tmp_path / "converted", path_initial_model_for_weight_conversion=tmp_path / "initial")
    truth = pm.merge_and_unload().state_dict()
    _assert_folds_to(base, tmp_path / "converted", truth, tmp_path, rtol=1e-4, atol=1e-5)


# -- N4: alpha_pattern / rank_pattern keys match modules as PEFT matches them -------------------------
PATTERNS = {
    "alternation": dict(alpha_pattern={"q_proj|v_proj": 32}),
    "two_keys": dict(alpha_pattern={"q_proj": 32, "v_proj": 2}),
    "full_path": dict(alpha_pattern={"layers.0.self_attn.q_proj": 32}),
    "regex_path": dict(alpha_pattern={r"layers\.1\..*": 3}),
    "first_match_wins": dict(alpha_pattern={"q_proj": 32, "layers.0.self_attn.q_proj": 2}),
    "no_partial_name": dict(alpha_pattern={"proj": 32}),  # not a whole trailing name: the default
    "anchored": dict(alpha_pattern={"^layers.1.self_attn.v_proj": 16}),
    "rank_alternation": dict(rank_pattern={"q_proj|v_proj": 2}, alpha_pattern={"v_proj": 6}),
    "rank_by_layer": dict(rank_pattern={r"layers\.0\.self_attn\.(q|v)_proj": 8}, alpha_pattern={"q_proj|v": 12}),
    "rslora": dict(use_rslora=True, rank_pattern={"v_proj": 2}, alpha_pattern={"layers.1.self_attn.q_proj|v_proj": 9}),
}


@pytest.mark.parametrize("case", sorted(PATTERNS))
def test_pattern_keys_match_like_peft_on_fold_merge_and_inspect(tmp_path, case):
    import copy

    from peft import LoraConfig, PeftModel, get_peft_model

    model, base = _toy_base(tmp_path)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                     **PATTERNS[case])
    torch.manual_seed(1)
    get_peft_model(copy.deepcopy(model), cfg).save_pretrained(tmp_path / "ad")
    # PEFT's own reading of the saved folder (it saves the patterns with sorted keys, so the first
    # match is the first in the file, which is what the folder means)
    truth = PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "ad").merge_and_unload().state_dict()
    engine.fold(base, None, tmp_path / "ad", "task_arithmetic", {"lambda": 1.0}, state_dir=tmp_path / "s",
                out=tmp_path / "o")
    engine.merge(base, [tmp_path / "ad"], "task_arithmetic", {"lambda": 1.0}, out=tmp_path / "m")
    base_sd = read_state_dict(base)
    for out in ("o", "m"):
        got = read_state_dict(tmp_path / out)
        for k, v in truth.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=f"{out} {k}")
    norm = engine.task_vector_stats(base, [tmp_path / "ad"])["norms"][0]
    want = float(torch.linalg.vector_norm(torch.cat([(truth[k] - base_sd[k]).reshape(-1) for k in base_sd])))
    assert norm == pytest.approx(want, rel=1e-5)


def test_a_rank_pattern_that_disagrees_with_the_weights_is_refused(tmp_path):
    import copy

    from peft import LoraConfig, get_peft_model

    from mergestream.errors import CorruptCheckpointError

    model, base = _toy_base(tmp_path)
    get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(
        tmp_path / "ad")
    cfg_path = tmp_path / "ad" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rank_pattern"] = {"q_proj|v_proj": 2}
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CorruptCheckpointError, match="rank 4 but its config gives r=2"):
        engine.fold(base, None, tmp_path / "ad", "ties", state_dir=tmp_path / "s", out=tmp_path / "o")
