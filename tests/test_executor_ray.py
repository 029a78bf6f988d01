"""The Ray executor (issues 15 and 37): folds on a Ray cluster of two nodes started here (Ray's own
multi-node test cluster on one machine: separate raylets and object stores, bound to 127.0.0.1)
write the bytes the local executor writes, for every registered policy; tasks read their inputs and
write their output themselves (the driver receives metadata only); a worker killed mid-fold is
retried; a fold whose task keeps failing leaves no output and an unchanged state folder; a dead
cluster address is refused within its timeout."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from mergestream import engine  # noqa: E402
from mergestream.engine import ExecOptions, LocalExecutor  # noqa: E402
from mergestream.engine.executors import make_executor  # noqa: E402
from mergestream.io.checkpoints import open_safetensors_file  # noqa: E402
from mergestream.io.state import StateDir  # noqa: E402

from .conftest import opened_during, perturb, random_model, save_tensors  # noqa: E402
from .test_unmerge_policies import IDS, POLICIES  # noqa: E402

#: small tasks, so that every fold here runs as several Ray tasks
GROUP = 6 * 1024
LOOPBACK = "127.0.0.1"


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes for the module (their start is paid once), each with its own raylet and object
    store, on the loopback only, without Ray's token authentication (so that the daemon subprocess
    can join it); the tasks land on both."""
    from mergestream.engine.executors.ray_cluster import loopback_only

    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_AUTH_MODE", "disabled")
    loopback_only()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    assert c.address.startswith(f"{LOOPBACK}:"), c.address
    ray.init(address=c.address, log_to_driver=False, include_dashboard=False)
    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert len(nodes) == 2 and {n["NodeManagerAddress"] for n in nodes} == {LOOPBACK}
    assert _ray_listeners() and all(ip in (LOOPBACK, "::ffff:127.0.0.1", "::1") for ip in _ray_listeners()), \
        _ray_listeners()
    yield c
    ray.shutdown()
    c.shutdown()
    mp.undo()


def _ray_listeners() -> set[str]:
    """The addresses Ray's own servers (GCS, raylets) listen on."""
    import psutil

    out = set()
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.pid:
            try:
                name = psutil.Process(c.pid).name()
            except psutil.Error:
                continue
            if name in ("gcs_server", "raylet"):
                out.add(c.laddr.ip)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray-models")
    base = random_model(0, torch.bfloat16)
    bpath = save_tensors(tmp / "base.safetensors", base)
    experts = [save_tensors(tmp / f"{c}.safetensors", perturb(base, 0.05, 10 + i)) for i, c in enumerate("AB")]
    return bpath, experts


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _content(path: Path) -> dict[str, object]:
    """A state or residual file's content: its metadata and every key's dtype, shape and bytes (a remote
    fold writes it as a pieces folder, the local one as one file)."""
    ck = open_safetensors_file(path)
    try:
        return {"__metadata__": ck.metadata(),
                **{k: (str(ck.meta(k).dtype), ck.meta(k).shape, ck.get(k).view(-1).view(torch.uint8).numpy().tobytes())
                   for k in ck.keys()}}
    finally:
        ck.close()


def _state_bytes(state: Path) -> dict[str, object]:
    """The state's data by role (their names are random): the per-tensor state and each residual."""
    man = StateDir(state).manifest
    out: dict[str, object] = {"state": _content(state / man.state_file) if man.state_file else None}
    for f in man.folds:
        out[f"contrib-{f.id}"] = _content(state / f.contribution) if f.contribution else None
        out[f"sha-{f.id}"] = (f.sha256, f.sha256_kind)
    return out


def _chain(tmp: Path, tag: str, bpath, experts, policy, params, executor=None, **kw):
    state, backbone = tmp / f"{tag}-state", None
    opts = kw.pop("opts", {})
    for i, e in enumerate(experts):
        out = tmp / f"{tag}-{i}"
        engine.fold(bpath, backbone, e, policy, params, state_dir=state, out=out, expert_id=f"e{i}",
                    options=ExecOptions(threads=1, executor=executor or LocalExecutor(), **opts), **kw)
        backbone = out
    return backbone, state


@pytest.mark.parametrize(("policy", "params"), POLICIES, ids=IDS)
def test_ray_fold_equals_local_fold_byte_for_byte(cluster, models, tmp_path, policy, params):
    bpath, experts = models
    ex = make_executor("ray", group_bytes=GROUP)
    out_l, st_l = _chain(tmp_path, "local", bpath, experts, policy, params)
    out_r, st_r = _chain(tmp_path, "ray", bpath, experts, policy, params, executor=ex)
    assert len(ex.tasks) > 1, "the fold should have been split into several tasks"
    assert _files(out_r) == _files(out_l)
    assert _state_bytes(st_r) == _state_bytes(st_l)
    model_bytes = sum(len(b) for b in _files(out_l).values())
    assert 0 < ex.received_bytes < model_bytes / 5, "tensor bytes travelled to the driver"


def test_ray_cmaes_search_runs_on_the_driver(cluster, models, tmp_path):
    """MDM-OC with CMA-ES: tasks write the state, the search (its objective evaluates whole models)
    stays on the driver, the chosen output is written by tasks again."""
    bpath, experts = models

    def objective(alphas, weights):
        return float(np.sum((np.asarray(alphas) - 0.4) ** 2))

    params = {"alpha": 0.3, "coefficients": "cmaes", "budget": 12, "stability": 0.0, "sigma": 0.3}
    out_l, st_l = _chain(tmp_path, "local", bpath, experts, "mdm_oc", params, objective=objective)
    out_r, st_r = _chain(tmp_path, "ray", bpath, experts, "mdm_oc", params,
                         executor=make_executor("ray", group_bytes=GROUP), objective=objective)
    assert _files(out_r) == _files(out_l)
    assert _state_bytes(st_r) == _state_bytes(st_l)


def test_ray_replay_unmerge_equals_local(cluster, models, tmp_path):
    bpath, experts = models
    params = {"k": 30}
    _, st_l = _chain(tmp_path, "local", bpath, experts, "ties", params)
    _, st_r = _chain(tmp_path, "ray", bpath, experts, "ties", params)
    engine.unmerge(st_l, "e0", "replay", out=tmp_path / "u-local", options=ExecOptions(threads=1))
    engine.unmerge(st_r, "e0", "replay", out=tmp_path / "u-ray",
                   options=ExecOptions(threads=1, executor=make_executor("ray", group_bytes=GROUP)))
    assert _files(tmp_path / "u-ray") == _files(tmp_path / "u-local")
    assert _state_bytes(st_r) == _state_bytes(st_l)


class KillOnce:
    """A task hook (runs in the worker): the first task to reach it dies with its process (SIGKILL);
    ``marker`` (a file every worker sees) records that it happened, so the retry goes on."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __call__(self, names: list[str]) -> None:
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_worker_is_retried_and_the_fold_is_unchanged(cluster, models, tmp_path):
    bpath, experts = models
    marker = tmp_path / "killed-once"

    ex = make_executor("ray", group_bytes=GROUP, task_hook=KillOnce(marker), max_retries=2)
    out_l, st_l = _chain(tmp_path, "local", bpath, experts, "safe_merge", POLICIES[3][1])
    out_r, st_r = _chain(tmp_path, "ray", bpath, experts, "safe_merge", POLICIES[3][1], executor=ex)
    assert marker.exists()
    assert _files(out_r) == _files(out_l)
    assert _state_bytes(st_r) == _state_bytes(st_l)


def test_a_task_that_keeps_failing_leaves_no_output_and_the_state_unchanged(cluster, models, tmp_path):
    bpath, experts = models
    out0, state = _chain(tmp_path, "ray", bpath, experts[:1], "opcm", {"alpha": 0.5})
    before = _files(state)

    def fail(names):
        raise RuntimeError("disk on fire")

    ex = make_executor("ray", group_bytes=GROUP, task_hook=fail, max_retries=2)
    with pytest.raises(RuntimeError, match="disk on fire") as err:
        engine.fold(bpath, out0, experts[1], "opcm", {"alpha": 0.5}, state_dir=state, out=tmp_path / "next",
                    expert_id="e1", options=ExecOptions(executor=ex))
    # the task's own error, not Ray's wrapper whose text is the worker's traceback (the CLI prints it)
    assert type(err.value) is RuntimeError and str(err.value) == "disk on fire"
    assert not (tmp_path / "next").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".next")], "a staging folder was left behind"
    assert _files(state) == before


def test_unknown_executor_is_a_clear_error():
    from mergestream.errors import MergestreamError

    with pytest.raises(MergestreamError, match="unknown executor 'dask'"):
        make_executor("dask")


@pytest.mark.parametrize(("policy", "params"), POLICIES, ids=IDS)
def test_ray_merge_equals_local_merge_byte_for_byte(cluster, models, tmp_path, policy, params):
    bpath, experts = models
    engine.merge(bpath, experts, policy, params, out=tmp_path / "local", options=ExecOptions(threads=1))
    ex = make_executor("ray", group_bytes=GROUP)
    engine.merge(bpath, experts, policy, params, out=tmp_path / "ray", options=ExecOptions(threads=1, executor=ex))
    assert len(ex.tasks) > 1
    assert _files(tmp_path / "ray") == _files(tmp_path / "local")


def test_cli_fold_with_the_ray_executor(cluster, models, tmp_path):
    """``--executor ray --ray-address``: the CLI joins the running cluster (here in-process)."""
    from click.testing import CliRunner

    from mergestream.cli import cli

    bpath, experts = models
    args = ["fold", "--base", str(bpath), "--expert", str(experts[0]), "--policy", "ties", "--set", "k=30",
            "--threads", "1", "-q"]
    r = CliRunner().invoke(cli, [*args, "--state", str(tmp_path / "s1"), "--out", str(tmp_path / "o1")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, [*args, "--state", str(tmp_path / "s2"), "--out", str(tmp_path / "o2"),
                                 "--executor", "ray"])
    assert r.exit_code == 0, r.output
    assert _files(tmp_path / "o2") == _files(tmp_path / "o1")
    r = CliRunner().invoke(cli, [*args, "--state", str(tmp_path / "s3"), "--out", str(tmp_path / "o3"),
                                 "--ray-address", "auto"])
    assert r.exit_code == 2 and "--ray-address needs --executor ray" in r.output


def test_daemon_folds_on_the_cluster_its_config_names(cluster, tmp_path):
    """``executor: {kind: ray, address}``: a real daemon subprocess joins the test's cluster and
    publishes the same weights as a local fold of the same experts."""
    from mergestream.io.checkpoints import read_state_dict

    from .test_daemon import Daemon, scaled_expert, tiny_base

    address = ray.get_runtime_context().gcs_address
    d = Daemon(tmp_path, {"executor": {"kind": "ray", "address": address}}, env={"RAY_AUTH_MODE": "disabled"})
    base = tiny_base()
    src = [save_tensors(tmp_path / "src" / f"e{i}.safetensors", scaled_expert(base, 10 + i)) for i in range(2)]
    try:
        d.start()
        for p in src:
            (tmp_path / "inbox" / p.name).write_bytes(p.read_bytes())
            n = int(p.stem[1:]) + 1
            d.wait(lambda n=n: d.status()["current_version"] == n, 120, f"version {n} never published")
    finally:
        assert d.stop() == 0
    assert "ray fold tasks=" in d.log.read_text(), "the daemon did not fold on Ray"
    assert "received_bytes=" in d.log.read_text()
    out, _ = _chain(tmp_path, "local", tmp_path / "base.safetensors", src, "task_arithmetic", {"lambda": 0.3})
    got, want = read_state_dict(tmp_path / "state" / "current" / "model"), read_state_dict(out)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.fixture(scope="module")
def tied_models(tmp_path_factory):
    """A base whose LM head is tied to its embeddings, and two experts that keep the tie."""
    tmp = tmp_path_factory.mktemp("ray-tied")
    base = random_model(3, torch.bfloat16)
    base["lm_head.weight"] = base["embed.word_embeddings.weight"].clone()
    bpath = save_tensors(tmp / "base.safetensors", base)
    experts = []
    for i, c in enumerate("AB"):
        e = perturb(base, 0.05, 20 + i)
        e["lm_head.weight"] = e["embed.word_embeddings.weight"].clone()
        experts.append(save_tensors(tmp / f"{c}.safetensors", e))
    return bpath, experts


@pytest.mark.parametrize(("policy", "params"), [("ties", {"k": 30}), ("safe_merge", POLICIES[3][1])],
                         ids=["ties", "safe_merge"])
def test_tasks_write_into_many_shards_with_tied_tensors(cluster, tied_models, tmp_path, policy, params):
    """A sharded output (a shard every ~2 KiB) whose tied LM head sits in another shard than its
    embeddings: every task writes its byte ranges into whichever shard the plan says; same bytes,
    same content hash as the local fold (the alias's digest is its primary's)."""
    bpath, experts = tied_models
    opts = {"max_shard_bytes": 2048}
    out_l, st_l = _chain(tmp_path, "local", bpath, experts, policy, params, opts=dict(opts))
    ex = make_executor("ray", group_bytes=GROUP)
    out_r, st_r = _chain(tmp_path, "ray", bpath, experts, policy, params, executor=ex, opts=dict(opts))
    assert len([p for p in out_l.iterdir() if p.suffix == ".safetensors"]) > 3
    assert _files(out_r) == _files(out_l)
    assert _state_bytes(st_r) == _state_bytes(st_l)


def test_tasks_run_on_both_nodes(cluster, models, tmp_path):
    """The tasks of one fold are spread over the cluster's two nodes (each its own raylet and object
    store): what the output needs travels through the shared folder, not through the driver."""
    bpath, experts = models
    seen = tmp_path / "nodes"
    seen.mkdir()

    def record_node(names):  # runs in the worker
        node = ray.get_runtime_context().get_node_id()
        (seen / f"{node}-{os.getpid()}").touch()
        time.sleep(0.2)  # long enough that one node does not take every task alone

    ex = make_executor("ray", group_bytes=GROUP // 2, task_hook=record_node)
    out_l, _ = _chain(tmp_path, "local", bpath, experts[:1], "task_arithmetic", {"lambda": 0.7})
    out_r, _ = _chain(tmp_path, "ray", bpath, experts[:1], "task_arithmetic", {"lambda": 0.7}, executor=ex)
    assert _files(out_r) == _files(out_l)
    nodes = {p.name.split("-")[0] for p in seen.iterdir()}
    assert nodes == {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def _dead_address() -> str:
    with socket.socket() as s:  # a port nobody listens on (bound, then closed)
        s.bind((LOOPBACK, 0))
        return f"{LOOPBACK}:{s.getsockname()[1]}"


def test_a_dead_cluster_address_is_refused_within_the_timeout(tmp_path, models):
    """`fold --executor ray --ray-address <dead>`: one line naming the address and how to choose
    another, exit 2, in seconds (Ray itself would retry for minutes)."""
    from .conftest import run_cli

    bpath, experts = models
    addr = _dead_address()
    t0 = time.monotonic()
    r = run_cli("fold", "--base", str(bpath), "--expert", str(experts[0]), "--policy", "ties", "--state",
                str(tmp_path / "s"), "--out", str(tmp_path / "o"), "--executor", "ray", "--ray-address", addr,
                "-q", check=False)
    took = time.monotonic() - t0
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and addr in lines[0] and "--ray-address" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert took < 60
    assert not (tmp_path / "o").exists() and not (tmp_path / "s").exists()


def test_an_address_where_something_else_listens_is_refused_in_seconds(cluster, tmp_path, models):
    """A wrong port (here an HTTP server; the new-user trial pointed at the S3 server) is not a Ray
    cluster: one line, exit 2, in seconds (Ray itself retried for over 10 minutes)."""
    import http.server
    import threading

    from mergestream.engine.executors import ray_cluster

    from .conftest import run_cli

    bpath, experts = models
    ray_cluster.check_reachable(ray.get_runtime_context().gcs_address, 5)  # a real cluster's GCS passes the probe
    srv = http.server.ThreadingHTTPServer((LOOPBACK, 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    addr = f"{LOOPBACK}:{srv.server_address[1]}"
    try:
        t0 = time.monotonic()
        r = run_cli("fold", "--base", str(bpath), "--expert", str(experts[0]), "--policy", "ties", "--state",
                    str(tmp_path / "s"), "--out", str(tmp_path / "o"), "--executor", "ray", "--ray-address", addr,
                    "-q", check=False, timeout=120)
        took = time.monotonic() - t0
    finally:
        srv.shutdown()
        srv.server_close()
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and addr in lines[0] and "not a Ray cluster" in lines[0], r.stderr
    assert took < 60 and not (tmp_path / "o").exists()


def test_a_remembered_dead_cluster_is_refused(tmp_path, monkeypatch):
    """`auto` reads the address Ray's pointer file remembers; a stale one (a cluster of an earlier
    session) is refused by name, not waited for."""
    from mergestream.engine.executors import ray_cluster

    pointer = tmp_path / "ray_current_cluster"
    addr = _dead_address()
    pointer.write_text(addr)
    assert ray_cluster.pointer_file().name == "ray_current_cluster"  # Ray's own location
    monkeypatch.setattr(ray_cluster, "pointer_file", lambda: pointer)
    assert ray_cluster.resolve_address("auto") == addr
    with pytest.raises(ray_cluster.ClusterUnreachableError, match=addr.replace(".", r"\.")):
        ray_cluster.check_reachable(addr, timeout=2)
    pointer.unlink()
    with pytest.raises(ray_cluster.ClusterUnreachableError, match="no Ray cluster was started"):
        ray_cluster.resolve_address("auto")
    monkeypatch.setenv("RAY_ADDRESS", addr)
    assert ray_cluster.resolve_address(None) == addr


@pytest.mark.parametrize(("policy", "params"), [("opcm", {"alpha": 0.5, "scope": "global"}),
                                                ("opcm", {"alpha": 0.5, **{"zero_diagonal": True, "rank": "above"}}),
                                                ("iso_c", {}), ("iso_cts", {}), ("iso_c", {"patch_budget": 0.3})],
                         ids=["opcm-global", "opcm-reference-projection", "iso_c", "iso_cts", "iso_c-patch-budget"])
def test_reference_modes_with_a_global_reduction_fold_the_same_on_ray(cluster, models, tmp_path, policy, params):
    """OPCM's whole-model rescale (scope=global): the tasks write the per-tensor state and return its
    partial sums, the driver finishes λ_t, and tasks write θ₀ + λ_t M_t — the driver opens no piece
    of the state (no tensor passes through it), and the bytes are the local fold's."""
    bpath, experts = models
    out_l, st_l = _chain(tmp_path, "local", bpath, experts, policy, params)
    got: dict = {}
    opened = opened_during(lambda: got.update(r=_chain(tmp_path, "ray", bpath, experts, policy, params,
                                                       executor=make_executor("ray", group_bytes=GROUP))))
    out_r, st_r = got["r"]
    assert _files(out_r) == _files(out_l)
    assert _state_bytes(st_r) == _state_bytes(st_l)
    assert not [p for p in opened if Path(p).name.startswith("part-")], "the driver read the state"
