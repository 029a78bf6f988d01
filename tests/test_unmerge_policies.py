"""Subtract-unmerge leaves every policy's state as if the expert had never been folded (issue 13,
R7b): fold A, fold B, subtract B, fold C is fold A, fold C, for every registered policy; and what each
policy promises when the removed expert is not the last one."""

from __future__ import annotations

import math

import pytest
import torch

from mergestream import engine
from mergestream.engine import residuals
from mergestream.io.checkpoints import read_state_dict
from mergestream.io.state import StateDir
from mergestream.policies import REGISTRY, TensorContext, make_policy

from .conftest import perturb, random_model, save_tensors

#: every registered policy, with parameters that keep the tests fast (SAFE-Merge: a few Adam steps on
#: a small general subspace, so its structured path runs on 48 × 40 weights)
POLICIES = [("task_arithmetic", {"lambda": 0.7}), ("task_arithmetic", {"lambda": 0.5, "k": 30}),
            ("ties", {"k": 30}), ("safe_merge", {"steps": 3, "k": 4, "k_s": 4, "rank": 2, "k_old": 4}),
            ("mdm_oc", {"alpha": 0.5}), ("mdm_oc", {"alpha": 0.5, "rank": 4}), ("opcm", {"alpha": 0.5}),
            ("magmax", {"lambda": 0.5}), ("dop", {"alpha": 0.7}), ("dop", {"solver": "adam", "steps": 3}),
            ("weight_average", {})]
IDS = [f"{p}-{'-'.join(f'{k}{v}' for k, v in q.items())}" for p, q in POLICIES]


def test_every_registered_policy_is_covered():
    """Every policy subtracts (the tests below) or refuses subtract and names replay (Iso-C, whose state
    is the running sum of τ: tests/test_iso_c.py checks the refusal and its replay; Iso-CTS, whose state
    holds every τ merged together; OPCM with scope=global: tests/test_conformance.py)."""
    refusing = {n for n in REGISTRY if not make_policy(n).subtract_unmerge}
    assert refusing == {"iso_c", "iso_cts"}
    assert {p for p, _ in POLICIES} == set(REGISTRY) - refusing


def _setup(tmp_path, dtype, n=4):
    base = random_model(0, dtype)
    bpath = save_tensors(tmp_path / "base.safetensors", base)
    experts = {c: save_tensors(tmp_path / f"{c}.safetensors", perturb(base, 0.05, 10 + i))
               for i, c in enumerate("ABCD"[:n])}
    return base, bpath, experts


class _Chain:
    """Folds into one state folder, each onto the previous output (or the last unmerge's)."""

    def __init__(self, tmp_path, tag, bpath, policy, params):
        self.tmp, self.tag, self.bpath, self.policy, self.params = tmp_path, tag, bpath, policy, params
        self.state, self.current, self.n = tmp_path / f"{tag}-state", None, 0

    def _out(self):
        self.n += 1
        return self.tmp / f"{self.tag}-{self.n}"

    def fold(self, expert, eid):
        out = self._out()
        engine.fold(self.bpath, self.current, expert, self.policy, self.params, state_dir=self.state, out=out,
                    expert_id=eid)
        self.current = out
        return read_state_dict(out)

    def subtract(self, eid):
        out = self._out()
        engine.unmerge(self.state, eid, "subtract", out=out)
        self.current = out
        return read_state_dict(out)

    def states(self, names):
        sd = StateDir(self.state)
        try:
            return {n: sd.tensor_state(n) for n in names}
        finally:
            sd.close()

    def manifest(self):
        return StateDir(self.state).manifest


def _bits(t):
    return residuals.bits(t) if t.is_floating_point() else t


def _assert_same(a, b, exact, what, through=None):
    """Byte-equal, or (``exact`` False) rounded once or twice more on the way: within a few units in
    the last place of the storage dtype of the largest value on the path (``through``: the backbone
    θ − α δ⊥ was computed from, which in bf16 can be far larger than the result)."""
    assert a.keys() == b.keys(), what
    for k in a:
        if exact or not a[k].is_floating_point():
            assert a[k].dtype == b[k].dtype and torch.equal(_bits(a[k]), _bits(b[k])), (what, k)
            continue
        x, y = a[k].double(), b[k].double()
        big = torch.maximum(x.abs(), y.abs())
        if through is not None:
            big = torch.maximum(big, through[k].double().abs())
        bound = 3 * torch.finfo(a[k].dtype).eps * big + 1e-6
        assert ((x - y).abs() <= bound).all(), (what, k, float((x - y).abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("policy,params", POLICIES, ids=IDS)
def test_subtract_of_the_latest_then_a_fold_equals_never_folding_it(tmp_path, dtype, policy, params):
    """fold A, fold B, subtract B, fold C == fold A, fold C: the weights, every per-tensor state field,
    the fold records' coefficients and the fold count (TensorContext.n_previous). Byte for byte
    for the policies whose residual is stored; MDM-OC rebuilds α δ⊥ from its state (float32 rounding)."""
    base, bpath, ex = _setup(tmp_path, dtype, 3)
    exact = not make_policy(policy, params).contributions_in_state
    names = [k for k, v in base.items() if v.is_floating_point()]
    one = _Chain(tmp_path, "with-b", bpath, policy, params)
    want_a = one.fold(ex["A"], "A")
    state_a = one.states(names)
    with_b = one.fold(ex["B"], "B")
    _assert_same(one.subtract("B"), want_a, exact, "after subtract B", with_b)
    for n in names:  # the state is A's again, byte for byte (drop_from_state only selects entries)
        _assert_same(one.states([n])[n], state_a[n], True, f"state of {n} after subtract B")
    got = one.fold(ex["C"], "C")
    two = _Chain(tmp_path, "without-b", bpath, policy, params)
    two.fold(ex["A"], "A")
    want = two.fold(ex["C"], "C")
    _assert_same(got, want, exact, "fold C after subtract B", with_b)
    for n in names:
        _assert_same(one.states([n])[n], two.states([n])[n], exact, f"state of {n} after fold C")
    m1, m2 = one.manifest(), two.manifest()
    assert m1.ids() == m2.ids() == ["A", "C"] and m1.coefficients() == m2.coefficients()


def test_task_arithmetic_subtract_of_an_earlier_expert_then_a_fold_equals_never_folding_it(tmp_path):
    """Task Arithmetic's folds never depend on each other: subtracting an earlier expert is the
    "never merged" model for every later fold too (within float32 rounding)."""
    _, bpath, ex = _setup(tmp_path, torch.float32)
    params = {"lambda": 0.6, "k": 50}
    one = _Chain(tmp_path, "all", bpath, "task_arithmetic", params)
    for c in "ABC":
        one.fold(ex[c], c)
    one.subtract("A")
    got = one.fold(ex["D"], "D")
    two = _Chain(tmp_path, "never-a", bpath, "task_arithmetic", params)
    for c in "BC":
        two.fold(ex[c], c)
    _assert_same(got, two.fold(ex["D"], "D"), False, "fold D after subtract A")
    assert one.manifest().ids() == ["B", "C", "D"]


def _norm(t):
    return float(t.double().norm())


def test_opcm_subtract_of_an_earlier_expert_keeps_the_running_mean_of_the_others(tmp_path):
    """OPCM after subtracting an earlier expert (its later folds depended on it: approximate, see
    the module docstring): its ‖τ‖ and λ leave the state, the others' entries are untouched, and
    the next fold scales the merged task vector to the mean ‖τ‖ of exactly the remaining experts."""
    base, bpath, ex = _setup(tmp_path, torch.float32)
    taus = {c: {k: v - base[k] for k, v in read_state_dict(p).items() if v.is_floating_point()} for c, p in ex.items()}
    one = _Chain(tmp_path, "opcm", bpath, "opcm", {"alpha": 0.5})
    for c in "ABC":
        one.fold(ex[c], c)
    names = list(taus["A"])
    before = one.states(names)
    one.subtract("B")
    after = one.states(names)
    for n in names:
        assert torch.equal(after[n]["norms"], before[n]["norms"][[0, 2]]), n
        assert torch.equal(after[n]["lams"], before[n]["lams"][[0, 2]]), n
        assert torch.equal(after[n]["lam"], before[n]["lams"][2:]), n  # the latest remaining fold's λ
    got = one.fold(ex["D"], "D")
    for n in names:
        norms = torch.tensor([_norm(taus[c][n]) for c in "ACD"], dtype=torch.float32)
        torch.testing.assert_close(one.states([n])[n]["norms"], norms, rtol=1e-6, atol=0)
        assert math.isclose(_norm(got[n] - base[n]), float(norms.mean()), rel_tol=1e-4), n


@pytest.mark.parametrize("rank", [0, 4])
def test_mdm_oc_subtract_of_an_earlier_expert_leaves_a_state_that_describes_the_backbone(tmp_path, rank):
    """MDM-OC: θ − α_k δ_k⊥ removes exactly what fold k added; the state keeps the other directions
    unchanged (it rebuilds the new backbone), a later fold stays orthogonal to them, and subtracting
    that later fold restores the backbone. (The others lost their overlap with δ_k when they were
    projected: "never merged" is `replay`.)"""
    base, bpath, ex = _setup(tmp_path, torch.float32)
    params = {"alpha": 0.5, "rank": rank}
    pol = make_policy("mdm_oc", params)
    one = _Chain(tmp_path, "oc", bpath, "mdm_oc", params)
    for c in "ABC":
        one.fold(ex[c], c)
    names = [k for k, v in base.items() if v.is_floating_point()]
    before = one.states(names)
    minus_b = one.subtract("B")
    coeffs = one.manifest().coefficients()
    assert one.manifest().ids() == ["A", "C"] and coeffs == [0.5, 0.5]
    after = one.states(names)
    for n in names:
        for i, j in ((0, 0), (1, 2)):
            want = pol._direction(before[n], j, base[n].shape)
            assert torch.equal(pol._direction(after[n], i, base[n].shape), want), (n, i)
        torch.testing.assert_close(pol.rebuild(base[n], after[n], coeffs), minus_b[n], rtol=1e-5, atol=1e-6)
    one.fold(ex["D"], "D")
    st = one.states(names)
    for n in names:
        d = pol._direction(st[n], 2, base[n].shape).reshape(-1)
        for i in (0, 1):
            o = pol._direction(st[n], i, base[n].shape).reshape(-1)
            if _norm(d) > 0 and _norm(o) > 0:
                assert abs(float(torch.dot(d, o))) <= 1e-5 * _norm(d) * _norm(o), (n, i)
    _assert_same(one.subtract("D"), minus_b, False, "subtract D after subtract B")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_mdm_oc_state_costs_the_model_in_its_storage_width_and_the_fold_applies_it_as_stored(tmp_path, dtype):
    """Issue 11 item 3: MDM-OC keeps one unit direction per fold in the checkpoint's width (bf16 for
    16-bit checkpoints, float32 otherwise; norms float32), the fold adds exactly the stored direction
    (θ_1 = cast(θ₀ + α‖δ⊥‖·q) byte for byte, q as stored), later folds stay orthogonal to the stored
    directions, and subtract of the latest restores the previous backbone within the storage rounding."""
    base, bpath, ex = _setup(tmp_path, dtype, 3)
    names = [k for k, v in base.items() if v.is_floating_point()]
    alpha = 0.5
    one = _Chain(tmp_path, "oc", bpath, "mdm_oc", {"alpha": alpha})
    want_q = torch.float32 if dtype == torch.float32 else torch.bfloat16
    outs = []
    for k, c in enumerate("ABC", 1):
        outs.append(one.fold(ex[c], c))
        st = one.states(names)
        for n in names:
            assert st[n]["Q"].dtype == want_q and st[n]["norms"].dtype == torch.float32, n
            assert st[n]["Q"].shape == (k, base[n].numel()), n
        if k == 1:
            for n in names:
                q, norm = st[n]["Q"][0].float(), float(st[n]["norms"][0])
                applied = base[n].float().add_(q.view(base[n].shape), alpha=alpha * norm).to(dtype)
                assert torch.equal(_bits(applied), _bits(outs[0][n])), n
    for n in names:  # the last direction is orthogonal to the stored (rounded) earlier ones
        Q = st[n]["Q"].double()
        gram = Q @ Q.T
        off = gram - torch.diag(torch.diagonal(gram))
        assert float(off.abs().max()) <= (1e-5 if dtype == torch.float32 else 2**-9), n
    _assert_same(one.subtract("C"), outs[1], False, "subtract C", outs[2])


def test_opcm_state_written_before_the_lambda_history_still_unmerges():
    """A state from before ``lams`` (only ``lam``): with one fold left λ₁ = 1 is known exactly;
    otherwise ``lam`` stays as it was (nothing better is known)."""
    pol = make_policy("opcm")
    old = {"norms": torch.tensor([2.0, 3.0]), "lam": torch.tensor([0.8])}
    out = pol.drop_from_state(old, 1)
    assert torch.equal(out["norms"], torch.tensor([2.0])) and torch.equal(out["lam"], torch.tensor([1.0]))
    assert "lams" not in out
    three = {"norms": torch.tensor([2.0, 3.0, 4.0]), "lam": torch.tensor([0.7])}
    out = pol.drop_from_state(three, 2)
    assert torch.equal(out["norms"], torch.tensor([2.0, 3.0])) and torch.equal(out["lam"], torch.tensor([0.7]))
    # the next fold on such a state starts the history: unknown earlier λ are NaN, the last one known
    g = torch.Generator().manual_seed(0)
    b = torch.randn(6, 5, generator=g)
    res = pol.fold_tensor(b, b + torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g), three,
                          TensorContext("w", 3))
    lams = res.state["lams"]
    assert lams.shape == (4,) and bool(torch.isnan(lams[:2]).all()) and float(lams[2]) == pytest.approx(0.7)
    assert torch.equal(lams[3:], res.state["lam"])
