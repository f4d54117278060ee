"""Started by an MPI launcher: `mpirun -np 2 python -m trainmesh gpt ...` forms one job of 2 ranks.

The first test fakes nothing but the launcher: two plain processes get exactly the variables Open MPI 4.1's
mpirun gives its ranks (recorded from `mpirun -np 2 env`), so it runs wherever the suite runs. The second
runs the real `mpirun` and is skipped where Open MPI is not installed (`apt-get install openmpi-bin`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support import nano_toml
from trainmesh.core.env import free_port

pytestmark = pytest.mark.slow

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
OVERRIDES = ["--train.max_steps=4", "--run.id=mpi"]


def _open_mpi_rank(rank: int, size: int) -> dict[str, str]:
    """What Open MPI 4.1's mpirun sets for rank `rank` of `size`, all on one node (PMIX_RANK too: ignored)."""
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(size),
        "OMPI_COMM_WORLD_NODE_RANK": str(rank),
        "PMIX_RANK": str(rank),
    }


def _assert_one_job(run_dir: Path, rank0_log: str) -> None:
    assert "2 data-parallel rank" in rank0_log, rank0_log[-3000:]
    assert "done: 4 steps" in rank0_log
    assert (run_dir / "metrics.jsonl").is_file() and len(list(run_dir.parent.iterdir())) == 1


def test_ranks_with_open_mpi_variables_form_one_job(tmp_path: Path) -> None:
    task = [sys.executable, "-m", "trainmesh", "gpt", "--config", str(nano_toml(tmp_path)), *OVERRIDES]
    port = {"MASTER_PORT": str(free_port())}  # all ranks on this node: the master is 127.0.0.1
    procs = [
        subprocess.Popen(
            task,
            cwd=tmp_path,
            env={**ENV, **port, **_open_mpi_rank(rank, 2)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    logs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-2000:] for log in logs)
    _assert_one_job(tmp_path / "runs" / "mpi", logs[0])
    assert "INFO" not in logs[1]  # rank 1 knows it is rank 1: only rank 0 logs progress


def test_ranks_started_by_a_real_mpirun_form_one_job(tmp_path: Path) -> None:
    mpirun = shutil.which("mpirun")
    if mpirun is None or "Open MPI" not in subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout:
        pytest.skip("needs Open MPI's mpirun (apt-get install openmpi-bin)")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []  # Open MPI refuses root without it
    command = [mpirun, *root, "--oversubscribe", "-np", "2", "-x", f"MASTER_PORT={free_port()}"]
    command += [sys.executable, "-m", "trainmesh", "gpt", "--config", str(nano_toml(tmp_path)), *OVERRIDES]
    result = subprocess.run(command, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_one_job(tmp_path / "runs" / "mpi", result.stderr)
