"""`trainmesh bench` end to end: real launches of the nano GPT at 1 and 2 processes, weak and strong, and a point
that fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from support import nano_toml
from trainmesh.core.env import free_port
from trainmesh.metrics.breakdown import PHASES

pytestmark = pytest.mark.slow

TRAINMESH = Path(sys.executable).parent / "trainmesh"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _bench(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    config = str(nano_toml(cwd))
    command = [str(TRAINMESH), "bench", "gpt", "--config", config, "--nprocs", "1,2", "--steps", "4", "--warmup", "2"]
    return subprocess.run(
        [*command, *args], cwd=cwd, env=env or ENV, capture_output=True, text=True, timeout=100, check=False
    )


@pytest.mark.timeout(120)
def test_weak_and_strong_scaling_at_one_and_two_processes(tmp_path: Path) -> None:
    result = _bench(tmp_path, "--mode", "both", "--run-id", "b")
    assert result.returncode == 0, result.stderr[-3000:]
    bench_dir = tmp_path / "runs" / "b"
    report = json.loads((bench_dir / "bench.json").read_text())
    points = {(p["mode"], p["processes"]): p for p in report["points"]}
    assert list(points) == [("weak", 1), ("weak", 2), ("strong", 1), ("strong", 2)]
    assert points["weak", 1]["run_dir"] == points["strong", 1]["run_dir"]  # the same job, run once
    assert sorted(p.name for p in bench_dir.iterdir() if p.is_dir()) == ["n1-gb4-mb4", "n2-gb4-mb2", "n2-gb8-mb4"]
    assert points["weak", 2]["global_batch"] == 2 * points["weak", 1]["global_batch"] == 8  # 4 per rank
    assert points["strong", 2]["global_batch"] == points["strong", 1]["global_batch"] == 4  # 2 per rank
    for (_, n), p in points.items():
        m = p["measured"]
        assert p["exit_code"] == 0 and m["steps"] == 4 and m["step_ms"] > 0, p
        assert m["throughput"] == pytest.approx(p["units_per_step"] * 1000 / m["step_ms"])
        assert p["ideal"] == n and p["efficiency"] == pytest.approx(p["speedup"] / n)
        assert set(m["phases_ms"]) == set(PHASES)
    assert points["weak", 1]["speedup"] == points["strong", 1]["speedup"] == 1.0
    weak, strong = points["weak", 2], points["strong", 2]
    assert weak["speedup"] == pytest.approx(
        weak["measured"]["throughput"] / points["weak", 1]["measured"]["throughput"]
    )
    assert strong["speedup"] == pytest.approx(
        points["strong", 1]["measured"]["step_ms"] / strong["measured"]["step_ms"]
    )
    assert report["machine"]["device"] == "cpu" and report["machine"]["threads_per_rank"] == 1
    assert report["machine"]["torch"] and report["config"]["model"]["size"] == "nano"

    # Each point is a run of exactly warm-up + timed steps, a record per step, no checkpoint.
    run = bench_dir / "n2-gb8-mb4"
    config = tomllib.loads((run / "config.toml").read_text())
    assert (config["train"]["max_steps"], config["run"]["log_every"], config["checkpoint"]["final"]) == (6, 1, False)
    assert config["run"]["out_dir"] == str(bench_dir) and config["run"]["id"] == run.name
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in steps if s] == [1, 2, 3, 4, 5, 6, 6]  # a val record at step 0 and at the end
    assert not (run / "checkpoints").exists()

    table = (bench_dir / "bench.md").read_text()
    assert "| 2 | weak | 8 |" in table and "| 2 | strong | 4 |" in table and "| 1 | strong | 4 |" in table
    assert f"| {weak['speedup']:.2f}× | {weak['efficiency']:.2f} |" in table
    assert (bench_dir / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 2 | weak | 8 |" in result.stderr and f"bench folder: {bench_dir} (bench.json" in result.stderr


@pytest.mark.timeout(120)
def test_a_failing_point_is_reported_and_the_bench_exits_nonzero(tmp_path: Path) -> None:
    """Rank 1 exists only in the 2-process point: it fails there, the 1-process point is still measured."""
    result = _bench(tmp_path, "--run-id", "f", env={**ENV, "TRAINMESH_FAULT": "rank=1,step=2,kind=exit"})
    assert result.returncode == 1, result.stderr[-3000:]
    bench_dir = tmp_path / "runs" / "f"
    assert (
        f"weak scaling, 2 process(es): failed with exit code 1; run folder {bench_dir / 'n2-gb8-mb4'}" in result.stderr
    )
    one, two = json.loads((bench_dir / "bench.json").read_text())["points"]
    assert one["speedup"] == 1.0 and (two["exit_code"], two["measured"], two["speedup"]) == (1, None, None)
    assert "| 2 | weak | 8 | failed (exit code 1) |" in (bench_dir / "bench.md").read_text()


@pytest.mark.timeout(120)
def test_two_simulated_nodes_share_one_bench_folder(tmp_path: Path) -> None:
    """Two launchers (--nnodes 2, c10d on loopback) run each point together; the one holding the folder reports."""
    flags = ["--nprocs", "1", "--mode", "both", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    config = str(nano_toml(tmp_path))
    command = [str(TRAINMESH), "bench", "gpt", "--config", config, "--steps", "3", "--warmup", "1", *flags]
    nodes = [subprocess.Popen(command, cwd=tmp_path, env=ENV, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    logs = [node.communicate(timeout=100)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(log[-2000:] for log in logs)
    (bench_dir,) = (tmp_path / "runs").iterdir()
    assert sum("writes the report" in log for log in logs) == 1
    points = json.loads((bench_dir / "bench.json").read_text())["points"]
    assert [(p["mode"], p["processes"], p["speedup"]) for p in points] == [("weak", 2, 1.0), ("strong", 2, 1.0)]
