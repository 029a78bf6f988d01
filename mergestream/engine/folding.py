"""The fold (θ_t = θ_{t−1} + Δ_t, one expert) and the offline merge (K experts at once).

For each tensor the fold reads θ₀, θ_{t−1} and the expert (float32 for the math), asks the
policy for Δ_t, and writes cast(θ_{t−1} + Δ_t) into a staged output, the policy's per-tensor state,
and what subtract-unmerge needs (:mod:`.residuals`). The expert is read once per fold: its content
hash, the finiteness check and the frozen-tensor comparison ride on the same pass (headers are
checked before any data is read). Peak memory is a few tensors per worker thread, never the
model; Task Arithmetic (a :meth:`~mergestream.policies.Policy.linear_scale` policy) folds in
chunks of each tensor. Integer/bool tensors are copied from θ₀; tensors tied in θ₀ (embeddings
and LM head) are written as one. A policy that searches its coefficients (MDM-OC with CMA-ES)
writes its output once, from the state, after the search; with ``coefficients: adamerging`` the
search learns the new expert's per-layer coefficients (:mod:`.coefficients`) and the state is
rewritten with them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import CorruptCheckpointError, MergestreamError, OutputExistsError, PolicyError, StateError
from ..io.checkpoints import (
    Checkpoint,
    default_expert_id,
    is_float_dtype,
    open_checkpoint,
    validate_against_base,
)
from ..io.expert_readers import DenseExpert, open_expert
from ..io.s3_checkpoint import is_s3_uri
from ..io.s3_output import S3Output
from ..io.st import weights_hash_kind
from ..io.state import FoldRecord, Manifest, StateDir, final_name, remove_file
from ..io.writers import AppendWriter, ModelWriter, staged_output
from ..policies import Policy, cmaes_coefficients, make_policy, stability_penalty
from . import residuals
from ._alloc import pin_mmap_threshold
from .coefficients import LayerObjective, learn_layer_coefficients, write_learned_state
from .executors import TensorMap
from .executors.parts import PartsPlan
from .fold_tensor import FoldSinks, FoldSpec, MergeSpec, TensorFolder, TensorMerger, placement
from .inspection import resolve_device
from .options import DEFAULT_OPTIONS, ExecOptions
from .rebuild import rebuild_remote, rewrite_from_state, state_reader
from .passes import (
    NO_HASH,
    ExpertLoader,
    FoldReport,
    Stats,
    canonical_order,
    finish_model,
    kept_ties,
    largest,
    open_base_and_backbone,
    provenance,
    tied_groups,
    worker_threads,
)
from .stream import Progress, shared_cores

log = logging.getLogger("mergestream.engine")

#: objective(alphas, weights) -> loss; ``weights()`` streams (name, float32 tensor) of θ(α).
Objective = Callable[[np.ndarray, Callable[[], Iterator[tuple[str, torch.Tensor]]]], float]


def fold(base: str | os.PathLike, backbone: str | os.PathLike | None, expert: str | os.PathLike,
         policy: str | Policy, params: dict[str, Any] | None = None, *, state_dir: str | os.PathLike,
         out: str | os.PathLike, expert_id: str | None = None, objective: Objective | LayerObjective | None = None,
         expect_sha256: str | None = None, tensor_hook: Callable[[str], None] | None = None,
         options: ExecOptions | None = None) -> FoldReport:
    """Fold one expert into the backbone: θ_t = θ_{t−1} + Δ_t, tensor by tensor, reading it once.

    Args:
        base: θ₀ (file or folder). backbone: θ_{t−1}; None (or θ₀ itself) for the first fold.
        expert: dense checkpoint or PEFT LoRA adapter folder.
        policy: a registered name (with ``params``) or a :class:`Policy` (``params`` then unused).
        state_dir: the policy state folder (created at the first fold, updated atomically).
        out: output folder (must not exist unless ``options.overwrite``); staged and renamed into place.
            Or ``s3://bucket/root/``: a new version ``root/versions/NNNNNN/model/`` (written by the
            Ray executor's tasks; uploaded from this process with the local executor), and
            ``root/current`` replaced last (:mod:`mergestream.io.s3_output`; the report's ``out`` is
            the version's URI). The state folder stays a filesystem path.
        expert_id: defaults to :func:`~mergestream.io.checkpoints.default_expert_id`.
        objective: for a policy that searches coefficients: ``mdm_oc`` with ``coefficients=cmaes``
            (an :data:`Objective`) or ``coefficients=adamerging`` (a differentiable
            :data:`~mergestream.engine.coefficients.LayerObjective`).
        expect_sha256: the content hash the caller recorded (the daemon's ledger); a fold whose
            expert hashes differently (changed since) is refused before anything is committed.
        tensor_hook: called with each tensor name before it is folded (tests, stop requests); with
            a remote executor, on the driver as each tensor is read.
        options: how it runs (device, threads, shard cap, executor, progress, overwrite; see
            :class:`~mergestream.engine.options.ExecOptions`); None: the defaults. The output and
            the state are the same bytes whatever the executor.

    Returns:
        :class:`FoldReport`.

    Raises:
        ValidationError subclasses: the expert or backbone does not fit θ₀ (nothing written, the
            state unchanged, even when the bad tensor is the last one read).
        StateError: the state folder disagrees with the backbone or already holds the expert.
        PolicyError: unknown policy, bad parameters, or another policy than the state's.
        NonFiniteError: a result overflowed its dtype. OutputExistsError: ``out`` exists.
        CorruptCheckpointError: the expert's content hash is not ``expect_sha256``.
        OutputStorageError: an ``s3://`` output's bucket failed (nothing published, ``current``
            unchanged).
    """
    pin_mmap_threshold()
    t0 = time.perf_counter()
    opts = options or DEFAULT_OPTIONS
    pol = policy if isinstance(policy, Policy) else make_policy(policy, params)
    dev = resolve_device(opts.device)
    sd = StateDir(state_dir)
    man = sd.manifest
    if man.policy is not None and man.policy != pol.name and man.folds:
        raise PolicyError(f"state {sd.path} belongs to policy {man.policy!r}, not {pol.name!r}")
    if Path(out).exists() and not opts.overwrite:
        raise OutputExistsError(f"{out} already exists; choose a new output path")
    base_ck, cur = open_base_and_backbone(base, backbone)
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
        raise PolicyError(f"coefficients={pol.searches_coefficients()} needs an objective (--objective module:function)")
    s3out = _s3_output(out)
    exp = open_expert(expert, base_ck)
    try:
        validate_against_base(base_ck, exp, role="expert", deep=False)
        # read ahead into pooled buffers, one per worker and one in flight: fresh tensor-sized pages
        # per expert tensor cost more page faults than the math of the element-wise policies (and
        # about a tenth of MDM-OC's fold), for one largest tensor per worker of memory
        buffers = worker_threads(opts.threads) + 1
        ties = tied_groups(base_ck)
        aliases = kept_ties(ties, [*([] if cur is base_ck else [cur.get]), _tensor_reader(exp, base_ck)],
                            f"expert {exp.path}") if ties else {}
        loader = ExpertLoader(exp, base_ck, aliases, f"expert {exp.path}", buffers)
        loader.untied = aliases != ties
        return _fold_pass(pol, sd, man, base_ck, cur, exp, loader, eid, expert, base, out, dev, opts, objective,
                          expect_sha256, tensor_hook, t0, s3out)
    finally:
        exp.close()
        base_ck.close()
        cur.close()


def _fold_pass(pol, sd, man, base_ck, cur, exp, loader, eid, expert, base, out, dev, opts: ExecOptions, objective,
               expect_sha256, tensor_hook, t0, s3out: S3Output | None = None) -> FoldReport:
    first = cur is base_ck
    n_prev = len(man.folds)
    aliases = loader.aliases
    metas = base_ck.metas()
    coeff = pol.coefficient()
    prev_coeffs = tuple(man.coefficients())
    search = pol.searches_coefficients()
    store_contrib = not pol.contributions_in_state
    lin = pol.linear_scale() if loader.dense else None
    stats = Stats()
    # a remote executor's tasks write the state and the residual as pieces of their own (no tensor
    # passes through this process); the local one appends to one file each
    remote = opts.executor.remote
    new_state = sd.new_pieces if remote else sd.new_file
    state_path = new_state("state")
    contrib_path = new_state("contrib", eid) if store_contrib else None
    new_files: list[Path] = [state_path] + ([contrib_path] if contrib_path else [])
    state_writer = None if remote else AppendWriter(state_path, header_bytes=residuals.header_room(metas, 4))
    contrib = residuals.ResidualWriter(contrib_path, metas, eid, recompute_lambda=lin,
                                       expert_path=_abs(expert)) if store_contrib and not remote else None
    bar = Progress(sum(m.nbytes for m in metas), len(metas), f"fold {eid}", opts.progress)
    try:
        with _staged(out, opts, s3out) as stage:
            planned = [{"id": f.id, "sha256": f.sha256} for f in man.folds] + [{"id": eid, "sha256": NO_HASH}]
            writer = ModelWriter(stage, metas, provenance(pol, planned, base_ck), opts.max_shard_bytes)
            try:
                sinks = FoldSinks(writer, state_writer, contrib, stats)
                folder = TensorFolder(pol, base_ck, cur, exp, sd.tensor_state, aliases, loader.where, n_prev,
                                      prev_coeffs, dev, tensor_hook)

                def work(name: str, item) -> None:
                    folder(name, item, sinks)

                # one tensor read (and hashed) ahead of the workers: without it every worker waited
                # for the loader after each tensor (MDM-OC's 1 GiB fold 9.3 -> 7.6 s); it costs one
                # stored tensor of memory. Whole-tensor policies hold several float32 copies of each
                # tensor: the largest tensor runs alone, smaller ones in parallel (the budget)
                with shared_cores(1 if lin is not None else worker_threads(opts.threads), dev):
                    # a remote executor maps the float tensors elsewhere (from the spec); frozen ones,
                    # the order and the hash stay here
                    # an element-wise (linear) fold has no reduction whose split the thread count could
                    # change: its tasks take one CPU each, so that they run side by side
                    spec = FoldSpec(pol, _abs(base), None if first else _abs(cur.path), _abs(expert),
                                    _abs(sd.path), aliases, loader.where, n_prev, prev_coeffs, str(dev),
                                    1 if lin is not None else torch.get_num_threads())
                    parts = PartsPlan(writer.plan(), str(state_path), str(contrib_path) if contrib_path else None,
                                      eid, lin, _abs(expert), s3out.target(writer.layout(), not (search or pol.scales_globally()))
                                      if s3out else None) \
                        if remote else None
                    job = TensorMap(
                        loader.names, loader.load, work, sinks, spec, base_ck, threads=worker_threads(opts.threads),
                        prefetch=1, release=loader.release, budget=None if lin is not None else largest(metas),
                        progress=bar, hook=tensor_hook, placement=placement(base_ck, aliases) if remote else None,
                        parts=parts)
                    tasks = opts.executor.map(job)
                if s3out is not None and not remote:
                    s3out.written_here()
                if not loader.dense:
                    sha = exp.sha256()
                else:
                    sha = loader.sha256_from(job.digests[0]) if remote else loader.reader.sha256()
                if expect_sha256 is not None and sha != expect_sha256 and exp.sha256(1) != expect_sha256:
                    # (a record written before weights hash version 2 is checked against version 1)
                    raise CorruptCheckpointError(
                        f"expert {exp.path} changed since it was registered: content hash {sha}, expected "
                        f"{expect_sha256}; nothing was folded")
                records = [{"id": f.id, "sha256": f.sha256} for f in man.folds] + [{"id": eid, "sha256": sha}]
                writer.set_metadata(provenance(pol, records, base_ck))
                if state_writer is not None:
                    state_writer.close()
                coeffs = list(prev_coeffs) + [coeff] if coeff is not None else None
                found = None
                record = pol.describe()
                if search == "adamerging":  # the new expert's per-layer α, into a rewritten state file
                    learned = sd.new_file("state")
                    new_files.append(learned)
                    profile, found = learn_layer_coefficients(pol, base_ck, state_reader(state_path)[1], objective, dev)
                    write_learned_state(base_ck, state_reader(state_path)[1], profile, learned)
                    new_files.remove(state_path)
                    remove_file(state_path)
                    state_path = learned
                    coeffs = list(prev_coeffs) + [float(np.mean(profile))]
                    record = {**record, "layer_alphas": profile}
                elif search:
                    coeffs, found = _optimise_coefficients(pol, base_ck, state_path, coeffs, list(prev_coeffs),
                                                           objective, dev)
                elif pol.scales_globally() and remote:  # the tasks return partial sums, finished here
                    coeffs = list(prev_coeffs) + [rebuild_remote(pol, base_ck, _abs(base), state_path, None, writer,
                                                                 aliases, dev, opts.executor, spec.torch_threads)]
                elif pol.scales_globally():  # one λ_t for the whole model, from every tensor's new state
                    st_ck, read = state_reader(state_path)
                    with contextlib.closing(st_ck):
                        coeffs = list(prev_coeffs) + [pol.global_scale(
                            read(m.name) for m in metas if is_float_dtype(m.dtype) and m.name not in aliases)]
                # the tasks write it, as they wrote the pass; to a bucket the driver does (its tasks
                # stage whole shards, which a rebuild by tensor groups cannot)
                if (search or pol.scales_globally()) and remote and s3out is None:
                    rebuild_remote(pol, base_ck, _abs(base), state_path, coeffs, writer, aliases, dev, opts.executor,
                                   spec.torch_threads)
                elif search or pol.scales_globally():
                    rewrite_from_state(pol, base_ck, state_path, coeffs, writer, dev, opts.threads, aliases)
                    if s3out is not None:
                        s3out.written_here()  # every shard is in the planning folder now
                finish_model(writer, base_ck, stage, contrib, untied=loader.untied)
            except BaseException:
                writer.abort()
                raise
    except BaseException:
        if state_writer is not None:
            state_writer.abort()
        if contrib is not None:
            contrib.abort()
        for f in new_files:
            remove_file(f)
        for folder in (sd.path / "contrib", sd.path):  # a failed first fold leaves no state folder
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if empty
        raise
    finally:
        bar.close()
    fold_rec = FoldRecord(id=eid, expert=_abs(expert), sha256=sha, params=record,
                          coefficient=coeffs[-1] if coeffs else None,
                          contribution=final_name(contrib_path, sd.path) if store_contrib else None,
                          exact_restore=store_contrib, sha256_kind=weights_hash_kind())
    folds = list(man.folds)
    if coeffs:
        for f, c in zip(folds, coeffs):
            f.coefficient = float(c)
    new_man = Manifest(policy=pol.name, base=_abs(base), base_tensors=len(base_ck.keys()),
                       backbone=s3out.uri_out if s3out else str(Path(out).resolve()),
                       state_file=final_name(state_path, sd.path), folds=folds + [fold_rec])
    sd.close()
    try:
        sd.commit(new_man, new_files)
    except BaseException:  # the model and the state go together: neither is left
        if s3out is not None:
            s3out.discard()
        elif not opts.overwrite:
            shutil.rmtree(out, ignore_errors=True)
        raise
    if s3out is not None:
        s3out.point()  # last: ``current`` names the new version
        out = s3out.uri_out
    bytes_read = (loader.reader.bytes_read if loader.dense else 0) + stats.bytes_read
    report = FoldReport(out=str(out), policy=pol.name, params=record, experts=[eid],
                        seconds=time.perf_counter() - t0, bytes_read=bytes_read,
                        bytes_written=writer.bytes_written, stats=stats.summary(),
                        coefficients=[float(c) for c in coeffs] if coeffs else None, search=found, sha256=[sha],
                        tasks=[list(t) for t in tasks] if tasks is not None else None,
                        received_bytes=getattr(opts.executor, "received_bytes", None) if remote else None)
    log.info("fold expert=%s policy=%s seconds=%.2f out=%s", eid, pol.name, report.seconds, out)
    return report


def _s3_output(out: str | os.PathLike) -> S3Output | None:
    """The :class:`~mergestream.io.s3_output.S3Output` of an ``s3://`` output (None for a folder).

    Raises:
        OutputStorageError: the bucket cannot be read.
    """
    return S3Output(str(out)) if is_s3_uri(out) else None


def _staged(out: str | os.PathLike, opts: ExecOptions, s3out: S3Output | None):
    """The pass's staging folder: :func:`~mergestream.io.writers.staged_output`, or for an ``s3://``
    output the driver's planning folder (:meth:`~mergestream.io.s3_output.S3Output.staged`)."""
    return s3out.staged() if s3out is not None else staged_output(out, overwrite=opts.overwrite)


def _abs(path: str | os.PathLike) -> str:
    """An input's absolute path, for workers whose working directory is not the driver's and for
    the manifest; an ``s3://`` URI unchanged."""
    if is_s3_uri(path):
        return path
    return str(Path(path).resolve())


def _tensor_reader(exp, base: Checkpoint) -> Callable[[str], torch.Tensor]:
    """``name -> tensor`` of an expert for :func:`~mergestream.engine.passes.kept_ties`: a dense expert's
    stored tensor, a LoRA adapter's task vector (θ₀'s tensor is the same for both names of a tie)."""
    if isinstance(exp, DenseExpert):
        return exp.get
    return lambda name: exp.task_vector(name, base.get(name))


def weights_stream(pol: Policy, base: Checkpoint, state_path: Path, coeffs: list[float],
                   dev: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """θ(α) = θ₀ + Σ αᵢ dᵢ rebuilt from the policy state at ``state_path``, tensor by tensor.

    Yields ``(name, tensor)`` in θ₀'s order: float tensors as float32 on ``dev``, others as stored.
    What a coefficient search's objective reads (MDM-OC, METHODS.md "CMA-ES coefficients").
    """
    read = state_reader(state_path)[1]
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
        v = float(objective(alphas, lambda: weights_stream(pol, base, state_path, list(alphas), dev)))
        seen.append(v)
        return v

    best, loss, evals = cmaes_coefficients(f, start, anchor, stability=p.stability, budget=p.budget, sigma=p.sigma)
    start_pen = seen[0] + p.stability * stability_penalty(start, anchor)
    log.info("cmaes coefficients=%s objective_start=%.6g objective=%.6g evaluations=%d",
             [round(float(x), 4) for x in best], start_pen, loss, evals)
    return [float(x) for x in best], {"evaluations": float(evals), "objective_start": start_pen, "objective": float(loss)}


def merge(base: str | os.PathLike, experts: list[str | os.PathLike], policy: str | Policy,
          params: dict[str, Any] | None = None, *, out: str | os.PathLike,
          options: ExecOptions | None = None) -> FoldReport:
    """Offline merge of K experts at once: θ = θ₀ + policy.merge_tensor(θ₀, [τ₁..τ_K]).

    Args:
        base: θ₀ (file or folder). experts: dense checkpoints or PEFT LoRA adapter folders.
        policy: a registered name (with ``params``) or a :class:`Policy`.
        out: output folder (must not exist unless ``options.overwrite``); staged and renamed into place;
            or ``s3://bucket/root/`` (as for :func:`fold`).
        options: how it runs (:class:`~mergestream.engine.options.ExecOptions`); None: the defaults.

    Each expert is read once (hashed on the way; twice with a remote ``options.executor``, see
    :mod:`mergestream.engine.executors`). Memory: K + 2 tensors per worker.

    Returns:
        :class:`FoldReport`.

    Raises:
        MergestreamError: no experts. Otherwise the same errors as :func:`fold`.
    """
    pin_mmap_threshold()
    t0 = time.perf_counter()
    opts = options or DEFAULT_OPTIONS
    pol = (policy if isinstance(policy, Policy) else make_policy(policy, params)).offline()
    dev = resolve_device(opts.device)
    if not experts:
        raise MergestreamError("merge needs at least one expert")
    if Path(out).exists() and not opts.overwrite:
        raise OutputExistsError(f"{out} already exists; choose a new output path")
    s3out = _s3_output(out)
    base_ck = open_checkpoint(base)
    exps = [open_expert(e, base_ck) for e in experts]
    try:
        for e in exps:
            validate_against_base(base_ck, e, role="expert", deep=False)
        ties = tied_groups(base_ck)
        aliases = kept_ties(ties, [_tensor_reader(e, base_ck) for e in exps], "an expert") if ties else {}
        loaders = [ExpertLoader(e, base_ck, aliases, f"expert {e.path}") for e in exps]
        metas = base_ck.metas()
        stats = Stats()
        bar = Progress(sum(m.nbytes for m in metas), len(metas), "merge", opts.progress)

        def load(name: str):
            items = [ld.load(name) if (not ld.dense or name in ld.reader.ckpt) else None for ld in loaders]
            return None if items[0] is None else items

        with _staged(out, opts, s3out) as stage:
            planned = [{"id": default_expert_id(p), "sha256": NO_HASH} for p in experts]
            writer = ModelWriter(stage, metas, provenance(pol, planned, base_ck), opts.max_shard_bytes)
            try:
                sinks = FoldSinks(writer, None, None, stats)
                merger = TensorMerger(pol, base_ck, exps, [ld.where for ld in loaders], aliases, dev)

                def work(name: str, items) -> None:
                    merger(name, items, sinks)

                with shared_cores(worker_threads(opts.threads), dev):
                    spec = MergeSpec(pol, _abs(base), [_abs(e) for e in experts], [ld.where for ld in loaders],
                                     aliases, str(dev), torch.get_num_threads())
                    remote = opts.executor.remote
                    job = TensorMap(canonical_order(base_ck), load, work, sinks, spec, base_ck,
                                    threads=worker_threads(opts.threads), prefetch=0, budget=largest(metas),
                                    progress=bar, placement=placement(base_ck, aliases) if remote else None,
                                    parts=PartsPlan(writer.plan(), s3=s3out.target(writer.layout()) if s3out else None)
                                    if remote else None)
                    opts.executor.map(job)
                if s3out is not None and not remote:
                    s3out.written_here()
                shas = [(ld.sha256_from(job.digests[i]) if remote else ld.reader.sha256()) if ld.dense else e.sha256()
                        for i, (ld, e) in enumerate(zip(loaders, exps))]
                records = [{"id": default_expert_id(p), "sha256": s} for p, s in zip(experts, shas)]
                writer.set_metadata(provenance(pol, records, base_ck))
                finish_model(writer, base_ck, stage, untied=aliases != ties)
            except BaseException:
                writer.abort()
                raise
            finally:
                bar.close()
    finally:
        for e in exps:
            e.close()
        base_ck.close()
    if s3out is not None:
        s3out.point()  # last: ``current`` names the new version
        out = s3out.uri_out
    return FoldReport(out=str(out), policy=pol.name, params=pol.describe(), experts=[r["id"] for r in records],
                      seconds=time.perf_counter() - t0, bytes_read=stats.bytes_read,
                      bytes_written=writer.bytes_written, stats=stats.summary(), sha256=shas)
