"""`trainmesh plan` from the command line: the table and a run command that `trainmesh check` accepts as it is,
calibration of this machine and its reuse, and every bad input refused (exit 2) before anything is written."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from support import nano_config, nano_toml
from trainmesh.apps.plan.cluster import PRESETS, save_calibration
from trainmesh.cli import main
from trainmesh.recipes.gpt.model import GPT

pytestmark = pytest.mark.timeout(120)


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_table_and_its_run_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = str(nano_toml(tmp_path))
    report = tmp_path / "plan.json"
    code, out, err = _plan(
        capsys, "gpt", "--config", config, "--cluster", "h100", "--devices-per-node", "2", "--json", str(report)
    )
    assert code == 0, err
    assert "layout" in out and "ddp(2)" in out and "fsdp(2)" in out and "assumptions:" in out
    command = shlex.split(out.split("Recommended:")[1].splitlines()[1])
    assert command[:3] == ["trainmesh", "run", "gpt"] and "--nproc-per-node" in command
    rows = json.loads(report.read_text())["layouts"]
    assert rows[0]["fits"] and rows == sorted(rows, key=lambda r: not r["fits"])  # those that fit first
    fastest = min(r["step_s"] for r in rows if r["fits"])
    assert rows[0]["step_s"] <= fastest * 1.15  # the recommendation: within the model's error of the fastest
    assert {"pp(2)", "tp(2)", "ddp(2) +AC"} <= {r["name"] for r in rows}
    # the printed command launches as printed: `trainmesh check` resolves it, and predicts the same memory
    assert main(["check", *command[2:]]) == 0
    checked = capsys.readouterr().out
    assert "OK" in checked and "memory per rank, predicted" in checked
    predicted = rows[0]["memory_bytes"]  # the same layout and batch: the same bytes but for the cluster's overhead
    assert f"activations {predicted['activations'] / 2**20:.2f}," in checked
    assert f"params {predicted['params'] / 2**20:.2f}," in checked


def test_calibrate_then_plan_on_this_machine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    calibration = tmp_path / "cache" / "calibration.json"
    config = ["gpt", "--config", str(nano_toml(tmp_path)), "--calibration", str(calibration)]
    code, out, err = _plan(capsys, *config, "--cluster", "this")
    assert code == 2 and "trainmesh plan --calibrate" in err and not calibration.exists()
    code, out, err = _plan(capsys, *config, "--calibrate", "--cluster", "this", "--top", "3")
    assert code == 0, err
    saved = json.loads(calibration.read_text())
    assert saved["device"] == "cpu" and saved["peak_flops"]["fp32"] > 1e8
    # the optimizer step the bandwidth stands for (32 bytes per parameter) took between 1 µs and 10 s: this model's
    # step, however loaded the machine (the arithmetic to the byte: tests/unit/test_plan.py)
    params = sum(p.numel() for p in GPT(nano_config(tmp_path).model).parameters())
    assert 1e-6 < 32 * params / saved["mem_bandwidth"] < 10
    assert all(cost["bandwidth"] > 1e6 for cost in saved["intra"]["costs"].values())
    assert 0 < saved["forward_share"] < 1 and saved["busy_slowdown"] >= 1 and 0 <= saved["tp_unsplit"] <= 1
    assert "calibrated (" in out and "more (--top" in out
    code, out, err = _plan(capsys, *config, "--cluster", "this")  # reused, not re-measured
    assert code == 0 and "calibrated (" in out
    # another machine described in the same format, edited: 4 devices a node with a fifth of the memory
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**saved, "name": "other", "devices_per_node": 4, "memory": saved["memory"] / 5}))
    code, out, err = _plan(capsys, *config, "--cluster", str(other), "--nodes", "2")
    assert code == 0 and "cluster: other, 2 node(s) × 4 cpu device(s)" in out
    # a calibration file that is not one: refused with the fix, not a traceback
    for garbage in ("{not json", "[]", json.dumps({**saved, "efficiency": 0}), json.dumps({**saved, "intra": []})):
        calibration.write_text(garbage)
        code, out, err = _plan(capsys, *config, "--cluster", "this")
        assert code == 2 and "is not a calibration trainmesh can read" in err and "Traceback" not in err, garbage


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cluster", "tpu"], "--cluster='tpu' is not one of a100, h100, h200, this, nor a .json file"),
        (["--cluster", "/no/such/cluster.json"], "--cluster='/no/such/cluster.json': no such file"),
        (["--nodes", "0"], "--nodes=0 must be at least 1"),
        (["--devices-per-node", "-1"], "--devices-per-node=-1 must be at least 1"),
        (["--global-batch", "0"], "--global-batch=0 must be at least 1"),
        (["--top", "0"], "--top=0 must be at least 1"),
        (["--memory-margin", "1"], "--memory-margin=1.0: the fraction of device memory kept free, from 0 to below 1"),
        (["--nodes", "100000000"], "plan up to 1,000,000 ranks"),
        (["--json", "/no/such/folder/plan.json"], "the folder /no/such/folder does not exist"),
        (["--train.global_batch_tokens=1000"], "is not a whole number of sequences of 32 tokens"),
        (["--model.n_head=5"], "model.n_embd=32 must be divisible by model.n_head=5"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    report, calibration = tmp_path / "plan.json", tmp_path / "calibration.json"
    config = ["--config", str(nano_toml(tmp_path)), "--json", str(report)]
    for calibrate in ([], ["--calibrate", "--calibration", str(calibration)]):  # nothing is measured either
        code, _, err = _plan(capsys, "gpt", *config, *calibrate, *args)
        assert code == 2 and message in err, err
        assert not report.exists() and not calibration.exists()


def _negative_latency(data: dict[str, Any]) -> str:
    data["intra"]["costs"]["all_reduce"]["latency"] = -1.0
    return json.dumps(data)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (_negative_latency, "intra.costs.all_reduce.latency=-1.0 must be seconds >= 0"),
        (lambda data: json.dumps({**data, "devices_per_node": True}), "devices_per_node=true must be a whole number"),
        (lambda data: "[" * 100_000, "its JSON nests too deeply"),
    ],
    ids=["negative-latency", "boolean-count", "deep-nesting"],
)
def test_a_bad_cluster_file_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: Callable[[dict[str, Any]], str], message: str
) -> None:
    """Negative latencies once gave a step of −9,983 s, `devices_per_node: true` a `--nproc-per-node True`, 100,000
    '[' a RecursionError's traceback: each is refused, naming the file and the key, before anything is measured."""
    cluster, calibration = tmp_path / "cluster.json", tmp_path / "calibration.json"
    save_calibration(PRESETS["h100"], cluster)
    cluster.write_text(content(json.loads(cluster.read_text())))
    config = ["gpt", "--config", str(nano_toml(tmp_path)), "--cluster", str(cluster)]
    for calibrate in ([], ["--calibrate", "--calibration", str(calibration)]):
        code, out, err = _plan(capsys, *config, *calibrate)
        assert code == 2 and message in err and str(cluster) in err and "Fix:" in err, err
        assert len(err.strip().splitlines()) == 1 and not out and not calibration.exists(), err


def test_a_recipe_the_plan_does_not_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for args in (["resnet"], ["resnet", "--calibrate", "--calibration", str(tmp_path / "c.json")]):
        code, _, err = _plan(capsys, *args)
        assert code == 2 and "run.recipe='resnet' is not supported" in err
    assert not (tmp_path / "c.json").exists()


def test_several_nodes_get_a_rendezvous_in_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _plan(
        capsys, "gpt", "--config", str(nano_toml(tmp_path)), "--nodes", "2", "--parallel.strategy=ddp"
    )
    assert code == 0, err
    command = shlex.split(out.split("Recommended:")[1].splitlines()[1])
    assert command[command.index("--nnodes") + 1] == "2" and "--rdzv-endpoint" in command
    assert sum(o.startswith("--parallel.strategy=") for o in command) == 1  # the layout's, not also the user's


SEVEN_B_WIDE = (  # the 7B's width, context and vocabulary (benchmarks/plan_dryrun.py's); 8 of its 32 blocks
    *("--model.n_layer=8", "--model.n_head=32", "--model.n_embd=4096", "--model.vocab_size=32000"),
    *("--model.block_size=4096", "--train.precision=bf16-mixed", "--train.global_batch_tokens=0"),
)


def test_check_dry_run_of_a_7b_wide_job_at_64_ranks_allocates_nothing_of_its_size(tmp_path: Path) -> None:
    """The model's state alone is 26 GiB (the whole 7B's, 100 GiB, is in the table of docs/plan_dryrun.json); the
    dry run of its fsdp(64) job here stays in a few hundred MiB and agrees with the plan on every component."""
    flags = ["--nproc-per-node", "8", "--nnodes", "8", "--rdzv-endpoint", "10.0.0.1:29400", "--cluster", "h100"]
    layout = ["--parallel.strategy=fsdp", "--train.micro_batch=1", "--train.global_batch=128"]
    script = (
        "import resource, sys; from trainmesh.cli import main; code = main(sys.argv[1:]); "
        "print('maxrss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(code)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, "check", "gpt", *SEVEN_B_WIDE, *layout, *flags, "--dry-run"],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "dry run here (1 rank(s) of 64" in done.stdout
    assert "the plan agrees within 5% on every component and the peak" in done.stdout, done.stdout
    peak_line = next(line for line in done.stdout.splitlines() if line.strip().startswith("rank 0: peak"))
    assert "GiB" in peak_line  # GiB per rank of the real job...
    maxrss_gib = int(done.stdout.split("maxrss_kib")[1].split()[0]) / 2**20
    assert maxrss_gib < 2  # ...of which nothing is allocated here


def test_check_dry_run_builds_each_pipeline_stage(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "gpt", "--parallel.pp=2", "--nproc-per-node", "2", "--dry-run"])
    out, _ = capsys.readouterr()
    assert code == 0, out
    assert "dry run here (2 rank(s) of 2" in out
    assert "rank 0 (pipeline stage 0): peak" in out and "rank 1 (pipeline stage 1): peak" in out
