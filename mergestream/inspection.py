"""Read-only views of checkpoints for ``mergestream inspect``: sizes, dtypes, task-vector geometry."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .checkpoints import default_expert_id, is_float_dtype, open_checkpoint, validate_against_base
from .errors import MergestreamError
from .expert_readers import open_expert


def resolve_device(device: str | torch.device) -> torch.device:
    """Validate a math device (``cpu``, ``cuda``, ``cuda:1``); raises MergestreamError if unusable."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MergestreamError(f"device {device!r} requested but CUDA is not available")
    return dev


def task_vector_stats(base: str | os.PathLike, experts: list[str | os.PathLike],
                      device: str = "cpu") -> dict[str, Any]:
    """One streaming pass of sums: ‖τᵢ‖ and the pairwise cosines cos(τᵢ, τⱼ) over the whole model.

    Returns:
        ``{"ids": [...], "norms": [K floats], "cosine": K×K nested list}``.

    Raises:
        ValidationError subclasses if an expert does not fit θ₀.
    """
    dev = resolve_device(device)
    base_ck = open_checkpoint(base)
    exps = [open_expert(e, base_ck) for e in experts]
    try:
        for e in exps:
            validate_against_base(base_ck, e, check_finite=False)
        k = len(exps)
        gram = torch.zeros(k, k, dtype=torch.float64)
        for m in base_ck.metas():
            if not is_float_dtype(m.dtype):
                continue
            b = base_ck.get(m.name).to(dev, torch.float32)
            taus = torch.stack([e.task_vector(m.name, b).to(dev).reshape(-1) for e in exps]).double()
            gram += (taus @ taus.T).cpu()
        norms = gram.diagonal().sqrt()
        denom = torch.outer(norms, norms).clamp_min(1e-300)
        cos = (gram / denom).tolist()
        return {"ids": [default_expert_id(e) for e in experts], "norms": norms.tolist(), "cosine": cos}
    finally:
        for e in exps:
            e.close()


def describe(path: str | os.PathLike) -> dict[str, Any]:
    """Tensor count, dtypes (count and bytes per dtype), total bytes and metadata of a checkpoint."""
    p = Path(path)
    if (p / "adapter_config.json").exists():
        cfg = json.loads((p / "adapter_config.json").read_text())
        ck = open_checkpoint(p / "adapter_model.safetensors")
        kind = "lora"
    else:
        cfg, ck, kind = None, open_checkpoint(p), "dense"
    dtypes: dict[str, dict[str, int]] = {}
    for m in ck.metas():
        d = dtypes.setdefault(str(m.dtype).replace("torch.", ""), {"tensors": 0, "bytes": 0})
        d["tensors"] += 1
        d["bytes"] += m.nbytes
    info = {"path": str(p), "kind": kind, "tensors": len(ck.keys()), "bytes": ck.nbytes, "dtypes": dtypes,
            "files": [f.name for f in ck.weight_files],
            "metadata": {k: v for k, v in ck.metadata().items() if k.startswith("mergestream.")}}
    if cfg is not None:
        info["lora"] = {k: cfg.get(k) for k in ("r", "lora_alpha", "use_rslora", "fan_in_fan_out", "target_modules")}
    ck.close()
    return info
