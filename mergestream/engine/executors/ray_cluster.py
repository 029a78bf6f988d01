"""The Ray executor: a fold's float tensors folded by Ray tasks, committed by the driver.

The only module of the package that imports ``ray`` (the optional extra ``mergestream[ray]``);
the design and the per-policy handling are in :mod:`mergestream.engine.executors`.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Callable

import ray
import torch

from ..fold_tensor import FoldSpec, MergeSpec, runs_on_driver
from ..stream import clear_scratch
from .base import TensorMap
from .recording import Recorder, replay

log = logging.getLogger("mergestream.engine.executors")

#: the default group of a task is at most this many bytes of θ₀ (results wait in Ray's object store)
MAX_GROUP_BYTES = 1 << 30


def _fold_group(spec: FoldSpec | MergeSpec, names: list[str], with_residuals: bool,
                task_hook: Callable[[list[str]], None] | None) -> tuple[list[tuple], float]:
    """One task: fold ``names`` (float tensors, canonical order) and return (recorded writes, seconds)."""
    t0 = time.perf_counter()
    torch.set_num_threads(spec.torch_threads)
    if task_hook is not None:
        task_hook(names)
    folder, close = spec.open()
    rec = Recorder(with_residuals)
    try:
        for name in names:
            folder(name, spec.read_expert(folder, name), rec.sinks)
    finally:
        close()
        clear_scratch()  # a Ray worker outlives the task: its scratch buffers must not
    return rec.ops, time.perf_counter() - t0


class RayExecutor:
    """Run a pass's per-tensor map on a Ray cluster: the :class:`~mergestream.engine.executors.Executor`
    of ``executor: ray`` / ``--executor ray`` (see :mod:`mergestream.engine.executors`).

    Args:
        address: the cluster (``auto``, ``ray://head:10001``, ``head:6379``); None: join the cluster
            ``RAY_ADDRESS`` names, else start a local Ray instance (``num_cpus`` of them).
        num_cpus: CPUs of a local instance started here (None: all). Ignored with an address.
        group_bytes: bytes of θ₀'s tensors per task (None: total / (4 · cluster CPUs), at most
            :data:`MAX_GROUP_BYTES`; at least one tensor per task). At most 2 tasks per cluster CPU
            are in flight; the driver takes their results in order, one at a time.
        max_retries: times Ray reruns a task whose worker process died (not for errors the task
            raises: those fail the fold).
        task_hook: called in each task with its tensor names before any work (fault injection in tests).

    Attributes:
        tasks: ``(bytes, seconds)`` of each task of the last fold: θ₀'s bytes of its tensors and
            its wall time in the worker (read inputs, fold, record), for the scaling benchmark.
    """

    def __init__(self, address: str | None = None, *, num_cpus: int | None = None, group_bytes: int | None = None,
                 max_retries: int = 3, task_hook: Callable[[list[str]], None] | None = None):
        self.address = address
        self.num_cpus = num_cpus
        self.group_bytes = group_bytes
        self.max_retries = max_retries
        self.task_hook = task_hook
        self.tasks: list[tuple[int, float]] = []

    def connect(self) -> int:
        """Join (or start) the cluster once; returns its CPU count."""
        if not ray.is_initialized():
            # ray.init replaces SIGTERM/SIGINT handlers with an immediate exit; the caller's (the
            # daemon's graceful stop) are put back
            main = threading.current_thread() is threading.main_thread()
            saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}
            ray.init(address=self.address, num_cpus=None if self.address else self.num_cpus,
                     include_dashboard=False, log_to_driver=False, configure_logging=False)
            for sig, handler in saved.items():
                if handler is not None:
                    signal.signal(sig, handler)
        return max(1, int(ray.cluster_resources().get("CPU", 1)))

    def map(self, job: TensorMap) -> list[tuple[int, float]]:
        """Map a pass's float tensors onto Ray tasks; the driver loads every tensor in order first.

        ``job.load`` (the local loader: hashes and checks on the way) runs here for every tensor;
        its float items are dropped (``job.release``) and re-read by the task from ``job.spec``'s
        paths. Frozen tensors go through ``job.work`` here. ``job.hook`` is called here with each
        name before it is read (liveness, stop requests: an exception cancels the tasks).
        ``job.threads``, ``prefetch`` and ``budget`` are the local executor's and are not used.

        Returns:
            ``(bytes, seconds)`` of each task (also kept in :attr:`tasks`).

        Raises:
            The first task's error (its original type where Ray can keep it); the tasks still
            queued are cancelled. Nothing is committed here.
        """
        spec, names, load, release, work, sinks = job.spec, job.names, job.load, job.release, job.work, job.sinks
        progress, hook, size_of = job.progress, job.hook, job.nbytes
        cpus = self.connect()
        total = sum(size_of(n) for n in names)
        target = self.group_bytes or min(MAX_GROUP_BYTES, max(1, total // (4 * cpus)))
        limit = 2 * cpus
        task = ray.remote(_fold_group).options(num_cpus=1, max_retries=self.max_retries, retry_exceptions=False)
        spec_ref = ray.put(spec)
        with_residuals = sinks.contrib is not None
        pending: deque = deque()
        self.tasks = []
        group: list[str] = []
        size = 0

        def submit() -> None:
            nonlocal group, size
            if group:
                pending.append((task.remote(spec_ref, group, with_residuals, self.task_hook), group, size))
                group, size = [], 0

        def drain_one() -> None:
            ref, group_names, nbytes = pending.popleft()
            ops, seconds = ray.get(ref)
            replay(ops, sinks)
            self.tasks.append((nbytes, seconds))
            if progress is not None:
                for n in group_names:
                    progress.advance(size_of(n))

        try:
            for name in names:
                if hook is not None:
                    hook(name)
                item = load(name)
                if item is None:
                    continue
                if runs_on_driver(item):
                    work(name, item)
                    continue
                if release is not None:
                    release(item)
                del item
                group.append(name)
                size += size_of(name)
                if size >= target:
                    submit()
                while len(pending) > limit:
                    drain_one()
            submit()
            while pending:
                drain_one()
        except BaseException:
            for ref, _, _ in pending:
                ray.cancel(ref, force=True)
            raise
        log.info("ray fold tasks=%d cpus=%d seconds=%.2f", len(self.tasks), cpus, sum(s for _, s in self.tasks))
        return list(self.tasks)
