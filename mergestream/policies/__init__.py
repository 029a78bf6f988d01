"""Merge policies: pure tensor functions, one registry (see ../shared/METHODS.md).

``REGISTRY`` maps a policy name to its class; :func:`make_policy` builds one from parameters named
as in METHODS.md (``lambda``, ``k``, ``rho``, ``rank``, ``alpha``, ...). Adding a policy is one
module here and one line in ``REGISTRY``: the CLI's choices, the config validation and the starter
config all read the registry. What a policy can do beyond :meth:`Policy.fold_tensor` it says
through capabilities (:meth:`Policy.linear_scale`, :meth:`Policy.searches_coefficients`,
:attr:`Policy.contributions_in_state`, :meth:`Policy.refold_params`, :meth:`Policy.rebuild`),
never through its name.
"""

from __future__ import annotations

from typing import Any

from ..errors import PolicyError
from ..recommended import RECOMMENDED_PARAMS, RECOMMENDED_POLICY  # torch-free home (the config reads it)
from .base import Policy, PolicyParams, TensorContext, TensorFold
from .budget import PatchBudget, is_budgeted, split_budget_params, with_budget
from .dop import Dop
from .iso_c import IsoC
from .iso_cts import IsoCts
from .lines import Lines, split_lines_params, with_lines
from .mdm_oc import MdmOc, cmaes_coefficients, stability_penalty
from .opcm import Opcm
from .safe_merge import SafeMerge
from .task_arithmetic import MagMax, TaskArithmetic, Ties
from .weight_average import WeightAverage

REGISTRY: dict[str, type[Policy]] = {
    cls.name: cls for cls in (TaskArithmetic, Ties, SafeMerge, MdmOc, Opcm, MagMax, Dop, IsoC, IsoCts, WeightAverage)
}



def make_policy(name: str, params: dict[str, Any] | None = None) -> Policy:
    """Instantiate a registered policy by name.

    ``lines_*`` parameters (any policy) wrap it in LiNeS depth scaling (:mod:`.lines`);
    ``patch_budget`` (any policy) wraps that in a per-fold patch budget (:mod:`.budget`).

    Raises:
        PolicyError: unknown name or invalid parameters (each named, as the policy's
            :class:`PolicyParams` model reports them).
    """
    if name not in REGISTRY:
        raise PolicyError(f"unknown policy {name!r}; known: {', '.join(policy_names())}")
    if isinstance(params, PolicyParams):
        return REGISTRY[name](params)
    own, budget = split_budget_params(params)
    own, lines = split_lines_params(own)
    return with_budget(with_lines(REGISTRY[name](own), lines), budget)


def reference_params(name: str) -> dict[str, Any] | None:
    """The parameters of a policy's reference mode (conventions of FusionBench 0.2.33, checked by
    tests/test_conformance.py), or None for a policy without a reference.

    Raises:
        PolicyError: unknown policy name.
    """
    if name not in REGISTRY:
        raise PolicyError(f"unknown policy {name!r}; known: {', '.join(policy_names())}")
    ref = REGISTRY[name].reference_params
    return None if ref is None else dict(ref)


def strength_candidates(name: str, params: dict[str, Any] | None, param: str | None = None,
                        grid: list[float] | None = None) -> tuple[str, list[float], float]:
    """The per-fold strength search of ``policy.strength: auto``: which parameter, which values.

    Args:
        name, params: the configured policy. param: the parameter to search (default: the policy's
            :meth:`Policy.strength` parameter). grid: candidate values (default: the policy's grid
            for that parameter).

    Returns:
        (parameter, candidate values in trial order, the configured value): the configured value
        (the policy's default when ``params`` omits it) first, then the grid ascending, no duplicates.

    Raises:
        PolicyError: unknown policy; no strength parameter and none named; a parameter that is not
            a number of the policy; no grid for it; a candidate value the policy refuses.
    """
    params = dict(params or {})
    pol = make_policy(name, params)
    declared = pol.strength()
    param = param or (declared[0] if declared else None)
    if param is None:
        raise PolicyError(f"policy {name} has no strength parameter: name one (policy.strength.param)")
    current = pol.describe().get(param)
    if isinstance(current, bool) or not isinstance(current, (int, float)):
        raise PolicyError(f"strength parameter {param!r} is not a numeric parameter of {name} "
                          f"(its parameters: {', '.join(sorted(pol.describe()))})")
    if grid is None and declared and declared[0] == param:
        grid = list(declared[1])
    if not grid:
        raise PolicyError(f"strength parameter {param} of {name} has no default grid: give one (policy.strength.grid)")
    values = [float(current)] + sorted({float(v) for v in grid} - {float(current)})
    for v in values[1:]:
        make_policy(name, {**params, param: v})  # an out-of-range candidate is refused before any fold
    return param, values, float(current)


def policy_names() -> list[str]:
    """The registered policy names, in registry order (the order of the docs' policy tables)."""
    return list(REGISTRY)


def parameter_names(name: str) -> list[str]:
    """A policy's parameter names as users write them (``lambda``, not the attribute ``lam``).

    Raises:
        PolicyError: unknown policy name.
    """
    if name not in REGISTRY:
        raise PolicyError(f"unknown policy {name!r}; known: {', '.join(policy_names())}")
    return [f.alias or n for n, f in REGISTRY[name].Params.model_fields.items()]


__all__ = ["REGISTRY", "RECOMMENDED_POLICY", "RECOMMENDED_PARAMS", "Policy", "PolicyParams", "TensorContext",
           "TensorFold", "make_policy", "parameter_names", "policy_names", "reference_params", "cmaes_coefficients",
           "stability_penalty", "Dop", "IsoC", "Lines", "MdmOc", "Opcm", "SafeMerge", "MagMax", "TaskArithmetic", "Ties",
           "IsoCts", "WeightAverage", "PatchBudget", "is_budgeted"]
