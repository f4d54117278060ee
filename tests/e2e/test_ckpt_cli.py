"""`trainmesh ckpt verify|inspect` on real checkpoints: verification gates reading, damage is reported."""

from __future__ import annotations

from pathlib import Path

import pytest

from support import train_rank
from trainmesh.cli import main
from trainmesh.testing import run_distributed

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    overrides = ["--train.max_steps=2", "--checkpoint.every=1", "--checkpoint.final=true", "--run.name=r"]
    run_distributed(train_rank, 1, args=(str(root), overrides))
    return root / "runs" / "r"


def test_verify_and_inspect_a_healthy_run(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ckpt", "verify", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "OK      " in out and "step_00000001" in out and "step_00000002" in out
    assert main(["ckpt", "inspect", str(run_dir / "checkpoints" / "step_00000002")]) == 0
    out = capsys.readouterr().out
    assert "step 2, 8 samples seen, saved by 1 rank(s)" in out
    assert "wte.weight" in out and "(256, 32)" in out and "torch.float32" in out


def test_damage_is_reported_and_blocks_inspection(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = run_dir / "checkpoints" / "step_00000001"
    shard = next(ckpt.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["ckpt", "verify", str(run_dir)]) == 1
    out = capsys.readouterr().out
    assert f"INVALID {ckpt}" in out and "sha256" in out and "OK      " in out  # step 2 is still fine
    assert main(["ckpt", "inspect", str(ckpt)]) == 1
    assert main(["ckpt", "verify", str(run_dir / "nope")]) == 1
