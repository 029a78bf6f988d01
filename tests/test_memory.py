"""Peak memory of a fold is a few tensors, never the model (measured in a subprocess, as the OS
reports it: VmHWM counts resident pages of memory-mapped inputs too). VmHWM, not ru_maxrss:
Linux carries the parent's high-water mark into ru_maxrss across fork + exec."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from mergestream.checkpoints import TensorMeta
from mergestream.writers import ModelWriter

ROWS, COLS = 2048, 4096  # 32 MiB per float32 tensor
N_TENSORS = 36  # 1.13 GiB per checkpoint, 36x the largest tensor

FOLD_SCRIPT = """
import json, sys
from mergestream import engine
base, expert, policy, params, state, out = sys.argv[1:7]
engine.fold(base, None, expert, policy, json.loads(params), state_dir=state, out=out,
            max_shard_bytes=256 * 1024**2)
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
print(int(hwm.split()[1]) * 1024)
"""


def _write_model(folder, seed, n, rows, cols, shard_bytes):
    folder.mkdir(parents=True)
    metas = [TensorMeta(f"layers.{i}.weight", (rows, cols), torch.float32) for i in range(n)]
    metas.append(TensorMeta("norm.weight", (cols,), torch.float32))
    w = ModelWriter(folder, metas, {"format": "pt"}, max_shard_bytes=shard_bytes)
    g = torch.Generator().manual_seed(0)
    noise = torch.Generator().manual_seed(seed)
    for m in metas:
        t = torch.randn(m.shape, generator=g)
        if seed:
            t += 0.01 * torch.randn(m.shape, generator=noise)
        w.write(m.name, t)
        del t
    w.close()
    return folder


def _peak_rss(base, expert, policy, params, state, out) -> int:
    proc = subprocess.run([sys.executable, "-c", FOLD_SCRIPT, str(base), str(expert), policy, json.dumps(params),
                           str(state), str(out)], capture_output=True, text=True, check=True)
    return int(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(autouse=True)
def _free_the_disk(tmp_path):
    """These models are GiB-sized: remove each test's files when it ends (pytest keeps the last three
    runs' temporary folders, which would otherwise hold ~20 GB)."""
    yield
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("policy,params", [("task_arithmetic", {"lambda": 0.3}), ("mdm_oc", {"alpha": 0.3})])
def test_fold_peak_rss_is_a_few_tensors(tmp_path, policy, params):
    largest = ROWS * COLS * 4
    base = _write_model(tmp_path / "base", 0, N_TENSORS, ROWS, COLS, 512 * 1024**2)
    expert = _write_model(tmp_path / "expert", 1, N_TENSORS, ROWS, COLS, 512 * 1024**2)
    total = sum(f.stat().st_size for f in base.glob("*.safetensors"))
    assert total >= 1024**3 and total >= 20 * largest
    # interpreter baseline: the same fold on a tiny model of the same layout
    tiny_b = _write_model(tmp_path / "tiny-base", 0, 3, 8, 16, 10**9)
    tiny_e = _write_model(tmp_path / "tiny-expert", 1, 3, 8, 16, 10**9)
    baseline = _peak_rss(tiny_b, tiny_e, policy, params, tmp_path / "tiny-state", tmp_path / "tiny-out")
    peak = _peak_rss(base, expert, policy, params, tmp_path / "state", tmp_path / "out")
    mib = 1024**2
    print(f"{policy}: baseline {baseline / mib:.0f} MiB, peak {peak / mib:.0f} MiB, "
          f"largest tensor {largest / mib:.0f} MiB, model {total / mib:.0f} MiB")
    assert peak - baseline < 4 * largest, (peak - baseline) / largest
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()


LEGACY_ROWS = 1024  # 16 MiB per float32 tensor: 36 of them are 576 MiB


def _as_legacy(folder, path, container):
    """The same weights as a ``torch.save`` pickle: a flat state dict or a Lightning-style container
    (``state_dict`` with every name under ``model.``)."""
    from mergestream.checkpoints import read_state_dict

    sd = read_state_dict(folder)
    torch.save(sd if container == "flat" else {"epoch": 1, "state_dict": {f"model.{k}": v for k, v in sd.items()}},
               path)
    del sd
    return path


@pytest.mark.slow
@pytest.mark.parametrize("which,suffix,container", [("expert", ".bin", "flat"), ("base", ".pt", "flat"),
                                                    ("expert", ".ckpt", "lightning")])
def test_fold_peak_rss_is_a_few_tensors_for_legacy_pickles(tmp_path, which, suffix, container):
    """A legacy pickle is read tensor by tensor with positional reads into fresh memory: its mapped
    pages are never made resident (nor privately copied), so a fold's peak is that of the same fold
    on safetensors (within a tensor or two: no pooled read buffers), whatever the model size (R4)."""
    largest = LEGACY_ROWS * COLS * 4

    def models(tag, n, rows):
        base = _write_model(tmp_path / f"{tag}base", 0, n, rows, COLS, 10**10)
        expert = _write_model(tmp_path / f"{tag}expert", 1, n, rows, COLS, 10**10)
        if which == "base":
            return (base, expert), (_as_legacy(base, tmp_path / f"{tag}base{suffix}", container), expert)
        return (base, expert), (base, _as_legacy(expert, tmp_path / f"{tag}expert{suffix}", container))

    (st_base, st_expert), (base, expert) = models("", N_TENSORS, LEGACY_ROWS)
    total = N_TENSORS * largest
    _, (tiny_b, tiny_e) = models("tiny-", 3, 8)
    params = {"lambda": 0.3}
    baseline = _peak_rss(tiny_b, tiny_e, "task_arithmetic", params, tmp_path / "tiny-state", tmp_path / "tiny-out")
    reference = _peak_rss(st_base, st_expert, "task_arithmetic", params, tmp_path / "st-state", tmp_path / "st-out")
    peak = _peak_rss(base, expert, "task_arithmetic", params, tmp_path / "state", tmp_path / "out")
    mib = 1024**2
    print(f"{which}{suffix}: baseline {baseline / mib:.0f} MiB, safetensors {reference / mib:.0f} MiB, "
          f"peak {peak / mib:.0f} MiB, largest tensor {largest / mib:.0f} MiB, model {total / mib:.0f} MiB")
    assert peak - reference < 2 * largest, (peak - reference) / largest
    assert peak - baseline < 6 * largest, (peak - baseline) / largest  # the model is 36 tensors
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
