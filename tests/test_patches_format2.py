"""Patch format 2 (issue 16): changed-entry bitmasks and optional zstd per payload; format 1 still
applies. Round trips are checked bit for bit on every kind of change and on real folds."""

from __future__ import annotations

import json

import pytest
import torch

from mergestream.patches import PatchError, apply_patch, read_patch
from mergestream.patches.build import PatchBuildError, build_patch
from mergestream.patches.codec import decode_mask, encode_mask

from .test_patches import (
    DTYPES,
    POLICY_PARAMS,
    assert_bit_identical,
    edge_case_pair,
    fold_versions,
    forge,
    write_model,
)


@pytest.mark.parametrize("zstd", [None, 3])
@pytest.mark.parametrize("dt", list(DTYPES))
def test_format2_round_trip_is_bit_exact_for_every_kind_of_change(tmp_path, dt, zstd):
    v1, v2 = edge_case_pair(tmp_path, DTYPES[dt])
    stats = build_patch(v1, v2, tmp_path / "p.safetensors", source_version="1", target_version="2",
                        patch_format=2, zstd_level=zstd)
    patch = read_patch(tmp_path / "p.safetensors")
    assert patch.metadata["patch_format"] == "mergestream-patch/2"
    assert stats["tensors_removed"] == 1 and stats["tensors_added"] == 1
    if zstd is None:
        assert not patch.compressed
    apply_patch(v1, tmp_path / "p.safetensors", tmp_path / "out")
    assert_bit_identical(tmp_path / "out", v2)


def test_a_medium_density_change_uses_the_bitmask(tmp_path):
    g = torch.Generator().manual_seed(0)
    a = {"w": torch.randn(256, 64, generator=g).to(torch.bfloat16)}
    b = {"w": a["w"].clone()}
    changed = torch.rand(256 * 64, generator=g) < 0.2
    b["w"].view(-1)[changed] += 1.0
    v1, v2 = write_model(tmp_path / "v1", a), write_model(tmp_path / "v2", b)
    f1 = build_patch(v1, v2, tmp_path / "p1.safetensors", source_version="1", target_version="2")
    f2 = build_patch(v1, v2, tmp_path / "p2.safetensors", source_version="1", target_version="2", patch_format=2)
    assert list(read_patch(tmp_path / "p2.safetensors").masked) == ["w"]
    assert f2["payload_bytes"] < f1["payload_bytes"]
    apply_patch(v1, tmp_path / "p2.safetensors", tmp_path / "out")
    assert_bit_identical(tmp_path / "out", v2)


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("policy", list(POLICY_PARAMS))
def test_format2_with_zstd_reproduces_every_policy_fold(tmp_path, policy, dt):
    v1, v2, _ = fold_versions(tmp_path, policy, DTYPES[dt])
    build_patch(v1, v2, tmp_path / "p.safetensors", source_version="1", target_version="2", patch_format=2,
                zstd_level=3)
    apply_patch(v1, tmp_path / "p.safetensors", tmp_path / "out")
    assert_bit_identical(tmp_path / "out", v2)


@pytest.mark.parametrize("policy,params", [("safe_merge", {"rho": 0.1}), ("ties", {})])
def test_format2_is_smaller_than_format1_on_sparse_folds(tmp_path, policy, params):
    v1, v2, _ = fold_versions(tmp_path, policy, torch.bfloat16, m=256, n=192, params=params)
    one = build_patch(v1, v2, tmp_path / "p1.safetensors", source_version="1", target_version="2")
    two = build_patch(v1, v2, tmp_path / "p2.safetensors", source_version="1", target_version="2", patch_format=2)
    two_z = build_patch(v1, v2, tmp_path / "p2z.safetensors", source_version="1", target_version="2", patch_format=2,
                        zstd_level=3)
    assert two["patch_bytes"] <= one["patch_bytes"] and two_z["patch_bytes"] < one["patch_bytes"], (one, two, two_z)
    apply_patch(v1, tmp_path / "p2z.safetensors", tmp_path / "out")
    assert_bit_identical(tmp_path / "out", v2)


def test_bitmask_round_trip_and_padding_check():
    changed = torch.rand(13) < 0.5
    packed = encode_mask(changed.numpy())
    assert (decode_mask(packed, 13, "t") == changed.numpy()).all()
    packed[-1] |= 0x80  # a padding bit
    with pytest.raises(PatchError, match="padding"):
        decode_mask(packed, 13, "t")


def test_format1_patch_claiming_format2_entries_is_refused(tmp_path):
    g = torch.Generator().manual_seed(0)
    a = {"w": torch.randn(256, 64, generator=g)}
    b = {"w": a["w"].clone()}
    b["w"].view(-1)[torch.rand(256 * 64, generator=g) < 0.3] += 1.0
    v1, v2 = write_model(tmp_path / "v1", a), write_model(tmp_path / "v2", b)
    build_patch(v1, v2, tmp_path / "p.safetensors", source_version="1", target_version="2", patch_format=2,
                zstd_level=3)
    bad = forge(tmp_path / "p.safetensors", tmp_path / "bad.safetensors", meta={"patch_format": "mergestream-patch/1"})
    with pytest.raises(PatchError, match="format 1 patch holds format 2 entries"):
        apply_patch(v1, bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_wrong_uncompressed_size_is_refused(tmp_path):
    a = {"w": torch.zeros(512, 64)}
    b = {"w": a["w"].clone()}
    b["w"][:100] = 1.0
    v1, v2 = write_model(tmp_path / "v1", a), write_model(tmp_path / "v2", b)
    build_patch(v1, v2, tmp_path / "p.safetensors", source_version="1", target_version="2", patch_format=2,
                zstd_level=3)
    shapes = json.loads(read_patch(tmp_path / "p.safetensors").metadata["compressed"])
    name, (dtype, shape) = next(iter(shapes.items()))
    shapes[name] = [dtype, [shape[0] + 8] + shape[1:]] if name.startswith("dense/") else [dtype, [shape[0] + 8]]
    bad = forge(tmp_path / "p.safetensors", tmp_path / "bad.safetensors", meta={"compressed": json.dumps(shapes)})
    with pytest.raises(PatchError):
        apply_patch(v1, bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_zstd_needs_format2():
    with pytest.raises(PatchBuildError, match="zstd needs format 2"):
        build_patch("a", "b", "c", source_version="1", target_version="2", zstd_level=3)
