"""A Horovod script changed only in its import (examples/horovod_mnist_style.py) trains under the real CLI with 2
processes exactly as the same script written for plain PyTorch DDP (tests/e2e/scripts/ddp_mnist_style.py):
the final weights are bit-identical. `trainmesh horovodrun -np 2 -H localhost:2 python script` launches it the
same way as `trainmesh run --nproc-per-node 2 script`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
TRAINMESH = Path(sys.executable).parent / "trainmesh"
EXAMPLE = ROOT / "examples" / "horovod_mnist_style.py"
DDP = ROOT / "tests" / "e2e" / "scripts" / "ddp_mnist_style.py"
# 8 steps per epoch and rank, 2 epochs, test metrics averaged after each epoch
ARGS = ["--epochs", "2", "--batch-size", "32", "--train-samples", "512", "--test-samples", "128", "--log-interval", "4"]
# this checkout's trainmesh in the launcher and every worker (not an installed one)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT / "src")}


def _trainmesh(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(TRAINMESH), *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=150, check=False
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def _test_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("Test set:")]


def test_a_horovod_script_trains_like_ddp_and_horovodrun_launches_it(tmp_path: Path) -> None:
    hvd = _trainmesh(tmp_path, "run", "--nproc-per-node", "2", str(EXAMPLE), *ARGS, "--save-model", "hvd.pt")
    ddp = _trainmesh(tmp_path, "run", "--nproc-per-node", "2", str(DDP), *ARGS, "--save-model", "ddp.pt")
    hvdrun = _trainmesh(
        tmp_path, "horovodrun", "-np", "2", "-H", "localhost:2", "python", str(EXAMPLE), *ARGS, "--save-model", "run.pt"
    )
    assert "--nproc-per-node=2" in hvdrun.stderr  # the torchrun command trainmesh run would have used
    weights = {name: torch.load(tmp_path / f"{name}.pt", weights_only=True) for name in ("hvd", "ddp", "run")}
    assert list(weights["hvd"]) == list(weights["ddp"]) and len(weights["hvd"]) == 8
    for key, value in weights["hvd"].items():  # Average = (g0 + g1) / 2 = DDP's g0 / 2 + g1 / 2 in fp32
        assert torch.equal(value, weights["ddp"][key]), (key, (value - weights["ddp"][key]).abs().max())
        assert torch.equal(value, weights["run"][key]), key
    lines = _test_lines(hvd.stdout)  # the metrics hvd.allreduce averaged, as DDP's all_reduce did
    assert len(lines) == 2 and lines == _test_lines(ddp.stdout) == _test_lines(hvdrun.stdout)
    assert hvd.stdout.count("Train Epoch:") == 4  # rank 0 only, batches 0 and 4 of each epoch
