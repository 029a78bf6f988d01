"""The compiled loop of a bf16 linear fold (mergestream.engine.fused) computes the very bits of the torch
path: θ_t, the tie bits and the misses of format 3, and the same refusals of non-finite input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mergestream import engine
from mergestream.engine import fused, linear_fold, residuals, stream
from mergestream.errors import NonFiniteError
from mergestream.io.checkpoints import read_state_dict
from mergestream.io.state import StateDir

from .conftest import perturb, random_model, save_tensors


def _reference(e: torch.Tensor, b: torch.Tensor, p: torch.Tensor, lam: float):
    """θ_t, tie mask and miss indices the torch path defines (task_vector_chunk, the float32 sum and
    cast, subtract_delta and the general neighbour formulation of the misses)."""
    d, _ = residuals.task_vector_chunk(e, b, lam, torch.device("cpu"))
    d = d.clone()
    theta = (d + p.float()).bfloat16()
    c = residuals.subtract_delta(theta, d, theta.float())
    pb = residuals.bits(p)
    ne = (residuals.bits(c) != pb).numpy()
    miss = (residuals._neighbour_bits(c) != pb).numpy() & ne
    return theta, ne, np.flatnonzero(miss)


def _values(n: int, scale: float, g: torch.Generator) -> torch.Tensor:
    v = (torch.randn(n, generator=g) * scale).bfloat16()
    v[:40], v[40:80] = 0.0, -0.0  # signed zeros
    return v


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e-38, 3e37], ids=["small", "unit", "subnormal", "large"])
@pytest.mark.parametrize("lam", [0.3, 0.5, 1.0, -0.7, 2.0])
def test_fused_later_fold_chunk_equals_the_torch_path(scale, lam):
    """Bit for bit, on every kind of bf16 value (signed zeros, subnormals, exact differences, large
    magnitudes, either sign of λ), with a chunk length that is not a multiple of 8."""
    n = (1 << 14) + 3
    g = torch.Generator().manual_seed(int(abs(lam) * 10))
    b = _values(n, scale, g)
    p = (b.float() + torch.randn(n, generator=g) * scale * 0.1).bfloat16()
    e = (b.float() + torch.randn(n, generator=g) * scale * torch.rand(n, generator=g)).bfloat16()
    e[100:200] = b[100:200]  # τ = 0 exactly
    e[200:240] = p[200:240]
    keep = torch.isfinite((e.float() - b.float()) * lam + p.float()) & torch.isfinite(
        ((e.float() - b.float()) * lam + p.float()).bfloat16())
    e = torch.where(keep, e, b)  # a fold refuses overflow: keep those entries at τ = 0
    theta, ne, miss = _reference(e, b, p, lam)
    out = e.clone()
    codes = np.empty(n, np.uint8)
    assert fused.fold_chunk(out, b, p, lam, codes) == (0, 0)
    assert torch.equal(residuals.bits(out), residuals.bits(theta))
    ties, got_miss = fused.exceptions(codes)
    assert ties == np.packbits(ne).tobytes()
    assert np.array_equal(got_miss, miss)
    assert ne.any() and miss.size and (ne.sum() > miss.size)  # recovered ties and misses both occur


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e-38, 3e37], ids=["small", "unit", "subnormal", "large"])
@pytest.mark.parametrize("lam", [0.3, 1.0, -0.7])
def test_fused_first_fold_chunk_equals_the_torch_path(scale, lam):
    """A first fold (θ_{t−1} = θ₀) writes rd(θ₀ + rd(λ·rd(e − θ₀))) exactly as torch does."""
    n = (1 << 14) + 5
    g = torch.Generator().manual_seed(7)
    b = _values(n, scale, g)
    e = (b.float() + torch.randn(n, generator=g) * scale).bfloat16()
    e = torch.where(torch.isfinite(((e.float() - b.float()) * lam + b.float()).bfloat16()), e, b)
    theta, _, _ = _reference(e, b, b, lam)
    out = e.clone()
    assert fused.fold_chunk(out, b, None, lam, None) == (0, 0)
    assert torch.equal(residuals.bits(out), residuals.bits(theta))


def _folds(tmp: Path, monkeypatch, enabled: bool) -> tuple[Path, Path]:
    """θ₀ and three experts folded in turn (bf16, chunks of 1000 entries, so tensors span several
    chunks and end in a partial one); returns (the state folder, the last backbone)."""
    monkeypatch.setattr(fused, "ENABLED", enabled)
    monkeypatch.setattr(linear_fold, "COMPILED_MIN_ENTRIES", 0)  # these small models too
    monkeypatch.setattr(stream, "CHUNK_ELEMENTS", 1000)
    base = random_model(3, torch.bfloat16, m=96, n=70)
    g = torch.Generator().manual_seed(5)
    base["layer.1.weight"] = (torch.randn(96, 70, generator=g) * torch.logspace(-6, 0, 70)).bfloat16()
    bpath = save_tensors(tmp / "base.safetensors", base)
    state, prev = tmp / "state", None
    for i in range(3):
        e = save_tensors(tmp / f"e{i}.safetensors", perturb(base, 0.05, i + 1))
        engine.fold(bpath, prev, e, "task_arithmetic", {"lambda": 0.5}, state_dir=state, out=tmp / f"v{i}")
        prev = tmp / f"v{i}"
    return state, prev


def _same_tensors(a: Path, b: Path) -> None:
    x, y = read_state_dict(a), read_state_dict(b)
    assert x.keys() == y.keys()
    for k in x:
        assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape, k
        assert x[k].reshape(-1).view(torch.uint8).numpy().tobytes() == \
            y[k].reshape(-1).view(torch.uint8).numpy().tobytes(), k


def test_folds_with_and_without_the_compiled_loop_write_the_same_bytes(tmp_path, monkeypatch):
    """Three bf16 Task Arithmetic folds: every backbone and every residual file (tie bits, miss
    lists) is byte-identical between the compiled loop and the torch path, and subtract-unmerge of
    the latest fold restores the previous backbone byte for byte."""
    runs = {}
    for enabled in (True, False):
        runs[enabled] = _folds(tmp_path / str(enabled), monkeypatch, enabled)
    for rel in ["v0", "v1", "v2"]:
        _same_tensors(tmp_path / "True" / rel, tmp_path / "False" / rel)
    # the files' names and metadata carry their folders' paths, which differ: compare tensors, in id order
    contrib = [sorted((runs[on][0] / "contrib").glob("*.safetensors")) for on in (True, False)]
    assert len(contrib[0]) == len(contrib[1]) == 3
    for f, g in zip(*contrib):
        assert f.name.split("-")[0] == g.name.split("-")[0]
        _same_tensors(f, g)
    monkeypatch.setattr(fused, "ENABLED", True)
    engine.unmerge(runs[True][0], StateDir(runs[True][0]).manifest.ids()[-1], "subtract", out=tmp_path / "minus")
    _same_tensors(tmp_path / "minus", tmp_path / "True" / "v1")


@pytest.mark.parametrize("enabled", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize("where", ["expert", "overflow"])
def test_fused_fold_refuses_non_finite_like_the_torch_path(tmp_path, monkeypatch, where, enabled):
    """A NaN in the expert late in a tensor, or a sum past bf16's largest value: the same error on
    both paths, and no output."""
    monkeypatch.setattr(fused, "ENABLED", enabled)
    monkeypatch.setattr(linear_fold, "COMPILED_MIN_ENTRIES", 0)
    base = random_model(1, torch.bfloat16, m=64, n=48)
    exp = perturb(base, 0.01, 2)
    name = "layer.0.mlp.weight"
    if where == "expert":
        exp[name][-1, -3] = float("nan")
    else:
        base[name][-1, -3] = 3.0e38
        exp[name][-1, -3] = 3.3e38  # 3e38 + 3·τ, τ = 3e37: past bf16's largest value (3.39e38)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    epath = save_tensors(tmp_path / "e.safetensors", exp)
    with pytest.raises(NonFiniteError, match="NaN/Inf" if where == "expert" else "overflow") as err:
        engine.fold(bpath, None, epath, "task_arithmetic", {"lambda": 3.0}, state_dir=tmp_path / "s",
                    out=tmp_path / "out")
    assert name in str(err.value)
    assert not (tmp_path / "out").exists()


def _fresh_process_folds(tmp_path: Path, count: int, after_each: str, setup: str = "") -> list[str]:
    """Task Arithmetic folds of ``count`` experts (tiny bf16 models) in one state, in a fresh
    interpreter as the CLI runs them: ``setup`` runs first (``linear_fold`` is ``L``), the
    statement ``after_each`` after every fold; returns what they printed, split on whitespace."""
    base = random_model(1, torch.bfloat16)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    code = f"import sys; from mergestream import engine; from mergestream.engine import linear_fold as L; {setup or 'pass'}; "
    prev = None
    for i in range(count):
        epath = save_tensors(tmp_path / f"e{i}.safetensors", perturb(base, 0.01, 2 + i))
        out = str(tmp_path / f"out{i}")
        code += (f"engine.fold({str(bpath)!r}, {prev!r}, {str(epath)!r}, 'task_arithmetic', {{'lambda': 0.5}}, "
                 f"state_dir={str(tmp_path / 's')!r}, out={out!r}); {after_each}; ")
        prev = out
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return run.stdout.split()


def test_a_small_fold_does_not_load_numba_and_a_large_one_would(tmp_path):
    """Loading numba costs about a second once per process: a fold below
    linear_fold.COMPILED_MIN_ENTRIES bf16 entries stays on the torch path and never imports it (a
    fresh interpreter, as the CLI runs); from the threshold on, or once loaded, the loop is used."""
    folds = _fresh_process_folds(tmp_path, 1, "print('numba' in sys.modules, 'mergestream.engine.fused' in sys.modules)")
    assert folds == ["False", "False"]
    cpu = torch.device("cpu")
    assert linear_fold.compiled_loop_pays(linear_fold.COMPILED_MIN_ENTRIES, cpu)
    assert linear_fold.compiled_loop_pays(linear_fold.COMPILED_MIN_ENTRIES_LATER, cpu, later=True)
    assert linear_fold.COMPILED_MIN_ENTRIES_LATER < linear_fold.COMPILED_MIN_ENTRIES  # ties cost torch more
    assert not linear_fold.compiled_loop_pays(linear_fold.COMPILED_MIN_ENTRIES, torch.device("cuda"))
    assert linear_fold.compiled_loop_pays(1, cpu)  # this process has it loaded (the tests above)


def test_a_later_fold_takes_the_loop_from_its_own_lower_threshold(tmp_path):
    """The folder asks for the later fold's threshold when θ_{t−1} ≠ θ₀ and the first fold's
    otherwise: with only the later one reachable, a first fold leaves numba unloaded and the next
    fold of the same state loads it (a fresh interpreter, as the CLI runs)."""
    folds = _fresh_process_folds(tmp_path, 2, "print('mergestream.engine.fused' in sys.modules)",
                                 setup="L.COMPILED_MIN_ENTRIES = 1 << 60; L.COMPILED_MIN_ENTRIES_LATER = 0")
    assert folds == ["False", "True"]
