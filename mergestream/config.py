"""The daemon's configuration: one YAML file validated by pydantic, environment overrides on top.

Every field is documented below; unknown keys are an error. Environment variables override the
file for secrets and URIs: ``MERGESTREAM_<FIELD>`` and ``MERGESTREAM_<SECTION>__<FIELD>`` (e.g.
``MERGESTREAM_MLFLOW__TRACKING_URI``, ``MERGESTREAM_MLFLOW__WEBHOOK__SECRET``).

Relative paths are resolved against the config file's folder (never the working directory), whether
written in the file, left at their default (``inbox``, ``state``) or given in the environment:
``base``, ``inbox``, ``state_dir``, ``policy.ri.data``, the ``data`` file of every built-in probe,
and the local stores of ``mlflow.tracking_uri`` / ``mlflow.registry.tracking_uri`` (``sqlite:///rel.db``,
``file:rel``, a bare ``rel/mlruns``), ``feed.dir`` and ``feed.keys``. ``~`` is expanded. An ``entrypoint`` probe's params are passed
as written. A :class:`Config` built in code (not by :func:`load_config`) resolves nothing.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from .config_policy import (  # noqa: F401 - re-exported: the sections are read as mergestream.config's
    _CHECK_POLICY,
    ObjectiveConfig,
    PolicyConfig,
    RIConfig,
    StrengthConfig,
    _Section,
)
from .errors import MergestreamError
from .patches.codec import FORMAT_NUMBERS
from .redaction import redact_uris
from .settings_base import NumbersNotBooleans, unknown_key_hint


class ConfigError(MergestreamError):
    """The configuration file is missing, unreadable or invalid."""


class WatchConfig(_Section):
    """The inbox folder watcher."""

    enabled: bool = Field(True, description="watch the inbox folder")
    settle_seconds: float = Field(2.0, ge=0, description="sizes must be stable this long (s) without a READY marker")
    polling: bool = Field(False, description="poll the folder instead of inotify (network filesystems)")
    poll_interval: float = Field(1.0, gt=0, description="polling / settle check period (s)")
    unwritten_seconds: float = Field(
        300.0, ge=0, description="a complete-looking weight file with a hole in its data or a trailing zero run "
                                 "beginning inside a tensor (a preallocated file still being written) waits until unchanged this long (s)")
    incomplete_timeout_seconds: float = Field(
        3600.0, gt=0, description="an inbox entry still incomplete and unchanged this long (s, as seen by the "
                                  "running daemon) is rejected "
                                  "(a copy that stopped for good)")


class RegistryConfig(_Section):
    """Poll an MLflow model registry for new expert versions."""

    enabled: bool = Field(False, description="poll the registry")
    models: list[str] = Field(default_factory=list, description="registered model names holding experts")
    tag_filter: dict[str, str] = Field(default_factory=dict, description="only versions with these tags")
    interval_seconds: float = Field(30.0, gt=0, description="poll period (s)")
    tracking_uri: str | None = Field(None, description="registry server; default: mlflow.tracking_uri")
    max_retries: int = Field(5, ge=0, description="download retries per version")
    backoff_seconds: float = Field(1.0, ge=0, description="first retry delay (s), doubled each time")
    pending_timeout_seconds: float = Field(
        3600.0, gt=0, description="a version PENDING_REGISTRATION longer than this (s, by the registry's "
                                  "timestamps) is skipped with a warning, so later versions are not held forever")


class WebhookConfig(_Section):
    """Optional MLflow webhook receiver (model_version.created); it only triggers a poll."""

    enabled: bool = Field(False, description="receive MLflow model_version.created webhooks (HMAC); each triggers a poll")
    host: str = Field("127.0.0.1", description="bind address of the receiver")
    port: int = Field(9109, ge=0, le=65535, description="port of the receiver (0 picks a free one)")
    secret: SecretStr | None = Field(None, description="HMAC secret shared with MLflow (use the env override)")


class MlflowConfig(_Section):
    """MLflow tracking (one run per fold) and backbone registration."""

    enabled: bool = Field(True, description="log folds and register versions")
    tracking_uri: str | None = Field(None, description="default: sqlite store inside state_dir")
    experiment: str = Field("mergestream", description="experiment holding one run per fold")
    registered_model: str = Field("mergestream-backbone", description="where accepted versions are registered")
    alias: str = Field("champion", description="alias moved to the current version")
    retry_seconds: float = Field(30.0, gt=0, description="retry period for tracking calls that failed (s)")
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    webhook: WebhookConfig = Field(default_factory=WebhookConfig)


class S3NotifyConfig(_Section):
    """Optional receiver of bucket notifications (MinIO webhook target, AWS event records): an
    ObjectCreated event triggers an immediate S3 poll; listing stays the source of truth."""

    enabled: bool = Field(False, description="receive bucket notifications; ObjectCreated triggers a poll")
    host: str = Field("127.0.0.1", description="bind address of the receiver")
    port: int = Field(9110, ge=0, le=65535, description="port of the receiver (0 picks a free one)")
    token: SecretStr | None = Field(None, description="bearer token the notifier sends (use the env override)")


class S3Config(_Section):
    """Take experts from S3-compatible object storage (AWS, MinIO, Ceph, R2); credentials come from
    the standard AWS chain (environment, ~/.aws, instance/container roles), never from this file."""

    enabled: bool = Field(False, description="poll the bucket")
    bucket: str | None = Field(None, description="bucket holding experts (required when enabled)")
    prefix: str = Field("", description="key prefix experts are uploaded under, e.g. experts/")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint; default: AWS")
    region: str | None = Field(None, description="region; default: the AWS chain's, else us-east-1")
    interval_seconds: float = Field(30.0, gt=0, description="poll period (s)")
    cache: bool = Field(True, description="download each expert into state_dir/cache/s3 before folding; "
                                          "false: fold it in place with ranged reads (no local copy)")
    notify: S3NotifyConfig = Field(default_factory=S3NotifyConfig)

    @field_validator("prefix")
    @classmethod
    def _folder_prefix(cls, v: str) -> str:
        v = v.lstrip("/")
        return v if not v or v.endswith("/") else v + "/"

    @model_validator(mode="after")
    def _complete(self) -> S3Config:
        if self.enabled and not self.bucket:
            raise ValueError("s3.enabled needs s3.bucket")
        return self


class PublishConfig(_Section):
    """Mirror every published version to object storage, the pointer object ``current`` last."""

    uri: str | None = Field(None, description="s3://bucket/prefix/ to mirror versions to; default: no mirror")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint; default: s3.endpoint_url")
    region: str | None = Field(None, description="region; default: s3.region")

    @field_validator("uri")
    @classmethod
    def _s3_uri(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith("s3://") or len(v) <= len("s3://") or v[5] == "/"):
            raise ValueError(f"publish.uri must look like s3://bucket/prefix/, got {redact_uris(v)!r}")
        if v is not None and "@" in v[len("s3://"):].partition("/")[0]:
            raise ValueError(f"publish.uri {redact_uris(v)!r} names credentials: an s3:// URI names a bucket, the "
                             "credentials come from the AWS chain (environment, ~/.aws, roles); remove the user@ part")
        return v


FEED_ROLES = ("root", "targets", "snapshot", "timestamp")


class FeedConfig(_Section):
    """Publish a signed update feed (The Update Framework; :mod:`mergestream.feed`) for devices running
    ``mergestream-agent``: rebuilt after every published version and operator rollback, its
    timestamp re-signed while the daemon runs. Needs ``pip install -e '.[feed]' from the checkout``."""

    dir: Path | None = Field(None, description="feed folder to serve over HTTP; default: no feed")
    keys: Path | None = Field(None, description="keys folder of `mergestream feed keygen` (required with dir)")
    patch_format: Literal[FORMAT_NUMBERS] = Field(1, description="2: re-encode the feed's patches with bitmasks")
    zstd_level: int | None = Field(None, ge=1, le=22, description="format 2: zstd level of each payload")
    keep: int | None = Field(None, ge=1, description="only the newest N versions' patches; default: all kept")
    expires: dict[str, str] = Field(default_factory=dict, description="role lifetimes, e.g. {timestamp: 1d, "
                                    "snapshot: 7d, targets: 90d, root: 365d}")
    refresh_seconds: float | None = Field(None, gt=0, description="re-sign the timestamp this often; "
                                          "default: half its lifetime")
    retry_seconds: float = Field(60.0, gt=0, description="longest wait before retrying a failed feed build (s); "
                                 "the first retries come sooner (0.5 s, doubling)")

    @field_validator("expires")
    @classmethod
    def _durations(cls, v: dict[str, str]) -> dict[str, str]:
        from .feed.layout import parse_duration

        for role, text in v.items():
            if role not in FEED_ROLES:
                raise ValueError(f"feed.expires: unknown role {role!r} (roles: {', '.join(FEED_ROLES)})")
            if parse_duration(str(text)) <= 0:
                raise ValueError(f"feed.expires.{role}: must be longer than 0 s")
        return {r: str(t) for r, t in v.items()}

    @model_validator(mode="after")
    def _complete(self) -> FeedConfig:
        if self.dir is not None and self.keys is None:
            raise ValueError("feed.dir needs feed.keys (the folder of `mergestream feed keygen`)")
        if self.zstd_level is not None and self.patch_format != 2:
            raise ValueError("feed.zstd_level needs feed.patch_format: 2")
        life = self.lifetimes().get("timestamp", 86400.0)
        if self.refresh_seconds is not None and self.refresh_seconds >= life:
            raise ValueError(f"feed.refresh_seconds ({self.refresh_seconds:g}) must be shorter than the timestamp's "
                             f"lifetime ({life:g} s), or devices see the feed expire between refreshes")
        return self

    def lifetimes(self) -> dict[str, float]:
        """Seconds each role in :attr:`expires` stays valid (roles not given: the builder's defaults)."""
        from .feed.layout import parse_duration

        return {r: parse_duration(t) for r, t in self.expires.items()}


class MetricsConfig(_Section):
    """Prometheus endpoint (/metrics, /healthz, /readyz)."""

    enabled: bool = Field(True, description="serve /metrics, /healthz and /readyz")
    host: str = Field("127.0.0.1", description="bind address")
    port: int = Field(9108, ge=0, le=65535, description="0 picks a free port")


class ProbeConfig(_Section):
    """One probe: ``type`` is a built-in (weight_space, sentence_similarity, perplexity, classification)
    or ``entrypoint`` (with ``params.target: package.module:function``)."""

    type: str = Field(description="weight_space (always on), sentence_similarity, perplexity, classification, entrypoint")
    params: dict[str, Any] = Field(default_factory=dict, description="the probe's parameters (entrypoint: target)")


class GateRule(_Section):
    """A rule on one probe metric; every set bound must hold for the candidate to be accepted."""

    metric: str = Field(description="probe metric name, e.g. step_drift, sts_spearman, acc.sst2")
    direction: Literal["higher", "lower"] = Field("higher", description="which way is better")
    against: Literal["current", "base", "both"] = Field("current", description="reference for drop limits")
    max_abs_drop: float | None = Field(None, ge=0, description="largest allowed worsening, in metric units")
    max_rel_drop: float | None = Field(None, ge=0, description="largest allowed worsening, fraction of the reference")
    max_value: float | None = Field(None, description="absolute upper bound")
    min_value: float | None = Field(None, description="absolute lower bound")
    max_ratio_to_history: float | None = Field(
        None, gt=0, description="candidate must be <= ratio x median of this metric over accepted folds")
    required: bool = Field(False, description="reject when the metric is missing (default: skip the rule)")


def default_gate_rules() -> list[GateRule]:
    """Safe defaults on the data-free probes: a fold may not move the weights far more than earlier
    folds did (a task vector scaled x50 is rejected), nor drift more than half of ‖θ₀‖ in all."""
    return [
        GateRule(metric="step_drift", direction="lower", max_ratio_to_history=10.0),
        GateRule(metric="relative_drift", direction="lower", max_value=0.5),
    ]


class GateConfig(_Section):
    """Accept / reject rules applied to each candidate's probe values."""

    rules: list[GateRule] = Field(default_factory=default_gate_rules)


class ExecutorConfig(_Section):
    """Where a fold's per-tensor map runs: local threads, or a Ray cluster (the ``ray`` extra; base,
    backbone, experts and state on storage every Ray worker reaches). See docs/scaling.md."""

    kind: Literal["local", "ray"] = Field("local", description="local threads or a Ray cluster")
    address: str | None = Field(None, description="Ray cluster: auto, ray://head:10001 (default: RAY_ADDRESS, "
                                                   "else a local Ray instance)")


class Config(BaseSettings, NumbersNotBooleans):
    """The whole daemon configuration (see ``mergestream init`` for a commented example)."""

    model_config = SettingsConfigDict(extra="forbid", frozen=True, env_prefix="MERGESTREAM_",
                                      env_nested_delimiter="__")

    base: Path = Field(description="the pretrained base θ₀ (file or Hugging Face folder)")
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    inbox: Path = Field(Path("inbox"), description="folder watched for new experts")
    state_dir: Path = Field(Path("state"), description="versions, ledger, lock, caches")
    watch: WatchConfig = Field(default_factory=WatchConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    s3: S3Config = Field(default_factory=S3Config)
    publish: PublishConfig = Field(default_factory=PublishConfig)
    feed: FeedConfig = Field(default_factory=FeedConfig)
    probes: list[ProbeConfig] = Field(default_factory=lambda: [ProbeConfig(type="weight_space")])
    gate: GateConfig = Field(default_factory=GateConfig)
    retention: int = Field(5, ge=1, description="published versions kept (current is never deleted)")
    device: str = Field("cpu", description="math device for folds (cpu, cuda)")
    fold_threads: int = Field(0, ge=0, description="tensor-level worker threads per fold (0: auto, the usable cores up to 4)")
    executor: ExecutorConfig = Field(default_factory=ExecutorConfig)
    torch_threads: int | None = Field(None, ge=1, description="torch.set_num_threads; default: torch's")
    max_shard_bytes: int = Field(5 * 1024**3, gt=0, description="output shard cap (bytes)")
    log_format: Literal["json", "text"] = Field("json", description="structured log lines")
    write_patches: bool = Field(True, description="write versions/N/patch-from-<N-1>.safetensors")
    patch_format: Literal[FORMAT_NUMBERS] = Field(1, description="format of those patches: 1 (index lists, every "
                                        "apply-patch reads it) or 2 (bitmasks, optional zstd)")
    patch_zstd_level: int | None = Field(None, ge=1, le=22, description="format 2: zstd level of each payload")

    @field_validator("probes")
    @classmethod
    def _weight_space_always_on(cls, v: list[ProbeConfig]) -> list[ProbeConfig]:
        if not any(p.type == "weight_space" for p in v):
            v = [ProbeConfig(type="weight_space"), *v]
        return v

    @model_validator(mode="after")
    def _zstd_needs_format_2(self) -> Config:
        if self.patch_zstd_level is not None and self.patch_format != 2:
            raise ValueError("patch_zstd_level needs patch_format: 2")
        return self

    @model_validator(mode="after")
    def _auto_strength_needs_general_probe(self) -> Config:
        if self.policy.strength.mode == "auto" and not any(q.type == "sentence_similarity" for q in self.probes):
            raise ValueError("policy.strength: auto weighs the task probes against general knowledge: add a "
                             "sentence_similarity probe")
        return self

    @model_validator(mode="after")
    def _cmaes_needs_data_probes(self) -> Config:
        p = self.policy
        if _CHECK_POLICY.get() and p.make().searches_coefficients() == "cmaes" and \
                not any(q.type in ("classification", "sentence_similarity") for q in self.probes):
            raise ValueError(f"{p.name} with {p.params} searches its coefficients on the data probes: add a "
                             "classification and/or sentence_similarity probe")
        return self

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings) -> tuple[PydanticBaseSettingsSource, ...]:
        return env_settings, init_settings

    def tracking_uri(self) -> str:
        """The MLflow tracking URI in use (default: sqlite inside the state folder)."""
        return self.mlflow.tracking_uri or f"sqlite:///{(self.state_dir / 'mlflow.db').resolve()}"


def _local_path(value: str | os.PathLike, root: Path) -> Path:
    """``value`` with ``~`` expanded, made absolute against ``root`` when relative."""
    p = Path(os.path.expanduser(os.fspath(value)))
    return p if p.is_absolute() else (root / p).resolve()


_URI_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _local_uri(uri: str | None, root: Path) -> str | None:
    """An MLflow tracking URI whose local store is a relative path, made absolute against ``root``:
    ``sqlite:///rel.db``, ``file:rel`` / ``file:./rel``, or a bare path. Other URIs (``http://``,
    ``databricks``, absolute paths) are returned unchanged."""
    if not uri:
        return uri
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        rest, sep, query = uri[len("sqlite:///"):].partition("?")
        if rest and rest != ":memory:":
            return f"sqlite:///{_local_path(rest, root)}{sep}{query}"
        return uri
    if uri.startswith("file:") and not uri.startswith("file:/"):
        return _local_path(uri[len("file:"):], root).as_uri()
    if _URI_SCHEME.match(uri):
        return uri
    return str(_local_path(uri, root))


def _resolve(cfg: Config, root: Path) -> Config:
    """``cfg`` with every relative path resolved against ``root`` (the config file's folder); see
    the module docstring for the fields. Applied after validation, so values from the file, the
    defaults and the environment are treated alike."""
    ri = cfg.policy.ri
    policy = cfg.policy.model_copy(update={"ri": ri.model_copy(
        update={"data": None if ri.data is None else _local_path(ri.data, root)})})
    probes = [p if p.type == "entrypoint" or not isinstance(p.params.get("data"), (str, os.PathLike))
              else p.model_copy(update={"params": {**p.params, "data": str(_local_path(p.params["data"], root))}})
              for p in cfg.probes]
    reg = cfg.mlflow.registry
    mlflow = cfg.mlflow.model_copy(update={
        "tracking_uri": _local_uri(cfg.mlflow.tracking_uri, root),
        "registry": reg.model_copy(update={"tracking_uri": _local_uri(reg.tracking_uri, root)})})
    feed = cfg.feed.model_copy(update={k: _local_path(v, root) for k in ("dir", "keys")
                                       if (v := getattr(cfg.feed, k)) is not None})
    return cfg.model_copy(update={"base": _local_path(cfg.base, root), "inbox": _local_path(cfg.inbox, root),
                                  "state_dir": _local_path(cfg.state_dir, root), "policy": policy,
                                  "probes": probes, "mlflow": mlflow, "feed": feed})


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader that records every key a mapping repeats (at any depth) in
    :attr:`duplicates` as ``(dotted.key, first line, repeated line)``, lines counted from 1. PyYAML
    itself keeps the last silently. Merge keys (``<<:``) still merge, and an explicit key still
    overrides a merged one, as YAML says."""

    def __init__(self, stream):
        super().__init__(stream)
        self.duplicates: list[tuple[str, int, int]] = []
        self._paths: dict[int, str] = {}  # id(collection node) -> its dotted place in the document

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        where = self._paths.get(id(node), "")
        seen: dict[Any, yaml.Node] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            name = f"{where}.{key}" if where else str(key)
            self._place(value_node, name)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:  # an unhashable key: PyYAML's own construction reports it
                continue
            if first is not key_node:
                self.duplicates.append((name, first.start_mark.line + 1, key_node.start_mark.line + 1))
        return super().construct_mapping(node, deep=deep)

    def _place(self, node: yaml.Node, name: str) -> None:
        self._paths[id(node)] = name
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._place(item, f"{name}[{i}]")


def _read_yaml(text: str) -> tuple[Any, list[tuple[str, int, int]]]:
    """The document in ``text`` (safe types only) and the keys it repeats (see :class:`_StrictLoader`).

    Raises:
        yaml.YAMLError: the text is not YAML.
    """
    loader = _StrictLoader(text)
    try:
        return loader.get_single_data(), sorted(loader.duplicates, key=lambda d: (d[2], d[0]))
    finally:
        loader.dispose()


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error as ``line L, column C: problem (context at line L', column C')`` (without
    PyYAML's quote of the line, which may hold a secret)."""
    def at(mark) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    problem, context = getattr(exc, "problem", None), getattr(exc, "context", None)
    pmark, cmark = getattr(exc, "problem_mark", None), getattr(exc, "context_mark", None)
    text = f"{at(pmark)}: " if pmark else ""
    text += str(problem or context or type(exc).__name__)
    if problem and context:
        text += f" ({context}" + (f" at {at(cmark)}" if cmark else "") + ")"
    return text


def _explain(err: dict[str, Any]) -> str:
    """One validation error of :class:`Config` as ``where: message``: an unknown key gets the closest
    known one (:func:`~mergestream.settings_base.unknown_key_hint`), and a value that came from the
    environment names its variable (never its value: it may be a secret)."""
    loc = tuple(err["loc"])
    msg = unknown_key_hint(Config, loc) if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
    env = env_variable_of(loc)
    return f"{'.'.join(map(str, loc))}: {msg}" + (f" (from the environment variable {env})" if env else "")


def env_variable_of(loc: tuple[Any, ...]) -> str | None:
    """The ``MERGESTREAM_…`` variable that set the value at ``loc``, if one did: the field's own
    (``MERGESTREAM_MLFLOW__TRACKING_URI``), or a whole section's (``MERGESTREAM_MLFLOW``, a JSON
    object) when that object holds the field (pydantic-settings merges it with the file's keys).
    Environment variables win over the file (:meth:`Config.settings_customise_sources`)."""
    env = {k.upper(): v for k, v in os.environ.items()}
    keys = list(itertools.takewhile(lambda part: isinstance(part, str), loc))  # a variable names keys only
    for i in range(len(keys), 0, -1):  # the field's own variable first, then its sections'
        name = "MERGESTREAM_" + "__".join(k.upper() for k in keys[:i])
        if name in env and (i == len(loc) or _holds(env[name], loc[i:])):
            return name
    return None


def _holds(text: str, rest: tuple[Any, ...]) -> bool:
    """A JSON document ``text`` has a value at the path ``rest`` (keys and list indices)."""
    try:
        node: Any = json.loads(text)
    except ValueError:
        return False
    for part in rest:
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            return False
    return True


def load_config(path: str | os.PathLike, *, check_policy: bool = True) -> Config:
    """Read and validate a YAML config; environment overrides win. Relative paths (written,
    defaulted or from the environment) are resolved against the folder of ``path``. No message
    quotes a secret: URIs are redacted (:mod:`mergestream.redaction`), YAML errors give a line and
    column, not the line.

    ``check_policy`` False (``status``, ``history``, ``rollback`` sent to a running daemon): the
    policy is kept as written, not built, and torch is not imported (the daemon checked it).

    Raises:
        ConfigError: missing/unreadable file, YAML syntax, a key repeated in one mapping (naming
            it and both lines), or validation errors (all listed).
    """
    p = Path(path)
    try:
        data, duplicates = _read_yaml(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {p} not found") from None
    except OSError as exc:
        raise ConfigError(f"config file {p} cannot be read: {exc.strerror or type(exc).__name__}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text (byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: invalid YAML: {_yaml_problem(exc)}") from None
    except RecursionError:
        raise ConfigError(f"{p}: invalid YAML: nested too deep") from None
    if duplicates:
        raise ConfigError(f"{p}: " + "; ".join(f"key {k} given twice (line {a} and line {b})" for k, a, b in duplicates)
                          + ": YAML would silently keep the later one; keep one")
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping")
    odd = [k for k in data if not isinstance(k, str)]
    if odd:
        raise ConfigError(f"{p}: top-level key {odd[0]!r} is not a name: keys are words such as base, policy, gate")
    token = _CHECK_POLICY.set(check_policy)
    try:
        cfg = Config(**data)
    except ValidationError as exc:
        raise ConfigError(f"{p}: " + "; ".join(_explain(e) for e in exc.errors())) from None
    finally:
        _CHECK_POLICY.reset(token)
    return _resolve(cfg, p.resolve().parent)
