"""The real command line, end to end: `trainmesh run` (recipe and script), plain `python -m trainmesh`,
plain torchrun, SLURM-style environment, two simulated nodes, and errors before launch."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from array import array
from pathlib import Path

import pytest

from support import assert_config_recorded, nano_toml, rank_output, train_rank
from trainmesh.checkpoint import list_checkpoints
from trainmesh.cli import main
from trainmesh.core.env import free_port
from trainmesh.testing import run_distributed

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run(
    *args: str, cwd: Path, timeout: float = 180, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=env or ENV, capture_output=True, text=True, timeout=timeout, check=False)


def _trainmesh(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return _run(str(BIN / "trainmesh"), *args, cwd=cwd)


def _run_gpt(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`trainmesh run gpt` on the nano config with 2 processes; `args` add launch flags and overrides."""
    return _trainmesh(cwd, "run", "gpt", "--config", str(nano_toml(cwd)), "--nproc-per-node", "2", *args)


def _run_together(commands: list[list[str]], envs: list[dict[str, str]], cwd: Path) -> list[str]:
    """Start the commands at once (like nodes or srun tasks), wait for all; asserts each exits 0."""
    procs = [
        subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for cmd, env in zip(commands, envs, strict=True)
    ]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), "\n".join(e[-2000:] for e in errors)
    return errors


def _records(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_complete_run(run_dir: Path, steps: int) -> None:
    assert assert_config_recorded(run_dir) >= 1  # config.toml is what every checkpoint records
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "loss.png").stat().st_size > 1000
    assert list((run_dir / "checkpoints").glob("step_*/.metadata"))
    records = _records(run_dir)
    val = [r["val_loss"] for r in records if r["kind"] == "val"]
    assert val[-1] < val[0] - 0.5, f"validation loss did not go down: {val}"
    train = [r for r in records if r["kind"] == "train"]  # nano logs every step
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert train[-1]["loss"] < train[0]["loss"] - 0.5, [r["loss"] for r in train]


def test_trainmesh_run_gpt_on_two_processes(tmp_path: Path) -> None:
    overrides = ["--train.max_steps=40", "--checkpoint.final=true", "--sample.max_new_tokens=20"]
    result = _run_gpt(tmp_path, "--run-id", "two", "--", *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_complete_run(tmp_path / "runs" / "two", 40)
    assert "sample from the trained model" in result.stderr and "done: 40 steps" in result.stderr


def test_plain_python_single_process(tmp_path: Path) -> None:
    config = nano_toml(tmp_path)
    overrides = ["--train.max_steps=40", "--checkpoint.final=true", "--run.id=single"]
    result = _run(sys.executable, "-m", "trainmesh", "gpt", "--config", str(config), *overrides, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_complete_run(tmp_path / "runs" / "single", 40)
    assert "1 data-parallel rank" in result.stderr


def test_plain_torchrun_module(tmp_path: Path) -> None:
    config = nano_toml(tmp_path)
    result = _run(
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        "-m",
        "trainmesh",
        "gpt",
        "--config",
        str(config),
        "--train.max_steps=4",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()  # rank 0 named it and told rank 1
    assert "2 data-parallel rank" in result.stderr and (run_dir / "metrics.jsonl").is_file()


def test_slurm_environment(tmp_path: Path) -> None:
    """Two processes started the way `srun` starts them: SLURM variables only, no torchrun."""
    config = nano_toml(tmp_path)
    slurm = {
        "SLURM_NTASKS": "2",
        "SLURM_TASKS_PER_NODE": "2",
        "SLURM_JOB_NODELIST": "127.0.0.1",
        "SLURM_JOB_ID": "77",
        "MASTER_PORT": str(free_port()),
    }
    task = [sys.executable, "-m", "trainmesh", "gpt", "--config", str(config), "--train.max_steps=4", "--run.id=s"]
    envs = [{**ENV, **slurm, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)} for r in range(2)]
    errors = _run_together([task, task], envs, tmp_path)
    assert "2 data-parallel rank" in errors[0]


def test_two_simulated_nodes_match_one_node(tmp_path: Path) -> None:
    """Two launcher agents (--nnodes 2, c10d rendezvous on loopback) train exactly like one node of 2."""
    config = nano_toml(tmp_path)
    common = ["--config", str(config), "--", "--train.max_steps=6"]
    run_distributed(train_rank, 2, args=(str(tmp_path), ["--train.max_steps=6", "--run.id=one"]))  # one node
    endpoint = f"127.0.0.1:{free_port()}"
    node_args = ["run", "gpt", "--nproc-per-node", "1", "--nnodes", "2", "--rdzv-endpoint", endpoint, "--rdzv-id", "t2"]
    agent = [str(BIN / "trainmesh"), *node_args, "--run-id", "two", *common]
    _run_together([agent, agent], [ENV, ENV], tmp_path)
    losses = [[r.get("loss", r.get("val_loss")) for r in _records(tmp_path / "runs" / n)] for n in ("one", "two")]
    assert losses[0] == losses[1]
    # Each node keeps its own ranks' logs, in a folder of its own (named by its host: here the same, then -2).
    nodes = sorted((tmp_path / "runs" / "two" / "logs").iterdir())
    assert len(nodes) == 2 and all(f"-{socket.gethostname()}" in node.name for node in nodes)
    ranks = sorted(sorted({p.name for p in node.glob("attempt_*/rank_*")}) for node in nodes)  # one rank a node
    assert ranks == [["rank_0"], ["rank_1"]], ranks


def test_script_mode_runs_any_torchrun_script(tmp_path: Path) -> None:
    result = _trainmesh(tmp_path, "run", str(ROOT / "examples" / "custom_loop.py"), "--epochs", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0/2 on cpu, strategy ddp" in result.stderr and "epoch 1: mean loss" in result.stderr


def test_config_errors_stop_before_any_process_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    gpt = ["run", "gpt", "--config", str(nano_toml(tmp_path)), "--nproc-per-node", "2", "--"]
    assert main([*gpt, "--train.global_batch=10"]) == 2
    err = capsys.readouterr().err
    assert "10 / 8 = 1.25 is not a whole number of accumulation steps" in err
    assert "torchrun" not in err and not (tmp_path / "runs").exists()
    assert main([*gpt, "--optim.lrr=1"]) == 2 and "Did you mean 'optim.lr'" in capsys.readouterr().err


def test_a_rank_that_fails_on_bad_input_says_what_to_fix_without_a_traceback(tmp_path: Path) -> None:
    """Shards whose headers read (so the launcher's check lets them through) hold ids beyond the vocabulary,
    which only the ranks' whole read finds."""
    shards = tmp_path / "shards"
    shards.mkdir()
    for name in ("train.bin", "val.bin"):  # raw uint16 (nanoGPT's layout), ids up to 999
        (shards / name).write_bytes(array("H", [*range(256)] * 8 + [999]).tobytes())
    vocab = "--model.vocab_size=256"
    result = _run_gpt(tmp_path, "--run-id", "bad-data", "--", f"--data.source={shards}", vocab)
    assert result.returncode == 2
    said = r"\[rank{}\] ERROR token shard [^ ]*shards/train.bin holds token id 999, outside the model's vocabulary"
    assert re.search(said.format(0), result.stderr), result.stderr[-3000:]
    # Rank 1 learns it from rank 0, which prepares the data, and says it too: in its log file (the console shows
    # local rank 0; the launcher shows the end of a failed rank's file when that rank failed first).
    assert re.search(said.format(1), rank_output(tmp_path / "runs" / "bad-data" / "logs", 1))
    assert "Fix: --model.vocab_size=1000 or more" in result.stderr and "Traceback" not in result.stderr
    assert re.search(r"rank \d failed first: exit code 2: a problem with the config, the inputs", result.stderr)


def test_env_and_check_commands(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RANK", "3")  # a variable to report
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "gloo  yes" in out and "RANK=3" in out
    gpt2 = str(ROOT / "configs" / "gpt2-124m.toml")
    elastic = ["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:29400"]
    assert main(["check", "gpt", "--config", gpt2, "--nproc-per-node", "8", *elastic]) == 0
    out = capsys.readouterr().out
    assert "world size 8: OK" in out and "world size 16: OK" in out


@pytest.mark.timeout(360)  # a cold inductor compile: 40 s alone, up to 120 s beside two other workers
def test_torch_compile_trains_samples_and_saves_plain_keys(tmp_path: Path) -> None:
    config = nano_toml(tmp_path)
    overrides = ["--train.max_steps=3", "--train.compile=true", "--checkpoint.final=true", "--run.id=c"]
    result = _run(
        sys.executable,
        "-m",
        "trainmesh",
        "gpt",
        "--config",
        str(config),
        *overrides,
        "--sample.max_new_tokens=10",
        cwd=tmp_path,
        timeout=300,
        env={**ENV, "TORCH_LOGS": "recompiles"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sample from the trained model" in result.stderr
    # two graphs, evaluation's (no grad) and training's; the sample runs eagerly (compiling its shapes costs more)
    assert result.stderr.count("Recompiling function") == 1, result.stderr[-3000:]
    from torch.distributed.checkpoint import FileSystemReader

    (checkpoint,) = list_checkpoints(tmp_path / "runs" / "c")
    keys = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    assert "model.wte.weight" in keys and not any("_orig_mod" in k for k in keys)


def test_fsdp_gradient_mode_auto_is_decided_at_launch_said_and_recorded(tmp_path: Path) -> None:
    """parallel.fsdp.reduce_every_microstep unset (auto) with accumulation: `trainmesh run` decides it from the plan
    on this machine (the nano model's whole gradients fit), says so, and config.toml records the decision."""
    overrides = ["--parallel.strategy=fsdp", "--train.micro_batch=2", "--train.global_batch=8", "--train.max_steps=2"]
    result = _run_gpt(tmp_path, "--run-id", "auto", "--", *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parallel.fsdp.reduce_every_microstep=auto: false — whole gradients" in result.stderr
    recorded = (tmp_path / "runs" / "auto" / "config.toml").read_text()
    assert "reduce_every_microstep = false" in recorded
