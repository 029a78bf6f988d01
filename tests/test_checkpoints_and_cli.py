"""Checkpoint I/O (sharded writer, provenance, atomic staging, tied tensors) and the one-shot CLI
on tiny real Hugging Face models."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from mergestream import engine
from mergestream.io.checkpoints import TensorMeta, open_checkpoint, read_state_dict
from mergestream.io.writers import ModelWriter, staged_output

from .conftest import check_merge_output, make_hf_expert, perturb, random_model, run_cli, save_tensors


def test_writer_shards_at_the_byte_cap_and_reads_back(tmp_path):
    tensors = {f"t{i}": torch.randn(10, 10 + i) for i in range(7)}
    tensors["ids"] = torch.arange(5)
    tensors["half"] = torch.randn(3, 3).to(torch.bfloat16)
    metas = [TensorMeta(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    w = ModelWriter(tmp_path, metas, {"who": "test"}, max_shard_bytes=1200)
    for k in reversed(list(tensors)):  # any order: tensors go to precomputed offsets
        w.write(k, tensors[k])
    w.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    for shard in shards:
        with safe_open(str(tmp_path / shard), "pt") as f:
            assert f.metadata()["who"] == "test"
            size = sum(f.get_slice(k).get_shape()[0] * 0 + f.get_tensor(k).nbytes for k in f.keys())
            assert size <= 1200 or len(list(f.keys())) == 1
    got = read_state_dict(tmp_path)
    for k, v in tensors.items():
        assert torch.equal(got[k], v)


def test_writer_refuses_unplanned_shapes_and_missing_tensors(tmp_path):
    w = ModelWriter(tmp_path, [TensorMeta("a", (2, 2), torch.float32), TensorMeta("b", (2,), torch.float32)])
    with pytest.raises(ValueError, match="planned"):
        w.write("a", torch.zeros(3, 2))
    w.write("a", torch.zeros(2, 2))
    with pytest.raises(RuntimeError, match="never written"):
        w.close()


def test_staged_output_leaves_nothing_on_failure(tmp_path):
    out = tmp_path / "model"
    with pytest.raises(RuntimeError):
        with staged_output(out) as stage:
            (stage / "half.bin").write_bytes(b"x" * 100)
            raise RuntimeError("crash mid-write")
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_fold_interrupted_mid_way_leaves_no_output_and_unchanged_state(tmp_path):
    base = random_model(0)
    bpath = save_tensors(tmp_path / "b.safetensors", base)
    e1 = save_tensors(tmp_path / "e1.safetensors", perturb(base, 0.01, 1))
    e2 = save_tensors(tmp_path / "e2.safetensors", perturb(base, 0.01, 2))
    engine.fold(bpath, None, e1, "ties", state_dir=tmp_path / "s", out=tmp_path / "o1")
    manifest = (tmp_path / "s" / "manifest.json").read_text()
    files = sorted(p.name for p in (tmp_path / "s").rglob("*"))

    def hook(name):
        if name == "layer.0.mlp.weight":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        engine.fold(bpath, tmp_path / "o1", e2, "ties", state_dir=tmp_path / "s", out=tmp_path / "o2", tensor_hook=hook)
    assert not (tmp_path / "o2").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert (tmp_path / "s" / "manifest.json").read_text() == manifest
    assert sorted(p.name for p in (tmp_path / "s").rglob("*")) == files
    engine.fold(bpath, tmp_path / "o1", e2, "ties", state_dir=tmp_path / "s", out=tmp_path / "o2")


def test_provenance_metadata_and_aux_files(tmp_path, tiny_bert):
    import shutil

    base = tmp_path / "base"
    shutil.copytree(tiny_bert, base)
    (base / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    (base / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    e1 = make_hf_expert(base, tmp_path / "ex1", seed=1)
    out = tmp_path / "out"
    engine.fold(base, None, e1, "safe_merge", {"steps": 3, "k": 4, "k_s": 4, "rank": 2},
                state_dir=tmp_path / "s", out=out, options=engine.ExecOptions(max_shard_bytes=30_000))
    check_merge_output(out, base)
    assert (out / "vocab.txt").read_text() == "[PAD]\n[UNK]\n"
    assert (out / "tokenizer_config.json").exists()
    ck = open_checkpoint(out)
    md = ck.metadata()
    assert md["mergestream.policy"] == "safe_merge"
    assert json.loads(md["mergestream.experts"]) == ["ex1"]
    assert json.loads(md["mergestream.expert_sha256"]) == [open_checkpoint(e1).sha256()]
    assert json.loads(md["mergestream.params"])["rho"] == 0.1
    assert len(ck.weight_files) > 1  # sharded at 100 kB


def test_tied_tensors_are_written_the_way_the_base_has_them(tmp_path, tiny_llama):
    # tiny_llama ties lm_head to embed_tokens: the file holds only embed_tokens, and so must the output
    base_keys = set(read_state_dict(tiny_llama))
    assert "lm_head.weight" not in base_keys
    e = make_hf_expert(tiny_llama, tmp_path / "ex", seed=3)
    engine.fold(tiny_llama, None, e, "ties", state_dir=tmp_path / "s1", out=tmp_path / "o1")
    assert set(read_state_dict(tmp_path / "o1")) == base_keys
    # a base that stores both copies gets both, identical, even with a randomised policy
    sd = read_state_dict(tiny_llama)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    bpath = save_tensors(tmp_path / "both" / "model.safetensors", sd)
    epath = save_tensors(tmp_path / "both-e" / "model.safetensors", perturb(sd, 0.01, 4) | {})
    ex = read_state_dict(epath)
    ex["lm_head.weight"] = ex["model.embed_tokens.weight"].clone()
    save_tensors(epath, ex)
    engine.fold(bpath.parent, None, epath.parent, "safe_merge", {"steps": 2, "k": 4, "k_s": 4},
                state_dir=tmp_path / "s2", out=tmp_path / "o2")
    got = read_state_dict(tmp_path / "o2")
    assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])
    assert not torch.equal(got["lm_head.weight"], sd["lm_head.weight"])


def test_hf_models_load_with_transformers_after_folding(tmp_path, tiny_llama):
    from transformers import LlamaForCausalLM

    experts = [make_hf_expert(tiny_llama, tmp_path / f"ex{i}", seed=i) for i in range(2)]
    backbone = None
    for i, e in enumerate(experts):
        out = tmp_path / f"v{i}"
        engine.fold(tiny_llama, backbone, e, "mdm_oc", {"rank": 2}, state_dir=tmp_path / "s", out=out)
        backbone = out
    model = LlamaForCausalLM.from_pretrained(backbone)
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("policy, first, later", [
    ("task_arithmetic", ["lambda=0.7"], []),
    ("ties", ["k=40", "lambda=0.9"], ["k=25"]),
    ("task_arithmetic", ["lambda=0.6", "lines_alpha=0.5", "lines_beta=0.4"], ["lines_beta=0.2"]),
])
def test_a_later_cli_fold_continues_with_the_states_parameters(tmp_path, tiny_bert, policy, first, later):
    """Parameters a later `fold --state` does not --set are the state's last fold's (never silently
    the defaults): the output equals the fold with every parameter repeated by hand."""
    experts = [make_hf_expert(tiny_bert, tmp_path / f"e{i}", seed=30 + i) for i in range(2)]
    sets = lambda xs: [a for x in xs for a in ("--set", x)]  # noqa: E731
    for tag, second in (("short", later), ("full", first + later)):
        st = tmp_path / f"state-{tag}"
        run_cli("fold", "--base", tiny_bert, "--expert", experts[0], "--policy", policy, *sets(first),
                "--state", st, "--out", tmp_path / f"{tag}-v1")
        run_cli("fold", "--base", tiny_bert, "--backbone", tmp_path / f"{tag}-v1", "--expert", experts[1],
                "--policy", policy, *sets(second), "--state", st, "--out", tmp_path / f"{tag}-v2")
    short, full = (json.loads((tmp_path / f"state-{t}" / "manifest.json").read_text()) for t in ("short", "full"))
    assert short["folds"][1]["params"] == full["folds"][1]["params"]
    for x in later:  # what is given wins over the state
        k, v = x.split("=")
        assert float(short["folds"][1]["params"][k]) == float(v)
    got, want = read_state_dict(tmp_path / "short-v2"), read_state_dict(tmp_path / "full-v2")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_cli_fold_merge_unmerge_inspect(tmp_path, tiny_bert):
    experts = [make_hf_expert(tiny_bert, tmp_path / f"e{i}", seed=10 + i) for i in range(3)]
    st = tmp_path / "state"
    run_cli("fold", "--base", tiny_bert, "--expert", experts[0], "--policy", "ties", "--set", "k=30",
            "--set", "lambda=0.8", "--state", st, "--out", tmp_path / "v1")
    proc = run_cli("fold", "--base", tiny_bert, "--backbone", tmp_path / "v1", "--expert", experts[1],
                   "--policy", "ties", "--set", "k=30", "--state", st, "--out", tmp_path / "v2", "--json",
                   "--threads", "2")
    rep = json.loads(proc.stdout)
    assert rep["experts"] == ["e1"] and rep["params"]["k"] == 30.0
    assert rep["params"]["lambda"] == 0.8  # not given: the state's last fold's value, not the default
    assert "lambda=0.8" in proc.stderr
    run_cli("fold", "--base", tiny_bert, "--backbone", tmp_path / "v2", "--expert", experts[2], "--id", "third",
            "--policy", "ties", "--state", st, "--out", tmp_path / "v3")
    manifest = json.loads((st / "manifest.json").read_text())
    assert [f["id"] for f in manifest["folds"]] == ["e0", "e1", "third"]
    check_merge_output(tmp_path / "v3", tiny_bert)
    run_cli("unmerge", "--state", st, "--expert", "e1", "--mode", "subtract", "--out", tmp_path / "u1")
    run_cli("unmerge", "--state", st, "--expert", "third", "--mode", "replay", "--out", tmp_path / "u2")
    assert [f["id"] for f in json.loads((st / "manifest.json").read_text())["folds"]] == ["e0"]
    run_cli("merge", "--base", tiny_bert, "--policy", "task_arithmetic", "--out", tmp_path / "m", *experts)
    check_merge_output(tmp_path / "m", tiny_bert)
    proc = run_cli("inspect", "--base", tiny_bert, *experts, "--json")
    info = json.loads(proc.stdout)
    assert info["task_vectors"]["ids"] == ["e0", "e1", "e2"]
    cos = info["task_vectors"]["cosine"]
    assert abs(cos[0][0] - 1) < 1e-9 and abs(cos[0][1]) < 0.2
    text = run_cli("inspect", "--base", tiny_bert, *experts).stdout
    assert "pairwise cosine" in text and "float32" in text
    # the weights hash inspect shows is the content hash the fold recorded for that expert
    hashes = [c["weights_sha256"] for c in info["checkpoints"]]
    assert hashes[0] == manifest["folds"][0]["sha256"] == open_checkpoint(experts[0]).sha256()
    assert all(f"weights sha256: {h}" in text for h in hashes) and len(set(hashes)) == 3
    assert "weights_sha256" not in json.loads(run_cli("inspect", "--no-hash", "--json", experts[0]).stdout)["checkpoints"][0]
    # bad input on every verb: one line, status 2, nothing written
    bad = run_cli("fold", "--base", tiny_bert, "--expert", experts[0], "--policy", "nope", "--state", tmp_path / "x",
                  "--out", tmp_path / "x-out", check=False)
    assert bad.returncode == 2 and "unknown policy" in bad.stderr and not (tmp_path / "x-out").exists()
    bad = run_cli("fold", "--base", tiny_bert, "--expert", experts[0], "--policy", "ties", "--set", "lambda",
                  "--state", tmp_path / "x", "--out", tmp_path / "x-out", check=False)
    assert bad.returncode == 2 and "name=value" in bad.stderr
    bad = run_cli("unmerge", "--state", st, "--expert", "ghost", "--out", tmp_path / "x-out", check=False)
    assert bad.returncode == 2 and "ghost" in bad.stderr and not (tmp_path / "x-out").exists()
    bad = run_cli("merge", "--base", tiny_bert, "--policy", "ties", "--out", tmp_path / "m", *experts, check=False)
    assert bad.returncode == 2 and "already exists" in bad.stderr


EXIT_SCRIPT = """
import atexit, os, sys, threading, time
from pathlib import Path
marks = Path(sys.argv[1])
real_exit = os._exit

def fast_exit(code):  # the exit that skips the interpreter's teardown, seen from outside
    (marks / "fast").write_text(str(code))
    real_exit(code)

os._exit = fast_exit
atexit.register(lambda: (marks / "atexit").write_text("ran"))

def late_work():  # still working when the command returns (it ends 0.5 s after the output exists)
    while not (marks.parent / "out").exists():
        time.sleep(0.01)
    time.sleep(0.5)
    (marks / "thread").write_text("done")

if sys.argv[2] == "thread":  # it must finish before the process ends
    threading.Thread(target=late_work).start()
if sys.argv[2] == "daemon-thread":  # a normal exit would not wait for it either (tqdm's monitor is one)
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
sys.argv = ["mergestream", *sys.argv[3:]]
from mergestream.cli import main
main()
"""


@pytest.mark.parametrize("case", ["ok", "thread", "daemon-thread", "bad"])
def test_a_one_shot_verb_ends_without_the_teardown_and_loses_nothing(tmp_path, case):
    """After fold/merge/unmerge/inspect succeed, the CLI ends with os._exit (the interpreter's
    teardown of torch took 0.4 s per command): the atexit hooks still run and stdout (a pipe, so
    block-buffered) arrives whole; with another non-daemon thread still alive, or after an error,
    the exit is the normal one (the thread finishes, status 2 stays); a daemon thread does not hold
    it back."""
    base = save_tensors(tmp_path / "base.safetensors", random_model(0))
    expert = save_tensors(tmp_path / "expert.safetensors", perturb(random_model(0), 0.01, 1))
    marks = tmp_path / "marks"
    marks.mkdir()
    policy = "nope" if case == "bad" else "task_arithmetic"
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(marks), case, "fold", "--base", str(base),
                           "--expert", str(expert), "--policy", policy, "--state", str(tmp_path / "st"),
                           "--out", str(tmp_path / "out"), "--json"], capture_output=True, text=True)
    assert (marks / "atexit").read_text() == "ran"
    if case == "bad":
        assert proc.returncode == 2 and "unknown policy" in proc.stderr and not (tmp_path / "out").exists()
        assert not (marks / "fast").exists()
        return
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["experts"] == ["expert"]  # the whole report, flushed
    check_merge_output(tmp_path / "out", base)
    if case == "thread":
        assert (marks / "thread").read_text() == "done" and not (marks / "fast").exists()
    else:
        assert (marks / "fast").read_text() == "0"


def test_expert_id_defaults():
    from mergestream.io.checkpoints import default_expert_id

    assert default_expert_id("/x/e2.safetensors") == "e2"
    assert default_expert_id("/x/my-expert/") == "my-expert"
    assert default_expert_id("run.pt") == "run"
