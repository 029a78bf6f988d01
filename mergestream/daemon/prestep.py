"""A fold's data-driven extras: the RI pre-step that adapts an expert before it is folded
(``policy.preprocess: [ri]``), the distil post-step that trains the folded backbone toward every
task's expert (``policy.postprocess: [distill]``), and the probe objective of a policy that searches
its coefficients.

``coefficients: adamerging`` gets :class:`~mergestream.engine.coefficients.EntropyObjective` instead: the
task heads RI uses (every accepted expert's and the candidate's) on RI's unlabeled inputs
(``policy.ri.data``), through RI's feature model.

RI: Resolving Interference (METHODS.md, "RI"), :func:`mergestream.datasteps.ri.adapt_expert`. The adapted
copy is written to ``state_dir/ri/<expert>``, the RI home of :class:`.store.KeptExperts` (the one
place that keeps an accepted expert's files for replay, and removes them once no kept version
holds the expert).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import Config
from ..datasteps.distill import (DistillError, DistillParams, DistillTask, default_lr, distill_backbone,
                                 teacher_outputs)
from ..engine.coefficients import EntropyObjective
from ..errors import MergestreamError
from ..policies import Policy, is_budgeted
from ..datasteps.ri import RIError, RIParams, adapt_expert, load_feature_model, read_aux
from ..datasteps.text import has_tokenizer, load_head, read_labelled_jsonl, read_scored_pairs
from .objective import ProbeObjective
from .probes import SentenceSimilarityProbe, discover_task_probe
from .probing import Prober
from .records import ExpertRow
from .store import KeptExperts

log = logging.getLogger("mergestream.service")


class PreStepRejected(MergestreamError):
    """A pre-step (RI) or the distil post-step refused the expert; it is rejected with this reason."""


class StopRequested(Exception):
    """Raised inside a fold (per tensor, per RI step, per objective evaluation) once a stop was
    asked: the fold is abandoned and its expert stays queued for the next start."""


class PreSteps:
    """The RI pre-step and the coefficient-search objective, for the pipeline.

    Args:
        cfg: the daemon's config. prober: the daemon's probes (task heads, general probe).
        heartbeat: called per RI step and objective evaluation; raises :class:`StopRequested`
            once a stop was asked.
        kept: where accepted experts' files are kept (default: the state folder's).
    """

    def __init__(self, cfg: Config, prober: Prober, heartbeat: Callable[..., None], kept: KeptExperts | None = None):
        self.cfg, self.prober, self.heartbeat = cfg, prober, heartbeat
        self.kept = kept or KeptExperts(cfg.state_dir)
        self._teachers: dict[tuple[str, str, str], DistillTask] = {}

    def ri_dir(self, expert_id: str) -> Path:
        """Where an expert's RI-adapted copy is kept (``state_dir/ri/<expert>``)."""
        return self.kept.dir(expert_id, "ri")

    def adapt(self, row: ExpertRow, att: Any) -> str:
        """Adapt the expert with RI; returns the path to fold (the adapted copy, or the expert
        itself when it has no task head and ``ri.on_missing_head`` is ``fold``). Records timings
        and ``fold.json`` extras on ``att`` (a :class:`~mergestream.daemon.records.Attempt`).

        Raises:
            PreStepRejected: the expert has no task head and ``ri.on_missing_head`` is reject,
                or RI cannot run on it (bad auxiliary data, unloadable expert, mismatched head).
            StopRequested: a stop was asked during the adaptation.
        """
        rc = self.cfg.policy.ri
        expert_dir = att.candidate_expert
        spec = discover_task_probe(expert_dir) if expert_dir is not None else None
        if spec is None:
            msg = "RI needs the expert's task head (mergestream_probe/) and it has none"
            if rc.on_missing_head == "reject":
                raise PreStepRejected(msg)
            log.warning("%s: folding %s unadapted", msg, row.expert_id)
            att.extra["ri"] = {"skipped": msg}
            att.timings["ri_skipped"] = 1.0
            return row.uri
        others = [s for s in self.prober.task_specs() if s.task != spec.task]
        try:
            aux = read_aux(rc.data, rc.max_examples)
            tok = expert_dir if has_tokenizer(expert_dir) else Path(self.cfg.base)
            fm = load_feature_model(rc.forward, tokenizer=tok, pooling=spec.pooling, max_length=rc.max_length)
            params = RIParams(alpha=rc.alpha, steps=rc.steps, time_budget_seconds=rc.time_budget_seconds, lr=rc.lr,
                              batch_size=rc.batch_size, max_length=rc.max_length, eval_every=rc.eval_every)

            def progress(step: int, loss: float) -> None:
                self.heartbeat()
                if step % 10 == 0 or step == params.steps:
                    log.info("ri expert=%s step=%d/%d loss=%.5g", row.expert_id, step, params.steps, loss)

            t = time.time()
            path, res = adapt_expert(expert_dir, self.cfg.base, self.ri_dir(row.expert_id),
                                     own_head=load_head(spec.head, spec.task),
                                     other_heads=[load_head(s.head, s.task) for s in others], aux=aux, params=params,
                                     feature_model=fm, cache_dir=self.cfg.state_dir / "cache", device=self.cfg.device,
                                     progress=progress)
        except RIError as exc:
            raise PreStepRejected(f"RI pre-step: {exc}") from exc
        att.timings.update(ri_seconds=time.time() - t, ri_steps=float(res.steps), ri_loss_before=res.loss_before,
                           ri_loss_after=res.loss_after)
        att.extra["ri"] = {**res.to_json(), "other_tasks": [s.task for s in others]}
        return str(path)

    def objective(self, candidate_expert: Path | None,
                  policy: Policy | None = None) -> ProbeObjective | EntropyObjective:
        """The coefficient search's objective on the data probes (task heads incl. the candidate's,
        and the configured sentence_similarity probe), see :class:`.objective.ProbeObjective`; for
        ``coefficients: adamerging`` :meth:`entropy_objective`.

        Args:
            candidate_expert: the expert's folder (it may ship a task probe), or None.
            policy: the attempt's :class:`~mergestream.policies.Policy` (None: built from the config).
        """
        policy = policy if policy is not None else self.cfg.policy.make()
        if policy.searches_coefficients() == "adamerging":
            return self.entropy_objective(candidate_expert)
        return self.probe_objective(candidate_expert)

    def probe_objective(self, candidate_expert: Path | None) -> ProbeObjective:
        """The data probes' objective (:class:`.objective.ProbeObjective`, ``policy.objective``'s
        weights and row counts): every accepted expert's task probe and the candidate's own, and the
        configured sentence_similarity probe. What CMA-ES and ``policy.strength: auto`` maximise.

        Raises:
            ProbeError: no task probe and no sentence_similarity probe, or a malformed probe.
        """
        oc = self.cfg.policy.objective
        general = next((p for p in self.prober.probes() if isinstance(p, SentenceSimilarityProbe)), None)
        base = Path(self.cfg.base)
        return ProbeObjective(base, self.prober.task_specs(candidate_expert), general, tokenizer=base,
                              task_weight=oc.task_weight, general_weight=oc.general_weight,
                              examples_per_task=oc.examples_per_task, general_pairs=oc.general_pairs,
                              device=self.cfg.device, on_eval=self.heartbeat)

    def entropy_objective(self, candidate_expert: Path | None) -> EntropyObjective:
        """AdaMerging's objective: the prediction entropy of every task head RI would use (the
        accepted experts' and the candidate's) on the first ``objective.adamerging_examples``
        inputs of ``ri.data``, through RI's feature model (``ri.forward``; pooling of the candidate's
        task probe, else the first one's, as RI does).

        Raises:
            RIError: unreadable ``ri.data`` or feature model. CoefficientError: no task head.
        """
        rc, oc = self.cfg.policy.ri, self.cfg.policy.objective
        specs = self.prober.task_specs(candidate_expert)
        own = discover_task_probe(candidate_expert) if candidate_expert is not None else None
        first = own or next(iter(specs), None)
        pooling = first.pooling if first is not None else "mean"
        base = Path(self.cfg.base)
        tok = candidate_expert if candidate_expert is not None and has_tokenizer(candidate_expert) else base
        fm = load_feature_model(rc.forward, tokenizer=tok, pooling=pooling, max_length=rc.max_length)
        return EntropyObjective(base, {s.task: load_head(s.head, s.task) for s in specs},
                                read_aux(rc.data, oc.adamerging_examples), feature_model=fm,
                                batch_size=rc.batch_size, device=self.cfg.device, on_eval=self.heartbeat)

    def distill(self, att: Any, candidate: tuple[str, Path | None] | None, exclude: str | None = None,
                within_patch_from: Path | None = None) -> None:
        """The distil post-step on the candidate backbone ``att.staging/model``, in place
        (:func:`mergestream.datasteps.distill.distill_backbone`, ``policy.distill``): the tasks are every
        accepted expert's task probe but ``exclude``'s (an unmerge) and ``candidate``'s own,
        ``(expert id, its folder)``; each task's target is its expert's outputs (the kept copy; the
        candidate's folder) on the first ``examples_per_task`` inputs of its probe, computed once per
        expert. No task probe at all: the step is skipped (recorded). ``within_patch_from``: the
        previous version, under a ``patch_budget``: only the entries the fold changed are trained
        (:func:`mergestream.datasteps.distill.distill_backbone`). Records timings and ``fold.json``'s
        ``distill``.

        Raises:
            PreStepRejected: the step cannot run (an expert or its head does not fit the features,
                a malformed probe, a non-finite loss).
            StopRequested: a stop was asked during the step.
        """
        dc = self.cfg.policy.distill
        base = Path(self.cfg.base)
        lr = dc.lr if dc.lr is not None else default_lr(is_budgeted(self.cfg.policy.params))
        params = DistillParams(steps=dc.steps, lr=lr,
                               gamma=dc.gamma, batch_per_task=dc.batch_per_task,
                               max_length=dc.max_length, time_budget_seconds=dc.time_budget_seconds,
                               anchor_batch=dc.anchor_batch)
        try:
            pairs: list[tuple[str, Any, Path | None]] = [
                (eid, spec, self.kept.path(eid)) for eid, spec in self.prober.accepted_task_probes() if eid != exclude]
            if candidate is not None and candidate[1] is not None and \
                    (own := discover_task_probe(candidate[1])) is not None:
                pairs.append((candidate[0], own, candidate[1]))
            if not pairs:
                log.warning("distil post-step skipped: no folded expert ships a task probe (mergestream_probe/)")
                att.extra["distill"] = {"skipped": "no task probe"}
                return
            # the tokenizer: θ₀'s, else the first expert folder that ships one (as RI takes the expert's)
            tok = base if has_tokenizer(base) else next((f for _, _, f in pairs if f is not None and has_tokenizer(f)),
                                                        base)
            fm = load_feature_model(dc.forward, tokenizer=tok, pooling=pairs[-1][1].pooling, max_length=dc.max_length,
                                    what="distill.forward")
            tasks = [self._teacher(eid, spec, folder, fm) for eid, spec, folder in pairs]

            def progress(step: int, loss: float) -> None:
                self.heartbeat()
                if step % 20 == 0 or step == params.steps:
                    log.info("distil step=%d/%d loss=%.5g", step, params.steps, loss)

            t = time.time()
            model = att.staging / "model"
            _, res = distill_backbone(model, base, model, tasks=tasks, params=params, anchors=self._anchors(),
                                      within_patch_from=within_patch_from, feature_model=fm,
                                      cache_dir=self.cfg.state_dir / "cache", device=self.cfg.device,
                                      progress=progress)
        except MergestreamError as exc:  # DistillError, RIError (the feature model), ProbeError (a probe file)
            raise PreStepRejected(f"distil post-step: {exc}") from exc
        att.timings.update(distill_seconds=time.time() - t, distill_steps=float(res.steps),
                           distill_kl_before=res.kl_before, distill_kl_after=res.kl_after)
        att.extra["distill"] = {**res.to_json(), "experts": [eid for eid, _, _ in pairs], "lr": params.lr}

    def _anchors(self) -> list[tuple[str, None]]:
        """The distil step's general anchors: the first ``policy.distill.anchor_examples`` distinct
        sentences of the pairs the first configured ``sentence_similarity`` probe reads (its
        ``max_pairs``); none without one, or with ``gamma`` 0.

        Raises:
            ProbeError: a malformed probe file.
        """
        n = self.cfg.policy.distill.anchor_examples
        general = next((p for p in self.prober.probes() if isinstance(p, SentenceSimilarityProbe)), None)
        if n == 0 or general is None or self.cfg.policy.distill.gamma == 0:
            return []
        seen: dict[str, None] = {}
        for _, a, b in read_scored_pairs(general.data, general.max_pairs):
            for sentence in (a, b):
                if len(seen) < n:
                    seen.setdefault(sentence)
        return [(sentence, None) for sentence in seen]

    def _teacher(self, expert_id: str, spec: Any, folder: Path | None, fm: Any) -> DistillTask:
        """One task of the distil step: its probe's inputs and its expert's outputs on them (cached per
        expert id, probe and feature model: an id names one content).

        Raises:
            DistillError: the expert's copy is not kept, or it or its head does not fit the features.
            ProbeError: a malformed probe file.
        """
        key = (expert_id, str(spec.data), fm.identity)
        if key not in self._teachers:
            if folder is None:
                raise DistillError(f"expert {expert_id}'s copy is not kept: its task {spec.task} has no teacher")
            rows = read_labelled_jsonl(spec.data, self.cfg.policy.distill.examples_per_task)
            inputs = [(t, t2) for t, t2, _ in rows]
            head = load_head(spec.head, spec.task)
            self._teachers[key] = DistillTask(spec.task, head, inputs,
                                              teacher_outputs(fm, folder, head, inputs, device=self.cfg.device))
        return self._teachers[key]
