"""The records the daemon's parts pass each other about one expert and one attempt: the ledger's
:class:`ExpertRow`, the pipeline's :class:`Attempt` and how it ended (:class:`Outcome`, written to
the ledger by :meth:`~mergestream.daemon.ledger.Ledger.record_fold`). Data only, no behaviour."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


#: the ledger's ``sha256`` of an expert queued but not yet read: this prefix + its arrival key
#: (:func:`mergestream.io.expert_readers.arrival_key`); its fold replaces it with the content hash
ARRIVAL_PREFIX = "arrival:"


@dataclass(frozen=True)
class ExpertRow:
    """One expert as the ledger knows it (``sha256``: its content hash, or ``arrival:<key>`` until
    its fold has read it: :attr:`content_sha256`)."""

    row: int
    expert_id: str
    source: str
    uri: str
    sha256: str
    registry_key: str | None
    metadata: dict[str, Any]
    status: str
    reason: str | None
    version: int | None
    created: float
    updated: float

    @property
    def content_sha256(self) -> str | None:
        """The expert's content hash (64 hex), or None while it is known by its arrival key only."""
        return None if self.sha256.startswith(ARRIVAL_PREFIX) else self.sha256

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Attempt:
    """One try at publishing a new version.

    Attributes:
        kind: ``"fold"`` (an expert in) or ``"unmerge"`` (an expert out).
        expert_id: the expert folded in or removed.
        staging: the candidate's folder (``model/``, ``state/``), published or removed at the end.
        started: wall-clock start (s since the epoch).
        row: the ledger row of a folded expert (None for an unmerge).
        params: the policy parameters recorded with the attempt.
        timings: seconds (and counts) per stage, logged as MLflow metrics.
        extra: more for ``fold.json`` (the RI pre-step's and the coefficient search's records).
        candidate_expert: the expert's folder when it is one (it may ship a task probe).
    """

    kind: str
    expert_id: str
    staging: Path
    started: float
    row: ExpertRow | None = None
    params: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    candidate_expert: Path | None = None


@dataclass
class Outcome:
    """How an attempt ended.

    Attributes:
        decision: ``accepted``, ``rejected`` or ``failed``.
        reason: why it was not accepted (None when accepted).
        stage: where a rejection happened (``validation``, ``preprocess``, ``postprocess``, ``gate``),
            the label of ``mergestream_experts_rejected_total``.
        probes: the candidate's probe values (empty when it was never probed).
    """

    decision: str
    reason: str | None = None
    stage: str = ""
    probes: dict[str, float] = field(default_factory=dict)
