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

from mergestream.io.checkpoints import TensorMeta
from mergestream.io.writers import ModelWriter

ROWS, COLS = 2048, 4096  # 32 MiB per float32 tensor
N_TENSORS = 36  # 1.13 GiB per checkpoint, 36x the largest tensor

FOLD_SCRIPT = """
import json, sys
from mergestream import engine
base, expert, policy, params, state, out = sys.argv[1:7]
engine.fold(base, None, expert, policy, json.loads(params), state_dir=state, out=out,
            options=engine.ExecOptions(max_shard_bytes=256 * 1024**2))
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


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """One folder for the module's models, shared by its tests (writing a GiB-sized model costs
    seconds of CPU); removed when the module ends (pytest keeps the last three runs' temporary
    folders, which would otherwise hold GBs)."""
    folder = tmp_path_factory.mktemp("memory")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def _free_the_disk(tmp_path):
    """Each test's own outputs are removed when it ends, like the shared models at the module's end."""
    yield
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.fixture(scope="module")
def large_models(workdir):
    """θ₀ and an expert of N_TENSORS (ROWS, COLS) float32 tensors in 512 MiB shards (1.13 GiB each)."""
    return (_write_model(workdir / "base", 0, N_TENSORS, ROWS, COLS, 512 * 1024**2),
            _write_model(workdir / "expert", 1, N_TENSORS, ROWS, COLS, 512 * 1024**2))


@pytest.fixture(scope="module")
def tiny_models(workdir):
    """θ₀ and an expert of the same layout as :func:`large_models` but three (8, 16) tensors: their
    fold's peak RSS is the interpreter/import baseline."""
    return (_write_model(workdir / "tiny-base", 0, 3, 8, 16, 10**9),
            _write_model(workdir / "tiny-expert", 1, 3, 8, 16, 10**9))


@pytest.mark.slow
@pytest.mark.parametrize("policy,params", [("task_arithmetic", {"lambda": 0.3}), ("mdm_oc", {"alpha": 0.3})])
def test_fold_peak_rss_is_a_few_tensors(tmp_path, policy, params, large_models, tiny_models):
    largest = ROWS * COLS * 4
    base, expert = large_models
    total = sum(f.stat().st_size for f in base.glob("*.safetensors"))
    assert total >= 1024**3 and total >= 20 * largest
    base_rss = _peak_rss(*tiny_models, policy, params, tmp_path / "tiny-state", tmp_path / "tiny-out")
    peak = _peak_rss(base, expert, policy, params, tmp_path / "state", tmp_path / "out")
    mib = 1024**2
    print(f"{policy}: baseline {base_rss / mib:.0f} MiB, peak {peak / mib:.0f} MiB, "
          f"largest tensor {largest / mib:.0f} MiB, model {total / mib:.0f} MiB")
    assert peak - base_rss < 4 * largest, (peak - base_rss) / largest
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()


LEGACY_ROWS = 1024  # 16 MiB per float32 tensor: 36 of them are 576 MiB


def _as_legacy(folder, path, container):
    """The same weights as a ``torch.save`` pickle: a flat state dict or a Lightning-style container
    (``state_dict`` with every name under ``model.``)."""
    from mergestream.io.checkpoints import read_state_dict

    sd = read_state_dict(folder)
    torch.save(sd if container == "flat" else {"epoch": 1, "state_dict": {f"model.{k}": v for k, v in sd.items()}},
               path)
    del sd
    return path


@pytest.fixture(scope="module")
def legacy_reference(workdir):
    """θ₀ and an expert of N_TENSORS (LEGACY_ROWS, COLS) float32 tensors as single safetensors files,
    and the peak RSS (bytes) of their Task Arithmetic fold: what a fold from a pickle is held to."""
    base = _write_model(workdir / "legacy-base", 0, N_TENSORS, LEGACY_ROWS, COLS, 10**10)
    expert = _write_model(workdir / "legacy-expert", 1, N_TENSORS, LEGACY_ROWS, COLS, 10**10)
    peak = _peak_rss(base, expert, "task_arithmetic", {"lambda": 0.3}, workdir / "legacy-state",
                     workdir / "legacy-out")
    return base, expert, peak


@pytest.mark.slow
@pytest.mark.parametrize("which,suffix,container", [("expert", ".bin", "flat"), ("base", ".pt", "flat"),
                                                    ("expert", ".ckpt", "lightning")])
def test_fold_peak_rss_is_a_few_tensors_for_legacy_pickles(tmp_path, which, suffix, container, legacy_reference):
    """A legacy pickle is read tensor by tensor with positional reads into fresh memory: its mapped
    pages are never made resident (nor privately copied), so a fold's peak is that of the same fold
    on safetensors (within a tensor or two: no pooled read buffers), whatever the model size (R4)."""
    largest = LEGACY_ROWS * COLS * 4

    def as_legacy(base, expert, tag):
        if which == "base":
            return _as_legacy(base, tmp_path / f"{tag}base{suffix}", container), expert
        return base, _as_legacy(expert, tmp_path / f"{tag}expert{suffix}", container)

    st_base, st_expert, reference = legacy_reference
    base, expert = as_legacy(st_base, st_expert, "")
    total = N_TENSORS * largest
    tiny_b, tiny_e = as_legacy(_write_model(tmp_path / "tiny-base", 0, 3, 8, 16, 10**10),
                               _write_model(tmp_path / "tiny-expert", 1, 3, 8, 16, 10**10), "tiny-")
    params = {"lambda": 0.3}
    baseline = _peak_rss(tiny_b, tiny_e, "task_arithmetic", params, tmp_path / "tiny-state", tmp_path / "tiny-out")
    peak = _peak_rss(base, expert, "task_arithmetic", params, tmp_path / "state", tmp_path / "out")
    mib = 1024**2
    print(f"{which}{suffix}: baseline {baseline / mib:.0f} MiB, safetensors {reference / mib:.0f} MiB, "
          f"peak {peak / mib:.0f} MiB, largest tensor {largest / mib:.0f} MiB, model {total / mib:.0f} MiB")
    assert peak - reference < 2 * largest, (peak - reference) / largest
    assert peak - baseline < 6 * largest, (peak - baseline) / largest  # the model is 36 tensors
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
