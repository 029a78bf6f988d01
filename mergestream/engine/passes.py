"""What every streaming pass shares: the report, the expert loader, casting and writing results.

The fold and the offline merge (:mod:`.folding`), the unmerge (:mod:`.unmerge`) and the θ₀ copy
all run on :func:`mergestream.engine.stream.run_stream`; this module holds the pieces they have in common
so that each pass reads as its own math. Tensors are float32 for the math and cast back to the
storage dtype of θ₀ on the CPU before they are written.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..errors import CorruptCheckpointError, NonFiniteError
from ..io.checkpoints import (
    DEFAULT_SHARD_BYTES,
    Checkpoint,
    check_frozen,
    is_float_dtype,
    open_checkpoint,
    sum_is_finite,
    validate_against_base,
)
from ..io.expert_readers import DenseExpert
from ..io.model_card import write_model_card
from ..io.paths import public_name
from ..io.st import WeightsHash, load_json, name_order
from ..io.writers import ModelWriter, copy_aux_files, staged_output
from ..policies import Policy, make_policy
from .stream import ExpertReader, default_threads, run_stream

log = logging.getLogger("mergestream.engine")


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
        tasks: with a remote executor, ``[bytes, seconds, cpu seconds]`` of each task (θ₀'s bytes of
            its tensors, its wall and CPU time in the worker); None locally.
        received_bytes: with a remote executor, bytes of the task results the driver received
            (pickled metadata; no tensor travels); None locally.
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
    tasks: list[list[float]] | None = None
    received_bytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


#: a same-length placeholder for a content hash known only at the end of the pass
NO_HASH = "0" * 64


def seed_of(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


class Stats:
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


def cast_checked(x: torch.Tensor, dtype: torch.dtype, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (a fold's or unmerge's result) cast to the storage dtype on the CPU; NonFiniteError if
    it is not finite there (overflow). ``out``: a CPU buffer of ``x``'s shape in ``dtype`` to cast
    into (used only when a cast or a device copy is needed; else ``x`` itself is returned)."""
    if out is not None and (x.dtype != dtype or x.device.type != "cpu"):
        out = out.copy_(x)
    else:
        out = x.to(dtype) if x.dtype != dtype else x
        out = out.cpu() if out.device.type != "cpu" else out
    if out.is_floating_point() and out.numel() and not sum_is_finite(out) and not bool(torch.isfinite(out).all()):
        raise NonFiniteError(f"tensor {name}: the result is not finite in {dtype} (overflow?); nothing written")
    return out


def write_with_aliases(writer: ModelWriter, name: str, result: torch.Tensor, aliases: dict[str, str]) -> None:
    """Write a tensor and every tensor tied to it in θ₀ (same bytes)."""
    writer.write(name, result)
    for alias, primary in aliases.items():
        if primary == name:
            writer.write(alias, result)


def tied_groups(ckpt: Checkpoint) -> dict[str, str]:
    """Aliases among tensors that share storage in the base (e.g. embeddings tied to the LM head).

    Only candidate pairs (an embedding-like name and an LM-head-like name of equal shape and dtype)
    are compared, so this reads at most a few tensors.

    Returns:
        ``{alias: primary}``: the alias is written as an exact copy of the primary's result.
    """
    metas = ckpt.metas()
    heads = [m for m in metas if re.search(r"(lm_head|embed_out|output)\.weight$", m.name)]
    embeds = [m for m in metas if re.search(r"(embed_tokens|word_embeddings|wte|shared)\.weight$", m.name)]
    out: dict[str, str] = {}
    for h in heads:
        for e in embeds:
            if h.shape == e.shape and h.dtype == e.dtype and _same_bytes(ckpt, h.name, e.name):
                out[h.name] = e.name
    return out


def _same_bytes(ckpt: Checkpoint, a: str, b: str, chunk: int = 1 << 22) -> bool:
    """Whether tensors ``a`` and ``b`` hold the same bytes, compared in ``chunk``-byte pieces that stop
    at the first difference (untied embeddings differ in their first bytes: two small reads, where
    whole-tensor reads cost two fresh vocabulary-sized buffers per fold)."""
    n = ckpt.meta(a).nbytes
    bufs = torch.empty(2, min(chunk, n), dtype=torch.uint8)
    for off in range(0, n, chunk):
        k = min(chunk, n - off)
        if not torch.equal(ckpt.read_into(a, bufs[0, :k], off), ckpt.read_into(b, bufs[1, :k], off)):
            return False
    return True


def kept_ties(ties: dict[str, str], readers: list[Callable[[str], torch.Tensor]], where: str) -> dict[str, str]:
    """The ties of θ₀ (``{alias: primary}``, :func:`tied_groups`) that every
    input keeps: ``read(alias)`` equals ``read(primary)`` bit for bit for each reader (the backbone
    θ_{t−1}, each expert's tensor or LoRA task vector). Only those are written as one tensor; an
    untied pair is folded tensor by tensor, and the output is marked untied (:func:`untie_config`).
    Reads the two tensors of each tie once per input (embedding-sized, a few per model)."""
    kept = {}
    for alias, primary in ties.items():
        if all(torch.equal(read(alias), read(primary)) for read in readers):
            kept[alias] = primary
        else:
            log.warning("%s unties %s from %s: folded separately, the output is untied "
                        "(config.json tie_word_embeddings=false)", where, alias, primary)
    return kept


def untie_config(folder: Path) -> None:
    """Mark a written model untied: ``tie_word_embeddings: false`` in its ``config.json`` (if it has
    one), so loaders keep the LM head the fold wrote instead of re-tying it to the embeddings."""
    cfg = Path(folder) / "config.json"
    if not cfg.is_file():
        return
    doc = load_json(cfg.read_bytes(), str(cfg), error=CorruptCheckpointError)
    if doc.get("tie_word_embeddings") is not False:
        doc["tie_word_embeddings"] = False
        cfg.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def provenance(policy: Policy, records: list[dict[str, str]], base: Checkpoint) -> dict[str, str]:
    """The string metadata every output's weight files (and its index) carry: the policy and its
    parameters, the experts in fold order with their content hashes, the base by its name
    (:func:`~mergestream.io.paths.public_name`, never its path: outputs travel to other machines)
    and the tool version. The model card (:mod:`mergestream.io.model_card`) is rendered from it."""
    return {
        "format": "pt",
        "mergestream.policy": policy.name,
        "mergestream.params": json.dumps(policy.describe(), sort_keys=True),
        "mergestream.experts": json.dumps([r["id"] for r in records]),
        "mergestream.expert_sha256": json.dumps([r["sha256"] for r in records]),
        "mergestream.n_folds": str(len(records)),
        "mergestream.base": public_name(base.path),
        "mergestream.version": __version__,
    }


def open_base_and_backbone(base: str | os.PathLike, backbone: str | os.PathLike | None) -> tuple[Checkpoint, Checkpoint]:
    b = open_checkpoint(base)
    if backbone is None or Path(backbone).resolve() == Path(base).resolve():
        return b, b
    cur = open_checkpoint(backbone)
    validate_against_base(b, cur, role="backbone", check_finite=False, deep=False)
    return b, cur


def largest(metas) -> int:
    """Bytes of the largest tensor (the memory budget of the whole-tensor jobs alive at once)."""
    return max((m.nbytes for m in metas), default=0)


def worker_threads(threads: int | None) -> int:
    return default_threads() if threads is None or threads <= 0 else threads


class ExpertLoader:
    """The fold's loader: reads (and hashes) the expert in canonical order, checks frozen tensors.

    ``load(name)`` returns ``(expert tensor or None, prev)`` for the worker, or None for a tensor
    the worker skips (an alias tied in θ₀: written with its primary). LoRA experts have no dense
    tensor to stream: the worker builds τ from the factors. Recomputed buffers the expert carries
    and θ₀ lacks (``dropped``, allowed by validation) are logged once, never merged nor written;
    when the content hash is computed on this pass their bytes are fed to it in order.
    """

    def __init__(self, exp, base: Checkpoint, aliases: dict[str, str], where: str, buffers: int = 0):
        self.dense = isinstance(exp, DenseExpert)
        self.reader = ExpertReader(exp.ckpt, buffers) if self.dense else None
        self.base = base
        self.aliases = aliases
        #: set by the caller when θ₀ ties tensors that this fold writes untied (see kept_ties)
        self.untied = False
        self.where = where
        order = self.reader.order() if self.dense else []
        self.dropped = [n for n in order if n not in base]
        self.names = [n for n in order if n in base] if self.dense else \
            [n for n in canonical_order(base) if n not in aliases]
        #: dropped tensors read for the hash only: before each kept tensor, and after the last one
        self._hash_only: dict[str, list[str]] = {}
        self._trailing: tuple[str | None, list[str]] = (None, [])
        if self.dropped:
            log.warning("%s: dropping %d recomputed buffer(s) the base lacks (not merged, not written): %s",
                        where, len(self.dropped), ", ".join(self.dropped))
        if self.dropped and exp.ckpt.raw:  # a legacy pickle's hash is its file's: nothing to read
            pending: list[str] = []
            for n in order:
                if n in base:
                    self._hash_only[n], pending = pending, []
                else:
                    pending.append(n)
            self._trailing = (self.names[-1], pending)

    def _hash_dropped(self, names: list[str]) -> None:
        for n in names:
            self._drop(self.reader.read(n))

    def load(self, name: str):
        self._hash_dropped(self._hash_only.pop(name, []))
        e = self.reader.read(name) if self.dense else None
        if name == self._trailing[0]:
            self._hash_dropped(self._trailing[1])
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

    def sha256_from(self, digests: dict[str, bytes]) -> str:
        """The expert's content hash (weights hash version 2) from per-tensor digests computed where
        the tensors were read (a remote executor's tasks). Tensors no task read are digested here:
        a tied alias takes its primary's digest (:func:`kept_ties` checked the expert holds the
        same bytes under both names), frozen tensors and dropped buffers are read (small)."""
        if not self.reader.ckpt.raw:  # a legacy pickle's hash is its file's, computed at open
            return self.reader.sha256()
        ck = self.reader.ckpt
        names = name_order(ck.keys())
        h = WeightsHash(len(names))
        for name in names:
            d = digests.get(name)
            if d is None and name in self.aliases:
                d = digests.get(self.aliases[name])
            if d is None:
                d = ck.digest(name)
            h.add_digest(ck.entry(name), d)
        return h.hexdigest()

    def release(self, item) -> None:
        """Hand a job's expert buffer back to the reader's pool."""
        if item is not None and self.reader is not None and item[0] == "float":
            self.reader.release(item[1])


def canonical_order(ck: Checkpoint) -> list[str]:
    """θ₀'s tensor names in canonical order (the order every pass loads them in)."""
    return name_order(ck.keys())


def finish_model(writer: ModelWriter, base: Checkpoint, stage: Path, *others: Any, untied: bool = False) -> None:
    """End a pass's output: close the model writer and the other writers (state, residuals; None
    skipped), then copy θ₀'s non-weight files into the staged folder (marked untied with
    ``untied``, see :func:`kept_ties`) and write the output's own model card in place of θ₀'s
    (:func:`~mergestream.io.model_card.write_model_card`)."""
    writer.close()
    for other in others:
        if other is not None:
            other.close()
    copy_aux_files(base, stage)
    if untied:
        untie_config(stage)
    write_model_card(stage, base=base.path)


def copy_base(base: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES, threads: int | None = 1) -> FoldReport:
    """Write θ₀ itself as a backbone (the result of removing every expert), through the stream."""
    pol = make_policy("task_arithmetic", {"lambda": 0.0})
    base_ck = open_checkpoint(base)
    try:
        with staged_output(out, overwrite=overwrite) as stage:
            w = ModelWriter(stage, base_ck.metas(), provenance(pol, [], base_ck), max_shard_bytes)
            try:
                run_stream(canonical_order(base_ck), base_ck.get, w.write, threads=worker_threads(threads))
                finish_model(w, base_ck, stage)
            except BaseException:
                w.abort()
                raise
    finally:
        base_ck.close()
    return FoldReport(out=str(out), policy="base", params={}, experts=[], bytes_written=w.bytes_written)
