"""Shared fixtures: tiny random Hugging Face models (BERT and Llama) built once per session,
experts derived from them, and helpers that every merge output must satisfy."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MERGESTREAM = [sys.executable, "-m", "mergestream.cli"]


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    """Write a single safetensors file (contiguous copies, so views are fine)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def perturb(tensors: dict[str, torch.Tensor], scale: float, seed: int) -> dict[str, torch.Tensor]:
    """An 'expert': every float tensor moved by Gaussian noise of std ``scale`` (ints unchanged)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in tensors.items():
        if v.is_floating_point():
            noise = torch.randn(v.shape, generator=g) * scale
            out[k] = (v.float() + noise).to(v.dtype)
        else:
            out[k] = v.clone()
    return out


def random_model(seed: int = 0, dtype: torch.dtype = torch.float32, m: int = 48, n: int = 40) -> dict[str, torch.Tensor]:
    """A small generic state dict: 2-D weights, a bias, a norm, an embedding, position ids."""
    g = torch.Generator().manual_seed(seed)
    t = {
        "embed.word_embeddings.weight": torch.randn(30, n, generator=g),
        "layer.0.attn.weight": torch.randn(m, n, generator=g) * 0.1,
        "layer.0.attn.bias": torch.randn(m, generator=g) * 0.1,
        "layer.0.mlp.weight": torch.randn(n, m, generator=g) * 0.1,
        "layer.0.norm.weight": torch.ones(n),
        "position_ids": torch.arange(16)[None],
    }
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in t.items()}


#: files this process opens while :func:`opened_during` watches (an audit hook: the interpreter's own
#: record of every ``open``, also of ``os.open``; files opened by native code or other processes are not seen)
_OPENED: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


def opened_during(fn) -> list[str]:
    """Run ``fn()`` and return the paths this process opened meanwhile (see :data:`_OPENED`)."""
    global _OPENED
    _OPENED = []
    try:
        fn()
        return list(_OPENED)
    finally:
        _OPENED = None


def stop_process_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process group of ``proc`` (started with ``start_new_session=True``), then SIGKILL
    it after ``grace`` seconds; a group already gone is fine."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=grace)


def run_cli(*args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """Run the real ``mergestream`` CLI in a subprocess."""
    proc = subprocess.run([*MERGESTREAM, *map(str, args)], capture_output=True, text=True, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"mergestream {' '.join(map(str, args))} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def load_dir(path: Path) -> dict[str, torch.Tensor]:
    from mergestream.io.checkpoints import read_state_dict

    return read_state_dict(path)


def check_merge_output(out: Path, base: Path | None = None) -> dict[str, torch.Tensor]:
    """What every merge output must satisfy: weights readable (index + shards when sharded),
    every base tensor present with the base's shape and dtype, no NaN/Inf, config copied."""
    assert out.is_dir(), f"{out} missing"
    index = out / "model.safetensors.index.json"
    if index.exists():
        wm = json.loads(index.read_text())["weight_map"]
        for shard in set(wm.values()):
            assert (out / shard).is_file()
    else:
        assert (out / "model.safetensors").is_file()
    assert not list(out.parent.glob(f".{out.name}.staging-*")), "staging folder left behind"
    got = load_dir(out)
    if base is not None:
        ref = load_dir(base)
        assert set(got) == set(ref)
        for k, v in ref.items():
            assert got[k].shape == v.shape and got[k].dtype == v.dtype, k
        if base.is_dir() and (base / "config.json").exists():
            assert (out / "config.json").read_text() == (base / "config.json").read_text()
    for k, v in got.items():
        if v.is_floating_point():
            assert torch.isfinite(v).all(), k
    return got


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> Path:
    """A tiny random BertModel (hidden 32, 2 layers) saved as a Hugging Face folder."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("bert") / "base"
    BertModel(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A tiny random LlamaForCausalLM (hidden 32, 2 layers) with the LM head tied to the embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("llama") / "base"
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def make_hf_expert(base: Path, dest: Path, seed: int, scale: float = 0.02) -> Path:
    """Copy a HF folder and perturb its float tensors (a fine-tuned 'expert')."""
    import shutil

    shutil.copytree(base, dest)
    for f in dest.glob("*.safetensors"):
        from safetensors import safe_open

        with safe_open(str(f), "pt") as h:
            meta = h.metadata()
            tensors = {k: h.get_tensor(k) for k in h.keys()}
        save_tensors(f, perturb(tensors, scale, seed), meta)
    return dest
