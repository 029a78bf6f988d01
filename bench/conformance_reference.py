"""Build the conformance fixtures: FusionBench's reference outputs on small deterministic inputs.

Issue 39: a policy named after a paper must reproduce the reference implementation when asked to
(its *reference mode*, :data:`mergestream.policies.REFERENCE_PARAMS`). This script runs FusionBench
0.2.33's own code (the reference of OPCM and DOP, by their authors, and its ports of Iso-C/Iso-CTS,
MagMax, TIES and the continual baselines) on a tiny model and writes, under
``tests/fixtures/conformance/``:

- ``inputs/base.safetensors`` and ``inputs/expert_{i}.safetensors``: θ₀ and four fp32 experts of a
  tiny model (an ``nn.Embedding``, three ``nn.Linear`` with biases, a ``LayerNorm``); experts 0 and 1
  have full-rank task vectors, experts 2 and 3 rank-2 ones on every matrix, and expert 3 ties
  expert 1's magnitude (opposite sign) on some LayerNorm-bias entries (MagMax's tie-break);
- ``inputs-one/``: the same for a model with one ``nn.Linear`` without bias (continual TIES: the
  reference trims over the whole flattened model, which a streaming fold never holds at once; on a
  one-tensor model the whole-model and per-tensor trims are the same selection);
- ``reference/{case}.safetensors``: the reference's final model after folding the experts in file
  order;
- ``cases.json``: per case, the inputs, our policy with its reference-mode parameters, the
  reference class and settings, and the reference output's file.

The tests (tests/test_conformance.py) fold the same inputs with our CLI and compare tensor by
tensor. Rerun (a few minutes; FusionBench needs ``transformers<5``, so it has its own environment)::

    python3 -m venv /work/fbvenv
    /work/fbvenv/bin/pip install fusion-bench==0.2.33 'transformers<5' torch==2.13.0
    /work/fbvenv/bin/python bench/conformance_reference.py --out tests/fixtures/conformance

Where a reference ``run()`` needs a CLIP task pool (FusionBench's continual Task Arithmetic, TIES
and weight averaging under ``method/opcm``), this script calls the reference's own merging
functions in the loop that ``run()`` executes (quoted in each ``_ref_*`` docstring); OPCM, DOP,
Iso-C, Iso-CTS and MagMax run through their algorithm classes' ``run`` on a model pool.
"""

from __future__ import annotations

import argparse
import json
from copy import deepcopy
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

N_EXPERTS = 4
SEED = 39


class Tiny(nn.Module):
    """The fixture model: embedding (10 × 20), fc1 (24 × 20), LayerNorm (24), fc2 (20 × 24), head (6 × 20)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 20)
        self.fc1 = nn.Linear(20, 24)
        self.norm = nn.LayerNorm(24)
        self.fc2 = nn.Linear(24, 20)
        self.head = nn.Linear(20, 6)


class One(nn.Module):
    """One matrix (24 × 20), no bias: the continual-TIES fixture (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(20, 24, bias=False)


def make_inputs(model: nn.Module, seed: int) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """θ₀ and N_EXPERTS experts (module docstring), float32, deterministic in ``seed``."""
    g = torch.Generator().manual_seed(seed)
    base = {k: torch.randn(v.shape, generator=g) * 0.5 for k, v in model.state_dict().items()}
    if "norm.bias" in base:
        base["norm.bias"].zero_()  # exact ties below: τ = θ_e − 0 is stored exactly
    experts = []
    for i in range(N_EXPERTS):
        e = {}
        for k, b in base.items():
            if b.ndim == 2 and i >= 2:  # rank-2 task vector
                tau = torch.randn(b.shape[0], 2, generator=g) @ torch.randn(2, b.shape[1], generator=g) * 0.03
            else:
                tau = torch.randn(b.shape, generator=g) * 0.05
            e[k] = b + tau
        experts.append(e)
    if "norm.bias" in base:  # expert 3 ties expert 1's magnitude with the opposite sign
        experts[3]["norm.bias"][:8] = -experts[1]["norm.bias"][:8]
    return base, experts


def as_model(cls: type[nn.Module], sd: dict[str, torch.Tensor]) -> nn.Module:
    m = cls()
    m.load_state_dict(sd)
    return m


def pool(cls: type[nn.Module], base: dict, experts: list[dict]):
    """A fresh FusionBench model pool (fresh modules: some references merge into the loaded ones)."""
    from fusion_bench import BaseModelPool

    models = {"_pretrained_": as_model(cls, base)}
    models.update({f"expert_{i}": as_model(cls, e) for i, e in enumerate(experts)})
    return BaseModelPool(models)


def sd_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def _ref_task_arithmetic(base, experts, lam):
    """``method/opcm/task_arithmetic.py`` ``run``: merged ← merged + λ (θ_i − θ₀), from θ₀."""
    merged = {k: v.clone() for k, v in base.items()}
    for e in experts:
        for k in merged:
            merged[k] = merged[k] + lam * (e[k] - base[k])
    return merged


def _ref_weight_average(base, experts):
    """``method/opcm/weight_average.py`` ``run``: merged = θ_1, then merged ← (merged·t + θ_{t+1})/(t + 1)."""
    merged = {k: v.clone() for k, v in experts[0].items()}
    for t, e in enumerate(experts[1:], start=1):
        for k in merged:
            merged[k] = (merged[k] * t + e[k]) / (t + 1)
    return merged


def _ref_ties(base, experts, lam, threshold, merge_func):
    """``method/opcm/ties_merging.py`` ``run``: the first fold adds λ τ₁ (untrimmed); later folds add
    λ · ties_merging([flat(merged − θ₀), flat(τ)], threshold, merge_func) to the merged model."""
    from fusion_bench.method.ties_merging.ties_merging_utils import (
        state_dict_to_vector,
        ties_merging,
        vector_to_state_dict,
    )

    merged = {k: v.clone() for k, v in base.items()}
    for idx, e in enumerate(experts):
        tv = {k: e[k] - base[k] for k in base}
        if idx == 0:
            upd = tv
        else:
            mtv = {k: merged[k] - base[k] for k in base}
            flat = torch.vstack([state_dict_to_vector(mtv), state_dict_to_vector(tv)])
            upd = vector_to_state_dict(ties_merging(flat, reset_thresh=threshold, merge_func=merge_func), merged)
        merged = {k: merged[k] + lam * upd[k] for k in merged}
    return merged


def run_case(case: dict, base, experts, cls) -> dict[str, torch.Tensor]:
    """The reference's final model for one case of :func:`cases`."""
    ref, s = case["reference"]["name"], case["reference"]["settings"]
    if ref == "opcm_task_arithmetic":
        return _ref_task_arithmetic(base, experts, s["scaling_factor"])
    if ref == "opcm_weight_average":
        return _ref_weight_average(base, experts)
    if ref == "opcm_ties_merging":
        return _ref_ties(base, experts, s["scaling_factor"], s["threshold"], s["merge_func"])
    p = pool(cls, base, experts)
    if ref == "magmax":
        from fusion_bench.method.magmax.magmax import MagMaxAlgorithm
        algo = MagMaxAlgorithm(**s)
    elif ref == "iso_c":
        from fusion_bench.method.isotropic_merging.iso import ISO_C_Merge
        algo = ISO_C_Merge(**s)
    elif ref == "iso_cts":
        from fusion_bench.method.isotropic_merging.iso import ISO_CTS_Merge
        algo = ISO_CTS_Merge(**s)
    elif ref == "opcm":
        from fusion_bench.method.opcm.opcm_general import OPCM
        algo = OPCM(shuffle_order=False, save_on_every_step=False, **s)
    elif ref == "dop":
        from fusion_bench.method.dop.dop_general import DOPMerging
        algo = DOPMerging(shuffle_order=False, save_on_every_step=False, **s)
    else:
        raise SystemExit(f"unknown reference {ref!r}")
    torch.manual_seed(0)
    return sd_of(algo.run(p))


def cases() -> dict[str, dict]:
    """Every conformance case: our policy and reference-mode parameters, the reference and its settings."""
    dop = dict(lr=1e-4, num_steps=200, alpha=0.8, ema_beta=0.999, svd_epsilon=0.99999, svd_proj_space="uv")
    ours_dop = {"alpha": 0.8, "epsilon": 0.99999, "solver": "adam", "steps": 200, "lr": 1e-4, "ema_beta": 0.999,
                "rank": "below", "space": "uv"}
    return {
        "task_arithmetic": {"policy": "task_arithmetic", "params": {"lambda": 0.3},
                            "reference": {"name": "opcm_task_arithmetic", "settings": {"scaling_factor": 0.3}}},
        "weight_average": {"policy": "weight_average", "params": {},
                           "reference": {"name": "opcm_weight_average", "settings": {}}},
        "magmax": {"policy": "magmax", "params": {"lambda": 0.5, "tie": "last"},
                   "reference": {"name": "magmax", "settings": {"scaling_factor": 0.5}}},
        "ties": {"policy": "ties", "inputs": "inputs-one",
                 "params": {"lambda": 0.5, "k": 20, "continual": "accumulate", "disjoint": "sum", "trim": "plus_one"},
                 "reference": {"name": "opcm_ties_merging",
                               "settings": {"scaling_factor": 0.5, "threshold": 20, "merge_func": "sum"}}},
        "iso_c": {"policy": "iso_c", "params": {"alpha": 1.5, "rank": "full", "others": "mean", "embeddings": "isotropic"},
                  "reference": {"name": "iso_c", "settings": {"scaling_factor": 1.5}}},
        "iso_cts": {"policy": "iso_cts", "params": {"alpha": 1.0, "common_fraction": 0.8},
                    "reference": {"name": "iso_cts", "settings": {"scaling_factor": 1.0, "common_space_fraction": 0.8}}},
        "opcm": {"policy": "opcm", "params": {"alpha": 0.5, "scope": "global", "zero_diagonal": True, "rank": "above",
                                              "project": "linear"},
                 "reference": {"name": "opcm", "settings": {"alpha": 0.5}}},
        "dop": {"policy": "dop", "params": {**ours_dop, "mgda": True, "ema": True},
                "reference": {"name": "dop", "settings": {**dop, "mgda": True, "ema": True}}},
        "dop_no_ema": {"policy": "dop", "params": {**ours_dop, "mgda": True, "ema": False},
                       "reference": {"name": "dop", "settings": {**dop, "mgda": True, "ema": False}}},
        "dop_no_mgda": {"policy": "dop", "params": {**ours_dop, "mgda": False},
                        "reference": {"name": "dop", "settings": {**dop, "mgda": False, "ema": False}}},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="tests/fixtures/conformance", help="fixture folder")
    ap.add_argument("--only", help="comma-separated case names (default: all)")
    args = ap.parse_args()
    import fusion_bench

    out = Path(args.out)
    models = {"inputs": Tiny, "inputs-one": One}
    for folder, cls in models.items():
        base, experts = make_inputs(cls(), SEED)
        (out / folder).mkdir(parents=True, exist_ok=True)
        save_file(base, out / folder / "base.safetensors")
        for i, e in enumerate(experts):
            save_file({k: v.contiguous() for k, v in e.items()}, out / folder / f"expert_{i}.safetensors")
    (out / "reference").mkdir(exist_ok=True)
    doc = {"fusion_bench": fusion_bench.__version__ if hasattr(fusion_bench, "__version__") else "0.2.33",
           "torch": torch.__version__, "seed": SEED, "order": [f"expert_{i}" for i in range(N_EXPERTS)],
           "tolerance": 1e-5, "cases": {}}
    only = set(args.only.split(",")) if args.only else None
    for name, case in cases().items():
        if only and name not in only:
            continue
        folder = case.get("inputs", "inputs")
        base = load_file(out / folder / "base.safetensors")
        experts = [load_file(out / folder / f"expert_{i}.safetensors") for i in range(N_EXPERTS)]
        res = run_case(case, base, experts, models[folder])
        save_file({k: v.float().contiguous() for k, v in res.items()}, out / "reference" / f"{name}.safetensors")
        doc["cases"][name] = {**case, "inputs": folder, "output": f"reference/{name}.safetensors"}
        print(f"{name}: done")
    path = out / "cases.json"
    if only and path.exists():
        old = json.loads(path.read_text())
        doc["cases"] = {**old["cases"], **doc["cases"]}
    path.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
