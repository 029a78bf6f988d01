"""The operator's rollback: ``current`` points at another kept version, expert statuses follow.

:func:`roll_back` is the one home of what a rollback changes in the store and the ledger; the
running daemon calls it on its loop (:meth:`mergestream.daemon.service.Service.rollback`, through
the ledger's command table), and :func:`rollback_here` runs it when no daemon holds the state
folder, without starting one: no probes, no sources, no torch (``mergestream rollback`` then takes a
fraction of a second, plus MLflow's import when tracking is on). Torch-free, like the other ledger
verbs' modules.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from ..errors import MergestreamError
from .feed_publish import build_feed_publisher
from .ledger import Ledger
from .metrics import Metrics
from .mirror import build_mirror
from .store import Store
from .tracking import make_tracker

if TYPE_CHECKING:
    from ..config import Config

log = logging.getLogger("mergestream.service")


def roll_back(store: Store, ledger: Ledger, version: int, policy: str) -> tuple[int | None, str]:
    """Point ``current`` at published version ``version`` (earlier or later).

    An expert in that version is ``accepted`` (also one an earlier rollback or unmerge took out), an
    accepted expert not in it becomes ``unmerged``; rejected, failed and queued experts are left as
    they are. The rollback is recorded in the history. The store's publishers (mirror, feed) are told.

    Returns:
        ``(the previous current version or None, the operator's message)``.

    Raises:
        MergestreamError: ``version`` is not kept. OSError: the state folder or the ledger cannot be
            written (``current`` is put back when the ledger failed).
    """
    if version not in store.numbers():
        raise MergestreamError(f"version {version} does not exist (kept: {store.numbers()})")
    before = store.current()
    store.point_current(version)
    try:
        keep = set(store.fold_json(version).get("experts", []))
        for row in ledger.experts():
            if row.expert_id in keep and row.status != "accepted":
                ledger.set_status(row.expert_id, "accepted", None)
            elif row.expert_id not in keep and row.status == "accepted":
                ledger.set_status(row.expert_id, "unmerged", f"rolled back to version {version}")
    except OSError:  # the ledger's disk: current goes back, so that it and the statuses still agree
        if before is not None:
            store.point_current(before)
        raise
    ledger.record_event("rollback", expert_id=None, policy=policy, params={"from": before, "to": version},
                        decision="accepted", reason=f"operator rollback {before} -> {version}", version=version)
    return before, f"current: version {before} -> {version}"


def rollback_here(cfg: Config, version: int) -> str:
    """``mergestream rollback`` when no daemon runs: take the daemon's lock (none starts meanwhile),
    :func:`roll_back`, tell the mirror and the feed (a feed build finishes before this returns) and
    move the MLflow alias, as the daemon would. Returns the operator's message.

    Raises:
        LockedError: a daemon took the state folder meanwhile. MergestreamError, OSError: as
            :func:`roll_back`; ConfigError: the feed's keys cannot be loaded.
    """
    store = Store(cfg.state_dir)
    store.lock()
    ledger = feed = None
    try:
        metrics = Metrics()
        ledger = Ledger(cfg.state_dir / "ledger.sqlite")
        feed = build_feed_publisher(cfg, metrics)
        store.publishers = [p for p in (build_mirror(cfg, metrics), feed) if p is not None]
        if feed is not None:
            feed.start(store.current())
        _, message = roll_back(store, ledger, version, cfg.policy.name)
        make_tracker(cfg, ledger, metrics, store.current).submit("alias", {})
        log.info("%s (no daemon running; pid %d)", message, os.getpid())
        return message
    finally:
        if feed is not None:
            feed.close()
        if ledger is not None:
            ledger.close()
        store.unlock()
