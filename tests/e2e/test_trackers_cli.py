"""Experiment trackers through the real command line: `trainmesh run` with MLflow on a file store (offline), and
a tracker whose package is missing refused before launch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import nano_toml
from trainmesh.cli import main
from trainmesh.metrics import trackers as trackers_module
from trainmesh.metrics.trackers import RUN_ID_TAG, read_ids

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


def _trainmesh(cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [str(BIN / "trainmesh"), "run", "gpt", "--config", str(nano_toml(cwd)), "--nproc-per-node", "2", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=180, check=False)


def test_a_run_and_its_resume_log_into_one_mlflow_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    store = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store for opt-in use only
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sinks = ['--log.sinks=["tensorboard","mlflow"]', f"--log.mlflow_tracking_uri={store}", '--log.tags=["e2e"]']
    first = _trainmesh(tmp_path, env, "--run-id", "tracked", "--", *sinks, "--checkpoint.final=true")
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "runs" / "tracked"
    run_id = read_ids(run_dir)["mlflow"]
    client = MlflowClient(store)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked" and run.data.tags[RUN_ID_TAG] == "tracked"
    assert client.get_experiment(run.info.experiment_id).name == "trainmesh" and "e2e" in run.data.tags
    params = run.data.params  # the resolved config, as config.toml holds it
    assert params["train.max_steps"] == "4" and params["model.n_layer"] == "2" and params["run.id"] == "tracked"
    assert params["log.sinks"] == '["tensorboard", "mlflow"]'

    def steps(key: str) -> list[int]:
        return [m.step for m in client.get_metric_history(run_id, key)]

    assert steps("train/loss") == [1, 2, 3, 4] and steps("val/val_loss") == [0, 4]
    assert {"train/tokens_per_s", "train/grad_norm", "train/lr"} <= set(run.data.metrics)
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))  # the other sink of the list

    resumed = _trainmesh(tmp_path, env, "--run-id", "tracked", "--resume", "--", *sinks, "--train.max_steps=6")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read_ids(run_dir)["mlflow"] == run_id and len(client.search_runs([run.info.experiment_id])) == 1
    assert steps("train/loss") == [1, 2, 3, 4, 5, 6] and client.get_run(run_id).info.status == "FINISHED"
    assert client.get_run(run_id).data.params["train.max_steps"] == "4"  # MLflow keeps a parameter's first value


def test_a_run_that_fails_marks_its_tracker_run_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    store = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINMESH_FAULT": "rank=1,step=2,kind=exception"}
    result = _trainmesh(
        tmp_path, env, "--run-id", "fails", "--", "--log.sinks=mlflow", f"--log.mlflow_tracking_uri={store}"
    )
    assert result.returncode == 1, result.stderr[-3000:]
    run_id = read_ids(tmp_path / "runs" / "fails")["mlflow"]
    client = MlflowClient(store)
    assert client.get_run(run_id).info.status == "FAILED"  # rank 0 failed too (its peer was gone): records kept
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [1]


def test_a_missing_tracker_package_stops_the_launch_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    real = trackers_module.importlib.util.find_spec
    monkeypatch.setattr(trackers_module.importlib.util, "find_spec", lambda n: None if n == "wandb" else real(n))
    for command in ("check", "run"):
        args = [command, "gpt", "--config", str(nano_toml(tmp_path)), "--nproc-per-node", "2", "--log.sinks=wandb"]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "the wandb package is not installed" in err and "pip install 'trainmesh[wandb]'" in err, err
    assert not (tmp_path / "runs").exists()  # nothing was started or written
