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


def _command(verb: tuple[str, ...]) -> click.Command:
    cmd: click.Command = cli
    for name in verb:
        cmd = cmd.commands[name]  # type: ignore[attr-defined]
    return cmd


@pytest.mark.parametrize("verb", [v for v in _verbs(cli) if not isinstance(_command(v), click.Group)], ids=" ".join)
def test_every_verb_turns_bad_input_into_one_line(verb):
    """Every verb's function is wrapped by :func:`mergestream.errors.fail_cleanly` (one line on stderr,
    exit status 2 for a MergestreamError or an OSError); ``demo`` forwards to its own command."""
    if verb == ("demo",):
        from mergestream.demo import demo_cmd

        callback = demo_cmd.callback
    else:
        callback = _command(verb).callback
    assert getattr(callback, "fails_cleanly", False), f"mergestream {' '.join(verb)} lets errors out as tracebacks"


@pytest.mark.parametrize("setting", ["lamda=1", "lambda=abc", "alpha=true"])
def test_demo_with_a_bad_policy_parameter_says_so_in_one_line(setting, tmp_path):
    """Regression: ``demo --set lamda=1`` printed a 44-line traceback with the venv's paths."""
    proc = run_cli("demo", "--set", setting, "--data", tmp_path, "--workdir", tmp_path / "w", "--no-live",
                   check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: PolicyError: policy iso_c: bad parameters:"), proc.stderr
    assert not (tmp_path / "w").exists()
