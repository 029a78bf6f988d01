"""The streaming fold: tensor by tensor, bounded memory, calls the policy.

For each tensor the engine reads θ₀, θ_{t−1} and the expert's τ (float32 for the math), asks the
policy for Δ_t, writes cast(θ_{t−1} + Δ_t) into a staged output, the fold's float32 contribution
Δ_t into the state folder (for subtract-unmerge) and the policy's per-tensor state. Peak memory is
a few tensors (times the number of worker threads), never the model. Integer/bool tensors are
copied from θ₀; tensors tied in θ₀ (embeddings and LM head) are written as one.

Public entry points: :func:`fold`, :func:`merge` (offline, K experts), :func:`unmerge`
(``subtract`` or ``replay``), :func:`task_vector_stats` and :func:`describe` (for ``inspect``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ._alloc import pin_mmap_threshold
from .checkpoints import (
    DEFAULT_SHARD_BYTES,
    Checkpoint,
    ModelWriter,
    SpoolWriter,
    TensorMeta,
    copy_aux_files,
    count_non_finite,
    default_expert_id,
    is_embedding_name,
    is_float_dtype,
    open_checkpoint,
    open_expert,
    open_safetensors_file,
    staged_output,
    tied_groups,
    validate_against_base,
)
from .errors import MergestreamError, NonFiniteError, OutputExistsError, PolicyError, StateError
from .policies import Policy, TensorContext, cmaes_coefficients, make_policy, stability_penalty
from .state import SEP, FoldRecord, Manifest, StateDir, final_name

log = logging.getLogger(__name__)

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

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def resolve_device(device: str | torch.device) -> torch.device:
    """Validate a math device (``cpu``, ``cuda``, ``cuda:1``); raises MergestreamError if unusable."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MergestreamError(f"device {device!r} requested but CUDA is not available")
    return dev


def _seed(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


class _Pool:
    """Run per-tensor jobs in order on ``threads`` workers with a bounded number in flight."""

    def __init__(self, threads: int):
        self.threads = max(1, threads)

    def run(self, job: Callable[[str], None], names: Iterable[str]) -> None:
        if self.threads == 1:
            for n in names:
                job(n)
            return
        with ThreadPoolExecutor(self.threads) as ex:
            pending: deque[Future] = deque()
            for n in names:
                pending.append(ex.submit(job, n))
                if len(pending) >= self.threads * 2:
                    pending.popleft().result()
            while pending:
                pending.popleft().result()


class _Stats:
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


def _cast_checked(x: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    out = x.to(meta.dtype).cpu() if x.dtype != meta.dtype or x.device.type != "cpu" else x
    if count_non_finite(out):
        raise NonFiniteError(
            f"tensor {meta.name}: the fold's result is not finite in {meta.dtype} (overflow?); nothing written")
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
    validate_against_base(b, cur, role="backbone", check_finite=False)
    return b, cur


def fold(base: str | os.PathLike, backbone: str | os.PathLike | None, expert: str | os.PathLike,
         policy: str | Policy, params: dict[str, Any] | None = None, *, state_dir: str | os.PathLike,
         out: str | os.PathLike, expert_id: str | None = None, device: str = "cpu", threads: int = 1,
         max_shard_bytes: int = DEFAULT_SHARD_BYTES, objective: Objective | None = None,
         overwrite: bool = False, progress: bool = False,
         tensor_hook: Callable[[str], None] | None = None) -> FoldReport:
    """Fold one expert into the backbone: θ_t = θ_{t−1} + Δ_t, tensor by tensor.

    Args:
        base: θ₀ (file or folder). backbone: θ_{t−1}; None (or θ₀ itself) for the first fold.
        expert: dense checkpoint or PEFT LoRA adapter folder.
        policy: a registered name (with ``params``) or a :class:`Policy`.
        state_dir: the policy state folder (created at the first fold, updated atomically).
        out: output folder (must not exist unless ``overwrite``); staged and renamed into place.
        expert_id: defaults to :func:`~mergestream.checkpoints.default_expert_id`.
        device: where the math runs (``cpu`` or ``cuda[:i]``); tensors are streamed from CPU.
        threads: worker threads for the per-tensor map (peak memory scales with it).
        max_shard_bytes: output shard cap (bytes).
        objective: for ``mdm_oc`` with ``coefficients=cmaes``: objective(α, weights) -> loss.
        tensor_hook: called with each tensor name before it is folded (tests, progress).

    Returns:
        :class:`FoldReport`.

    Raises:
        ValidationError subclasses: the expert or backbone does not fit θ₀ (nothing written).
        StateError: the state folder disagrees with the backbone or already holds the expert.
        PolicyError: unknown policy, bad parameters, or another policy than the state's.
        NonFiniteError: a result overflowed its dtype. OutputExistsError: ``out`` exists.
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
    cur_folds = 0 if cur is base_ck else int(cur.metadata().get("mergestream.n_folds", "-1"))
    if cur_folds != n_prev:
        raise StateError(
            f"backbone {cur.path} holds {cur_folds if cur_folds >= 0 else 'an unknown number of'} fold(s) but state "
            f"{sd.path} records {n_prev}: pass the backbone produced by the last fold with this state")
    if man.base_tensors is not None and man.base_tensors != len(base_ck.keys()):
        raise StateError(f"state {sd.path} was built on another base ({man.base})")
    exp = open_expert(expert, base_ck)
    validate_against_base(base_ck, exp, role="expert")
    rec = {"id": eid, "sha256": exp.sha256()}
    records = [{"id": f.id, "sha256": f.sha256} for f in man.folds] + [rec]
    coeff = pol.coefficient()
    prev_coeffs = tuple(man.coefficients())
    store_contrib = not pol.contributions_in_state
    metas = base_ck.metas()
    aliases = tied_groups(base_ck)
    float_metas = [TensorMeta(m.name, m.shape, torch.float32) for m in metas
                   if is_float_dtype(m.dtype) and m.name not in aliases]
    stats = _Stats()
    state_lock = threading.Lock()
    new_files: list[Path] = []
    state_path = sd.new_file("state")
    contrib_path = sd.new_file("contrib", eid) if store_contrib else None
    state_writer = SpoolWriter(state_path)
    new_files.append(state_path)
    contrib_writer = None
    try:
        with staged_output(out, overwrite=overwrite) as stage:
            writer = ModelWriter(stage, metas, _provenance(pol, records, base_ck), max_shard_bytes)
            if store_contrib:
                contrib_stage = Path(tempfile.mkdtemp(prefix=".contrib-", dir=contrib_path.parent))
                contrib_writer = ModelWriter(contrib_stage, float_metas, {"mergestream.expert": eid}, 2**62)
            try:
                def job(name: str) -> None:
                    meta = base_ck.meta(name)
                    if tensor_hook is not None:
                        tensor_hook(name)
                    if not is_float_dtype(meta.dtype):
                        writer.write(name, base_ck.get(name))
                        return
                    b = base_ck.get(name).to(dev, torch.float32)
                    # first fold: θ_{t−1} is θ₀, already in memory (a copy, since it is updated in place)
                    bb = b.clone() if cur is base_ck else cur.get(name).to(dev, torch.float32)
                    tau = exp.task_vector(name, b).to(dev)
                    with state_lock:
                        st = {k: v.to(dev) for k, v in sd.tensor_state(name).items()}
                    ctx = TensorContext(name, n_prev, prev_coeffs, is_embedding_name(name), _seed(name))
                    res = pol.fold_tensor(b, bb, tau, st, ctx)
                    del b, tau
                    result = _cast_checked(bb.add_(res.delta, alpha=res.scale), meta)
                    _write_with_aliases(writer, name, result, aliases)
                    if contrib_writer is not None:
                        contrib_writer.write(name, res.full_delta().cpu())
                    if res.state:
                        with state_lock:
                            for k, v in res.state.items():
                                state_writer.write(f"{name}{SEP}{k}", v.cpu())
                    stats.add(res.stats, meta.numel, meta.nbytes * 3)

                _Pool(threads).run(job, [m.name for m in metas if m.name not in aliases])
                state_writer.close()
                coeffs = None
                search = None
                if coeff is not None:
                    coeffs = list(prev_coeffs) + [coeff]
                    if getattr(pol.params, "coefficients", "fixed") == "cmaes":
                        if objective is None:
                            raise PolicyError("coefficients=cmaes needs an objective (--objective module:function)")
                        coeffs, search = _optimise_coefficients(pol, base_ck, state_path, coeffs, list(prev_coeffs),
                                                                objective, dev)
                        _rewrite_from_state(pol, base_ck, state_path, coeffs, writer, dev, threads, aliases)
                writer.close()
                if contrib_writer is not None:
                    contrib_writer.close()
                    produced = contrib_writer.files[0]
                    os.replace(produced, contrib_path)
                    shutil.rmtree(contrib_stage, ignore_errors=True)
                    new_files.append(contrib_path)
                copy_aux_files(base_ck, stage)
            except BaseException:
                writer.abort()
                if contrib_writer is not None:
                    contrib_writer.abort()
                    shutil.rmtree(contrib_stage, ignore_errors=True)
                raise
    except BaseException:
        state_writer.abort()
        for f in new_files:
            f.unlink(missing_ok=True)
        raise
    finally:
        exp.close()
    fold_rec = FoldRecord(id=eid, expert=str(Path(expert).resolve()), sha256=rec["sha256"], params=pol.describe(),
                          coefficient=coeffs[-1] if coeffs else None,
                          contribution=final_name(contrib_path, sd.path) if store_contrib else None)
    folds = list(man.folds)
    if coeffs:
        for f, c in zip(folds, coeffs):
            f.coefficient = float(c)
    new_man = Manifest(policy=pol.name, base=str(Path(base).resolve()), base_tensors=len(base_ck.keys()),
                       backbone=str(Path(out).resolve()), state_file=final_name(state_path, sd.path),
                       folds=folds + [fold_rec])
    sd.close()
    sd.commit(new_man, new_files)
    report = FoldReport(out=str(out), policy=pol.name, params=pol.describe(), experts=[eid],
                        seconds=time.perf_counter() - t0, bytes_read=stats.bytes_read,
                        bytes_written=writer.bytes_written, stats=stats.summary(),
                        coefficients=[float(c) for c in coeffs] if coeffs else None, search=search)
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
        b = base.get(m.name).to(dev, torch.float32) if is_float_dtype(m.dtype) else base.get(m.name)
        if not is_float_dtype(m.dtype):
            yield m.name, b
            continue
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
                        writer: ModelWriter, dev: torch.device, threads: int, aliases: dict[str, str]) -> None:
    for name, t in _weights_stream(pol, base, state_path, coeffs, dev):
        meta = base.meta(name)
        if name in aliases or not is_float_dtype(meta.dtype):
            continue
        result = _cast_checked(t, meta)
        _write_with_aliases(writer, name, result, aliases)


def merge(base: str | os.PathLike, experts: list[str | os.PathLike], policy: str | Policy,
          params: dict[str, Any] | None = None, *, out: str | os.PathLike, device: str = "cpu",
          threads: int = 1, max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False) -> FoldReport:
    """Offline merge of K experts at once: θ = θ₀ + policy.merge_tensor(θ₀, [τ₁..τ_K]).

    Memory: K + 2 tensors per worker. Raises the same errors as :func:`fold`.
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
            validate_against_base(base_ck, e, role="expert")
        records = [{"id": default_expert_id(p), "sha256": e.sha256()} for p, e in zip(experts, exps)]
        metas = base_ck.metas()
        aliases = tied_groups(base_ck)
        stats = _Stats()
        with staged_output(out, overwrite=overwrite) as stage:
            writer = ModelWriter(stage, metas, _provenance(pol, records, base_ck), max_shard_bytes)
            try:
                def job(name: str) -> None:
                    meta = base_ck.meta(name)
                    if not is_float_dtype(meta.dtype):
                        writer.write(name, base_ck.get(name))
                        return
                    b = base_ck.get(name).to(dev, torch.float32)
                    taus = [e.task_vector(name, b).to(dev) for e in exps]
                    ctx = TensorContext(name, 0, (), is_embedding_name(name), _seed(name))
                    delta = pol.merge_tensor(b, taus, ctx)
                    result = _cast_checked(b.add_(delta), meta)
                    _write_with_aliases(writer, name, result, aliases)
                    stats.add({}, meta.numel, meta.nbytes * (1 + len(exps)))

                _Pool(threads).run(job, [m.name for m in metas if m.name not in aliases])
                writer.close()
                copy_aux_files(base_ck, stage)
            except BaseException:
                writer.abort()
                raise
    finally:
        for e in exps:
            e.close()
    return FoldReport(out=str(out), policy=pol.name, params=pol.describe(), experts=[r["id"] for r in records],
                      seconds=time.perf_counter() - t0, bytes_read=stats.bytes_read,
                      bytes_written=writer.bytes_written, stats=stats.summary())


def unmerge(state_dir: str | os.PathLike, expert_id: str, mode: str, *, out: str | os.PathLike,
            backbone: str | os.PathLike | None = None, base: str | os.PathLike | None = None,
            device: str = "cpu", threads: int = 1, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
            overwrite: bool = False) -> FoldReport:
    """Remove one expert from the backbone the state describes.

    Modes:
        ``subtract``: θ − Δ_k with Δ_k the fold's stored float32 contribution (MDM-OC: α_k δ_k⊥
        rebuilt from the state). O(1) folds; exact for orthogonal policies up to rounding, an
        approximation for policies whose later folds depended on Δ_k (TIES, SAFE-Merge, OPCM).
        ``replay``: refold every other expert from its raw task vector, in the original order with
        its recorded parameters, starting from θ₀: the "never merged" model.

    The state folder is updated to describe the new backbone (at ``out``).

    Raises:
        StateError: unknown expert, missing contribution, or (replay) an expert file that is gone.
    """
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
    backbone = backbone or man.backbone
    pol = make_policy(man.policy, man.folds[k].params)
    if mode == "replay":
        return _replay(sd, k, out=out, device=device, threads=threads, max_shard_bytes=max_shard_bytes,
                       overwrite=overwrite, t0=t0, base=base)
    if not backbone or not Path(backbone).exists():
        raise StateError(f"backbone {backbone} recorded in {sd.path} is missing; pass --backbone")
    dev = resolve_device(device)
    base_ck, cur = _open_base_and_backbone(base, backbone)
    if int(cur.metadata().get("mergestream.n_folds", "-1")) != len(man.folds):
        raise StateError(f"backbone {backbone} does not match state {sd.path} (fold counts differ)")
    remaining = [f for i, f in enumerate(man.folds) if i != k]
    records = [{"id": f.id, "sha256": f.sha256} for f in remaining]
    coeff_k = man.folds[k].coefficient
    contrib = None if pol.contributions_in_state else sd.contribution(k)
    metas = base_ck.metas()
    aliases = tied_groups(base_ck)
    state_path = sd.new_file("state")
    state_writer = SpoolWriter(state_path)
    lock = threading.Lock()
    stats = _Stats()
    try:
        with staged_output(out, overwrite=overwrite) as stage:
            writer = ModelWriter(stage, metas, _provenance(pol, records, base_ck), max_shard_bytes)
            try:
                def job(name: str) -> None:
                    meta = base_ck.meta(name)
                    if not is_float_dtype(meta.dtype):
                        writer.write(name, base_ck.get(name))
                        return
                    bb = cur.get(name).to(dev, torch.float32)
                    with lock:
                        st = sd.tensor_state(name)
                    if contrib is not None:
                        c = contrib.get(name).to(dev)
                    else:
                        c = pol.contribution({k2: v.to(dev) for k2, v in st.items()}, k, coeff_k, bb.shape)
                    if c is not None:
                        bb.sub_(c)
                    result = _cast_checked(bb, meta)
                    _write_with_aliases(writer, name, result, aliases)
                    if st:
                        new_st = pol.drop_from_state(st, k)
                        with lock:
                            for f, v in new_st.items():
                                state_writer.write(f"{name}{SEP}{f}", v.cpu())
                    stats.add({}, meta.numel, meta.nbytes * 2)

                _Pool(threads).run(job, [m.name for m in metas if m.name not in aliases])
                writer.close()
                state_writer.close()
                copy_aux_files(base_ck, stage)
            except BaseException:
                writer.abort()
                raise
    except BaseException:
        state_writer.abort()
        state_path.unlink(missing_ok=True)
        raise
    if contrib is not None:
        contrib.close()
    new_man = Manifest(policy=man.policy, base=man.base, base_tensors=man.base_tensors,
                       backbone=str(Path(out).resolve()), state_file=final_name(state_path, sd.path), folds=remaining)
    sd.close()
    sd.commit(new_man, [state_path])
    return FoldReport(out=str(out), policy=pol.name, params=pol.describe(), experts=[f.id for f in remaining],
                      seconds=time.perf_counter() - t0, bytes_read=stats.bytes_read,
                      bytes_written=writer.bytes_written, stats={"mode_subtract": 1.0})


def _replay(sd: StateDir, k: int, *, out, device, threads, max_shard_bytes, overwrite, t0, base) -> FoldReport:
    man = sd.manifest
    remaining = [f for i, f in enumerate(man.folds) if i != k]
    for f in remaining:
        if not Path(f.expert).exists():
            raise StateError(f"replay needs expert {f.id!r} at {f.expert}, which is gone")
    work = Path(tempfile.mkdtemp(prefix=".replay-", dir=Path(out).resolve().parent))
    try:
        tmp_state = work / "state"
        backbone = None
        report = None
        for i, f in enumerate(remaining):
            params = dict(f.params)
            if params.get("coefficients") == "cmaes":  # no objective here: keep the recorded α
                params["coefficients"] = "fixed"
                params["alpha"] = f.coefficient
            step_out = Path(out) if i == len(remaining) - 1 else work / f"step-{i}"
            report = fold(base, backbone, f.expert, man.policy, params, state_dir=tmp_state, out=step_out,
                          expert_id=f.id, device=device, threads=threads, max_shard_bytes=max_shard_bytes,
                          overwrite=overwrite and step_out == Path(out))
            backbone = step_out
        if report is None:  # removing the only expert: the backbone is θ₀ again
            report = _copy_base(base, out, overwrite, max_shard_bytes)
            new_man = Manifest(policy=man.policy, base=man.base, base_tensors=man.base_tensors,
                               backbone=str(Path(out).resolve()), state_file=None, folds=[])
            sd.close()
            sd.commit(new_man, [])
        else:
            _adopt_state(sd, tmp_state)
        report.seconds = time.perf_counter() - t0
        report.experts = [f.id for f in remaining]
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _copy_base(base, out, overwrite, max_shard_bytes) -> FoldReport:
    pol = make_policy("task_arithmetic", {"lambda": 0.0})
    base_ck = open_checkpoint(base)
    with staged_output(out, overwrite=overwrite) as stage:
        w = ModelWriter(stage, base_ck.metas(), _provenance(pol, [], base_ck), max_shard_bytes)
        for m in base_ck.metas():
            w.write(m.name, base_ck.get(m.name))
        w.close()
        copy_aux_files(base_ck, stage)
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


def task_vector_stats(base: str | os.PathLike, experts: list[str | os.PathLike],
                      device: str = "cpu") -> dict[str, Any]:
    """One streaming pass of sums: ‖τᵢ‖ and the pairwise cosines cos(τᵢ, τⱼ) over the whole model.

    Returns:
        ``{"ids": [...], "norms": [K floats], "cosine": K×K nested list}``.

    Raises:
        ValidationError subclasses if an expert does not fit θ₀.
    """
    dev = resolve_device(device)
    base_ck = open_checkpoint(base)
    exps = [open_expert(e, base_ck) for e in experts]
    try:
        for e in exps:
            validate_against_base(base_ck, e, check_finite=False)
        k = len(exps)
        gram = torch.zeros(k, k, dtype=torch.float64)
        for m in base_ck.metas():
            if not is_float_dtype(m.dtype):
                continue
            b = base_ck.get(m.name).to(dev, torch.float32)
            taus = torch.stack([e.task_vector(m.name, b).to(dev).reshape(-1) for e in exps]).double()
            gram += (taus @ taus.T).cpu()
        norms = gram.diagonal().sqrt()
        denom = torch.outer(norms, norms).clamp_min(1e-300)
        cos = (gram / denom).tolist()
        return {"ids": [default_expert_id(e) for e in experts], "norms": norms.tolist(), "cosine": cos}
    finally:
        for e in exps:
            e.close()


def describe(path: str | os.PathLike) -> dict[str, Any]:
    """Tensor count, dtypes (count and bytes per dtype), total bytes and metadata of a checkpoint."""
    p = Path(path)
    if (p / "adapter_config.json").exists():
        cfg = json.loads((p / "adapter_config.json").read_text())
        ck = open_checkpoint(p / "adapter_model.safetensors")
        kind = "lora"
    else:
        cfg, ck, kind = None, open_checkpoint(p), "dense"
    dtypes: dict[str, dict[str, int]] = {}
    for m in ck.metas():
        d = dtypes.setdefault(str(m.dtype).replace("torch.", ""), {"tensors": 0, "bytes": 0})
        d["tensors"] += 1
        d["bytes"] += m.nbytes
    info = {"path": str(p), "kind": kind, "tensors": len(ck.keys()), "bytes": ck.nbytes, "dtypes": dtypes,
            "files": [f.name for f in ck.weight_files],
            "metadata": {k: v for k, v in ck.metadata().items() if k.startswith("mergestream.")}}
    if cfg is not None:
        info["lora"] = {k: cfg.get(k) for k in ("r", "lora_alpha", "use_rslora", "fan_in_fan_out", "target_modules")}
    ck.close()
    return info
