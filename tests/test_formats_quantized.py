"""Quantized checkpoints (fp8 e4m3/e5m2 with or without per-tensor scales, scale-only int8, packed
GPTQ weights, fp8 legacy pickles) are refused from their headers on every path that merges: fold,
offline merge, a LoRA fold into a quantized base, inspect --base. One line, exit 2, nothing written;
no stored code is merged and no scale is ever averaged as a weight."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from mergestream import engine
from mergestream.errors import QuantizedCheckpointError, UnsupportedCheckpointError
from mergestream.io.checkpoints import open_checkpoint

from .conftest import perturb, random_model, run_cli, save_tensors

WEIGHTS = ("layer.0.attn.weight", "layer.0.mlp.weight")
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SCALES = ["none", "weight_scale", "weight_scale_inv", "input_scale"]


def _quantize(sd: dict[str, torch.Tensor], dtype: torch.dtype | None, scales: str) -> dict[str, torch.Tensor]:
    """fp8 (``dtype``) or int8 (``dtype`` None) codes of the 2-D weights, with the named scales."""
    out = dict(sd)
    for name in WEIGHTS:
        w = sd[name]
        s = w.abs().amax(1, keepdim=True) / (448.0 if dtype is not None else 127.0)
        out[name] = (w / s).to(dtype) if dtype is not None else (w / s).round().to(torch.int8)
        stem = name.rsplit(".", 1)[0]
        if scales == "weight_scale":
            out[f"{stem}.weight_scale"] = s
        elif scales == "weight_scale_inv":
            out[f"{stem}.weight_scale_inv"] = 1 / s
        elif scales == "input_scale":
            out[f"{stem}.input_scale"] = torch.tensor(0.02)
    return out


def _adapter(folder):
    folder.mkdir()
    g = torch.Generator().manual_seed(3)
    save_file({"base_model.model.layer.0.attn.lora_A.weight": torch.randn(2, 40, generator=g),
               "base_model.model.layer.0.attn.lora_B.weight": torch.randn(48, 2, generator=g)},
              str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2,
                                                            "target_modules": ["attn"]}))
    return folder


def _refused_everywhere(tmp_path, base, experts, words):
    """fold, merge, LoRA fold and inspect --base all raise QuantizedCheckpointError; nothing written."""
    ad = _adapter(tmp_path / "lora")
    calls = {
        "fold": lambda: engine.fold(base, None, experts[0], "task_arithmetic", state_dir=tmp_path / "s",
                                    out=tmp_path / "o"),
        "merge": lambda: engine.merge(base, experts, "ties", out=tmp_path / "o"),
        "lora": lambda: engine.fold(base, None, ad, "task_arithmetic", state_dir=tmp_path / "s", out=tmp_path / "o"),
        "inspect": lambda: engine.task_vector_stats(base, experts),
    }
    for what, call in calls.items():
        with pytest.raises(QuantizedCheckpointError) as info:
            call()
        msg = str(info.value)
        assert "unsupported quantized checkpoint" in msg, what
        for w in words:
            assert w in msg, (what, w, msg)
        assert not (tmp_path / "o").exists() and not (tmp_path / "s").exists(), what


@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_fp8_base_and_experts_are_refused_on_every_path(tmp_path, dtype, scales):
    sd = random_model(0)
    base = save_tensors(tmp_path / "base.safetensors", _quantize(sd, dtype, scales))
    experts = [save_tensors(tmp_path / f"e{i}.safetensors", _quantize(perturb(sd, 0.01, i), dtype, scales))
               for i in (1, 2)]
    _refused_everywhere(tmp_path, base, experts, [str(base), str(dtype).replace("torch.", ""), "fp8"])


@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2", "int8_weight_scale", "fp8_legacy_bin"])
def test_a_quantized_expert_for_an_unquantized_base_is_refused(tmp_path, kind):
    sd = random_model(0)
    base = save_tensors(tmp_path / "base.safetensors", sd)
    dtype = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8_weight_scale": None,
             "fp8_legacy_bin": torch.float8_e4m3fn}[kind]
    q = _quantize(perturb(sd, 0.01, 1), dtype, "weight_scale")
    if kind == "fp8_legacy_bin":
        torch.save(q, tmp_path / "e.bin")
        expert = tmp_path / "e.bin"
    else:
        expert = save_tensors(tmp_path / "e.safetensors", q)
    words = [str(expert), "weight_scale" if dtype is None else "fp8"]
    for call in (lambda: engine.fold(base, None, expert, "task_arithmetic", state_dir=tmp_path / "s", out=tmp_path / "o"),
                 lambda: engine.merge(base, [expert], "task_arithmetic", out=tmp_path / "o"),
                 lambda: engine.task_vector_stats(base, [expert])):
        with pytest.raises(QuantizedCheckpointError) as info:
            call()
        assert all(w in str(info.value) for w in words), str(info.value)
        assert not (tmp_path / "o").exists() and not (tmp_path / "s").exists()


@pytest.mark.parametrize("names", [("qweight", "qzeros", "scales", "g_idx"), ("weight.absmax", "weight.quant_map"),
                                   ("weight.SCB",)])
def test_packed_quantized_layers_are_refused(tmp_path, names):
    sd = random_model(0)
    base = save_tensors(tmp_path / "base.safetensors", sd)
    q = {k: v for k, v in perturb(sd, 0.01, 1).items() if k != "layer.0.attn.weight"}
    for n in names:
        q[f"layer.0.attn.{n}"] = torch.zeros(4, dtype=torch.int32)
    expert = save_tensors(tmp_path / "e.safetensors", q)
    with pytest.raises(QuantizedCheckpointError, match="quantized weight"):
        engine.fold(base, None, expert, "ties", state_dir=tmp_path / "s", out=tmp_path / "o")


def test_an_fp8_lora_adapter_is_refused(tmp_path):
    sd = random_model(0)
    base = save_tensors(tmp_path / "base.safetensors", sd)
    ad = _adapter(tmp_path / "lora")
    from safetensors.torch import load_file

    t = {k: v.to(torch.float8_e4m3fn) for k, v in load_file(ad / "adapter_model.safetensors").items()}
    save_file(t, str(ad / "adapter_model.safetensors"))
    with pytest.raises(QuantizedCheckpointError, match="LoRA adapter"):
        engine.fold(base, None, ad, "task_arithmetic", state_dir=tmp_path / "s", out=tmp_path / "o")


def test_a_quantized_safetensors_code_torch_cannot_hold_is_refused_at_open(tmp_path):
    header = json.dumps({"w": {"dtype": "F8_E8M0", "shape": [4], "data_offsets": [0, 4]}}).encode()
    path = tmp_path / "mx.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x7f" * 4)
    with pytest.raises(QuantizedCheckpointError, match="F8_E8M0"):
        open_checkpoint(path)
    assert issubclass(QuantizedCheckpointError, UnsupportedCheckpointError)


def test_cli_refuses_with_one_line_and_describes_without_base(tmp_path):
    sd = random_model(0)
    base = save_tensors(tmp_path / "base.safetensors", _quantize(sd, torch.float8_e4m3fn, "weight_scale"))
    expert = save_tensors(tmp_path / "e.safetensors", _quantize(perturb(sd, 0.01, 1), torch.float8_e4m3fn,
                                                                "weight_scale"))
    ad = _adapter(tmp_path / "lora")
    for args in (["fold", "--base", base, "--expert", expert, "--policy", "ties", "--state", tmp_path / "s",
                  "--out", tmp_path / "o"],
                 ["fold", "--base", base, "--expert", ad, "--policy", "task_arithmetic", "--state", tmp_path / "s",
                  "--out", tmp_path / "o"],
                 ["merge", "--base", base, "--policy", "task_arithmetic", "--out", tmp_path / "o", expert],
                 ["inspect", "--base", base, expert]):
        proc = run_cli(*args, check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (args[0], proc.stderr)
        assert "QuantizedCheckpointError" in lines[0] and "unsupported quantized checkpoint" in lines[0]
        assert not (tmp_path / "o").exists() and not (tmp_path / "s").exists()
    # describing a quantized checkpoint (no merge) still works
    info = json.loads(run_cli("inspect", base, "--json").stdout)
    assert "float8_e4m3fn" in info["checkpoints"][0]["dtypes"]
