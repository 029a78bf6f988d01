"""The steps that run a text encoder on data: what a fold does when it has inputs and heads, not
only weights.

- :mod:`.text` is the text-encoder toolkit (load a model or tokenizer, pool, embed, STS Spearman, a
  linear head's accuracy, the probe data files). The daemon's data probes, its coefficient
  objective, the experts toolkit and both steps below read through it, so what a probe measures
  is what a step trains on.
- :mod:`.ri` is RI, the pre-step that adapts an expert before it is folded (:func:`adapt_expert`;
  Ramesh et al., arXiv 2603.13467), with the feature models and auxiliary data both steps use.
- :mod:`.distill` is the distil post-step that pulls a folded backbone back toward every seen
  expert's head outputs (:func:`distill_backbone`).

Both steps train (≈ 4× the model's float32 size resident), unlike a fold. Dependencies run one
way: the daemon's pre/post steps and probes, the engine's AdaMerging objective and the experts
toolkit -> datasteps -> io, errors, plugins; nothing here imports the daemon or the engine.
The in-memory distil optimisation is ``distill.distill``: the name ``distill`` here is the module.
"""

from __future__ import annotations

from .distill import DistillError, DistillParams, DistillResult, DistillTask, distill_backbone, teacher_outputs
from .ri import (
    FeatureModel,
    HFEncoderFeatures,
    RIError,
    RIParams,
    RIResult,
    adapt_expert,
    load_feature_model,
    read_aux,
    resolve_interference,
)

__all__ = ["DistillError", "DistillParams", "DistillResult", "DistillTask", "FeatureModel", "HFEncoderFeatures",
           "RIError", "RIParams", "RIResult", "adapt_expert", "distill_backbone", "load_feature_model",
           "read_aux", "resolve_interference", "teacher_outputs"]
