"""Choose the distil post-step's γ and anchors (``mergestream.datasteps.distill``) on validation rows, never test rows.

Folds the 8 real MiniLM experts of ``bench/results/quality.json`` with Iso-C at its tuned
parameters (order-free: the one-shot merge of all 8), then distils that backbone once per (anchor
count, γ) toward every expert (``--steps`` AdamW steps, ``--aux`` unlabeled train inputs per task,
``--anchors`` STS-B train sentences that are in neither dev nor test), and reports ACC, G and H on
the validation rows carved before the experts were trained with G on STS-B *dev* (what chooses),
and on the benchmark's test rows (for the record only).

    .venv/bin/python bench/distill_gamma.py --gammas 0.1,0.3,1.0 --steps 100 --aux 128 \
        --json bench/results/distill_gamma.json
    .venv/bin/python bench/distill_gamma.py --gammas 0.3 --anchors 0,1024 --json ...
    .venv/bin/python bench/distill_gamma.py --gammas 0.3 --anchors 1024 --lrs 1e-5,3e-5 \
        --patch-budget 0.29 --json ...
    .venv/bin/python bench/distill_gamma.py --gammas 0.3 --anchors 1024 --alphas 1.5,2.5 --json ...

``--alphas`` merges at each Iso-C α in turn (default: the benchmark's tuned α) and runs the grid
on each merge, so α is chosen with the distil step on rather than without it.

``--row`` folds another row of ``bench/quality.py`` instead of Iso-C, at its tuned parameters,
in file order, with ``--alphas`` then setting that row's tuned coefficient (``GRID``'s key: for
``safe_merge+iso``, ``iso_alpha``). Iso-C is order-free, so its fold is the one-shot merge; a row
that is not (SAFE-Merge) is proxied by its file-order stream with one distil step at the end
rather than one per fold, and without RI: a ranking of the coefficient, not the row's H.

    .venv/bin/python bench/distill_gamma.py --row safe_merge+iso --gammas 0.3 --anchors 1024 \
        --alphas 2,2.5,3 --json ...

``--set KEY=VALUE,...`` folds the row at other values of its parameters (``--set rho=0.5``), and
the JSON's ``params`` record them.

``--patch-budget ρ`` stands in for a budgeted row (``iso_c+budget29``): the one-shot merge keeps
only the top ρ of each matrix's change from θ₀ (by |change|, as :mod:`mergestream.policies.budget`
picks at a fold) and the distil step trains only those entries (``within_patch_from`` = θ₀), as
the daemon does under a patch budget.

``bench/results/distill_anchors.json`` holds the runs that chose 1024 anchors at γ 0.3 with 128
inputs per task (each run's command is in it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import quality as Q  # noqa: E402
import torch  # noqa: E402
from common import recorded_command, resolved_path  # noqa: E402
from quality_report import hmean  # noqa: E402
from quality_setup import RESULTS, validation_rows  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from mergestream import experts as X  # noqa: E402
from mergestream.datasteps.distill import DistillParams, DistillTask, distill_backbone, teacher_outputs  # noqa: E402
from mergestream.datasteps.ri import HFEncoderFeatures  # noqa: E402
from mergestream.policies.masks import top_mask  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="the distil step's gamma on validation rows")
    ap.add_argument("--gammas", default="0.1,0.3,1.0")
    ap.add_argument("--steps", type=int, default=DistillParams().steps)
    ap.add_argument("--aux", type=int, default=128, help="unlabeled train inputs per task")
    ap.add_argument("--anchors", default="0",
                    help="comma list of how many general anchor sentences (STS-B *train*) join the similarity term")
    ap.add_argument("--lrs", default=str(DistillParams().lr), help="comma list of distil AdamW learning rates")
    ap.add_argument("--alphas", default=None,
                    help="comma list of the row's coefficient (Iso-C's α) to merge at (default: its tuned value)")
    ap.add_argument("--row", default="iso_c", choices=sorted({p + v for p, v, _ in Q.POLICIES}),
                    metavar="ROW", help="the bench/quality.py row to fold (default iso_c)")
    ap.add_argument("--set", dest="overrides", default=None, metavar="KEY=VALUE,...",
                    help="comma list of the row's parameters to fold at instead of its own (e.g. rho=0.5); "
                         "the JSON's params record them")
    ap.add_argument("--patch-budget", type=float, default=None,
                    help="keep the top ρ of each matrix's change from θ₀ and train only those entries")
    ap.add_argument("--quality-json", default=str(RESULTS / "quality.json"),
                    help="the benchmark whose experts, data and Iso-C tuning are used")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the table as JSON here")
    args = ap.parse_args(argv)
    X._offline()
    torch.set_num_threads(args.threads)
    doc = json.loads(Path(args.quality_json).read_text())
    proto = doc["protocol"]
    tasks = proto["tasks"]
    experts = {t: resolved_path(p) for t, p in proto["experts"].items()}
    data = resolved_path(proto["data"])
    policy, params, key = row_params(args.row, proto["tuning"])
    params = {**params, **_overrides(args.overrides)}
    test = Q.Evaluator.on_test_rows(tasks, experts, data, proto["eval_examples"], proto["sts_pairs"])
    val = Q.Evaluator(test.tasks, test.heads, {t: validation_rows(data, t) for t in tasks},
                      Q.read_sts_dev(data, proto["sts_pairs"] or 500), test.tok)
    work = Path(tempfile.mkdtemp(prefix="ms-distil-gamma-"))
    alphas = _numbers(args.alphas, float) if args.alphas else [params[key]]
    grid = list(itertools.product(_numbers(args.anchors, int), _numbers(args.gammas, float), _numbers(args.lrs, float)))
    fm = HFEncoderFeatures(X.base_model_path(), max_length=DistillParams().max_length)
    dtasks = []
    for t in tasks:
        inputs = [(r[0], r[1]) for r in X.subsample(test.tasks[t].train, args.aux, seed=5)]
        dtasks.append(DistillTask(t, test.heads[t], inputs, teacher_outputs(fm, experts[t], test.heads[t], inputs)))

    def measure(folder: Path) -> dict[str, dict[str, float]]:
        out = {}
        for name, ev in (("validation", val), ("test", test)):
            accs, g = ev.measure(folder, tasks)
            a = float(np.mean(list(accs.values())))
            out[name] = {"ACC": a, "G": g, "H": hmean(a, g)}
        return out

    general = Q.sts_train_sentences(data)
    rows = []
    within = X.base_model_path() if args.patch_budget is not None else None
    for alpha in alphas:
        merged = Q.fold_stream(tasks, experts, policy, {**params, key: alpha}, test, work,
                               full_steps=False, log=lambda m: None, keep_final=True, threads=args.threads)["backbone"]
        if args.patch_budget is not None:
            merged = budgeted(merged, X.base_model_path(), args.patch_budget, work / f"a{alpha}-budgeted")
        rows.append({"alpha": alpha, "gamma": None, "anchors": 0, "lr": None, **measure(merged)})
        for n_anchor, gamma, lr in grid:
            t0 = time.perf_counter()
            out, res = distill_backbone(merged, X.base_model_path(), work / f"a{alpha}-g{gamma}-a{n_anchor}-lr{lr}",
                                        tasks=dtasks, params=DistillParams(steps=args.steps, gamma=gamma, lr=lr),
                                        anchors=X.subsample(general, n_anchor, seed=7) if n_anchor else (),
                                        within_patch_from=within, feature_model=fm, cache_dir=work / "cache")
            rows.append({"alpha": alpha, "gamma": gamma, "anchors": n_anchor, "lr": lr,
                         "seconds": time.perf_counter() - t0,
                         "kl_before": res.kl_before, "kl_after": res.kl_after, **measure(out)})
            print(json.dumps(rows[-1]), flush=True)
    stepped = [r for r in rows if r["gamma"] is not None]
    best = max(stepped, key=lambda r: r["validation"]["H"]) if stepped else None
    print(f"{args.row} {key} {alphas} ({params}) of {len(tasks)} experts, distil {args.steps} steps, {args.aux} inputs per task"
          + (f", patch budget {args.patch_budget}" if args.patch_budget is not None else ""))
    print("| α | gamma | anchors | lr | val ACC | val G (dev) | val H | test ACC | test G | test H |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        v, t = r["validation"], r["test"]
        print(f"| {r['alpha']} | {'none' if r['gamma'] is None else r['gamma']} | {r['anchors']} | {r['lr'] or '-'} | {v['ACC']:.2f} | "
              f"{v['G']:.2f} | {v['H']:.2f} | {t['ACC']:.2f} | {t['G']:.2f} | {t['H']:.2f} |")
    if best is not None:
        print(f"chosen on validation: α {best['alpha']}, gamma {best['gamma']}, anchors {best['anchors']}, lr {best['lr']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(["bench/distill_gamma.py", *recorded_command(argv or sys.argv[1:])]),
                                               "row": args.row, "params": params, "strength": key,
                                               **({"iso_c": params} if args.row == "iso_c" else {}), "steps": args.steps, "aux": args.aux, "rows": rows,
                                               "chosen": best["gamma"] if best else None,
                                               "chosen_anchors": best["anchors"] if best else None,
                                               "chosen_lr": best["lr"] if best else None,
                                               "chosen_alpha": best["alpha"] if best else None,
                                               "patch_budget": args.patch_budget}, indent=1) + "\n")
    return 0


def row_params(label: str, tuning: dict) -> tuple[str, dict, str]:
    """``(policy, params, key)`` of ``bench/quality.py``'s row ``label`` ("policy+variant") as the
    benchmark ran it: its METHODS.md defaults with the tuned coefficients of ``tuning`` applied
    (``tuned_rows``), and ``key``, the coefficient ``--alphas`` sets (its ``GRID`` entry's)."""
    (policy, _var, params), = [r for r in Q.tuned_rows(Q.POLICIES, tuning, {}) if r[0] + r[1] == label]
    return policy, params, Q.GRID.get(label, Q.GRID.get(policy, ("alpha", ())))[0]


def _overrides(text: str | None) -> dict[str, Any]:
    """``{"rho": 0.5}`` of ``"rho=0.5"`` (comma list; each value read as JSON: a number, true/false)."""
    out: dict[str, Any] = {}
    for item in filter(None, (text or "").split(",")):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise SystemExit(f"--set wants KEY=VALUE items, got {item!r}")
        out[name.strip()] = json.loads(value)
    return out


def _numbers(text: str, kind: type) -> list:
    """A comma list from the command line (``"0.1,0.3"``) as numbers of ``kind``; empty items skipped."""
    return [kind(v) for v in text.split(",") if v]


def budgeted(merged: Path, base: Path, rho: float, out: Path) -> Path:
    """``merged`` with each matrix's change from θ₀ cut to its top ⌈ρ·n⌉ entries by |change| (the
    rest back at θ₀; 1-D tensors kept whole, as the budget wrapper does), written to ``out``."""
    shutil.copytree(merged, out)
    theta0 = load_file(str(base / "model.safetensors"))
    tensors = load_file(str(out / "model.safetensors"))
    kept = 0
    for name, t in tensors.items():
        b = theta0.get(name)
        if t.ndim < 2 or b is None or b.shape != t.shape:
            continue
        d = t.float() - b.float()
        keep = top_mask(d.abs(), min(d.numel(), math.ceil(rho * d.numel())))
        tensors[name] = torch.where(keep, t.float(), b.float()).to(t.dtype)
        kept += 1
    save_file(tensors, str(out / "model.safetensors"))
    print(f"patch budget {rho}: {kept} matrices cut to their top {rho:.0%} changed entries", flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
