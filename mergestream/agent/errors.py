"""The agent's refusals, each with its exit code, and the fault-injection points the tests use.

Exit codes of ``mergestream-agent``: 0 done (updated, up to date, held back), 1 unexpected
failure, 2 usage, and the codes of the :class:`AgentError` subclasses below.
"""

from __future__ import annotations

import os
import signal

from ..errors import MergestreamError

CRASH_ENV = "MERGESTREAM_AGENT_CRASH_AT"


class AgentError(MergestreamError):
    """A refusal or failure of the agent; ``code`` is the process exit status."""

    code = 1


class MetadataRefused(AgentError):
    """The feed's signed metadata failed verification: bad signature, expired (freeze), an older
    version than already seen (rollback), wrong length. Nothing was downloaded or changed."""

    code = 3


class TargetRefused(AgentError):
    """A downloaded file or an applied result does not match the signed length/hash."""

    code = 4


class DownloadFailed(AgentError):
    """A network failure; what was downloaded is kept and the next run resumes from it."""

    code = 5


class HealthCheckFailed(AgentError):
    """The ``--check`` command failed on the new slot: the device stays on (or returns to) the old one."""

    code = 6


class LocalStateError(AgentError):
    """The device state forbids the operation: no trusted root, another agent running, nothing to
    roll back to, an unusable model folder."""

    code = 7


def crashpoint(stage: str, progress: int | None = None) -> None:
    """Fault injection for the power-loss tests: SIGKILL this process at ``stage``.

    ``MERGESTREAM_AGENT_CRASH_AT`` is ``stage`` or ``stage:N`` (for ``download``: once at least N
    bytes of a file were written). Unset in production: a no-op.
    """
    want = os.environ.get(CRASH_ENV)
    if not want:
        return
    name, _, n = want.partition(":")
    if name == stage and (not n or (progress is not None and progress >= int(n))):
        os.kill(os.getpid(), signal.SIGKILL)
