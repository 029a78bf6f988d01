"""Executors of a pass's per-tensor map: local threads (the default, :class:`LocalExecutor` on
:func:`~mergestream.engine.stream.run_stream`) or a Ray cluster (the optional extra
``mergestream[ray]``; :mod:`.ray_cluster`, the only module that imports ``ray``). Both implement
the :class:`Executor` protocol: the fold and the offline merge describe their map as a
:class:`TensorMap` and hand it to ``options.executor.map`` (:class:`~mergestream.engine.options.ExecOptions`).

Design: the driver (the process calling :func:`mergestream.engine.fold`) plans the output, reads the
expert in canonical order (its content hash, the frozen-tensor checks, tied tensors), folds the
frozen (integer) tensors itself, and commits the output, the state and the manifest exactly as the
local fold does. Ray tasks take groups of float tensors (consecutive in canonical order, about
``total / (4 · cluster CPUs)`` bytes each), open θ₀, θ_{t−1}, the expert and the state folder from
their paths (storage every worker reaches: a shared filesystem; ``s3://`` inputs are not read by
tasks), run the same :class:`~mergestream.engine.fold_tensor.TensorFolder` as the local path with
recording writers, and return what it wrote (tensors and residual bytes). The driver replays the
recordings in canonical order onto the real writers, so the output, the state file and the
residual file are the bytes of a local fold with ``threads=1``. The expert is read twice in Ray
mode (once by the driver for the hash, once by the task).

Per-policy handling of state that spans folds or tensors:

* Task Arithmetic, TIES, MagMax, SAFE-Merge, DOP, LiNeS-wrapped policies: per-tensor math and
  per-tensor state only; the task reads the tensor's previous state from the state folder.
* OPCM: its running scale (``norms``, ``lams``, ``lam``) is kept per tensor in the state; a task reads
  the tensor's entry and returns the new one: correct whatever the grouping.
* MDM-OC: its bases are per tensor (as above). With ``coefficients=cmaes`` the tasks write only the
  state; the CMA-ES search over α and the rewrite of the output from the state run on the driver
  after the map, as in the local fold (the search needs every tensor).

Byte identity: tasks pin torch's intra-op thread count to the driver's
(:attr:`~mergestream.engine.fold_tensor.FoldSpec.torch_threads`), so reductions split the same way. A task
that fails raises on the driver (the fold then leaves no output and an unchanged state folder); a
task whose worker process dies is retried by Ray (``max_retries``).
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
