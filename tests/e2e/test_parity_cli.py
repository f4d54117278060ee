"""`trainmesh check --parity` end to end on the nano GPT: 2 processes train like 1, and ddp like fsdp (each a
real launch of A, B and B again through torchrun)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import nano_toml

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _parity(cwd: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, object]]:
    command = [str(BIN / "trainmesh"), "check", "gpt", "--config", str(nano_toml(cwd)), "--parity", *args]
    result = subprocess.run(command, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=140, check=False)
    folders = list((cwd / "runs").glob("gpt-parity-*"))
    assert len(folders) == 1, result.stderr[-3000:]
    assert sorted(p.name for p in folders[0].iterdir() if p.is_dir()) == ["candidate", "candidate-again", "reference"]
    return result, json.loads((folders[0] / "parity.json").read_text())


def test_two_processes_train_like_one(tmp_path: Path) -> None:
    result, report = _parity(tmp_path, "--nproc-per-node", "2", "--parity-steps", "3")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "EQUAL within tolerance" in result.stdout
    assert "A (1 process): 1 process(es), single" in result.stdout
    assert "B (2 processes): 2 process(es), ddp" in result.stdout
    assert report["equal"] is True and len(report["steps"]) == 4  # type: ignore[arg-type]
    assert report["execution_order"][:2] == ["wte.weight", "wpe.weight"]  # type: ignore[index]
    assert report["widest_spread"]["spread"] > 0  # type: ignore[index]  # B again ran with its noise


def test_ddp_and_fsdp_agree(tmp_path: Path) -> None:
    sides = ["--parity-a=parallel.strategy=ddp", "--parity-b", "parallel.strategy=fsdp"]
    result, report = _parity(tmp_path, "--nproc-per-node", "2", "--parity-steps", "3", *sides)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "B (--parallel.strategy=fsdp): 2 process(es), fsdp" in result.stdout
    assert report["equal"] is True
