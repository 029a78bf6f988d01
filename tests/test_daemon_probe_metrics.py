"""The probe gauges show exactly the current version's probes and the last candidate's (issue 13,
N5): a task unmerged or rolled back leaves no series behind, read from a real /metrics scrape."""

from __future__ import annotations

import re
import urllib.request

from mergestream.daemon.metrics import MetricsServer
from mergestream.daemon.sources import ExpertReady

from .test_operator import _experts, _ok, _service

#: a per-task probe like the classification probe of experts that ship one: acc.<task> for each
#: fold in the candidate (its contribution files are named <expert id>-<generation>.safetensors)
PROBE = '''from pathlib import Path
def score(model_dir, ctx):
    return {"acc." + Path(c).name.rsplit("-", 1)[0]: 90.0 + i for i, c in enumerate(ctx.contributions)}
'''


def _scrape(port: int) -> dict[str, dict[str, float]]:
    """{gauge: {probe: value}} of the two probe gauges, from the text exposition."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    out: dict[str, dict[str, float]] = {"mergestream_probe_value": {}, "mergestream_candidate_probe_value": {}}
    for m in re.finditer(r'^(mergestream_(?:candidate_)?probe_value)\{probe="([^"]+)"\} (\S+)$', text, re.MULTILINE):
        out[m.group(1)][m.group(2)] = float(m.group(3))
    return out


def _tasks(series: dict[str, float]) -> set[str]:
    return {k for k in series if k.startswith("acc.")}


def test_probe_series_follow_the_current_version_through_fold_unmerge_rollback_and_restart(tmp_path, monkeypatch):
    (tmp_path / "probes").mkdir()
    (tmp_path / "probes" / "n5probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path / "probes"))
    bpath, experts = _experts(tmp_path, 3)
    probes = [{"type": "weight_space"}, {"type": "entrypoint", "params": {"target": "n5probe:score"}}]
    svc = _service(tmp_path, bpath, probes=probes)
    server = MetricsServer(svc.metrics, "127.0.0.1", 0)
    server.start()
    try:
        for i, e in enumerate(experts):
            svc.on_expert_ready(ExpertReady(source="folder", uri=str(e), expert_id=f"t{i}"))
            assert svc.step()
        got = _scrape(server.port)
        assert _tasks(got["mergestream_probe_value"]) == {"acc.t0", "acc.t1", "acc.t2"}
        assert got["mergestream_probe_value"] == got["mergestream_candidate_probe_value"]
        assert "relative_drift" in got["mergestream_probe_value"]  # the other probes stay

        _ok(svc, "unmerge", "t1")
        got = _scrape(server.port)
        current = svc.store.fold_json(svc.store.current())["probes"]
        assert got["mergestream_probe_value"] == current and _tasks(current) == {"acc.t0", "acc.t2"}
        assert got["mergestream_candidate_probe_value"] == current

        _ok(svc, "rollback", 1)
        got = _scrape(server.port)
        assert got["mergestream_probe_value"] == svc.store.fold_json(1)["probes"]
        assert _tasks(got["mergestream_probe_value"]) == {"acc.t0"}
        assert _tasks(got["mergestream_candidate_probe_value"]) == {"acc.t0", "acc.t2"}  # the last candidate's

        _ok(svc, "rollback", 3)
        assert _tasks(_scrape(server.port)["mergestream_probe_value"]) == {"acc.t0", "acc.t1", "acc.t2"}
    finally:
        server.stop()
        svc.shutdown()
    # a restarted daemon exports the current version's probes from the start, and only those
    svc = _service(tmp_path, bpath, probes=probes)
    try:
        registry = svc.metrics.registry
        current = svc.store.fold_json(svc.store.current())["probes"]
        for k, v in current.items():
            assert registry.get_sample_value("mergestream_probe_value", {"probe": k}) == v
        assert registry.get_sample_value("mergestream_probe_value", {"probe": "acc.nope"}) is None
    finally:
        svc.shutdown()


def test_a_candidate_whose_probes_failed_leaves_no_candidate_series(tmp_path, monkeypatch):
    (tmp_path / "probes").mkdir()
    (tmp_path / "probes" / "n5flaky.py").write_text(PROBE.replace(
        "def score(model_dir, ctx):\n", "def score(model_dir, ctx):\n"
        "    if len(ctx.contributions) > 1:\n        raise RuntimeError('probe broke')\n"))
    monkeypatch.syspath_prepend(str(tmp_path / "probes"))
    bpath, experts = _experts(tmp_path, 2)
    svc = _service(tmp_path, bpath, probes=[{"type": "entrypoint", "params": {"target": "n5flaky:score"}}])
    try:
        for i, e in enumerate(experts):
            svc.on_expert_ready(ExpertReady(source="folder", uri=str(e), expert_id=f"t{i}"))
            assert svc.step()
        assert svc.ledger.expert("t1").status == "failed"
        r = svc.metrics.registry
        assert r.get_sample_value("mergestream_candidate_probe_value", {"probe": "acc.t0"}) is None
        assert r.get_sample_value("mergestream_probe_value", {"probe": "acc.t0"}) == 90.0  # current: unchanged
    finally:
        svc.shutdown()
