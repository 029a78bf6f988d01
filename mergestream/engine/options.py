"""How a pass runs, apart from what it computes: one record for the fold, the merge and the unmerge.

:class:`ExecOptions` gathers the execution settings (math device, worker threads, output shard
cap, where the per-tensor map runs, progress bar, overwriting the output) that
:func:`~mergestream.engine.fold`, :func:`~mergestream.engine.merge` and :func:`~mergestream.engine.unmerge`
take as one ``options`` argument. None of them changes the bytes a pass writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..io.checkpoints import DEFAULT_SHARD_BYTES
from .executors import Executor, LocalExecutor


@dataclass(frozen=True)
class ExecOptions:
    """Execution options of a fold, merge or unmerge (frozen; build once, pass whole).

    Attributes:
        device: where the math runs: ``"cpu"``, ``"cuda"`` or ``"cuda:<i>"`` (tensors are streamed
            from CPU memory); resolved by :func:`~mergestream.engine.resolve_device` when a pass
            starts (an unavailable device raises there).
        threads: local worker threads for the per-tensor map (a count); None or 0: the usable
            cores, at most 4 (:func:`~mergestream.engine.stream.default_threads`). Peak memory grows
            by a few tensors per thread.
        max_shard_bytes: cap of each output ``.safetensors`` shard, in bytes (> 0).
        executor: where the float tensors' map runs (:class:`~mergestream.engine.executors.Executor`):
            the local worker threads (the default) or a Ray cluster
            (:func:`~mergestream.engine.executors.make_executor`); the output is the same bytes.
            Replay's folds use it; subtract-unmerge always runs on local threads.
        progress: show a progress bar (on a terminal only).
        overwrite: replace an existing output folder instead of raising OutputExistsError.

    Raises:
        TypeError: ``executor`` is not an :class:`~mergestream.engine.executors.Executor` (e.g. None).
    """

    device: str = "cpu"
    threads: int | None = 1
    max_shard_bytes: int = DEFAULT_SHARD_BYTES
    executor: Executor = field(default_factory=LocalExecutor)
    progress: bool = False
    overwrite: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.executor, Executor):
            raise TypeError(f"ExecOptions.executor must be an Executor (LocalExecutor(), make_executor(...)), "
                            f"not {self.executor!r}")


#: the options of a call that passes none
DEFAULT_OPTIONS = ExecOptions()
