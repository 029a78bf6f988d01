"""``mergestream-agent``: the device's command line (click; torch never imported).

Commands: ``pull`` (once, or ``--every 10m``), ``rollback``, ``status``. Every refusal prints one
line ``error: ...`` on stderr and exits with its code (:mod:`mergestream.agent.errors`): 3 metadata
refused, 4 target refused, 5 download failed (resumable), 6 health check failed, 7 local state.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time

import click

from ..errors import error_line
from ..feed.layout import parse_duration
from .errors import AgentError

log = logging.getLogger(__name__)


def _fail(exc: AgentError) -> None:
    click.echo(f"error: {' '.join(str(exc).split())}", err=True)
    sys.exit(exc.code)


def _line(doc: dict) -> str:
    cur = doc.get("current") or {}
    where = f"v{cur.get('version')} ({str(cur.get('weights_sha256', ''))[:12]}) in slot {cur.get('slot')}"
    if doc["outcome"] == "updated":
        return f"updated to {where}: {doc.get('plan')}, {doc.get('bytes_downloaded', 0):,} bytes downloaded"
    if doc["outcome"] == "held_back":
        return f"staying on {where}: {doc.get('note')}"
    if doc["outcome"] == "rolled_back":
        return f"rolled back to {where}"
    return f"up to date: {where}"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="more logging on stderr (-v info, -vv debug)")
def agent(verbose: int) -> None:
    """Pull signed model updates from a mergestream feed and install them A/B."""
    level = logging.WARNING if not verbose else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")


@agent.command("pull")
@click.option("--feed", required=True, help="base URL of the feed (its metadata/ and targets/ are below it)")
@click.option("--model-dir", required=True, type=click.Path(file_okay=False), help="the device's model folder")
@click.option("--root", "root_file", type=click.Path(dir_okay=False, exists=True),
              help="the feed's trusted root.json (needed on the first pull; kept in MODEL_DIR/.agent)")
@click.option("--every", help="keep pulling at this interval (e.g. 10m, 1h); default: once")
@click.option("--check", help="health check run on the new model before the switch; {model_dir} is replaced "
                              "and $MERGESTREAM_MODEL_DIR set; non-zero keeps the old model")
@click.option("--status", "status_file", type=click.Path(dir_okay=False),
              help="status JSON file (default: MODEL_DIR/status.json)")
@click.option("--json", "as_json", is_flag=True, help="print the status document")
def pull_cmd(feed, model_dir, root_file, every, check, status_file, as_json) -> None:
    """Bring MODEL_DIR to the feed's latest signed version (shortest verified path)."""
    from .pull import pull

    try:
        interval = parse_duration(every) if every else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--every") from None
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while True:
        try:
            doc = pull(model_dir, feed, root_file=root_file, check=check, status_file=status_file)
            click.echo(json.dumps(doc, indent=2) if as_json else _line(doc))
        except (AgentError, OSError) as exc:
            if not isinstance(exc, AgentError):  # disk full, permissions: one line (path, reason), exit 1
                exc = AgentError(error_line(exc))
            if interval is None:
                _fail(exc)
            click.echo(f"error: {' '.join(str(exc).split())}", err=True)
        if interval is None:
            return
        deadline = time.monotonic() + interval
        while not stop and time.monotonic() < deadline:
            time.sleep(min(1.0, interval))
        if stop:
            return


@agent.command("rollback")
@click.option("--model-dir", required=True, type=click.Path(file_okay=False))
@click.option("--status", "status_file", type=click.Path(dir_okay=False))
def rollback_cmd(model_dir, status_file) -> None:
    """Switch back to the previous slot; the version left is not reinstalled until the feed moves on."""
    from .pull import rollback

    try:
        click.echo(_line(rollback(model_dir, status_file)))
    except (AgentError, OSError) as exc:
        _fail(exc if isinstance(exc, AgentError) else AgentError(error_line(exc)))


@agent.command("status")
@click.option("--model-dir", required=True, type=click.Path(file_okay=False))
@click.option("--status", "status_file", type=click.Path(dir_okay=False))
def status_cmd(model_dir, status_file) -> None:
    """Print the status file of the last pull or rollback."""
    from pathlib import Path

    path = Path(status_file) if status_file else Path(model_dir) / "status.json"
    if not path.exists():
        click.echo(f"error: {path}: no status yet (no pull has run)", err=True)
        sys.exit(7)
    try:
        click.echo(path.read_text().rstrip())
    except OSError as exc:
        _fail(AgentError(error_line(exc)))


def main() -> None:
    """Console-script entry point of ``mergestream-agent``."""
    agent(prog_name="mergestream-agent")


if __name__ == "__main__":
    main()
