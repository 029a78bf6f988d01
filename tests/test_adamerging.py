"""AdaMerging-style per-layer coefficients on a real (tiny, randomly initialised) BERT encoder:
zero steps give the starting coefficients, learning lowers its own entropy objective, eq. 4 oracle."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call
from transformers import BertConfig, BertModel

from mergestream.policies.adamerging import (
    adamerging_coefficients,
    entropy_objective,
    layer_groups,
    merge_layerwise,
    prediction_entropy,
)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=48, max_position_embeddings=32)
    model = BertModel(cfg, add_pooling_layer=False).eval()
    base = {k: v.detach().clone() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    taus = [{k: 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(2)]
    heads = [(torch.randn(3, 32, generator=g), torch.zeros(3)), (torch.randn(4, 32, generator=g), torch.zeros(4))]
    batches = [torch.randint(0, 64, (8, 12), generator=g) for _ in range(2)]

    def forward(params, ids):
        return functional_call(model, params, (ids,)).last_hidden_state.mean(1)

    groups = layer_groups(list(base))
    return base, taus, heads, batches, forward, groups


def test_groups_follow_the_blocks(setup):
    groups = setup[5]
    assert groups["encoder.layer.0.attention.self.query.weight"] == 1
    assert groups["encoder.layer.1.output.dense.weight"] == 2
    assert groups["embeddings.word_embeddings.weight"] == 0 and max(groups.values()) == 2


def test_uniform_coefficients_are_task_arithmetic(setup):
    base, taus, *_, groups = setup
    merged = merge_layerwise(base, taus, torch.full((2, 3), 0.3), groups)
    for k, v in base.items():
        torch.testing.assert_close(merged[k], v + 0.3 * (taus[0][k] + taus[1][k]))
    with pytest.raises(ValueError, match="K=2"):
        merge_layerwise(base, taus, torch.zeros(3, 3), groups)


def test_zero_steps_are_the_starting_coefficients(setup):
    base, taus, heads, batches, forward, groups = setup
    f = entropy_objective(forward, base, taus, groups, heads, batches)
    start = torch.full((2, 3), 0.3)
    lam, hist = adamerging_coefficients(f, start, steps=0)
    assert torch.equal(lam, start) and len(hist) == 1
    assert hist[0] == pytest.approx(float(f(start)), rel=1e-6)


def test_learning_lowers_its_entropy_objective_within_bounds(setup):
    base, taus, heads, batches, forward, groups = setup
    f = entropy_objective(forward, base, taus, groups, heads, batches)
    start = torch.full((2, 3), 0.3)
    lam, hist = adamerging_coefficients(f, start, steps=15, lr=0.05)
    assert len(hist) == 16 and min(hist[1:]) < hist[0]
    assert float(f(lam)) == pytest.approx(min(hist), rel=1e-5) and float(f(lam)) < hist[0]
    assert float(lam.min()) >= 0.0 and float(lam.max()) <= 1.0 and not torch.equal(lam, start)


def test_entropy_is_zero_for_certain_and_log_c_for_uniform():
    assert float(prediction_entropy(torch.tensor([[100.0, 0.0, 0.0]]))) == pytest.approx(0.0, abs=1e-6)
    assert float(prediction_entropy(torch.zeros(2, 4))) == pytest.approx(float(torch.log(torch.tensor(4.0))))
