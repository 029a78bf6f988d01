"""The ``mergestream`` command line (click).

One-shot verbs: ``fold``, ``merge``, ``unmerge``, ``inspect``. Bad input exits with status 2 and a
one-line ``error: ...`` on stderr; nothing is written.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from .errors import MergestreamError, fail_cleanly
from .patches.codec import FORMAT_NUMBERS

if TYPE_CHECKING:  # the engine (torch) loads only when a verb runs
    from .engine import ExecOptions


def _parsing_done() -> None:
    """Turn the cyclic garbage collector back on (see :func:`main`), with everything imported so far
    frozen out of later collections (module objects live as long as the process)."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def _parse_sets(pairs: tuple[str, ...]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise MergestreamError(f"--set expects name=value, got {pair!r}")
        key, value = pair.split("=", 1)
        params[key.strip()] = value.strip()
    return params


class PolicyName(click.ParamType):
    """A registered policy name; the registry (which imports torch) is read only when needed."""

    name = "policy"

    def convert(self, value, param, ctx):
        from .policies import policy_names

        if value not in policy_names():
            self.fail(f"unknown policy {value!r}; known: {', '.join(policy_names())}", param, ctx)
        return value

    def get_metavar(self, *args, **kwargs) -> str:
        from .policies import policy_names

        return "[" + "|".join(policy_names()) + "]"


POLICY = PolicyName()


def _engine_options(fn):
    fn = click.option("--device", default="cpu", show_default=True,
                      help="where the math runs: cpu, cuda, cuda:1 (tensors stream from CPU)")(fn)
    fn = click.option("--threads", default=0, show_default="0: auto, the usable cores up to 4", type=click.IntRange(0),
                      help="worker threads for the per-tensor map (memory grows by a few tensors per thread)")(fn)
    fn = click.option("--quiet", "-q", is_flag=True, help="no progress bar (it is shown only on a terminal anyway)")(fn)
    fn = click.option("--max-shard-size", "max_shard_bytes", default=5 * 1024**3, show_default=True,
                      type=click.IntRange(1), help="output shard cap in bytes")(fn)
    fn = click.option("--executor", default="local", show_default=True, type=click.Choice(["local", "ray"]),
                      help="where the per-tensor map runs: local threads, or a Ray cluster (pip install -c "
                           "constraints.txt -e '.[ray]' from the checkout; inputs on storage every worker "
                           "reaches)")(fn)
    fn = click.option("--ray-address", help="Ray cluster to join (auto, ray://head:10001); default: RAY_ADDRESS, "
                                            "else a local Ray instance")(fn)
    return fn


def _exec_options(device: str, threads: int, max_shard_bytes: int, executor: str, ray_address: str | None,
                  progress: bool) -> ExecOptions:
    """The engine's :class:`~mergestream.engine.options.ExecOptions` from the flags of
    :func:`_engine_options` (``progress``: a bar unless ``--quiet`` or ``--json``).

    Raises:
        MergestreamError: ``--ray-address`` without ``--executor ray``, or ``ray`` not installed.
    """
    if ray_address and executor != "ray":
        raise MergestreamError("--ray-address needs --executor ray")
    from .engine import ExecOptions
    from .engine.executors import make_executor

    return ExecOptions(device=device, threads=threads, max_shard_bytes=max_shard_bytes,
                       executor=make_executor(executor, ray_address), progress=progress)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mergestream", prog_name="mergestream", message="%(prog)s %(version)s")
@click.option("-v", "--verbose", count=True, help="more logging (-v info, -vv debug)")
def cli(verbose: int) -> None:
    """mergestream: fold fine-tuned experts into a running backbone, continually."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")


@cli.command("fold")
@click.option("--base", required=True, type=click.Path(), help="the pretrained base θ₀")
@click.option("--backbone", type=click.Path(), help="the current backbone θ_{t−1} (default: the base)")
@click.option("--expert", required=True, type=click.Path(), help="expert checkpoint or LoRA adapter folder")
@click.option("--policy", required=True, type=POLICY, help="merge policy (docs: Policies)")
@click.option("--set", "sets", multiple=True, metavar="NAME=VALUE", help="policy parameter (names: docs, Reference, Policies and parameters)")
@click.option("--state", "state_dir", required=True, type=click.Path(), help="policy state folder")
@click.option("--out", required=True, type=click.Path(),
              help="output model folder (must not exist), or s3://bucket/root/: a new version there, current "
              "replaced last; with --executor ray the workers write the shards (docs: Scaling)")
@click.option("--id", "expert_id", help="expert id (default: the expert's file or folder name)")
@click.option("--objective", help="package.module:function, for mdm_oc with --set coefficients=cmaes "
              "(black-box: alphas, weights -> loss) or =adamerging (differentiable: see mergestream.engine.coefficients)")
@click.option("--json", "as_json", is_flag=True, help="print the fold report as JSON")
@_engine_options
@fail_cleanly
def fold_cmd(base, backbone, expert, policy, sets, state_dir, out, expert_id, objective, as_json,
             device, threads, quiet, max_shard_bytes, executor, ray_address) -> None:
    """Fold one expert into the backbone with a policy."""
    from .engine import fold
    from .plugins import resolve_callable

    obj = resolve_callable(objective, what="--objective") if objective else None
    params = _params_from_state(state_dir, policy, _parse_sets(sets))
    options = _exec_options(device, threads, max_shard_bytes, executor, ray_address, not quiet and not as_json)
    rep = fold(base, backbone, expert, policy, params, state_dir=state_dir, out=out, expert_id=expert_id,
               objective=obj, options=options)
    _report(rep, as_json)


def _params_from_state(state_dir: str, policy: str, given: dict[str, Any]) -> dict[str, Any]:
    """A later fold's parameters: those not given by ``--set`` come from the state's last fold.

    A state records every fold's parameters, so ``fold --state S`` without ``--set`` continues with
    the values the stream was started with instead of silently falling back to the policy's
    defaults. Only the policy's own parameter names (and the wrappers' ``lines_*``, ``patch_budget``) are taken; what is
    taken is said on stderr. A first fold, or a state of another policy (refused by the fold), gets
    ``given`` unchanged.
    """
    from .io.state import StateDir
    from .policies import parameter_names

    if not (Path(state_dir) / "manifest.json").exists():
        return given
    man = StateDir(state_dir).manifest
    if man.policy != policy or not man.folds:
        return given
    known = set(parameter_names(policy))
    kept = {k: v for k, v in man.folds[-1].params.items()
            if (k in known or k.startswith("lines_") or k == "patch_budget") and k not in given}
    if kept:
        click.echo("parameters from the state's last fold: "
                   + ", ".join(f"{k}={v}" for k, v in sorted(kept.items())), err=True)
    return {**kept, **given}


@cli.command("merge")
@click.option("--base", required=True, type=click.Path(), help="the pretrained base θ₀")
@click.option("--policy", required=True, type=POLICY, help="merge policy (docs: Policies)")
@click.option("--set", "sets", multiple=True, metavar="NAME=VALUE", help="policy parameter")
@click.option("--out", required=True, type=click.Path(),
              help="output model folder (must not exist), or s3://bucket/root/: a new version there, current "
              "replaced last; with --executor ray the workers write the shards (docs: Scaling)")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@click.argument("experts", nargs=-1, required=True, type=click.Path())
@_engine_options
@fail_cleanly
def merge_cmd(base, policy, sets, out, as_json, experts, device, threads, quiet, max_shard_bytes, executor,
              ray_address) -> None:
    """Merge K experts at once (offline)."""
    from .engine import merge

    params = _parse_sets(sets)
    options = _exec_options(device, threads, max_shard_bytes, executor, ray_address, not quiet and not as_json)
    rep = merge(base, list(experts), policy, params, out=out, options=options)
    _report(rep, as_json)


@cli.command("unmerge")
@click.argument("expert", required=False)
@click.option("--config", "config_path", type=click.Path(), help="daemon config: publish a version without EXPERT")
@click.option("--state", "state_dir", type=click.Path(exists=True), help="policy state folder (one-shot form)")
@click.option("--expert", "expert_id", help="id of the expert to remove (one-shot form)")
@click.option("--mode", type=click.Choice(["subtract", "replay"]), default="subtract", show_default=True)
@click.option("--out", type=click.Path(), help="output model folder (must not exist; one-shot form)")
@click.option("--backbone", type=click.Path(), help="override the backbone recorded in the state")
@click.option("--base", type=click.Path(), help="override the base recorded in the state")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@_engine_options
@fail_cleanly
def unmerge_cmd(expert, config_path, state_dir, expert_id, mode, out, backbone, base, as_json, device, threads,
                quiet, max_shard_bytes, executor, ray_address) -> None:
    """Remove an expert.

    \b
    Daemon form:   mergestream unmerge EXPERT --config FILE
                   (a new version without EXPERT, through the probes and the gate;
                   EXPERT: its id or a unique prefix of it)
    One-shot form: mergestream unmerge --state DIR --expert ID --mode subtract|replay --out OUT
    """
    if config_path:
        if not expert:
            raise MergestreamError("unmerge --config needs the EXPERT id as argument")
        _operator(config_path, "unmerge", expert)
        return
    if not (state_dir and (expert_id or expert) and out):
        raise MergestreamError("unmerge needs either EXPERT --config FILE, or --state DIR --expert ID --out OUT")
    from .engine import unmerge

    removed = expert_id or expert
    options = _exec_options(device, threads, max_shard_bytes, executor, ray_address, not quiet and not as_json)
    rep = unmerge(state_dir, removed, mode, out=out, backbone=backbone, base=base, options=options)
    if as_json:
        _report(rep, True)
    else:
        click.echo(f"{rep.policy}: removed {removed} ({mode}) -> {rep.out} in {rep.seconds:.2f} s; "
                   f"remaining: {', '.join(rep.experts) or 'none (the base)'}")


# -- the daemon and its operator commands ---------------------------------------------------------
def _operator(config_path: str, verb: str, arg: str | None) -> None:
    """Send a command to the running daemon (through the ledger), or run it here if none runs: a
    rollback on the store and the ledger only (:func:`~mergestream.daemon.rollback.rollback_here`),
    an unmerge or a retry in a service started in this process."""
    import time

    from .config import load_config
    from .daemon.ledger import Ledger
    from .daemon.store import Store

    cfg = load_config(config_path, check_policy=False)  # a running daemon checked its own
    store = Store(cfg.state_dir)
    if store.is_locked():
        ledger = Ledger(cfg.state_dir / "ledger.sqlite")
        row = ledger.add_command(verb, arg)
        deadline = time.time() + 3600
        while time.time() < deadline:
            cmd = ledger.command(row)
            if cmd and cmd["done"]:
                result = json.loads(cmd["result"])
                break
            time.sleep(0.2)
        else:
            raise MergestreamError(f"the daemon did not answer {verb} within an hour")
    elif verb == "rollback":  # no daemon: the store and the ledger only (no probes, no torch)
        from .daemon.rollback import rollback_here

        result = {"ok": True, "message": rollback_here(cfg, int(arg))}
    else:
        from .daemon.service import Service

        cfg = load_config(config_path)  # run here: the policy is checked as the daemon would
        svc = Service(cfg, serve_metrics=False, watch_sources=False)
        svc.start()
        try:
            result = json.loads(svc.execute(verb, arg))
        finally:
            svc.shutdown()
    if not result["ok"]:
        raise MergestreamError(result["message"])
    click.echo(result["message"])


@cli.command("init")
@click.argument("folder", type=click.Path())
@click.option("--base", required=True, type=click.Path(exists=True), help="the pretrained base θ₀")
@click.option("--policy", default=None, type=POLICY,
              help="merge policy [default: the best measured on the quality benchmark, with its parameters]")
@fail_cleanly
def init_cmd(folder, base, policy) -> None:
    """Write a commented starter FOLDER/config.yaml (inbox FOLDER/inbox, state FOLDER/state)."""
    from .io.checkpoints import open_checkpoint
    from .starter import write_starter

    with open_checkpoint(base) as ck:  # a base that is not a model is refused now, not at the first fold
        if not ck.keys():
            raise MergestreamError(f"base {base}: the checkpoint holds no tensors")
    path = write_starter(folder, base, policy)
    click.echo(f"wrote {path}; start the daemon with: mergestream run --config {path}")


@cli.command("run")
@click.option("--config", "config_path", required=True, type=click.Path(), help="daemon config (YAML)")
@fail_cleanly
def run_cmd(config_path) -> None:
    """Run the daemon: watch the sources, fold, probe, publish or roll back, serve metrics."""
    from .config import load_config
    from .daemon.service import Service
    from .logs import setup_logging

    cfg = load_config(config_path)
    setup_logging(cfg.log_format)
    Service(cfg).run()


@cli.command("status")
@click.option("--config", "config_path", required=True, type=click.Path(), help="daemon config (YAML)")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@fail_cleanly
def status_cmd(config_path, as_json) -> None:
    """Current version, queue, every expert's status, and what the sources report (a registered
    model that does not exist, an inbox polled because inotify ran out, skipped versions)."""
    import time

    from .config import load_config
    from .daemon.ledger import Ledger
    from .daemon.notes import source_notes
    from .daemon.store import Store

    cfg = load_config(config_path, check_policy=False)
    store = Store(cfg.state_dir)
    ledger = Ledger(cfg.state_dir / "ledger.sqlite")
    experts = [{"id": e.expert_id, "status": e.status, "source": e.source, "uri": e.uri, "version": e.version,
                "reason": e.reason, "sha256": e.content_sha256} for e in ledger.experts()]
    sources: dict[str, list[dict]] = {}
    for n in source_notes(ledger):
        sources.setdefault(n["source"], []).append({k: n.get(k) for k in ("subject", "level", "message", "since")})
    doc = {"current_version": store.current(), "versions": store.numbers(), "policy": cfg.policy.name,
           "queue_depth": ledger.queue_depth(), "daemon_running": store.is_locked(),
           "tracking_pending": len(ledger.outbox()), "experts": experts, "sources": sources}
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    current = doc["current_version"] if doc["current_version"] is not None else "none yet"
    click.echo(f"current version: {current}  (kept: {doc['versions']})  policy: {cfg.policy.name}  "
               f"daemon: {'running' if doc['daemon_running'] else 'stopped'}  queue: {doc['queue_depth']}")
    for name, notes in sorted(sources.items()):
        for n in notes:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(n["since"])) if n["since"] else "?"
            click.echo(f"source {name} {n['level']}: {n['message']}  (since {since})")
    for e in experts:
        extra = f"  v{e['version']}" if e["version"] else ""
        reason = f"  ({e['reason']})" if e["reason"] else ""
        click.echo(f"  {e['id']:<24} {e['status']:<9}{extra}{reason}")


@cli.command("history")
@click.option("--config", "config_path", required=True, type=click.Path(), help="daemon config (YAML)")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@fail_cleanly
def history_cmd(config_path, as_json) -> None:
    """Every fold, unmerge and rollback with its decision, reason and probe values."""
    from .config import load_config
    from .daemon.ledger import Ledger

    cfg = load_config(config_path, check_policy=False)
    folds = Ledger(cfg.state_dir / "ledger.sqlite").folds()
    if as_json:
        click.echo(json.dumps(folds, indent=2))
        return
    if not folds:
        click.echo("no folds yet")
        return
    for f in folds:
        probes = ", ".join(f"{k}={v:.4g}" for k, v in sorted(f["probes"].items()))
        ver = f" -> v{f['version']}" if f["version"] else ""
        reason = f"  reason: {f['reason']}" if f["reason"] else ""
        subject = f["expert_id"] or ("-" if f["kind"] != "rollback" else "operator")
        click.echo(f"{f['row']:>4} {f['kind']:<8} {subject:<20} {f['decision']:<9}{ver}  {probes}{reason}")


@cli.command("rollback")
@click.option("--config", "config_path", required=True, type=click.Path(), help="daemon config (YAML)")
@click.option("--to", "version", required=True, type=int, help="published version to make current")
@fail_cleanly
def rollback_cmd(config_path, version) -> None:
    """Point `current` at another kept version, earlier or later (experts' status follows it)."""
    _operator(config_path, "rollback", str(version))


@cli.command("retry")
@click.argument("expert")
@click.option("--config", "config_path", required=True, type=click.Path(), help="daemon config (YAML)")
@fail_cleanly
def retry_cmd(expert, config_path) -> None:
    """Queue a rejected, failed or unmerged expert again (EXPERT: its id or a unique prefix of it)."""
    _operator(config_path, "retry", expert)


@cli.command("inspect")
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--base", type=click.Path(), help="base θ₀: adds task-vector norms and pairwise cosines")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@click.option("--no-hash", is_flag=True, help="headers only: skip the weights hash (it reads every tensor once)")
@fail_cleanly
def inspect_cmd(paths, base, as_json, no_hash) -> None:
    """Tensor count, dtypes, bytes, the weights hash (sha256, the content hash the ledger, the model
    card, patches and the feed show); with --base, ‖τ‖ and pairwise cosine between experts."""
    from .engine import describe, task_vector_stats

    infos = [describe(p, content_hash=not no_hash) for p in paths]
    stats = task_vector_stats(base, list(paths)) if base else None
    if as_json:
        click.echo(json.dumps({"checkpoints": infos, "task_vectors": stats}, indent=2))
        return
    for info in infos:
        dts = ", ".join(f"{k}: {v['tensors']} tensors / {v['bytes']:,} B" for k, v in info["dtypes"].items())
        click.echo(f"{info['path']}  [{info['kind']}]  {info['tensors']} tensors, {info['bytes']:,} bytes  ({dts})")
        if "weights_sha256" in info:
            click.echo(f"    weights sha256: {info['weights_sha256']}")
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


@cli.command("patch")
@click.option("--from", "from_version", required=True, type=int, help="source version A")
@click.option("--to", "to_version", required=True, type=int, help="target version B")
@click.option("--config", "config_path", required=True, type=click.Path(), help="daemon config (YAML)")
@click.option("--out", required=True, type=click.Path(), help="patch file to write (must not exist)")
@click.option("--format", "patch_format", type=click.Choice([str(n) for n in FORMAT_NUMBERS]),
              help="patch format (default: the config's patch_format)")
@click.option("--zstd", "zstd_level", type=click.IntRange(1, 22),
              help="format 2: zstd level of each payload (default: the config's patch_zstd_level)")
@click.option("--json", "as_json", is_flag=True, help="print the statistics as JSON")
@fail_cleanly
def patch_cmd(from_version, to_version, config_path, out, patch_format, zstd_level, as_json) -> None:
    """Build a patch from published version A to version B (any two kept versions)."""
    from .config import load_config
    from .io.versions import Versions
    from .patches.build import build_patch

    cfg = load_config(config_path)
    fmt = int(patch_format) if patch_format else cfg.patch_format
    if zstd_level is None and patch_format is None:
        zstd_level = cfg.patch_zstd_level
    if zstd_level is not None and fmt != 2:
        raise MergestreamError("--zstd needs patch format 2")
    store = Versions(cfg.state_dir)
    for v in (from_version, to_version):
        if not (store.path(v) / "model").exists():
            raise MergestreamError(f"version {v} is not in {store.versions_dir} (kept: {store.numbers()})")
    stats = build_patch(store.path(from_version) / "model", store.path(to_version) / "model", out,
                        source_version=str(from_version), target_version=str(to_version),
                        policy=store.fold_json(to_version).get("policy", ""), patch_format=fmt, zstd_level=zstd_level)
    if as_json:
        click.echo(json.dumps(stats, indent=2, default=str))
    else:
        click.echo(f"{out}: {stats['patch_bytes']:,} bytes, {100 * stats['ratio']:.1f}% of the model "
                   f"({stats['tensors_changed']} tensors changed: {stats['tensors_sparse']} sparse, "
                   f"{stats['tensors_dense']} dense)")


def _register_patch_commands() -> None:
    from .patches.cli import apply_patch_cmd, make_patch_cmd

    cli.add_command(apply_patch_cmd)
    cli.add_command(make_patch_cmd)


_register_patch_commands()


def _register_feed_commands() -> None:
    from .feed.cli import feed

    cli.add_command(feed)


_register_feed_commands()


@cli.command("demo", context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
             add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def demo_forward(args) -> None:
    """The daemon on real input: MiniLM experts (built and cached) + a harmful one (see --help)."""
    from .demo import demo_cmd  # imports torch/transformers only for this verb

    demo_cmd.main(args=list(args), prog_name="mergestream demo", standalone_mode=True)


def _report(rep, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(rep.to_json(), indent=2))
    else:
        extra = ", ".join(f"{k}={v:.4g}" for k, v in rep.stats.items())
        click.echo(f"{rep.policy}: {', '.join(rep.experts)} -> {rep.out} in {rep.seconds:.2f} s"
                   f" ({rep.bytes_written:,} bytes written{'; ' + extra if extra else ''})")


#: Verbs whose process ends as soon as they succeed (:func:`_exit_now`): everything they write is
#: committed (fsynced and renamed) before they return. ``run`` too: the daemon's shutdown has closed
#: the ledger, released the lock and finished a pending feed build when it logs "daemon stopped";
#: the interpreter's teardown of torch, MLflow and the probes' models after that took seconds.
FAST_EXIT_VERBS = frozenset({"fold", "merge", "unmerge", "inspect", "run"})
_succeeded: list[str] = []  # the FAST_EXIT_VERBS command that returned normally, if any


def main() -> None:
    """Console-script entry point.

    The cyclic garbage collector is off while the command line is parsed: parsing ``--policy``
    imports torch (~10⁶ objects), and the collections that import triggers cost ~0.25 s of a
    fold's start-up. Every command turns it back on before it runs (:func:`_parsing_done`).

    After a :data:`FAST_EXIT_VERBS` command succeeds, the process ends without the interpreter's
    teardown (:func:`_exit_now`): tearing down torch's modules took 0.1-0.4 s of every command.
    """
    gc.disable()
    code: int | str | None = 0
    try:
        _gc_back_on_before_run(cli)
        cli(prog_name="mergestream")
    except SystemExit as exc:
        code = exc.code
    finally:
        _parsing_done()
    if code in (0, None) and _succeeded:
        _exit_now()
    sys.exit(code)


def _exit_now() -> None:
    """End a process whose command has succeeded, skipping the interpreter's teardown (module and
    object finalisation). What a normal exit does that matters is done first: the atexit hooks
    (logging's flush among them) and stdout/stderr flushed. Only when no other non-daemon thread
    is alive: a normal exit would join those first (daemon threads, such as tqdm's monitor, it
    would not)."""
    import atexit
    import os
    import threading

    main = threading.main_thread()
    if any(t is not main and not t.daemon and t.is_alive() for t in threading.enumerate()):
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: a normal exit would not report it either
            pass
    os._exit(0)


def _gc_back_on_before_run(group: click.Group) -> None:
    """Make every command of ``group`` (and of its subgroups) call :func:`_parsing_done` first."""
    for cmd in group.commands.values():
        if isinstance(cmd, click.Group):
            _gc_back_on_before_run(cmd)
        if cmd.callback is not None and not getattr(cmd.callback, "_gc_wrapped", False):
            cmd.callback = _run_with_gc(cmd.callback, cmd.name if group is cli else None)


def _run_with_gc(fn, verb: str | None = None):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        _parsing_done()
        result = fn(*args, **kwargs)
        if verb in FAST_EXIT_VERBS:
            _succeeded.append(verb)
        return result

    run._gc_wrapped = True
    return run


if __name__ == "__main__":
    main()
