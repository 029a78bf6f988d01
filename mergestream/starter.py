"""The commented starter config ``mergestream init`` writes (one home for its text and defaults).

The starter names the recommended policy (:data:`mergestream.policies.RECOMMENDED_POLICY`, the best
measured on the quality benchmark) with its parameters, lists every registered policy with its
parameter names, and must always load with :func:`mergestream.config.load_config`.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import yaml

from .config import ConfigError, load_config
from .io.st import write_atomic
from .policies import RECOMMENDED_PARAMS, RECOMMENDED_POLICY, make_policy, parameter_names, policy_names

STARTER = """\
# mergestream daemon configuration (written by `mergestream init`).
# Every key is optional except `base`. Environment variables override this file:
# MERGESTREAM_<KEY> or MERGESTREAM_<SECTION>__<KEY>, e.g. MERGESTREAM_MLFLOW__TRACKING_URI.
# Relative paths are resolved against this file's folder.

# The pretrained base θ₀ every expert was fine-tuned from (file or Hugging Face folder).
base: {base}

# The merge policy and its parameters (docs/policies.md; every parameter: the docs' policies reference):
{policies}policy:
  name: {policy}
  params: {params}
  unmerge_mode: {unmerge_mode}{pad}# how `mergestream unmerge EXPERT` removes an expert: subtract | replay
  # Any policy also takes, beside its own params (docs/policies.md):
  #   patch_budget: 0.2          # each fold changes at most 20% of every matrix (small fleet patches);
  #                              # the rest is sent at later folds; unmerge then replays
  #   lines_alpha: 0.5           # LiNeS: shallow blocks stay nearer θ₀ (with lines_beta)
  # Data-driven extras (docs/data-driven.md):
  # preprocess: [ri]            # RI pre-step: adapt each expert (that ships a task head) on unlabeled data;
  #                            # the benchmark's best row is the recommended policy plus this step and distill below
  # ri: {{data: aux.txt, steps: 100, time_budget_seconds: 300, alpha: 1.0}}
  # postprocess: [distill]     # distil post-step: after each fold, train the backbone toward each task's
  #                            # expert on its task probe's inputs (experts ship mergestream_probe/);
  #                            # unmerge_mode above must then be replay; with a sentence_similarity probe its
  #                            # sentences are anchors that keep θ₀'s geometry (anchor_examples: 0 for none)
  # distill: {{steps: 100, gamma: 0.3, examples_per_task: 128, anchor_examples: 1024, time_budget_seconds: 600}}
  # with mdm_oc and params {{coefficients: cmaes, budget: 40}}, CMA-ES maximises the data probes:
  # objective: {{task_weight: 1.0, general_weight: 1.0, examples_per_task: 64, general_pairs: 200}}
  # with mdm_oc and params {{coefficients: adamerging}}, per-layer α are learned on ri.data (needed even
  # without preprocess [ri]; experts must ship a task head): objective: {{adamerging_examples: 64}}
  # strength: auto              # per fold, fold at each value of the policy's strength (lambda, alpha) and
  #                            # keep the best on the objective above (task probes' rows + a sentence_similarity
  #                            # probe, needed); a grid of your own: strength: {{mode: auto, grid: [1.5, 2.0, 3.0]}}

# New experts arrive here: a .safetensors file, a Hugging Face folder or a PEFT LoRA adapter folder.
# One is ready when a READY marker appears (inside a folder; `<file>.READY` next to a file), or when
# its files are complete and their sizes stayed unchanged for settle_seconds.
inbox: inbox
watch:
  settle_seconds: 2.0
  polling: false                # true for network filesystems

# Published versions (versions/NNNNNN), the `current` pointer, the ledger and caches.
state_dir: state
retention: 5                    # published versions kept; `current` is never deleted

# Prometheus metrics on http://HOST:PORT/metrics, plus /healthz and /readyz.
metrics:
  host: 127.0.0.1
  port: 9108

# MLflow: one run per fold; accepted versions registered under `registered_model` with `alias`.
# Without tracking_uri, a sqlite store inside state_dir is used (no server needed).
mlflow:
  enabled: true
  # tracking_uri: http://127.0.0.1:5000
  experiment: mergestream
  registered_model: mergestream-backbone
  alias: champion
  registry:                     # also take experts from a model registry
    enabled: false
    models: []                  # registered model names holding experts
    interval_seconds: 30
    # pending_timeout_seconds: 3600   # skip a version stuck PENDING_REGISTRATION this long (s)

# Object storage (pip install -e '.[s3]' from the checkout; credentials from the standard AWS chain only):
# s3:                           # also take experts from a bucket (docs/sources.md)
#   enabled: true
#   bucket: experts
#   prefix: incoming/
#   endpoint_url: http://127.0.0.1:9000   # MinIO, Ceph, R2...; omit for AWS
#   interval_seconds: 30
#   cache: true                 # false: fold in place with ranged reads, no local copy
# publish:
#   uri: s3://models/backbone/  # mirror every published version; the object `current` is written last

# A signed update feed for edge devices (pip install -e '.[feed]' from the checkout; docs/fleet.md):
# feed:
#   dir: feed                   # serve this folder over HTTP; rebuilt after each version and rollback
#   keys: keys                  # from `mergestream feed keygen --keys keys`
#   patch_format: 2
#   expires: {{timestamp: 1d}}    # re-signed every half lifetime while the daemon runs

# Probes run on every candidate before it is published. weight_space (data-free: relative_drift,
# step_drift, general_subspace_energy, max_task_cosine) is always on. Data probes, e.g.:
#   - type: sentence_similarity
#     params: {{data: stsb_test.tsv, metric: sts_spearman}}
#   - type: classification      # experts that ship mergestream_probe/ keep being probed
#   - type: entrypoint
#     params: {{target: mypackage.probes:score}}
probes:
  - type: weight_space

# Gate: every rule must hold or the candidate is rejected (rolled back) and `current` stays.
# Defaults reject a fold that moves the weights far more than earlier folds did.
gate:
  rules:
    - metric: step_drift        # ||θ_t − θ_(t−1)|| / ||θ₀||
      direction: lower
      max_ratio_to_history: 10  # at most 10x the median of accepted folds
    - metric: relative_drift    # ||θ_t − θ₀|| / ||θ₀||
      direction: lower
      max_value: 0.5
    # - metric: sts_spearman
    #   direction: higher
    #   against: base
    #   max_abs_drop: 5.0
"""


def _policy_lines() -> str:
    """The starter's comment listing every registered policy with its parameter names."""
    return "".join(f"#   {name}: {', '.join(parameter_names(name)) or '(no parameters)'}\n" for name in policy_names())


def write_starter(folder: str | os.PathLike, base: str, policy: str | None = None) -> Path:
    """Write ``folder/config.yaml`` (commented) and create ``folder/inbox``; returns the file path.

    ``policy`` None: :data:`~mergestream.policies.RECOMMENDED_POLICY` with its measured parameters;
    another policy starts from its own defaults (``params: {}``).

    Raises:
        ConfigError: the config file already exists.
        OSError: the folder cannot be written (nothing is left behind).
    """
    d = Path(folder)
    path = d / "config.yaml"
    if path.exists():
        raise ConfigError(f"{path} already exists")
    params = RECOMMENDED_PARAMS if policy in (None, RECOMMENDED_POLICY) else {}
    mode = "subtract" if make_policy(policy or RECOMMENDED_POLICY, params).subtract_unmerge else "replay"
    text = STARTER.format(base=str(Path(base).resolve()), policy=policy or RECOMMENDED_POLICY,
                          params=yaml.safe_dump(params, default_flow_style=True).strip(),
                          unmerge_mode=mode, pad=" " * max(1, 16 - len(mode)),  # the comments line up
                          policies=_policy_lines())
    made = [p for p in (d / "inbox", d, *d.parents) if not p.exists()]
    try:  # complete or not at all: an OSError (a full disk) leaves neither the file nor the folders made
        (d / "inbox").mkdir(parents=True, exist_ok=True)
        write_atomic(path, text.encode())
    except BaseException:
        for p in made:
            with contextlib.suppress(OSError):
                p.rmdir()
        raise
    load_config(path)  # the starter must always validate
    return path
