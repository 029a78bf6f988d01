"""Coverage-guided fuzzing of every parser of outside bytes (atheris, libFuzzer underneath).

Each target of ``bench/fuzz_targets.py`` runs in its own child process for ``--seconds``, starting
from the valid seeds of :func:`fuzz_targets.seeds` plus the regression inputs kept in
``tests/fuzz_regressions/<target>/`` (every crash found so far, fixed since, replayed first), with
only ``mergestream`` instrumented. A crash is any exception outside ``fuzz_targets.ALLOWED`` (or a
5xx answer of a receiver), a hang past ``--timeout`` or memory past ``--rss-limit-mb``; libFuzzer
writes the input to ``<out>/crashes/``. The table (printed, and written to
``bench/results/fuzz.md`` + ``fuzz.json``) gives per target the seconds, executions, coverage
(libFuzzer's ``cov`` edges and ``ft`` features), corpus size, peak RSS and crashes.

Usage::

    .venv/bin/pip install atheris           # not a dependency of the package (a bench tool)
    .venv/bin/python bench/fuzz.py --seconds 600 --jobs 2          # every target, 10 min each
    .venv/bin/python bench/fuzz.py --targets st_header --seconds 30 --out /tmp/fz --no-results

A crash found: copy its input into ``tests/fuzz_regressions/<target>/`` (the property tests of
``tests/test_fuzz_properties.py`` replay every file there), fix, rerun.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
REGRESSIONS = REPO / "tests" / "fuzz_regressions"
RESULTS = HERE / "results"


def child(name: str, corpus: Path, crashes: Path, seconds: int, timeout: int, rss_mb: int) -> None:
    """Run one target under atheris (in this process; libFuzzer exits it)."""
    import atheris

    sys.path.insert(0, str(HERE))
    with atheris.instrument_imports(include=["mergestream"]):
        import mergestream.config  # noqa: F401  (instrumented before fuzz_targets imports them)
        import mergestream.daemon.sources.s3_notify  # noqa: F401
        import mergestream.daemon.sources.webhook  # noqa: F401
        import mergestream.feed.layout  # noqa: F401
        import mergestream.feed.plan  # noqa: F401
        import mergestream.io.checkpoints  # noqa: F401
        import mergestream.io.expert_readers  # noqa: F401
    import logging

    import fuzz_targets

    logging.disable(logging.CRITICAL)  # a rejected input logs; a million of them need not
    target = fuzz_targets.make(name)

    def one(data: bytes) -> None:
        fuzz_targets.check(target, data)

    args = [sys.argv[0], str(corpus), f"-max_total_time={seconds}", f"-timeout={timeout}",
            f"-rss_limit_mb={rss_mb}", f"-artifact_prefix={crashes}/{name}-", "-print_final_stats=1",
            "-max_len=65536"]
    atheris.Setup(args, one)
    atheris.Fuzz()


_STAT = re.compile(r"^stat::(\w+):\s+(\d+)", re.M)
_COV = re.compile(r"#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)/")


def run_target(name: str, out: Path, seconds: int, timeout: int, rss_mb: int) -> dict:
    """Prepare the corpus of ``name`` (seeds + regressions), fuzz it in a child, return its row."""
    sys.path.insert(0, str(HERE))
    import fuzz_targets

    corpus, crashes = out / "corpus" / name, out / "crashes"
    corpus.mkdir(parents=True, exist_ok=True)
    crashes.mkdir(parents=True, exist_ok=True)
    for i, data in enumerate(fuzz_targets.seeds()[name]):
        (corpus / f"seed-{i}").write_bytes(data)
    regressions = sorted((REGRESSIONS / name).glob("*")) if (REGRESSIONS / name).is_dir() else []
    for f in regressions:
        (corpus / f"regression-{f.name}").write_bytes(f.read_bytes())
    before = set(crashes.iterdir())
    log = out / f"{name}.log"
    t0 = time.time()
    with log.open("w") as fh:
        rc = subprocess.run([sys.executable, __file__, "--child", name, "--out", str(out), "--seconds", str(seconds),
                             "--timeout", str(timeout), "--rss-limit-mb", str(rss_mb)],
                            stdout=fh, stderr=subprocess.STDOUT, cwd=REPO).returncode
    wall = time.time() - t0
    text = log.read_text(errors="replace")
    stats = {k: int(v) for k, v in _STAT.findall(text)}
    cov = _COV.findall(text)
    # targets may run at the same time into one folder: only this target's artifacts are its crashes
    new_crashes = sorted(p.name for p in set(crashes.iterdir()) - before if p.name.startswith(f"{name}-"))
    return {"target": name, "seconds": round(wall, 1), "executions": stats.get("number_of_executed_units", 0),
            "exec_per_s": round(stats.get("number_of_executed_units", 0) / max(wall, 1e-9), 1),
            "cov": int(cov[-1][1]) if cov else None, "ft": int(cov[-1][2]) if cov else None,
            "corpus": int(cov[-1][3]) if cov else None, "peak_rss_mb": stats.get("peak_rss_mb"),
            "regressions_replayed": len(regressions), "crashes": new_crashes, "exit": rc, "commit": _commit(),
            "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "log_tail": "" if rc == 0 else text[-2000:]}


def _commit() -> str:
    """The short commit of the fuzzed tree (``+dirty`` with changes under mergestream/), or ``?``."""
    try:
        sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "mergestream"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def render(rows: list[dict], args) -> str:
    """The markdown report: one row per target (a rerun of some targets keeps the others' rows, each
    with the commit it fuzzed and when it finished)."""
    lines = ["# Fuzzing the parsers of outside bytes", "",
             f"`{' '.join(['python', 'bench/fuzz.py', *sys.argv[1:]])}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"{os.cpu_count()} CPUs, {args.jobs} target(s) at a time; atheris (libFuzzer), only `mergestream` "
             "instrumented; timeout per input "
             f"{args.timeout} s, RSS limit {args.rss_limit_mb} MiB. Targets and the contract: `bench/fuzz_targets.py`.",
             "", "| target | seconds | executions | exec/s | cov (edges) | ft | corpus | peak RSS MiB | "
             "regressions replayed | crashes | commit, finished |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['target']} | {r['seconds']:.0f} | {r['executions']:,} | {r['exec_per_s']:,.0f} | {r['cov']} | "
                     f"{r['ft']} | {r['corpus']} | {r['peak_rss_mb']} | {r['regressions_replayed']} | "
                     f"{', '.join(r['crashes']) or 'none'} | {r.get('commit', '?')}, {r.get('finished', '?')} |")
    fixed = sorted(f"{d.name}/{f.name}" for d in REGRESSIONS.glob("*") if d.is_dir() for f in d.iterdir())
    lines += ["", "## Crashes found and fixed", "",
              "Every input that crashed a target is kept in `tests/fuzz_regressions/<target>/` and replayed by "
              "`tests/test_fuzz_properties.py` in CI (and first, by this script):", ""]
    lines += [f"- `{f}`" for f in fixed] or ["- none"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", nargs="*", help="targets to run (default: all)")
    ap.add_argument("--seconds", type=int, default=600, help="fuzzing time per target (default 600)")
    ap.add_argument("--jobs", type=int, default=1, help="targets fuzzed at the same time")
    ap.add_argument("--timeout", type=int, default=10, help="seconds one input may take (a hang past it is a crash)")
    ap.add_argument("--rss-limit-mb", type=int, default=3072, help="memory limit of a target process")
    ap.add_argument("--out", type=Path, default=Path("/tmp/mergestream-fuzz"), help="corpus, crashes and logs")
    ap.add_argument("--no-results", action="store_true", help="do not write bench/results/fuzz.md/json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.out / "corpus" / args.child, args.out / "crashes", args.seconds, args.timeout,
              args.rss_limit_mb)
        return 0
    sys.path.insert(0, str(HERE))
    import fuzz_targets

    names = args.targets or list(fuzz_targets.TARGET_NAMES)
    args.out.mkdir(parents=True, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda n: run_target(n, args.out, args.seconds, args.timeout, args.rss_limit_mb), names))
    if args.targets and not args.no_results and (RESULTS / "fuzz.json").is_file():
        # a rerun of some targets (after a fix) keeps the other targets' rows of the last report
        again = {r["target"] for r in rows}
        kept = [r for r in json.loads((RESULTS / "fuzz.json").read_text()).get("rows", []) if r["target"] not in again]
        order = list(fuzz_targets.TARGET_NAMES)
        rows = sorted(kept + rows, key=lambda r: order.index(r["target"]) if r["target"] in order else len(order))
    report = render(rows, args)
    print(report)
    if not args.no_results:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "fuzz.md").write_text(report)
        (RESULTS / "fuzz.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "rows": rows}, indent=1))
    return 1 if any(r["crashes"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
