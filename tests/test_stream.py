"""The streaming core: each input read once, one content hash, exact unmerge in every storage dtype,
and nothing published or changed when a late tensor is bad."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mergestream import engine
from mergestream.engine import residuals, stream
from mergestream.errors import CorruptCheckpointError, FrozenTensorMismatchError, NonFiniteError, StateError
from mergestream.io.checkpoints import Checkpoint, open_checkpoint, read_state_dict
from mergestream.io.expert_readers import content_sha256
from mergestream.io.state import StateDir
from mergestream.patches import weights_sha256

from .conftest import perturb, random_model, save_tensors

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return residuals.bits(t) if t.is_floating_point() else t


def _same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(_bits(a[k]), _bits(b[k])), k


def _wide_model(seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Weights of mixed magnitudes (many near zero, where a residual is often inexact) and a 0-d tensor."""
    t = random_model(seed, dtype, m=64, n=48)
    g = torch.Generator().manual_seed(seed + 100)
    t["layer.1.weight"] = (torch.randn(64, 48, generator=g) * torch.logspace(-6, 0, 48)).to(dtype)
    t["bn.num_batches_tracked"] = torch.tensor(7)
    t["scale"] = torch.tensor(0.5, dtype=dtype)
    return t


@pytest.mark.parametrize("policy,params", [("task_arithmetic", {"lambda": 0.7}), ("task_arithmetic", {"lambda": 0.5}),
                                           ("ties", {"k": 30}),
                                           ("safe_merge", {"steps": 2, "k": 4, "k_s": 4, "rank": 2})])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_subtract_of_the_latest_fold_restores_bytes_over_25_cycles(tmp_path, dtype, policy, params):
    """fold X, subtract X, 25 times, on top of an earlier fold: the backbone comes back byte for byte
    every time (the applied residual is stored, not the pre-rounding Δ; Task Arithmetic: what the
    rounding lost, λ = 0.5 putting a rounding tie on a quarter of the entries), so nothing drifts."""
    base = _wide_model(0, dtype)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    first = save_tensors(tmp_path / "first.safetensors", perturb(base, 0.05, 1))
    state = tmp_path / "state"
    engine.fold(bpath, None, first, policy, params, state_dir=state, out=tmp_path / "v0")
    start = read_state_dict(tmp_path / "v0")
    current = tmp_path / "v0"
    for i in range(25):
        e = save_tensors(tmp_path / f"x{i}.safetensors", perturb(base, 0.05 * (1 + i % 3), 10 + i))
        engine.fold(bpath, current, e, policy, params, state_dir=state, out=tmp_path / f"f{i}")
        engine.unmerge(state, f"x{i}", "subtract", out=tmp_path / f"u{i}")
        _same_bytes(read_state_dict(tmp_path / f"u{i}"), start)
        current = tmp_path / f"u{i}"
    assert StateDir(state).manifest.ids() == ["first"]


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e-38, 3e38], ids=["small", "unit", "subnormal", "near-max"])
@pytest.mark.parametrize("lam", [0.3, 0.5, 1.0])
def test_bf16_misses_read_off_the_bits_equal_the_neighbour_formulation(scale, lam):
    """A bf16 fold lists as exceptions the entries where θ_{t−1} is neither c = rd(θ_t − d) nor c's
    neighbour toward θ_t − d. The bf16 path reads that off θ_t − d's float32 bits
    (residuals._bf16_misses); it must give exactly the entries the general path (widen c, step it
    toward θ_t − d, compare) gives, for signed zeros, subnormals, exact differences (d = 0), values
    near bf16's largest and either sign."""
    n = 1 << 14
    g = torch.Generator().manual_seed(int(lam * 10))
    prev = (torch.randn(n, generator=g) * scale).bfloat16()
    prev[:64], prev[64:128] = 0.0, -0.0
    d = torch.randn(n, generator=g) * scale * torch.rand(n, generator=g) * lam
    d[128:256] = 0.0
    theta = (prev.float() + d).bfloat16()
    keep = torch.isfinite(theta)  # a fold refuses overflow; keep those entries unchanged
    theta, d = torch.where(keep, theta, prev), torch.where(keep, d, 0.0)
    pb = residuals.bits(prev)
    c = residuals.subtract_delta(theta, d, theta.float())
    ne = (residuals.bits(c) != pb).numpy()
    general = (residuals._neighbour_bits(c) != pb).numpy() & ne
    c = residuals.subtract_delta(theta, d, theta.float())
    fast = residuals._bf16_misses(pb, np.flatnonzero(ne))
    assert general.any() and (ne & ~general).any()  # both kinds occur: recovered ties and misses
    assert np.array_equal(fast, np.flatnonzero(general))


def _three_folds(tmp, dtype: torch.dtype, policy: str, params: dict):
    """θ₀ and three perturbed experts folded in turn into ``tmp/state``; returns (θ₀ tensors, θ₀'s
    path, the state folder, the last backbone)."""
    base = _wide_model(0, dtype)
    bpath = save_tensors(tmp / "base.safetensors", base)
    state, prev = tmp / "state", None
    for i in range(3):
        e = save_tensors(tmp / f"e{i}.safetensors", perturb(base, 0.05, i + 1))
        engine.fold(bpath, prev, e, policy, params, state_dir=state, out=tmp / f"v{i}")
        prev = tmp / f"v{i}"
    return base, bpath, state, prev


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_subtract_of_an_earlier_fold_is_within_one_ulp(tmp_path, dtype):
    """Removing an earlier Task Arithmetic fold: rd(θ − λτ) with λτ recomputed from the kept expert
    exactly as the fold computed it (float32 for these dtypes), within one unit in the last place of
    the storage dtype of the exact θ − λτ on every element; removing the last one left gives θ₀
    exactly."""
    base, bpath, state, prev = _three_folds(tmp_path, dtype, "task_arithmetic", {"lambda": 0.5})
    e0 = read_state_dict(tmp_path / "e0.safetensors")
    cur = read_state_dict(prev)
    engine.unmerge(state, "e0", "subtract", out=tmp_path / "minus0")
    got = read_state_dict(tmp_path / "minus0")
    for k, v in cur.items():
        if not v.is_floating_point():
            assert torch.equal(got[k], v)
            continue
        d = (e0[k].float() - base[k].float()) * 0.5
        exact = v.double() - d.double()
        ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(torch.finfo(dtype).tiny)
        assert ((got[k].double() - exact).abs() <= ulp * 1.0001).all(), k
    assert not any(f.exact_restore for f in StateDir(state).manifest.folds)  # backbone is no fold's output now
    engine.unmerge(state, "e1", "subtract", out=tmp_path / "minus01")
    engine.unmerge(state, "e2", "subtract", out=tmp_path / "empty")
    _same_bytes(read_state_dict(tmp_path / "empty"), base)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_task_arithmetic_fold_stores_no_residual_tensor(tmp_path, dtype):
    """A linear fold's residual file (format 3) holds λ, one tie bit per element and the exception
    lists only, since subtract recomputes λτ from the kept expert: its data stays under the
    model's size even on this model, where a fifth of the weights are far smaller than λτ (their
    low bits are lost by the fold and must be listed)."""
    base, bpath, state, prev = _three_folds(tmp_path, dtype, "task_arithmetic", {"lambda": 0.5})
    float_bytes = sum(t.numel() * t.element_size() for t in base.values() if t.is_floating_point())
    for i, f in enumerate(StateDir(state).manifest.folds):
        reader = residuals.ResidualReader(state / f.contribution)
        try:
            assert reader.recompute_lambda == 0.5
            keys = list(reader._ck.keys())
            assert all(residuals.is_exception_key(k) for k in keys)
            # the first fold's is never subtracted exactly (removing the only fold writes θ₀): λ only
            assert bool(keys) == (i > 0) and any(k.endswith(residuals.EXACT_TIES) for k in keys) == (i > 0)
            stored = sum(reader._ck.get(k).numel() * reader._ck.get(k).element_size() for k in keys)
        finally:
            reader.close()
        assert stored < float_bytes


@pytest.mark.parametrize("change", ["deleted", "rewritten"])
def test_subtract_needing_a_kept_expert_that_is_gone_or_changed_loses_nothing(tmp_path, change):
    """Subtract of a Task Arithmetic fold recomputes λτ from the kept expert: a deleted expert is a
    StateError before any work, a changed one (another content hash) a CorruptCheckpointError after
    the pass; either way no output is published and the state folder is byte for byte as before."""
    base, bpath, state, prev = _three_folds(tmp_path, torch.bfloat16, "task_arithmetic", {"lambda": 0.5})
    before = {p.relative_to(state): p.read_bytes() for p in state.rglob("*") if p.is_file()}
    e1 = tmp_path / "e1.safetensors"
    if change == "deleted":
        e1.unlink()
    else:
        save_tensors(e1, perturb(base, 0.05, 99))
    with pytest.raises(StateError if change == "deleted" else CorruptCheckpointError, match="replay"):
        engine.unmerge(state, "e1", "subtract", out=tmp_path / "minus1")
    assert not (tmp_path / "minus1").exists()
    assert {p.relative_to(state): p.read_bytes() for p in state.rglob("*") if p.is_file()} == before
    engine.unmerge(state, "e2", "subtract", out=tmp_path / "minus2")  # the others still subtract
    _same_bytes(read_state_dict(tmp_path / "minus2"), read_state_dict(tmp_path / "v1"))


def test_replay_is_byte_exact(tmp_path):
    base, bpath, state, prev = _three_folds(tmp_path, torch.bfloat16, "ties", {"k": 40})
    engine.unmerge(state, "e1", "replay", out=tmp_path / "replayed")
    s2, prev = tmp_path / "s2", None
    for i in (0, 2):
        engine.fold(bpath, prev, tmp_path / f"e{i}.safetensors", "ties", {"k": 40}, state_dir=s2,
                    out=tmp_path / f"w{i}")
        prev = tmp_path / f"w{i}"
    _same_bytes(read_state_dict(tmp_path / "replayed"), read_state_dict(prev))


class _CountingCheckpoint:
    """Count the tensor bytes every reader of the fold pulls from each file (patched class)."""

    reads: dict[str, int] = {}

    @classmethod
    def install(cls, monkeypatch):
        cls.reads = {}
        orig = Checkpoint.read_into

        def read_into(self, name, out, start=0):
            key = str(self._entries[name].file) if self._entries else str(self.path)
            cls.reads[key] = cls.reads.get(key, 0) + out.numel()
            return orig(self, name, out, start)

        monkeypatch.setattr(Checkpoint, "read_into", read_into)


@pytest.mark.parametrize("policy", ["task_arithmetic", "ties", "mdm_oc"])
def test_the_expert_is_read_once_per_fold(tmp_path, monkeypatch, policy):
    """Validation, finiteness, frozen tensors and the content hash ride on the fold's own pass: the
    expert file's tensor bytes are read exactly once (counted through the reader)."""
    base = _wide_model(0, torch.bfloat16)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    epath = save_tensors(tmp_path / "e.safetensors", perturb(base, 0.05, 1))
    _CountingCheckpoint.install(monkeypatch)
    rep = engine.fold(bpath, None, epath, policy, state_dir=tmp_path / "s", out=tmp_path / "o",
                      options=engine.ExecOptions(threads=2))
    data_bytes = sum(v.nbytes for v in base.values())
    assert _CountingCheckpoint.reads[str(epath)] == data_bytes
    assert rep.sha256 == [content_sha256(epath)] == [weights_sha256(epath)]


def test_content_hash_is_one_definition(tmp_path):
    """The fold's on-the-fly hash, the ledger's (content_sha256), the manifest's, the output
    metadata's and the patches' weights hash agree; it ignores sharding and file names."""
    base = _wide_model(0, torch.float16)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    expert = perturb(base, 0.05, 3)
    single = save_tensors(tmp_path / "one" / "model.safetensors", expert).parent
    from mergestream.io.writers import ModelWriter

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    ck = open_checkpoint(single)
    w = ModelWriter(sharded, list(reversed(ck.metas())), {"format": "pt"}, max_shard_bytes=4000)
    for m in ck.metas():
        w.write(m.name, ck.get(m.name))
    w.close()
    assert content_sha256(single) == content_sha256(sharded) == weights_sha256(sharded) == ck.sha256()
    rep = engine.fold(bpath, None, sharded, "task_arithmetic", state_dir=tmp_path / "s", out=tmp_path / "o")
    assert rep.sha256 == [content_sha256(single)]
    assert StateDir(tmp_path / "s").manifest.folds[0].sha256 == content_sha256(single)
    md = open_checkpoint(tmp_path / "o").metadata()
    assert json.loads(md["mergestream.expert_sha256"]) == [content_sha256(single)]


@pytest.mark.parametrize("bad", ["nan_last", "inf_middle", "frozen_last"])
@pytest.mark.parametrize("policy", ["task_arithmetic", "ties"])
def test_a_bad_tensor_late_in_the_file_leaves_no_output_and_the_state_unchanged(tmp_path, bad, policy):
    base = _wide_model(0, torch.bfloat16)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    good = save_tensors(tmp_path / "good.safetensors", perturb(base, 0.05, 1))
    state = tmp_path / "state"
    engine.fold(bpath, None, good, policy, state_dir=state, out=tmp_path / "v1")
    before = {p.name: p.read_bytes() for p in state.rglob("*") if p.is_file()}
    e = perturb(base, 0.05, 2)
    last = sorted(k for k, v in e.items() if v.is_floating_point())[-1]
    if bad == "nan_last":
        e[last].view(-1)[-1] = float("nan")
        err = NonFiniteError
    elif bad == "inf_middle":
        e["layer.0.mlp.weight"].view(-1)[5] = float("inf")
        err = NonFiniteError
    else:
        e["position_ids"] = e["position_ids"] + 1
        err = FrozenTensorMismatchError
    epath = save_tensors(tmp_path / "bad.safetensors", e)
    with pytest.raises(err):
        engine.fold(bpath, tmp_path / "v1", epath, policy, state_dir=state, out=tmp_path / "v2")
    assert not (tmp_path / "v2").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".v2")]  # no staging left over
    after = {p.name: p.read_bytes() for p in state.rglob("*") if p.is_file()}
    assert after == before


def test_an_expert_that_changed_since_it_was_registered_is_refused(tmp_path):
    base = _wide_model(0, torch.float32)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    epath = save_tensors(tmp_path / "e.safetensors", perturb(base, 0.05, 1))
    registered = content_sha256(epath)
    save_tensors(epath, perturb(base, 0.05, 2))
    with pytest.raises(Exception, match="changed since it was registered"):
        engine.fold(bpath, None, epath, "task_arithmetic", state_dir=tmp_path / "s", out=tmp_path / "o",
                    expect_sha256=registered)
    assert not (tmp_path / "o").exists() and not (tmp_path / "s" / "manifest.json").exists()


def test_chunked_task_arithmetic_equals_the_whole_tensor_path(tmp_path, monkeypatch):
    """The element-wise fast path (chunks, reused buffers, threads) gives the same bytes as the
    generic per-tensor path of the policy."""
    base = _wide_model(0, torch.bfloat16)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    e1 = save_tensors(tmp_path / "e1.safetensors", perturb(base, 0.05, 1))
    e2 = save_tensors(tmp_path / "e2.safetensors", perturb(base, 0.05, 2))
    monkeypatch.setattr(stream, "CHUNK_ELEMENTS", 1000)  # many chunks per tensor
    engine.fold(bpath, None, e1, "task_arithmetic", {"lambda": 0.3}, state_dir=tmp_path / "a", out=tmp_path / "a1",
                options=engine.ExecOptions(threads=3))
    engine.fold(bpath, tmp_path / "a1", e2, "task_arithmetic", {"lambda": 0.3}, state_dir=tmp_path / "a",
                out=tmp_path / "a2", options=engine.ExecOptions(threads=3))
    from mergestream.policies import TaskArithmetic

    monkeypatch.setattr(TaskArithmetic, "linear_scale", lambda self: None)
    engine.fold(bpath, None, e1, "task_arithmetic", {"lambda": 0.3}, state_dir=tmp_path / "b", out=tmp_path / "b1")
    engine.fold(bpath, tmp_path / "b1", e2, "task_arithmetic", {"lambda": 0.3}, state_dir=tmp_path / "b",
                out=tmp_path / "b2")
    _same_bytes(read_state_dict(tmp_path / "a2"), read_state_dict(tmp_path / "b2"))


@pytest.mark.parametrize("policy,params", [("safe_merge", {"k": 8, "k_s": 8, "rank": 4, "steps": 5}),
                                           ("mdm_oc", {"rank": 4})])
def test_randomized_svd_folds_are_the_same_at_any_thread_count(tmp_path, monkeypatch, request, policy, params):
    """Policies with randomized SVDs (matrices over 512 on their short side) fold the same bytes with
    1 or 4 worker threads (each with one intra-op thread: torch's parallel reductions split by
    thread count), in a later fold too: their test matrices come from private generators.
    Reseeding torch's global generator per SVD (what they did) raced between workers; no policy may
    touch it (torch.manual_seed raises here)."""
    g = torch.Generator().manual_seed(0)
    base = {f"layers.{i}.w": (torch.randn(520, 600, generator=g) * 0.02).to(torch.bfloat16) for i in range(6)}
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    e1 = save_tensors(tmp_path / "e1.safetensors", perturb(base, 0.05, 1))
    e2 = save_tensors(tmp_path / "e2.safetensors", perturb(base, 0.05, 2))

    def no_global_seed(*a, **k):
        raise AssertionError("a policy reseeded torch's global RNG")

    monkeypatch.setattr(torch, "manual_seed", no_global_seed)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)  # one intra-op thread per worker either way: reductions split alike
    request.addfinalizer(lambda: torch.set_num_threads(threads_before))
    outs = {}
    for threads in (1, 4):
        st, o1, o2 = tmp_path / f"s{threads}", tmp_path / f"a{threads}", tmp_path / f"b{threads}"
        engine.fold(bpath, None, e1, policy, params, state_dir=st, out=o1, options=engine.ExecOptions(threads=threads))
        engine.fold(bpath, o1, e2, policy, params, state_dir=st, out=o2, options=engine.ExecOptions(threads=threads))
        outs[threads] = read_state_dict(o2)
    _same_bytes(outs[1], outs[4])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy,params", [("task_arithmetic", {"lambda": 0.5}), ("ties", {"k": 30}),
                                           ("mdm_oc", {"alpha": 0.4})])
def test_cuda_fold_matches_cpu(tmp_path, policy, params):
    """--device cuda: the same fold within float rounding of the CPU's (bit-exact for TA)."""
    base = _wide_model(0, torch.bfloat16)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    epath = save_tensors(tmp_path / "e.safetensors", perturb(base, 0.05, 1))
    for dev in ("cpu", "cuda"):
        engine.fold(bpath, None, epath, policy, params, state_dir=tmp_path / f"s-{dev}", out=tmp_path / dev,
                    options=engine.ExecOptions(device=dev))
    a, b = read_state_dict(tmp_path / "cpu"), read_state_dict(tmp_path / "cuda")
    if policy == "task_arithmetic":
        _same_bytes(a, b)
    for k in a:
        if a[k].is_floating_point():
            torch.testing.assert_close(a[k].float(), b[k].float(), atol=1e-2, rtol=1e-2)


def test_legacy_checkpoint_with_shared_storage_is_folded_once_per_name(tmp_path):
    """B03 class: a legacy .bin whose names share one storage (tied embeddings). The reader hands
    out independent tensors, so in-place math on one name never changes another (fold and merge)."""
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(20, 8, generator=g)
    base = {"shared.weight": emb, "encoder.embed_tokens.weight": emb, "decoder.embed_tokens.weight": emb,
            "fc.weight": torch.randn(8, 8, generator=g)}
    tau = torch.randn(20, 8, generator=g) * 0.1
    e_emb = emb + tau
    expert = {"shared.weight": e_emb, "encoder.embed_tokens.weight": e_emb, "decoder.embed_tokens.weight": e_emb,
              "fc.weight": base["fc.weight"] + 0.1}
    torch.save(base, tmp_path / "base.bin")
    torch.save(expert, tmp_path / "expert.bin")
    engine.fold(tmp_path / "base.bin", None, tmp_path / "expert.bin", "task_arithmetic", {"lambda": 1.0},
                state_dir=tmp_path / "s", out=tmp_path / "o")
    got = read_state_dict(tmp_path / "o")
    for k in expert:
        torch.testing.assert_close(got[k], expert[k], rtol=0, atol=1e-6)
    engine.merge(tmp_path / "base.bin", [tmp_path / "expert.bin"], "task_arithmetic", {"lambda": 0.5},
                 out=tmp_path / "m")
    got = read_state_dict(tmp_path / "m")
    for k in ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        torch.testing.assert_close(got[k], emb + 0.5 * tau, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8, torch.float32,
                                   torch.float16, torch.bfloat16], ids=str)
def test_zero_dim_tensors_of_every_dtype_fold_and_unmerge(tmp_path, dtype):
    """B06 class: 0-d tensors (BatchNorm's num_batches_tracked, scalar gains) are read, merged or
    copied, written and unmerged like any other tensor."""
    base = random_model(0)
    base["bn.num_batches_tracked"] = torch.tensor(3).to(dtype)
    expert = perturb(base, 0.05, 1)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    epath = save_tensors(tmp_path / "e.safetensors", expert)
    engine.fold(bpath, None, epath, "task_arithmetic", {"lambda": 1.0}, state_dir=tmp_path / "s", out=tmp_path / "o")
    got = read_state_dict(tmp_path / "o")
    assert got["bn.num_batches_tracked"].shape == () and got["bn.num_batches_tracked"].dtype == dtype
    assert torch.equal(_bits(got["bn.num_batches_tracked"]), _bits(expert["bn.num_batches_tracked"]))
    e2 = save_tensors(tmp_path / "e2.safetensors", perturb(base, 0.05, 2))
    engine.fold(bpath, tmp_path / "o", e2, "task_arithmetic", {"lambda": 1.0}, state_dir=tmp_path / "s",
                out=tmp_path / "o2")
    engine.unmerge(tmp_path / "s", "e2", "subtract", out=tmp_path / "u")
    _same_bytes(read_state_dict(tmp_path / "u"), got)


def test_a_failed_first_fold_leaves_no_state_folder(tmp_path):
    base = _wide_model(0, torch.float32)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    e = perturb(base, 0.05, 1)
    e["layer.1.weight"].view(-1)[-1] = float("nan")
    epath = save_tensors(tmp_path / "bad.safetensors", e)
    with pytest.raises(NonFiniteError):
        engine.fold(bpath, None, epath, "ties", state_dir=tmp_path / "state", out=tmp_path / "o")
    assert not (tmp_path / "state").exists() and not (tmp_path / "o").exists()
    # and removing the last fold reports the state's policy, not "base"
    good = save_tensors(tmp_path / "good.safetensors", perturb(base, 0.05, 2))
    engine.fold(bpath, None, good, "ties", state_dir=tmp_path / "s2", out=tmp_path / "v1")
    rep = engine.unmerge(tmp_path / "s2", "good", "subtract", out=tmp_path / "u")
    assert rep.policy == "ties" and rep.experts == []


HOSTILE = [["F32"], {"a": 1}, True, 1.5, None, "F32x", -1, [1], "", 2**70]


@pytest.mark.parametrize("field", ["dtype", "shape", "dim", "start", "end"])
def test_a_hostile_header_value_is_a_format_error_never_a_type_error(tmp_path, field):
    """Every field of a tensor entry, given a value of the wrong JSON type (list, object, bool,
    float, null, string, out of range), is refused with FormatError by the one header parser (the
    checkpoint reader, the inbox readiness check and the patch reader all use it)."""
    import struct

    from mergestream.io.st import FormatError, parse_header_text

    for bad in HOSTILE:
        entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
        if field == "dtype":
            entry["dtype"] = bad
        elif field == "shape":
            entry["shape"] = bad
        elif field == "dim":
            entry["shape"] = [bad]
        else:
            entry["data_offsets"] = [bad, 8] if field == "start" else [0, bad]
        text = json.dumps({"w": entry})
        with pytest.raises(FormatError):
            parse_header_text(text, tmp_path / "x.safetensors", "x")
        f = tmp_path / f"{field}.safetensors"
        raw = text.encode()
        f.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 8)
        with pytest.raises(CorruptCheckpointError):
            open_checkpoint(f)


def test_whole_tensor_workers_share_the_cores_and_torch_threads_come_back(tmp_path):
    """With W worker threads, a whole-tensor policy's math runs with torch's intra-op threads divided
    by W (no W × cores oversubscription), a chunked element-wise fold keeps them, and the setting
    is restored after the fold, also when it fails."""
    from mergestream.engine.stream import shared_cores

    before = torch.get_num_threads()
    with shared_cores(2):
        assert torch.get_num_threads() == max(1, before // 2)
    assert torch.get_num_threads() == before
    with shared_cores(1), shared_cores(3, "meta"):
        assert torch.get_num_threads() == before
    base = _wide_model(0, torch.bfloat16)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    epath = save_tensors(tmp_path / "e.safetensors", perturb(base, 0.05, 1))
    seen: dict[str, set[int]] = {}
    for policy in ("ties", "task_arithmetic"):
        engine.fold(bpath, None, epath, policy, state_dir=tmp_path / policy, out=tmp_path / f"{policy}-o",
                    options=engine.ExecOptions(threads=2),
                    tensor_hook=lambda name, p=policy: seen.setdefault(p, set()).add(torch.get_num_threads()))
        assert torch.get_num_threads() == before
    assert seen == {"ties": {max(1, before // 2)}, "task_arithmetic": {before}}

    def boom(name):
        raise RuntimeError("injected")

    with pytest.raises(RuntimeError, match="injected"):
        engine.fold(bpath, None, epath, "ties", state_dir=tmp_path / "f", out=tmp_path / "f-o",
                    options=engine.ExecOptions(threads=2), tensor_hook=boom)
    assert torch.get_num_threads() == before
