"""``entrypoint``: a user function ``package.module:function``.

Called as ``function(model_dir, ctx, **params)`` (every param except ``target`` and ``name`` is
passed through as a keyword argument); it must return a mapping of metric name to number.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...plugins import resolve_callable
from .base import ProbeContext, ProbeError, as_metrics


class EntryPointProbe:
    """A user probe: ``package.module:function`` (or ``module:obj.attr``) imported at construction.

    Called as ``function(model_dir: Path, ctx: ProbeContext, **params)`` where ``params`` are every
    keyword given to :func:`make_probe` except ``target`` and ``name``; it must return a mapping of
    metric name (str) to number, which is checked (no NaN) and converted to floats.

    Args:
        target: ``"package.module:function"``; the module must be importable (on ``sys.path``).
        name: probe name (default: the target string).
        **params: passed through to the function as keyword arguments.

    Raises:
        ProbeError: malformed target, import failure, missing or non-callable attribute; at call
            time a result that is not a mapping of names to numbers.
    """

    def __init__(self, target: str | None = None, name: str | None = None, **params: Any):
        self.target = target
        self.func = resolve_callable(target, what="entrypoint", error=ProbeError)
        self.params = params
        self.name = name or str(target)

    def __call__(self, model_dir: Path, ctx: ProbeContext) -> dict[str, float]:
        """Call the user function and validate its result."""
        return as_metrics(self.func(Path(model_dir), ctx, **self.params), self.name)
