"""Click commands for incremental updates: ``apply-patch`` and ``make-patch``.

Both are plain :func:`click.command` objects, registered in the main ``mergestream`` group by
``cli.py``; they import their implementation lazily, so ``apply-patch`` never imports torch
(it needs only :mod:`mergestream.patches`: numpy and the standard library). Run standalone with
``python -m mergestream.patches.cli apply-patch ...``.

Errors the user can cause (a refused patch, an unreadable model, an existing output) exit with
status 2 and one line ``error: <Type>: ...`` on stderr (:func:`mergestream.errors.fail_cleanly`);
nothing is written.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..errors import fail_cleanly
from .codec import FORMAT_NUMBERS


def _report(doc: dict, as_json: bool, line: str) -> None:
    """Print a command's result: the whole dict as JSON, or its one-line summary."""
    click.echo(json.dumps(doc, indent=2) if as_json else line)


@click.command("apply-patch")
@click.argument("model_dir", type=click.Path())
@click.argument("patch", type=click.Path())
@click.option("--out", required=True, type=click.Path(), help="output model folder (must not exist)")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@fail_cleanly
def apply_patch_cmd(model_dir: str, patch: str, out: str, as_json: bool) -> None:
    """Apply PATCH to the model in MODEL_DIR and write the target version to --out.

    The patch's integrity and the model's weights hash are verified before anything is written,
    and the result's hash after; the output is staged and renamed into place.
    """
    from . import apply_patch

    rep = apply_patch(model_dir, patch, out)
    _report(rep, as_json, f"{rep['source_version'] or '?'} -> {rep['target_version'] or '?'}: {rep['out']} "
            f"({rep['tensors']} tensors: {rep['tensors_copied']} unchanged, {rep['tensors_sparse']} sparse, "
            f"{rep['tensors_dense']} dense, {rep['tensors_removed']} removed; sha256 {rep['target_sha256']})")


@click.command("make-patch")
@click.option("--from-dir", "from_dir", required=True, type=click.Path(), help="source model (version A)")
@click.option("--to-dir", "to_dir", required=True, type=click.Path(), help="target model (version B)")
@click.option("--out", required=True, type=click.Path(), help="patch file to write (must not exist)")
@click.option("--source-version", help="recorded source version (default: the source folder's name)")
@click.option("--target-version", help="recorded target version (default: the target folder's name)")
@click.option("--policy", default="", help="recorded policy (default: the target's mergestream.policy metadata)")
@click.option("--format", "patch_format", type=click.Choice([str(n) for n in FORMAT_NUMBERS]), default="1", show_default=True,
              help="1: index lists (every apply-patch reads it); 2: bitmasks for denser changes (smaller)")
@click.option("--zstd", "zstd_level", type=click.IntRange(1, 22), help="format 2: zstd level of each payload")
@click.option("--json", "as_json", is_flag=True, help="print the statistics as JSON")
@fail_cleanly
def make_patch_cmd(from_dir: str, to_dir: str, out: str, source_version: str | None, target_version: str | None,
                   policy: str, patch_format: str, zstd_level: int | None, as_json: bool) -> None:
    """Build the exact patch "--from-dir -> --to-dir" between two model folders.

    Format 2 (``--format 2``, optionally ``--zstd LEVEL``) needs a mergestream that reads patch
    format 2 on the applying side; format 1 is read by every version.
    """
    from .build import build_patch

    stats = build_patch(from_dir, to_dir, out,
                        source_version=source_version if source_version is not None else Path(from_dir).name,
                        target_version=target_version if target_version is not None else Path(to_dir).name,
                        policy=policy, patch_format=int(patch_format), zstd_level=zstd_level)
    _report(stats, as_json, f"{stats['path']}: {stats['patch_bytes']:,} bytes, {stats['ratio']:.2%} of the model "
            f"({stats['model_bytes']:,} bytes); {stats['tensors_changed']} of {stats['tensors']} tensors changed "
            f"({stats['tensors_sparse']} sparse, {stats['tensors_dense']} dense), {stats['tensors_removed']} removed")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def patch_cli() -> None:
    """Incremental updates: build and apply exact weight patches."""


patch_cli.add_command(apply_patch_cmd)
patch_cli.add_command(make_patch_cmd)


def main() -> None:
    """Entry point of ``python -m mergestream.patches.cli``."""
    patch_cli(prog_name="mergestream")


if __name__ == "__main__":
    main()
