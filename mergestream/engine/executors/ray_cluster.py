"""The Ray executor: a pass's float tensors folded by Ray tasks that read and write shared storage
(or stage whole output shards in a bucket, :mod:`mergestream.io.s3_output`).

The only module of the package that imports ``ray`` (the optional extra ``mergestream[ray]``);
the design and the per-policy handling are in :mod:`mergestream.engine.executors`.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from ...errors import MergestreamError
from .base import TensorMap
from .parts import PartResult, run_part

log = logging.getLogger("mergestream.engine.executors")

#: the default group of a task is at most this many bytes of θ₀
MAX_GROUP_BYTES = 1 << 30
#: seconds a cluster address may take to answer before the connection is refused as unreachable
CONNECT_TIMEOUT = 10.0
#: the address a Ray instance started here binds to (never the machine's network address)
LOOPBACK = "127.0.0.1"


def pointer_file() -> Path:
    """Where Ray remembers the last cluster started on this machine (what ``address="auto"`` reads):
    Ray's own answer (its temporary folder honours ``RAY_TMPDIR`` and ``TMPDIR``)."""
    from ray._common.utils import get_ray_address_file

    return Path(get_ray_address_file(None))


def loopback_only() -> None:
    """Make every Ray process this one starts bind to 127.0.0.1 and advertise it (a local instance,
    Ray's test clusters), never the machine's network address.

    Ray replaces 127.0.0.1 in any address with the machine's address unless it runs "without cluster
    support" (its switch ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read from the environment by the
    processes it starts and at import by this one, hence also set on the imported module). Only
    for instances started here: a driver that joins a real cluster must advertise a reachable address.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants  # the switch as this process read it at import

    ray_constants.ENABLE_RAY_CLUSTER = False


def shard_owners(plan: dict[str, tuple[str, int, tuple[int, ...], str]], aliases: dict[str, str]) -> dict[str, int]:
    """For an ``s3://`` output, where one task owns whole shards: ``{tensor name: owner}``, the owner
    being the number of its shard's group (shards whose tensors are tied, e.g. embeddings and the LM
    head, form one group; else one shard per group), numbered in the order of the shards' files."""
    shard_of = {name: where[0] for name, where in plan.items()}
    parent = {path: path for path in shard_of.values()}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for alias, primary in aliases.items():
        a, b = find(shard_of[alias]), find(shard_of[primary])
        if a != b:
            parent[max(a, b)] = min(a, b)
    numbers: dict[str, int] = {}
    for path in sorted(parent):
        numbers.setdefault(find(path), len(numbers))
    return {name: numbers[find(path)] for name, path in shard_of.items()}


def group_target(total: int, cpus: int, group_bytes: int | None = None) -> int:
    """Bytes of θ₀ per task: ``group_bytes``, else total / (4 · cluster CPUs), at most
    :data:`MAX_GROUP_BYTES` (a task takes consecutive tensors in canonical order until it reaches it)."""
    return group_bytes or min(MAX_GROUP_BYTES, max(1, total // (4 * cpus)))


#: tasks in flight per cluster CPU (the driver submits more only as results come back)
IN_FLIGHT_PER_CPU = 2


def _result(ref: Any) -> Any:
    """``ray.get(ref)``, a task's own exception raised as itself: Ray wraps it in a ``RayTaskError``
    whose text is the worker's whole traceback (one line of kilobytes in the CLI's error); that
    traceback goes to the debug log instead."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if not isinstance(cause, Exception):
            raise
        log.debug("task failed in its worker:\n%s", exc)
        raise cause from None


class ClusterUnreachableError(MergestreamError):
    """The Ray cluster named (or remembered) does not answer within :data:`CONNECT_TIMEOUT` seconds."""


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a cluster address (``host:port``, ``ray://host:port``), None if it names none."""
    rest = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def resolve_address(address: str | None) -> str | None:
    """The cluster to join: ``address``, else ``RAY_ADDRESS``; ``auto`` becomes the address in Ray's
    pointer file (:func:`pointer_file`). None: start a local instance (explicitly: never the
    remembered one)."""
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address == "auto":
        try:
            remembered = pointer_file().read_text().strip()
        except OSError:
            raise ClusterUnreachableError(
                "ray address auto: no Ray cluster was started on this machine (no pointer file); start one with "
                "'ray start --head --node-ip-address=127.0.0.1', or leave the address empty to start a local "
                "instance") from None
        address = remembered or None
    return address


#: what a gRPC server (Ray's GCS, its client server) answers first to an HTTP/2 connection:
#: the client's connection preface is this string then a SETTINGS frame (RFC 9113 §3.4); the
#: server's first frame is SETTINGS (frame type 4, the 4th byte of the 9-byte frame header)
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_H2_SETTINGS = 4
_CHOOSE = ("name another with --ray-address / executor.address (or RAY_ADDRESS), or leave it empty to start a "
           "local instance")


def check_reachable(address: str, timeout: float = CONNECT_TIMEOUT) -> None:
    """Refuse, within ``timeout`` seconds, an address nobody answers at and one where something
    other than a gRPC server answers (a wrong port: Ray itself retries either for minutes, or for
    ever). The check opens a TCP connection and sends HTTP/2's connection preface: a Ray cluster's
    GCS answers with a SETTINGS frame; an HTTP/1 server, a database or silence does not.

    Raises:
        ClusterUnreachableError: one line naming the address and how to choose another.
    """
    hp = _host_port(address)
    if hp is None:
        return  # Ray's own errors for what it does not parse
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection(hp, timeout=timeout) as conn:
            conn.settimeout(max(0.1, deadline - time.monotonic()))
            conn.sendall(_H2_PREFACE)
            head = b""
            while len(head) < 9:
                chunk = conn.recv(9 - len(head))
                if not chunk:
                    break
                head += chunk
    except socket.timeout:
        head = None
    except OSError as exc:
        raise ClusterUnreachableError(
            f"the Ray cluster at {address} does not answer ({exc.strerror or exc}; waited at most {timeout:g} s): "
            f"start it, {_CHOOSE}") from None
    if head is None or len(head) < 9 or head[3] != _H2_SETTINGS:
        what = "nothing came back" if not head else "it answered, but not as gRPC"
        raise ClusterUnreachableError(
            f"{address} is not a Ray cluster ({what} within {timeout:g} s: a wrong port?): {_CHOOSE}")


class RayExecutor:
    """Run a pass's per-tensor map on a Ray cluster: the :class:`~mergestream.engine.executors.Executor`
    of ``executor: ray`` / ``--executor ray`` (see :mod:`mergestream.engine.executors`).

    Args:
        address: the cluster (``auto``, ``ray://head:10001``, ``head:6379``); None: join the cluster
            ``RAY_ADDRESS`` names, else start a local Ray instance (``num_cpus`` of them) bound to
            127.0.0.1. An address that does not answer within ``connect_timeout`` s is refused.
        num_cpus: CPUs of a local instance started here (None: all). Ignored with an address.
        group_bytes: bytes of θ₀'s tensors per task (None: total / (4 · cluster CPUs), at most
            :data:`MAX_GROUP_BYTES`; at least one tensor per task; with an ``s3://`` output a task
            takes whole shards instead, see :meth:`map`). At most 2 tasks per cluster CPU
            are in flight; each reserves as many CPUs as the intra-op threads it folds with (the
            driver's, at most a node's).
        max_retries: times Ray reruns a task whose worker process died (not for errors the task
            raises: those fail the fold).
        task_hook: called in each task with its tensor names before any work (fault injection in tests).
        connect_timeout: seconds an address may take to answer.

    Attributes:
        tasks: ``(bytes, seconds, cpu seconds)`` of each task of the last pass: θ₀'s bytes of its
            tensors, its wall time and CPU time in the worker (read inputs, fold, write), for the
            scaling benchmark.
        received_bytes: bytes of the task results the driver received in the last pass (pickled
            metadata: names, digests, statistics; never a tensor).
    """

    remote = True

    def __init__(self, address: str | None = None, *, num_cpus: int | None = None, group_bytes: int | None = None,
                 max_retries: int = 3, task_hook: Callable[[list[str]], None] | None = None,
                 connect_timeout: float = CONNECT_TIMEOUT):
        self.address = address
        self.num_cpus = num_cpus
        self.group_bytes = group_bytes
        self.max_retries = max_retries
        self.task_hook = task_hook
        self.connect_timeout = connect_timeout
        self.tasks: list[tuple[int, float, float]] = []
        self.received_bytes = 0

    def connect(self) -> int:
        """Join (or start) the cluster once; returns its CPU count.

        Raises:
            ClusterUnreachableError: the address (given, ``RAY_ADDRESS`` or remembered) does not answer.
        """
        if not ray.is_initialized():
            address = resolve_address(self.address)
            if address is not None and address != "local":
                check_reachable(address, self.connect_timeout)
            # ray.init replaces SIGTERM/SIGINT handlers with an immediate exit; the caller's (the
            # daemon's graceful stop) are put back
            main = threading.current_thread() is threading.main_thread()
            saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}
            if address is None or address == "local":
                loopback_only()
                ray.init(address="local", num_cpus=self.num_cpus, include_dashboard=False, log_to_driver=False,
                         configure_logging=False)
            else:
                hp = _host_port(address)
                if hp is not None and hp[0] in ("127.0.0.1", "localhost", "::1"):
                    loopback_only()  # else Ray rewrites the loopback address into this machine's network one
                try:
                    ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
                except ConnectionError as exc:  # a gRPC server that is not (or not this version's) Ray
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    raise ClusterUnreachableError(f"cannot join the Ray cluster at {address} ({first}): "
                                                  f"{_CHOOSE}") from None
            for sig, handler in saved.items():
                if handler is not None:
                    signal.signal(sig, handler)
        return max(1, int(ray.cluster_resources().get("CPU", 1)))

    @staticmethod
    def node_cpus() -> int:
        """CPUs of the largest live node of the cluster (a task can reserve no more)."""
        cpus = [n.get("Resources", {}).get("CPU", 0) for n in ray.nodes() if n.get("Alive")]
        return max(1, int(max(cpus, default=1)))

    def map(self, job: TensorMap) -> list[tuple[int, float, float]]:
        """Map a pass's float tensors onto Ray tasks that read their inputs and write their output
        themselves (shared storage, ``job.parts``); the driver reads no float tensor.

        In canonical order on the driver: ``job.hook(name)``, then by ``job.placement(name)``: a
        ``driver`` tensor (frozen) is loaded and written here (``job.load`` / ``job.work``), a
        ``remote`` one joins the current task group, a ``skip`` one (a tied alias) is written by its
        primary's task. With an ``s3://`` output (``job.parts.s3``) a task owns whole shards
        instead (:func:`shard_owners`; ``group_bytes`` is not used): it is submitted once the driver
        has seen every tensor of its shards, and it also copies their frozen tensors (the driver
        only checks them). Each task returns a :class:`~.parts.PartResult` (metadata only): its
        statistics go to ``job.sinks.stats``, its digests to ``job.digests``, its written tensors to
        the model writer's account. ``job.threads``, ``prefetch`` and ``budget`` are the local
        executor's and are not used.

        Returns:
            ``(bytes, seconds, cpu seconds)`` of each task (also kept in :attr:`tasks`).

        Raises:
            The first task's error (its original type where Ray can keep it); the tasks still
            queued are cancelled. Nothing is committed here. MergestreamError: a pass without
            ``job.parts``.
        """
        if job.parts is None:
            raise MergestreamError("the Ray executor needs a pass that plans its parts (shared-storage output)")
        names, load, work, sinks, size_of = job.names, job.load, job.work, job.sinks, job.nbytes
        progress, hook = job.progress, job.hook
        place = job.placement or (lambda name: "remote")
        cpus = self.connect()
        total = sum(size_of(n) for n in names)
        target = group_target(total, cpus, self.group_bytes)
        limit = IN_FLIGHT_PER_CPU * cpus
        # a task asks for the CPUs it computes on (the driver's intra-op threads, pinned for the same
        # bytes), at most a node's: more threads than reserved cores thrash (LAPACK under contention
        # ran 3-10x slower with 2 tasks x 2 threads on 2 cores)
        task_cpus = max(1, min(int(job.spec.torch_threads), self.node_cpus()))
        task = ray.remote(run_part).options(num_cpus=task_cpus, max_retries=self.max_retries, retry_exceptions=False)
        spec_ref = ray.put(job.spec)
        plan_ref = ray.put(job.parts)
        pending: deque = deque()
        self.tasks = []
        self.received_bytes = 0
        job.digests[:] = [{} for _ in range(job.spec.expert_count)]
        job.partials.clear()
        group: list[str] = []
        size = 0
        # s3:// output: a task owns whole shards (their staging objects), frozen tensors included;
        # it is submitted once the driver has seen every tensor of its shards
        owners = shard_owners(job.parts.model, job.spec.aliases) if job.parts.s3 is not None else None
        owned: dict[int, list[str]] = {}
        frozen: dict[int, set[str]] = {}
        left: dict[int, int] = {}
        if owners is not None:
            for name in names:
                if place(name) != "skip":
                    left[owners[name]] = left.get(owners[name], 0) + 1

        def submit(index: int | None = None) -> None:
            nonlocal group, size
            if index is not None:  # an owner's shards
                mine = owned.pop(index)
                pending.append((task.remote(spec_ref, index, mine, plan_ref, self.task_hook,
                                            frozenset(frozen.pop(index, ()))),
                                mine, sum(size_of(n) for n in mine)))
                return
            if group:
                index = len(self.tasks) + len(pending)
                pending.append((task.remote(spec_ref, index, group, plan_ref, self.task_hook),
                                group, size))
                group, size = [], 0

        def drain_one() -> None:
            ref, group_names, nbytes = pending.popleft()
            res: PartResult = _result(ref)
            self.received_bytes += len(pickle.dumps(res, protocol=pickle.HIGHEST_PROTOCOL))
            for stats, numel, nb in res.stats:
                sinks.stats.add(stats, numel, nb)
            for mine, theirs in zip(job.digests, res.digests):
                mine.update(theirs)
            job.partials.update(res.partials)
            sinks.writer.mark_written(res.written, res.bytes_written)
            self.tasks.append((nbytes, res.seconds, res.cpu_seconds))
            if progress is not None:
                for n in group_names:
                    progress.advance(size_of(n))

        try:
            for name in names:
                if hook is not None:
                    hook(name)
                where = place(name)
                if where == "skip":
                    continue
                if owners is not None:
                    owner = owners[name]
                    if where == "driver":
                        load(name)  # the frozen check; the owner copies θ₀'s tensor
                        frozen.setdefault(owner, set()).add(name)
                    owned.setdefault(owner, []).append(name)
                    left[owner] -= 1
                    if not left[owner]:
                        submit(owner)
                elif where == "driver":
                    item = load(name)
                    if item is not None:
                        work(name, item)
                    continue
                else:
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
            if pending:  # until their workers are gone: none writes after the caller cleans up
                ray.wait([ref for ref, _, _ in pending], num_returns=len(pending), timeout=30)
            raise
        log.info("ray fold tasks=%d cpus=%d task_seconds=%.2f received_bytes=%d", len(self.tasks), cpus,
                 sum(t[1] for t in self.tasks), self.received_bytes)
        return list(self.tasks)

    def __repr__(self) -> str:
        return f"RayExecutor(address={self.address!r})"
