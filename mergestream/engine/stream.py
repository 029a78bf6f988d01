"""The one streaming skeleton every pass over a model uses: load in order, map per tensor, write.

Fold, offline merge, unmerge, replay (a sequence of folds), the coefficient rewrite and the copy
of θ₀ all run through :func:`run_stream`:

1. **plan** (the caller): the output's tensors, shapes and dtypes are known from headers, so the
   output and state writers are created before any data is read;
2. **load**, in one thread and in a fixed order (the canonical name order of
   :func:`mergestream.io.st.name_order`): read the tensors a job needs, and do what must see the bytes
   in order (the expert's content hash, :class:`ExpertReader`);
3. **map**: ``work(name, item)`` on ``threads`` worker threads (math and ``pwrite``; torch and the
   OS release the GIL), overlapping with the loading of the next tensors;
4. **commit** (the caller): close the writers, rename the staged output into place.

Memory is bounded: at most ``threads + prefetch`` jobs are alive (loaded and not yet finished),
each holding the tensors its loader read. The first error (from the loader or a worker) stops the
loading, waits for the jobs in flight and is raised; nothing is committed by this module.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch

from ..io import st
from ..io.checkpoints import Checkpoint, TensorMeta

#: elements per chunk of the element-wise fast paths (float32 temporaries of 4 MiB)
CHUNK_ELEMENTS = 1 << 20


def default_threads() -> int:
    """Worker threads when the user does not say: the usable cores, at most 4."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


class Progress:
    """A progress bar (bytes and tensors, rate, ETA) on a terminal; silent otherwise.

    Uses tqdm. Shown only when ``enabled`` and standard error is a terminal.

    Args:
        total_bytes: bytes the pass will process (for rate and ETA). tensors: tensor count.
        desc: the label (e.g. ``fold sst2``). enabled: False for ``--quiet`` or library use.
    """

    def __init__(self, total_bytes: int, tensors: int, desc: str, enabled: bool):
        self._bar = None
        self._tensors = tensors
        self._done = 0
        self._lock = threading.Lock()
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                             leave=False, dynamic_ncols=True, file=sys.stderr)

    def advance(self, nbytes: int) -> None:
        """One tensor of ``nbytes`` finished."""
        if self._bar is None:
            return
        with self._lock:
            self._done += 1
            self._bar.set_postfix_str(f"{self._done}/{self._tensors} tensors", refresh=False)
            self._bar.update(nbytes)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class _Slots:
    """Admission of jobs: at most ``count`` alive, and (with a ``budget``) their summed cost within
    it, except that a job is always admitted when none is alive (a tensor above the budget runs
    alone)."""

    def __init__(self, count: int, budget: int | None):
        self._cond = threading.Condition()
        self._count = count
        self._budget = budget
        self._alive = 0
        self._cost = 0

    def acquire(self, cost: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._alive == 0 or (
                self._alive < self._count and (self._budget is None or self._cost + cost <= self._budget)))
            self._alive += 1
            self._cost += cost

    def release(self, cost: int) -> None:
        with self._cond:
            self._alive -= 1
            self._cost -= cost
            self._cond.notify_all()


def run_stream(names: Iterable[str], load: Callable[[str], Any], work: Callable[[str, Any], None], *,
               threads: int = 1, prefetch: int = 1, progress: Progress | None = None,
               sizes: Callable[[str], int] | None = None, release: Callable[[Any], None] | None = None,
               budget: int | None = None) -> None:
    """Load tensors in order on the calling thread and map ``work`` over them on worker threads.

    Args:
        names: tensor names, in the order ``load`` must see them.
        load: ``load(name) -> item`` (I/O, ordered side effects). An item of ``None`` means there is
            nothing to do for that tensor (it is not passed to ``work``).
        work: ``work(name, item)``: compute and write one tensor; runs on ``threads`` workers.
        threads: worker threads (>= 1). prefetch: jobs loaded ahead of the workers (>= 0); at most
            ``threads + prefetch`` jobs are alive at once.
        progress: advanced by ``sizes(name)`` bytes per finished tensor.
        release: called with each item once its job is over (e.g. to return pooled buffers).
        budget: bytes (of ``sizes``) the jobs alive may hold together; a larger tensor runs alone.
            Bounds the memory of policies whose temporaries are several copies of each tensor
            while small tensors still run in parallel.

    Raises:
        The first exception of ``load`` or ``work``; the jobs in flight are finished or abandoned
        first (no worker is left running).
    """
    threads = max(1, threads)
    slots = _Slots(threads + max(0, prefetch), budget)
    cost = (lambda n: sizes(n)) if sizes is not None and budget is not None else (lambda n: 0)
    failed: list[BaseException] = []
    pending: list[Future] = []

    def job(name: str, box: list, c: int) -> None:
        # the item comes in a box the job empties: once its slot is free the loader reads the next
        # tensor, and nothing may still hold this one then (the executor keeps a job's arguments)
        item = box.pop()
        try:
            if not failed:
                work(name, item)
            if progress is not None and sizes is not None:
                progress.advance(sizes(name))
        except BaseException as exc:  # noqa: BLE001 - re-raised by the loader thread
            failed.append(exc)
        finally:
            if release is not None:
                release(item)
            del item
            slots.release(c)

    with ThreadPoolExecutor(threads, thread_name_prefix="mergestream-fold") as pool:
        try:
            for name in names:
                c = cost(name)
                slots.acquire(c)
                if failed:
                    slots.release(c)
                    break
                try:
                    item = load(name)
                except BaseException:
                    slots.release(c)
                    raise
                if item is None:
                    slots.release(c)
                    if release is not None:
                        release(item)
                    if progress is not None and sizes is not None:
                        progress.advance(sizes(name))
                    continue
                pending.append(pool.submit(job, name, [item], c))
                del item  # the job's alone now: freed when it ends, not when the next tensor is read
                pending = [f for f in pending if not f.done()]
        except BaseException as exc:
            failed.append(exc)
        for f in pending:
            f.result()
    if failed:
        raise failed[0]


class ExpertReader:
    """Read an expert's tensors in canonical name order and hash them on the way.

    Every tensor of the expert is fed to :class:`mergestream.io.st.WeightsHash` as it is read, so the
    content hash costs no extra pass; :meth:`sha256` is available once every tensor was read.
    For a checkpoint without raw entries (a legacy pickle) the hash is the file hash, read once
    up front. Counts the bytes it read (``bytes_read``) for the tests that check a single pass.
    """

    def __init__(self, ckpt: Checkpoint, buffers: int = 0):
        self.ckpt = ckpt
        self.bytes_read = 0
        self._hash = st.WeightsHash(len(ckpt.keys())) if ckpt.raw else None
        self._sha = None if ckpt.raw else ckpt.sha256()
        self._pool = BufferPool(buffers, max((m.nbytes for m in ckpt.metas()), default=0)) if buffers and ckpt.raw \
            else None

    def order(self) -> list[str]:
        """Every tensor name of the expert, in the order :meth:`read` must be called."""
        return st.name_order(self.ckpt.keys())

    def read(self, name: str) -> torch.Tensor:
        """The tensor's stored value (CPU, stored dtype and shape), hashed on the way.

        In fresh memory, or, with ``buffers``, in a pooled buffer the caller hands back with
        :meth:`release` once done (a reused buffer costs no page faults).
        """
        m: TensorMeta = self.ckpt.meta(name)
        if self._pool is not None:
            t = self.ckpt.read_into(name, self._pool.take(m.nbytes)).view(m.dtype).reshape(m.shape)
        else:
            t = self.ckpt.get(name)
        self.bytes_read += m.nbytes
        if self._hash is not None:
            self._hash.begin(self.ckpt.entry(name))
            if m.nbytes:
                self._hash.data(t.reshape(-1).view(torch.uint8).numpy())
        return t

    def release(self, t: torch.Tensor | None) -> None:
        """Hand back a tensor :meth:`read` returned (no-op without a pool)."""
        if self._pool is not None and t is not None:
            self._pool.give(t)

    def sha256(self) -> str:
        """The expert's content hash (raises FormatError if some tensor was not read)."""
        if self._sha is None:
            self._sha = self._hash.hexdigest()
        return self._sha


@contextmanager
def shared_cores(workers: int, device: torch.device | str = "cpu") -> Iterator[None]:
    """While ``workers`` threads each run whole-tensor math (matmuls, SVDs), give each its share of
    torch's intra-op threads (``torch.get_num_threads() // workers``, at least 1), then restore it.

    Otherwise every worker's matmul spawns torch's full thread team: ``workers`` × cores threads on
    the cores. Measured on 2 cores, SAFE-Merge on four 2048×5504 tensors: 8.4 s with 2 workers × 2
    intra-op threads, 5.8 s with 2 × 1. A no-op for one worker or a non-CPU device.
    """
    if workers <= 1 or torch.device(device).type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, before // workers))
    try:
        yield
    finally:
        torch.set_num_threads(before)


_local = threading.local()


def scratch(slot: str, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A per-thread reusable flat buffer of ``numel`` elements (a view of one that only grows),
    named by ``slot``: the same thread gets the same memory back for the same slot.

    Fresh tensor-sized buffers cost page faults and zeroing (the mmap threshold is pinned, see
    :mod:`mergestream.engine._alloc`), several times the arithmetic done in them: on this project's VM
    a fresh float32 copy of an 11M-element tensor took 25 ms, a copy into reused memory 3 ms.
    The caller must be done with a slot's contents before its thread asks for the slot again,
    and must not hand the buffer to anything that outlives the job (copy it instead).
    """
    device = torch.device(device)
    key = (slot, dtype, device)
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    buf = bufs.get(key)
    if buf is None or buf.numel() < numel:
        buf = None
        bufs.pop(key, None)  # drop the old one before the larger one is made
        buf = bufs[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def policy_scratch(slot: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """:func:`scratch` for a policy's temporaries (``TensorContext.buffers``), in slots of their own
    so that they never share memory with the engine's (``base``, ``tau``, ...)."""
    return scratch(f"policy:{slot}", numel, dtype, device)


def read_scratch(ck: Checkpoint, name: str, slot: str) -> torch.Tensor:
    """Tensor ``name`` of ``ck`` as stored (CPU, its dtype and shape) in this thread's :func:`scratch`
    buffer ``slot`` (valid until the thread reads into that slot again)."""
    m = ck.meta(name)
    return ck.read_into(name, scratch(slot, m.nbytes, torch.uint8)).view(m.dtype).view(m.shape)


def float32_scratch(ck: Checkpoint, name: str, slot: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """Tensor ``name`` of ``ck`` widened to float32 on ``device``, in this thread's scratch (slots
    ``slot`` and ``slot + ".raw"``); read straight into the float32 buffer when stored as float32."""
    raw = read_scratch(ck, name, slot + ".raw")
    if raw.dtype == torch.float32 and torch.device(device).type == "cpu":
        return raw
    return scratch(slot, raw.numel(), torch.float32, device).view(raw.shape).copy_(raw)


def clear_scratch() -> None:
    """Free this thread's :func:`scratch` buffers (a thread that lives on after its fold)."""
    _local.bufs = {}


class BufferPool:
    """At most ``count`` reusable byte buffers of ``nbytes`` each, handed out and back by threads.

    :meth:`take` blocks while all are out; callers bound how many they hold (``run_stream``'s
    slots), so ``count`` >= the number of jobs alive never blocks for long.
    """

    def __init__(self, count: int, nbytes: int):
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self._made = 0
        self._count = count
        self._nbytes = nbytes
        self._lock = threading.Lock()
        self._mine: dict[int, torch.Tensor] = {}

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat ``uint8`` tensor of exactly ``nbytes`` (a view of a pooled buffer)."""
        with self._lock:
            make = self._free.empty() and self._made < self._count
            if make:
                self._made += 1
        if make:
            buf = torch.empty(self._nbytes, dtype=torch.uint8)
            with self._lock:
                self._mine[buf.data_ptr()] = buf
        else:
            buf = self._free.get()
        return buf[:nbytes]

    def give(self, t: torch.Tensor) -> None:
        """Return a tensor obtained from :meth:`take` (or any view of it starting at its start)."""
        with self._lock:
            buf = self._mine.get(t.data_ptr())
        if buf is not None:
            self._free.put(buf)
