"""``mergestream feed``: keys, signed feed builds and key rotation (the operator's side).

Registered in the main ``mergestream`` group by ``cli.py``. Errors the operator can cause exit with
status 2 and one line ``error: <Type>: ...`` (:func:`mergestream.errors.fail_cleanly`); key material
and passphrases are never printed.
"""

from __future__ import annotations

import json
from datetime import timedelta

import click

from ..errors import MergestreamError, fail_cleanly
from ..patches.codec import FORMAT_NUMBERS
from .layout import parse_duration


def _need_tuf() -> None:
    """Refuse with one line when the `feed` extra (python-tuf, securesystemslib) is not installed."""
    try:
        import securesystemslib.signer  # noqa: F401
        import tuf.api.metadata  # noqa: F401
    except ImportError as exc:
        raise MergestreamError(f"the feed needs python-tuf ({exc.name} is missing): "
                               "pip install -e '.[feed]' from the checkout") from None


@click.group("feed")
def feed() -> None:
    """A signed update feed (The Update Framework) for edge devices running mergestream-agent."""


@feed.command("keygen")
@click.option("--keys", "keys_dir", required=True, type=click.Path(file_okay=False),
              help="folder for the key files (created, mode 0700)")
@fail_cleanly
def keygen_cmd(keys_dir: str) -> None:
    """Create Ed25519 keys for the root, targets, snapshot and timestamp roles.

    Private keys are encrypted when MERGESTREAM_FEED_KEY_PASSPHRASE is set. Keep root's key offline.
    """
    _need_tuf()
    from .keys import generate

    ids = generate(keys_dir)
    for role, keyid in ids.items():
        click.echo(f"{role}: keyid {keyid}")


@feed.command("build")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="daemon config (its state_dir)")
@click.option("--state-dir", type=click.Path(file_okay=False), help="the daemon's state folder (instead of --config)")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="feed folder (created or advanced)")
@click.option("--keys", "keys_dir", required=True, type=click.Path(file_okay=False), help="keys folder (feed keygen)")
@click.option("--latest", type=int, help="version devices should run (default: the daemon's current); "
                                         "an older one than the feed's is an operator rollback")
@click.option("--keep", type=click.IntRange(1), help="only the newest N versions' patches")
@click.option("--timestamp-expires", default="1d", show_default=True, help="timestamp lifetime (freeze window)")
@click.option("--snapshot-expires", default="7d", show_default=True)
@click.option("--targets-expires", default="90d", show_default=True)
@click.option("--root-expires", default="365d", show_default=True)
@click.option("--patch-format", type=click.Choice([str(n) for n in FORMAT_NUMBERS]), default="1", show_default=True,
              help="2: re-encode the patches with bitmasks (smaller for sparse folds)")
@click.option("--zstd", "zstd_level", type=click.IntRange(1, 22), help="format 2: zstd level for each payload")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@fail_cleanly
def build_cmd(config_path, state_dir, out, keys_dir, latest, keep, timestamp_expires, snapshot_expires,
              targets_expires, root_expires, patch_format, zstd_level, as_json) -> None:
    """Publish the next signed release of the feed from the daemon's versions."""
    _need_tuf()
    from .build import build_feed

    if bool(config_path) == bool(state_dir):
        raise MergestreamError("give exactly one of --config and --state-dir")
    if config_path:
        from ..config import load_config

        state_dir = load_config(config_path).state_dir
    try:
        expires = {r: timedelta(seconds=parse_duration(v)) for r, v in
                   (("timestamp", timestamp_expires), ("snapshot", snapshot_expires),
                    ("targets", targets_expires), ("root", root_expires))}
        rep = build_feed(state_dir, out, keys_dir, latest=latest, keep=keep, expires=expires,
                         patch_format=int(patch_format), zstd_level=zstd_level)
    except ValueError as exc:  # a malformed duration, or a feed file that does not parse
        raise MergestreamError(" ".join(str(exc).split())) from None
    if as_json:
        click.echo(json.dumps(rep, indent=2))
        return
    lat = rep["latest"]
    click.echo(f"release {rep['release']}: latest v{lat['version']} ({lat['weights_sha256'][:12]})"
               f"{' ROLLBACK' if lat['rollback'] else ''}, {rep['targets']} targets, root v{rep['root_version']}")
    for v, n in rep["bytes_to_latest"].items():
        click.echo(f"  from {'a fresh device' if v == 'none' else 'v' + v}: {n:,} bytes")
    if rep["patch_warning"]:
        click.echo(f"warning: {rep['patch_warning']}")


@feed.command("rotate-key")
@click.option("--keys", "keys_dir", required=True, type=click.Path(file_okay=False))
@click.option("--role", required=True, type=click.Choice(["root", "targets", "snapshot", "timestamp"]))
@fail_cleanly
def rotate_cmd(keys_dir: str, role: str) -> None:
    """Replace one role's key; the next `feed build` publishes a new root listing it (signed by the
    old root key too when ROLE is root)."""
    _need_tuf()
    from .keys import rotate_key

    old, new = rotate_key(keys_dir, role)
    click.echo(f"{role}: keyid {old[:12]} -> {new[:12]}; run `mergestream feed build` to publish the new root")
