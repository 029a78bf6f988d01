"""Output of ``bench/quality.py``: quality.json (written first, after every run), quality.md and
the PNG plots (last: a plot error never loses a finished run)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from quality_plots import NEEDS_DATA as _NEEDS_DATA  # row variants that need data or a search objective
from quality_setup import portable_protocol

from mergestream.policies import REGISTRY

log = logging.getLogger(__name__)


def hmean(a: float, g: float) -> float:
    """H = 2·ACC·G/(ACC + G) (0 when both are 0)."""
    return 2 * a * g / (a + g) if a + g > 0 else 0.0


# ------------------------------------------------------------------------------------------
def complete_plan(doc: dict[str, Any]) -> None:
    """``+ri`` and ``+distill`` rows enter ``planned_runs`` only when their order is reached (the "best other"
    policy is chosen during the run): once a ``+ri`` label is known, plan it on every order."""
    seeds = [None, *range(doc["protocol"]["shuffles"])]
    plan = doc.setdefault("planned_runs", [])
    for name in sorted({n for n, _ in plan if n.endswith(("+ri", "+distill"))}):
        for seed in seeds:
            if [name, seed] not in plan:
                plan.append([name, seed])



def recommended_row(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The row ``mergestream init`` and the demo should default to: among rows that need no data
    (no RI, no coefficient search), whose policy's state does not grow with the stream
    (``Policy.state_grows``: a daemon is left running on an open-ended stream) and that have every
    order of the protocol (file order + each shuffle) finished, the one with the best mean H over
    the orders. None until every planned run of such a row is done (a planned run of a row that
    needs data cannot change the choice, so it is not waited for).

    Returns:
        {"label", "policy", "params", "H", "orders"}.
    """
    def candidate(policy: str, variant: str) -> bool:
        return not variant.endswith(_NEEDS_DATA) and policy in REGISTRY and not REGISTRY[policy].state_grows

    done = {(label(r), r["order_seed"]) for r in doc["runs"]}
    for n, s in (tuple(x) for x in doc.get("planned_runs", [])):
        policy = n.split("+", 1)[0]
        if candidate(policy, n[len(policy):]) and (n, s) not in done:
            return None
    orders = {None, *range(doc["protocol"]["shuffles"])}
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in doc["runs"]:
        if candidate(r["policy"], r["variant"]):
            groups.setdefault(label(r), []).append(r)
    full = {n: rs for n, rs in groups.items() if {r["order_seed"] for r in rs} == orders}
    if not full:
        return None
    name = max(full, key=lambda n: float(np.mean([r["final"]["H"] for r in full[n]])))
    rs = full[name]
    return {"label": name, "policy": rs[0]["policy"], "params": rs[0]["params"],
            "H": float(np.mean([r["final"]["H"] for r in rs])), "orders": len(rs)}


def backward_transfer(order: list[str], final_acc: dict[str, float], diag: dict[str, float]) -> dict[str, float]:
    """BWT under both conventions, from the accuracy matrix's last row and its diagonal.

    ``BWT`` (ours, METHODS.md): mean over the T − 1 earlier tasks j < T of a_{T,j} − a_{j,j}.
    ``BWT_ref`` (FusionBench / the OPCM and DOP papers): the same sum divided by T (the last task's
    a_{T,T} − a_{T,T} = 0 counted in the mean), i.e. BWT · (T − 1)/T. Both 0.0 for one task.

    Args:
        order: the tasks in fold order (T of them). final_acc: a_{T,j} per task (percent).
        diag: a_{j,j}, each task's accuracy right after its own fold (percent).
    """
    t = len(order)
    if t < 2:
        return {"BWT": 0.0, "BWT_ref": 0.0}
    total = float(sum(final_acc[j] - diag[j] for j in order[:-1]))
    return {"BWT": total / (t - 1), "BWT_ref": total / t}


def bwt_ref_of(run: dict[str, Any]) -> float:
    """A run's reference-convention BWT: stored, or (rows written before it was) BWT · (T − 1)/T."""
    f = run["final"]
    if "BWT_ref" in f:
        return float(f["BWT_ref"])
    t = len(run["order"])
    return float(f["BWT"]) * (t - 1) / t if t > 1 else 0.0


#: policies whose final model is a function of the set of experts, not of their order (Task
#: Arithmetic, Iso-C, Iso-CTS, weight averaging), and the variants that keep that (RI and coefficient
#: searches depend on the order): their final-model metrics are equal for every order by
#: construction, so their rows say so instead of a spread of 0. BWT and a_jj still depend on the order.
ORDER_FREE = frozenset({"task_arithmetic", "iso_c", "iso_cts", "weight_average"})
ORDER_FREE_VARIANTS = ("", "+lines")
#: a task whose expert gains fewer points than this over the base with the expert's head gets no
#: gain share (the ratio of two small differences is noise)
MIN_GAIN = 1.0


def order_free(run: dict[str, Any]) -> bool:
    """Whether a run's final model cannot depend on its order (see :data:`ORDER_FREE`)."""
    return run["policy"] in ORDER_FREE and run["variant"] in ORDER_FREE_VARIANTS


def gain_share(merged: float, expert: float, base_head: float) -> float | None:
    """Percent of the expert's gain over the base with its head that the merged model keeps:
    100 · (merged − base+head) / (expert − base+head); None when the gain is under :data:`MIN_GAIN`."""
    gain = expert - base_head
    return None if gain < MIN_GAIN else 100.0 * (merged - base_head) / gain


def final_acc_of(run: dict[str, Any]) -> dict[str, float]:
    """a_{T,j} per task: the last step's accuracies."""
    return run["steps"][-1]["acc"]


def ran_params_text(run: dict[str, Any]) -> str:
    """The params cell: every parameter the row ran with when the run stored them (``ran_params``),
    else the ones it was given, marked (the others were the defaults of its time)."""
    if run.get("ran_params"):
        return ", ".join(f"{k}={v}" for k, v in run["ran_params"].items())
    given = ", ".join(f"{k}={v}" for k, v in run["params"].items())
    return (given + "; " if given else "") + "others: the defaults when it ran"


def gain_table(doc: dict[str, Any]) -> list[str]:
    """Per task and on average, the share of the expert's gain each row's final model recovers."""
    tasks, ref = doc["protocol"]["tasks"], doc["references"]
    kept = [t for t in tasks if gain_share(0.0, ref["expert_acc"][t], ref["base_head_acc"][t]) is not None]
    out = ["", "## Share of the expert's gain recovered", "",
           "100 · (merged − base+head) / (expert − base+head) per task for the final model, mean over orders: "
           "with LP-FT heads the unchanged base with an expert's head already scores near the expert on some "
           f"tasks, which compresses ACC. Tasks whose expert gains under {MIN_GAIN:g} point over base+head show – "
           "and are left out of the mean.", "",
           "| policy | " + " | ".join(tasks) + " | mean |", "| --- |" + " ---: |" * (len(tasks) + 1)]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in doc["runs"]:
        groups.setdefault(label(r), []).append(r)
    for name, rs in groups.items():
        cells, means = [], []
        for t in tasks:
            if t not in kept:
                cells.append("–")
                continue
            v = float(np.mean([gain_share(final_acc_of(r)[t], ref["expert_acc"][t], ref["base_head_acc"][t])
                               for r in rs]))
            means.append(v)
            cells.append(f"{v:.0f}")
        out.append(f"| {name} | " + " | ".join(cells) + (f" | {np.mean(means):.0f} |" if means else " | – |"))
    return out


def label(run: dict[str, Any]) -> str:
    """A run's row label: policy + variant (``opcm+lines``)."""
    return run["policy"] + run["variant"]


def write_md(doc: dict[str, Any], path: Path) -> None:
    """quality.md from the document (``path`` overwritten)."""
    p = doc["protocol"]
    ref = doc["references"]
    lines = ["# Merge quality on real experts (all-MiniLM-L6-v2)", "",
             "Generated by `bench/quality.py`; do not edit by hand. Command:", "",
             f"    {doc['command']}", "",
             f"Tasks ({len(p['tasks'])}, file order): {', '.join(p['tasks'])}. "
             f"Evaluation: {p['eval_examples'] or 'all'} test rows per task (seeded subsample), G = STS-B test "
             f"Spearman x100 on {p['sts_pairs'] or 1379} pairs; orders: the file order"
             f"{' (accuracy of every seen task after every fold)' if True else ''}"
             + (f" plus {p['shuffles']} seeded shuffles" + (" (all tasks measured after the last fold only; "
                "a_jj right after each fold)" if p["final_only_shuffles"] else "") if p["shuffles"] else "") + ".",
             "", "Hyperparameters: " + hyper_line(p) + " The `params` column lists what each row ran with.", ""]
    for pol, t in (p.get("tuning") or {}).items():
        lines.append(f"- tuned {pol}: {t['param']}={t['chosen']} from {t['grid']}"
                     + (" (**at the grid's edge**: widen the grid)" if t.get("at_grid_edge") else "")
                     + ("; that row only, on top of its parent's tuned value." if "+" in pol
                        else "; its variants use it too."))
    lp = p.get("lpft") or {}
    if lp.get("tasks"):
        lines.append(f"- LP-FT ({lp.get('rule', '')}): "
                     + ", ".join(f"{t} {'LP-FT' if d['lpft'] else 'fine-tune'} ({d['expert_val_acc']:.1f} vs "
                                 f"{d['probe_val_acc']:.1f})" for t, d in lp["tasks"].items()) + ".")
    if lines[-1].startswith("- "):
        lines.append("")
    if p.get("reduced"):
        lines += ["**Reduced protocol** (what was cut to fit the time available): " + p["reduced"], ""]
    lines += ["## References", "",
              "| task | expert acc % | base + expert head % | linear probe on frozen base % |",
              "| --- | ---: | ---: | ---: |"]
    for t in p["tasks"]:
        lines.append(f"| {t} | {ref['expert_acc'][t]:.1f} | {ref['base_head_acc'][t]:.1f} | {ref['linear_probe_acc'][t]:.1f} |")
    lines.append(f"| **mean** | {np.mean(list(ref['expert_acc'].values())):.1f} | "
                 f"{np.mean(list(ref['base_head_acc'].values())):.1f} | {np.mean(list(ref['linear_probe_acc'].values())):.1f} |")
    lines += ["", f"G of the unchanged base: {ref['base_G']:.2f}; G of each single expert: "
              + ", ".join(f"{t} {v:.1f}" for t, v in ref["expert_G"].items()), ""]
    lines += ["## Final model after all folds", "",
              "Mean over orders (file order + shuffles) ± std where there are several; UAD = mean accuracy "
              "drop of the remaining tasks after `unmerge --mode subtract` of the first task, against the "
              "model folded without it from the start (= `--mode replay`), file order.", "",
              "patch/model = size of the version-to-version patch (`versions/N/patch-from-<N-1>`) over the full "
              "model's, mean over folds 2..T of the file order, in patch format 1 and in format 2 with zstd (v2); "
              "RI s = seconds of the RI pre-step per expert "
              "(the first expert of an order has no earlier heads, so RI leaves it unchanged); distil s = seconds of "
              "the distil post-step per fold (`mergestream.datasteps.distill`: every seen task's head pulled toward its "
              "expert's outputs on a few unlabeled inputs, θ₀'s similarity geometry kept).", "",
              "BWT = mean over the earlier tasks j < T of a_Tj − a_jj (ours); BWT ref = the same sum divided by "
              "T, the convention of FusionBench and the OPCM/DOP papers (= BWT · (T − 1)/T); a_jj = mean accuracy "
              "of each task right after its own fold (a low a_jj makes a positive BWT easy).", "",
              "Order-free rows (Task Arithmetic, Iso-C, Iso-CTS, weight averaging, alone or with LiNeS: the final "
              "model is a function of the set of experts) show their final-model metrics without a spread: they "
              "are equal for every order by construction.", "",
              "| policy | params | ACC | norm ACC | BWT | BWT ref | a_jj | G | H | fold s | RI s | distil s | patch/model | patch/model v2 | UAD |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in doc["runs"]:
        groups.setdefault(label(r), []).append(r)
    for name, rs in groups.items():
        free = all(order_free(r) for r in rs)

        def cell(key: str, rs=rs, free=free) -> str:
            if key == "BWT_ref":
                v = [bwt_ref_of(r) for r in rs]
            elif key == "a_jj":
                v = [float(np.mean([r["diag"][t] for t in r["order"]])) for r in rs]
            else:
                v = [r["final"][key] for r in rs]
            spread = len(v) > 1 and not (free and key in ("ACC", "norm_ACC", "G", "H"))
            return f"{np.mean(v):.1f}" + (f" ± {np.std(v):.1f}" if spread else "")
        u = next((r["uad"]["UAD"] for r in rs if r.get("uad")), None)
        pr = next((r["final"]["patch_ratio_mean"] for r in rs if r["final"].get("patch_ratio_mean") is not None), None)
        pr2 = next((r["final"]["patch_ratio_v2_mean"] for r in rs if r["final"].get("patch_ratio_v2_mean") is not None),
                   None)
        ri_s = [r["final"]["ri_seconds_mean"] for r in rs if r["final"].get("ri_seconds_mean") is not None]
        di_s = [r["final"]["distill_seconds_mean"] for r in rs if r["final"].get("distill_seconds_mean") is not None]
        params = ran_params_text(rs[0]) + ("; order-free" if free and len(rs) > 1 else "")
        lines.append(f"| {name} | {params} | {cell('ACC')} | {cell('norm_ACC')} | {cell('BWT')} | {cell('BWT_ref')} | "
                     f"{cell('a_jj')} | {cell('G')} | "
                     f"{cell('H')} | {np.mean([r['final']['fold_seconds_mean'] for r in rs]):.1f} | "
                     + (f"{np.mean(ri_s):.1f}" if ri_s else "–") + " | "
                     + (f"{np.mean(di_s):.1f}" if di_s else "–") + " | "
                     + (f"{pr:.3f}" if pr is not None else "–") + " | "
                     + (f"{pr2:.3f}" if pr2 is not None else "–") + " | "
                     + (f"{u:.2f}" if u is not None else "–") + " |")
    lines += gain_table(doc)
    lines += gains_table(doc["runs"])
    planned = doc.get("planned_runs")
    if planned:
        done = {(r["policy"] + r["variant"], r["order_seed"]) for r in doc["runs"]}
        missing = [f"{name} (order {'file' if seed is None else 'shuffle ' + str(seed)})"
                   for name, seed in (tuple(x) for x in planned) if (name, seed) not in done]
        lines += ["", f"Runs completed: {len(done)} of {len(planned)} planned."
                  + (" Not completed yet (the benchmark runs in pieces: the same command with `--resume` runs only these): " + ", ".join(missing) + "." if missing else "")]
    rec = recommended_row(doc)
    if rec is not None:
        lines += ["", f"Recommended default (`mergestream init`, the demo): **{rec['label']}** "
                  f"({', '.join(f'{k}={v}' for k, v in rec['params'].items())}), mean H {rec['H']:.1f} over "
                  f"{rec['orders']} orders — the best row that needs no data (no RI, no coefficient search) and "
                  f"whose state does not grow with the stream (not {', '.join(sorted(n for n, c in REGISTRY.items() if c.state_grows))})."]
    if doc.get("skipped"):
        lines += ["", "Not run: " + "; ".join(doc["skipped"])]
    lines += ["", "## File order, per fold (ACC over the tasks seen so far / G / H)", ""]
    fo = [r for r in doc["runs"] if r["order_seed"] is None]
    lines.append("| policy | " + " | ".join(f"t={i + 1}" for i in range(len(p["tasks"]))) + " |")
    lines.append("| --- |" + " ---: |" * len(p["tasks"]))
    for r in fo:
        cells = []
        for s in r["steps"]:
            a = float(np.mean(list(s["acc"].values())))
            cells.append(f"{a:.1f} / {s['G']:.1f} / {hmean(a, s['G']):.1f}" if s["G"] is not None else f"{a:.1f}")
        lines.append(f"| {label(r)} | " + " | ".join(cells) + " |")
    lines += ["", "Plots: " + ", ".join(f"`{x}`" for x in doc.get("plots", [])), ""]
    path.write_text("\n".join(lines))


def plot(doc: dict[str, Any], out: Path) -> list[str]:
    """The PNG plots of the file-order runs in ``out`` (:mod:`quality_plots`); returns their names.
    The recommended row (:func:`recommended_row`, or ``mergestream``'s recommended policy while the
    benchmark is unfinished) is drawn as the default."""
    import quality_plots

    rec = recommended_row(doc)
    return quality_plots.plot(doc, out, rec["label"] if rec else _recommended_policy())


def _recommended_policy() -> str | None:
    try:
        from mergestream.policies import RECOMMENDED_POLICY
    except ImportError:  # the package is not installed: no row is drawn as the default
        return None
    return RECOMMENDED_POLICY


#: new methods that are a policy of their own, compared with the policy they extend (Iso-C is task
#: arithmetic with each weight matrix's summed task vectors made isotropic)
METHOD_BASELINES = {"iso_c": "task_arithmetic"}


def gains_table(runs: list[dict[str, Any]]) -> list[str]:
    """quality.md lines: each variant (``+lines``, ``+ri``, ...) against its parent policy, and each
    policy of :data:`METHOD_BASELINES` against the policy it extends, on the orders both ran (means
    over those orders), with both rows' seconds per fold."""
    by: dict[tuple[str, Any], dict[str, Any]] = {(label(r), r["order_seed"]): r for r in runs}
    out = []
    names = [label(r) for r in runs if r["variant"] or r["policy"] in METHOD_BASELINES]
    for name in dict.fromkeys(names):
        parent = next(r["policy"] for r in runs if label(r) == name)
        parent = METHOD_BASELINES.get(name, parent)
        for step in ("+ri", "+distill"):  # a data step on a variant against the same variant without it
            if name.endswith(step) and "+" in name[:-len(step)]:
                parent = name[:-len(step)]
        seeds = [s for (n, s) in by if n == name and (parent, s) in by]
        if not seeds:
            continue
        def mean(key: str, lab: str, seeds=seeds) -> float:
            return float(np.mean([by[(lab, s)]["final"][key] for s in seeds]))
        d = {k: mean(k, name) - mean(k, parent) for k in ("H", "ACC", "BWT", "G")}
        out.append(f"| {name} | {parent} | {len(seeds)} | {d['H']:+.1f} | {d['ACC']:+.1f} | {d['BWT']:+.1f} | "
                   f"{d['G']:+.1f} | {mean('fold_seconds_mean', name):.1f} | {mean('fold_seconds_mean', parent):.1f} |")
    if not out:
        return []
    return ["", "## Each step's gain over the same policy without it", "",
            "Differences (variant − parent), means over the orders both rows ran.", "",
            "| variant | parent | orders | ΔH | ΔACC | ΔBWT | ΔG | fold s (variant) | fold s (parent) |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", *out]


def hyper_line(p: dict[str, Any]) -> str:
    """quality.md's sentence on where the hyperparameters came from (tuning, overrides, defaults)."""
    val = p.get("validation", "train")
    where = ("held-out validation rows carved from train before the experts were trained"
             if val == "holdout" else "rows of the train split the experts were trained on (in-sample)")
    parts = [f"tuned on {where}, G on STS-B dev" if p.get("tuned") else "not tuned"]
    over = p.get("overrides") or {}
    if over:
        parts.append("overrides: " + "; ".join(f"{lab}." + f", {lab}.".join(f"{k}={v}" for k, v in ps.items())
                                                for lab, ps in over.items()))
    else:
        parts.append("otherwise the policies' defaults")
    return "; ".join(parts) + "."


def save_outputs(doc: dict[str, Any], out: Path,
                 plotter: Callable[[dict[str, Any], Path], list[str]] | None = None) -> list[str]:
    """Write ``quality.json`` first (atomically), then ``quality.md``, then the plots; a plot error is
    logged and recorded in the document (``plot_error``), never raised, so a finished run is kept.

    Returns:
        The plot file names written (empty when plotting failed).
    """
    out.mkdir(parents=True, exist_ok=True)
    complete_plan(doc)
    if "protocol" in doc:  # no host folder in a checked-in result (read back: common.resolved_path)
        doc["protocol"] = portable_protocol(doc["protocol"])
    _write_json(doc, out / "quality.json")
    write_md(doc, out / "quality.md")
    try:
        files = (plotter or plot)(doc, out)
    except Exception as exc:  # noqa: BLE001 - plots are optional; the JSON is the result
        log.warning("plots failed (quality.json and quality.md are written): %s", exc)
        doc["plot_error"] = f"{type(exc).__name__}: {exc}"
        files = []
    else:
        doc.pop("plot_error", None)
    doc["plots"] = files
    _write_json(doc, out / "quality.json")
    write_md(doc, out / "quality.md")
    return files


def _write_json(doc: dict[str, Any], path: Path) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    tmp.replace(path)
