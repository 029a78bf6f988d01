"""The model card (``README.md``) of every model mergestream writes: the one home of its content.

A fold, a merge, an unmerge, a published daemon version and a model rebuilt from a patch each get
a card of their own in the Hugging Face convention: YAML front matter (``base_model``, ``tags``
with ``merge`` and ``mergestream``, ``library_name``, and the base card's ``license`` /
``language`` when it has them), then what the model is: the policy and its parameters, the experts
in fold order with their content hashes (the weights hash of :mod:`mergestream.io.st`), for a
daemon version its number and probe values, and the tool version.

Everything except the daemon's release facts comes from the provenance the weights themselves
carry (their safetensors ``__metadata__``, :func:`mergestream.engine.passes.provenance`), so a card
never disagrees with the weights next to it. No card holds a path of the operator's machine: the
base and the experts are named by :func:`mergestream.io.paths.public_name` and their content hash.
Cards hold no timestamps: the same inputs write the same bytes.

The front matter is written with PyYAML (a dependency already) rather than ``huggingface_hub``'s
``ModelCardData``: importing the latter cost 0.13-0.3 s of every fold's start-up (measured on
this 2-core machine), for the same three lines of YAML; the tests parse every card with
``huggingface_hub.ModelCard`` to check that it follows the convention.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from .. import __version__
from .st import CARD_NAME, FormatError, load_json, read_header, write_atomic
#: Tags every card carries.
TAGS = ("merge", "mergestream")
#: Fields of the base's own card a merged model inherits (its terms, languages and task stay the base's).
INHERITED = ("license", "license_name", "license_link", "language", "pipeline_tag")


def provenance_of(folder: str | os.PathLike) -> dict[str, str]:
    """The ``mergestream.*`` provenance of the model in ``folder`` (the ``__metadata__`` of its first
    weight file; every shard carries the same). ``{}`` when it has none or no weight file.

    Raises:
        FormatError: the weight file's header is malformed.
    """
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        return {}
    meta = read_header(files[0]).metadata
    return {k: v for k, v in meta.items() if k.startswith("mergestream.")}


def base_card_fields(base: str | os.PathLike | None) -> dict[str, Any]:
    """The front-matter fields of the base's own card that a merge inherits (:data:`INHERITED`),
    and its ``library_name``: ``{}`` when the base has no card, or one without front matter or
    with front matter that is not a YAML mapping (the base's card is not ours to refuse)."""
    if base is None or not Path(base).is_dir() or not (Path(base) / CARD_NAME).is_file():
        return {}
    text = (Path(base) / CARD_NAME).read_text(encoding="utf-8", errors="replace")
    if not text.startswith("---"):
        return {}
    head, sep, _ = text[3:].partition("\n---")
    try:
        doc = yaml.safe_load(head) if sep else None
    except yaml.YAMLError:
        return {}
    if not isinstance(doc, dict):
        return {}
    return {k: doc[k] for k in (*INHERITED, "library_name") if doc.get(k) is not None}


def library_of(base: str | os.PathLike | None) -> str | None:
    """The library that loads the base folder: ``sentence-transformers`` (``modules.json``),
    ``transformers`` (``config.json``), else None (a bare weights file)."""
    if base is None or not Path(base).is_dir():
        return None
    if (Path(base) / "modules.json").is_file():
        return "sentence-transformers"
    if (Path(base) / "config.json").is_file():
        return "transformers"
    return None


def _json(meta: Mapping[str, str], key: str, default: Any) -> Any:
    """``meta[key]`` parsed as JSON of ``default``'s type; ``default`` when absent or malformed."""
    try:
        return load_json(meta[key], key, error=ValueError, expect=type(default)) if key in meta else default
    except ValueError:
        return default


def _cell(value: Any) -> str:
    """``value`` as a Markdown table cell in a code span (pipes and backticks cannot break the table)."""
    text = str(value).replace("`", "'").replace("|", "\\|").replace("\n", " ")
    return f"`{text}`"


def render_card(meta: Mapping[str, str], *, base_fields: Mapping[str, Any] | None = None,
                library: str | None = None, release: Mapping[str, Any] | None = None) -> str:
    """The card's text for a model whose provenance is ``meta``.

    Args:
        meta: the model's ``mergestream.*`` metadata (:func:`provenance_of`).
        base_fields: the base card's inherited fields (:func:`base_card_fields`).
        library: ``library_name`` when the base card names none (:func:`library_of`).
        release: a daemon version's facts: ``version`` (int), ``kind`` (``fold`` | ``unmerge``),
            ``expert`` (the id folded in or removed), ``previous`` (version or None), ``probes``
            ({name: float}).

    Returns:
        Markdown with YAML front matter, ending in a newline.
    """
    fields = dict(base_fields or {})
    policy = meta.get("mergestream.policy", "unknown")
    base_name = meta.get("mergestream.base") or "unknown"
    front: dict[str, Any] = {"base_model": base_name}
    lib = fields.pop("library_name", None) or library
    if lib:
        front["library_name"] = lib
    front.update({k: fields[k] for k in INHERITED if k in fields})
    front["tags"] = [*TAGS, policy]
    params = _json(meta, "mergestream.params", {})
    ids = _json(meta, "mergestream.experts", [])
    shas = _json(meta, "mergestream.expert_sha256", [])
    tool = meta.get("mergestream.version") or __version__
    lines = ["---", yaml.safe_dump(front, sort_keys=False, allow_unicode=True).rstrip("\n"), "---", ""]
    title = f"version {release['version']}" if release else f"{base_name} + {len(ids)} expert(s)"
    lines += [f"# {title} ({policy})", "",
              f"A merged model written by mergestream {tool}: the base `{base_name}` with {len(ids)} fine-tuned "
              f"expert(s) folded in by the `{policy}` policy. Inputs are named by their content hash "
              "(the weights hash: sha256 of the tensors' names, dtypes, shapes and bytes, independent of "
              "sharding and metadata), never by a path.", ""]
    if release:
        kind = "folded in" if release.get("kind") == "fold" else "removed"
        prev = release.get("previous")
        lines += ["## Release", "", "| | |", "|---|---|", f"| version | {_cell(release['version'])} |",
                  f"| change | {_cell(str(release.get('expert')) + ' ' + kind)} |",
                  f"| previous version | {_cell(prev if prev is not None else 'none')} |", ""]
        probes = release.get("probes") or {}
        if probes:
            lines += ["### Probe values", "", "| probe | value |", "|---|---|"]
            lines += [f"| {_cell(k)} | {_cell(f'{float(v):.6g}')} |" for k, v in sorted(probes.items())]
            lines.append("")
    lines += ["## Merge", "", "| | |", "|---|---|", f"| policy | {_cell(policy)} |",
              f"| parameters | {_cell(json.dumps(params, sort_keys=True))} |", f"| base | {_cell(base_name)} |",
              f"| folds | {_cell(meta.get('mergestream.n_folds', len(ids)))} |", f"| tool | {_cell('mergestream ' + tool)} |"]
    distil = _json(meta, "mergestream.distill", {})
    if isinstance(distil, dict) and distil.get("steps"):  # the distil post-step trained these weights
        p = distil.get("params") or {}
        tasks = ", ".join(map(str, distil.get("tasks") or []))
        what = f"{distil['steps']} AdamW steps toward the experts of {tasks} (gamma {p.get('gamma')}, lr {p.get('lr')})"
        if distil.get("anchors"):
            what += f"; θ₀'s geometry kept on {distil['anchors']} general anchor sentences"
        if distil.get("trained_entries") is not None:
            what += f"; only the {distil['trained_entries']} entries the fold changed (patch budget)"
        lines.append(f"| distil post-step | {_cell(what)} |")
    lines += ["", "## Experts, in fold order", ""]
    if ids:
        lines += ["| # | expert | weights sha256 |", "|---|---|---|"]
        lines += [f"| {i} | {_cell(e)} | {_cell(s)} |" for i, (e, s) in enumerate(zip(ids, shas + [""] * len(ids)), 1)]
    else:
        lines.append("None: the weights are the base's.")
    return "\n".join(lines) + "\n"


def write_model_card(folder: str | os.PathLike, *, base: str | os.PathLike | None = None,
                     release: Mapping[str, Any] | None = None) -> Path | None:
    """Write ``folder/README.md``, the card of the model in ``folder`` (replacing a copy of the
    base's card), from the provenance its weights carry. A folder whose weights carry no
    mergestream provenance keeps what it has (None is returned).

    Args:
        base: the base θ₀ (a folder's card and config give ``license``, ``language`` and
            ``library_name``); a path read here, never written into the card.
        release: a daemon version's facts (see :func:`render_card`).

    Raises:
        FormatError: a weight file's header is malformed. OSError: the card cannot be written.
    """
    meta = provenance_of(folder)
    if not meta:
        return None
    text = render_card(meta, base_fields=base_card_fields(base), library=library_of(base), release=release)
    path = Path(folder) / CARD_NAME
    write_atomic(path, text.encode("utf-8"))
    return path


__all__ = ["CARD_NAME", "FormatError", "base_card_fields", "library_of", "provenance_of", "render_card",
           "write_model_card"]
