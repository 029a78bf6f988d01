"""No path of the operator's machine leaves it: the class of bug, over every output and feed file.

Everything runs under a folder whose path holds a distinctive marker, with absolute paths on the
command lines (the worst case): the one-shot verbs (fold, a second fold, merge, unmerge by subtract
and by replay, make-patch, apply-patch), the daemon (two published versions, their patch, ``patch
--from --to``) and a signed feed built from it. Then every byte of every file those wrote that
travels (model folders, patches, ``fold.json``, the feed's metadata and targets) is searched for the
marker, the temporary folder's path and the home folder. The state folders (the policy state's
manifest and residuals, the daemon's ledger, kept experts, ``versions/N/state/``) are the operator's
own: they stay on the machine (never mirrored, never in a feed) and are not searched.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from .conftest import make_hf_expert, run_cli, save_tensors
from .test_daemon import Daemon, scaled_expert, tiny_base

MARKER = "HOSTMARK-q7zx"


def _leaks(roots: list[Path], needles: list[str]) -> list[str]:
    """``file: needle`` for every file under ``roots`` holding one of ``needles`` (bytes, anywhere)."""
    found = []
    for root in roots:
        files = [root] if root.is_file() else [p for p in sorted(root.rglob("*")) if p.is_file()]
        for f in files:
            data = f.read_bytes()
            found += [f"{f}: {n}" for n in needles if n.encode() in data]
    return found


@pytest.mark.slow
def test_no_output_or_feed_file_holds_a_host_path(tmp_path, tiny_bert):
    root = tmp_path / f"operator-{MARKER}" / "work"
    root.mkdir(parents=True)
    base = root / "models" / "base"
    shutil.copytree(tiny_bert, base)
    e1 = make_hf_expert(base, root / "experts" / "e1", seed=1)
    e2 = make_hf_expert(base, root / "experts" / "e2", seed=2)
    pol = ("--policy", "task_arithmetic", "--set", "lambda=0.5", "-q")
    run_cli("fold", "--base", base, "--expert", e1, "--state", root / "s", "--out", root / "f1", *pol)
    run_cli("fold", "--base", base, "--backbone", root / "f1", "--expert", e2, "--state", root / "s",
            "--out", root / "f2", *pol)
    shutil.copytree(root / "s", root / "s_replay")
    run_cli("merge", "--base", base, "--out", root / "m", *pol, e1, e2)
    run_cli("unmerge", "--state", root / "s", "--expert", "e1", "--out", root / "u", "-q")
    run_cli("unmerge", "--state", root / "s_replay", "--expert", "e1", "--mode", "replay", "--out", root / "r", "-q")
    run_cli("make-patch", "--from-dir", root / "f1", "--to-dir", root / "f2", "--out", root / "p.safetensors")
    run_cli("apply-patch", root / "f1", root / "p.safetensors", "--out", root / "ap")

    (root / "daemon").mkdir()
    d = Daemon(root / "daemon").start()
    try:
        for i, name in enumerate(("first", "second"), 1):
            save_tensors(root / "daemon" / "inbox" / f"{name}.safetensors", scaled_expert(tiny_base(), i))
            d.wait(lambda i=i: d.status()["current_version"] == i, 60, f"{name} not folded")
    finally:
        assert d.stop() == 0
    run_cli("patch", "--from", "1", "--to", "2", "--config", d.config, "--out", root / "p12.safetensors")
    run_cli("feed", "keygen", "--keys", root / "keys")
    run_cli("feed", "build", "--config", d.config, "--out", root / "feed", "--keys", root / "keys")

    versions = root / "daemon" / "state" / "versions"
    travelling = [root / n for n in ("f1", "f2", "m", "u", "r", "ap", "p.safetensors", "p12.safetensors", "feed")]
    for v in sorted(versions.iterdir()):  # versions/N/state/ stays local (see the module docstring)
        travelling += [p for p in v.iterdir() if p.name != "state"]
    home = os.path.expanduser("~")
    needles = [MARKER, str(tmp_path)] + ([home + "/"] if len(home) > 1 else [])
    assert _leaks(travelling, needles) == []
    # the check is real: the state folders the operator keeps do name the inputs by path
    assert _leaks([root / "s" / "manifest.json"], [MARKER])

    # what outputs record instead: names and content hashes
    for v in (1, 2):
        card = (versions / f"{v:06d}" / "model" / "README.md").read_text()
        fold = json.loads((versions / f"{v:06d}" / "fold.json").read_text())
        assert f"# version {v} " in card and "base_model: base.safetensors" in card
        assert fold["probes"] and all(f"`{k}`" in card for k in fold["probes"])
    feed_card = next((root / "feed" / "targets").rglob("*README.md")).read_text()
    assert feed_card == (versions / "000002" / "model" / "README.md").read_text()
