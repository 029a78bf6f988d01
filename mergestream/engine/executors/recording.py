"""Recording writers: what a remote fold task writes, captured as data and replayed by the driver.

A task runs :class:`~mergestream.engine.fold_tensor.TensorFolder` with a :class:`Recorder`'s sinks; the
recorder keeps every write in call order (output tensors, state fields, residual reservations and
byte ranges, statistics). :func:`replay` performs them on the driver's real writers in the same
order, mapping the residual file's offsets, so the files are the bytes the local path writes.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

from ..fold_tensor import FoldSinks
from ..passes import Stats
from ..residuals import ResidualWriter


class _Model:
    def __init__(self, ops: list, kind: str):
        self._ops, self._kind = ops, kind

    def write(self, name: str, tensor: torch.Tensor) -> None:
        # a copy: the folder may hand out a per-thread scratch buffer it reuses for the next tensor
        self._ops.append((self._kind, name, tensor.clone()))


class _Append:
    """The :class:`~mergestream.io.writers.AppendWriter` calls a residual writer makes, recorded with
    offsets in a task-local data region."""

    def __init__(self, ops: list):
        self._ops = ops
        self._offset = 0

    def reserve(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        start = self._offset
        self._ops.append(("reserve", name, tuple(shape), dtype, start))
        n = dtype.itemsize
        for d in shape:
            n *= d
        self._offset += n
        return start

    def write_range(self, data_start: int, data) -> None:
        self._ops.append(("range", data_start, bytes(memoryview(data).cast("B"))))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self._ops.append(("cwrite", name, tensor.clone()))  # a copy, as _Model.write


class _Residuals(ResidualWriter):
    """A :class:`~mergestream.engine.residuals.ResidualWriter` whose file is a recording."""

    def __init__(self, ops: list):  # no file: the base class's writer is replaced by a recording
        self._w = _Append(ops)


class _Stats(Stats):
    def __init__(self, ops: list):
        super().__init__()
        self._ops = ops

    def add(self, stats: dict[str, float], numel: int, nbytes: int) -> None:
        self._ops.append(("stats", {k: float(v) for k, v in stats.items()}, numel, nbytes))


class Recorder:
    """Sinks that record (see the module docstring). ``ops``: the recorded calls, picklable."""

    def __init__(self, with_residuals: bool):
        self.ops: list[tuple] = []
        self.sinks = FoldSinks(_Model(self.ops, "model"), _Model(self.ops, "state"),
                               _Residuals(self.ops) if with_residuals else None, _Stats(self.ops))


def replay(ops: list[tuple], sinks: FoldSinks) -> None:
    """Perform recorded calls on the real sinks, in order.

    Raises:
        ValueError: a byte range outside every reserved residual (a recording out of order).
    """
    starts: list[int] = []
    reals: list[int] = []
    contrib: Any = sinks.contrib
    for op in ops:
        kind = op[0]
        if kind == "model":
            sinks.writer.write(op[1], op[2])
        elif kind == "state":
            sinks.state_writer.write(op[1], op[2])
        elif kind == "stats":
            sinks.stats.add(op[1], op[2], op[3])
        elif kind == "reserve":
            starts.append(op[4])
            reals.append(contrib._w.reserve(op[1], op[2], op[3]))
        elif kind == "range":
            i = bisect.bisect_right(starts, op[1]) - 1
            if i < 0:
                raise ValueError(f"residual bytes at {op[1]} before any reserved tensor")
            contrib._w.write_range(reals[i] + op[1] - starts[i], op[2])
        elif kind == "cwrite":
            contrib._w.write(op[1], op[2])
