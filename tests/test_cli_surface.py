"""The command line's surface: ``--version``, ``-h`` on every verb, shell completion."""

from __future__ import annotations

import os
import subprocess
from importlib.metadata import version

import click
import pytest
from click.testing import CliRunner

from mergestream.cli import cli

from .conftest import MERGESTREAM, run_cli


def test_version_comes_from_the_package_metadata():
    proc = run_cli("--version")
    assert proc.stdout == f"mergestream {version('mergestream')}\n"


def _verbs(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for name, cmd in sorted(group.commands.items()):
        out.append((*prefix, name))
        if isinstance(cmd, click.Group):
            out += _verbs(cmd, (*prefix, name))
    return out


@pytest.mark.parametrize("verb", [v for v in _verbs(cli) if v != ("demo",)], ids=" ".join)
def test_every_verb_takes_dash_h(verb):
    res = CliRunner().invoke(cli, [*verb, "-h"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("Usage: ") and " ".join(verb) in res.output.splitlines()[0]


def test_demo_takes_dash_h_like_the_other_verbs():
    """``demo`` forwards its arguments to its own command (it imports torch only when it runs)."""
    proc = run_cli("demo", "-h")
    assert proc.stdout.startswith("Usage: mergestream demo [OPTIONS]") and "--policy" in proc.stdout


def test_bash_completion_script_and_completions():
    env = {**os.environ, "_MERGESTREAM_COMPLETE": "bash_source"}
    script = subprocess.run(MERGESTREAM, env=env, capture_output=True, text=True, timeout=60).stdout
    assert "_MERGESTREAM_COMPLETE=bash_complete" in script and "complete " in script
    env = {**os.environ, "_MERGESTREAM_COMPLETE": "bash_complete", "COMP_WORDS": "mergestream st", "COMP_CWORD": "1"}
    got = subprocess.run(MERGESTREAM, env=env, capture_output=True, text=True, timeout=60).stdout
    assert "plain,status" in got.split()
