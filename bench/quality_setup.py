"""Inputs of ``bench/quality.py``: policy parameters, recipes, the held-out validation split, the
LP-FT rule and where results go. Pure functions over files and dicts (no model is loaded here), so
they are tested cheaply (tests/test_quality_tooling.py).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import yaml

from common import recorded_path

from mergestream import experts as X
from mergestream.errors import MergestreamError
from mergestream.io.checkpoints import open_checkpoint
from mergestream.io.st import WEIGHTS_HASH_VERSION
from mergestream.policies import make_policy

#: where the checked-in results live; written only when ``--out`` names it
RESULTS = Path(__file__).resolve().parent / "results"


class BenchInputError(MergestreamError):
    """A benchmark option or config file that cannot be used (the message names it)."""


def parse_value(text: str) -> Any:
    """A ``--set``/``--recipe`` value, typed: ``64`` int, ``0.5`` / ``3e-5`` float, ``true`` bool,
    ``null`` None, a YAML/JSON list or mapping, anything else the string itself."""
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_sets(items: list[str]) -> dict[str, dict[str, Any]]:
    """``--set LABEL.NAME=VALUE`` options as {label: {name: value}}.

    LABEL is a policy (``dop``: the row and its variants) or a row label (``opcm+lines``: that row
    only); NAME a parameter as in the docs' policies reference (``lambda``, ``alpha``, ``lines_alpha``).

    Raises:
        BenchInputError: an item without ``=`` or without ``LABEL.``.
    """
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, eq, value = item.partition("=")
        lab, dot, name = key.strip().partition(".")
        if not eq or not dot or not lab or not name:
            raise BenchInputError(f"--set expects LABEL.NAME=VALUE (e.g. dop.alpha=0.7), got {item!r}")
        out.setdefault(lab, {})[name.strip()] = parse_value(value.strip())
    return out


def load_config(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """A YAML/JSON config file ``{params: {LABEL: {NAME: VALUE}}}`` (the same shape as ``--set``).

    Raises:
        BenchInputError: unreadable file, or not that shape.
    """
    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise BenchInputError(f"config {path}: {exc}") from None
    params = doc.get("params", {}) if isinstance(doc, dict) else None
    if not isinstance(params, dict) or not all(isinstance(v, dict) for v in params.values()):
        raise BenchInputError(f"config {path}: expected 'params: {{LABEL: {{NAME: VALUE}}}}'")
    unknown = set(doc) - {"params"}
    if unknown:
        raise BenchInputError(f"config {path}: unknown keys {sorted(unknown)} (known: params)")
    return {str(k): dict(v) for k, v in params.items()}


def merge_overrides(*layers: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Later layers win, name by name (the config file first, then ``--set``)."""
    out: dict[str, dict[str, Any]] = {}
    for layer in layers:
        for lab, params in layer.items():
            out.setdefault(lab, {}).update(params)
    return out


def apply_overrides(pols: list[tuple[str, str, dict[str, Any]]], overrides: dict[str, dict[str, Any]]
                    ) -> list[tuple[str, str, dict[str, Any]]]:
    """The benchmark rows with overrides applied: a policy's first, then the row label's.

    Raises:
        BenchInputError: an override names no row of the plan. PolicyError: a row's parameters are
            invalid for its policy (checked here, before any model is loaded).
    """
    labels = {p + v for p, v, _ in pols} | {p for p, _, _ in pols}
    stray = sorted(set(overrides) - labels)
    if stray:
        raise BenchInputError(f"parameters for {', '.join(stray)}: no such row; rows: {', '.join(sorted(labels))}")
    out = []
    for pol, var, params in pols:
        p = {**params, **overrides.get(pol, {}), **(overrides.get(pol + var, {}) if var else {})}
        make_policy(pol, p)
        out.append((pol, var, p))
    return out


def parse_recipe(text: str) -> dict[str, Any]:
    """``--recipe``: ``k=v,k=v`` or a YAML/JSON mapping, each value typed (``lr=3e-5`` float,
    ``max_train=64`` int, ``head_init=lp`` string), checked against :class:`mergestream.experts.Recipe`.

    Raises:
        BenchInputError: a malformed item or an unknown recipe field.
    """
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            got = json.loads(text)
        except ValueError:
            got = parse_value(text)
        if not isinstance(got, dict):
            raise BenchInputError(f"--recipe: not a mapping: {text!r}")
        over = {str(k): v for k, v in got.items()}
    else:
        over = {}
        for item in text.split(","):
            k, eq, v = item.partition("=")
            if not eq or not k.strip():
                raise BenchInputError(f"--recipe expects name=value items, got {item!r}")
            over[k.strip()] = parse_value(v.strip())
    fields = {f.name: str(f.type) for f in dataclasses.fields(X.Recipe)}
    bad = sorted(set(over) - set(fields))
    if bad:
        raise BenchInputError(f"--recipe: unknown field(s) {', '.join(bad)}; known: {', '.join(sorted(fields))}")
    for k, v in over.items():  # YAML reads 1e-4 as a string: the field's type decides
        if isinstance(v, str) and fields[k].startswith(("float", "int")):
            try:
                over[k] = float(v) if fields[k].startswith("float") else int(v)
            except ValueError:
                raise BenchInputError(f"--recipe: {k}={v!r} is not a {fields[k]}") from None
    return over


def portable_protocol(protocol: dict[str, Any]) -> dict[str, Any]:
    """``protocol`` with its ``data`` folder and ``experts`` folders recorded by :func:`recorded_path`."""
    out = dict(protocol)
    if "data" in out:
        out["data"] = recorded_path(out["data"])
    if isinstance(out.get("experts"), dict):
        out["experts"] = {t: recorded_path(f) for t, f in out["experts"].items()}
    return out


def default_out() -> Path:
    """A new scratch folder for results (the checked-in ``bench/results`` only when asked)."""
    return Path(tempfile.mkdtemp(prefix="ms-quality-results-"))


# ------------------------------------------------------------------------------------------
# Held-out validation split, carved before the experts are trained
# ------------------------------------------------------------------------------------------
def carve_validation(src: Path, dst: Path, tasks: list[str], n_val: int, seed: int = 7) -> Path:
    """A copy of the data folder whose task files mark ``n_val`` seeded train rows per task as
    split ``val``: experts built from ``dst`` never train on them (``load_task`` reads only
    ``train``/``test``), so tuning on them is out of sample. ``general/`` and ``raw/`` are linked.

    Args:
        src: the shared data folder (``tasks/``, ``general/``, ``raw/``).
        dst: folder to create (reused when its content is already the same).

    Returns:
        ``dst``. Raises BenchInputError when a task has no more than ``n_val`` train rows.
    """
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "tasks").mkdir(exist_ok=True)
    for sub in ("general", "raw"):
        link = dst / sub
        if not link.exists() and (src / sub).exists():
            link.symlink_to((src / sub).resolve(), target_is_directory=True)
    for t in tasks:
        with open(src / "tasks" / f"{t}.tsv", newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh, delimiter="\t")
            header, rows = reader.fieldnames or [], list(reader)
        train_idx = [i for i, r in enumerate(rows) if r["split"] == "train"]
        if len(train_idx) <= n_val:
            raise BenchInputError(f"task {t}: {len(train_idx)} train rows, cannot carve {n_val} validation rows")
        for i in random.Random(seed).sample(train_idx, n_val):
            rows[i]["split"] = "val"
        path = dst / "tasks" / f"{t}.tsv"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w", newline="", encoding="utf-8") as fh:
            w = csv.DictWriter(fh, fieldnames=header, delimiter="\t", lineterminator="\n")
            w.writeheader()
            w.writerows(rows)
        if path.exists() and path.read_bytes() == tmp.read_bytes():
            tmp.unlink()
        else:
            tmp.replace(path)
    return dst


def validation_rows(data: Path, task: str) -> list[tuple[str, str | None, int]]:
    """The ``val`` rows of a carved task file, labelled as :func:`mergestream.experts.load_task` labels."""
    td = X.load_task(task, data)
    idx = {lab: i for i, lab in enumerate(td.classes)}
    with open(Path(data) / "tasks" / f"{task}.tsv", newline="", encoding="utf-8") as fh:
        return [(r["text"], r.get("text2") or None, idx[r["label"]]) for r in csv.DictReader(fh, delimiter="\t")
                if r["split"] == "val"]


def carved_folder(root: Path, tasks: list[str], n_val: int, seed: int = 7) -> Path:
    """A stable folder name for a carve (same tasks, rows and seed → same folder, same experts)."""
    tag = hashlib.sha256(f"{sorted(tasks)}|{n_val}|{seed}".encode()).hexdigest()[:12]
    return root / f"data-val{n_val}-{tag}"


# ------------------------------------------------------------------------------------------
# LP-FT by a measurable rule
# ------------------------------------------------------------------------------------------
def needs_lpft(expert_val_acc: float, probe_val_acc: float, margin: float = 0.0) -> bool:
    """LP-FT when the fine-tuned expert (random head) is not better than a linear probe on frozen θ₀,
    both measured on the held-out validation rows: full fine-tuning then lost what the frozen
    features already had, the case LP-FT targets (Kumar et al., ICLR 2022)."""
    return expert_val_acc < probe_val_acc + margin



#: options that do not change any measured number (where results go, threads, the md's note)
_NOT_PROTOCOL = frozenset({"out", "workdir", "threads", "resume", "from_json", "reduced_note", "cache",
                           "planned_policies"})


# options that only add rows (each row's numbers are independent of them): a resumed run may list more
_ADDITIVE = frozenset({"ri_policies", "distill_policies"})


# options that decide only the +distill rows' numbers; each run records them (``ran_params``), and a
# resumed run with other values re-runs those rows (:func:`stale_distill_runs`) instead of refusing
DISTILL_ROW_OPTIONS = ("distill_steps", "distill_lr", "distill_gamma", "distill_aux", "distill_anchors")
# what a run recorded before an option existed ran with
_DISTILL_BEFORE = {"distill_anchors": 0}


def stale_distill_runs(runs: list[dict[str, Any]], args: Any,
                       row_options: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The +distill runs of an earlier piece whose distil options (``ran_params``) differ from
    ``args``'s: a resumed run drops and re-runs them (their rows' numbers are those options').
    ``row_options``: per row label (policy + variant before "+ri"/"+distill"), the options that row
    runs with instead of ``args``'s (see ``quality.ROW_DISTILL``)."""
    now = json.loads(json.dumps({k: getattr(args, k) for k in DISTILL_ROW_OPTIONS}))
    rows = json.loads(json.dumps(row_options or {}))

    def wanted(run: dict[str, Any]) -> dict[str, Any]:
        return {**now, **rows.get(distill_row_label(run["policy"], run.get("variant", "")), {})}

    return [r for r in runs if str(r.get("variant", "")).endswith("+distill")
            and any(r.get("ran_params", {}).get(k, _DISTILL_BEFORE.get(k)) != wanted(r)[k] for k in DISTILL_ROW_OPTIONS)]


def distill_row_label(policy: str, variant: str) -> str:
    """The row a +distill run's data steps were added to: ``policy`` + ``variant`` without its
    trailing "+distill" and "+ri" (``iso_c``, ``+budget29+ri+distill`` → ``iso_c+budget29``)."""
    v = variant.removesuffix("+distill").removesuffix("+ri")
    return policy + v


def _grows(had: Any, now: Any) -> bool:
    """Whether the comma-separated list ``now`` keeps every item of ``had`` (rows may be added, not dropped)."""
    return set(filter(None, str(had or "").split(","))) <= set(filter(None, str(now or "").split(",")))


def protocol_args(args: Any) -> dict[str, Any]:
    """The command-line options that decide the measured numbers (everything but where results go,
    threads and notes), as JSON values: a resumed run must have exactly these."""
    return {k: v for k, v in sorted(vars(args).items()) if k not in _NOT_PROTOCOL}


def load_resume(out: Path, args: Any, defaults: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The earlier pieces of this benchmark from ``out/quality.json`` for ``--resume``, or None when
    there is no such file (a fresh start). ``defaults``: the options' default values; an option the
    file does not record (added to the script after that run started) matches its default.

    The distil options (:data:`DISTILL_ROW_OPTIONS`) may differ: see :func:`stale_distill_runs`.

    Raises:
        BenchInputError: the file was written with other protocol options (listed by name), or
            by a version of the script that did not record them; mixing them would merge
            incomparable numbers.
    """
    path = out / "quality.json"
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    had = doc.get("protocol", {}).get("args")
    if had is None:
        raise BenchInputError(f"{path} does not record its options (written before --resume existed); "
                              "start a fresh run in another --out")
    now = json.loads(json.dumps(protocol_args(args)))
    dflt = json.loads(json.dumps(protocol_args(argparse.Namespace(**defaults)))) if defaults else {}
    diff = sorted(k for k in set(had) | set(now) if had.get(k, dflt.get(k)) != now.get(k)
                  and not (k in _ADDITIVE and _grows(had.get(k, dflt.get(k)), now.get(k)))
                  and k not in DISTILL_ROW_OPTIONS)
    if diff:
        raise BenchInputError(f"{path} was run with other options: "
                              + ", ".join(f"{k}={had.get(k)!r} (now {now.get(k)!r})" for k in diff))
    return doc


def check_resumed_experts(prev: dict[str, Any] | None, experts: dict[str, Path]) -> None:
    """A resumed run must fold the very experts of its earlier pieces: their content hashes must equal
    the recorded ones, computed with the weights-hash definition the record used
    (``protocol.expert_hash_version``; a record without it is version 1, from before the per-tensor
    definition). A run that recorded no hashes (older pieces) is not checked.

    Raises:
        BenchInputError: an expert differs (e.g. the expert cache was lost and the expert retrained).
    """
    proto = (prev or {}).get("protocol", {})
    had = proto.get("expert_hashes")
    if not had:
        return
    version = int(proto.get("expert_hash_version", 1))
    hashes = {t: expert_hash(folder, version) for t, folder in experts.items()}
    diff = sorted(t for t in set(had) | set(hashes) if had.get(t) != hashes.get(t))
    if diff:
        raise BenchInputError("the experts differ from the run being resumed (retrained or another cache?): "
                              + ", ".join(f"{t} {str(had.get(t))[:12]} -> {str(hashes.get(t))[:12]}" for t in diff)
                              + "; start a fresh run in another --out")


def curve_steps(args: argparse.Namespace) -> list[int]:
    """``--steps-curve`` as step counts (each a non-negative integer).

    Raises:
        SystemExit: a value that is not one.
    """
    try:
        steps = [int(v) for v in args.steps_curve.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--steps-curve: comma-separated integers, got {args.steps_curve!r}") from None
    if any(n < 0 for n in steps):
        raise SystemExit(f"--steps-curve: step counts are >= 0, got {args.steps_curve!r}")
    return steps


def stale_grid(entry: dict[str, Any], grid: list[float], pol: str, runs: list[dict[str, Any]],
               variant: str = "") -> bool:
    """True when a resumed run's recorded tuning of ``pol`` (or of its row ``pol + variant``, for a
    variant tuned on its own) used another grid than ``grid`` (then it is tuned again).

    Raises:
        BenchInputError: the grid changed but runs of ``pol`` (or its variants; with ``variant``: of that
            row) were already made with the old tuned value: they would not be comparable with the rest.
    """
    if [float(v) for v in entry["grid"]] == [float(v) for v in grid]:
        return False
    if any(r["policy"] == pol and (not variant or r.get("variant", "") == variant) for r in runs):
        raise BenchInputError(f"{pol}: GRID changed since its runs were made with {entry['param']}={entry['chosen']}; "
                              "start a fresh run in another --out")
    return True


def expert_hash(folder: Path, version: int = WEIGHTS_HASH_VERSION) -> str:
    """An expert's content hash: the weights hash every mergestream ledger uses, in its current
    definition (or ``version`` 1 to verify an older record)."""
    with open_checkpoint(folder) as ck:
        return ck.sha256(version)
