"""The policy protocol: pure per-tensor functions that compute a fold's Δ_t.

A policy never does I/O. The engine hands it, for one tensor at a time, θ₀, θ_{t−1} and τ as
float32 tensors of the same shape, plus that tensor's policy state (a dict of tensors the policy
returned at the previous fold, empty at the first), and gets back Δ_t (float32) and the new state.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from pydantic import ConfigDict
from pydantic import ValidationError as PydanticValidationError

from ..settings_base import NumbersNotBooleans
from ..errors import PolicyError

Tensor = torch.Tensor
TensorState = dict[str, Tensor]


class PolicyParams(NumbersNotBooleans):
    """Base of every policy's parameters: frozen, unknown names and booleans for numbers are errors."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


@dataclass(frozen=True)
class TensorContext:
    """What a policy may know about the tensor it folds, besides the tensors themselves.

    Attributes:
        name: tensor name in the checkpoint.
        n_previous: number of experts already folded into θ_{t−1}.
        coefficients: the scaling coefficient each previous fold used (policies that keep one).
        is_embedding: the tensor is an embedding matrix or (tied) LM head.
        seed: a per-tensor seed for anything random (stable across runs).
        n_blocks: the model's number of transformer blocks, from θ₀'s tensor names
            (:func:`mergestream.policies.lines.block_count`); 0 when it has none.
        dtype: the tensor's storage dtype in the checkpoint (the math is float32 regardless);
            a policy may keep tensor-sized state no wider than what the checkpoint stores.
        buffers: ``(slot, numel, dtype, device) -> flat tensor``, the engine's per-thread reusable
            buffers (:func:`mergestream.engine.stream.scratch`), or None for fresh memory; use them
            through :meth:`scratch`.
    """

    name: str
    n_previous: int = 0
    coefficients: tuple[float, ...] = ()
    is_embedding: bool = False
    seed: int = 0
    n_blocks: int = 0
    dtype: torch.dtype = torch.float32
    buffers: Callable[[str, int, torch.dtype, torch.device], Tensor] | None = None

    def scratch(self, slot: str, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> Tensor:
        """An uninitialised tensor of ``shape`` for a temporary of this tensor's fold.

        With the engine's :attr:`buffers` it is the same memory each time this thread asks for
        ``slot``: fresh tensor-sized buffers cost page faults and kernel zeroing (SAFE-Merge's
        several (m, n) temporaries per matrix spent a sixth of a 1 GiB fold's CPU time on them).
        The contents are valid until this thread asks for ``slot`` again, so a temporary must not
        be returned as Δ_t or state (and two live temporaries need two slots).
        """
        shape = tuple(shape)
        if self.buffers is None:
            return torch.empty(shape, dtype=dtype, device=device)
        return self.buffers(slot, math.prod(shape), dtype, torch.device(device)).view(shape)


@dataclass
class TensorFold:
    """A policy's answer for one tensor.

    Attributes:
        delta: float32, θ's shape; Δ_t = scale · delta, and the engine writes cast(θ_{t−1} + Δ_t).
        state: the new per-tensor policy state (float32/int tensors), persisted by the engine.
        stats: scalars worth logging (kept fraction, recovery loss, ...).
        scale: a scalar applied by the engine while adding (saves a tensor-sized temporary when
            ``delta`` is also kept in the state, e.g. MDM-OC's unit direction).
    """

    delta: Tensor
    state: TensorState = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    scale: float = 1.0

    def full_delta(self) -> Tensor:
        """Δ_t = scale · delta (a new tensor unless scale is 1)."""
        return self.delta if self.scale == 1.0 else self.delta * self.scale


def explain_error(err: dict[str, Any], params: type[PolicyParams], also: Sequence[str] = ()) -> str:
    """One pydantic error on ``params`` as a line for a user: ``where: message``; an unknown name
    gets the closest known one and the list, ``also`` (other accepted names, e.g. the wrappers'
    parameters) after the model's own."""
    where = ".".join(map(str, err["loc"])) or "params"
    if err["type"] != "extra_forbidden":
        return f"{where}: {err['msg']}"
    own = [f.alias or n for n, f in params.model_fields.items()]
    other = [k for k in also if k not in own]
    close = difflib.get_close_matches(where, own + other, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    tail = f"; with any policy: {', '.join(other)}" if other else ""
    return f"{where}: unknown parameter ({hint}known: {', '.join(own)}{tail})"


class Policy:
    """Base class of merge policies.

    Subclasses set ``name`` and ``Params`` and implement :meth:`fold_tensor`. The defaults make
    every additive policy unmergeable by ``subtract`` (the engine stores the residual each fold
    applied, :mod:`mergestream.engine.residuals`) and give an offline K-way :meth:`merge_tensor` that
    folds the task vectors one by one in memory.
    """

    name: ClassVar[str] = ""
    Params: ClassVar[type[PolicyParams]] = PolicyParams
    #: the fold's coefficient recorded per expert (used by policies whose backbone is rebuilt from
    #: state with coefficients, e.g. MDM-OC); None for the others.
    coefficient_param: ClassVar[str | None] = None
    #: True when :meth:`contribution` rebuilds each fold's contribution from the state, so the
    #: engine need not store contributions separately.
    contributions_in_state: ClassVar[bool] = False
    #: False when ``subtract`` unmerge cannot give a correct state (the policy's state folds the
    #: experts together irreversibly, e.g. Iso-C's running sum): unmerge then refuses ``subtract``
    #: and names ``replay``. A class default that an instance may narrow by its parameters
    #: (SAFE-Merge with ``iso_alpha``); ask an instance.
    subtract_unmerge: bool = True
    #: why ``subtract`` is refused when :attr:`subtract_unmerge` is False, as errors say it
    no_subtract_reason: str = "its state folds the experts together"
    #: the parameters that reproduce the reference implementation (FusionBench 0.2.33) on its
    #: conventions, checked by tests/test_conformance.py on the fixtures of
    #: bench/conformance_reference.py; None for a policy that has no reference there
    reference_params: ClassVar[dict[str, Any] | None] = None
    #: the parameter that sets how strongly an expert is folded (``lambda``, ``alpha``) and the
    #: candidate values ``policy.strength: auto`` tries by default (the grid bench/quality.py
    #: tunes on); None for a policy without one (weight averaging). Ask an instance: :meth:`strength`.
    strength_param: ClassVar[str | None] = None
    strength_grid: ClassVar[tuple[float, ...]] = ()
    #: True when the state keeps something per expert folded (MDM-OC's directions, Iso-CTS's task
    #: vectors), so a fold's memory, state on disk and time grow with the length of the stream;
    #: such a policy is never the recommended default of a daemon left running (bench/quality_report.py)
    state_grows: ClassVar[bool] = False

    def __init__(self, params: dict[str, Any] | PolicyParams | None = None):
        if isinstance(params, PolicyParams):
            self.params = params
        else:
            try:
                self.params = self.Params(**(params or {}))
            except PydanticValidationError as exc:
                errs = "; ".join(self._explain(e) for e in exc.errors())
                raise PolicyError(f"policy {self.name}: bad parameters: {errs}") from None

    @classmethod
    def _explain(cls, err: dict[str, Any]) -> str:
        """One pydantic error as a line for a user: an unknown name gets the known ones (and the
        closest), the wrappers' parameters that any policy accepts among them."""
        wrapped = [f.alias or n for w in Wrapper.__subclasses__() for n, f in w.Own.model_fields.items()]
        return explain_error(err, cls.Params, wrapped)

    def describe(self) -> dict[str, Any]:
        """Parameters as a JSON-able dict, with METHODS.md names (``lambda``, ``k``, ...)."""
        return self.params.model_dump(by_alias=True)

    def offline(self) -> Policy:
        """The policy an offline K-way ``merge`` runs as, and records: this one (a patch budget,
        which has no versions in between to bound, gives its inner policy)."""
        return self

    def coefficient(self) -> float | None:
        """The coefficient this fold uses for the new expert (recorded in the state manifest)."""
        return None if self.coefficient_param is None else float(getattr(self.params, self.coefficient_param))

    def linear_scale(self) -> float | None:
        """Capability: λ when Δ_t = λ·τ element-wise whatever θ_{t−1} and the state (no state kept).

        The engine then folds such a policy in small chunks of each tensor (float32 temporaries of
        a few MiB instead of several tensor-sized ones). None (the default): use :meth:`fold_tensor`.
        """
        return None

    def searches_coefficients(self) -> str | None:
        """Capability: which search the fold runs on an objective after its pass (a truthy name,
        e.g. ``"cmaes"`` or ``"adamerging"``), or None; with a search the engine writes the output
        once, from the state, after it."""
        return None

    def scales_globally(self) -> bool:
        """Capability: the fold's output is θ₀ + λ_t·(state) with one λ_t for the whole model, known
        only after every tensor's state is computed (OPCM with ``scope=global``). The engine then
        writes the output after its pass: λ_t = :meth:`global_scale` of the new states, recorded as
        the fold's coefficient, and each tensor from :meth:`rebuild` with the coefficients."""
        return False

    def global_scale(self, states: Iterable[TensorState]) -> float:
        """The whole-model coefficient λ_t from every float tensor's new state (see
        :meth:`scales_globally`), in θ₀'s order: :meth:`finish_scale` of each :meth:`scale_partial`
        (so a remote executor's tasks compute the partials where the state is and the driver
        finishes them, with the very same floats).

        Raises:
            NotImplementedError: a policy that does not scale globally.
        """
        return self.finish_scale(self.scale_partial(st) for st in states)

    def scale_partial(self, state: TensorState) -> list[float]:
        """One tensor's share of :meth:`global_scale`: a few floats (partial sums), from its new state.

        Raises:
            NotImplementedError: a policy that does not scale globally.
        """
        raise NotImplementedError(f"policy {self.name} has no global scale")

    def finish_scale(self, partials: Iterable[list[float]]) -> float:
        """λ_t from every float tensor's :meth:`scale_partial`, in θ₀'s order.

        Raises:
            NotImplementedError: a policy that does not scale globally.
        """
        raise NotImplementedError(f"policy {self.name} has no global scale")

    def strength(self) -> tuple[str, tuple[float, ...]] | None:
        """Capability: (the parameter that scales the fold, its default candidate values) for the
        daemon's per-fold strength choice (``policy.strength: auto``), or None when the policy has
        no such parameter. Default: the class's :attr:`strength_param` and :attr:`strength_grid`."""
        return None if self.strength_param is None else (self.strength_param, tuple(self.strength_grid))

    def refold_params(self, coefficient: float | None) -> dict[str, Any]:
        """Capability: the parameters that fold this expert again without an objective (replay),
        given the coefficient its fold recorded. Default: the parameters as described."""
        return self.describe()

    def fold_tensor(self, base: Tensor, backbone: Tensor, tau: Tensor, state: TensorState,
                    ctx: TensorContext) -> TensorFold:
        """Compute Δ_t for one tensor.

        Args:
            base: θ₀, float32, shape S.
            backbone: θ_{t−1}, float32, shape S.
            tau: τ = θ_expert − θ₀, float32, shape S (may be modified in place by the policy).
            state: this tensor's state from the previous fold (empty dict at the first fold).
            ctx: see :class:`TensorContext`.

        Returns:
            :class:`TensorFold` with Δ_t float32 of shape S.
        """
        raise NotImplementedError

    def merge_tensor(self, base: Tensor, taus: list[Tensor], ctx: TensorContext) -> Tensor:
        """Offline merge of K task vectors (float32, shape S) into one Δ (θ = θ₀ + Δ).

        Default: fold them one by one in memory, in the given order.
        """
        backbone = base.clone()
        state: TensorState = {}
        coeffs: list[float] = []
        for i, tau in enumerate(taus):
            c = TensorContext(ctx.name, i, tuple(coeffs), ctx.is_embedding, ctx.seed)
            out = self.fold_tensor(base, backbone, tau.clone(), state, c)
            backbone.add_(out.delta, alpha=out.scale)
            state = out.state
            if (cf := self.coefficient()) is not None:
                coeffs.append(cf)
        return backbone - base

    def contribution(self, state: TensorState, index: int, coefficient: float | None,
                     shape: torch.Size) -> Tensor | None:
        """Fold ``index``'s float32 contribution rebuilt from state, or None to use the stored one."""
        return None

    def drop_from_state(self, state: TensorState, index: int) -> TensorState:
        """The per-tensor state after expert ``index`` is subtract-unmerged (default: unchanged).

        A policy that keeps anything per expert (or derived from the experts folded so far, like
        OPCM's λ) removes it here: after the most recent fold is removed the state must be the one
        before that fold, so the next fold is the one that would have come without it.
        """
        return state

    def rebuild(self, base: Tensor, state: TensorState, coefficients: list[float]) -> Tensor | None:
        """θ = θ₀ + Σ cᵢ dᵢ from state for policies that support re-weighting (else None)."""
        return None


class Wrapper(Policy):
    """Base of a policy wrapped around another (LiNeS, the patch budget): the wrapper's own parameters
    in ``self.own`` (a pydantic model), ``name``, parameters and coefficient are the inner policy's
    (the state and manifest belong to it)."""

    Own: ClassVar[type[PolicyParams]] = PolicyParams
    #: how errors name the wrapper ("with LiNeS", "with a patch budget")
    label: ClassVar[str] = ""

    def __init__(self, inner: Policy, params: dict[str, Any] | PolicyParams):
        """Raises:
            PolicyError: a wrapper parameter unknown, missing or out of range (each named)."""
        self.inner = inner
        if isinstance(params, self.Own):
            self.own = params
        else:
            try:
                self.own = self.Own(**params)
            except PydanticValidationError as exc:
                errs = "; ".join(explain_error(e, self.Own) for e in exc.errors())
                raise PolicyError(f"policy {inner.name} {self.label}: bad parameters: {errs}") from None
        self.name = inner.name  # type: ignore[misc]
        self.Params = inner.Params  # type: ignore[misc]
        self.params = inner.params
        self.coefficient_param = inner.coefficient_param  # type: ignore[misc]
        # capabilities are the inner policy's until the wrapper narrows them
        self.contributions_in_state = inner.contributions_in_state  # type: ignore[misc]
        self.subtract_unmerge = inner.subtract_unmerge
        self.no_subtract_reason = inner.no_subtract_reason
        self.state_grows = inner.state_grows  # type: ignore[misc]

    def describe(self) -> dict[str, Any]:
        """The inner policy's parameters plus the wrapper's own."""
        return {**self.inner.describe(), **self.own.model_dump()}

    def coefficient(self) -> float | None:
        """The inner policy's recorded coefficient."""
        return self.inner.coefficient()

    def strength(self) -> tuple[str, tuple[float, ...]] | None:
        """The inner policy's strength parameter and grid."""
        return self.inner.strength()

    def refold_params(self, coefficient: float | None) -> dict[str, Any]:
        """The inner policy's replay parameters, with the same wrapper parameters."""
        return {**self.inner.refold_params(coefficient), **self.own.model_dump()}

