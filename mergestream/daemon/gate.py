"""The gate: compare a candidate's probe values with the current version's, θ₀'s and the history
of accepted folds; accept only if every rule holds.

A rule (see :class:`mergestream.config.GateRule`) names a metric and a direction. Its bounds:
``max_abs_drop`` / ``max_rel_drop`` against the current version and/or θ₀ (a "drop" is a change
in the worse direction), ``max_value`` / ``min_value`` absolute bounds, and
``max_ratio_to_history``: the candidate may be at most ratio × the median of the metric over the
accepted folds so far (skipped while there is no history). A metric missing from the candidate
skips its rule unless ``required``; a missing reference skips that comparison.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from ..config import GateRule


@dataclass
class GateDecision:
    """The verdict: ``accepted`` and, when rejected, every failed rule with both values."""

    accepted: bool
    failures: list[str] = field(default_factory=list)

    @property
    def reason(self) -> str | None:
        return "; ".join(self.failures) if self.failures else None


def _worse_by(rule: GateRule, candidate: float, reference: float) -> float:
    """How much worse the candidate is than the reference (positive = worse)."""
    return reference - candidate if rule.direction == "higher" else candidate - reference


def evaluate(rules: list[GateRule], candidate: dict[str, float], current: dict[str, float] | None,
             base: dict[str, float] | None, history: list[dict[str, float]] | None = None) -> GateDecision:
    """Apply every rule; see the module docstring.

    Args:
        candidate: the candidate's probe values.
        current: the current version's values (None before the first publish).
        base: θ₀'s values (None if not measured).
        history: probe values of accepted folds, oldest first.
    """
    failures: list[str] = []
    for rule in rules:
        m = rule.metric
        if m not in candidate:
            if rule.required:
                failures.append(f"{m}: required metric missing from the candidate's probes")
            continue
        value = float(candidate[m])
        if rule.max_value is not None and value > rule.max_value:
            failures.append(f"{m}: candidate {value:.6g} > max_value {rule.max_value:.6g}")
        if rule.min_value is not None and value < rule.min_value:
            failures.append(f"{m}: candidate {value:.6g} < min_value {rule.min_value:.6g}")
        refs = []
        if rule.against in ("current", "both") and current and m in current:
            refs.append(("current", float(current[m])))
        if rule.against in ("base", "both") and base and m in base:
            refs.append(("base", float(base[m])))
        for name, ref in refs:
            worse = _worse_by(rule, value, ref)
            if rule.max_abs_drop is not None and worse > rule.max_abs_drop:
                failures.append(f"{m}: candidate {value:.6g} vs {name} {ref:.6g}, worse by {worse:.6g} "
                                f"> max_abs_drop {rule.max_abs_drop:.6g}")
            if rule.max_rel_drop is not None and abs(ref) > 0 and worse / abs(ref) > rule.max_rel_drop:
                failures.append(f"{m}: candidate {value:.6g} vs {name} {ref:.6g}, worse by "
                                f"{100 * worse / abs(ref):.3g}% > max_rel_drop {100 * rule.max_rel_drop:.3g}%")
        if rule.max_ratio_to_history is not None and history:
            past = [float(h[m]) for h in history if m in h]
            if past:
                med = statistics.median(past)
                limit = rule.max_ratio_to_history * med
                if (rule.direction == "lower" and value > limit) or (rule.direction == "higher" and value < med / rule.max_ratio_to_history):
                    failures.append(f"{m}: candidate {value:.6g} vs median {med:.6g} of {len(past)} accepted fold(s), "
                                    f"beyond max_ratio_to_history {rule.max_ratio_to_history:g}")
    return GateDecision(not failures, failures)
