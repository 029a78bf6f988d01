"""One tensor of a fold: θ_t = cast(θ_{t−1} + Δ_t), the policy state update and the residual.

The per-tensor map of :func:`mergestream.engine.folding.fold`, in one place for both executors: the local
one calls a :class:`TensorFolder` from its worker threads with the real writers; the Ray executor
(:mod:`mergestream.engine.executors`) rebuilds the same :class:`TensorFolder` in a task from a picklable
:class:`FoldSpec` (paths on storage every worker reaches) and hands it writers onto that storage
(:mod:`mergestream.engine.executors.parts`). Same code, same inputs, same bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..io.checkpoints import Checkpoint, check_finite_tensor, is_embedding_name, is_float_dtype, open_checkpoint
from ..io.expert_readers import DenseExpert, open_expert
from ..io.state import SEP, StateDir
from ..policies import Policy, TensorContext
from ..policies.lines import block_count
from . import linear_fold
from .passes import (
    Stats,
    cast_checked,
    open_base_and_backbone,
    seed_of,
    write_with_aliases,
)
from .stream import policy_scratch, read_scratch, scratch


@dataclass
class FoldSinks:
    """Where one tensor's fold goes: the output model (``write(name, tensor)``), the state file
    (``write(key, tensor)``), the residual writer (:class:`~mergestream.engine.residuals.ResidualWriter`
    API, or None when the policy keeps its contributions in its state) and the statistics."""

    writer: Any
    state_writer: Any
    contrib: Any
    stats: Stats


class TensorFolder:
    """Fold one float tensor (see the module docstring); thread-safe.

    Args:
        pol: the policy. base_ck / cur: θ₀ and θ_{t−1} (the same object at the first fold).
        exp: the expert (dense or LoRA, :mod:`mergestream.io.expert_readers`).
        read_state: ``name -> {field: tensor}``, the tensor's policy state before this fold.
        aliases: θ₀'s kept ties ``{alias: primary}``. where: the expert's description for errors.
        n_prev / prev_coeffs: folds before this one and their coefficients. dev: the math device.
        tensor_hook: called with each tensor name before it is folded.
    """

    def __init__(self, pol: Policy, base_ck: Checkpoint, cur: Checkpoint, exp, read_state: Callable,
                 aliases: dict[str, str], where: str, n_prev: int, prev_coeffs: tuple, dev: torch.device,
                 tensor_hook: Callable[[str], None] | None = None):
        self.pol, self.base_ck, self.cur, self.exp = pol, base_ck, cur, exp
        self.read_state, self.aliases, self.where = read_state, aliases, where
        self.n_prev, self.prev_coeffs, self.dev = n_prev, prev_coeffs, dev
        self.first = cur is base_ck
        # a coefficient search or a global scale writes the output once, after the pass, from the state
        self.search = pol.searches_coefficients() or pol.scales_globally()
        self.lin = pol.linear_scale() if isinstance(exp, DenseExpert) else None
        self.compiled = False
        if self.lin is not None:
            bf16 = sum(m.numel for m in base_ck.metas() if m.dtype == torch.bfloat16)
            # loaded here, before the workers start, so that they do not queue on the import
            self.compiled = linear_fold.compiled_loop_pays(bf16, dev, later=not self.first) and \
                linear_fold.load_compiled(torch.bfloat16, dev) is not None
        self.tensor_hook = tensor_hook
        self.n_blocks = block_count(base_ck.keys())
        self._lock = threading.Lock()

    def __call__(self, name: str, item: tuple[str, torch.Tensor | None], out: FoldSinks) -> None:
        """Fold tensor ``name``. ``item``: ``("frozen", θ₀'s tensor)`` (copied) or ``("float", e)``
        with ``e`` the expert's stored tensor in fresh or pooled memory (overwritten), None for LoRA.

        Raises:
            NonFiniteError: NaN/Inf in the expert, or the result overflows the storage dtype.
        """
        kind, e = item
        if self.tensor_hook is not None:
            self.tensor_hook(name)
        base_ck, cur, dev, first, contrib = self.base_ck, self.cur, self.dev, self.first, out.contrib
        meta = base_ck.meta(name)
        if kind == "frozen":
            write_with_aliases(out.writer, name, e, self.aliases)
            out.stats.add({}, meta.numel, meta.nbytes)  # θ₀'s copy (the expert's is counted by its reader)
            return
        if e is not None and self.lin is None:
            check_finite_tensor(name, e, self.where)
        if self.lin is not None:
            linear_fold.fold_linear(name, e, self.lin, base_ck, None if first else cur, dev, contrib, self.where,
                                    compiled=self.compiled)
            write_with_aliases(out.writer, name, e, self.aliases)
            out.stats.add({}, meta.numel, meta.nbytes * (1 if first else 2))  # θ₀ (and θ_{t−1})
            return
        # θ₀ and θ_{t−1} go into this thread's scratch buffers (stream.scratch: no fresh pages per
        # tensor); float32 on the CPU is read straight into the buffer the policy gets
        b_raw = read_scratch(base_ck, name, "base_raw")
        b = b_raw if _as_is(meta.dtype, dev) else scratch("base", meta.numel, torch.float32, dev).view(meta.shape).copy_(b_raw)
        # θ_{t−1} as stored is kept only when its residual is stored (not for policies whose
        # contributions live in their state), so memory stays at a few tensors
        prev_s = None
        if first:
            if contrib is not None:
                prev_s = b_raw  # θ₀ as stored (b is its exact float32 widening)
            # θ_{t−1} = θ₀: policies only read base and backbone, and θ₀ is not needed after the
            # policy, so the result is built in θ₀'s float32 buffer (one tensor-sized copy and
            # scratch buffer fewer per thread) unless that buffer is θ₀ as stored, kept for contrib
            bb = b if prev_s is not b else scratch("backbone", meta.numel, torch.float32, dev).view(meta.shape).copy_(b)
        else:
            prev_raw = read_scratch(cur, name, "prev_raw")
            if contrib is None and _as_is(meta.dtype, dev):
                bb = prev_raw
            else:
                bb = scratch("backbone", meta.numel, torch.float32, dev).view(meta.shape).copy_(prev_raw)
                prev_s = prev_raw if contrib is not None else None
        if e is None:  # LoRA: built from the factors
            tau = self.exp.task_vector(name, b).to(dev)
        elif _as_is(e.dtype, dev):  # float32 expert on the CPU: τ in the expert's own buffer
            tau = e.sub_(b)
        else:
            tau = scratch("tau", meta.numel, torch.float32, dev).view(meta.shape).copy_(e).sub_(b)
        if e is None:
            check_finite_tensor(name, tau, f"LoRA delta of {self.where}")
        del e
        with self._lock:
            st = {k: v.to(dev) for k, v in self.read_state(name).items()}
        ctx = TensorContext(name, self.n_prev, self.prev_coeffs, is_embedding_name(name), seed_of(name),
                            n_blocks=self.n_blocks, dtype=meta.dtype, buffers=policy_scratch)
        res = self.pol.fold_tensor(b, bb, tau, st, ctx)
        del b, tau
        if not self.search:  # a coefficient search writes the output once, from the state
            cast_into = None if _as_is(meta.dtype, dev) else scratch("result", meta.numel, meta.dtype).view(meta.shape)
            result = cast_checked(bb.add_(res.delta, alpha=res.scale), meta.dtype, name, out=cast_into)
            write_with_aliases(out.writer, name, result, self.aliases)
            if contrib is not None:
                contrib.add(name, result, prev_s)
        for k, v in res.state.items():
            out.state_writer.write(f"{name}{SEP}{k}", v.cpu())
        out.stats.add(res.stats, meta.numel, meta.nbytes * (1 if first else 2))  # θ₀ (and θ_{t−1})


def _as_is(dtype: torch.dtype, dev: torch.device) -> bool:
    """True when a stored tensor is already what the policy computes on (float32 on the CPU)."""
    return dtype == torch.float32 and dev.type == "cpu"


@dataclass
class FoldSpec:
    """A fold's per-tensor map as data (picklable), for an executor on other processes or hosts.

    Every path must be reachable by every worker (shared storage). ``backbone`` None: the first
    fold. ``torch_threads``: the intra-op thread count the driver folds with, pinned in the worker
    so that reductions split the same way (same bytes).
    """

    policy: Policy
    base: str
    backbone: str | None
    expert: str
    state_dir: str
    aliases: dict[str, str]
    where: str
    n_prev: int
    prev_coeffs: tuple
    device: str
    torch_threads: int
    #: experts the pass reads (their per-tensor digests come back from the tasks)
    expert_count: int = 1

    def open(self) -> tuple[TensorFolder, Callable[[], None]]:
        """The :class:`TensorFolder` on freshly opened inputs, and a function that closes them."""
        base_ck, cur = open_base_and_backbone(self.base, self.backbone)
        exp = open_expert(self.expert, base_ck)
        sd = StateDir(self.state_dir)
        folder = TensorFolder(self.policy, base_ck, cur, exp, sd.tensor_state, self.aliases, self.where,
                              self.n_prev, self.prev_coeffs, torch.device(self.device))

        def close() -> None:
            sd.close()
            exp.close()
            if cur is not base_ck:
                cur.close()
            base_ck.close()

        return folder, close

    def read_expert(self, folder: TensorFolder, name: str) -> tuple[str, torch.Tensor | None]:
        """The float tensor's item as the local loader gives it: the expert's stored tensor in fresh
        memory (dense), None (LoRA: the folder builds τ from the factors)."""
        exp = folder.exp
        return ("float", exp.ckpt.get(name) if isinstance(exp, DenseExpert) else None)

    def frozen_item(self, folder: TensorFolder, name: str) -> tuple[str, torch.Tensor]:
        """A frozen (integer) tensor's item: θ₀'s copy, as the local loader gives it."""
        return ("frozen", folder.base_ck.get(name))


class TensorMerger:
    """One tensor of the offline merge: θ = cast(θ₀ + policy.merge_tensor(θ₀, [τ₁..τ_K])); thread-safe.

    Args:
        pol: the policy. base_ck: θ₀. exps: the experts (dense or LoRA). wheres: their descriptions.
        aliases: θ₀'s kept ties. dev: the math device.
    """

    def __init__(self, pol: Policy, base_ck: Checkpoint, exps: list, wheres: list[str], aliases: dict[str, str],
                 dev: torch.device):
        self.pol, self.base_ck, self.exps, self.wheres, self.aliases, self.dev = pol, base_ck, exps, wheres, aliases, dev
        self.n_blocks = block_count(base_ck.keys())

    def __call__(self, name: str, items: list[tuple[str, torch.Tensor | None]], out: FoldSinks) -> None:
        """Merge tensor ``name``; ``items``: one ``(kind, tensor)`` per expert as for :class:`TensorFolder`.

        Raises:
            NonFiniteError: NaN/Inf in an expert, or the result overflows the storage dtype.
        """
        meta = self.base_ck.meta(name)
        if items[0][0] == "frozen":
            write_with_aliases(out.writer, name, items[0][1], self.aliases)
            return
        b = self.base_ck.get(name).to(self.dev, torch.float32)
        taus = []
        for (_, e), where, ex in zip(items, self.wheres, self.exps):
            if e is None:
                taus.append(ex.task_vector(name, b).to(self.dev))
                check_finite_tensor(name, taus[-1], f"LoRA delta of {where}")
            else:
                check_finite_tensor(name, e, where)
                taus.append(e.to(self.dev, torch.float32).sub_(b))
        ctx = TensorContext(name, 0, (), is_embedding_name(name), seed_of(name), n_blocks=self.n_blocks,
                            dtype=meta.dtype)
        result = cast_checked(b.add_(self.pol.merge_tensor(b, taus, ctx)), meta.dtype, name)
        write_with_aliases(out.writer, name, result, self.aliases)
        out.stats.add({}, meta.numel, meta.nbytes * (1 + len(self.exps)))


@dataclass
class MergeSpec:
    """An offline merge's per-tensor map as data (see :class:`FoldSpec`)."""

    policy: Policy
    base: str
    experts: list[str]
    wheres: list[str]
    aliases: dict[str, str]
    device: str
    torch_threads: int

    @property
    def expert_count(self) -> int:
        """Experts the pass reads."""
        return len(self.experts)

    def open(self) -> tuple[TensorMerger, Callable[[], None]]:
        """The :class:`TensorMerger` on freshly opened inputs, and a function that closes them."""
        base_ck = open_checkpoint(self.base)
        exps = [open_expert(e, base_ck) for e in self.experts]

        def close() -> None:
            for e in exps:
                e.close()
            base_ck.close()

        return TensorMerger(self.policy, base_ck, exps, self.wheres, self.aliases, torch.device(self.device)), close

    def read_expert(self, merger: TensorMerger, name: str) -> list[tuple[str, torch.Tensor | None]]:
        """The items the local loaders give for a float tensor (fresh memory; None for LoRA)."""
        return [("float", e.ckpt.get(name) if isinstance(e, DenseExpert) else None) for e in merger.exps]

    def frozen_item(self, merger: TensorMerger, name: str) -> list[tuple[str, torch.Tensor]]:
        """A frozen (integer) tensor's items: θ₀'s copy, as the local loaders give it."""
        return [("frozen", merger.base_ck.get(name))]


def placement(base_ck: Checkpoint, aliases: dict[str, str]) -> Callable[[str], str]:
    """Where a remote executor runs each tensor (:attr:`~mergestream.engine.executors.TensorMap.placement`):
    a tied alias is ``skip`` (written with its primary), a frozen (integer/bool) tensor ``driver``
    (copied from θ₀ there, after the frozen check), a float tensor ``remote``."""

    def place(name: str) -> str:
        if name in aliases:
            return "skip"
        return "remote" if is_float_dtype(base_ck.meta(name).dtype) else "driver"

    return place
