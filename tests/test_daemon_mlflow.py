"""The daemon against a real MLflow tracking server: experts come from the model registry in
numeric version order, every fold is a run, every accepted version is registered with the alias
on the newest."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import save_file

from .conftest import run_cli
from .mlflow_server import mlflow_server  # noqa: F401  (fixture)
from .test_daemon import Daemon, scaled_expert, tiny_base


@pytest.mark.slow
def test_registry_versions_fold_in_numeric_order_with_runs_and_alias(tmp_path, mlflow_server, monkeypatch):  # noqa: F811
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    client = MlflowClient(tracking_uri=mlflow_server.uri, registry_uri=mlflow_server.uri)
    exp = client.create_experiment("expert-training")
    run = client.create_run(exp)
    client.create_registered_model("experts")
    base = tiny_base()
    for i in range(1, 11):
        f = tmp_path / "train" / f"v{i}" / "model.safetensors"
        f.parent.mkdir(parents=True)
        save_file(scaled_expert(base, 100 + i), str(f))
        client.log_artifact(run.info.run_id, str(f.parent), f"expert-{i}")
        client.create_model_version("experts", source=f"runs:/{run.info.run_id}/expert-{i}/v{i}",
                                    run_id=run.info.run_id)
    client.set_terminated(run.info.run_id)

    d = Daemon(tmp_path, extra={"mlflow": {"tracking_uri": mlflow_server.uri, "registered_model": "backbone",
                                           "alias": "champion",
                                           "registry": {"enabled": True, "models": ["experts"],
                                                        "interval_seconds": 1}}},
               env={"MLFLOW_DISABLE_TELEMETRY": "true"})
    d.start()
    try:
        d.wait(lambda: d.status()["current_version"] == 10, 240, "the ten registry versions were not all folded")
        hist = json.loads(run_cli("history", "--config", d.config, "--json").stdout)
        assert [h["expert_id"] for h in hist] == [f"experts-v{i}" for i in range(1, 11)]  # 9 before 10
        assert all(h["decision"] == "accepted" for h in hist)
        d.wait(lambda: d.status()["tracking_pending"] == 0, 60, "tracking calls still pending")
        runs = client.search_runs([client.get_experiment_by_name("mergestream").experiment_id], max_results=100)
        assert len(runs) == 10
        assert {r.data.tags["mergestream.expert"] for r in runs} == {f"experts-v{i}" for i in range(1, 11)}
        assert all("step_drift" in r.data.metrics for r in runs)
        versions = client.search_model_versions("name='backbone'")
        assert len(versions) == 10
        champion = client.get_model_version_by_alias("backbone", "champion")
        assert champion.tags["mergestream.version"] == "10"
        # an operator rollback moves the alias back
        run_cli("rollback", "--config", d.config, "--to", "7")
        d.wait(lambda: client.get_model_version_by_alias("backbone", "champion").tags["mergestream.version"] == "7",
               30, "alias did not follow the rollback")
        cursor = d.status()
        assert cursor["current_version"] == 7
    finally:
        d.stop()
