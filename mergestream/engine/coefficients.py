"""AdaMerging-style per-layer coefficients as a fold's coefficient search (``coefficients: adamerging``).

The math is :mod:`mergestream.policies.adamerging` (Yang et al., ICLR 2024, layer-wise AdaMerging,
eq. 4-5). This module is what the engine and its callers need around it:

* :func:`learn_layer_coefficients` — run by :func:`mergestream.engine.folding.fold` after the fold pass of
  a policy whose ``searches_coefficients()`` is ``"adamerging"`` (MDM-OC). The new expert's
  direction d (rebuilt from the state just written) gets one coefficient per layer group g
  (:func:`~mergestream.policies.adamerging.layer_groups`: 0 outside the blocks, N + 1 for block N):

      θ(λ) = θ₀ + Σ_{k<K} α_k d_k + λ_g(name) d,

  earlier experts keep the coefficients the state holds for them (our choice: one fold learns only
  its own expert's G values, so a fold never moves what earlier folds decided, and replay can refold
  each expert with the values it recorded). λ starts at ``layer_alphas`` or ``alpha`` and is learned
  by Adam on a differentiable objective of θ(λ), clamped to [0, 1] (the paper's range); the best
  iterate is kept. The state is then rewritten with each tensor's λ in its ``alphas`` field.
* :class:`EntropyObjective` — the objective the daemon and the benchmark hand it: Σ over task heads
  of the mean prediction entropy (eq. 5) on unlabeled inputs (the daemon's RI auxiliary data), on
  one resident copy of the encoder whose parameters are swapped for θ(λ) with
  :func:`torch.func.functional_call`.

Memory: unlike the streaming fold, the learning holds θ₀ + Σ α_k d_k and d as float32 tensors, and
each step builds θ(λ) and its autograd graph: about 3× the model's float32 size plus the encoder's
activations on the unlabeled inputs. That is fine for the encoders the daemon's probes run (MiniLM:
~90 MB per copy); above ``ada_max_mib`` (a policy parameter) the fold is refused before anything is
loaded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from ..errors import MergestreamError, PolicyError
from ..io.checkpoints import Checkpoint, is_float_dtype
from ..io.state import SEP
from ..io.writers import AppendWriter
from ..policies import Policy
from ..policies.adamerging import adamerging_coefficients, layer_groups, merge_layerwise, prediction_entropy
from ..policies.lines import block_count
from ..datasteps.ri import AuxItem, FeatureModel, Head, match_names

log = logging.getLogger("mergestream.engine")

#: objective(params) -> 0-d loss: ``params`` maps checkpoint tensor names to float32 tensors of θ(λ)
#: (differentiable in λ); lower is better.
LayerObjective = Callable[[dict[str, torch.Tensor]], torch.Tensor]
#: the range λ is clamped to after each step (AdaMerging's)
BOUNDS = (0.0, 1.0)


class CoefficientError(MergestreamError):
    """The adamerging objective cannot be built: no task head, no unlabeled input, or a head that
    does not fit the encoder's features."""


def starting_coefficients(pol: Policy, n_groups: int) -> list[float]:
    """λ's start: the policy's ``layer_alphas`` (one per group), else ``alpha`` for every group.

    Raises:
        PolicyError: ``layer_alphas`` has another length than ``n_groups``.
    """
    la = pol.params.layer_alphas
    if la is None:
        return [float(pol.params.alpha)] * n_groups
    if len(la) != n_groups:
        raise PolicyError(f"layer_alphas has {len(la)} values, the model has {n_groups} layer groups")
    return [float(a) for a in la]


def learn_layer_coefficients(pol: Policy, base: Checkpoint, read_state: Callable[[str], dict[str, torch.Tensor]],
                             objective: LayerObjective, dev: torch.device) -> tuple[list[float], dict[str, float]]:
    """Learn the new direction's per-layer λ (module docstring).

    Args:
        pol: the policy of the fold (MDM-OC, possibly with LiNeS); its state fields per tensor come
            from ``read_state(name)`` and hold an ``alphas`` field (the fold pass wrote it).
        base: θ₀. objective: see :data:`LayerObjective`. dev: where the tensors live.

    Returns:
        (λ per layer group, G floats: the start itself, as given, unless a step lowered the
        objective; ``{"evaluations", "steps", "objective_start", "objective"}``).

    Raises:
        PolicyError: the float tensors are larger than ``ada_max_mib`` allows, or no tensor has state.
    """
    p = pol.params
    names = [m.name for m in base.metas() if is_float_dtype(m.dtype)]
    need = 3 * 4 * sum(base.meta(n).numel for n in names)
    if need > p.ada_max_mib * 2**20:
        raise PolicyError(f"coefficients=adamerging holds the model in memory (~{need / 2**20:.0f} MiB of float32 "
                          f"here) and ada_max_mib is {p.ada_max_mib:g}: raise it, or use fixed / cmaes coefficients")
    n_groups = block_count(base.keys()) + 1
    start = starting_coefficients(pol, n_groups)
    groups = layer_groups(names)
    fixed: dict[str, torch.Tensor] = {}
    new: dict[str, torch.Tensor] = {}
    for n in names:
        st = {k: v.to(dev) for k, v in read_state(n).items()}
        alphas = st.pop("alphas", None)
        if alphas is None:
            continue
        b = base.get(n).to(dev, torch.float32)
        for k in range(alphas.shape[0] - 1):  # earlier experts at their stored per-tensor α
            c = pol.contribution(st, k, float(alphas[k]), b.shape)
            if c is not None:
                b += c
        d = pol.contribution(st, alphas.shape[0] - 1, 1.0, b.shape)
        fixed[n], new[n] = b, (torch.zeros_like(b) if d is None else d)
    if not fixed:
        raise PolicyError("coefficients=adamerging: no tensor of the state holds per-layer coefficients")
    start_t = torch.tensor([start], dtype=torch.float32, device=dev)

    def f(lam: torch.Tensor) -> torch.Tensor:
        return objective(merge_layerwise(fixed, [new], lam, groups))

    t0 = time.perf_counter()
    best, hist = adamerging_coefficients(f, start_t, steps=p.ada_steps, lr=p.ada_lr, bounds=BOUNDS)
    profile = start if torch.equal(best, start_t) else [float(x) for x in best[0]]
    log.info("adamerging coefficients=%s objective_start=%.6g objective=%.6g steps=%d seconds=%.2f",
             [round(x, 4) for x in profile], hist[0], min(hist), p.ada_steps, time.perf_counter() - t0)
    return profile, {"evaluations": float(len(hist)), "steps": float(p.ada_steps), "objective_start": hist[0],
                     "objective": min(hist)}


def write_learned_state(base: Checkpoint, read_state: Callable[[str], dict[str, torch.Tensor]], profile: list[float],
                        dst: Path) -> None:
    """Copy a state file (every field of every tensor of θ₀, read through ``read_state``) to
    ``dst``, with the last entry of each ``alphas`` field set to its layer group's λ."""
    names = base.keys()
    groups = layer_groups(names)
    writer = AppendWriter(dst, header_bytes=4096 + sum((len(n.encode()) + 160) * 6 for n in names))
    try:
        for n in names:
            for fld, t in read_state(n).items():
                if fld == "alphas":
                    t = t.clone()
                    t[-1] = profile[groups[n]]
                writer.write(f"{n}{SEP}{fld}", t)
        writer.close()
    except BaseException:
        writer.abort()
        raise


class _Features(torch.nn.Module):
    """``items -> features`` of a feature model as one module, so functional_call can swap its parameters."""

    def __init__(self, fm: FeatureModel, model: torch.nn.Module):
        super().__init__()
        self.fm, self.model = fm, model

    def forward(self, items: list[AuxItem]) -> torch.Tensor:
        return self.fm.features(self.model, items)


class EntropyObjective:
    """params ↦ Σ_k mean entropy of softmax(head_k(features(x; params))) over unlabeled inputs x
    (AdaMerging eq. 5), a :data:`LayerObjective`.

    Args:
        base: θ₀'s folder, loaded once with ``feature_model.load`` (a private float32 copy; its
            parameters are only swapped, never changed).
        heads: task name → (weight (C, H), bias (C,)) of its linear head.
        aux: the unlabeled inputs (every head sees all of them: the daemon's RI data is shared).
        feature_model: how inputs become (B, H) features (RI's :class:`~mergestream.datasteps.ri.FeatureModel`;
            the default Hugging Face encoder + pooling of :func:`mergestream.datasteps.ri.load_feature_model`).
        batch_size: inputs per forward pass (all batches are in one graph: the loss is exact, not a
            mini-batch estimate, so the best iterate is comparable across steps).
        device: torch device of the forward passes.
        on_eval: called after each evaluation with (None, the values dict) — heartbeats, logging.

    Attributes:
        evaluations: list of ([], {"score": −entropy sum, "entropy.<task>": ...}) in call order
            (the daemon logs them like CMA-ES evaluations).

    Raises:
        CoefficientError: no head or no input; at call time a head whose input size is not the
            features', or a candidate none of whose tensors is a parameter of the encoder.
    """

    def __init__(self, base: str | Path, heads: Mapping[str, Head], aux: Sequence[AuxItem], *,
                 feature_model: FeatureModel, batch_size: int = 32, device: str | torch.device = "cpu",
                 on_eval: Callable[[None, dict[str, float]], None] | None = None):
        if not heads:
            raise CoefficientError("coefficients=adamerging needs at least one task head (an accepted expert's or "
                                   "the candidate's mergestream_probe/)")
        if not aux:
            raise CoefficientError("coefficients=adamerging needs unlabeled inputs (policy.ri.data)")
        self.device = torch.device(device)
        model = feature_model.load(Path(base), self.device)
        for prm in model.parameters():
            prm.requires_grad_(False)
        self.module = _Features(feature_model, model).eval()
        self.sd_names = {k: None for k in model.state_dict()}
        self.heads = {t: (w.to(self.device, torch.float32), b.to(self.device, torch.float32)) for t, (w, b) in heads.items()}
        self.batches = [list(aux[i:i + batch_size]) for i in range(0, len(aux), batch_size)]
        self.on_eval = on_eval
        self._map: dict[str, str] | None = None
        self.evaluations: list[tuple[list[float], dict[str, float]]] = []

    def __call__(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        if self._map is None:
            self._map = match_names(list(params), self.sd_names)
            if not self._map:
                raise CoefficientError(f"none of the candidate's tensors ({list(params)[:3]} ...) is a parameter of "
                                       "the encoder the objective runs")
        swapped = {"model." + self._map[n]: t for n, t in params.items() if n in self._map}
        feats = torch.cat([torch.func.functional_call(self.module, swapped, (batch,)) for batch in self.batches])
        total = feats.new_zeros(())
        vals: dict[str, float] = {}
        for task, (w, b) in self.heads.items():
            if w.shape[1] != feats.shape[1]:
                raise CoefficientError(f"task {task!r}: head expects {w.shape[1]} features, the encoder gives "
                                       f"{feats.shape[1]}")
            e = prediction_entropy(feats @ w.T + b)
            vals[f"entropy.{task}"] = float(e.detach())
            total = total + e
        vals["score"] = -float(total.detach())
        self.evaluations.append(([], vals))
        if self.on_eval is not None:
            self.on_eval(None, vals)
        return total
