"""The operator's ledger verbs start without torch, and the daemon's process ends promptly.

``status``, ``history`` and ``rollback`` (sent to a running daemon, or run here when none runs) read a SQLite ledger and a few
JSON files: they must not pay for importing torch (2-5 s on a loaded machine). Checked on the real
CLI in a subprocess with ``python -X importtime``, which lists every module the process imported.
The daemon, once it logged its last line ("daemon stopped"), exits within 2 s (the interpreter's
teardown of torch and MLflow used to take up to 8 s after it).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from .conftest import save_tensors
from .test_daemon import Daemon, scaled_expert, tiny_base


def imported_modules(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``mergestream ARGS`` under ``-X importtime``; its result and every module it imported."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "mergestream.cli", *args],
                          capture_output=True, text=True, timeout=120)
    mods = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "mergestream.cli" in mods or "click" in mods, proc.stderr[-2000:]
    return proc, mods


def torch_modules(mods: set[str]) -> list[str]:
    return sorted(m for m in mods if m == "torch" or m.startswith("torch."))


def _last_log_time(log: Path) -> float:
    """Unix time of the daemon's last JSON log line."""
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    return datetime.fromisoformat(lines[-1]["ts"].replace("Z", "+00:00")).timestamp()


def test_ledger_verbs_import_no_torch_and_the_daemon_exits_promptly(tmp_path):
    base = tiny_base()
    d = Daemon(tmp_path).start()
    try:
        for i, name in enumerate(("first", "second"), 1):
            save_tensors(tmp_path / "inbox" / f"{name}.safetensors", scaled_expert(base, i))
            d.wait(lambda i=i: d.status()["current_version"] == i, 60, f"{name} not folded")
        proc, mods = imported_modules("status", "--config", str(d.config), "--json")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(proc.stdout)["current_version"] == 2
        assert torch_modules(mods) == []
        proc, mods = imported_modules("history", "--config", str(d.config), "--json")
        assert proc.returncode == 0 and [f["expert_id"] for f in json.loads(proc.stdout)] == ["first", "second"]
        assert torch_modules(mods) == []
        proc, mods = imported_modules("rollback", "--config", str(d.config), "--to", "1")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "version 2 -> 1" in proc.stdout
        assert torch_modules(mods) == []
        assert d.status()["current_version"] == 1
        # the daemon: from SIGTERM to its last log line it finishes the step it is in; after the
        # last line the process is gone within 2 s
        d.proc.send_signal(signal.SIGTERM)
        d.proc.wait(60)
        ended = time.time()
        assert d.proc.returncode == 0
        assert "daemon stopped" in d.log.read_text().splitlines()[-1]
        assert ended - _last_log_time(d.log) < 2.0
    finally:
        d.stop()
    # no daemon running: rollback runs here, on the store and the ledger only (no probes, no torch)
    proc, mods = imported_modules("rollback", "--config", str(d.config), "--to", "2")
    assert proc.returncode == 0 and "version 1 -> 2" in proc.stdout, proc.stderr[-2000:]
    assert torch_modules(mods) == []
    st = d.status()
    assert st["current_version"] == 2 and not st["daemon_running"]
    assert {x["id"]: x["status"] for x in st["experts"]} == {"first": "accepted", "second": "accepted"}
    hist = json.loads(imported_modules("history", "--config", str(d.config), "--json")[0].stdout)
    assert [(h["kind"], h["version"]) for h in hist][-2:] == [("rollback", 1), ("rollback", 2)]
    bad, mods = imported_modules("rollback", "--config", str(d.config), "--to", "7")
    assert bad.returncode == 2 and "version 7 does not exist" in bad.stderr and torch_modules(mods) == []


def test_a_folding_verb_still_imports_torch_as_the_check_is_real(tmp_path):
    """The import check sees torch where it is loaded (``inspect`` reads tensors)."""
    save_tensors(tmp_path / "m.safetensors", tiny_base())
    proc, mods = imported_modules("inspect", str(tmp_path / "m.safetensors"))
    assert proc.returncode == 0 and torch_modules(mods)
