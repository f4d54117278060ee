"""The pods of `trainmesh k8s`'s manifests, as two processes on this machine: each gets the container command and
config of the generated manifest and the environment its operator gives a pod, with only the host names changed to
loopback, and the two form one job.

- PyTorchJob (training-operator's pkg/controller.v1/pytorch/elastic.go, for an elasticPolicy without a Master):
  PET_RDZV_ENDPOINT (<name>-worker-0:<pytorchjob-port>), PET_RDZV_BACKEND, PET_NNODES (min:max),
  PET_MAX_RESTARTS; no RANK or WORLD_SIZE (envvar.go sets those only with a Master replica).
- JobSet: the PET_ variables the manifest itself sets, the node rank being the pod's completion index.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from support import nano_toml
from trainmesh.cli import main
from trainmesh.core.env import free_port

pytestmark = pytest.mark.slow


def _generate(tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str) -> tuple[list[str], list[dict[str, Any]]]:
    """The container's command (its config file written here) and env of the manifest for 2 nodes of 1 GPU."""
    flags = ["--config", str(nano_toml(tmp_path)), "--nodes", "2", "--gpus-per-node", "1", "--image", "tm:test"]
    assert main(["k8s", "gpt", *flags, "--kind", kind, "--name", "tm", "--", "--train.max_steps=4"]) == 0
    config_map, trainer = yaml.safe_load_all(capsys.readouterr().out)
    (tmp_path / "config.toml").write_text(config_map["data"]["config.toml"])  # the ConfigMap's mount
    if kind == "pytorchjob":
        pod = trainer["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    else:
        pod = trainer["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    command = [str(tmp_path / "config.toml") if a == "/etc/trainmesh/config.toml" else a for a in container["command"]]
    assert command[0] == "trainmesh"
    return [sys.executable, "-m", "trainmesh.cli", *command[1:]], container.get("env", [])


def _pods(command: list[str], envs: list[dict[str, str]], cwd: Path) -> list[str]:
    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "0"}  # the operator sets PYTHONUNBUFFERED
    procs = [
        subprocess.Popen(
            command, cwd=cwd, env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for env in envs
    ]
    logs = [p.communicate(timeout=150)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-2500:] for log in logs)
    return logs


def _assert_one_job(tmp_path: Path, logs: list[str]) -> None:
    both = "\n".join(logs)
    assert "2 data-parallel rank" in both and "done: 4 steps" in both, both[-3000:]
    assert (tmp_path / "runs" / "tm" / "metrics.jsonl").is_file()  # the run id is the job's name


def test_pytorchjob_pods_form_one_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    command, env = _generate(tmp_path, capsys, "pytorchjob")
    assert env == []  # everything comes from the operator
    operator = {  # elastic.go for minReplicas = maxReplicas = 2, maxRestarts 3
        "PET_RDZV_ENDPOINT": f"127.0.0.1:{free_port()}",  # tm-worker-0:23456 in the cluster
        "PET_RDZV_BACKEND": "c10d",
        "PET_NNODES": "2:2",
        "PET_MAX_RESTARTS": "3",
        "PYTHONUNBUFFERED": "0",
    }
    _assert_one_job(tmp_path, _pods(command, [operator, operator], tmp_path))


def test_jobset_pods_form_one_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    command, env = _generate(tmp_path, capsys, "jobset")
    port = str(free_port())
    pods = []
    for index in range(2):
        pod = {}
        for item in env:
            value = item.get("value")
            if item["name"] == "PET_NODE_RANK":  # the downward API: the pod's completion index
                value = str(index)
            elif item["name"] == "PET_MASTER_ADDR":
                assert value == "tm-node-0-0.tm"  # the first pod, in the JobSet's headless service
                value = "127.0.0.1"
            elif item["name"] == "PET_MASTER_PORT":
                value = port
            pod[item["name"]] = str(value)
        pods.append(pod)
    _assert_one_job(tmp_path, _pods(command, pods, tmp_path))
