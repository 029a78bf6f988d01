"""Distil: a post-step that pulls a folded backbone back toward every expert's own outputs.

A fold (any policy) gives the backbone θ. With a few unlabeled inputs xⱼ of each task j folded so
far, its task head hⱼ and the log-probabilities pⱼ = log softmax hⱼ(f_θⱼ(xⱼ)) of expert j's own
outputs (recorded once, when expert j arrives), θ (initialised at the fold's result) minimises

    L(θ) = 1/N · Σⱼ KL(pⱼ ‖ log softmax hⱼ(f_θ(xⱼ)))  +  γ · ‖Ĉ_θ − Ĉ_θ₀‖²_F / B

over N tasks, where Ĉ is the B × B cosine-similarity matrix of the pooled features of one batch
(every task's inputs together). The first term is knowledge distillation from each expert
(Hinton et al., arXiv 1503.02531) on few unlabeled inputs, the form data-aided merging uses to
recover what a merge lost (e.g. ProDistill, Xu et al., ICML 2025, which distils layer-wise
features); ours distils each task's head outputs, so only the heads and a handful of inputs are
kept per task. The second term is similarity-preserving distillation (Tung & Mori, ICCV 2019,
Eq. 2-4) toward θ₀: it keeps the geometry of θ₀'s embedding space, which general-knowledge probes
(sentence similarity) read, and which the KL term alone erodes. γ = 0 drops it.

Two layers, as in :mod:`mergestream.datasteps.ri` (whose feature models, auxiliary data and checkpoint
writer this module uses):

* :func:`distill` — the optimisation on an in-memory module; no I/O.
* :func:`distill_backbone` — on a backbone folder: loads it with a :class:`~mergestream.datasteps.ri.FeatureModel`,
  caches θ₀'s features of the inputs, optimises under a step and a time budget, and writes the
  result with the backbone's tensor names, dtypes, other files and header metadata (plus
  ``mergestream.distill``), staged and renamed.

Like RI it trains: the whole backbone, its gradients and AdamW's two moments are resident (≈ 4× its
float32 size). A policy whose backbone is rebuilt from its state (Iso-C's Σ τ) does not carry the
correction to the next fold; the step runs again after every fold, on every task seen so far.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import MergestreamError
from .ri import AuxItem, FeatureModel, Head, HFEncoderFeatures, RIError, base_features, optimiser_step, write_trained

log = logging.getLogger(__name__)


class DistillError(MergestreamError):
    """The distil step cannot run: bad parameters, no task, inputs or teacher outputs that do not
    fit their head, a backbone that cannot be loaded, or a loss that became non-finite."""


#: AdamW learning rate when the step trains every entry, chosen on validation rows of the one-shot
#: Iso-C merge of 8 MiniLM experts (1e-5 of 1e-5, 3e-5, 1e-4: bench/results/distill_lr.json)
LR = 1e-5
#: the same under a patch budget (the step trains only the entries each fold changed: fewer entries
#: move, each further): 3e-5 of the same grid with a ρ 0.29 mask (bench/results/distill_lr_budget29.json)
BUDGETED_LR = 3e-5


def default_lr(budgeted: bool) -> float:
    """The AdamW learning rate the distil step uses when none is configured: :data:`BUDGETED_LR`
    for a policy with a ``patch_budget`` below 1 (every fold of it, the first included),
    :data:`LR` otherwise."""
    return BUDGETED_LR if budgeted else LR


@dataclass(frozen=True)
class DistillParams:
    """Distil hyperparameters.

    Attributes:
        steps: AdamW updates; 0 makes the step the identity.
        lr: AdamW learning rate (no weight decay).
        batch_per_task: inputs of each task in every step's batch.
        gamma: weight γ of the similarity-preserving term toward θ₀ (0: off).
        max_length: tokens per input for the default Hugging Face features.
        seed: order of the batches.
        time_budget_seconds: wall-clock budget of the optimisation (s); None: no limit.
        eval_examples: inputs per task on which the loss is reported before and after.
        anchor_batch: general (anchor) inputs added to every step's similarity batch when anchors
            are given (0: none).
    """

    steps: int = 100
    lr: float = LR
    batch_per_task: int = 8
    gamma: float = 0.3
    max_length: int = 64
    seed: int = 0
    time_budget_seconds: float | None = None
    eval_examples: int = 32
    anchor_batch: int = 16

    def __post_init__(self) -> None:
        for name, least in (("steps", 0), ("batch_per_task", 1), ("max_length", 1), ("seed", 0),
                            ("eval_examples", 1), ("anchor_batch", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise DistillError(f"distil {name} must be a whole number >= {least}, got {v!r}")
        for name in ("lr", "gamma", "time_budget_seconds"):
            v = getattr(self, name)
            if v is None and name == "time_budget_seconds":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise DistillError(f"distil {name} must be a finite number >= 0, got {v!r}")
        if self.lr == 0:
            raise DistillError("distil lr must be > 0")


@dataclass
class DistillTask:
    """One task's part of the objective.

    Attributes:
        name: the task (for messages and the record).
        head: hⱼ as (weight (C, H) float32, bias (C,) float32).
        inputs: its unlabeled inputs xⱼ (N items).
        teacher_logp: log softmax of expert j's own logits on ``inputs``, (N, C) float32
            (:func:`teacher_outputs`).
    """

    name: str
    head: Head
    inputs: list[AuxItem]
    teacher_logp: torch.Tensor


@dataclass
class DistillResult:
    """What one distil run did.

    Attributes:
        steps: AdamW steps taken; seconds: wall time of the optimisation (s).
        stopped: ``"steps"``, ``"time"``, ``"identity"`` (no steps) or ``"nothing to train"`` (a
            train mask without a True entry: the model is unchanged).
        kl_before / kl_after: the mean KL term on the evaluation inputs at the fold's result and after.
        sim_before / sim_after: the similarity term (unweighted) on the same inputs.
        tasks: the tasks distilled, in order.
        anchors: general anchor inputs the similarity term could draw from (0: none).
        trained_entries: entries the train mask let train (None: no mask, every entry).
        losses: the mini-batch loss of every step.
    """

    steps: int = 0
    seconds: float = 0.0
    stopped: str = "identity"
    kl_before: float = 0.0
    kl_after: float = 0.0
    sim_before: float = 0.0
    sim_after: float = 0.0
    tasks: list[str] = field(default_factory=list)
    anchors: int = 0
    trained_entries: int | None = None
    losses: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The record without the per-step losses (first and last kept)."""
        d = asdict(self)
        d.pop("losses")
        d["loss_first_step"] = self.losses[0] if self.losses else None
        d["loss_last_step"] = self.losses[-1] if self.losses else None
        return d


def similarity_term(student: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """‖Ĉ_s − Ĉ_b‖²_F / B for features (B, H) of one batch, Ĉ = the B × B cosine similarities
    (Tung & Mori, ICCV 2019, Eq. 2-4, on row-normalised features instead of their row-normalised
    Gram matrix: the same geometry for pooled embeddings). A scalar, differentiable in ``student``."""
    s = F.normalize(student.float(), dim=-1)
    b = F.normalize(base.float(), dim=-1)
    return (s @ s.T - b @ b.T).pow(2).sum() / student.shape[0]


def _kl(feats: torch.Tensor, head: Head, teacher_logp: torch.Tensor) -> torch.Tensor:
    w, b = head
    return F.kl_div(F.log_softmax(feats @ w.T + b, -1), teacher_logp, log_target=True, reduction="batchmean")


def _check(tasks: Sequence[DistillTask], base_feats: Sequence[torch.Tensor]) -> None:
    if not tasks:
        raise DistillError("distil needs at least one task")
    if len(base_feats) != len(tasks):
        raise DistillError(f"{len(tasks)} tasks but θ₀ features for {len(base_feats)}")
    for t, bf in zip(tasks, base_feats):
        n = len(t.inputs)
        w, b = t.head
        if n == 0:
            raise DistillError(f"task {t.name!r}: no inputs")
        if w.dim() != 2 or b.shape != (w.shape[0],):
            raise DistillError(f"task {t.name!r}: head weight {tuple(w.shape)} / bias {tuple(b.shape)} do not fit")
        if t.teacher_logp.shape != (n, w.shape[0]):
            raise DistillError(f"task {t.name!r}: teacher outputs must be (N={n}, C={w.shape[0]}), "
                               f"got {tuple(t.teacher_logp.shape)}")
        if not torch.isfinite(t.teacher_logp).all():
            raise DistillError(f"task {t.name!r}: teacher outputs are not finite")
        if bf.dim() != 2 or bf.shape[0] != n or bf.shape[1] != w.shape[1]:
            raise DistillError(f"task {t.name!r}: θ₀ features must be (N={n}, H={w.shape[1]}), "
                               f"got {tuple(bf.shape)}")


def distill(model: torch.nn.Module, features: Callable[[torch.nn.Module, list[AuxItem]], torch.Tensor],
            tasks: Sequence[DistillTask], base_feats: Sequence[torch.Tensor], params: DistillParams = DistillParams(),
            *, anchors: Sequence[AuxItem] = (), anchor_feats: torch.Tensor | None = None,
            train_mask: dict[str, torch.Tensor] | None = None,
            progress: Callable[[int, float], None] | None = None) -> DistillResult:
    """Train ``model`` (the folded backbone, updated in place) on the distil objective.

    Args:
        model: the backbone's module; every floating parameter with ``requires_grad`` is trained.
        features: ``features(model, items) -> (B, H)`` float32 pooled features (differentiable).
        tasks: every task seen so far (:class:`DistillTask`; two may share a name, e.g. a task's
            retrained expert beside its first one).
        base_feats: f_θ₀ of each task's inputs, one (N, H) float32 tensor per task in the order of
            ``tasks``, row i for ``inputs[i]``.
        params: budgets and hyperparameters.
        anchors: general inputs (no head, no teacher), e.g. the general-knowledge probe's
            sentences: ``params.anchor_batch`` of them join every step's similarity batch, so θ₀'s
            geometry is kept where the general probes read it, not only on the tasks' inputs.
        anchor_feats: f_θ₀ of ``anchors``, (M, H) float32, row i for ``anchors[i]``.
        train_mask: parameter name → bool tensor of its shape: only the True entries are trained;
            every other entry keeps its value bit for bit (AdamW without weight decay never moves an
            entry whose gradient is always 0), and a parameter without a True entry, or without a
            mask, is not trained; no True entry at all: no step is taken. None: every entry is trained.
        progress: called after every step with (step, mini-batch loss).

    Returns:
        :class:`DistillResult`; ``model`` is untouched when ``params.steps == 0``.

    Raises:
        DistillError: no task, inputs / heads / teacher outputs / θ₀ features that do not fit, anchors
            without their θ₀ features (or of another shape), or a non-finite loss.
    """
    _check(tasks, base_feats)
    n_anchor = len(anchors)
    if n_anchor and (anchor_feats is None or anchor_feats.dim() != 2 or anchor_feats.shape[0] != n_anchor
                     or anchor_feats.shape[1] != tasks[0].head[0].shape[1]):
        got = None if anchor_feats is None else tuple(anchor_feats.shape)
        raise DistillError(f"{n_anchor} anchors need θ₀ features (M={n_anchor}, H={tasks[0].head[0].shape[1]}), "
                           f"got {got}")
    res = DistillResult(tasks=[t.name for t in tasks], anchors=n_anchor if params.anchor_batch and params.gamma else 0)
    if params.steps == 0:
        return res
    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    heads = [(t.head[0].to(dev).float(), t.head[1].to(dev).float()) for t in tasks]
    teach = [t.teacher_logp.to(dev).float() for t in tasks]
    bases = [b.to(dev).float() for b in base_feats]
    anchor_base = anchor_feats.to(dev).float() if n_anchor else None

    def loss_on(picks: list[list[int]], with_sim: bool, anchor_idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        kls, fs, bs = [], [], []
        for k, (t, idx) in enumerate(zip(tasks, picks)):
            f = features(model, [t.inputs[i] for i in idx]).float()
            kls.append(_kl(f, heads[k], teach[k][idx]))
            fs.append(f)
            bs.append(bases[k][idx])
        if with_sim and anchor_idx:
            fs.append(features(model, [anchors[i] for i in anchor_idx]).float())
            bs.append(anchor_base[anchor_idx])
        sim = similarity_term(torch.cat(fs), torch.cat(bs)) if with_sim else fs[0].new_zeros(())
        return torch.stack(kls).mean(), sim

    ev = [list(range(min(len(t.inputs), params.eval_examples))) for t in tasks]
    ev_anchor = list(range(min(n_anchor, params.eval_examples))) if res.anchors else []

    def evaluate() -> tuple[float, float]:
        with torch.no_grad():
            kl, sim = loss_on(ev, True, ev_anchor)  # the similarity term is reported whatever γ
        return float(kl), float(sim)

    res.kl_before, res.sim_before = evaluate()
    trainable = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]
    hooks = []
    if train_mask is not None:
        trainable, res.trained_entries = [], 0
        for name, p in model.named_parameters():
            m = train_mask.get(name)
            if not (p.requires_grad and p.is_floating_point()) or m is None or not bool(m.any()):
                continue
            if m.shape != p.shape:
                raise DistillError(f"train mask of {name} is {tuple(m.shape)}, the parameter {tuple(p.shape)}")
            trainable.append(p)
            res.trained_entries += int(m.sum())
            if not bool(m.all()):  # a bool mask (1 byte an entry), not a float copy of the parameter
                drop = ~m.to(p.device)
                hooks.append(p.register_hook(lambda g, drop=drop: g.masked_fill(drop, 0.0)))
        if not trainable:  # e.g. a fold that changed nothing under a patch budget: nothing to train
            res.stopped = "nothing to train"
            res.kl_after, res.sim_after = res.kl_before, res.sim_before
            model.train(was_training)
            log.info("distil: the fold changed no entry, nothing to train")
            return res
    opt = torch.optim.AdamW(trainable, lr=params.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(params.seed)
    orders: list[list[int]] = [[] for _ in tasks]
    anchor_order: list[int] = []
    take_anchor = min(params.anchor_batch, n_anchor)
    bs = params.batch_per_task
    t0 = time.perf_counter()
    res.stopped = "steps"
    ids = {id(q) for q in trainable}
    frozen = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
    for p in frozen:  # no gradient is computed for what the mask leaves out
        p.requires_grad_(False)
    try:
        for step in range(params.steps):
            if params.time_budget_seconds is not None and time.perf_counter() - t0 >= params.time_budget_seconds:
                res.stopped = "time"
                break
            picks = []
            for k, t in enumerate(tasks):
                take = min(bs, len(t.inputs))
                if len(orders[k]) < take:
                    orders[k] += torch.randperm(len(t.inputs), generator=gen).tolist()
                picks.append(orders[k][:take])
                orders[k] = orders[k][take:]
            if len(anchor_order) < take_anchor:
                anchor_order += torch.randperm(n_anchor, generator=gen).tolist()
            anchor_idx, anchor_order = anchor_order[:take_anchor], anchor_order[take_anchor:]
            kl, sim = loss_on(picks, params.gamma > 0, anchor_idx)
            res.losses.append(optimiser_step(opt, kl + params.gamma * sim, step, DistillError, "distil"))
            res.steps = step + 1
            if progress is not None:
                progress(res.steps, res.losses[-1])
    finally:
        for p in frozen:
            p.requires_grad_(True)
        for h in hooks:
            h.remove()
    res.seconds = time.perf_counter() - t0
    res.kl_after, res.sim_after = evaluate()
    opt.zero_grad(set_to_none=True)
    model.train(was_training)
    log.info("distil tasks=%d anchors=%d steps=%d stopped=%s seconds=%.1f kl=%.5g->%.5g sim=%.5g->%.5g",
             len(tasks), res.anchors, res.steps, res.stopped, res.seconds, res.kl_before, res.kl_after,
             res.sim_before, res.sim_after)
    return res


def teacher_outputs(fm: FeatureModel, expert: str | os.PathLike, head: Head, inputs: Sequence[AuxItem], *,
                    device: str | torch.device = "cpu", batch_size: int = 64) -> torch.Tensor:
    """log softmax hⱼ(f_θⱼ(x)) of expert ``expert`` on ``inputs``: (N, C) float32 on the CPU, the
    target :class:`DistillTask` keeps (computed once, when the expert arrives).

    Raises:
        DistillError: the expert cannot be loaded by ``fm``, or the head does not fit its features.
    """
    try:
        model = fm.load(Path(expert), torch.device(device))
    except RIError as exc:
        raise DistillError(str(exc)) from exc
    w, b = head[0].float(), head[1].float()
    out = []
    with torch.no_grad():
        for s in range(0, len(inputs), batch_size):
            f = fm.features(model, list(inputs[s:s + batch_size])).float().cpu()
            if f.shape[1] != w.shape[1]:
                raise DistillError(f"the head (weight {tuple(w.shape)}) takes features of size {w.shape[1]}, but the "
                                   f"expert's features have size {f.shape[1]}: the head does not fit")
            out.append(F.log_softmax(f @ w.T + b, -1))
    del model
    return torch.cat(out)


def _patch_support(model: torch.nn.Module, prev: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameter name → bool mask of the entries where ``model`` differs from ``prev`` (same
    architecture)."""
    theirs = dict(prev.named_parameters())
    out = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            q = theirs.get(name)
            if q is None or q.shape != p.shape:
                raise DistillError(f"the previous version has no parameter {name} of shape {tuple(p.shape)}")
            out[name] = p.ne(q)
    return out


def distill_backbone(backbone: str | os.PathLike, base: str | os.PathLike, out: str | os.PathLike, *,
                     tasks: Sequence[DistillTask], params: DistillParams = DistillParams(),
                     anchors: Sequence[AuxItem] = (), within_patch_from: str | os.PathLike | None = None,
                     feature_model: FeatureModel | None = None,
                     cache_dir: str | os.PathLike | None = None,
                     device: str | torch.device = "cpu",
                     progress: Callable[[int, float], None] | None = None) -> tuple[Path, DistillResult]:
    """Run the distil step on a folded backbone folder and write the result to ``out``.

    Args:
        backbone: the fold's output (a Hugging Face folder for the default features).
        base: θ₀ (same form), for the similarity term's features.
        out: the folder written, which must not exist yet (or ``backbone`` itself, to distil in
            place: it is replaced whole, staged and renamed): one ``model.safetensors`` with the
            backbone's tensor names and dtypes, its other files, and its header metadata plus
            ``mergestream.distill`` (the result and the parameters, JSON).
        tasks: every task seen so far (:class:`DistillTask`).
        anchors: general inputs for the similarity term (see :func:`distill`); their θ₀ features are
            computed here (and cached like the tasks').
        within_patch_from: the previous version (same form): only the entries where ``backbone``
            differs from it are trained, so the patch from it to ``out`` touches no entry the
            fold's patch did not (a ``patch_budget``'s bound holds). None: every entry is trained.
        feature_model: default :class:`~mergestream.datasteps.ri.HFEncoderFeatures` with the backbone's
            tokenizer (the base's when it has none).
        cache_dir: where θ₀'s features of each task's inputs are cached (None: not cached).

    Returns:
        (the folder, result). With ``params.steps == 0`` nothing is written and the folder is
        ``backbone``.

    Raises:
        DistillError: see :func:`distill`, plus a missing backbone or base, an ``out`` that exists
            and is not the backbone, and a backbone whose tensor names do not match the feature
            model's parameters.
    """
    backbone, base, out = Path(backbone), Path(base), Path(out)
    prev = [("previous version", Path(within_patch_from))] if within_patch_from is not None else []
    for what, p in (("backbone", backbone), ("base", base), *prev):
        if not p.exists():
            raise DistillError(f"distil {what} {p} does not exist")
    if out.exists() and out.resolve() != backbone.resolve():
        raise DistillError(f"distil output {out} exists and is not the backbone: give a new folder")
    _check(tasks, [torch.empty(len(t.inputs), t.head[0].shape[1]) for t in tasks])
    if params.steps == 0:
        return backbone, DistillResult(tasks=[t.name for t in tasks])
    dev = torch.device(device)
    if feature_model is None:
        has_tok = (backbone / "tokenizer_config.json").exists() or (backbone / "tokenizer.json").exists()
        try:
            feature_model = HFEncoderFeatures(backbone if has_tok else base, max_length=params.max_length)
        except RIError as exc:
            raise DistillError(str(exc)) from exc
    cache = Path(cache_dir) if cache_dir else None
    try:
        bf = [base_features(feature_model, base, t.inputs, cache_dir=cache, device=dev) for t in tasks]
        af = base_features(feature_model, base, list(anchors), cache_dir=cache, device=dev) if anchors else None
        model = feature_model.load(backbone, dev)
        mask = None
        if within_patch_from is not None:
            mask = _patch_support(model, feature_model.load(Path(within_patch_from), dev))
    except RIError as exc:
        raise DistillError(str(exc)) from exc
    res = distill(model, feature_model.features, tasks, bf, params, anchors=anchors, anchor_feats=af,
                  train_mask=mask, progress=progress)
    write_trained(model, backbone, out, {"mergestream.distill": json.dumps({**res.to_json(), "params": asdict(params)})},
                  error=DistillError)
    return out, res
