"""Read-only views of checkpoints: sizes, dtypes, task-vector geometry (``mergestream inspect``),
and the streaming weight-space statistics the daemon's weight-space probe reports (drift from θ₀,
energy of a step in θ₀'s top singular subspaces, Gram matrices of contributions).

Every statistic is one pass over the tensors, read one at a time (or in row chunks) through
:class:`~mergestream.io.checkpoints.Checkpoint`, with float32 math per tensor and float64 sums across
tensors; the linear algebra is :mod:`mergestream.engine.linalg`.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CorruptCheckpointError, MergestreamError
from ..io.checkpoints import (
    Checkpoint,
    TensorMeta,
    default_expert_id,
    folder_file,
    is_float_dtype,
    open_checkpoint,
    validate_against_base,
)
from ..io.expert_readers import content_sha256, open_expert
from ..io.s3_checkpoint import is_s3_uri
from ..io.st import load_json
from .linalg import cosine_matrix, subspace_energy, top_singular_vectors
from .stream import clear_scratch, float32_scratch, scratch


def resolve_device(device: str | torch.device) -> torch.device:
    """Validate a math device (``cpu``, ``cuda``, ``cuda:1``); raises MergestreamError if unusable."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MergestreamError(f"device {device!r} requested but CUDA is not available")
    return dev


def task_vector_stats(base: str | os.PathLike, experts: list[str | os.PathLike],
                      device: str = "cpu") -> dict[str, Any]:
    """One streaming pass of sums: ‖τᵢ‖ and the pairwise cosines cos(τᵢ, τⱼ) over the whole model.

    Returns:
        ``{"ids": [...], "norms": [K floats], "cosine": K×K nested list}``.

    Raises:
        ValidationError subclasses if an expert does not fit θ₀.
    """
    dev = resolve_device(device)
    base_ck = open_checkpoint(base)
    exps = [open_expert(e, base_ck) for e in experts]
    try:
        for e in exps:
            validate_against_base(base_ck, e, check_finite=False)
        k = len(exps)
        gram = torch.zeros(k, k, dtype=torch.float64)
        for m in base_ck.metas():
            if not is_float_dtype(m.dtype):
                continue
            b = base_ck.get(m.name).to(dev, torch.float32)
            taus = torch.stack([e.task_vector(m.name, b).to(dev).reshape(-1) for e in exps]).double()
            gram += (taus @ taus.T).cpu()
        cos = cosine_matrix(gram).tolist()
        return {"ids": [default_expert_id(e) for e in experts], "norms": gram.diagonal().sqrt().tolist(),
                "cosine": cos}
    finally:
        for e in exps:
            e.close()


@dataclass(frozen=True)
class DriftSums:
    """Sums of squares (float64 across tensors) from one pass of :func:`drift_sums`.

    Attributes:
        base_sq: Σ‖θ₀‖² over the tensors.
        drift_sq: Σ‖θ_cand − θ₀‖².
        step_sq: Σ‖Δ‖², Δ = θ_cand − θ_prev (θ_prev = θ₀ when there is no previous backbone).
        step2d_sq: Σ‖Δ‖² over the 2-D tensors only.
        inside_sq: Σ‖U₀ᵀ Δ V₀‖² over the 2-D tensors (U₀, V₀: θ₀'s top-k singular vectors).
    """

    base_sq: float
    drift_sq: float
    step_sq: float
    step2d_sq: float
    inside_sq: float


def drift_sums(base: Checkpoint, candidate: Checkpoint, previous: Checkpoint | None, metas: list[TensorMeta], *,
               k: int, svd: str = "auto", device: str | torch.device = "cpu",
               bases: MutableMapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> DriftSums:
    """Drift of a candidate from θ₀ and the energy of its step in θ₀'s general subspace (the
    general-knowledge risk SAFE-Merge measures, Qiu et al. 2026), streamed tensor by tensor.

    Args:
        metas: the tensors to measure (θ₀'s float tensors); the caller has checked that
            ``candidate`` and ``previous`` hold them with θ₀'s shapes.
        k: rank of θ₀'s subspace per 2-D tensor (capped at min(m, n)).
        svd: ``auto``, ``exact`` or ``lowrank`` (:func:`mergestream.engine.linalg.top_singular_vectors`).
        device: where the float32 math runs.
        bases: a cache of (U₀ m×k, V₀ n×k) CPU float32 per tensor name for this θ₀, k and svd;
            filled for the tensors it lacks (None: nothing is cached).

    Returns:
        :class:`DriftSums`.
    """
    dev = torch.device(device)
    bases = {} if bases is None else bases
    base_sq = drift_sq = step_sq = step2d_sq = inside_sq = 0.0
    try:
        for m in metas:
            sums = _drift_tensor(base, candidate, previous, m, k, svd, dev, bases)
            base_sq, drift_sq, step_sq = base_sq + sums[0], drift_sq + sums[1], step_sq + sums[2]
            step2d_sq, inside_sq = step2d_sq + sums[3], inside_sq + sums[4]
    finally:
        clear_scratch()  # the probe thread lives on: its buffers must not
    return DriftSums(base_sq, drift_sq, step_sq, step2d_sq, inside_sq)


def _drift_tensor(base: Checkpoint, candidate: Checkpoint, previous: Checkpoint | None, m: TensorMeta, k: int,
                  svd: str, dev: torch.device, bases: MutableMapping) -> tuple[float, float, float, float, float]:
    """One tensor's (‖θ₀‖², ‖θ − θ₀‖², ‖step‖², 2-D ‖step‖², in-subspace energy) for :func:`drift_sums`,
    in this thread's scratch buffers (fresh tensor-sized copies cost page faults several times the math)."""
    step2d_sq = inside_sq = 0.0
    b = float32_scratch(base, m.name, "drift.base", dev)
    c = float32_scratch(candidate, m.name, "drift.cand", dev)
    p = float32_scratch(previous, m.name, "drift.prev", dev) if previous is not None else b
    step = torch.sub(c, p, out=scratch("drift.step", m.numel, torch.float32, dev).view(m.shape))
    del p
    s2 = float(torch.linalg.vector_norm(step)) ** 2
    if len(m.shape) == 2:
        step2d_sq = s2
        uv = bases.get(m.name)
        if uv is None:
            u, v = top_singular_vectors(b, k, svd)
            uv = bases[m.name] = (u.cpu(), v.cpu())
        u, v = (x.to(dev) for x in uv)
        if s2 > 0.0:
            inside_sq = subspace_energy(step, u, v)
    del step
    base_sq = float(torch.linalg.vector_norm(b)) ** 2
    drift_sq = float(torch.linalg.vector_norm(c.sub_(b))) ** 2  # c is our scratch copy
    return base_sq, drift_sq, s2, step2d_sq, inside_sq


def _read_rows(ck: Checkpoint, name: str, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of tensor ``name`` (along its first dimension), flat, in its stored dtype."""
    m = ck.meta(name)
    row_bytes = m.nbytes // m.shape[0]
    buf = torch.empty((stop - start) * row_bytes, dtype=torch.uint8)
    return ck.read_into(name, buf, start * row_bytes).view(m.dtype)


def gram_matrix(checkpoints: list[Checkpoint], metas: list[TensorMeta], *, chunk_bytes: int,
                device: str | torch.device = "cpu") -> torch.Tensor:
    """Gram matrix G[i, j] = ⟨cᵢ, cⱼ⟩ (float64 CPU, N×N) of N checkpoints over the tensors ``metas``.

    Tensors are read in row chunks through :meth:`Checkpoint.read_into` so that at most
    ``chunk_bytes`` of stacked float64 slices are held at once (a larger single row is read alone);
    the result does not depend on the chunking beyond float64 rounding.

    Args:
        metas: the tensors (names and shapes) every checkpoint holds; checked by the caller.
        chunk_bytes: memory cap (bytes) of the stacked slices.
        device: where the products run.
    """
    dev = torch.device(device)
    n = len(checkpoints)
    gram = torch.zeros(n, n, dtype=torch.float64)
    for m in metas:
        rows = m.shape[0] if m.shape else 1
        row_elems = max(1, m.numel // max(rows, 1))
        # float64 slices (8 bytes per element)
        whole = not m.shape or n * m.numel * 8 <= chunk_bytes
        step = rows if whole else max(1, chunk_bytes // (n * row_elems * 8))
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            x = torch.empty(n, (stop - start) * row_elems, dtype=torch.float64, device=dev)
            for i, ck in enumerate(checkpoints):
                part = ck.get(m.name) if whole else _read_rows(ck, m.name, start, stop)
                x[i].copy_(part.reshape(-1))
            gram += (x @ x.T).cpu()
            del x
    return gram


def describe(path: str | os.PathLike, content_hash: bool = True) -> dict[str, Any]:
    """Tensor count, dtypes (count and bytes per dtype), total bytes, metadata and content hash of a
    checkpoint.

    Args:
        content_hash: also ``weights_sha256``, the one content hash of
            :func:`~mergestream.io.expert_readers.content_sha256` (a dense checkpoint: its weights
            hash, which the ledger, ``fold.json``, the model card, patches and the feed show; a LoRA
            adapter: the hash a fold records for it). Reads every tensor's bytes once; False: headers only.
    """
    remote = is_s3_uri(path)  # read in place; a Path would fold "s3://" into "s3:/"
    p = path if remote else Path(path)
    if not remote and (p / "adapter_config.json").exists():
        cfg_path = folder_file(p, "adapter_config.json")
        cfg = load_json(cfg_path.read_bytes(), str(cfg_path), error=CorruptCheckpointError)
        ck = open_checkpoint(folder_file(p, "adapter_model.safetensors"))
        kind = "lora"
    else:
        cfg, ck, kind = None, open_checkpoint(p), "dense"
    dtypes: dict[str, dict[str, int]] = {}
    for m in ck.metas():
        d = dtypes.setdefault(str(m.dtype).replace("torch.", ""), {"tensors": 0, "bytes": 0})
        d["tensors"] += 1
        d["bytes"] += m.nbytes
    info = {"path": str(p), "kind": kind, "tensors": len(ck.keys()), "bytes": ck.nbytes, "dtypes": dtypes,
            "files": [f.name for f in ck.weight_files],
            "metadata": {k: v for k, v in ck.metadata().items() if k.startswith("mergestream.")}}
    if cfg is not None:
        info["lora"] = {k: cfg.get(k) for k in ("r", "lora_alpha", "use_rslora", "fan_in_fan_out", "target_modules")}
    ck.close()
    if content_hash:
        info["weights_sha256"] = content_sha256(path)
    return info
