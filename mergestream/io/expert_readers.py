"""What the fold reads as an expert: a dense checkpoint or a PEFT LoRA adapter, both seen as task
vectors τ = θ − θ₀, and the one content hash that identifies an expert.

:func:`open_expert` opens either against θ₀; :class:`LoraExpert` presents an adapter as dense
deltas τ = scaling · B @ A per target weight (Hu et al. 2021, LoRA, eq. 3; rsLoRA scaling from
Kalajdzievski 2023). :func:`content_sha256` is the ledger's, the manifest's and the output
metadata's hash of an expert. Dense tensors are read through :mod:`mergestream.io.checkpoints`.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from pathlib import Path
from typing import Protocol

import torch

from ..errors import (
    CorruptCheckpointError,
    ExtraKeyError,
    MissingShardError,
    ModifiedBaseAdapterError,
    NonFiniteError,
    ObjectChangedError,
    ObjectGoneError,
    OutsideRootError,
    ShapeMismatchError,
    UnsupportedCheckpointError,
    VocabularyGrownError,
)
from .checkpoints import (
    Checkpoint,
    TensorMeta,
    check_not_quantized,
    count_non_finite,
    file_sha256,
    folder_file,
    is_embedding_name,
    open_checkpoint,
    open_safetensors_file,
)
from .paths import confined_files
from .s3_checkpoint import is_s3_path
from .st import WEIGHTS_HASH_VERSION, json_type, load_json, weights_hash_version


class Expert(Protocol):
    """What the engine needs of an expert: its tensors' metadata and its task vector per tensor."""

    path: Path

    def keys(self) -> list[str]: ...

    def meta(self, name: str) -> TensorMeta: ...

    def task_vector(self, name: str, base: torch.Tensor) -> torch.Tensor:
        """τ for ``name`` as float32, given θ₀'s tensor (any dtype, same shape)."""
        ...

    def sha256(self, version: int = WEIGHTS_HASH_VERSION) -> str: ...

    def close(self) -> None: ...


class DenseExpert:
    """A full fine-tuned checkpoint used as an expert: τ = θ − θ₀ computed in float32."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self.path = ckpt.path

    def keys(self) -> list[str]:
        return self.ckpt.keys()

    def meta(self, name: str) -> TensorMeta:
        return self.ckpt.meta(name)

    def get(self, name: str) -> torch.Tensor:
        return self.ckpt.get(name)

    def task_vector(self, name: str, base: torch.Tensor) -> torch.Tensor:
        """τ = θ − θ₀ in float32 (computed in place in the freshly read expert buffer)."""
        t = self.ckpt.get(name)
        t = t.float() if t.dtype != torch.float32 else t
        return t.sub_(base.to(t.device, torch.float32))

    def sha256(self, version: int = WEIGHTS_HASH_VERSION) -> str:
        """The content hash (:func:`content_sha256`; ``version`` 1 for an older record)."""
        return self.ckpt.sha256(version)

    def close(self) -> None:
        self.ckpt.close()


_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B)"
                       r"(?:\.(?P<adapter>[^.]+))?(?:\.weight)?$")
_LORA_UNSUPPORTED_FLAGS = {
    "use_dora": "DoRA (weight-decomposed LoRA) cannot be represented as a dense additive delta",
    "lora_bias": "LoRA with a trained bias term is not supported",
    "layer_replication": "layer replication changes the architecture",
    "target_parameters": "LoRA on raw parameters (target_parameters) is not supported",
}
#: string ``init_lora_weights`` values that leave the base weights untouched (as do True and False)
_BASE_KEEPING_INITS = ("gaussian", "eva", "orthogonal")
#: ``init_lora_weights`` prefixes of initialisations that rewrite the base at init, and why
_BASE_CHANGING_INITS = {
    "pissa": "PiSSA moved the base's principal components into the adapter (W_res = W - B0 @ A0)",
    "olora": "OLoRA moved a QR factor of the base into the adapter (W_res = W - scale * B0 @ A0)",
    "corda": "CorDA moved context-oriented components of the base into the adapter (W_res = W - B0 @ A0)",
    "lora_ga": "LoRA-GA subtracted its gradient-based initial product from the base (W - scale * B0 @ A0)",
    "loftq": "LoftQ replaced the base by a quantized residual of it (Q(W - B0 @ A0))",
}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_adapter_types(cfg: dict, where: Path) -> None:
    """The types of the ``adapter_config.json`` fields the reader uses (numbers, patterns).

    Raises:
        CorruptCheckpointError: naming the field and the JSON type found.
    """
    for key in ("lora_alpha", "r"):
        if cfg.get(key) is not None and not _number(cfg[key]):
            raise CorruptCheckpointError(f"{where}: {key} must be a number, got {json_type(cfg[key])}")
    for key in ("alpha_pattern", "rank_pattern"):
        pattern = cfg.get(key) or {}
        if not isinstance(pattern, dict) or not all(_number(v) for v in pattern.values()):
            raise CorruptCheckpointError(f"{where}: {key} must map module patterns to numbers")
    if not isinstance(cfg.get("peft_type", "LORA"), str):
        raise CorruptCheckpointError(f"{where}: peft_type must be a string, got {json_type(cfg['peft_type'])}")


def check_adapter_init(cfg: dict, folder: Path) -> None:
    """Refuse an adapter whose initialisation rewrote the base it was trained on.

    PEFT's ``init_lora_weights`` of ``pissa``/``pissa_niter_N``, ``olora``, ``corda``, ``lora_ga``
    and ``loftq`` subtract the adapter's initial product from the base weights (or quantize them),
    so the fine-tuned model is that modified base plus ``scale · B @ A``, not θ₀ plus it. Allowed:
    ``True``/``False``/``gaussian``/``eva``/``orthogonal`` (the base untouched), and adapters PEFT
    converted with ``save_pretrained(path_initial_model_for_weight_conversion=...)`` (saved with
    ``init_lora_weights: true``).

    Raises:
        ModifiedBaseAdapterError: naming the init method, for those and any value not known to
            keep the base.
    """
    init = cfg.get("init_lora_weights", True)
    key = init.lower() if isinstance(init, str) else ""
    if init is True or init is False or key in _BASE_KEEPING_INITS:
        return
    why = next((w for k, w in _BASE_CHANGING_INITS.items() if key.startswith(k)),
               "it is not known to leave the base weights unchanged")
    raise ModifiedBaseAdapterError(
        f"{folder}: unsupported adapter: init_lora_weights={init!r}: {why}, so the adapter was trained on a "
        "modified base and scale*B@A added to the base is not the fine-tuned model. Convert it to a plain "
        "LoRA first (PEFT: save_pretrained(..., path_initial_model_for_weight_conversion=...)) or merge it "
        "with PEFT and fold the dense model")


def pattern_value(patterns: dict, module: str, default):
    """The value of the first key of ``patterns`` (a PEFT ``rank_pattern``/``alpha_pattern``, in
    the config's order) that matches ``module``, else ``default``.

    PEFT's own rule (``peft.utils.other.get_pattern_key``): key ``k`` matches module name ``m``
    when ``re.match(rf"(.*\\.)?({k})$", m)``, so ``q_proj`` matches ``layers.0.attn.q_proj`` and
    ``q_proj|v_proj`` is an alternation of whole trailing names; the first match wins.

    Raises:
        CorruptCheckpointError: a key is not a valid regular expression.
    """
    for key, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        except re.error as exc:
            raise CorruptCheckpointError(f"adapter pattern key {key!r} is not a regular expression ({exc})") from exc
    return default


class LoraExpert:
    """A PEFT LoRA adapter folder presented as dense task vectors.

    For each target weight W (out × in): τ = scaling · B @ A with scaling = lora_alpha / r, or
    lora_alpha / √r with ``use_rslora`` (Kalajdzievski 2023, rsLoRA). ``fan_in_fan_out`` transposes
    the delta (Conv1D-style weights stored in × out); embedding adapters use τ = (B @ A)ᵀ. Weights
    the adapter does not target have τ = 0. ``alpha_pattern`` and ``rank_pattern`` are matched
    against the adapter's module names as PEFT matches them (:func:`pattern_value`).

    Raises:
        UnsupportedCheckpointError: DoRA, a non-LORA ``peft_type``, ``modules_to_save``, trained
            LoRA biases, conv LoRA, or any other variant that is not ``scale · B @ A``.
        ModifiedBaseAdapterError: an initialisation that rewrote the base (:func:`check_adapter_init`).
        CorruptCheckpointError: a module's ``lora_A`` rank is not the rank its config gives it.
    """

    def __init__(self, folder: Path, base_keys: list[str], base_meta):
        self.path = folder
        cfg_path = folder_file(folder, "adapter_config.json")
        cfg = load_json(cfg_path.read_bytes(), str(cfg_path), error=CorruptCheckpointError)
        _check_adapter_types(cfg, cfg_path)
        self.config = cfg
        peft_type = str(cfg.get("peft_type", "LORA")).upper()
        if peft_type != "LORA":
            raise UnsupportedCheckpointError(f"{folder}: peft_type {peft_type} is not LoRA; only LoRA adapters fold")
        for flag, why in _LORA_UNSUPPORTED_FLAGS.items():
            if cfg.get(flag):
                raise UnsupportedCheckpointError(f"{folder}: adapter sets {flag}: {why}")
        if cfg.get("modules_to_save"):
            raise UnsupportedCheckpointError(
                f"{folder}: adapter has modules_to_save {cfg['modules_to_save']}: full module copies are "
                "not a LoRA delta; merge them into a dense expert first")
        check_adapter_init(cfg, folder)
        weights = folder / "adapter_model.safetensors"
        if not weights.is_file():
            legacy = folder / "adapter_model.bin"
            if legacy.is_file():
                self._ckpt = open_checkpoint(folder_file(folder, legacy.name))
            else:
                raise UnsupportedCheckpointError(f"{folder}: adapter_model.safetensors is missing")
        else:
            self._ckpt = open_safetensors_file(folder_file(folder, weights.name))
        self.fan_in_fan_out = bool(cfg.get("fan_in_fan_out", False))
        self.use_rslora = bool(cfg.get("use_rslora", False))
        self.lora_alpha = float(cfg.get("lora_alpha", 8))
        self.alpha_pattern: dict[str, float] = cfg.get("alpha_pattern") or {}
        self.rank_pattern: dict[str, int] = cfg.get("rank_pattern") or {}
        pairs: dict[str, dict[str, str]] = {}
        #: copies of base weights PEFT saves for targeted embeddings ({base key: adapter key});
        #: validation requires them to equal θ₀.
        self.base_layer_copies: dict[str, str] = {}
        base_set = set(base_keys)
        for k in self._ckpt.keys():
            if ".base_layer." in k:
                target = self._resolve(k.removeprefix("base_model.model.").replace(".base_layer.", "."), base_set)
                if target is None:
                    raise ExtraKeyError(f"adapter {folder} ships {k!r}, which matches no tensor of the base")
                self.base_layer_copies[target] = k
                continue
            m = _LORA_KEY.match(k)
            if not m:
                raise UnsupportedCheckpointError(f"{folder}: adapter tensor {k!r} is not a LoRA A/B matrix")
            module = m["module"]
            if module.startswith("base_model.model."):
                module = module[len("base_model.model."):]
            kind = m["kind"].replace("embedding_", "")
            pairs.setdefault(module, {})[kind] = k
            if "embedding" in m["kind"]:
                pairs[module]["embedding"] = "1"
        self._targets: dict[str, dict[str, str]] = {}
        for module, kinds in pairs.items():
            if "lora_A" not in kinds or "lora_B" not in kinds:
                raise CorruptCheckpointError(f"{folder}: module {module!r} has only one of lora_A / lora_B")
            a_shape = self._ckpt.meta(kinds["lora_A"]).shape
            if len(a_shape) != 2:
                raise UnsupportedCheckpointError(
                    f"{folder}: module {module!r} has a {len(a_shape)}-D LoRA matrix (conv LoRA is not supported)")
            r = pattern_value(self.rank_pattern, module, cfg.get("r"))
            if r is not None and int(r) != a_shape[0]:
                raise CorruptCheckpointError(
                    f"{folder}: module {module!r} has lora_A of rank {a_shape[0]} but its config gives r={r}")
            target = self._resolve(module + ".weight", base_set)
            if target is None:
                raise ExtraKeyError(
                    f"LoRA target {module}.weight (adapter {folder}) has no matching tensor in the base")
            self._targets[target] = {**kinds, "module": module}
        self._base_meta = base_meta
        self._sha: str | None = None

    @staticmethod
    def _resolve(key: str, base_set: set[str]) -> str | None:
        if key in base_set:
            return key
        hits = [b for b in base_set if b.endswith("." + key) or key.endswith("." + b)]
        return hits[0] if len(hits) == 1 else None

    def _scaling(self, module: str, r: int) -> float:
        """PEFT's scaling of ``module`` (the adapter's module name): alpha / r, or alpha / √r."""
        alpha = float(pattern_value(self.alpha_pattern, module, self.lora_alpha))
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def adapter_meta(self, key: str) -> TensorMeta:
        """Shape/dtype of a raw adapter tensor."""
        return self._ckpt.meta(key)

    def adapter_tensor(self, key: str) -> torch.Tensor:
        """A raw adapter tensor as stored."""
        return self._ckpt.get(key)

    def keys(self) -> list[str]:
        """The base weights this adapter changes (others have τ = 0)."""
        return list(self._targets)

    def meta(self, name: str) -> TensorMeta:
        return self._base_meta(name)

    def delta_shape(self, name: str) -> tuple[int, ...]:
        kinds = self._targets[name]
        a = self._ckpt.meta(kinds["lora_A"]).shape
        b = self._ckpt.meta(kinds["lora_B"]).shape
        shape = (b[0], a[1])
        if self.fan_in_fan_out or "embedding" in kinds:
            shape = shape[::-1]
        return shape

    def task_vector(self, name: str, base: torch.Tensor) -> torch.Tensor:
        """τ = scaling · B @ A (float32) for a target; zeros of θ₀'s shape otherwise."""
        kinds = self._targets.get(name)
        if kinds is None:
            return torch.zeros(base.shape, dtype=torch.float32, device=base.device)
        a = self._ckpt.get(kinds["lora_A"]).to(base.device, torch.float32)
        b = self._ckpt.get(kinds["lora_B"]).to(base.device, torch.float32)
        delta = (b @ a).mul_(self._scaling(kinds["module"], a.shape[0]))
        if self.fan_in_fan_out or "embedding" in kinds:
            delta = delta.T.contiguous()
        return delta

    def sha256(self, version: int = WEIGHTS_HASH_VERSION) -> str:
        """The adapter's content hash (:func:`content_sha256`; ``version`` 1 for an older record)."""
        if version != WEIGHTS_HASH_VERSION:
            return content_sha256(self.path, version=version)
        if self._sha is None:
            self._sha = content_sha256(self.path)
        return self._sha

    def close(self) -> None:
        self._ckpt.close()

    #: validate_against_base hands an adapter to :meth:`validate_against`
    is_adapter = True

    def validate_against(self, base: Checkpoint, *, role: str = "expert", check_finite: bool = True) -> None:
        """Check the adapter against θ₀: saved base-layer copies equal θ₀, every delta B @ A has its
        target's shape, and (``check_finite``) every delta is finite.

        Raises:
            VocabularyGrownError, ShapeMismatchError: a base-layer copy or a delta of another shape.
            UnsupportedCheckpointError: a saved base-layer copy differs from θ₀.
            QuantizedCheckpointError: the adapter's own tensors are quantized (fp8, scales).
            NonFiniteError: a delta holds NaN or ±Inf.
        """
        where = str(self.path)
        check_not_quantized(self._ckpt, f"{role} (LoRA adapter)")
        for name, key in self.base_layer_copies.items():
            want, got = base.meta(name), self.adapter_meta(key)
            if got.shape != want.shape:
                if is_embedding_name(name):
                    raise VocabularyGrownError(
                        f"tensor {name}: {role} {where} ships a base layer with {got.shape[0]} rows, base "
                        f"{base.path} has {want.shape[0]}: the vocabulary was resized. Hint: resize the base's "
                        "embeddings the same way before merging")
                raise ShapeMismatchError(f"tensor {name}: shape {list(got.shape)} in {role} {where} vs "
                                         f"{list(want.shape)} in base {base.path}")
            if not torch.equal(self.adapter_tensor(key), base.get(name)):
                raise UnsupportedCheckpointError(
                    f"tensor {name}: {role} {where} ships a modified copy of the base layer; only scale·B@A deltas fold")
        for name in self.keys():
            want = base.meta(name).shape
            got = self.delta_shape(name)
            if got != want:
                raise ShapeMismatchError(
                    f"LoRA delta for {name}: shape {list(got)} in {role} {where} vs {list(want)} in base {base.path}")
        if check_finite:
            for name in self.keys():
                tau = self.task_vector(name, torch.zeros(()))
                if count_non_finite(tau):
                    raise NonFiniteError(f"tensor {name}: LoRA delta of {role} {where} holds NaN or Inf")


def is_lora_adapter(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "adapter_config.json").is_file()


def open_expert(path: str | os.PathLike, base: Checkpoint) -> DenseExpert | LoraExpert:
    """Open an expert against its base θ₀: a dense checkpoint or a PEFT LoRA adapter folder; a
    dense checkpoint may be in object storage (``s3://`` or a ``*.s3ref.json`` reference).

    A legacy pickle's wrapper prefix (``module.``, ``model.``) is stripped when θ₀'s names lack it
    (:func:`~mergestream.io.checkpoints.open_checkpoint`). Raises what :class:`LoraExpert` and
    :func:`~mergestream.io.checkpoints.open_checkpoint` raise.
    """
    if is_lora_adapter(path):
        return LoraExpert(Path(path), base.keys(), base.meta)
    return DenseExpert(open_checkpoint(path, expect_keys=base.keys()))


def content_sha256(path: str | os.PathLike, within: str | os.PathLike | None = None,
                   version: int = WEIGHTS_HASH_VERSION) -> str:
    """The one content hash of an expert (64 hex characters), whatever its form.

    - a dense safetensors checkpoint (file, folder, sharded): the weights hash of
      :mod:`mergestream.io.st` (independent of file names, sharding, header layout and metadata);
    - a PEFT LoRA adapter folder: sha256 of a tag, ``adapter_config.json``'s bytes and the
      adapter weights' content hash;
    - anything else (legacy pickle, a file that does not parse): sha256 of a tag and the bytes of
      its files (a folder's files in relative-name order, a ``READY`` marker excluded), so a corrupt
      expert still gets one stable identity.

    The engine computes the same value for a dense expert on the fold's own pass. An expert in
    object storage (an ``s3://`` URI or a ``*.s3ref.json`` reference) is hashed the same way,
    streamed with ranged GETs; one whose content does not parse is identified by its reference
    file's bytes (its bucket, keys and ETags), and a URI that does not parse raises.

    ``within``: where a folder's files may resolve to through symlinks (the daemon passes the inbox
    a folder expert arrived in: the fold reads its kept copy, links resolved, and must get the same
    hash); default the folder itself. ``version``: of the weights hash (2, current; 1 to verify a
    record written before version 2, :func:`hash_matches`).

    Raises:
        ObjectGoneError, ObjectChangedError: an expert in object storage was deleted or replaced
            (and the other errors of :func:`~mergestream.io.checkpoints.open_checkpoint` for a URI).
    """
    if is_s3_path(path):
        try:
            with open_checkpoint(path) as ck:
                return ck.sha256(version)
        except (ObjectGoneError, ObjectChangedError):
            raise
        except (CorruptCheckpointError, UnsupportedCheckpointError, MissingShardError):
            if not Path(path).is_file():
                raise
            return file_sha256([Path(path)])
    p = Path(path)
    try:
        if is_lora_adapter(p):
            cfg = folder_file(p, "adapter_config.json", within).read_bytes()
            weights = p / "adapter_model.safetensors"
            inner = content_sha256(folder_file(p, weights.name if weights.is_file() else "adapter_model.bin", within),
                                   version=version)
            tag = f"mergestream-adapter-sha256/{version}\x00".encode()  # the adapter tag follows the weights hash's
            return hashlib.sha256(tag + cfg + bytes.fromhex(inner)).hexdigest()
        with open_checkpoint(p, within=within) as ck:
            return ck.sha256(version)
    except (CorruptCheckpointError, UnsupportedCheckpointError, MissingShardError, OutsideRootError,
            FileNotFoundError, OSError):
        pass
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and f.name != "READY")
    return file_sha256(files)


def arrival_key(path: str | os.PathLike, within: str | os.PathLike | None = None) -> str | None:
    """A cheap identity of an expert as it arrived, from file metadata only (no tensor byte read):
    sha256 (64 hex) over a tag and, for each of its files in relative-name order (links inside
    ``within`` followed, as :func:`content_sha256` and the daemon's kept copy see them), the name,
    size in bytes, modification time (ns) and inode; a ``*.s3ref.json`` reference by its own bytes
    (its bucket, keys and ETags). The daemon queues an expert under this key and learns its
    :func:`content_sha256` on the fold's own pass, so an expert is read once per fold, not twice.

    The same file announced again (a rescan, a restart) has the same key; a file rewritten in
    place (new mtime) or replaced (new inode) has another. Two copies of one content have
    different keys: content duplicates are found once the fold has read them.

    Returns:
        The key, or None for an ``s3://`` URI (nothing local to look at: hash the content instead).

    Raises:
        OSError: the path is gone or unreadable.
    """
    if is_s3_path(path) and not Path(path).is_file():
        return None
    p = Path(path)
    h = hashlib.sha256(b"mergestream-arrival/1\x00")
    if p.is_file() and p.name.endswith(".s3ref.json"):
        h.update(p.read_bytes())
        return h.hexdigest()
    try:
        files = confined_files(p, within if within is not None else (p if p.is_dir() else p.parent), str(p),
                               error=OutsideRootError)
    except OutsideRootError:  # refused when it is kept; named here by its links, not what they point at
        files = [(f.relative_to(p), f) for f in sorted(p.rglob("*"))] if p.is_dir() else [(Path(p.name), p)]
    for rel, real in files:
        if p.is_dir() and rel.name == "READY":  # the folder source's marker, not the expert (as content_sha256)
            continue
        st_ = os.stat(real, follow_symlinks=False)
        h.update(f"{rel.as_posix()}\x00{st_.st_size}\x00{st_.st_mtime_ns}\x00{st_.st_ino}\x00".encode())
    if not files:
        os.stat(p)  # a folder that is gone raises; an empty one still has a key
    return h.hexdigest()


def hash_matches(path: str | os.PathLike, sha: str, within: str | os.PathLike | None = None,
                 kind: str | None = None) -> bool:
    """Whether the expert at ``path`` still has the content hash a record holds: of the version the
    record's ``kind`` names (``FoldRecord.sha256_kind``), or, for a record that names none (the
    ledger), of the current version and else of version 1 (a record written before version 2:
    read a second time, only then). Raises as :func:`content_sha256`."""
    version = weights_hash_version(kind)
    if version is not None:
        return content_sha256(path, within, version) == sha
    return content_sha256(path, within) == sha or content_sha256(path, within, 1) == sha
