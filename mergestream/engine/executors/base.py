"""The executor protocol and the local executor (see :mod:`mergestream.engine.executors`).

:class:`TensorMap` is one pass's per-tensor map as data; an :class:`Executor` runs it.
:class:`LocalExecutor` runs it on this process's worker threads; the Ray executor
(:mod:`.ray_cluster`) on a cluster.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ...io.checkpoints import Checkpoint
from ..fold_tensor import FoldSinks, FoldSpec, MergeSpec
from ..stream import Progress, run_stream


@dataclass
class TensorMap:
    """One pass's per-tensor map (a fold's or an offline merge's), as every executor needs it.

    Attributes:
        names: θ₀'s tensor names in the order ``load`` must see them (canonical order).
        load: ``load(name) -> item`` on the calling thread, in order (reads, hashes, frozen checks);
            None: nothing to do for that tensor.
        work: ``work(name, item)``: compute and write one tensor into ``sinks`` (thread-safe).
        sinks: the pass's real writers (model, state, residuals, statistics).
        spec: the pass as data (:class:`~mergestream.engine.fold_tensor.FoldSpec` or ``MergeSpec``,
            picklable), for an executor that runs the float tensors in other processes.
        base: θ₀ (each tensor's size in bytes: progress, memory budget, task groups).
        threads: local worker threads (>= 1). prefetch: jobs loaded ahead of the local workers (>= 0).
        release: called with each loaded item once its job is over (pooled buffers); None: nothing.
        budget: bytes of θ₀'s tensors the local jobs alive may hold together (None: no bound).
        progress: advanced by each tensor's bytes once it is done; None: no bar.
        hook: for an executor that folds the float tensors elsewhere: called on the driver with each
            name before it is read (liveness, stop requests). The local executor does not call it:
            its ``work`` calls the pass's own tensor hook.
        placement: for a remote executor: ``placement(name)`` is ``"remote"`` (a task folds it,
            reading the inputs itself), ``"driver"`` (``load`` + ``work`` here: frozen integer
            tensors) or ``"skip"`` (a tied alias, written with its primary). None: all remote.
        parts: for a remote executor: where its tasks write (:class:`~.parts.PartsPlan`).
        digests: filled by a remote executor: per expert, ``{name: sha256 of the stored bytes}`` of
            every tensor its tasks read (the weights hash is combined from them on the driver).
        partials: filled by a remote executor: ``{name: what the task's worker returned}`` where it
            returned something (a rebuild's partial sums, :mod:`mergestream.engine.rebuild`).
    """

    names: list[str]
    load: Callable[[str], Any]
    work: Callable[[str, Any], None]
    sinks: FoldSinks
    spec: FoldSpec | MergeSpec
    base: Checkpoint
    threads: int = 1
    prefetch: int = 1
    release: Callable[[Any], None] | None = None
    budget: int | None = None
    progress: Progress | None = None
    hook: Callable[[str], None] | None = None
    placement: Callable[[str], str] | None = None
    parts: Any = None
    digests: list[dict[str, bytes]] = field(default_factory=list)
    partials: dict[str, Any] = field(default_factory=dict)

    def nbytes(self, name: str) -> int:
        """Bytes of θ₀'s tensor ``name``."""
        return self.base.meta(name).nbytes


@runtime_checkable
class Executor(Protocol):
    """Where a pass's per-tensor map runs (see the module docstring).

    An executor must produce the very bytes of :class:`LocalExecutor` in the output (a remote one
    writes the state and residuals as pieces folders: the same keys and bytes); the driver commits
    them. It is reused across passes (a daemon keeps one). ``remote``: whether its tasks write the
    output themselves (then the pass hands it :attr:`TensorMap.parts`).
    """

    remote: bool

    def map(self, job: TensorMap) -> list[tuple[int, float, float]] | None:
        """Run ``job``: load every tensor in order on the calling thread, write each result into
        ``job.sinks``, then return.

        Returns:
            ``(bytes, seconds, cpu seconds)`` of each remote task (θ₀'s bytes of its tensors, its wall
            and CPU time in the worker), for :attr:`~mergestream.engine.passes.FoldReport.tasks`; None
            when the map ran locally.

        Raises:
            The first error of ``load``, ``work`` or a task; nothing is committed here.
        """
        ...


class LocalExecutor:
    """The engine's own worker threads: :func:`~mergestream.engine.stream.run_stream` in this process.

    Stateless; one instance serves any number of passes, concurrently too.
    """

    remote = False

    def map(self, job: TensorMap) -> None:
        """Run ``job`` on ``job.threads`` worker threads (at most ``threads + prefetch`` jobs alive,
        within ``job.budget``); returns None (no remote tasks). Raises the first error of
        ``job.load`` or ``job.work``."""
        run_stream(job.names, job.load, job.work, threads=job.threads, progress=job.progress, prefetch=job.prefetch,
                   sizes=job.nbytes, release=job.release, budget=job.budget)

    def __repr__(self) -> str:
        return "LocalExecutor()"
