"""The fold, the offline merge and the unmerge, on the one streaming skeleton of :mod:`.stream`.

For each tensor the engine reads θ₀, θ_{t−1} and the expert (float32 for the math), asks the
policy for Δ_t, and writes cast(θ_{t−1} + Δ_t) into a staged output, the policy's per-tensor state,
and what subtract-unmerge needs (:mod:`.residuals`). The expert is read once per fold: its content
hash, the finiteness check and the frozen-tensor comparison ride on the same pass (headers are
checked before any data is read). Peak memory is a few tensors per worker thread, never the
model; Task Arithmetic (a :meth:`~mergestream.policies.Policy.linear_scale` policy) folds in
chunks of each tensor. Integer/bool tensors are copied from θ₀; tensors tied in θ₀ (embeddings
and LM head) are written as one.

Public entry points: :func:`fold`, :func:`merge` (offline, K experts), :func:`unmerge`
(``subtract`` or ``replay``); :func:`task_vector_stats` and :func:`describe` (for ``inspect``)
live in :mod:`.inspection` and are re-exported here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import residuals
from ._alloc import pin_mmap_threshold
from .checkpoints import (
    DEFAULT_SHARD_BYTES,
    Checkpoint,
    DenseExpert,
    check_finite_tensor,
    check_frozen,
    default_expert_id,
    is_embedding_name,
    is_float_dtype,
    open_checkpoint,
    open_expert,
    open_safetensors_file,
    tied_groups,
    validate_against_base,
)
from .errors import CorruptCheckpointError, MergestreamError, NonFiniteError, OutputExistsError, PolicyError, StateError
from .inspection import describe, resolve_device, task_vector_stats
from .policies import Policy, TensorContext, cmaes_coefficients, make_policy, stability_penalty
from .state import SEP, FoldRecord, Manifest, StateDir, final_name
from .st import name_order
from .stream import ExpertReader, Progress, default_threads, run_stream
from .writers import AppendWriter, ModelWriter, copy_aux_files, staged_output

log = logging.getLogger(__name__)

__all__ = ["FoldReport", "fold", "merge", "unmerge", "resolve_device", "task_vector_stats", "describe"]

#: objective(alphas, weights) -> loss; ``weights()`` streams (name, float32 tensor) of θ(α).
Objective = Callable[[np.ndarray, Callable[[], Iterator[tuple[str, torch.Tensor]]]], float]


@dataclass
class FoldReport:
    """What one fold (or merge / unmerge) did.

    Attributes:
        seconds: wall time of the whole call (s). bytes_read / bytes_written: tensor data (bytes).
        stats: policy statistics averaged over tensors (e.g. ``kept_fraction``).
        coefficients: MDM-OC's α of every folded expert after this fold.
        search: for CMA-ES coefficients, ``{"evaluations", "objective_start", "objective"}`` (the
            penalised objective at the starting α and at the chosen α; lower is better).
        sha256: the content hash of each expert read (computed on the fold's own pass).
    """

    out: str
    policy: str
    params: dict[str, Any]
    experts: list[str]
    seconds: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    coefficients: list[float] | None = None
    search: dict[str, float] | None = None
    sha256: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


#: a same-length placeholder for a content hash known only at the end of the pass
_NO_HASH = "0" * 64


def _seed(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


class _Stats:
    """Policy statistics and bytes read, summed over tensors from worker threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.kept = 0.0
        self.numel = 0
        self.bytes_read = 0

    def add(self, stats: dict[str, float], numel: int, nbytes: int) -> None:
        with self.lock:
            self.bytes_read += nbytes
            for k, v in stats.items():
                if k == "kept":
                    self.kept += v
                    self.numel += numel
                else:
                    self.sums[k] = self.sums.get(k, 0.0) + v
                    self.counts[k] = self.counts.get(k, 0) + 1

    def summary(self) -> dict[str, float]:
        out = {k: self.sums[k] / self.counts[k] for k in self.sums}
        if self.numel:
            out["kept_fraction"] = self.kept / self.numel
        return out


def _cast_checked(x: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """``x`` (a fold's or unmerge's result) cast to the storage dtype on the CPU; NonFiniteError if
    it is not finite there (overflow)."""
    out = x.to(dtype) if x.dtype != dtype else x
    out = out.cpu() if out.device.type != "cpu" else out
    if out.is_floating_point() and out.numel() and not bool(torch.isfinite(out.sum(dtype=torch.float32))) \
            and not bool(torch.isfinite(out).all()):
        raise NonFiniteError(f"tensor {name}: the result is not finite in {dtype} (overflow?); nothing written")
    return out


def _write_with_aliases(writer: ModelWriter, name: str, result: torch.Tensor, aliases: dict[str, str]) -> None:
    """Write a tensor and every tensor tied to it in θ₀ (same bytes)."""
    writer.write(name, result)
    for alias, primary in aliases.items():
        if primary == name:
            writer.write(alias, result)


def _provenance(policy: Policy, records: list[dict[str, str]], base: Checkpoint) -> dict[str, str]:
    return {
        "format": "pt",
        "mergestream.policy": policy.name,
        "mergestream.params": json.dumps(policy.describe(), sort_keys=True),
        "mergestream.experts": json.dumps([r["id"] for r in records]),
        "mergestream.expert_sha256": json.dumps([r["sha256"] for r in records]),
        "mergestream.n_folds": str(len(records)),
        "mergestream.base": str(base.path),
    }


def _open_base_and_backbone(base: str | os.PathLike, backbone: str | os.PathLike | None) -> tuple[Checkpoint, Checkpoint]:
    b = open_checkpoint(base)
    if backbone is None or Path(backbone).resolve() == Path(base).resolve():
        return b, b
    cur = open_checkpoint(backbone)
    validate_against_base(b, cur, role="backbone", check_finite=False, deep=False)
    return b, cur


def _largest(metas) -> int:
    """Bytes of the largest tensor (the memory budget of the whole-tensor jobs alive at once)."""
    return max((m.nbytes for m in metas), default=0)


def _threads(threads: int | None) -> int:
    return default_threads() if threads is None or threads <= 0 else threads


class _ExpertLoader:
    """The fold's loader: reads (and hashes) the expert in canonical order, checks frozen tensors.

    ``load(name)`` returns ``(expert tensor or None, prev)`` for the worker, or None for a tensor
    the worker skips (an alias tied in θ₀: written with its primary). LoRA experts have no dense
    tensor to stream: the worker builds τ from the factors.
    """

    def __init__(self, exp, base: Checkpoint, aliases: dict[str, str], where: str, buffers: int = 0):
        self.dense = isinstance(exp, DenseExpert)
        self.reader = ExpertReader(exp.ckpt, buffers) if self.dense else None
        self.base = base
        self.aliases = aliases
        self.where = where
        self.names = self.reader.order() if self.dense else [n for n in _order(base) if n not in aliases]

    def load(self, name: str):
        e = self.reader.read(name) if self.dense else None
        if name in self.aliases:
            self._drop(e)
            return None
        meta = self.base.meta(name)
        if not is_float_dtype(meta.dtype):
            want = self.base.get(name)
            try:
                if e is not None:
                    check_frozen(name, e, want, self.where, self.base.path)
            finally:
                self._drop(e)
            return ("frozen", want)
        return ("float", e)

    def _drop(self, e) -> None:
        if e is not None:
            self.reader.release(e)

    def release(self, item) -> None:
        """Hand a job's expert buffer back to the reader's pool."""
        if item is not None and self.reader is not None and item[0] == "float":
            self.reader.release(item[1])


def _order(ck: Checkpoint) -> list[str]:
    """θ₀'s tensor names in canonical order (the order every pass loads them in)."""
    return name_order(ck.keys())


def fold(base: str | os.PathLike, backbone: str | os.PathLike | None, expert: str | os.PathLike,
         policy: str | Policy, params: dict[str, Any] | None = None, *, state_dir: str | os.PathLike,
         out: str | os.PathLike, expert_id: str | None = None, device: str = "cpu", threads: int | None = 1,
         max_shard_bytes: int = DEFAULT_SHARD_BYTES, objective: Objective | None = None,
         overwrite: bool = False, progress: bool = False, expect_sha256: str | None = None,
         tensor_hook: Callable[[str], None] | None = None) -> FoldReport:
    """Fold one expert into the backbone: θ_t = θ_{t−1} + Δ_t, tensor by tensor, reading it once.

    Args:
        base: θ₀ (file or folder). backbone: θ_{t−1}; None (or θ₀ itself) for the first fold.
        expert: dense checkpoint or PEFT LoRA adapter folder.
        policy: a registered name (with ``params``) or a :class:`Policy`.
        state_dir: the policy state folder (created at the first fold, updated atomically).
        out: output folder (must not exist unless ``overwrite``); staged and renamed into place.
        expert_id: defaults to :func:`~mergestream.checkpoints.default_expert_id`.
        device: where the math runs (``cpu`` or ``cuda[:i]``); tensors are streamed from CPU.
        threads: worker threads (None or 0: :func:`~mergestream.stream.default_threads`); peak
            memory grows by a few tensors per thread.
        max_shard_bytes: output shard cap (bytes).
        objective: for a policy that searches coefficients (``mdm_oc`` with ``coefficients=cmaes``).
        progress: show a progress bar on a terminal.
        expect_sha256: the content hash the caller recorded (the daemon's ledger); a fold whose
            expert hashes differently (changed since) is refused before anything is committed.
        tensor_hook: called with each tensor name before it is folded (tests, stop requests).

    Returns:
        :class:`FoldReport`.

    Raises:
        ValidationError subclasses: the expert or backbone does not fit θ₀ (nothing written, the
            state unchanged, even when the bad tensor is the last one read).
        StateError: the state folder disagrees with the backbone or already holds the expert.
        PolicyError: unknown policy, bad parameters, or another policy than the state's.
        NonFiniteError: a result overflowed its dtype. OutputExistsError: ``out`` exists.
        CorruptCheckpointError: the expert's content hash is not ``expect_sha256``.
    """
    pin_mmap_threshold()
    t0 = time.perf_counter()
    pol = policy if isinstance(policy, Policy) else make_policy(policy, params)
    dev = resolve_device(device)
    sd = StateDir(state_dir)
    man = sd.manifest
    if man.policy is not None and man.policy != pol.name and man.folds:
        raise PolicyError(f"state {sd.path} belongs to policy {man.policy!r}, not {pol.name!r}")
    if Path(out).exists() and not overwrite:
        raise OutputExistsError(f"{out} already exists; choose a new output path")
    base_ck, cur = _open_base_and_backbone(base, backbone)
    eid = expert_id or default_expert_id(expert)
    if eid in man.ids():
        raise StateError(f"expert {eid!r} is already folded into this state; use another --id or unmerge it first")
    n_prev = len(man.folds)
    first = cur is base_ck
    cur_folds = 0 if first else int(cur.metadata().get("mergestream.n_folds", "-1"))
    if cur_folds != n_prev:
        raise StateError(
            f"backbone {cur.path} holds {cur_folds if cur_folds >= 0 else 'an unknown number of'} fold(s) but state "
            f"{sd.path} records {n_prev}: pass the backbone produced by the last fold with this state")
    if man.base_tensors is not None and man.base_tensors != len(base_ck.keys()):
        raise StateError(f"state {sd.path} was built on another base ({man.base})")
    if pol.searches_coefficients() and objective is None:
        raise PolicyError("coefficients=cmaes needs an objective (--objective module:function)")
    exp = open_expert(expert, base_ck)
    try:
        validate_against_base(base_ck, exp, role="expert", deep=False)
        lin = pol.linear_scale() if isinstance(exp, DenseExpert) else None
        # element-wise policies are I/O-bound: read ahead into pooled buffers (no page faults)
        buffers = _threads(threads) + 1 if lin is not None else 0
        loader = _ExpertLoader(exp, base_ck, tied_groups(base_ck), f"expert {exp.path}", buffers)
        return _fold_pass(pol, sd, man, base_ck, cur, exp, loader, eid, expert, base, out, dev, threads,
                          max_shard_bytes, objective, overwrite, progress, expect_sha256, tensor_hook, t0)
    finally:
        exp.close()
        base_ck.close()
        cur.close()


def _fold_pass(pol, sd, man, base_ck, cur, exp, loader, eid, expert, base, out, dev, threads, max_shard_bytes,
               objective, overwrite, progress, expect_sha256, tensor_hook, t0) -> FoldReport:
    first = cur is base_ck
    n_prev = len(man.folds)
    aliases = loader.aliases
    metas = base_ck.metas()
    coeff = pol.coefficient()
    prev_coeffs = tuple(man.coefficients())
    search = pol.searches_coefficients()
    store_contrib = not pol.contributions_in_state
    lin = pol.linear_scale() if loader.dense else None
    stats = _Stats()
    state_lock = threading.Lock()
    state_path = sd.new_file("state")
    contrib_path = sd.new_file("contrib", eid) if store_contrib else None
    new_files: list[Path] = [state_path] + ([contrib_path] if contrib_path else [])
    state_writer = AppendWriter(state_path, header_bytes=residuals.header_room(metas, 4))
    contrib = residuals.ResidualWriter(contrib_path, metas, eid) if store_contrib else None
    bar = Progress(sum(m.nbytes for m in metas), len(metas), f"fold {eid}", progress)
    try:
        with staged_output(out, overwrite=overwrite) as stage:
            planned = [{"id": f.id, "sha256": f.sha256} for f in man.folds] + [{"id": eid, "sha256": _NO_HASH}]
            writer = ModelWriter(stage, metas, _provenance(pol, planned, base_ck), max_shard_bytes)
            try:
                def work(name: str, item) -> None:
                    kind, e = item
                    if tensor_hook is not None:
                        tensor_hook(name)
                    meta = base_ck.meta(name)
                    if kind == "frozen":
                        _write_with_aliases(writer, name, e, aliases)
                        stats.add({}, meta.numel, meta.nbytes)  # θ₀'s copy (the expert's is counted by its reader)
                        return
                    if e is not None and lin is None:
                        check_finite_tensor(name, e, loader.where)
                    if lin is not None:
                        residuals.fold_linear(name, e, lin, base_ck, None if first else cur, dev, contrib,
                                              loader.where)
                        _write_with_aliases(writer, name, e, aliases)
                        stats.add({}, meta.numel, meta.nbytes * (1 if first else 2))  # θ₀ (and θ_{t−1})
                        return
                    b = base_ck.get(name).to(dev, torch.float32)
                    # θ_{t−1} as stored is kept only when its residual is stored (not for policies
                    # whose contributions live in their state), so memory stays at a few tensors
                    prev_s = None
                    if first:
                        bb = b.clone()
                        if contrib is not None:
                            prev_s = b if meta.dtype == torch.float32 else b.to(meta.dtype)
                    else:
                        prev_s = cur.get(name)
                        bb = prev_s.to(dev, torch.float32, copy=contrib is not None)
                        if contrib is None:
                            prev_s = None
                    tau = exp.task_vector(name, b).to(dev) if e is None else e.to(dev, torch.float32).sub_(b)
                    if e is None:
                        check_finite_tensor(name, tau, f"LoRA delta of {loader.where}")
                    del e
                    with state_lock:
                        st = {k: v.to(dev) for k, v in sd.tensor_state(name).items()}
                    ctx = TensorContext(name, n_prev, prev_coeffs, is_embedding_name(name), _seed(name))
                    res = pol.fold_tensor(b, bb, tau, st, ctx)
                    del b, tau
                    if not search:  # a coefficient search writes the output once, from the state
                        result = _cast_checked(bb.add_(res.delta, alpha=res.scale), meta.dtype, name)
                        _write_with_aliases(writer, name, result, aliases)
                        if contrib is not None:
                            contrib.add(name, result, prev_s)
                    for k, v in res.state.items():
                        state_writer.write(f"{name}{SEP}{k}", v.cpu())
                    stats.add(res.stats, meta.numel, meta.nbytes * (1 if first else 2))  # θ₀ (and θ_{t−1})

                # read ahead only where the fold is I/O-bound (element-wise policies): elsewhere the
                # math dominates and a prefetched tensor would only add to peak memory
                # whole-tensor policies hold several float32 copies of each tensor: the largest
                # tensor runs alone, smaller ones in parallel (memory of --threads 1 at its peak)
                run_stream(loader.names, loader.load, work, threads=_threads(threads), progress=bar,
                           prefetch=1 if lin is not None else 0, sizes=lambda n: base_ck.meta(n).nbytes,
                           release=loader.release, budget=None if lin is not None else _largest(metas))
                sha = exp.sha256() if not loader.dense else loader.reader.sha256()
                if expect_sha256 is not None and sha != expect_sha256:
                    raise CorruptCheckpointError(
                        f"expert {exp.path} changed since it was registered: content hash {sha}, expected "
                        f"{expect_sha256}; nothing was folded")
                records = [{"id": f.id, "sha256": f.sha256} for f in man.folds] + [{"id": eid, "sha256": sha}]
                writer.set_metadata(_provenance(pol, records, base_ck))
                state_writer.close()
                coeffs = list(prev_coeffs) + [coeff] if coeff is not None else None
                found = None
                if search:
                    coeffs, found = _optimise_coefficients(pol, base_ck, state_path, coeffs, list(prev_coeffs),
                                                           objective, dev)
                    _rewrite_from_state(pol, base_ck, state_path, coeffs, writer, dev, threads, aliases)
                writer.close()
                if contrib is not None:
                    contrib.close()
                copy_aux_files(base_ck, stage)
            except BaseException:
                writer.abort()
                raise
    except BaseException:
        state_writer.abort()
        if contrib is not None:
            contrib.abort()
        for f in new_files:
            f.unlink(missing_ok=True)
        for folder in (sd.path / "contrib", sd.path):  # a failed first fold leaves no state folder
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if empty
        raise
    finally:
        bar.close()
    fold_rec = FoldRecord(id=eid, expert=str(Path(expert).resolve()), sha256=sha, params=pol.describe(),
                          coefficient=coeffs[-1] if coeffs else None,
                          contribution=final_name(contrib_path, sd.path) if store_contrib else None,
                          exact_restore=store_contrib, sha256_kind="weights")
    folds = list(man.folds)
    if coeffs:
        for f, c in zip(folds, coeffs):
            f.coefficient = float(c)
    new_man = Manifest(policy=pol.name, base=str(Path(base).resolve()), base_tensors=len(base_ck.keys()),
                       backbone=str(Path(out).resolve()), state_file=final_name(state_path, sd.path),
                       folds=folds + [fold_rec])
    sd.close()
    sd.commit(new_man, new_files)
    bytes_read = (loader.reader.bytes_read if loader.dense else 0) + stats.bytes_read
    report = FoldReport(out=str(out), policy=pol.name, params=pol.describe(), experts=[eid],
                        seconds=time.perf_counter() - t0, bytes_read=bytes_read,
                        bytes_written=writer.bytes_written, stats=stats.summary(),
                        coefficients=[float(c) for c in coeffs] if coeffs else None, search=found, sha256=[sha])
    log.info("fold expert=%s policy=%s seconds=%.2f out=%s", eid, pol.name, report.seconds, out)
    return report


def _state_reader(path: Path) -> Callable[[str], dict[str, torch.Tensor]]:
    ck = open_safetensors_file(path)
    fields: dict[str, list[str]] = {}
    for key in ck.keys():
        t, _, f = key.rpartition(SEP)
        fields.setdefault(t, []).append(f)
    return lambda name: {f: ck.get(f"{name}{SEP}{f}") for f in fields.get(name, [])}


def _weights_stream(pol: Policy, base: Checkpoint, state_path: Path, coeffs: list[float],
                    dev: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    read = _state_reader(state_path)
    for m in base.metas():
        if not is_float_dtype(m.dtype):
            yield m.name, base.get(m.name)
            continue
        b = base.get(m.name).to(dev, torch.float32)
        st = {k: v.to(dev) for k, v in read(m.name).items()}
        yield m.name, pol.rebuild(b, st, coeffs) if st else b


def _optimise_coefficients(pol: Policy, base: Checkpoint, state_path: Path, start: list[float],
                           anchor: list[float], objective: Objective,
                           dev: torch.device) -> tuple[list[float], dict[str, float]]:
    p = pol.params
    seen: list[float] = []

    def f(alphas: np.ndarray) -> float:
        v = float(objective(alphas, lambda: _weights_stream(pol, base, state_path, list(alphas), dev)))
        seen.append(v)
        return v

    best, loss, evals = cmaes_coefficients(f, start, anchor, stability=p.stability, budget=p.budget, sigma=p.sigma)
    start_pen = seen[0] + p.stability * stability_penalty(start, anchor)
    log.info("cmaes coefficients=%s objective_start=%.6g objective=%.6g evaluations=%d",
             [round(float(x), 4) for x in best], start_pen, loss, evals)
    return [float(x) for x in best], {"evaluations": float(evals), "objective_start": start_pen, "objective": float(loss)}


def _rewrite_from_state(pol: Policy, base: Checkpoint, state_path: Path, coeffs: list[float],
                        writer: ModelWriter, dev: torch.device, threads: int | None, aliases: dict[str, str]) -> None:
    """Write θ(α) = θ₀ + Σ αᵢ dᵢ from the state: the output of a coefficient search, written once."""
    read = _state_reader(state_path)

    def load(name: str):
        return None if name in aliases else (base.get(name), read(name))

    def work(name: str, item) -> None:
        b, st = item
        meta = base.meta(name)
        if is_float_dtype(meta.dtype) and st:
            t = pol.rebuild(b.to(dev, torch.float32), {k: v.to(dev) for k, v in st.items()}, coeffs)
            b = _cast_checked(t, meta.dtype, name)
        _write_with_aliases(writer, name, b, aliases)

    run_stream(_order(base), load, work, threads=_threads(threads))


def merge(base: str | os.PathLike, experts: list[str | os.PathLike], policy: str | Policy,
          params: dict[str, Any] | None = None, *, out: str | os.PathLike, device: str = "cpu",
          threads: int | None = 1, max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
          progress: bool = False) -> FoldReport:
    """Offline merge of K experts at once: θ = θ₀ + policy.merge_tensor(θ₀, [τ₁..τ_K]).

    Each expert is read once (hashed on the way). Memory: K + 2 tensors per worker. Raises the
    same errors as :func:`fold`.
    """
    pin_mmap_threshold()
    t0 = time.perf_counter()
    pol = policy if isinstance(policy, Policy) else make_policy(policy, params)
    dev = resolve_device(device)
    if not experts:
        raise MergestreamError("merge needs at least one expert")
    if Path(out).exists() and not overwrite:
        raise OutputExistsError(f"{out} already exists; choose a new output path")
    base_ck = open_checkpoint(base)
    exps = [open_expert(e, base_ck) for e in experts]
    try:
        for e in exps:
            validate_against_base(base_ck, e, role="expert", deep=False)
        aliases = tied_groups(base_ck)
        loaders = [_ExpertLoader(e, base_ck, aliases, f"expert {e.path}") for e in exps]
        metas = base_ck.metas()
        stats = _Stats()
        bar = Progress(sum(m.nbytes for m in metas), len(metas), "merge", progress)

        def load(name: str):
            items = [ld.load(name) if (not ld.dense or name in ld.reader.ckpt) else None for ld in loaders]
            return None if items[0] is None else items

        with staged_output(out, overwrite=overwrite) as stage:
            planned = [{"id": default_expert_id(p), "sha256": _NO_HASH} for p in experts]
            writer = ModelWriter(stage, metas, _provenance(pol, planned, base_ck), max_shard_bytes)
            try:
                def work(name: str, items) -> None:
                    meta = base_ck.meta(name)
                    if items[0][0] == "frozen":
                        _write_with_aliases(writer, name, items[0][1], aliases)
                        return
                    b = base_ck.get(name).to(dev, torch.float32)
                    taus = []
                    for (_, e), ld, ex in zip(items, loaders, exps):
                        if e is None:
                            taus.append(ex.task_vector(name, b).to(dev))
                            check_finite_tensor(name, taus[-1], f"LoRA delta of {ld.where}")
                        else:
                            check_finite_tensor(name, e, ld.where)
                            taus.append(e.to(dev, torch.float32).sub_(b))
                    ctx = TensorContext(name, 0, (), is_embedding_name(name), _seed(name))
                    result = _cast_checked(b.add_(pol.merge_tensor(b, taus, ctx)), meta.dtype, name)
                    _write_with_aliases(writer, name, result, aliases)
                    stats.add({}, meta.numel, meta.nbytes * (1 + len(exps)))

                run_stream(_order(base_ck), load, work, threads=_threads(threads), progress=bar, prefetch=0,
                           sizes=lambda n: base_ck.meta(n).nbytes, budget=_largest(metas))
                shas = [ld.reader.sha256() if ld.dense else e.sha256() for ld, e in zip(loaders, exps)]
                records = [{"id": default_expert_id(p), "sha256": s} for p, s in zip(experts, shas)]
                writer.set_metadata(_provenance(pol, records, base_ck))
                writer.close()
                copy_aux_files(base_ck, stage)
            except BaseException:
                writer.abort()
                raise
            finally:
                bar.close()
    finally:
        for e in exps:
            e.close()
        base_ck.close()
    return FoldReport(out=str(out), policy=pol.name, params=pol.describe(), experts=[r["id"] for r in records],
                      seconds=time.perf_counter() - t0, bytes_read=stats.bytes_read,
                      bytes_written=writer.bytes_written, stats=stats.summary(), sha256=shas)


def unmerge(state_dir: str | os.PathLike, expert_id: str, mode: str, *, out: str | os.PathLike,
            backbone: str | os.PathLike | None = None, base: str | os.PathLike | None = None,
            device: str = "cpu", threads: int | None = 1, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
            overwrite: bool = False, progress: bool = False) -> FoldReport:
    """Remove one expert from the backbone the state describes.

    Modes:
        ``subtract``: θ − Δ_k with Δ_k the residual fold k actually applied (stored in the
        checkpoint's dtype; MDM-OC: α_k δ_k⊥ rebuilt from the state). Removing the most recent
        fold restores the previous backbone byte for byte; removing an earlier one is within one
        unit in the last place of the storage dtype of θ − Δ_k; removing the only fold gives θ₀
        exactly. An approximation of "never merged" for policies whose later folds depended on
        Δ_k (TIES, SAFE-Merge, OPCM): use ``replay`` for those.
        ``replay``: refold every other expert from its raw task vector, in the original order with
        its recorded parameters, starting from θ₀: the "never merged" model, byte for byte.

    The state folder is updated to describe the new backbone (at ``out``).

    Raises:
        StateError: unknown expert, missing contribution, or (replay) an expert file that is gone.
    """
    from .unmerge import replay, subtract

    pin_mmap_threshold()
    if mode not in ("subtract", "replay"):
        raise MergestreamError(f"unknown unmerge mode {mode!r}: use subtract or replay")
    t0 = time.perf_counter()
    sd = StateDir(state_dir)
    man = sd.manifest
    if not man.folds:
        raise StateError(f"{sd.path}: no folds recorded (is this a state folder?)")
    k = man.index_of(expert_id)
    base = base or man.base
    opts = dict(device=device, threads=threads, max_shard_bytes=max_shard_bytes, overwrite=overwrite)
    if mode == "replay" or len(man.folds) == 1:  # removing the only fold: θ₀ itself, exactly
        report = replay(sd, k, out=out, base=base, **opts)
    else:
        report = subtract(sd, k, out=out, base=base, backbone=backbone or man.backbone, progress=progress, **opts)
    report.seconds = time.perf_counter() - t0
    return report


def copy_base(base: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES, threads: int | None = 1) -> FoldReport:
    """Write θ₀ itself as a backbone (the result of removing every expert), through the stream."""
    pol = make_policy("task_arithmetic", {"lambda": 0.0})
    base_ck = open_checkpoint(base)
    try:
        with staged_output(out, overwrite=overwrite) as stage:
            w = ModelWriter(stage, base_ck.metas(), _provenance(pol, [], base_ck), max_shard_bytes)
            try:
                run_stream(_order(base_ck), base_ck.get, w.write, threads=_threads(threads))
                w.close()
            except BaseException:
                w.abort()
                raise
            copy_aux_files(base_ck, stage)
    finally:
        base_ck.close()
    return FoldReport(out=str(out), policy="base", params={}, experts=[], bytes_written=w.bytes_written)


def _adopt_state(sd: StateDir, tmp: Path) -> None:
    """Move a replayed state folder's files into ``sd`` and commit its manifest."""
    other = StateDir(tmp)
    new_files = []
    man = other.manifest
    if man.state_file:
        dest = sd.new_file("state")
        shutil.move(str(tmp / man.state_file), dest)
        new_files.append(dest)
        man.state_file = final_name(dest, sd.path)
    for f in man.folds:
        if f.contribution:
            dest = sd.new_file("contrib", f.id)
            shutil.move(str(tmp / f.contribution), dest)
            new_files.append(dest)
            f.contribution = final_name(dest, sd.path)
    other.close()
    sd.close()
    sd.commit(man, new_files)


def replay_work_dir(out: str | os.PathLike) -> Path:
    """A scratch folder beside ``out`` for replay's intermediate backbones."""
    return Path(tempfile.mkdtemp(prefix=".replay-", dir=Path(out).resolve().parent))
