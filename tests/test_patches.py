"""Incremental updates: exact patches between versions (build side, apply side, CLI).

Round trips are checked on raw bytes (every tensor's bytes, and the weight files themselves),
never with float comparisons: -0.0 vs 0.0 and NaN payloads must survive.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mergestream import engine
from mergestream.errors import OutputExistsError
from mergestream.io.checkpoints import TensorMeta
from mergestream.io.st import encode_header
from mergestream.io.writers import ModelWriter
from mergestream.patches import (
    PatchError,
    Weights,
    apply_patch,
    canonical_header,
    read_header,
    read_patch,
    weights_sha256,
)
from mergestream.patches import build as patch_build
from mergestream.patches.build import build_patch
from mergestream.policies import REGISTRY

from .conftest import perturb, random_model

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
POLICY_PARAMS = {
    "task_arithmetic": {},
    "ties": {},
    "safe_merge": {"steps": 3, "k": 4, "k_s": 4, "rank": 2},
    "mdm_oc": {"rank": 2},
    "opcm": {},
    "magmax": {},
    "dop": {},
    "iso_c": {},
    "iso_cts": {},
    "weight_average": {},
}
NO_TORCH = "import sys; sys.modules['torch'] = None; from mergestream.patches.cli import main; main()"


# -- helpers -----------------------------------------------------------------------------------
def write_model(folder: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
                max_shard_bytes: int | None = None, config: str | None = '{"model_type": "toy"}') -> Path:
    """A model folder: one model.safetensors (safetensors' own writer) or shards + index (ours)."""
    folder.mkdir(parents=True, exist_ok=True)
    if max_shard_bytes is None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"), metadata=metadata)
    else:
        metas = [TensorMeta(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
        w = ModelWriter(folder, metas, metadata, max_shard_bytes)
        for k, v in tensors.items():
            w.write(k, v)
        w.close()
    if config is not None:
        (folder / "config.json").write_text(config)
    return folder


def raw_tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name -> (dtype, shape, raw bytes) of every tensor of a model."""
    with Weights(path) as w:
        return {n: (e.dtype, e.shape, w.read(n).tobytes()) for n, e in w.entries.items()}


def weight_files(path: Path) -> dict[str, bytes]:
    """Every weight file and index of a model folder, by name."""
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())
            if f.name.endswith(".safetensors") or f.name.endswith(".index.json")}


def assert_bit_identical(got: Path, want: Path) -> None:
    """Same tensors (dtype, shape, bytes) and byte-identical weight files."""
    assert raw_tensors(got) == raw_tensors(want)
    assert weight_files(got) == weight_files(want)
    assert weights_sha256(got) == weights_sha256(want)


def nothing_left(out: Path) -> bool:
    return not out.exists() and not list(out.parent.glob(f".{out.name}.staging-*"))


def set_bits(t: torch.Tensor, flat_index: int, bits: int) -> None:
    """Write raw bits into one element (NaN payloads, signed zeros)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    t.view(ints).view(-1)[flat_index] = bits


def forge(patch: Path, dest: Path, *, meta: dict[str, str] | None = None, data=None) -> Path:
    """Rewrite a patch with changed metadata and/or data, re-signing its payload sha256, so that
    only the apply side's later checks can catch it."""
    hdr = read_header(patch)
    payload = bytearray(patch.read_bytes()[hdr.data_start:])
    obj = json.loads(hdr.text)
    obj["__metadata__"].update(meta or {})
    if data is not None:
        data(obj, payload)
    h = hashlib.sha256(bytes(payload))
    h.update(canonical_header(obj))
    obj["__metadata__"]["payload_sha256"] = h.hexdigest()
    dest.write_bytes(encode_header(obj) + bytes(payload))
    return dest


def edge_case_pair(tmp_path: Path, dtype: torch.dtype) -> tuple[Path, Path]:
    """Source and target models covering every kind of change."""
    g = torch.Generator().manual_seed(0)
    src = {
        "unchanged.weight": torch.randn(32, 16, generator=g).to(dtype),
        "sparse.weight": torch.randn(64, 32, generator=g).to(dtype),
        "dense.weight": torch.randn(24, 8, generator=g).to(dtype),
        "signed_zero.bias": torch.zeros(40, dtype=dtype),
        "nan.bias": torch.full((40,), float("nan"), dtype=dtype),
        "scalar": torch.tensor(1.5, dtype=dtype),
        "empty": torch.zeros(0, 4, dtype=dtype),
        "position_ids": torch.arange(16)[None],
        "reshaped.weight": torch.randn(4, 6, generator=g).to(dtype),
        "removed.weight": torch.randn(5, generator=g).to(dtype),
    }
    dst = {k: v.clone() for k, v in src.items() if k != "removed.weight"}
    dst["sparse.weight"].view(-1)[[0, 17, 900, 2047]] += 1.0
    dst["dense.weight"] = (dst["dense.weight"].float() * 1.5 + 0.25).to(dtype)
    dst["signed_zero.bias"][[3, 31]] = -0.0  # equal as floats, different bits
    nan_bits = {torch.float32: 0x7FC00001, torch.bfloat16: 0x7FC1, torch.float16: 0x7E01}[dtype]
    set_bits(dst["nan.bias"], 7, nan_bits)  # another NaN payload: NaN != NaN anyway, bits differ
    dst["scalar"] = torch.tensor(-1.5, dtype=dtype)
    dst["reshaped.weight"] = dst["reshaped.weight"].reshape(6, 4).contiguous()
    dst["added.weight"] = torch.randn(3, 3, generator=g).to(dtype)
    return (write_model(tmp_path / "v1", src, {"mergestream.n_folds": "1"}),
            write_model(tmp_path / "v2", dst, {"mergestream.n_folds": "2", "mergestream.policy": "ties"}))


# -- round trips on hand-made models ------------------------------------------------------------
@pytest.mark.parametrize("dt", list(DTYPES))
def test_round_trip_is_bit_exact_for_every_kind_of_change(tmp_path, dt):
    v1, v2 = edge_case_pair(tmp_path, DTYPES[dt])
    stats = build_patch(v1, v2, tmp_path / "p.safetensors", source_version="1", target_version="2")
    assert stats["tensors_removed"] == 1 and stats["tensors_added"] == 1
    assert stats["tensors_unchanged"] == 3  # unchanged.weight, empty, position_ids
    # sparse: a few entries, the signed zeros, the NaN payload; dense: all changed, scalar,
    # reshaped, added
    assert stats["tensors_sparse"] == 3
    assert stats["tensors_dense"] == 4
    patch = read_patch(tmp_path / "p.safetensors")
    assert patch.policy == "ties" and patch.removed == ["removed.weight"]
    assert (patch.source_sha256, patch.target_sha256) == (weights_sha256(v1), weights_sha256(v2))
    rep = apply_patch(v1, tmp_path / "p.safetensors", tmp_path / "out")
    assert rep["target_sha256"] == weights_sha256(v2)
    assert_bit_identical(tmp_path / "out", v2)
    assert (tmp_path / "out" / "config.json").read_text() == (v1 / "config.json").read_text()
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert f.metadata()["mergestream.n_folds"] == "2"
        assert f.get_tensor("sparse.weight").dtype == DTYPES[dt]
    with safe_open(str(tmp_path / "p.safetensors"), framework="pt") as f:  # the patch is valid safetensors
        assert f.get_tensor("sparse.indices/sparse.weight").dtype == torch.int32
        assert f.get_tensor("sparse.values/sparse.weight").dtype == DTYPES[dt]


def test_identical_models_give_an_empty_patch(tmp_path):
    v1 = write_model(tmp_path / "a", random_model(0))
    v2 = write_model(tmp_path / "b", random_model(0))
    stats = build_patch(v1, v2, tmp_path / "p.safetensors", source_version="a", target_version="b")
    assert stats["payload_bytes"] == 0 and stats["tensors_changed"] == 0
    apply_patch(v1, tmp_path / "p.safetensors", tmp_path / "out")
    assert_bit_identical(tmp_path / "out", v2)


def test_sharded_target_is_rebuilt_file_for_file(tmp_path):
    base = random_model(0)
    src = write_model(tmp_path / "src", base)  # one file
    changed = perturb(base, 0.01, seed=1)
    dst = write_model(tmp_path / "dst", changed, {"who": "v2"}, max_shard_bytes=4000)
    assert (dst / "model.safetensors.index.json").exists()
    build_patch(src, dst, tmp_path / "p.safetensors", source_version="1", target_version="2")
    apply_patch(src, tmp_path / "p.safetensors", tmp_path / "out")
    assert_bit_identical(tmp_path / "out", dst)
    assert len(weight_files(tmp_path / "out")) > 2


def test_sparse_indices_switch_to_int64_for_huge_tensors(tmp_path, monkeypatch):
    monkeypatch.setattr(patch_build, "_I32_LIMIT", 10)
    v1, v2 = edge_case_pair(tmp_path, torch.float32)
    build_patch(v1, v2, tmp_path / "p.safetensors", source_version="1", target_version="2")
    with safe_open(str(tmp_path / "p.safetensors"), framework="pt") as f:
        assert f.get_tensor("sparse.indices/sparse.weight").dtype == torch.int64
    apply_patch(v1, tmp_path / "p.safetensors", tmp_path / "out")
    assert_bit_identical(tmp_path / "out", v2)


def test_weights_hash_ignores_sharding_order_and_metadata_but_not_bits(tmp_path):
    t = random_model(0, torch.bfloat16)
    single = write_model(tmp_path / "single", t, {"a": "1"})
    sharded = write_model(tmp_path / "sharded", dict(reversed(list(t.items()))), {"b": "2"}, max_shard_bytes=3000)
    assert weights_sha256(single) == weights_sha256(sharded) == weights_sha256(single / "model.safetensors")
    flipped = {k: v.clone() for k, v in t.items()}
    flipped["layer.0.attn.bias"][0] = -flipped["layer.0.attn.bias"][0]
    assert weights_sha256(write_model(tmp_path / "flip", flipped)) != weights_sha256(single)
    zeros = {"z": torch.zeros(4)}
    negzeros = {"z": -torch.zeros(4)}
    assert weights_sha256(write_model(tmp_path / "z", zeros)) != weights_sha256(write_model(tmp_path / "nz", negzeros))
    renamed = {("x" + k): v for k, v in t.items()}
    assert weights_sha256(write_model(tmp_path / "ren", renamed)) != weights_sha256(single)


# -- through the real engine ----------------------------------------------------------------------
def fold_versions(tmp_path: Path, policy: str, dtype: torch.dtype, m: int = 48, n: int = 40,
                  params: dict | None = None) -> list[Path]:
    """Fold 3 experts one after another; returns the version folders v1, v2, v3."""
    base_t = random_model(0, dtype, m=m, n=n)
    base = write_model(tmp_path / "base", base_t)
    experts = [write_model(tmp_path / f"e{i}", perturb(base_t, 0.05, seed=10 + i), config=None) for i in range(3)]
    versions, backbone = [], None
    for i, e in enumerate(experts):
        out = tmp_path / f"v{i + 1}"
        engine.fold(base, backbone, e, policy, dict(POLICY_PARAMS[policy], **(params or {})),
                    state_dir=tmp_path / "state", out=out)
        versions.append(out)
        backbone = out
    return versions


def test_every_registered_policy_is_covered():
    assert set(POLICY_PARAMS) == set(REGISTRY)


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("policy", list(POLICY_PARAMS))
def test_chain_of_patches_reproduces_the_last_fold(tmp_path, policy, dt):
    v1, v2, v3 = fold_versions(tmp_path, policy, DTYPES[dt])
    p12 = build_patch(v1, v2, tmp_path / "p12.safetensors", source_version="1", target_version="2")
    p23 = build_patch(v2, v3, tmp_path / "p23.safetensors", source_version="2", target_version="3")
    assert read_patch(tmp_path / "p23.safetensors").policy == policy
    assert p12["tensors_changed"] > 0 and p23["tensors_changed"] > 0
    apply_patch(v1, tmp_path / "p12.safetensors", tmp_path / "a2")
    apply_patch(tmp_path / "a2", tmp_path / "p23.safetensors", tmp_path / "a3")
    assert_bit_identical(tmp_path / "a3", v3)
    # a direct patch between non-adjacent versions works too
    build_patch(v1, v3, tmp_path / "p13.safetensors", source_version="1", target_version="3")
    apply_patch(v1, tmp_path / "p13.safetensors", tmp_path / "b3")
    assert_bit_identical(tmp_path / "b3", v3)


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_safe_merge_patch_is_much_smaller_than_the_model(tmp_path, dt):
    v1, v2, _ = fold_versions(tmp_path, "safe_merge", DTYPES[dt], m=256, n=192, params={"rho": 0.1})
    stats = build_patch(v1, v2, tmp_path / "p.safetensors", source_version="1", target_version="2")
    assert stats["ratio"] < 0.5, stats
    assert stats["tensors_sparse"] >= 3


# -- refusals: nothing written ------------------------------------------------------------------
@pytest.fixture
def patched(tmp_path):
    v1, v2 = edge_case_pair(tmp_path, torch.bfloat16)
    p = tmp_path / "p.safetensors"
    build_patch(v1, v2, p, source_version="1", target_version="2")
    return v1, v2, p


def test_corrupted_payload_is_refused(tmp_path, patched):
    v1, _, p = patched
    bad = tmp_path / "bad.safetensors"
    raw = bytearray(p.read_bytes())
    raw[-3] ^= 0x01  # one bit in the last tensor's data
    bad.write_bytes(bytes(raw))
    out = tmp_path / "out"
    with pytest.raises(PatchError, match="corrupted"):
        apply_patch(v1, bad, out)
    assert nothing_left(out)


def test_corrupted_header_content_is_refused(tmp_path, patched):
    v1, _, p = patched
    raw = p.read_bytes()
    want = json.loads(read_header(p).text)["__metadata__"]["target_sha256"].encode()
    i = raw.index(want)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(raw[:i] + (b"0" if raw[i:i + 1] != b"0" else b"1") + raw[i + 1:])
    with pytest.raises(PatchError, match="corrupted"):
        apply_patch(v1, bad, tmp_path / "out")
    assert nothing_left(tmp_path / "out")


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_truncated_patch_is_refused(tmp_path, patched, keep):
    v1, _, p = patched
    raw = p.read_bytes()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(raw[:int(len(raw) * keep)])
    with pytest.raises(PatchError, match="truncated|not a safetensors"):
        apply_patch(v1, bad, tmp_path / "out")
    assert nothing_left(tmp_path / "out")


def test_patch_for_another_source_is_refused(tmp_path, patched):
    v1, v2, p = patched
    with pytest.raises(PatchError, match=f"patch is for source sha256 {weights_sha256(v1)}.*this model has "
                                         f"{weights_sha256(v2)}"):
        apply_patch(v2, p, tmp_path / "out")
    assert nothing_left(tmp_path / "out")


def test_result_that_misses_the_target_hash_is_refused(tmp_path, patched):
    v1, _, p = patched
    bad = forge(p, tmp_path / "bad.safetensors", meta={"target_sha256": "0" * 64})
    with pytest.raises(PatchError, match="hashes to .* records target sha256 0000"):
        apply_patch(v1, bad, tmp_path / "out")
    assert nothing_left(tmp_path / "out")


def test_out_of_range_sparse_index_is_refused(tmp_path, patched):
    v1, _, p = patched

    def poison(obj, payload):
        start, _ = obj["sparse.indices/sparse.weight"]["data_offsets"]
        payload[start:start + 4] = (10**9).to_bytes(4, "little")

    bad = forge(p, tmp_path / "bad.safetensors", data=poison)
    with pytest.raises(PatchError, match="out of range"):
        apply_patch(v1, bad, tmp_path / "out")
    assert nothing_left(tmp_path / "out")


def test_model_file_given_as_patch_and_existing_output_are_refused(tmp_path, patched):
    v1, v2, p = patched
    with pytest.raises(PatchError, match="not a mergestream patch"):
        apply_patch(v1, v2 / "model.safetensors", tmp_path / "out")
    (tmp_path / "out").mkdir()
    with pytest.raises(PatchError, match="already exists"):
        apply_patch(v1, p, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_build_refuses_an_existing_patch_unless_overwrite(tmp_path, patched):
    v1, v2, p = patched
    before = p.read_bytes()
    with pytest.raises(OutputExistsError):
        build_patch(v1, v2, p, source_version="1", target_version="2")
    assert p.read_bytes() == before
    build_patch(v1, v2, p, source_version="1", target_version="2", overwrite=True)
    assert p.read_bytes() == before  # deterministic
    assert sorted(x.name for x in tmp_path.iterdir() if x.name.startswith(".")) == []


# -- command line -------------------------------------------------------------------------------
def run_patch_cli(*args, no_torch: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", NO_TORCH] if no_torch else [sys.executable, "-m", "mergestream.patches.cli"]
    return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True)


def test_cli_make_patch_then_apply_patch_without_torch(tmp_path):
    v1, v2 = edge_case_pair(tmp_path, torch.float16)
    proc = run_patch_cli("make-patch", "--from-dir", v1, "--to-dir", v2, "--out", tmp_path / "p.safetensors", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tensors_removed"] == 1
    assert read_patch(tmp_path / "p.safetensors").source_version == "v1"
    proc = run_patch_cli("apply-patch", v1, tmp_path / "p.safetensors", "--out", tmp_path / "out", no_torch=True)
    assert proc.returncode == 0, proc.stderr
    assert "v1 -> v2" in proc.stdout
    assert_bit_identical(tmp_path / "out", v2)


def test_cli_refuses_a_patch_for_another_source_with_one_line(tmp_path, patched):
    v1, v2, p = patched
    proc = run_patch_cli("apply-patch", v2, p, "--out", tmp_path / "out", no_torch=True)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: FormatError: patch is for source sha256"), proc.stderr
    assert nothing_left(tmp_path / "out")


def test_apply_side_imports_without_torch():
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.modules['torch'] = None; "
                           "import mergestream.patches, mergestream.patches.cli; "
                           "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _device_files() -> list[str]:
    """The files docs/architecture.md says a device needs for the apply side."""
    doc = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    block = doc.split("<!-- device-files -->", 1)[1].split("<!-- /device-files -->", 1)[0]
    return re.findall(r"^- `([^`]+)`", block, flags=re.M)


def test_apply_module_is_standalone(tmp_path, patched):
    """The apply side copied alone (exactly the files docs/architecture.md lists for a device) next
    to nothing but numpy applies a patch: no torch, no other module of the package. The interpreter
    runs without ``site`` (``-S``), so the editable install's finder cannot fill a missing file in."""
    v1, v2, p = patched
    files = _device_files()
    assert "mergestream/patches/__init__.py" in files and "mergestream/io/st.py" in files
    lone = tmp_path / "lone"
    root = Path(__file__).parents[1]
    for name in files:
        (lone / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / name, lone / name)
    deps = {str(Path(m.__file__).parents[1]) for m in (np, __import__("zstandard"))}
    code = (f"import sys; sys.modules['torch'] = None; "
            f"from mergestream import patches; patches.apply_patch({str(v1)!r}, {str(p)!r}, {str(tmp_path / 'out')!r}); "
            f"mods = {{m: getattr(sys.modules[m], '__file__', '') for m in sys.modules if m.startswith('mergestream')}}; "
            f"outside = [m for m, f in mods.items() if not f.startswith({str(lone)!r})]; "
            f"assert not outside, outside; print(sorted(mods))")
    proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=lone,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(lone), *sorted(deps)])})
    assert proc.returncode == 0, proc.stderr
    assert_bit_identical(tmp_path / "out", v2)
