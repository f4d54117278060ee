"""The sbatch script of `trainmesh slurm`, run by bash as SLURM would run it, on this machine: a fake `srun` starts
its tasks as srun does (SLURM_PROCID/SLURM_LOCALID/SLURM_NODEID for each, on 2 simulated nodes) and, like
`--signal=TERM@S` near the time limit, sends SIGTERM to every task mid-training; a fake `scontrol` records the
requeue. The requeued attempt (same job id) continues from the checkpoint and finishes. Both ways of starting the
ranks: one `trainmesh run` per node, and one worker per GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import nano_toml
from trainmesh.cli import main
from trainmesh.core.env import free_port

pytestmark = pytest.mark.slow

FAKE_SRUN = """#!{python}
# srun as far as the script needs it: start each task with SLURM's per-task variables, in a process group of its own,
# optionally SIGTERM every group once the run has logged some steps (what --signal=TERM@S does), exit with the
# highest exit code of the tasks.
import os, signal, subprocess, sys, time
from pathlib import Path

args = sys.argv[1:]
options = {{}}
while args[0].startswith("--"):
    key, _, value = args.pop(0).partition("=")
    options[key] = value
with open(os.environ["FAKE_LOG"], "a") as log:
    print("srun", *sys.argv[1:], file=log)
nodes = int(os.environ["SLURM_NNODES"])
per_node = int(options.get("--ntasks-per-node", os.environ["SLURM_NTASKS_PER_NODE"]))
tasks = []
for node in range(nodes):
    for local in range(per_node):
        env = {{
            **os.environ,
            "SLURM_PROCID": str(node * per_node + local),
            "SLURM_LOCALID": str(local),
            "SLURM_NODEID": str(node),
            "SLURM_NTASKS": str(nodes * per_node),
            "SLURM_TASKS_PER_NODE": f"{{per_node}}(x{{nodes}})",
        }}
        tasks.append(subprocess.Popen(args, env=env, start_new_session=True))  # slurmstepd: a group per task
if os.environ.get("FAKE_TERM_AFTER"):
    metrics, lines = os.environ["FAKE_TERM_AFTER"].rsplit(":", 1)
    path, deadline = Path(metrics), time.monotonic() + 120

    def logged() -> int:
        return len(path.read_text().splitlines()) if path.is_file() else 0

    while time.monotonic() < deadline and all(t.poll() is None for t in tasks) and logged() < int(lines):
        time.sleep(0.1)
    for task in tasks:  # as slurmstepd signals a task: its whole process group (DataLoader workers included)
        os.killpg(task.pid, signal.SIGTERM)
codes = [task.wait() for task in tasks]
sys.exit(max(code if code >= 0 else 128 - code for code in codes))
"""
FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$FAKE_LOG"
if [ "$1" = show ]; then echo 127.0.0.1; echo 127.0.0.1; fi
"""


def _fake_slurm(root: Path) -> Path:
    fake_bin = root / "bin"
    fake_bin.mkdir()
    for name, text in (("srun", FAKE_SRUN.format(python=sys.executable)), ("scontrol", FAKE_SCONTROL)):
        (fake_bin / name).write_text(text)
        (fake_bin / name).chmod(0o755)
    return fake_bin


def _sbatch_cpus_per_task(script: Path) -> str:
    (line,) = [line for line in script.read_text().splitlines() if line.startswith("#SBATCH --cpus-per-task=")]
    return line.partition("=")[2]


def _attempt(script: Path, root: Path, restart: int, term_after: str, mode_env: dict[str, str]) -> tuple[int, str]:
    env = {
        **os.environ,
        **mode_env,
        "OMP_NUM_THREADS": "1",
        "PATH": f"{root / 'bin'}:{os.environ['PATH']}",
        "FAKE_LOG": str(root / "calls.log"),
        "FAKE_TERM_AFTER": term_after,
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "127.0.0.1",
        "SLURM_NNODES": "2",
        "SLURM_CPUS_PER_TASK": _sbatch_cpus_per_task(script),  # as sbatch sets it from the script
        "SLURM_RESTART_COUNT": str(restart),
        "MASTER_PORT": str(free_port()),
    }
    done = subprocess.run(["bash", str(script)], cwd=root, env=env, capture_output=True, text=True, timeout=240)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("one_task_per_gpu", [False, True], ids=["task-per-node", "task-per-gpu"])
def test_stopped_at_the_time_limit_requeued_and_continued(
    one_task_per_gpu: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = ["--train.max_steps=60", "--checkpoint.every=0", f"--run.out_dir={tmp_path / 'runs'}"]
    overrides += ["--data.num_workers=1"]  # processes in each task's group, which the signal reaches too
    mode = ["--one-task-per-gpu"] if one_task_per_gpu else []
    flags = ["--nodes", "2", "--gpus-per-node", "1", *mode, "--config", str(nano_toml(tmp_path)), "--", *overrides]
    assert main(["slurm", "gpt", *flags]) == 0
    script = tmp_path / "job.sbatch"
    script.write_text(capsys.readouterr().out)
    _fake_slurm(tmp_path)
    mode_env = {"SLURM_NTASKS_PER_NODE": "1"}
    run_dir = tmp_path / "runs" / "gpt-4242"

    code, log = _attempt(script, tmp_path, 0, f"{run_dir / 'metrics.jsonl'}:8", mode_env)
    assert code == 75, log[-3000:]
    assert "requeueing job 4242" in log and "scontrol requeue 4242" in (tmp_path / "calls.log").read_text()
    # a CPU for the rank and one for its loader worker, asked of srun too (it no longer inherits it since 22.05)
    (srun,) = [line for line in (tmp_path / "calls.log").read_text().splitlines() if line.startswith("srun ")]
    assert " --cpus-per-task=2 " in srun, srun
    (stopped,) = [p.name for p in (run_dir / "checkpoints").glob("step_*")]
    assert 0 < int(stopped[5:]) < 60, stopped

    code, log = _attempt(script, tmp_path, 1, "", mode_env)  # the requeued job: same id, no signal this time
    assert code == 0, log[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / stopped}" in log and "attempt 2, run gpt-4242" in log
    assert (tmp_path / "calls.log").read_text().count("scontrol requeue") == 1  # done: not requeued again
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert steps[-1] == 60 and steps == sorted(steps), steps  # continued where it stopped, to the end
