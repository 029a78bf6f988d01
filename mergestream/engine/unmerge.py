"""Unmerge: remove one expert from a state's backbone, by ``subtract`` or by ``replay``.

:func:`unmerge` documents the guarantees (re-exported as :func:`mergestream.engine.unmerge`); both
modes run on the streaming skeleton of :mod:`.stream`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

from ..errors import CorruptCheckpointError, MergestreamError, StateError, ValidationError
from ..io.checkpoints import is_float_dtype, validate_against_base
from ..io.expert_readers import DenseExpert, open_expert
from ..io.s3_checkpoint import is_s3_path, is_s3_uri
from ..io.st import WEIGHTS_HASH_VERSION, weights_hash_version
from ..io.state import SEP, Manifest, StateDir, final_name
from ..io.writers import AppendWriter, ModelWriter, staged_output
from ..policies import make_policy
from . import linear_fold, residuals
from ._alloc import pin_mmap_threshold
from .folding import fold
from .inspection import resolve_device
from .options import DEFAULT_OPTIONS, ExecOptions
from .passes import (
    ExpertLoader,
    FoldReport,
    Stats,
    canonical_order,
    cast_checked,
    copy_base,
    finish_model,
    kept_ties,
    largest,
    open_base_and_backbone,
    provenance,
    tied_groups,
    worker_threads,
    write_with_aliases,
)
from .stream import Progress, run_stream


def unmerge(state_dir: str | os.PathLike, expert_id: str, mode: str, *, out: str | os.PathLike,
            backbone: str | os.PathLike | None = None, base: str | os.PathLike | None = None,
            options: ExecOptions | None = None) -> FoldReport:
    """Remove one expert from the backbone the state describes.

    Modes:
        ``subtract``: θ − Δ_k with Δ_k the residual fold k actually applied (stored in the
        checkpoint's dtype; Task Arithmetic: λ·τ_k recomputed from the kept expert, whose content
        hash must still match; MDM-OC: α_k δ_k⊥ rebuilt from the state). Removing the most recent
        fold restores the previous backbone byte for byte; removing an earlier one is within one
        unit in the last place of the storage dtype of θ − Δ_k; removing the only fold gives θ₀
        exactly. An approximation of "never merged" for policies whose later folds depended on
        Δ_k (TIES, SAFE-Merge, OPCM, MagMax; MDM-OC's later directions lost their overlap with
        δ_k⊥): use ``replay`` for those.
        ``replay``: refold every other expert from its raw task vector, in the original order with
        its recorded parameters, starting from θ₀: the "never merged" model, byte for byte.

    The state folder is updated to describe the new backbone (at ``out``): the fold record of
    ``expert_id`` goes (so the next fold's ``n_previous`` and coefficients are the remaining
    ones') and each tensor's policy state drops it (:meth:`Policy.drop_from_state`). After
    ``subtract`` of the most recent fold the state is the one before that fold, so the next fold
    equals the fold that would have come without it (byte for byte where the backbone is).

    Args:
        state_dir: the state folder (updated atomically). expert_id: the fold to remove.
        mode: ``subtract`` or ``replay`` (above). out: the new backbone's folder (must not exist
            unless ``options.overwrite``). backbone, base: override the paths the state records.
        options: how it runs (:class:`~mergestream.engine.options.ExecOptions`; None: the defaults).
            ``options.executor`` runs replay's folds; subtract is one cheap element-wise pass and
            always runs on local threads. Replay's folds show no progress bar.

    Returns:
        :class:`FoldReport` (``experts``: the remaining ones).

    Raises:
        MergestreamError: an unknown ``mode``. ValidationError: an ``s3://`` ``out``.
        StateError: unknown expert, missing contribution, ``subtract`` for a policy that cannot
            (:attr:`~mergestream.policies.base.Policy.subtract_unmerge`, e.g. Iso-C), or an expert
            file that is gone (replay; subtract of a Task Arithmetic fold).
        CorruptCheckpointError: subtract of a Task Arithmetic fold whose expert file changed since
            it was folded (content hash); nothing is written and the state is unchanged.
    """
    pin_mmap_threshold()
    if mode not in ("subtract", "replay"):
        raise MergestreamError(f"unknown unmerge mode {mode!r}: use subtract or replay")
    if is_s3_uri(out):
        raise ValidationError(f"unmerge writes its output to a folder, not {out}: an s3:// output is for fold and "
                              "merge with the ray executor")
    t0 = time.perf_counter()
    sd = StateDir(state_dir)
    man = sd.manifest
    if not man.folds:
        raise StateError(f"{sd.path}: no folds recorded (is this a state folder?)")
    k = man.index_of(expert_id)
    base = base or man.base
    opts = options or DEFAULT_OPTIONS
    existed = os.path.lexists(out)
    try:
        if mode == "replay" or len(man.folds) == 1:  # removing the only fold: θ₀ itself, exactly
            report = replay(sd, k, out=out, base=base, options=opts)
        else:
            report = subtract(sd, k, out=out, base=base, backbone=backbone or man.backbone, options=opts)
    except BaseException:  # e.g. the state's commit failed (a full disk): no model without its state
        if not existed:
            shutil.rmtree(out, ignore_errors=True)
        raise
    report.seconds = time.perf_counter() - t0
    return report


def subtract(sd: StateDir, k: int, *, out, base, backbone, options: ExecOptions) -> FoldReport:
    """θ − Δ_k for every tensor (see :func:`unmerge`) on local threads (``options.executor`` is not
    used); updates ``sd``."""
    device, threads, overwrite = options.device, options.threads, options.overwrite
    man = sd.manifest
    pol = make_policy(man.policy, man.folds[k].params)
    if not pol.subtract_unmerge:
        raise StateError(f"policy {man.policy} cannot remove {man.folds[k].id!r} by subtract "
                         f"({pol.no_subtract_reason}); use --mode replay (refolds the others)")
    if not backbone or not Path(backbone).exists():
        raise StateError(f"backbone {backbone} recorded in {sd.path} is missing; pass --backbone")
    dev = resolve_device(device)
    base_ck, cur = open_base_and_backbone(base, backbone)
    if int(cur.metadata().get("mergestream.n_folds", "-1")) != len(man.folds):
        raise StateError(f"backbone {backbone} does not match state {sd.path} (fold counts differ)")
    last = k == len(man.folds) - 1
    exact = last and man.folds[k].exact_restore
    remaining = [f for i, f in enumerate(man.folds) if i != k]
    if not last:  # the backbone no longer equals any remaining fold's output
        for f in remaining:
            f.exact_restore = False
    records = [{"id": f.id, "sha256": f.sha256} for f in remaining]
    coeff_k = man.folds[k].coefficient
    contrib = exp = loader = None
    lam = None
    metas = base_ck.metas()
    ties = tied_groups(base_ck)
    aliases = kept_ties(ties, [cur.get], f"backbone {backbone}") if ties else {}
    if not pol.contributions_in_state:
        rec = man.folds[k]
        if not rec.contribution or not (sd.path / rec.contribution).exists():
            raise StateError(f"{sd.path}: no stored contribution for expert {rec.id!r}")
        contrib = residuals.ResidualReader(sd.path / rec.contribution)
        lam = contrib.recompute_lambda
    try:
        if lam is not None:  # format 3: λτ_k from the kept expert, read (and hashed) in its order
            exp, loader = _open_kept_expert(man.folds[k], base_ck, aliases, threads)
    except BaseException:
        contrib.close()
        base_ck.close()
        cur.close()
        raise
    names = loader.names if loader is not None else canonical_order(base_ck)
    state_path = sd.new_file("state")
    state_writer = AppendWriter(state_path, header_bytes=residuals.header_room(metas, 4))
    lock = threading.Lock()
    stats = Stats()
    bar = Progress(sum(m.nbytes for m in metas), len(metas), f"unmerge {man.folds[k].id}", options.progress)
    try:
        with staged_output(out, overwrite=overwrite) as stage:
            writer = ModelWriter(stage, metas, provenance(pol, records, base_ck), options.max_shard_bytes)
            try:
                def load(name: str):
                    """``(expert tensor or None, θ or None)``; None for an alias written with its primary."""
                    if loader is None:
                        return None if name in aliases else (None, cur.get(name))
                    item = loader.load(name)  # frozen tensors checked against θ₀ on the way
                    if item is None:
                        return None
                    return (item[1], cur.get(name)) if item[0] == "float" else (None, None)

                def release(item) -> None:
                    if loader is not None and item[0] is not None:
                        loader.release(("float", item[0]))

                def work(name: str, item) -> None:
                    e, cur_s = item
                    meta = base_ck.meta(name)
                    if not is_float_dtype(meta.dtype):
                        write_with_aliases(writer, name, base_ck.get(name), aliases)
                        return
                    with lock:
                        st = sd.tensor_state(name)
                    if lam is not None:
                        result = linear_fold.subtract_linear(name, cur_s, e, lam, base_ck, dev,
                                                           contrib if exact else None)
                    elif contrib is not None:
                        r, idx, val = contrib.get(name)
                        result = cur_s if r is None else residuals.subtract(
                            cur_s.to(dev), r, *((idx, val) if exact else (None, None))).cpu()
                    else:
                        c = pol.contribution({k2: v.to(dev) for k2, v in st.items()}, k, coeff_k, cur_s.shape)
                        result = cur_s if c is None else (cur_s.to(dev, torch.float32) - c)
                    result = cast_checked(result, meta.dtype, name)
                    write_with_aliases(writer, name, result, aliases)
                    if st:
                        for f, v in pol.drop_from_state(st, k).items():
                            state_writer.write(f"{name}{SEP}{f}", v.cpu())
                    stats.add({}, meta.numel, meta.nbytes * 2)

                run_stream(names, load, work, threads=worker_threads(threads), progress=bar,
                           prefetch=0 if loader is None else 1, release=release,
                           sizes=lambda n: base_ck.meta(n).nbytes, budget=largest(metas))
                if loader is not None:
                    _check_kept_expert(man.folds[k], loader)
                finish_model(writer, base_ck, stage, state_writer, untied=aliases != ties)
            except BaseException:
                writer.abort()
                raise
    except BaseException:
        state_writer.abort()
        state_path.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
        if contrib is not None:
            contrib.close()
        if exp is not None:
            exp.close()
        base_ck.close()
        cur.close()
    new_man = Manifest(policy=man.policy, base=man.base, base_tensors=man.base_tensors,
                       backbone=str(Path(out).resolve()), state_file=final_name(state_path, sd.path), folds=remaining)
    sd.close()
    sd.commit(new_man, [state_path])
    return FoldReport(out=str(out), policy=pol.name, params=pol.describe(), experts=[f.id for f in remaining],
                      bytes_read=stats.bytes_read + (loader.reader.bytes_read if loader is not None else 0),
                      bytes_written=writer.bytes_written, stats={"mode_subtract": 1.0})


def _open_kept_expert(rec, base_ck, aliases: dict[str, str], threads):
    """The expert of fold ``rec`` and a loader that reads (and hashes) it in its own order, for a
    subtract that recomputes λτ (residual format 3). Raises StateError when the file is gone or is
    no longer a dense checkpoint of θ₀'s keys."""
    if not is_s3_path(rec.expert) and not Path(rec.expert).exists():
        raise StateError(f"subtract of {rec.id!r} recomputes λ·τ from its expert, which is gone: {rec.expert} "
                         f"(restore the file with content hash {rec.sha256}, or use --mode replay)")
    exp = open_expert(rec.expert, base_ck)
    try:
        if not isinstance(exp, DenseExpert):
            raise StateError(f"expert {rec.id!r} at {rec.expert} is no longer a dense checkpoint; use --mode replay")
        validate_against_base(base_ck, exp, role="expert", deep=False)
        return exp, ExpertLoader(exp, base_ck, aliases, f"expert {exp.path}", worker_threads(threads) + 1)
    except BaseException:
        exp.close()
        raise


def _check_kept_expert(rec, loader: ExpertLoader) -> None:
    """Raise CorruptCheckpointError (before anything is published) if the expert read for the
    subtract is not the one folded: its content hash, computed on the same pass."""
    version = weights_hash_version(rec.sha256_kind)
    if version is None:  # a state written before the weights hash: nothing to compare with
        return
    sha = loader.reader.sha256() if version == WEIGHTS_HASH_VERSION else loader.reader.ckpt.sha256(version)
    if sha != rec.sha256:
        raise CorruptCheckpointError(
            f"expert {rec.id!r} at {rec.expert} changed since it was folded (content hash {sha}, expected "
            f"{rec.sha256}); subtract recomputes λ·τ from it, so nothing was removed: restore the file or "
            "use --mode replay")


def replay(sd: StateDir, k: int, *, out, base, options: ExecOptions) -> FoldReport:
    """Refold every expert but ``k`` from θ₀ (see :func:`unmerge`) with ``options`` (no progress
    bar; only the last fold, into ``out``, may overwrite); updates ``sd``."""
    man = sd.manifest
    remaining = [f for i, f in enumerate(man.folds) if i != k]
    for f in remaining:
        if not is_s3_path(f.expert) and not Path(f.expert).exists():  # an S3 object is checked at open
            raise StateError(f"replay needs expert {f.id!r} at {f.expert}, which is gone")
    work = replay_work_dir(out)
    try:
        tmp_state = work / "state"
        backbone = None
        report = None
        for i, f in enumerate(remaining):
            params = make_policy(man.policy, f.params).refold_params(f.coefficient)  # no objective here
            step_out = Path(out) if i == len(remaining) - 1 else work / f"step-{i}"
            step = dataclasses.replace(options, progress=False, overwrite=options.overwrite and step_out == Path(out))
            report = fold(base, backbone, f.expert, man.policy, params, state_dir=tmp_state, out=step_out,
                          expert_id=f.id, expect_sha256=f.sha256 if weights_hash_version(f.sha256_kind) else None,
                          options=step)
            backbone = step_out
        if report is None:  # removing the only expert: the backbone is θ₀ again
            report = copy_base(base, out, options.overwrite, options.max_shard_bytes, options.threads)
            pol = make_policy(man.policy, man.folds[k].params)
            report.policy, report.params = pol.name, pol.describe()
            new_man = Manifest(policy=man.policy, base=man.base, base_tensors=man.base_tensors,
                               backbone=str(Path(out).resolve()), state_file=None, folds=[])
            sd.close()
            sd.commit(new_man, [])
        else:
            _adopt_state(sd, tmp_state)
        report.experts = [f.id for f in remaining]
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)


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
