"""Unmerge: remove one expert from a state's backbone, by ``subtract`` or by ``replay``.

Called through :func:`mergestream.engine.unmerge` (which documents the guarantees); both run on
the streaming skeleton of :mod:`.stream`.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import torch

from . import residuals
from .checkpoints import is_float_dtype, tied_groups
from .engine import (
    FoldReport,
    _adopt_state,
    _cast_checked,
    _largest,
    _open_base_and_backbone,
    _order,
    _provenance,
    _Stats,
    _threads,
    _write_with_aliases,
    copy_base,
    fold,
    replay_work_dir,
    resolve_device,
)
from .errors import StateError
from .policies import make_policy
from .state import SEP, Manifest, StateDir, final_name
from .stream import Progress, run_stream
from .writers import AppendWriter, ModelWriter, copy_aux_files, staged_output


def subtract(sd: StateDir, k: int, *, out, base, backbone, device, threads, max_shard_bytes, overwrite,
             progress: bool = False) -> FoldReport:
    """θ − Δ_k for every tensor (see :func:`mergestream.engine.unmerge`); updates ``sd``."""
    man = sd.manifest
    pol = make_policy(man.policy, man.folds[k].params)
    if not backbone or not Path(backbone).exists():
        raise StateError(f"backbone {backbone} recorded in {sd.path} is missing; pass --backbone")
    dev = resolve_device(device)
    base_ck, cur = _open_base_and_backbone(base, backbone)
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
    contrib = None
    if not pol.contributions_in_state:
        rec = man.folds[k]
        if not rec.contribution or not (sd.path / rec.contribution).exists():
            raise StateError(f"{sd.path}: no stored contribution for expert {rec.id!r}")
        contrib = residuals.ResidualReader(sd.path / rec.contribution)
    metas = base_ck.metas()
    aliases = tied_groups(base_ck)
    state_path = sd.new_file("state")
    state_writer = AppendWriter(state_path, header_bytes=residuals.header_room(metas, 4))
    lock = threading.Lock()
    stats = _Stats()
    bar = Progress(sum(m.nbytes for m in metas), len(metas), f"unmerge {man.folds[k].id}", progress)
    try:
        with staged_output(out, overwrite=overwrite) as stage:
            writer = ModelWriter(stage, metas, _provenance(pol, records, base_ck), max_shard_bytes)
            try:
                def load(name: str):
                    return None if name in aliases else cur.get(name)

                def work(name: str, cur_s: torch.Tensor) -> None:
                    meta = base_ck.meta(name)
                    if not is_float_dtype(meta.dtype):
                        _write_with_aliases(writer, name, base_ck.get(name), aliases)
                        return
                    with lock:
                        st = sd.tensor_state(name)
                    if contrib is not None:
                        r, idx, val = contrib.get(name)
                        result = cur_s if r is None else residuals.subtract(
                            cur_s.to(dev), r, *((idx, val) if exact else (None, None))).cpu()
                    else:
                        c = pol.contribution({k2: v.to(dev) for k2, v in st.items()}, k, coeff_k, cur_s.shape)
                        result = cur_s if c is None else (cur_s.to(dev, torch.float32) - c)
                    result = _cast_checked(result, meta.dtype, name)
                    _write_with_aliases(writer, name, result, aliases)
                    if st:
                        for f, v in pol.drop_from_state(st, k).items():
                            state_writer.write(f"{name}{SEP}{f}", v.cpu())
                    stats.add({}, meta.numel, meta.nbytes * 2)

                run_stream(_order(base_ck), load, work, threads=_threads(threads), progress=bar, prefetch=0,
                           sizes=lambda n: base_ck.meta(n).nbytes, budget=_largest(metas))
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
    finally:
        bar.close()
        if contrib is not None:
            contrib.close()
        base_ck.close()
        cur.close()
    new_man = Manifest(policy=man.policy, base=man.base, base_tensors=man.base_tensors,
                       backbone=str(Path(out).resolve()), state_file=final_name(state_path, sd.path), folds=remaining)
    sd.close()
    sd.commit(new_man, [state_path])
    return FoldReport(out=str(out), policy=pol.name, params=pol.describe(), experts=[f.id for f in remaining],
                      bytes_read=stats.bytes_read, bytes_written=writer.bytes_written, stats={"mode_subtract": 1.0})


def replay(sd: StateDir, k: int, *, out, base, device, threads, max_shard_bytes, overwrite) -> FoldReport:
    """Refold every expert but ``k`` from θ₀ (see :func:`mergestream.engine.unmerge`); updates ``sd``."""
    man = sd.manifest
    remaining = [f for i, f in enumerate(man.folds) if i != k]
    for f in remaining:
        if not Path(f.expert).exists():
            raise StateError(f"replay needs expert {f.id!r} at {f.expert}, which is gone")
    work = replay_work_dir(out)
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
                          overwrite=overwrite and step_out == Path(out),
                          expect_sha256=f.sha256 if f.sha256_kind == "weights" else None)
            backbone = step_out
        if report is None:  # removing the only expert: the backbone is θ₀ again
            report = copy_base(base, out, overwrite, max_shard_bytes, threads)
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

