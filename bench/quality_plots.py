"""The PNG plots of ``bench/quality.py`` (drawn from quality.json alone, so ``--from-json`` redraws them).

- ``quality_acc_matrix.png``: accuracy after each fold on each task, one panel per file-order row.
- ``quality_curves.png``: ACC, G and H after each fold (file order) for the rows that matter
  (:func:`highlighted`), each in a style of its own, the legend outside the panels; every other row is
  a thin grey line and a row of the table under the panels.
- ``quality_patch.png``: final H (mean over the orders) against the version-to-version patch size
  over the model size, in patch format 1 and in format 2 + zstd, every row a point.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

#: row variants that need data (unlabeled inputs or probe rows) or a search objective: dashed lines
NEEDS_DATA = ("+ri", "+distill", "+cmaes", "+adamerging")
#: the seed methods of the project (SAFE-Merge and MDM-OC, ../shared/METHODS.md): always shown
SEED_METHODS = ("safe_merge", "mdm_oc")
#: distinct colours and markers for the highlighted rows (no colour repeats among at most 12 rows)
_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
            "#bcbd22", "#000000", "#4b0082", "#aec7e8")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h", "*", "p")


def _label(run: dict[str, Any]) -> str:
    return run["policy"] + run["variant"]


def _hmean(a: float, g: float) -> float:
    return 2 * a * g / (a + g) if a + g > 0 else 0.0


def mean_h(doc: dict[str, Any]) -> dict[str, float]:
    """Each row's final H, mean over the orders it ran (file order + shuffles), in row order."""
    groups: dict[str, list[float]] = {}
    for r in doc["runs"]:
        groups.setdefault(_label(r), []).append(r["final"]["H"])
    return {k: float(np.mean(v)) for k, v in groups.items()}


def highlighted(doc: dict[str, Any], default: str | None) -> list[str]:
    """The rows the plots show in colour, in this order: the default row, the seed methods' plain rows
    (:data:`SEED_METHODS`), then the best row (mean H over its orders) of each policy family (rows
    whose policy is the same, variants included). Only rows with a file-order run are returned."""
    fo = {_label(r) for r in doc["runs"] if r["order_seed"] is None}
    h = mean_h(doc)
    best: dict[str, str] = {}
    for r in doc["runs"]:
        name = _label(r)
        if name in fo and (r["policy"] not in best or h[name] > h[best[r["policy"]]]):
            best[r["policy"]] = name
    picked = [n for n in (default, *SEED_METHODS, *best.values()) if n in fo]
    return list(dict.fromkeys(picked))


def _style(i: int, name: str, default: str | None) -> dict[str, Any]:
    return {"color": _COLOURS[i % len(_COLOURS)], "marker": _MARKERS[i % len(_MARKERS)], "markersize": 5,
            "ls": "--" if name.endswith(NEEDS_DATA) else "-", "lw": 2.6 if name == default else 1.5,
            "zorder": 3}


def _curves(r: dict[str, Any]) -> tuple[list[int], list[float], list[float], list[float]]:
    ts = [s["t"] for s in r["steps"]]
    acc = [float(np.mean(list(s["acc"].values()))) for s in r["steps"]]
    g = [s["G"] for s in r["steps"]]
    return ts, acc, g, [_hmean(a, b) for a, b in zip(acc, g)]


def plot_curves(doc: dict[str, Any], out: Path, default: str | None) -> Path:
    """``quality_curves.png``: see the module docstring. ``default``: the recommended row's label."""
    import matplotlib.pyplot as plt

    fo = [r for r in doc["runs"] if r["order_seed"] is None]
    show = highlighted(doc, default)
    rest = [r for r in fo if _label(r) not in show]
    h = mean_h(doc)
    height = 4.2 + 0.19 * (len(rest) + 2)
    fig = plt.figure(figsize=(15, height))
    grid = fig.add_gridspec(2, 3, height_ratios=[4.2, height - 4.2], hspace=0.35)
    axes = [fig.add_subplot(grid[0, i]) for i in range(3)]
    for r in rest:
        ts, acc, g, hh = _curves(r)
        for ax, ys in zip(axes, (acc, g, hh)):
            ax.plot(ts, ys, color="0.75", lw=0.8, zorder=1)
    by = {_label(r): r for r in fo}
    for i, name in enumerate(show):
        ts, acc, g, hh = _curves(by[name])
        tag = name + (" (default)" if name == default else "") + f": H {h[name]:.1f}"
        for ax, ys in zip(axes, (acc, g, hh)):
            ax.plot(ts, ys, label=tag if ax is axes[0] else None, **_style(i, name, default))
    for ax, title in zip(axes, ("ACC (tasks seen so far) %", "G (STS-B Spearman x100)", "H")):
        ax.set_xlabel("folds")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].axhline(doc["references"]["base_G"], color="k", ls=":", lw=0.8, label="base")
    handles, labels = axes[0].get_legend_handles_labels()
    handles += [plt.Line2D([], [], color="0.75", lw=0.8), plt.Line2D([], [], color="k", ls=":", lw=0.8)]
    labels += [f"{len(rest)} other rows (table below)", "G of the base"]
    fig.legend(handles, labels, loc="upper left", bbox_to_anchor=(0.905, 0.98), fontsize=8,
               title="file order; H = mean over orders\n(dashed: needs data)", title_fontsize=8, frameon=False)
    tab = fig.add_subplot(grid[1, :])
    tab.axis("off")
    if rest:
        rows = []
        for r in rest:
            _, acc, g, hh = _curves(r)
            rows.append([_label(r), f"{acc[-1]:.1f}", f"{g[-1]:.1f}", f"{hh[-1]:.1f}", f"{h[_label(r)]:.1f}"])
        t = tab.table(cellText=rows, colLabels=["other row", "ACC", "G", "H", "H (mean over orders)"],
                      loc="upper center", cellLoc="left", colWidths=[0.3, 0.08, 0.08, 0.08, 0.16])
        t.auto_set_font_size(False)
        t.set_fontsize(7.5)
        t.scale(1, 1.05)
        tab.set_title("the other rows after the last fold (file order)", fontsize=9)
    fig.suptitle("quality after each fold, file order", y=0.995)
    path = out / "quality_curves.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_patch(doc: dict[str, Any], out: Path, default: str | None) -> Path | None:
    """``quality_patch.png``: final H against patch/model for every row that recorded its patch sizes
    (format 1 and format 2 + zstd, one panel each); None when no row has them."""
    import matplotlib.pyplot as plt

    h = mean_h(doc)
    ratio: dict[str, tuple[float | None, float | None]] = {}
    for r in doc["runs"]:
        f = r["final"]
        if f.get("patch_ratio_mean") is not None and _label(r) not in ratio:
            ratio[_label(r)] = (f["patch_ratio_mean"], f.get("patch_ratio_v2_mean"))
    if not ratio:
        return None
    families = list(dict.fromkeys(r["policy"] for r in doc["runs"]))
    colour = {p: _COLOURS[i % len(_COLOURS)] for i, p in enumerate(families)}
    family = {_label(r): r["policy"] for r in doc["runs"]}
    show = patch_labels(doc, ratio, default)
    span = max(h.values()) - min(h.values())
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.6), sharey=True)
    for k, (ax, title) in enumerate(zip(axes, ("patch format 1", "patch format 2 + zstd"))):
        boxes: list[tuple[float, float, float]] = []  # placed labels: x from, x to, y
        for name in sorted(ratio, key=lambda n: (n not in show, -h[n])):
            x = ratio[name][k]
            if x is None:
                continue
            ax.scatter(x, h[name], s=80 if name == default else 34, color=colour[family[name]],
                       marker="^" if name.endswith(NEEDS_DATA) else "o",
                       edgecolors="k" if name in show else "none", zorder=3 if name in show else 2)
            if name in show:
                text = name + (" (default)" if name == default else "")
                tx, ty, ha = _place(boxes, x, h[name], 0.0108 * len(text), span * 0.04)
                ax.annotate(text, (x, h[name]), (tx, ty), fontsize=7, ha=ha, va="center",
                            arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "0.5"} if ty != h[name] else None)
        ax.axvline(1.0, color="k", ls=":", lw=0.8)
        ax.set_xlim(0, 1.12)
        ax.set_xlabel("patch / model (mean over folds 2..T, file order)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("final H (mean over orders)")
    handles = [plt.Line2D([], [], ls="", marker="o", color=colour[p], label=p) for p in families]
    handles += [plt.Line2D([], [], ls="", marker="^", color="0.4", label="needs data (+ri, +distill, +cmaes, +adamerging)"),
                plt.Line2D([], [], ls="", marker="o", color="w", markeredgecolor="k",
                           label="labelled: each policy, the default,\nthe best row of each family,\n"
                                 "the best H at its patch size or less (v2)"),
                plt.Line2D([], [], color="k", ls=":", lw=0.8, label="a full download")]
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.91, 0.9), fontsize=8, frameon=False,
               title="policy family", title_fontsize=8)
    fig.suptitle("merge quality against the size of each version-to-version patch")
    path = out / "quality_patch.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


#: patch/model sizes closer than this count as the same size on the front (the SAFE-Merge rows all
#: send 0.104 of the model: only the best of them is on it)
FRONT_TOLERANCE = 0.01


def patch_labels(doc: dict[str, Any], ratio: dict[str, tuple[float | None, float | None]],
                 default: str | None) -> set[str]:
    """The rows ``quality_patch.png`` labels: the curves' rows (:func:`highlighted`), every family's
    plain row, a variant that needs no data and beats its plain row by 0.5 H or more
    (safe_merge+iso), and the front of H against patch size in format 2: each row no other row beats
    in H with a patch as small or smaller (within :data:`FRONT_TOLERANCE`; the best a fleet gets for
    its bytes), among all rows and among the rows that need no data.

    Args:
        ratio: label -> (patch/model in format 1, in format 2 + zstd), None where not recorded.
    """
    h = mean_h(doc)
    families = {r["policy"] for r in doc["runs"]}
    family = {_label(r): r["policy"] for r in doc["runs"]}
    show = set(highlighted(doc, default)) | {n for n in ratio if n in families}
    show |= {n for n in ratio if not n.endswith(NEEDS_DATA) and family[n] in h and h[n] >= h[family[n]] + 0.5}
    v2 = {n: x[1] for n, x in ratio.items() if x[1] is not None}
    free = {n for n in v2 if not n.endswith(NEEDS_DATA)}
    for rows in (v2, free):  # the front of every row, and of the rows that need no data
        show |= {n for n in rows if not any(v2[m] <= v2[n] + FRONT_TOLERANCE and h[m] > h[n] for m in rows)}
    return show


def _place(boxes: list[tuple[float, float, float]], x: float, y: float, width: float,
           height: float) -> tuple[float, float, str]:
    """Where a label of ``width`` (data units) goes next to the point (x, y): right of it, else left,
    else further up or down, at the first place that overlaps no label in ``boxes`` (appended)."""
    for step in (0, -1, 1, -2, 2, -3, 3, -4, 4):
        ty = y + step * height
        for ha, x0, x1 in (("left", x + 0.012, x + 0.012 + width), ("right", x - 0.012 - width, x - 0.012)):
            if all(x1 < a or x0 > b or abs(ty - by) >= height for a, b, by in boxes):
                boxes.append((x0, x1, ty))
                return (x0 if ha == "left" else x1), ty, ha
    boxes.append((x + 0.012, x + 0.012 + width, y))
    return x + 0.012, y, "left"


def plot_matrix(doc: dict[str, Any], out: Path) -> Path:
    """``quality_acc_matrix.png``: accuracy after each fold (row) on each task (column), per file-order row."""
    import matplotlib.pyplot as plt

    tasks = doc["protocol"]["tasks"]
    fo = [r for r in doc["runs"] if r["order_seed"] is None]
    n = len(fo)
    cols = min(4, n)
    rows_ = math.ceil(n / cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(3.6 * cols, 3.4 * rows_), squeeze=False)
    for ax, r in zip(axes.flat, fo):
        m = np.full((len(tasks), len(tasks)), np.nan)
        for s in r["steps"]:
            for j, t in enumerate(tasks):
                if t in s["acc"]:
                    m[s["t"] - 1, j] = s["acc"][t]
        im = ax.imshow(m, vmin=0, vmax=100, cmap="viridis")
        ax.set_title(_label(r), fontsize=9)
        ax.set_xticks(range(len(tasks)), tasks, rotation=70, fontsize=7)
        ax.set_yticks(range(len(tasks)), [f"t={i + 1}" for i in range(len(tasks))], fontsize=7)
        for i in range(len(tasks)):
            for j in range(len(tasks)):
                if not np.isnan(m[i, j]):
                    ax.text(j, i, f"{m[i, j]:.0f}", ha="center", va="center", fontsize=6, color="w")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.colorbar(im, ax=axes, shrink=0.6, label="accuracy %")
    fig.suptitle("accuracy after each fold (row) on each task (column), file order")
    path = out / "quality_acc_matrix.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot(doc: dict[str, Any], out: Path, default: str | None = None) -> list[str]:
    """Every plot of the file-order runs into ``out``; returns the file names written (none before
    the first run). ``default``: the recommended row's label, drawn thicker and named in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    if not any(r["order_seed"] is None for r in doc["runs"]):
        return []
    files = [plot_matrix(doc, out), plot_curves(doc, out, default)]
    patch = plot_patch(doc, out, default)
    return [f.name for f in files + ([patch] if patch else [])]
