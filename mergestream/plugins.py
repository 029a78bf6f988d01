"""User plug-ins named as ``package.module:attribute``: one resolver for every extension point.

Used by the daemon's ``entrypoint`` probes and by RI's ``ri.forward`` feature-model factory.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from .errors import MergestreamError


def resolve_callable(target: Any, *, what: str = "entry point", form: str = "package.module:function",
                     error: type[MergestreamError] = MergestreamError) -> Callable[..., Any]:
    """Import ``package.module:name`` (``name`` may be dotted: ``module:Class.method``) and return it.

    Args:
        target: the string, exactly one ``:`` with a non-empty module and attribute on each side;
            the module must be importable (on ``sys.path``).
        what: how error messages name the setting (``"entrypoint"``, ``"ri.forward"``).
        form: the expected form shown in error messages.
        error: the exception class raised (the caller's error type).

    Returns:
        the callable object.

    Raises:
        error: malformed target, the module cannot be imported (any exception while importing,
            named with its type), a missing attribute, or an attribute that is not callable.
    """
    if not isinstance(target, str) or target.count(":") != 1:
        raise error(f"{what}: target must be '{form}', got {target!r}")
    mod_name, attr = target.split(":")
    if not mod_name or not attr:
        raise error(f"{what}: target must be '{form}', got {target!r}")
    try:
        obj: Any = importlib.import_module(mod_name)
    except Exception as exc:
        raise error(f"{what} {target!r}: cannot import {mod_name!r}: {type(exc).__name__}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise error(f"{what} {target!r}: {mod_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise error(f"{what} {target!r}: {attr!r} is not callable")
    return obj
