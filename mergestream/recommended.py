"""The recommended merge policy and its parameters, without torch.

The row with the best measured H in ``bench/results/quality.md`` (file order and shuffles, tuned
coefficients) that needs no data and whose policy's state does not grow with the stream
(``Policy.state_grows``), kept in step with it by ``tests/test_recommended_policy.py``. ``mergestream init``,
the starter config, the daemon's config default and ``mergestream demo`` use it. It lives outside
:mod:`mergestream.policies` (which imports torch) so that the configuration, and with it the
ledger verbs (``status``, ``history``, ``rollback``), load without torch;
:mod:`mergestream.policies` re-exports both names.
"""

from __future__ import annotations

from typing import Any

RECOMMENDED_POLICY: str = "iso_c"
RECOMMENDED_PARAMS: dict[str, Any] = {"alpha": 2.0, "lambda": 0.2}
