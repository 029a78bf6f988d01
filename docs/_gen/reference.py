"""Build-time generator of the site's reference pages (mkdocs-gen-files runs it on every build).

Each page is read from the code, so it cannot drift from it:

- ``reference/config.md``: every key of the daemon's configuration, from the pydantic model
  :class:`mergestream.config.Config` (type, default, description, environment variable);
- ``reference/metrics.md``: every Prometheus metric, from :class:`mergestream.daemon.metrics.Metrics`'s
  registry (name, type, labels, help);
- ``reference/policies.md``: every policy of :data:`mergestream.policies.REGISTRY` with its parameters
  (from its ``Params`` model) and the math of its module docstring, plus LiNeS's parameters;
- the quality table of ``policies.md`` (at its ``<!-- quality-table`` marker): each registered policy's
  row of ``bench/results/quality.json`` and its best variant;
- ``results/quality.md`` and its images: ``bench/results/quality.md`` and the PNGs beside it, as they
  are checked in (the benchmark writes them; nothing is copied into ``docs/``).

The CLI page (``reference/cli.md``) is rendered by mkdocs-click from the click commands.
"""

from __future__ import annotations

import inspect
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

import mkdocs_gen_files
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
#: checked-in benchmark plots shown on the site (policies page, quality results page)
IMAGES = ("quality_curves.png", "quality_patch.png", "quality_acc_matrix.png")


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: one line, ``|`` escaped, and ``<...>`` and ``{...}`` shown
    as written (not taken for HTML or attribute lists)."""
    parts = " ".join(str(text).split()).replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace("{", "\\{").replace("}", "\\}")
    return "`".join(parts)


def _type(annotation: Any) -> str:
    """A field's type as a reader writes it in YAML (``float``, ``list[str]``, ``"a" | "b"``)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type(a) for a in args)}]"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation)).replace("SecretStr", "secret str")


def _default(field: Any) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        value = [v.model_dump(exclude_defaults=True) for v in value]
    if isinstance(value, Path):
        return f"`{value}`"
    return f"`{value!r}`" if value not in (None, "") else ("`null`" if value is None else '`""`')


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (itself or as list items), else None."""
    for cand in (annotation, *typing.get_args(annotation)):
        if isinstance(cand, type) and issubclass(cand, BaseModel):
            return cand
    return None


def _doc(obj: Any) -> str:
    return inspect.cleandoc(obj.__doc__ or "").split("\n\n")[0].replace("\n", " ")


def config_page() -> str:
    """``reference/config.md``: one table per section of :class:`mergestream.config.Config`."""
    from mergestream.config import Config

    out = ["# Configuration keys", "",
           "Generated from the pydantic model `mergestream.config.Config` at build time: every key the "
           "daemon's YAML file accepts, its type, default and meaning. Unknown keys are errors. Each key "
           "can also be set from the environment: `MERGESTREAM_<KEY>` at the top level, "
           "`MERGESTREAM_<SECTION>__<KEY>` below it (upper case, `__` between levels); the "
           "[configuration page](../configuration.md) explains how the file is read.", ""]
    sections: list[tuple[str, type[BaseModel], str]] = [("", Config, "")]
    while sections:
        prefix, model, how = sections.pop(0)
        title = f"`{prefix}`" if prefix else "Top level"
        out += [f"## {title}", "", _doc(model) if prefix else "", ""]
        if how:
            out += [how, ""]
        out += ["| key | type | default | description | environment |", "| --- | --- | --- | --- | --- |"]
        subs = []
        for name, field in model.model_fields.items():
            key = f"{prefix}.{name}" if prefix else name
            sub = _model_of(field.annotation)
            env = "MERGESTREAM_" + key.replace(".", "__").upper() if "[" not in key else ""
            desc = field.description or ""
            if sub is not None and typing.get_origin(field.annotation) is list:
                desc = (desc + " " if desc else "") + f"a list of entries; each entry's keys below (`{key}[]`)"
                subs.append((f"{key}[]", sub, ""))
                env = ""
            elif sub is not None:
                env = ""
                desc = (desc + " " if desc else "") + f"section: see [`{key}`](#{key.replace('.', '')})"
                subs.append((key, sub, ""))
            constraints = [f"{k} {v}" for m in field.metadata for k, v in
                           (("≥", getattr(m, "ge", None)), (">", getattr(m, "gt", None)),
                            ("≤", getattr(m, "le", None))) if v is not None]
            typ = _type(field.annotation) + (f" ({', '.join(constraints)})" if constraints else "")
            out.append(f"| `{key}` | {typ} | {_default(field) if sub is None or typing.get_origin(field.annotation) is list else '(section)'} "
                       f"| {_cell(desc)} | {f'`{env}`' if env else ''} |")
        out.append("")
        sections[0:0] = subs
    return "\n".join(out)


def metrics_page() -> str:
    """``reference/metrics.md``: every metric the daemon registers, as ``/metrics`` names it."""
    from prometheus_client.metrics import MetricWrapperBase

    from mergestream.daemon.metrics import Metrics

    m = Metrics()
    rows = []
    for attr, c in vars(m).items():
        if not isinstance(c, MetricWrapperBase):
            continue
        name = c._name + ("_total" if c._type == "counter" else "")
        labels = ", ".join(f"`{x}`" for x in c._labelnames if x != "le")
        rows.append(f"| `{name}` | {c._type} | {labels} | {_cell(c._documentation)} |")
    return "\n".join(["# Prometheus metrics", "",
                      "Generated from the metrics registry (`mergestream.daemon.metrics.Metrics`) at build "
                      "time: every metric the daemon serves on `/metrics`. A histogram also has its "
                      "`_bucket`, `_sum` and `_count` series. What the label values mean, and the alerts "
                      "built on them: [metrics and alerts](../metrics.md).", "",
                      "| metric | type | labels | help |", "| --- | --- | --- | --- |", *rows, ""])


def _params_table(model: type[BaseModel]) -> list[str]:
    rows = ["| parameter | type | default | description |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        constraints = [f"{k} {v}" for m in field.metadata for k, v in
                       (("≥", getattr(m, "ge", None)), (">", getattr(m, "gt", None)),
                        ("≤", getattr(m, "le", None)), ("<", getattr(m, "lt", None))) if v is not None]
        typ = _type(field.annotation) + (f" ({', '.join(constraints)})" if constraints else "")
        rows.append(f"| `{field.alias or name}` | {typ} | {_default(field)} | {_cell(field.description or '')} |")
    return rows


def policies_page() -> str:
    """``reference/policies.md``: the registry's policies, their parameters and their math."""
    from mergestream.policies import RECOMMENDED_PARAMS, RECOMMENDED_POLICY, REGISTRY
    from mergestream.policies.budget import BudgetParams
    from mergestream.policies.lines import LinesParams

    out = ["# Policies and their parameters", "",
           "Generated from the policy registry (`mergestream.policies.REGISTRY`) at build time. Pass a "
           "parameter as `--set NAME=VALUE` on the command line or under `policy.params` in the daemon's "
           f"configuration. The default policy is `{RECOMMENDED_POLICY}` with "
           + ", ".join(f"`{k}={v}`" for k, v in RECOMMENDED_PARAMS.items())
           + ". Which to pick, with the measured quality: [policies](../policies.md).", ""]
    for name, cls in REGISTRY.items():
        mod = sys.modules[cls.__module__]
        first = inspect.cleandoc(mod.__doc__ or "").split("\n\n")
        out += [f"## `{name}`", "", _cell(first[0]), ""]
        out += _params_table(cls.Params)
        strength = cls().strength()
        out += ["", (f"Strength (what `policy.strength: auto` searches, [data-driven merging](../data-driven.md)): "
                     f"`{strength[0]}` over {', '.join(f'{v:g}' for v in strength[1])} and the configured value."
                     if strength else "No declared strength parameter: `policy.strength: auto` needs "
                     "`strength.param` (a numeric parameter) and `strength.grid`.")]
        out += ["", f'??? note "The math of `{name}` (docstring of `{cls.__module__}`)"', "",
                "    ```text"]
        out += ["    " + line if line else "" for line in inspect.cleandoc(mod.__doc__ or "").splitlines()]
        out += ["    ```", ""]
    out += ["## LiNeS depth scaling (any policy)", "",
            "These parameters can be added to any policy's (`mergestream.policies.lines`):", ""]
    out += _params_table(LinesParams)
    out += ["", "## Patch budget (any policy)", "",
            "This parameter can be added to any policy's (`mergestream.policies.budget`); "
            "[fleet updates](../fleet.md) says when to use it:", ""]
    out += _params_table(BudgetParams)
    return "\n".join(out) + "\n"


def quality_table() -> str:
    """The policies page's table: per registered policy, its plain row of the quality benchmark (mean
    over the orders) and its best variant, from ``bench/results/quality.json``."""
    import numpy as np

    from mergestream.policies import REGISTRY

    doc = json.loads((RESULTS / "quality.json").read_text())
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in doc["runs"]:
        groups.setdefault(r["policy"] + r["variant"], []).append(r)

    def mean(rows: list[dict[str, Any]], key: str) -> float:
        return float(np.mean([r["final"][key] for r in rows]))

    out = ["| policy | tuned | H | patch/model (format 1 / 2 + zstd) | s per fold | best variant (H) |",
           "| --- | --- | ---: | ---: | ---: | --- |"]
    for name in REGISTRY:
        rows = groups.get(name)
        if not rows:
            out.append(f"| `{name}` | not in the benchmark | | | | |")
            continue
        fam = {k: v for k, v in groups.items() if v[0]["policy"] == name and k != name}
        best = max(fam, key=lambda k: mean(fam[k], "H"), default=None)
        f = rows[0]["final"]
        out.append(f"| `{name}` | {', '.join(f'{k}={v}' for k, v in rows[0]['params'].items())} | "
                   f"**{mean(rows, 'H'):.1f}** | "
                   f"{f.get('patch_ratio_mean', float('nan')):.3f} / {f.get('patch_ratio_v2_mean', float('nan')):.3f} | "
                   f"{mean(rows, 'fold_seconds_mean'):.1f} | "
                   + (f"`{best}` ({mean(fam[best], 'H'):.1f})" if best else "–") + " |")
    return "\n".join(out)


def write(path: str, text: str) -> None:
    with mkdocs_gen_files.open(path, "w") as f:
        f.write(text)


write("reference/config.md", config_page())
page = (ROOT / "docs" / "policies.md").read_text()
marker = next(line for line in page.splitlines() if line.startswith("<!-- quality-table"))
write("policies.md", page.replace(marker, quality_table()))
write("reference/metrics.md", metrics_page())
write("reference/policies.md", policies_page())
quality = (RESULTS / "quality.md").read_text()
write("results/quality.md", quality + "\n" + "\n".join(
    f"![{name}](../img/{name})" for name in IMAGES if (RESULTS / name).exists()) + "\n")
for name in IMAGES:
    if (RESULTS / name).exists():
        with mkdocs_gen_files.open(f"img/{name}", "wb") as f:
            f.write((RESULTS / name).read_bytes())
