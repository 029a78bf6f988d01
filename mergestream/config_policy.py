"""The ``policy`` section of the daemon's configuration (:mod:`mergestream.config` reads the file):
the policy and its parameters, the RI pre-step, the distil post-step, the data-probe objective of coefficient searches and
the per-fold strength choice. Torch-free: a policy is built (to check its name and parameters) only
through a deferred import.
"""

from __future__ import annotations

import contextvars
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from .errors import PolicyError
from .recommended import RECOMMENDED_PARAMS, RECOMMENDED_POLICY
from .settings_base import NumbersNotBooleans

if TYPE_CHECKING:
    from .policies import Policy

#: False while :func:`load_config` reads a config without building its policy (``check_policy``).
_CHECK_POLICY: contextvars.ContextVar[bool] = contextvars.ContextVar("mergestream_check_policy", default=True)


def _make_policy(name: str, params: dict[str, Any]) -> Policy:
    from .policies import make_policy  # torch: loaded only when a policy is checked or built
    return make_policy(name, params)


class _Section(NumbersNotBooleans):
    # a number field takes finite values only: `.inf` or `.nan` in YAML is a config error, not a fold
    # that fails later
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class RIConfig(_Section):
    """The RI (Resolving Interference) pre-step, enabled with ``policy.preprocess: [ri]``.

    Each expert that ships a task head (``mergestream_probe/``) is adapted before it is folded:
    it keeps its own head's outputs and, through every earlier accepted task's head, looks like θ₀
    on the auxiliary inputs (Ramesh et al., arXiv 2603.13467; :mod:`mergestream.datasteps.ri`).
    """

    data: Path | None = Field(None, description="unlabeled auxiliary inputs: text file (one per line) or JSONL "
                                                "with text[, text2]; required when ri is enabled")
    max_examples: int | None = Field(512, ge=1, description="use the first N auxiliary inputs")
    alpha: float = Field(1.0, ge=0, description="weight of the look-like-the-base term (paper: 1)")
    steps: int = Field(100, ge=0, description="step budget (AdamW updates); 0 = identity")
    time_budget_seconds: float | None = Field(300.0, ge=0, description="time budget per expert (s)")
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate")
    batch_size: int = Field(16, ge=1, description="auxiliary inputs per AdamW step")
    max_length: int = Field(64, ge=1, description="tokens per input (Hugging Face features)")
    eval_every: int = Field(10, ge=0, description="keep the best iterate, evaluated every N steps (0: the last)")
    forward: str | None = Field(None, description="package.module:factory returning a FeatureModel; "
                                                  "default: Hugging Face encoder + pooling of the task probe")
    on_missing_head: Literal["skip", "reject"] = Field(
        "skip", description="an expert without a task head: fold it unadapted (skip) or reject it")


class DistillConfig(_Section):
    """The distil post-step, enabled with ``policy.postprocess: [distill]``.

    After every fold the candidate backbone is trained for a few steps so that, through each task
    head it carries (every accepted expert's task probe and the new expert's), it gives the outputs
    of that task's own expert on the first ``examples_per_task`` inputs of the task probe (their
    labels are not used), while a similarity term keeps θ₀'s embedding geometry (:mod:`mergestream.datasteps.distill`)
    on those inputs and on the first ``anchor_examples`` sentences of the ``sentence_similarity``
    probe, when one is configured (the general knowledge the gate checks).
    Each expert's outputs are computed from its kept copy. The published version is the distilled
    one; the next fold starts from it. Unmerge replays (the step changes the backbone after the fold).
    """

    steps: int = Field(100, ge=0, description="AdamW steps per fold; 0 = identity")
    lr: float | None = Field(None, gt=0, description="AdamW learning rate; default 1e-5, or 3e-5 when the "
                                                    "policy has a patch_budget below 1 (both chosen on validation)")
    gamma: float = Field(0.3, ge=0, description="weight of the similarity-preserving term toward θ₀ (0: off)")
    batch_per_task: int = Field(8, ge=1, description="inputs of each task per step")
    examples_per_task: int = Field(128, ge=1, description="first N inputs of each task probe (their labels unused)")
    max_length: int = Field(64, ge=1, description="tokens per input (Hugging Face features)")
    anchor_examples: int = Field(1024, ge=0, description="first N distinct sentences of the sentence_similarity "
                                 "probe kept in θ₀'s geometry by the similarity term (0: none)")
    anchor_batch: int = Field(16, ge=1, description="anchor sentences per step")
    time_budget_seconds: float | None = Field(600.0, ge=0, description="time budget per fold (s)")
    forward: str | None = Field(None, description="package.module:factory returning a FeatureModel (as ri.forward)")


class ObjectiveConfig(_Section):
    """The data-probe objective of CMA-ES coefficients (``mdm_oc`` with ``coefficients: cmaes``):
    maximise task_weight × mean task accuracy + general_weight × the sentence_similarity probe.
    ``coefficients: adamerging`` instead minimises the task heads' prediction entropy on the first
    ``adamerging_examples`` inputs of ``ri.data`` (:mod:`mergestream.engine.coefficients`)."""

    task_weight: float = Field(1.0, ge=0, description="weight of the mean task accuracy (task probes)")
    general_weight: float = Field(1.0, ge=0, description="weight of the sentence_similarity probe (general)")
    examples_per_task: int = Field(64, ge=1, description="first N rows of each task probe")
    general_pairs: int = Field(200, ge=2, description="first N pairs of the sentence_similarity probe")
    adamerging_examples: int = Field(64, ge=1, description="adamerging: first N unlabeled inputs of ri.data")


class StrengthConfig(_Section):
    """How strongly each expert is folded. ``fixed``: the configured parameter (``policy.params``).
    ``auto``: at every fold the daemon folds the expert once per candidate value of the policy's
    strength parameter (``lambda`` of task arithmetic, ``alpha`` of Iso-C...), scores each candidate
    with the data-probe objective of ``policy.objective`` (mean accuracy on the validation rows of the
    task probes of the experts folded so far and the new one's, plus the sentence_similarity probe,
    so general knowledge weighs against the tasks) and keeps the best; the configured value is always
    a candidate and wins ties. The choice is recorded in ``fold.json`` (``params``, ``strength``).
    ``policy.strength: auto`` is short for ``{mode: auto}``."""

    mode: Literal["fixed", "auto"] = Field("fixed", description="fixed: the configured value; auto: the best "
                                           "candidate on the data probes at each fold")
    param: str | None = Field(None, description="the parameter searched; default: the policy's strength "
                                                "parameter (the policies reference names it)")
    grid: list[float] | None = Field(None, min_length=1, description="candidate values (the configured value "
                                     "is added); default: the policy's strength grid")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        """``strength: auto`` / ``strength: fixed`` as ``{mode: ...}``."""
        return {"mode": data} if isinstance(data, str) else data


class PolicyConfig(_Section):
    """The merge policy and its parameters (names as in METHODS.md)."""

    name: str = Field(RECOMMENDED_POLICY, description="a registered policy name (`mergestream fold --help` lists them)")
    params: dict[str, Any] = Field(default_factory=dict, description="policy parameters, e.g. {lambda: 0.3}")
    unmerge_mode: Literal["subtract", "replay"] = Field(
        "subtract", description="how `unmerge EXPERT` removes an expert (default replay for a policy that cannot subtract)")
    preprocess: list[Literal["ri"]] = Field(default_factory=list, description="pre-steps applied to each expert")
    postprocess: list[Literal["distill"]] = Field(default_factory=list,
                                                  description="post-steps applied to each folded backbone")
    ri: RIConfig = Field(default_factory=RIConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    strength: StrengthConfig = Field(default_factory=StrengthConfig)

    @model_validator(mode="before")
    @classmethod
    def _recommended_params(cls, data: Any) -> Any:
        """No policy named: the recommended one with its measured parameters (an explicit ``params``,
        even ``{}``, is kept)."""
        if isinstance(data, dict) and "name" not in data and "params" not in data:
            data = {**data, "params": dict(RECOMMENDED_PARAMS)}
        if not isinstance(data, dict) or "unmerge_mode" in data:
            return data
        post = data.get("postprocess")
        if isinstance(post, list) and "distill" in post:  # whatever the policy, and whether it builds
            return {**data, "unmerge_mode": "replay"}
        if _CHECK_POLICY.get():
            try:
                pol = _make_policy(data.get("name", RECOMMENDED_POLICY), data.get("params") or {})
            except Exception:  # noqa: BLE001 - any malformed name or params: reported by the checks below
                return data
            if not pol.subtract_unmerge:  # e.g. Iso-C
                data = {**data, "unmerge_mode": "replay"}
        return data

    @model_validator(mode="after")
    def _unmerge_mode_fits(self) -> PolicyConfig:
        if self.unmerge_mode == "subtract" and "distill" in self.postprocess:
            raise ValueError("postprocess [distill] changes the backbone after each fold, which subtract cannot "
                             "remove: set policy.unmerge_mode: replay")
        if _CHECK_POLICY.get() and self.unmerge_mode == "subtract" and not (pol := self.make()).subtract_unmerge:
            raise ValueError(f"policy {self.name} cannot unmerge by subtract ({pol.no_subtract_reason}): "
                             "set policy.unmerge_mode: replay")
        return self

    @field_validator("preprocess", "postprocess")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("each step may appear once")
        return v

    @model_validator(mode="after")
    def _policy_exists(self) -> PolicyConfig:
        if _CHECK_POLICY.get():
            self.make()  # an unknown name or a bad parameter is refused when the config loads, not per expert
        return self

    def make(self, params: dict[str, Any] | None = None) -> Policy:
        """The configured :class:`~mergestream.policies.Policy` (``params``: instead of ``self.params``).

        Raises:
            ValueError: unknown policy name or bad parameters (a config error, reported by pydantic).
        """
        try:
            return _make_policy(self.name, self.params if params is None else params)
        except PolicyError as exc:
            raise ValueError(str(exc)) from None

    @model_validator(mode="after")
    def _strength_fits(self) -> PolicyConfig:
        if self.strength.mode == "auto" and _CHECK_POLICY.get():
            from .policies import strength_candidates

            try:
                strength_candidates(self.name, self.params, self.strength.param, self.strength.grid)
            except PolicyError as exc:
                raise ValueError(str(exc)) from None
            if search := self.make().searches_coefficients():
                raise ValueError(f"policy.strength: auto and {self.name}'s {search} search would both choose the scale")
        return self

    @model_validator(mode="after")
    def _ri_needs_data(self) -> PolicyConfig:
        if "ri" in self.preprocess and self.ri.data is None:
            raise ValueError("preprocess [ri] needs ri.data (a file of unlabeled auxiliary inputs)")
        if _CHECK_POLICY.get() and self.make().searches_coefficients() == "adamerging" and self.ri.data is None:
            raise ValueError("coefficients: adamerging learns on unlabeled inputs: set policy.ri.data (the RI "
                             "auxiliary data file; ri itself need not be in preprocess)")
        return self
