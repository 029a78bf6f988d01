"""The shortest verified path from what a device runs to what the feed says it should run.

Pure and standard-library only: the device agent plans with it, and ``mergestream feed build``
uses it to report how many bytes a device at each version needs.

The graph: nodes are weights hashes (:mod:`mergestream.io.st`); each patch target is an edge
``from_sha256 -> to_sha256`` costing its length in bytes; the full model of the latest version
is an edge from anywhere (a fresh device included) costing the sum of its files' lengths.
Dijkstra over bytes (ties: fewer downloads) gives the cheapest route.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Target:
    """One feed target as the planner sees it: its path, length in bytes and ``custom.mergestream``."""

    path: str
    length: int
    info: dict[str, Any]


@dataclass
class Plan:
    """What to download and in which order.

    Attributes:
        kind: ``"none"`` (already there), ``"patches"`` (a chain applied in order) or ``"full"``.
        steps: the patch targets in order (``patches``) or the model's files (``full``).
        bytes: total download size. target_version / target_sha256: where the plan ends.
    """

    kind: str
    steps: list[Target] = field(default_factory=list)
    bytes: int = 0
    target_version: int | None = None
    target_sha256: str = ""

    def describe(self) -> str:
        """One line: ``"patches 1->2->5 (12,345 bytes)"``, ``"full model v5 (…)"`` or ``"up to date"``."""
        if self.kind == "none":
            return "up to date"
        if self.kind == "full":
            return f"full model v{self.target_version} ({self.bytes:,} bytes, {len(self.steps)} files)"
        chain = [str(self.steps[0].info["from_version"])] + [str(s.info["to_version"]) for s in self.steps]
        return f"patches {'->'.join(chain)} ({self.bytes:,} bytes)"


class NoPathError(Exception):
    """The feed offers no way from the installed version to the latest (no patch chain, no full model)."""


def full_model_files(targets: list[Target], version: int, sha: str) -> list[Target]:
    """The files of the full model of ``version`` whose recorded weights hash is ``sha`` (sorted by path)."""
    return sorted((t for t in targets if t.info.get("kind") == "model" and t.info.get("version") == version
                   and t.info.get("weights_sha256") == sha), key=lambda t: t.path)


def shortest(targets: list[Target], installed_sha: str | None, latest_version: int, latest_sha: str) -> Plan:
    """The cheapest way (bytes) from ``installed_sha`` (None: nothing installed) to ``latest_sha``.

    Raises:
        NoPathError: no patch chain and no full model reach the latest version.
    """
    if installed_sha == latest_sha:
        return Plan("none", [], 0, latest_version, latest_sha)
    full = full_model_files(targets, latest_version, latest_sha)
    best: Plan | None = None
    if full:
        best = Plan("full", full, sum(t.length for t in full), latest_version, latest_sha)
    if installed_sha is not None:
        edges: dict[str, list[Target]] = {}
        for t in targets:
            if t.info.get("kind") == "patch":
                edges.setdefault(t.info.get("from_sha256", ""), []).append(t)
        dist: dict[str, tuple[int, int]] = {installed_sha: (0, 0)}
        prev: dict[str, Target] = {}
        heap: list[tuple[int, int, str]] = [(0, 0, installed_sha)]
        while heap:
            cost, hops, node = heapq.heappop(heap)
            if (cost, hops) > dist.get(node, (cost, hops)):
                continue
            if node == latest_sha:
                break
            for t in edges.get(node, ()):
                nxt, cand = t.info.get("to_sha256", ""), (cost + t.length, hops + 1)
                if cand < dist.get(nxt, (float("inf"), 0)):
                    dist[nxt], prev[nxt] = cand, t
                    heapq.heappush(heap, (*cand, nxt))
        if latest_sha in dist:
            chain, node = [], latest_sha
            while node != installed_sha:
                chain.append(prev[node])
                node = prev[node].info["from_sha256"]
            chain.reverse()
            cost = dist[latest_sha][0]
            if best is None or cost < best.bytes or (cost == best.bytes and len(chain) <= len(best.steps)):
                best = Plan("patches", chain, cost, latest_version, latest_sha)
    if best is None:
        raise NoPathError(f"the feed offers no patch chain from the installed model ({installed_sha or 'none'}) "
                          f"and no full model of version {latest_version}")
    return best
