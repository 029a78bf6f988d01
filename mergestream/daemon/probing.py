"""The daemon's probe runner: the configured probes, the task probes of accepted experts, θ₀'s
cached values, and the current version's (what the gate compares a candidate with)."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from ..config import Config
from ..errors import MergestreamError
from ..io.state import StateDir
from .ledger import Ledger
from .probes import ProbeContext, discover_task_probe, make_probe, run_probes
from .store import Store

log = logging.getLogger("mergestream.service")


class Prober:
    """Runs the configured probes (plus every accepted expert's task probe) on a model folder.

    Task probes of accepted experts are kept under ``state_dir/tasks/<expert>/mergestream_probe``
    (:meth:`keep_task_probe`), so later candidates are checked against every task folded so far.
    """

    def __init__(self, cfg: Config, ledger: Ledger, store: Store):
        self.cfg, self.ledger, self.store = cfg, ledger, store
        self._probes: list[Any] | None = None

    def probes(self) -> list[Any]:
        """The configured probes (built once, on first use)."""
        if self._probes is None:
            self._probes = [make_probe(p.type, **p.params) for p in self.cfg.probes]
        return self._probes

    def accepted_task_probes(self) -> list[tuple[str, Any]]:
        """(expert id, task probe) of every accepted expert that shipped one, in ledger order."""
        out = []
        for row in self.ledger.experts():
            if row.status == "accepted":
                spec = discover_task_probe(self.cfg.state_dir / "tasks" / row.expert_id)
                if spec is not None:
                    out.append((row.expert_id, spec))
        return out

    def task_specs(self, extra: Path | None = None) -> list[Any]:
        """Task probes of the accepted experts, plus ``extra``'s (a candidate expert folder) if it ships one."""
        specs = [spec for _, spec in self.accepted_task_probes()]
        if extra is not None and (spec := discover_task_probe(extra)) is not None:
            specs.append(spec)
        return specs

    def run(self, model_dir: Path, previous: Path | None, state_dir: Path | None,
            candidate_expert: Path | None = None) -> dict[str, float]:
        """Probe ``model_dir`` (``previous``: the current version's model, for drift; ``state_dir``:
        the candidate's policy state, whose stored contributions the weight-space probe reads).

        Raises:
            ProbeError (or anything a probe raises): the caller records the attempt as failed.
        """
        contributions = []
        if state_dir is not None and (state_dir / "manifest.json").exists():
            sd = StateDir(state_dir)
            contributions = [state_dir / f.contribution for f in sd.manifest.folds if f.contribution]
        base = Path(self.cfg.base)
        ctx = ProbeContext(base=base, previous=previous, contributions=contributions,
                           tasks=self.task_specs(candidate_expert), device=self.cfg.device,
                           tokenizer=base if base.is_dir() else None, cache_dir=self.cfg.state_dir / "cache" / "probes")
        return run_probes(self.probes(), model_dir, ctx)

    def base(self) -> dict[str, float]:
        """θ₀'s probe values, cached in the ledger while the base and the probe config are unchanged."""
        key = hashlib.sha256(json.dumps([str(self.cfg.base), [p.model_dump() for p in self.cfg.probes]],
                                        sort_keys=True, default=str).encode()).hexdigest()[:16]
        cached = self.ledger.get_meta("base_probes")
        if cached and cached.get("key") == key:
            return cached["values"]
        # a first start is silent otherwise for as long as the probes take (a minute on a small model
        # on 2 busy cores): say what it does and that it is kept
        log.info("measuring the base with the probes (%s): once, kept in the ledger for later starts; experts "
                 "that arrive meanwhile wait", ", ".join(p.type for p in self.cfg.probes) or "weight_space")
        values = self.run(Path(self.cfg.base), None, None)
        self.ledger.set_meta("base_probes", {"key": key, "values": values})
        return values

    def current(self) -> dict[str, float] | None:
        """The current version's probe values (None before the first version)."""
        cur = self.store.current()
        if cur is None:
            return None
        return self.store.fold_json(cur).get("probes")

    def keep_task_probe(self, expert_id: str, expert_dir: Path) -> None:
        """Keep an accepted expert's task probe (if it ships one) for the candidates after it."""
        try:
            spec = discover_task_probe(expert_dir)
        except MergestreamError as exc:
            log.warning("expert %s ships a malformed probe: %s", expert_id, exc)
            return
        if spec is None:
            return
        dest = self.cfg.state_dir / "tasks" / expert_id
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(expert_dir / "mergestream_probe", dest / "mergestream_probe")
