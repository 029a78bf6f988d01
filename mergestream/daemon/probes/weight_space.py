"""``weight_space``: the data-free probe, always on.

Metrics (reads weights tensor by tensor through :class:`~mergestream.io.checkpoints.Checkpoint`, never
a whole model; the statistics are :mod:`mergestream.engine.inspection`'s):

``relative_drift``  ‖θ_cand − θ₀‖ / ‖θ₀‖ over every float tensor of θ₀ (dimensionless).
``step_drift``      ‖θ_cand − θ_prev‖ / ‖θ₀‖ (θ_prev = θ₀ before the first fold).
``general_subspace_energy``  fraction of the step's energy that lies in θ₀'s top-k singular
                    subspaces, the general-knowledge risk SAFE-Merge measures: with Δ = θ_cand −
                    θ_prev and, per 2-D tensor of θ₀, U₀ (m×k) / V₀ (n×k) its top-k left/right
                    singular vectors, Σ‖U₀U₀ᵀ Δ V₀V₀ᵀ‖² / Σ‖Δ‖² over the 2-D tensors, in [0, 1]
                    (0.0 when Δ = 0). U₀, V₀ are cached per base (see :func:`clear_svd_cache`)
                    and, with ``ctx.cache_dir`` (the daemon's ``state/cache/probes``), kept on disk
                    for the next process: a 1 GiB θ₀'s take ~12 s to compute on 2 cores.
``max_task_cosine`` the largest |cos(cᵢ, cⱼ)|, i < j, between the fold contributions folded so
                    far (``ctx.contributions``, whole-model cosine), in [0, 1]; 0.0 with fewer
                    than two.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ...engine.inspection import drift_sums, gram_matrix
from ...engine.linalg import SVD_MODES, max_abs_cosine
from ...engine.residuals import is_exception_key, open_contribution
from ...errors import StateError
from ...io.checkpoints import Checkpoint, TensorMeta, is_float_dtype, open_checkpoint
from .base import ProbeContext, ProbeError, positive_int, probe_device

#: θ₀ top-k singular vectors: key (base file fingerprint, k, svd mode) -> {tensor: (U m×k, V n×k)}.
_SVD_CACHE: OrderedDict[tuple, dict[str, tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
_SVD_CACHE_BASES = 2
_SVD_LOCK = threading.Lock()
log = logging.getLogger(__name__)


def _fingerprint(ck: Checkpoint) -> tuple:
    """Identity of a checkpoint's weight files: resolved path, size and mtime of each."""
    parts = []
    for f in ck.weight_files:
        st = f.stat()
        parts.append((str(f.resolve()), st.st_size, st.st_mtime_ns))
    return tuple(parts)


def _svd_entry(key: tuple) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The cached U₀, V₀ for ``key`` = (θ₀'s :func:`_fingerprint`, k, mode), filled by
    :func:`drift_sums`."""
    with _SVD_LOCK:
        entry = _SVD_CACHE.get(key)
        if entry is None:
            entry = _SVD_CACHE[key] = {}
            while len(_SVD_CACHE) > _SVD_CACHE_BASES:
                _SVD_CACHE.popitem(last=False)
        else:
            _SVD_CACHE.move_to_end(key)
        return entry


#: File name prefix of the U₀, V₀ kept in a probe cache folder (:attr:`ProbeContext.cache_dir`).
SVD_FILE_PREFIX = "weight_space-svd-"


def _svd_file(cache_dir: Path, key: tuple) -> Path:
    """The file that keeps the U₀, V₀ of cache key ``key`` = (θ₀'s fingerprint, k, mode) in
    ``cache_dir``: named by k, mode and a digest of the fingerprint."""
    fingerprint, k, mode = key
    digest = hashlib.sha256(repr(fingerprint).encode()).hexdigest()[:24]
    return cache_dir / f"{SVD_FILE_PREFIX}k{k}-{mode}-{digest}.safetensors"


def _load_svd_file(path: Path, base: Checkpoint, k: int, entry: dict[str, tuple[torch.Tensor, torch.Tensor]]
                   ) -> None:
    """Fill an empty cache entry from ``path`` (tensors ``<name>.U`` (m, k′), ``<name>.V`` (n, k′),
    float32, k′ = min(k, m, n), for θ₀'s 2-D tensors ``<name>``); an unreadable file is ignored and
    a pair that does not fit θ₀ is skipped (either is computed again and the file rewritten)."""
    try:
        loaded = load_file(str(path))
    except (OSError, SafetensorError, ValueError) as exc:
        log.warning("weight_space: ignoring the unreadable SVD cache %s: %s", path, exc)
        return
    for key, u in loaded.items():
        name, v = key[:-2], loaded.get(key[:-2] + ".V")
        if not key.endswith(".U") or v is None or name not in base:
            continue
        shape = base.meta(name).shape
        kk = min(k, *shape) if len(shape) == 2 else -1
        if (tuple(u.shape), tuple(v.shape)) == ((shape[0], kk), (shape[-1], kk)) and u.dtype == v.dtype == torch.float32:
            entry.setdefault(name, (u, v))


def _store_svd_file(path: Path, entry: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write ``entry`` to ``path`` (temporary file + rename) and drop the folder's files of the same
    k and mode for other bases; a failure is logged, never raised (the cache only saves time)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {f"{name}.{which}": t.contiguous() for name, uv in entry.items() for which, t in zip("UV", uv)}
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
        for old in path.parent.glob(path.name.rsplit("-", 1)[0] + "-*.safetensors"):
            if old != path:
                old.unlink(missing_ok=True)
    except (OSError, SafetensorError) as exc:
        log.warning("weight_space: could not keep the SVD cache in %s: %s", path.parent, exc)
        tmp.unlink(missing_ok=True)


def clear_svd_cache() -> None:
    """Drop every cached set of θ₀ singular vectors (e.g. when θ₀ changes in place)."""
    with _SVD_LOCK:
        _SVD_CACHE.clear()


def _float_metas(ck: Checkpoint) -> list[TensorMeta]:
    """The float tensors of a contribution, without its exception entries."""
    return [m for m in ck.metas() if is_float_dtype(m.dtype) and not is_exception_key(m.name)]


class WeightSpaceProbe:
    """Data-free probe: drift from θ₀, step size, general-subspace energy, task-vector interference.

    One streaming pass over θ₀'s float tensors reads θ₀, the candidate and the previous backbone
    one tensor at a time (float32 math, float64 sums across tensors); a second pass reads the
    contributions in row chunks for their Gram matrix. Metrics: ``relative_drift``,
    ``step_drift``, ``general_subspace_energy``, ``max_task_cosine`` (see the module docstring).

    Args:
        k: rank of θ₀'s "general" subspace per 2-D tensor (capped at min(m, n)).
        svd: ``auto`` (exact SVD while the short side is at most 512 and m·n·min(m, n) ≤ 2³³,
            randomized subspace iteration otherwise: :func:`mergestream.engine.linalg.top_singular_vectors`),
            ``exact`` or ``lowrank``.
        chunk_bytes: memory cap (bytes) of the stacked float64 contribution slices held at once
            (a larger single row is read alone).
        name: probe name (default ``weight_space``).

    Raises:
        ProbeError: bad parameters; at call time, a candidate/previous/contribution that lacks a
            float tensor of θ₀ or has another shape, or θ₀ with zero norm.
    """

    def __init__(self, k: int = 16, svd: str = "auto", chunk_bytes: int = 256 * 1024**2,
                 name: str = "weight_space"):
        self.k = positive_int(k, "weight_space: k", allow_none=False)
        if svd not in SVD_MODES:
            raise ProbeError(f"weight_space: svd must be auto, exact or lowrank, got {svd!r}")
        self.svd = svd
        self.chunk_bytes = positive_int(chunk_bytes, "weight_space: chunk_bytes", allow_none=False)
        self.name = name

    def __repr__(self) -> str:
        return f"WeightSpaceProbe(k={self.k}, svd={self.svd!r})"

    @staticmethod
    def _check(other: Checkpoint, meta: TensorMeta, what: str) -> None:
        if meta.name not in other:
            raise ProbeError(f"{what} {other.path} lacks θ₀'s tensor {meta.name!r}")
        got = other.meta(meta.name).shape
        if got != meta.shape:
            raise ProbeError(f"{what} {other.path}: tensor {meta.name!r} has shape {got}, θ₀ has {meta.shape}")

    def __call__(self, model_dir: Path, ctx: ProbeContext) -> dict[str, float]:
        """Measure ``model_dir`` against θ₀, the previous backbone and the contributions.

        Returns:
            ``relative_drift``, ``step_drift``, ``general_subspace_energy``, ``max_task_cosine``.
        """
        dev = probe_device(ctx)
        base = open_checkpoint(ctx.base)
        cand = open_checkpoint(model_dir)
        prev = open_checkpoint(ctx.previous) if ctx.previous is not None else None
        try:
            floats = [m for m in base.metas() if is_float_dtype(m.dtype)]
            for m in floats:
                self._check(cand, m, "candidate")
                if prev is not None:
                    self._check(prev, m, "previous backbone")
            key = (_fingerprint(base), self.k, self.svd)
            bases = _svd_entry(key)
            kept = _svd_file(ctx.cache_dir, key) if ctx.cache_dir is not None else None
            if kept is not None and not bases and kept.exists():
                _load_svd_file(kept, base, self.k, bases)
            known = len(bases)
            sums = drift_sums(base, cand, prev, floats, k=self.k, svd=self.svd, device=dev, bases=bases)
            if kept is not None and len(bases) > known:
                _store_svd_file(kept, bases)
        finally:
            for ck in (base, cand, prev):
                if ck is not None:
                    ck.close()
        if sums.base_sq == 0.0:
            raise ProbeError(f"θ₀ {ctx.base} has zero norm; relative drift is undefined")
        base_norm = math.sqrt(sums.base_sq)
        energy = min(1.0, sums.inside_sq / sums.step2d_sq) if sums.step2d_sq > 0.0 else 0.0
        return {
            "relative_drift": math.sqrt(sums.drift_sq) / base_norm,
            "step_drift": math.sqrt(sums.step_sq) / base_norm,
            "general_subspace_energy": energy,
            "max_task_cosine": self.max_task_cosine(ctx.contributions, dev, base=ctx.base),
        }

    def max_task_cosine(self, contributions: list[Path], device: torch.device | str = "cpu",
                        base: Path | None = None) -> float:
        """Largest |cos(cᵢ, cⱼ)| over pairs i < j of whole-model contributions; 0.0 with < 2.

        A contribution with zero norm has cosine 0 with every other. Reads every contribution's
        tensors in row chunks so that at most ``chunk_bytes`` of slices are held at once.
        """
        if len(contributions) < 2:
            return 0.0
        return max_abs_cosine(torch.from_numpy(self.contribution_gram(contributions, device, base=base)))

    def contribution_gram(self, contributions: list[Path], device: torch.device | str = "cpu",
                          base: Path | None = None) -> np.ndarray:
        """Gram matrix G[i, j] = ⟨cᵢ, cⱼ⟩ (float64, N×N) of the contributions over their float tensors.

        A Task Arithmetic fold stores no residual tensor (residual format 3): its Δ = λτ is
        recomputed from the expert it records and θ₀ (``base``, required then).

        Raises:
            ProbeError: the contributions do not hold the same float tensors with the same shapes,
                or a recomputed one cannot be (no ``base``, its expert gone).
        """
        cks = []
        try:
            for p in contributions:
                try:
                    cks.append(open_contribution(p, base) if base is not None else open_checkpoint(p))
                except StateError as exc:
                    raise ProbeError(str(exc)) from exc
                if base is None and not _float_metas(cks[-1]):
                    raise ProbeError(f"contribution {p} stores no residual tensor (Task Arithmetic): "
                                     "pass θ₀ to recompute it")
            ref = cks[0]
            metas = _float_metas(ref)
            names = {m.name for m in metas}
            for ck in cks[1:]:
                other = {m.name for m in _float_metas(ck)}
                if other != names:
                    diff = sorted(names ^ other)[:3]
                    raise ProbeError(f"contributions {ref.path} and {ck.path} hold different tensors "
                                     f"(e.g. {diff})")
                for m in metas:
                    if ck.meta(m.name).shape != m.shape:
                        raise ProbeError(f"contribution {ck.path}: tensor {m.name!r} has shape "
                                         f"{ck.meta(m.name).shape}, {ref.path} has {m.shape}")
            return gram_matrix(cks, metas, chunk_bytes=self.chunk_bytes, device=device).numpy()
        finally:
            for ck in cks:
                ck.close()
