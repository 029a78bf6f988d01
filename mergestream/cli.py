"""The ``mergestream`` command line (click).

One-shot verbs: ``fold``, ``merge``, ``unmerge``, ``inspect``. Bad input exits with status 2 and a
one-line ``error: ...`` on stderr; nothing is written.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import sys
from typing import Any

import click

from .errors import MergestreamError

EXIT_BAD_INPUT = 2


def _fail_cleanly(fn):
    """Turn user-caused errors into one line on stderr and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (MergestreamError, FileNotFoundError, NotADirectoryError, PermissionError) as exc:
            msg = " ".join(str(exc).split())
            click.echo(f"error: {type(exc).__name__}: {msg}", err=True)
            sys.exit(EXIT_BAD_INPUT)

    return wrapper


def _parse_sets(pairs: tuple[str, ...]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise MergestreamError(f"--set expects name=value, got {pair!r}")
        key, value = pair.split("=", 1)
        params[key.strip()] = value.strip()
    return params


def _load_entry_point(spec: str):
    if ":" not in spec:
        raise MergestreamError(f"--objective expects package.module:function, got {spec!r}")
    mod, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as exc:
        raise MergestreamError(f"cannot load objective {spec!r}: {exc}") from exc


def _engine_options(fn):
    fn = click.option("--device", default="cpu", show_default=True,
                      help="where the math runs: cpu, cuda, cuda:1 (tensors stream from CPU)")(fn)
    fn = click.option("--threads", default=1, show_default=True, type=click.IntRange(1),
                      help="worker threads for the per-tensor map (memory grows with it)")(fn)
    fn = click.option("--max-shard-size", "max_shard_bytes", default=5 * 1024**3, show_default=True,
                      type=click.IntRange(1), help="output shard cap in bytes")(fn)
    return fn


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="more logging (-v info, -vv debug)")
def cli(verbose: int) -> None:
    """mergestream: fold fine-tuned experts into a running backbone, continually."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")


@cli.command("fold")
@click.option("--base", required=True, type=click.Path(), help="the pretrained base θ₀")
@click.option("--backbone", type=click.Path(), help="the current backbone θ_{t−1} (default: the base)")
@click.option("--expert", required=True, type=click.Path(), help="expert checkpoint or LoRA adapter folder")
@click.option("--policy", required=True, help="task_arithmetic | ties | safe_merge | mdm_oc | opcm | magmax")
@click.option("--set", "sets", multiple=True, metavar="NAME=VALUE", help="policy parameter (METHODS.md names)")
@click.option("--state", "state_dir", required=True, type=click.Path(), help="policy state folder")
@click.option("--out", required=True, type=click.Path(), help="output model folder (must not exist)")
@click.option("--id", "expert_id", help="expert id (default: the expert's file or folder name)")
@click.option("--objective", help="package.module:function, for mdm_oc with --set coefficients=cmaes")
@click.option("--json", "as_json", is_flag=True, help="print the fold report as JSON")
@_engine_options
@_fail_cleanly
def fold_cmd(base, backbone, expert, policy, sets, state_dir, out, expert_id, objective, as_json,
             device, threads, max_shard_bytes) -> None:
    """Fold one expert into the backbone with a policy."""
    from .engine import fold

    obj = _load_entry_point(objective) if objective else None
    rep = fold(base, backbone, expert, policy, _parse_sets(sets), state_dir=state_dir, out=out,
               expert_id=expert_id, device=device, threads=threads, max_shard_bytes=max_shard_bytes,
               objective=obj)
    _report(rep, as_json)


@cli.command("merge")
@click.option("--base", required=True, type=click.Path(), help="the pretrained base θ₀")
@click.option("--policy", required=True, help="policy name")
@click.option("--set", "sets", multiple=True, metavar="NAME=VALUE", help="policy parameter")
@click.option("--out", required=True, type=click.Path(), help="output model folder (must not exist)")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@click.argument("experts", nargs=-1, required=True, type=click.Path())
@_engine_options
@_fail_cleanly
def merge_cmd(base, policy, sets, out, as_json, experts, device, threads, max_shard_bytes) -> None:
    """Merge K experts at once (offline)."""
    from .engine import merge

    rep = merge(base, list(experts), policy, _parse_sets(sets), out=out, device=device, threads=threads,
                max_shard_bytes=max_shard_bytes)
    _report(rep, as_json)


@cli.command("unmerge")
@click.option("--state", "state_dir", required=True, type=click.Path(exists=True), help="policy state folder")
@click.option("--expert", "expert_id", required=True, help="id of the expert to remove")
@click.option("--mode", type=click.Choice(["subtract", "replay"]), default="subtract", show_default=True)
@click.option("--out", required=True, type=click.Path(), help="output model folder (must not exist)")
@click.option("--backbone", type=click.Path(), help="override the backbone recorded in the state")
@click.option("--base", type=click.Path(), help="override the base recorded in the state")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@_engine_options
@_fail_cleanly
def unmerge_cmd(state_dir, expert_id, mode, out, backbone, base, as_json, device, threads, max_shard_bytes) -> None:
    """Remove one expert's contribution (subtract) or refold without it (replay)."""
    from .engine import unmerge

    rep = unmerge(state_dir, expert_id, mode, out=out, backbone=backbone, base=base, device=device,
                  threads=threads, max_shard_bytes=max_shard_bytes)
    _report(rep, as_json)


@cli.command("inspect")
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--base", type=click.Path(), help="base θ₀: adds task-vector norms and pairwise cosines")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@_fail_cleanly
def inspect_cmd(paths, base, as_json) -> None:
    """Tensor count, dtypes, bytes; with --base, ‖τ‖ and pairwise cosine between experts."""
    from .engine import describe, task_vector_stats

    infos = [describe(p) for p in paths]
    stats = task_vector_stats(base, list(paths)) if base else None
    if as_json:
        click.echo(json.dumps({"checkpoints": infos, "task_vectors": stats}, indent=2))
        return
    for info in infos:
        dts = ", ".join(f"{k}: {v['tensors']} tensors / {v['bytes']:,} B" for k, v in info["dtypes"].items())
        click.echo(f"{info['path']}  [{info['kind']}]  {info['tensors']} tensors, {info['bytes']:,} bytes  ({dts})")
        for k, v in info["metadata"].items():
            click.echo(f"    {k} = {v}")
    if stats:
        click.echo("\ntask vectors against " + str(base))
        width = max(len(i) for i in stats["ids"])
        for i, n in zip(stats["ids"], stats["norms"]):
            click.echo(f"  ||tau|| {i:<{width}}  {n:.6g}")
        click.echo("  pairwise cosine:")
        click.echo("  " + " " * width + "".join(f"{i[:8]:>10}" for i in stats["ids"]))
        for i, row in zip(stats["ids"], stats["cosine"]):
            click.echo(f"  {i:<{width}}" + "".join(f"{c:>10.4f}" for c in row))


def _report(rep, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(rep.to_json(), indent=2))
    else:
        extra = ", ".join(f"{k}={v:.4g}" for k, v in rep.stats.items())
        click.echo(f"{rep.policy}: {', '.join(rep.experts)} -> {rep.out} in {rep.seconds:.2f} s"
                   f" ({rep.bytes_written:,} bytes written{'; ' + extra if extra else ''})")


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="mergestream")


if __name__ == "__main__":
    main()
