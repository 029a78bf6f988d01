"""The engine's public face: fold, merge, unmerge, inspect, on the streaming skeleton of :mod:`.stream`.

- :func:`fold` folds one expert into the backbone (θ_t = θ_{t−1} + Δ_t) and :func:`merge` merges
  K experts offline; both live in :mod:`.folding`.
- :func:`unmerge` removes one expert (``subtract`` or ``replay``), in :mod:`.unmerge`;
  :func:`copy_base` writes θ₀ itself as a backbone.
- :func:`task_vector_stats`, :func:`describe` and :func:`resolve_device` (for ``inspect`` and the
  ``--device`` option) live in :mod:`.inspection`.
- :class:`ExecOptions` (:mod:`.options`) is how a fold, merge or unmerge runs (device, threads,
  shard cap, executor, progress, overwrite), passed whole as ``options=``; its ``executor`` is an
  :class:`Executor` (:mod:`.executors`): :class:`LocalExecutor` threads, or Ray from :func:`make_executor`.

The pieces every pass shares (the report, the expert loader, casting and writing a result) are in
:mod:`.passes`. Dependencies run one way: cli -> daemon -> engine -> (folding, unmerge) -> passes
-> policies, checkpoints, writers, stream.
"""

from __future__ import annotations

from .executors import Executor, LocalExecutor, make_executor
from .folding import Objective, fold, merge
from .inspection import describe, resolve_device, task_vector_stats
from .options import ExecOptions
from .passes import FoldReport, copy_base
from .unmerge import replay_work_dir, unmerge

__all__ = ["ExecOptions", "Executor", "FoldReport", "LocalExecutor", "Objective", "copy_base", "describe", "fold",
           "make_executor", "merge", "replay_work_dir", "resolve_device", "task_vector_stats", "unmerge"]
