"""The output rebuilt from the policy state: θ(α) = θ₀ + Σ αᵢ dᵢ, after a fold whose coefficients
are known only once every tensor's state is (a coefficient search: MDM-OC's CMA-ES, AdaMerging;
OPCM's whole-model rescale ``scope=global``), here or on a remote executor's tasks.

Locally (:func:`rewrite_from_state`) the driver reads θ₀ and the state and writes the output. With a
remote executor (:func:`rebuild_remote`) the same runs as a :class:`RebuildSpec` pass of its own:
each task reads θ₀'s and the state's tensors of its group from shared storage and writes their
bytes into the planned shards; the driver only plans and collects metadata. OPCM's λ_t is a
reduction over the whole model: the tasks of a first ``RebuildSpec`` pass without coefficients
return each tensor's partial sums (:meth:`~mergestream.policies.base.Policy.scale_partial`, a few
floats) and the driver finishes it (:meth:`~mergestream.policies.base.Policy.finish_scale`) in θ₀'s
order — the very floats of the local reduction, so the output is byte-identical.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..io.checkpoints import Checkpoint, is_float_dtype, open_checkpoint, open_safetensors_file
from ..io.state import SEP
from ..io.writers import ModelWriter
from ..policies import Policy
from .executors import TensorMap
from .executors.parts import PartsPlan
from .fold_tensor import FoldSinks
from .passes import Stats, canonical_order, cast_checked, worker_threads, write_with_aliases
from .stream import run_stream


def state_reader(path: Path) -> tuple[Checkpoint, Callable[[str], dict[str, torch.Tensor]]]:
    """Open a state file (or pieces folder) and return it with ``name -> {field: tensor}`` (empty for
    a tensor without state). Close the checkpoint when done."""
    ck = open_safetensors_file(path)
    fields: dict[str, list[str]] = {}
    for key in ck.keys():
        t, _, f = key.rpartition(SEP)
        fields.setdefault(t, []).append(f)
    return ck, lambda name: {f: ck.get(f"{name}{SEP}{f}") for f in fields.get(name, [])}


def _rebuilt(pol: Policy, base: torch.Tensor, dtype: torch.dtype, state: dict[str, torch.Tensor],
             coeffs: list[float], dev: torch.device, name: str) -> torch.Tensor:
    """θ₀'s tensor rebuilt from its state with ``coeffs``, in θ₀'s storage dtype (θ₀ itself without state)."""
    if not state:
        return base
    t = pol.rebuild(base.to(dev, torch.float32), {k: v.to(dev) for k, v in state.items()}, coeffs)
    return cast_checked(t, dtype, name)


def rewrite_from_state(pol: Policy, base: Checkpoint, state_path: Path, coeffs: list[float], writer: ModelWriter,
                       dev: torch.device, threads: int | None, aliases: dict[str, str]) -> None:
    """Write θ(α) = θ₀ + Σ αᵢ dᵢ from the state into ``writer``, in this process (every tensor).

    Raises:
        NonFiniteError: a rebuilt tensor overflows its storage dtype.
    """
    ck, read = state_reader(state_path)
    try:
        def load(name: str):
            return None if name in aliases else (base.get(name), read(name))

        def work(name: str, item) -> None:
            b, st = item
            meta = base.meta(name)
            out = _rebuilt(pol, b, meta.dtype, st, coeffs, dev, name) if is_float_dtype(meta.dtype) else b
            write_with_aliases(writer, name, out, aliases)

        run_stream(canonical_order(base), load, work, threads=worker_threads(threads))
    finally:
        ck.close()


@dataclass
class RebuildSpec:
    """A rebuild pass as data (picklable) for a remote executor's tasks (:func:`~.executors.parts.run_part`).

    Attributes:
        policy: the fold's policy. base: θ₀'s path. state: the new state (file or pieces folder),
            on storage every worker reaches. coefficients: α of every fold; None: the tasks return
            each tensor's :meth:`~mergestream.policies.base.Policy.scale_partial` instead of writing.
        aliases: tied ``{alias: primary}`` (written with the primary). device / torch_threads: as
            the fold's (:class:`~.fold_tensor.FoldSpec`).
    """

    policy: Policy
    base: str
    state: str
    coefficients: tuple[float, ...] | None
    aliases: dict[str, str]
    device: str
    torch_threads: int
    #: a rebuild reads no expert (no digests come back)
    expert_count: int = 0

    def open(self) -> tuple[_Rebuilder, Callable[[], None]]:
        """The per-tensor worker on freshly opened inputs, and a function that closes them."""
        base_ck = open_checkpoint(self.base)
        try:
            st_ck, read = state_reader(Path(self.state))
        except BaseException:
            base_ck.close()
            raise

        def close() -> None:
            st_ck.close()
            base_ck.close()

        return _Rebuilder(self, base_ck, read), close

    def read_expert(self, _worker: Any, _name: str) -> tuple[str, None]:
        """No expert is read: nothing to digest."""
        return ("state", None)


class _Rebuilder:
    """A rebuild task's per-tensor worker (what :func:`~.executors.parts.run_part` calls)."""

    def __init__(self, spec: RebuildSpec, base_ck: Checkpoint, read: Callable[[str], dict[str, torch.Tensor]]):
        self.spec, self.base_ck, self.read = spec, base_ck, read
        self.dev = torch.device(spec.device)

    def __call__(self, name: str, _item: Any, out: FoldSinks) -> list[float] | None:
        """Write tensor ``name`` rebuilt from its state (and its tied aliases); or, without
        coefficients, return its partial sums (None for a tensor without state)."""
        spec, st = self.spec, self.read(name)
        if spec.coefficients is None:
            return spec.policy.scale_partial(st) if st else None
        meta = self.base_ck.meta(name)
        t = _rebuilt(spec.policy, self.base_ck.get(name), meta.dtype, st, list(spec.coefficients), self.dev, name)
        write_with_aliases(out.writer, name, t, spec.aliases)
        return None


def rebuild_remote(pol: Policy, base: Checkpoint, base_path: str, state_path: Path, coeffs: list[float] | None,
                   writer: ModelWriter, aliases: dict[str, str], dev: torch.device, executor: Any,
                   torch_threads: int) -> float | None:
    """Run a rebuild on ``executor``'s tasks: with ``coeffs``, they write θ(α) of every float tensor
    into ``writer``'s planned shards (frozen tensors were written by the fold's pass) and None is
    returned; without, they return each tensor's partial sums and the whole-model λ is returned
    (:meth:`~mergestream.policies.base.Policy.finish_scale` over θ₀'s order, as the local reduction).

    Raises:
        The first task's error (nothing is committed here).
    """
    names = canonical_order(base)
    spec = RebuildSpec(pol, base_path, str(state_path), tuple(coeffs) if coeffs is not None else None, aliases,
                       str(dev), torch_threads)

    def place(name: str) -> str:
        return "remote" if name not in aliases and is_float_dtype(base.meta(name).dtype) else "skip"

    def never(*_: Any) -> None:  # every tensor is remote or skipped
        raise AssertionError("a rebuild pass loads nothing on the driver")

    job = TensorMap(names, never, never, FoldSinks(writer, None, None, Stats()), spec, base, placement=place,
                    parts=PartsPlan(writer.plan()))
    executor.map(job)
    if coeffs is not None:
        return None
    return pol.finish_scale(job.partials[m.name] for m in base.metas() if m.name in job.partials)
