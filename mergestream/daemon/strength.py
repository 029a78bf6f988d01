"""The per-fold strength choice (``policy.strength: auto``): fold at each candidate strength, keep
the best on the data probes.

A policy's strength (task arithmetic's λ, Iso-C's α: :meth:`mergestream.policies.Policy.strength`)
fixed once does not follow the stream: on another task set re-tuning moved Iso-C's α from 2 to 3.5
(issue 39). With ``auto`` the daemon chooses it at every fold from data it already has: the
expert is folded once per candidate value (the configured one first,
:func:`mergestream.policies.strength_candidates`), each candidate is scored by the very objective
CMA-ES maximises (:class:`.objective.ProbeObjective`, ``policy.objective``: mean accuracy on the
first rows of the task probes of every accepted expert and the new one, which are validation rows,
plus the sentence_similarity probe so general knowledge weighs against the tasks), and the best
candidate becomes the attempt's candidate, which the probes and the gate then judge as any other.
The configured value wins ties (a candidate must score strictly higher to replace it).

Cost: one fold and one objective evaluation per candidate; at most two candidates are on disk at a
time. Each fold records its own parameters (the chosen value among them), so replay refolds an
expert at the strength it was folded with. The daemon does no tensor math here: folds are the
engine's, scores the objective's.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import PolicyConfig
from ..engine import FoldReport
from ..policies import Policy, strength_candidates
from .objective import ProbeObjective

log = logging.getLogger("mergestream.service")

#: fold_one(policy, state_dir, out) -> the engine's report of folding the attempt's expert
FoldOne = Callable[[Policy, Path, Path], FoldReport]


def fold_at_best_strength(policy: PolicyConfig, objective: ProbeObjective, fold_one: FoldOne,
                          carry_state: Callable[[Path], None], staging: Path) -> tuple[FoldReport, dict[str, Any]]:
    """Fold the expert at each candidate strength and leave the best in ``staging/model`` and
    ``staging/state``.

    Args:
        policy: the ``policy`` config (name, params, ``strength`` with its parameter and grid).
        objective: the data probes' objective; its ``score`` (higher is better) ranks candidates.
        fold_one: folds the attempt's expert with a policy into a state folder and an output folder.
        carry_state: fills a folder with the current version's policy state (what each fold starts from).
        staging: the attempt's staging folder (candidates are built under ``staging/strength/``).

    Returns:
        (the chosen candidate's fold report, the record for ``fold.json``'s ``strength``: param,
        configured, chosen, candidates with their objective values, seconds).

    Raises:
        PolicyError: the strength parameter or a candidate is invalid (checked when the config loads).
        ProbeError: the objective cannot score a candidate. Whatever the fold raises (the caller
            turns it into the attempt's outcome); StopRequested from the heartbeats.
    """
    param, values, configured = strength_candidates(policy.name, policy.params, policy.strength.param,
                                                    policy.strength.grid)
    t0 = time.time()
    trials = staging / "strength"
    best: Any = None  # (folder, objective values, report, value) of the best candidate so far
    candidates = []
    try:
        for i, value in enumerate(values):
            trial = trials / f"{i:02d}"
            carry_state(trial / "state")
            rep = fold_one(policy.make({**policy.params, param: value}), trial / "state", trial / "model")
            vals = objective.score_model(trial / "model")
            candidates.append({"value": value, **vals, "fold_seconds": rep.seconds})
            log.info("strength %s=%g score=%.4f %s", param, value, vals["score"],
                     " ".join(f"{k}={v:.2f}" for k, v in sorted(vals.items()) if k != "score"))
            if best is None or vals["score"] > best[1]["score"]:
                if best is not None:
                    shutil.rmtree(best[0], ignore_errors=True)
                best = (trial, vals, rep, value)
            else:
                shutil.rmtree(trial, ignore_errors=True)
        (best[0] / "model").rename(staging / "model")
        (best[0] / "state").rename(staging / "state")
    finally:
        shutil.rmtree(trials, ignore_errors=True)
    chosen = best[3]
    log.info("strength chosen %s=%g (configured %g) of %d candidates in %.1fs", param, chosen, configured,
             len(values), time.time() - t0)
    return best[2], {"param": param, "configured": configured, "chosen": chosen, "candidates": candidates,
                     "seconds": time.time() - t0}
