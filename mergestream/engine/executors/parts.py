"""What a remote task writes itself, and the little it returns: the executors' shared-storage sinks.

A task of a remote fold (:mod:`.ray_cluster`) writes its tensors straight into the output shards the
driver planned (:class:`~mergestream.io.writers.PartWriter`), its tensors' policy state and residuals
into pieces of their own (``part-NNNNN.safetensors`` in the pieces folders of
:meth:`~mergestream.io.state.StateDir.new_pieces`), and hashes every expert tensor it reads
(:func:`mergestream.io.st.tensor_digest`). What travels back to the driver is a :class:`PartResult`:
names, per-tensor digests (32 bytes each), the policy statistics and byte counts. No tensor.
With an ``s3://`` output the task owns whole shards and stages them as objects instead
(:class:`~mergestream.io.s3_output.StagingWriter`); the state and residual pieces stay on the
shared filesystem.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...io.checkpoints import TensorMeta, piece_name
from ...io.st import tensor_digest
from ...io.s3_output import S3Target, StagingWriter
from ...io.writers import AppendWriter, PartWriter, tensor_bytes
from ..fold_tensor import FoldSinks
from ..passes import Stats
from ..residuals import ResidualWriter, header_room


@dataclass
class PartsPlan:
    """Where the tasks of one pass write (picklable, tensor-free; every path on shared storage).

    Attributes:
        model: :meth:`~mergestream.io.writers.ModelWriter.plan` of the staged output.
        state: the state's pieces folder (None: the pass keeps no state, e.g. an offline merge).
        contrib: the residual's pieces folder (None: no residual file, e.g. the policy keeps its
            contributions in its state).
        expert_id / recompute_lambda / expert_path: the residual's metadata (see
            :class:`~mergestream.engine.residuals.ResidualWriter`).
        s3: for an ``s3://`` output, where the tasks stage the shards they own
            (:class:`~mergestream.io.s3_output.S3Target`; each task then writes whole shards, frozen
            tensors and tied aliases included); None: the shards on shared storage.
    """

    model: dict[str, tuple[str, int, tuple[int, ...], str]]
    state: str | None = None
    contrib: str | None = None
    expert_id: str = ""
    recompute_lambda: float | None = None
    expert_path: str | None = None
    s3: S3Target | None = None


class _StatsRecord(Stats):
    """Statistics as a list of ``Stats.add`` calls, summed again on the driver (a few floats per tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[dict[str, float], int, int]] = []

    def add(self, stats: dict[str, float], numel: int, nbytes: int) -> None:
        self.calls.append(({k: float(v) for k, v in stats.items()}, numel, nbytes))


@dataclass
class PartResult:
    """What a task returns: metadata only.

    Attributes:
        names: the tensors it folded. written: every planned tensor it wrote (aliases included).
        digests: per expert of the pass, ``{tensor name: sha256 of its stored bytes}`` (32 bytes each).
        stats: its ``Stats.add`` calls. bytes_written: model bytes written. seconds: wall time in the
        worker; cpu_seconds: the CPU time its process spent on it (all threads). partials: what its
        per-tensor worker returned, by tensor (a rebuild's partial sums: a few floats each).
    """

    names: list[str]
    written: list[str] = field(default_factory=list)
    digests: list[dict[str, bytes]] = field(default_factory=list)
    stats: list[tuple[dict[str, float], int, int]] = field(default_factory=list)
    bytes_written: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    partials: dict[str, Any] = field(default_factory=dict)


class PartSinks:
    """A task's sinks (:class:`~mergestream.engine.fold_tensor.FoldSinks`) over shared storage: the
    planned shards, and its own pieces of the state and the residual (piece ``index``).

    Args:
        plan: the pass's :class:`PartsPlan`. index: the task's number (its pieces' name; a retried
            task rewrites the same pieces). metas: θ₀'s metas of the task's tensors (header room).
    """

    def __init__(self, plan: PartsPlan, index: int, metas: list[TensorMeta]):
        self.model = StagingWriter(plan.model, plan.s3) if plan.s3 is not None else PartWriter(plan.model)
        self.stats = _StatsRecord()
        self.state = AppendWriter(Path(plan.state) / piece_name(index), header_bytes=header_room(metas, 4)) \
            if plan.state is not None else None
        try:
            self.contrib = ResidualWriter(Path(plan.contrib) / piece_name(index), metas, plan.expert_id,
                                          recompute_lambda=plan.recompute_lambda, expert_path=plan.expert_path) \
                if plan.contrib is not None else None
        except BaseException:
            self.abort()
            raise
        self.sinks = FoldSinks(self.model, self.state, self.contrib, self.stats)

    def finish(self, result: PartResult) -> PartResult:
        """Make everything written durable (fsync, headers) and fill ``result``'s counts."""
        self.model.close()
        for w in (self.state, self.contrib):
            if w is not None:
                w.close()
        result.written = list(self.model.written)
        result.bytes_written = self.model.bytes_written
        result.stats = self.stats.calls
        return result

    def abort(self) -> None:
        """Drop what this task wrote into its pieces (the driver discards the staged output)."""
        self.model.abort()
        for w in (getattr(self, "state", None), getattr(self, "contrib", None)):
            if w is not None:
                w.abort()


def digest(t: torch.Tensor | None) -> bytes | None:
    """sha256 of a stored tensor's bytes (the per-tensor digest of the weights hash), None for None."""
    if t is None:
        return None
    h = tensor_digest()
    h.update(tensor_bytes(t))
    return h.digest()


def run_part(spec: Any, index: int, names: list[str], plan: PartsPlan, hook: Any = None,
             frozen: frozenset[str] = frozenset()) -> PartResult:
    """One task: open the pass's inputs from ``spec`` (a :class:`~mergestream.engine.fold_tensor.FoldSpec`,
    ``MergeSpec`` or :class:`~mergestream.engine.rebuild.RebuildSpec`), fold (merge, rebuild) ``names``
    into shared storage, return metadata only.

    ``frozen``: those of ``names`` that are copied from θ₀ (integer tensors of shards this task owns
    with an ``s3://`` output; the driver checked the expert's copies).

    Raises:
        Whatever the fold of a tensor raises; the task's pieces are removed first.
    """
    from ..stream import clear_scratch

    t0, c0 = time.perf_counter(), time.process_time()
    torch.set_num_threads(spec.torch_threads)
    if hook is not None:
        hook(names)
    worker, close = spec.open()
    result = PartResult(names=list(names), digests=[{} for _ in range(spec.expert_count)])
    part = None
    try:
        part = PartSinks(plan, index, [worker.base_ck.meta(n) for n in names])
        for name in names:
            if name in frozen:
                worker(name, spec.frozen_item(worker, name), part.sinks)
                continue
            item = spec.read_expert(worker, name)
            for i, (_, e) in enumerate(item if isinstance(item, list) else [item]):
                d = digest(e)
                if d is not None:
                    result.digests[i][name] = d
            partial = worker(name, item, part.sinks)
            if partial is not None:
                result.partials[name] = partial
            del item
        part.finish(result)
    except BaseException:
        if part is not None:
            part.abort()
        raise
    finally:
        close()
        clear_scratch()  # a Ray worker outlives the task: its scratch buffers must not
    result.seconds, result.cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    return result
