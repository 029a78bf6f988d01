"""Executors of a pass's per-tensor map: local threads (the default, :class:`LocalExecutor` on
:func:`~mergestream.engine.stream.run_stream`) or a Ray cluster (the optional extra
``mergestream[ray]``; :mod:`.ray_cluster`, the only module that imports ``ray``). Both implement
the :class:`Executor` protocol: the fold and the offline merge describe their map as a
:class:`TensorMap` and hand it to ``options.executor.map`` (:class:`~mergestream.engine.options.ExecOptions`).

Design (issue 37): the driver (the process calling :func:`mergestream.engine.fold`) plans the output
(the staged shards with their headers, :meth:`~mergestream.io.writers.ModelWriter.plan`), reads the
expert's headers, folds the frozen (integer) tensors itself, and commits exactly once: the shards'
final metadata, the index, the state manifest and, in the daemon, fold.json and ``current``. Ray
tasks take groups of float tensors (consecutive in canonical order, about ``total / (4 · cluster
CPUs)`` bytes each, :func:`.ray_cluster.group_target`); each opens θ₀, θ_{t−1}, the expert and the
state folder from their paths (storage every worker reaches: a shared filesystem, or ``s3://``
inputs through the existing readers), runs the same
:class:`~mergestream.engine.fold_tensor.TensorFolder` as the local path, and writes (:mod:`.parts`):
its tensors' bytes at their planned offsets in the staged shards, its tensors' policy state and
residuals as pieces of their own (``part-NNNNN.safetensors`` in the state's and the residual's
pieces folders, :meth:`~mergestream.io.state.StateDir.new_pieces`). A task returns metadata only
(:class:`.parts.PartResult`: names, one 32-byte digest per expert tensor it read, the policy's
statistics; about 1 KB per task, ``RayExecutor.received_bytes``). The driver combines the digests
into the expert's content hash (:meth:`~mergestream.engine.passes.ExpertLoader.sha256_from`, weights
hash version 2), so the expert is read once per fold, by the tasks. A failed or lost task leaves
nothing the commit can see (the staged folder and the ``.tmp`` pieces folders are discarded); a
retried task rewrites its own byte ranges and its own pieces. Output files are the bytes of a local
fold; the state and residual hold the same keys, bytes and metadata, as pieces folders.

What travels per policy (driver ⇄ tasks; never a tensor):

* Task Arithmetic, TIES, MagMax, SAFE-Merge, DOP, Iso-C, LiNeS-wrapped policies: per-tensor math and
  per-tensor state only. Down: the spec (policy, paths, fold index, earlier coefficients) once per
  fold; up: names, digests, statistics.
* OPCM: its running scale (``norms``, ``lams``, ``lam``) is kept per tensor in the state; a task
  reads the tensor's entry from the state folder and writes the new one into its piece: correct
  whatever the grouping. With ``scope=global`` (one λ_t for the whole model) a second map's tasks
  read their tensors' new state and return its partial sums (``[‖M_t‖², ‖τ_1‖², …]``, a few floats
  per tensor: :meth:`~mergestream.policies.base.Policy.scale_partial`); the driver finishes λ_t in
  θ₀'s order (the very floats of the local reduction) and a third map's tasks write θ₀ + λ_t M_t
  (:mod:`mergestream.engine.rebuild`). The driver reads no state.
* MDM-OC: its bases are per tensor (as above). With ``coefficients=cmaes`` the tasks write only the
  state; the CMA-ES search over α (its objective evaluates whole models) runs on the driver after
  the map, as in the local fold, reading the state pieces; the output at the chosen α is written by
  a rebuild map's tasks.
* AdaMerging coefficients: the same: tasks write the state, the driver learns the per-layer α from
  it and rewrites the state; tasks write the output.

Output to a bucket (``out="s3://bucket/root/"``, :mod:`mergestream.io.s3_output`): the plan gives
each task whole shards (:func:`.ray_cluster.shard_owners`: one shard, or the shards a tied pair
spans), frozen tensors included (copied from θ₀ by the task, checked on the driver); the task
spools each shard's data locally and uploads it as one staging object, overwritten by a retry. The
driver plans the headers in a local folder and assembles each final shard with one multipart upload
(the final header and the first part's bytes through it: at most 5 MiB each way per shard; the rest
server-side copies), then uploads the index and the aux files, and after the state's commit
replaces ``current``. The state folder stays on a filesystem; a policy whose output the driver
rewrites after the map (a coefficient search, OPCM ``scope=global``) stages nothing: the driver
uploads the shards it wrote, as the local executor's output is uploaded.

Byte identity: tasks pin torch's intra-op thread count to the driver's
(:attr:`~mergestream.engine.fold_tensor.FoldSpec.torch_threads`), so reductions split the same way,
and reserve that many CPUs (at most a node's). A task that fails raises on the driver (the fold then
leaves no output and an unchanged state folder); a task whose worker process dies is retried by Ray
(``max_retries``). Connecting never hangs: an address that does not answer within
``connect_timeout`` s is refused by name (:func:`.ray_cluster.check_reachable`), and with no address a
local instance bound to 127.0.0.1 is started explicitly, never the one Ray's pointer file remembers.
"""

from __future__ import annotations

from typing import Any

from ...errors import MergestreamError
from .base import Executor, LocalExecutor, TensorMap

#: executor kinds accepted by the CLI (``--executor``) and the daemon config (``executor.kind``)
KINDS = ("local", "ray")


def make_executor(kind: str = "local", address: str | None = None, **options: Any) -> Executor:
    """The executor for ``kind``: a :class:`LocalExecutor` for ``local`` (the engine's own threads),
    a :class:`~mergestream.engine.executors.ray_cluster.RayExecutor` for ``ray``.

    Args:
        kind: ``local`` or ``ray``. address: the Ray cluster (``auto``, ``ray://host:10001``,
            ``host:6379``); None starts a local Ray instance, or joins the one ``RAY_ADDRESS`` names.
        options: passed to :class:`RayExecutor` (``num_cpus``, ``group_bytes``, ``max_retries``).

    Raises:
        MergestreamError: unknown kind, or ``ray`` without the ``ray`` package installed.
    """
    if kind == "local":
        return LocalExecutor()
    if kind != "ray":
        raise MergestreamError(f"unknown executor {kind!r}; known: {', '.join(KINDS)}")
    try:
        from .ray_cluster import RayExecutor
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise MergestreamError("executor ray needs the ray extra: pip install -c constraints.txt -e '.[ray]' "
                               "from the checkout") from exc
    return RayExecutor(address, **options)


__all__ = ["KINDS", "Executor", "LocalExecutor", "TensorMap", "make_executor"]
