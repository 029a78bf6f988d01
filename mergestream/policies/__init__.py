"""Merge policies: pure tensor functions, one registry (see ../shared/METHODS.md).

``REGISTRY`` maps a policy name to its class; :func:`make_policy` builds one from parameters named
as in METHODS.md (``lambda``, ``k``, ``rho``, ``rank``, ``alpha``, ...).
"""

from .base import Policy, PolicyParams, TensorContext, TensorFold, make_policy
from .mdm_oc import MdmOc, cmaes_coefficients, stability_penalty
from .opcm import Opcm
from .safe_merge import SafeMerge
from .task_arithmetic import MagMax, TaskArithmetic, Ties

REGISTRY: dict[str, type[Policy]] = {
    cls.name: cls for cls in (TaskArithmetic, Ties, SafeMerge, MdmOc, Opcm, MagMax)
}

__all__ = ["REGISTRY", "Policy", "PolicyParams", "TensorContext", "TensorFold", "make_policy",
           "cmaes_coefficients", "stability_penalty", "MdmOc", "Opcm", "SafeMerge", "MagMax", "TaskArithmetic", "Ties"]
