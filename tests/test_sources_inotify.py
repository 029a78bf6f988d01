"""The folder source when inotify runs out (class N7): real watchdog observers in a private user
namespace (``unshare -Ur``) whose inotify limits are lowered, so nothing else on the machine is
affected. Out of instances, out of watches at start, out of watches later (a folder arriving in the
inbox): the source polls instead, says so once (warning, ``on_error``, ``status`` note), and every
expert is still emitted; the daemon keeps running and folds."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .conftest import MERGESTREAM, run_cli, save_tensors
from .test_daemon import Daemon, scaled_expert, tiny_base


def _userns_ok() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-Ur", "sh", "-c", "echo 1 > /proc/sys/user/max_inotify_watches"],
                           capture_output=True)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not _userns_ok(), reason="needs unshare -Ur and writable /proc/sys/user limits")


def _limited(limit: str, value: int, argv: list[str]) -> list[str]:
    """``argv`` run in a fresh user namespace whose ``/proc/sys/user/<limit>`` is ``value``."""
    return ["unshare", "-Ur", "sh", "-c", f'echo {value} > /proc/sys/user/{limit} && exec "$@"', "sh", *argv]


#: Runs a FolderSource on argv[1] (already holding ``ready.safetensors``); a folder expert and a
#: file expert arrive after it started; prints what it saw as JSON.
WATCHER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    import torch
    from safetensors.torch import save_file
    from mergestream.daemon.sources import FolderSource

    inbox = Path(sys.argv[1])
    got, errors, notes = [], [], []
    src = FolderSource(inbox, lambda ev: got.append(Path(ev.uri).name), settle_seconds=0.3, poll_interval=0.2,
                       on_error=errors.append, note=notes.append)
    src.start()
    def wait(n):
        end = time.time() + 15
        while len(got) < n and time.time() < end:
            time.sleep(0.05)
    wait(1)
    started_with = type(src._observer).__name__
    for name in ("hf-a", "hf-b"):  # folders: each needs a watch of its own under inotify
        (inbox / name).mkdir()
        time.sleep(0.3)
        save_file({"w": torch.ones(4)}, str(inbox / name / "model.safetensors"))
    wait(3)
    save_file({"w": torch.zeros(4)}, str(inbox / "late.safetensors"))
    wait(4)
    print(json.dumps({"got": sorted(got), "errors": [[e.errno, str(e)] for e in errors],
                      "notes": [n for n in notes if n], "fallback": src.fallback, "started_with": started_with,
                      "observer": type(src._observer).__name__}))
    src.stop()
""")


def _watch(tmp_path: Path, limit: str, value: int) -> dict:
    inbox = tmp_path / "inbox"
    save_tensors(inbox / "ready.safetensors", tiny_base(1))
    script = tmp_path / "watcher.py"
    script.write_text(WATCHER)
    proc = subprocess.run(_limited(limit, value, [sys.executable, str(script), str(inbox)]), capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["stderr"] = proc.stderr
    return out


ALL = ["hf-a", "hf-b", "late.safetensors", "ready.safetensors"]


@pytest.mark.parametrize("limit,value,errno_", [("max_inotify_instances", 0, 24), ("max_inotify_watches", 0, 28)],
                         ids=["no-instance", "no-watch-for-the-inbox"])
def test_inotify_exhausted_at_start_polls_the_inbox_and_says_so_once(tmp_path, limit, value, errno_):
    out = _watch(tmp_path, limit, value)
    assert out["got"] == ALL
    assert out["started_with"] == out["observer"] == "PollingObserver"
    assert [e[0] for e in out["errors"]] == [errno_]  # one error for the source-errors metric, not one per event
    assert out["fallback"] and f"errno {errno_}" in out["fallback"]
    assert len(out["notes"]) == 1 and "watch.polling" in out["notes"][0]
    assert out["stderr"].count("inotify exhausted") == 1  # one warning


def test_watch_limit_reached_later_by_a_new_folder_switches_to_polling(tmp_path):
    """One watch left: the inbox itself is watched by inotify; the first folder that arrives cannot
    be (watchdog skips it silently), the source notices, polls from then on, and still emits that
    folder's expert and everything after it."""
    out = _watch(tmp_path, "max_inotify_watches", 1)
    assert out["started_with"] == "InotifyObserver" and out["observer"] == "PollingObserver"
    assert out["got"] == ALL
    assert [e[0] for e in out["errors"]] == [28]
    assert len(out["notes"]) == 1 and "errno 28" in out["notes"][0]
    assert out["stderr"].count("inotify exhausted") == 1


def test_enough_watches_keeps_inotify_and_reports_nothing(tmp_path):
    out = _watch(tmp_path, "max_inotify_watches", 64)
    assert out["got"] == ALL
    assert out["observer"] == "InotifyObserver" and out["fallback"] is None
    assert out["errors"] == [] and out["notes"] == []


class LimitedDaemon(Daemon):
    """The daemon subprocess in a user namespace without any inotify instance."""

    def start(self, wait_ready: bool = True) -> Daemon:
        argv = _limited("max_inotify_instances", 0, [*MERGESTREAM, "run", "--config", str(self.config)])
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(self.log, "ab"), env=self.env)
        if wait_ready:
            self.wait(lambda: self.http("/readyz")[0] == 200, 60, "daemon never became ready")
        return self


def test_daemon_without_inotify_keeps_running_folds_and_shows_it(tmp_path):
    base = tiny_base()
    for i in (1, 2):
        save_tensors(tmp_path / "inbox" / f"e{i}.safetensors", scaled_expert(base, 10 + i))
    d = LimitedDaemon(tmp_path, extra={"mlflow": {"enabled": False}})
    d.start()
    try:
        d.wait(lambda: d.status()["current_version"] == 2, 90, "the inbox experts were not folded")
        save_tensors(tmp_path / "inbox" / "e3.safetensors", scaled_expert(base, 13))  # found by polling
        d.wait(lambda: d.status()["current_version"] == 3, 60, "an expert arriving later was not folded")
        assert d.metric('mergestream_source_errors_total{source="folder"}') == 1.0
        notes = d.status()["sources"]["folder"]
        assert [n["subject"] for n in notes] == ["watch"] and notes[0]["level"] == "warning"
        assert "errno 24" in notes[0]["message"]
        text = run_cli("status", "--config", d.config).stdout
        assert "source folder warning: inbox polled" in text
        assert d.proc.poll() is None  # still running: no crash loop
    finally:
        rc = d.stop()
    assert rc == 0 and "Traceback" not in d.log.read_text()
