"""The RI (Resolving Interference) pre-step: loss, identities, budgets, user forward functions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mergestream import engine
from mergestream.datasteps.ri import (
    HFEncoderFeatures,
    RIError,
    RIParams,
    adapt_expert,
    load_feature_model,
    read_aux,
    resolve_interference,
)

from .conftest import load_dir, make_hf_expert, save_tensors
from .test_probes import WORDS, bert, sentences, tok_dir  # noqa: F401 - fixtures

H = 32


def heads(seed: int, classes=(3, 4, 2)) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(c, H, generator=g), torch.randn(c, generator=g)) for c in classes]


@pytest.fixture(scope="module")
def expert(bert, tmp_path_factory) -> Path:
    return make_hf_expert(bert, tmp_path_factory.mktemp("ri") / "expert", seed=3, scale=0.05)


@pytest.fixture
def aux() -> list[tuple[str, None]]:
    return [(s, None) for s in sentences(48, seed=11)]


def test_ri_loss_decreases_and_only_trained_tensors_change(bert, expert, aux, tmp_path):
    own, *others = heads(0)
    out, res = adapt_expert(expert, bert, tmp_path / "adapted", own_head=own, other_heads=others, aux=aux,
                            params=RIParams(steps=40, lr=1e-3, batch_size=8), cache_dir=tmp_path / "cache")
    assert res.steps == 40 and res.stopped == "steps" and res.other_heads == 2
    assert res.loss_before > 0
    assert res.loss_after < 0.5 * res.loss_before
    # the base-term is what RI reduces; the own-head term stays small
    assert res.own_kl_after < res.loss_before
    a, e = load_dir(out), load_dir(expert)
    assert set(a) == set(e) and all(a[k].dtype == e[k].dtype for k in a)
    changed = {k for k in a if not torch.equal(a[k], e[k])}
    assert any(k.startswith("encoder.layer") for k in changed)
    assert not any(k.startswith("pooler.") for k in changed)  # no gradient reaches the unused pooler
    assert (out / "config.json").exists() and (out / "tokenizer_config.json").exists()
    assert list((tmp_path / "cache").glob("ri-base-*.safetensors"))
    # the adapted expert folds like any other expert
    rep = engine.fold(bert, None, out, "task_arithmetic", {"lambda": 0.5}, state_dir=tmp_path / "s",
                      out=tmp_path / "v1", expert_id="adapted")
    assert rep.experts == ["adapted"]


def _perturbed_student(aux, noise: float):
    """A bag-of-words teacher with head 1's logits on ``aux``, and a student = teacher + ``noise``·N(0, 1)
    per weight: (features, own head, other heads, teacher logits, student, student's start state)."""
    fm = BagOfWordsFeatures()
    torch.manual_seed(0)
    teacher_model = BagOfWords()
    own, *others = heads(1)
    with torch.no_grad():
        teacher = fm.features(teacher_model, aux) @ own[0].T + own[1]
    student = BagOfWords()
    start = {k: v + noise * torch.randn_like(v) for k, v in teacher_model.state_dict().items()}
    student.load_state_dict(start)
    return fm, own, others, teacher, student, start


def test_alpha_zero_pulls_a_perturbed_model_back_to_the_experts_own_outputs(aux):
    """With α = 0 only the own-head term is left: from a perturbed start, enough steps bring the
    model back to the expert's outputs (the teacher)."""
    fm, own, others, teacher, student, _ = _perturbed_student(aux, 0.3)
    res = resolve_interference(student, fm.features, aux, torch.zeros(len(aux), H), own, others,
                               RIParams(alpha=0.0, steps=300, lr=1e-2, batch_size=16), teacher_logits=teacher)
    assert res.loss_before > 0.05
    assert res.loss_after < 0.02 * res.loss_before
    with torch.no_grad():
        p = F.softmax(fm.features(student, aux) @ own[0].T + own[1], -1)
    torch.testing.assert_close(p, F.softmax(teacher, -1), atol=0.05, rtol=0)


def test_alpha_zero_on_the_expert_itself_keeps_it_exactly(bert, expert, aux, tmp_path):
    own, *others = heads(1)
    out, res = adapt_expert(expert, bert, tmp_path / "adapted", own_head=own, other_heads=others, aux=aux,
                            params=RIParams(alpha=0.0, steps=60, lr=1e-3, batch_size=8))
    assert out == expert and res.stopped == "identity"
    # the optimisation itself, forced to run from the expert, moves its own outputs only by
    # AdamW's normalised float-rounding noise (~lr per step): why the identity shortcut exists
    fm = HFEncoderFeatures(bert)
    m = fm.load(expert, torch.device("cpu"))
    with torch.no_grad():
        teacher = fm.features(m, aux) @ own[0].T + own[1]
    res = resolve_interference(m, fm.features, aux, torch.zeros(len(aux), H), own, others,
                               RIParams(alpha=0.0, steps=30, lr=1e-5, batch_size=8), teacher_logits=teacher)
    assert res.steps == 30 and res.loss_after < 1e-4
    torch.testing.assert_close(own_probs_of(m, fm, aux, own), F.softmax(teacher, -1), atol=1e-2, rtol=0)


@pytest.mark.parametrize("eval_every", [0, 1, 4])
def test_best_iterate_is_kept_when_the_steps_overshoot(aux, eval_every):
    """A start near the minimum and a learning rate far too large: AdamW's last iterate ends above
    where it started; with ``eval_every`` the best evaluated iterate (here θᵢ itself) is returned."""
    fm, own, others, teacher, student, start = _perturbed_student(aux, 1e-3)
    res = resolve_interference(student, fm.features, aux, torch.zeros(len(aux), H), own, others,
                               RIParams(alpha=0.0, steps=12, lr=0.5, batch_size=16, eval_every=eval_every),
                               teacher_logits=teacher)
    assert res.steps == 12 and res.eval_losses[0] == (0, res.loss_before)
    if eval_every == 0:
        assert res.best_step == 12 and res.loss_after > res.loss_before  # the overshoot is real
    else:
        assert res.loss_after <= res.loss_before
        assert res.loss_after == min(loss for _, loss in res.eval_losses)
        assert res.best_step % eval_every == 0 or res.best_step == 12
        if res.best_step == 0:
            assert all(torch.equal(student.state_dict()[k], v) for k, v in start.items())
    with pytest.raises(RIError):
        RIParams(eval_every=-1)


def own_probs_of(model, fm, aux, head) -> torch.Tensor:
    with torch.no_grad():
        return F.softmax(fm.features(model, list(aux)) @ head[0].T + head[1], -1)


def test_zero_step_budget_is_the_identity(bert, expert, aux, tmp_path):
    own, *others = heads(0)
    out, res = adapt_expert(expert, bert, tmp_path / "adapted", own_head=own, other_heads=others, aux=aux,
                            params=RIParams(steps=0))
    assert out == expert and res.steps == 0 and res.stopped == "identity"
    assert not (tmp_path / "adapted").exists()


def test_time_budget_stops_the_optimisation(bert, expert, aux, tmp_path):
    own, *others = heads(0)
    _, res = adapt_expert(expert, bert, tmp_path / "adapted", own_head=own, other_heads=others, aux=aux,
                          params=RIParams(steps=10_000, time_budget_seconds=0.0))
    assert res.stopped == "time" and res.steps == 0


def test_first_expert_without_other_heads_is_left_unchanged(bert, expert, aux, tmp_path):
    own, *_ = heads(0)
    out, res = adapt_expert(expert, bert, tmp_path / "adapted", own_head=own, other_heads=[], aux=aux,
                            params=RIParams(steps=20, lr=1e-3))
    assert out == expert and res.stopped == "identity" and res.other_heads == 0


def test_bad_inputs_are_clear_errors(bert, expert, aux, tmp_path):
    own, *others = heads(0)
    with pytest.raises(RIError, match="hidden size"):
        adapt_expert(expert, bert, tmp_path / "x", own_head=(torch.zeros(3, H + 1), torch.zeros(3)),
                     other_heads=others, aux=aux, params=RIParams(steps=2))
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(RIError, match="no auxiliary inputs"):
        read_aux(tmp_path / "empty.txt")
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"txt": 3}\n')
    with pytest.raises(RIError, match="bad.jsonl:2"):
        read_aux(tmp_path / "bad.jsonl")
    with pytest.raises(RIError, match="package.module:factory"):
        load_feature_model("nocolon", tokenizer=bert)
    with pytest.raises(RIError):
        RIParams(lr=0)
    assert not (tmp_path / "x").exists()


def test_read_aux_text_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("one\n\n two \nthree\n")
    assert read_aux(tmp_path / "a.txt") == [("one", None), ("two", None), ("three", None)]
    (tmp_path / "a.jsonl").write_text('{"text": "x", "text2": "y", "label": 1}\n{"text": "z"}\n')
    assert read_aux(tmp_path / "a.jsonl") == [("x", "y"), ("z", None)]
    assert read_aux(tmp_path / "a.txt", max_examples=2) == [("one", None), ("two", None)]


# ------------------------------------------------------------------------------------------
# A user-provided forward function on a non-Hugging Face model stored as one safetensors file
# ------------------------------------------------------------------------------------------
class BagOfWords(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(len(WORDS), H)
        self.proj = torch.nn.Linear(H, H)


class BagOfWordsFeatures:
    """A FeatureModel: mean word embedding through a tanh projection."""

    identity = "tests.bag-of-words"

    def load(self, path: Path, device: torch.device) -> torch.nn.Module:
        from safetensors.torch import load_file

        m = BagOfWords()
        m.load_state_dict(load_file(str(path)))
        return m.to(device)

    def features(self, model: torch.nn.Module, items) -> torch.Tensor:
        idx = [torch.tensor([WORDS.index(w) for w in t.split()]) for t, _ in items]
        return torch.stack([torch.tanh(model.proj(model.emb(i).mean(0))) for i in idx])


def make_bag_of_words_features() -> BagOfWordsFeatures:
    return BagOfWordsFeatures()


def test_user_forward_function_on_a_plain_safetensors_model(tmp_path, aux):
    torch.manual_seed(0)
    base = save_tensors(tmp_path / "base.safetensors", {k: v.detach().clone() for k, v in BagOfWords().state_dict().items()})
    exp = {k: v + 0.1 * torch.randn_like(v) for k, v in load_dir(base).items()}
    exp_path = save_tensors(tmp_path / "expert.safetensors", exp)
    fm = load_feature_model("tests.test_ri:make_bag_of_words_features", tokenizer=tmp_path)
    own, *others = heads(4)
    out, res = adapt_expert(exp_path, base, tmp_path / "adapted", own_head=own, other_heads=others, aux=aux,
                            params=RIParams(steps=50, lr=1e-2, batch_size=8), feature_model=fm)
    assert res.loss_after < 0.5 * res.loss_before
    adapted = load_dir(out)
    assert set(adapted) == set(exp) and not torch.equal(adapted["proj.weight"], exp["proj.weight"])


def test_resolve_interference_validates_base_features(aux):
    m = BagOfWords()
    fm = BagOfWordsFeatures()
    own, *others = heads(0)
    with pytest.raises(RIError, match="base_features"):
        resolve_interference(m, fm.features, aux, torch.zeros(len(aux) - 1, H), own, others, RIParams(steps=1))
    with pytest.raises(RIError, match="at least one"):
        resolve_interference(m, fm.features, [], torch.zeros(0, H), own, others, RIParams(steps=1))
