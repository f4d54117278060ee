"""`trainmesh slurm`: the sbatch script's lines, its bash syntax, and its requeue logic driven by bash with a fake
`srun` and `scontrol` on PATH (shell scripts that record their arguments); flag errors before anything is printed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from trainmesh.apps.schedulers.slurm import time_limit_seconds
from trainmesh.cli import main

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

NANO = ["--", "--model.size=nano", "--model.block_size=32", "--data.max_corpus_mb=0.25"]


def _generate(capsys: pytest.CaptureFixture[str], tmp_path: Path, *flags: str) -> str:
    (tmp_path / "cache").mkdir(exist_ok=True)
    code = main(["slurm", "gpt", "--nodes", "2", "--gpus-per-node", "4", *flags, *NANO, f"--data.cache_dir={tmp_path}"])
    out = capsys.readouterr().out
    assert code == 0, out
    return out


def test_the_script_asks_for_the_signal_requeue_and_the_resumable_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    script = _generate(capsys, tmp_path, "--time", "2-00:00:00", "--partition", "gpu", "--signal-seconds", "300")
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",  # one `trainmesh run` per node
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --time=2-00:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --signal=TERM@300",  # no B: the tasks get SIGTERM, not the batch shell
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        'RUN_ID="gpt-${SLURM_JOB_ID}"  # the same on every requeue: SLURM keeps the job id',
        '    scontrol requeue "$SLURM_JOB_ID"',
    ):
        assert line in lines, line
    assert "# checked: world size 8: ddp on dp_replicate 8" in script
    assert '--node-rank "$SLURM_NODEID"' in script and "--nnodes 2 --nproc-per-node 4" in script
    assert '--run-id "$RUN_ID" --auto-resume' in script
    # each node's agent gives its ranks the --signal window, less a margin, to save before it SIGKILLs them
    assert "--shutdown-timeout 285" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True, check=False).returncode == 0


def test_one_task_per_gpu_runs_the_worker_under_srun(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    script = _generate(capsys, tmp_path, "--one-task-per-gpu", "--run-id", "long-run")
    assert "#SBATCH --ntasks-per-node=4" in script
    assert "RUN_ID=long-run" in script  # a fixed name continues across submissions too
    srun = 'srun --cpus-per-task="$SLURM_CPUS_PER_TASK" "$PYTHON" -m trainmesh gpt --run.id="$RUN_ID" --auto-resume'
    assert srun in script
    assert subprocess.run(["bash", "-n"], input=script, text=True, check=False).returncode == 0


@pytest.mark.parametrize(
    ("flags", "cpus"),
    [([], 4), (["--", "--data.num_workers=3"], 16), (["--one-task-per-gpu", "--", "--data.num_workers=3"], 4)],
    ids=["no-loader-workers", "task-per-node", "task-per-gpu"],
)
def test_each_task_asks_for_a_cpu_per_rank_and_loader_worker(
    flags: list[str], cpus: int, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Without --cpus-per-task a site with no CPUs-per-GPU default gives a task one core, for its ranks and their
    DataLoader workers; and srun (SLURM 22.05 on) must be told again, or it binds each task to one CPU."""
    script = _generate(capsys, tmp_path, *flags)
    assert f"#SBATCH --cpus-per-task={cpus}" in script.splitlines()
    (srun,) = [line for line in script.splitlines() if line.startswith("srun ")]
    assert '--cpus-per-task="$SLURM_CPUS_PER_TASK"' in srun
    assert "#SBATCH --mem" not in script and "#SBATCH --exclusive" not in script  # the partition's, unless asked


def test_cpus_memory_exclusive_and_more_sbatch_options(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "cache").mkdir()
    code = main(
        [
            "slurm",
            "--sbatch-option=--constraint=h100",  # before the recipe and after it: both kept, in order
            "gpt",
            *["--nodes", "2", "--gpus-per-node", "4", "--cpus-per-task", "32", "--mem", "0", "--exclusive"],
            *["--sbatch-option=--qos=high", "--sbatch-option=-Cfoo", *NANO, f"--data.cache_dir={tmp_path}"],
        ]
    )
    script = capsys.readouterr().out
    assert code == 0, script
    lines = script.splitlines()
    for line in ("#SBATCH --cpus-per-task=32", "#SBATCH --mem=0", "#SBATCH --exclusive"):
        assert line in lines, line
    head = [line for line in lines if line.startswith("#SBATCH")]
    assert head[-3:] == ["#SBATCH --constraint=h100", "#SBATCH --qos=high", "#SBATCH -Cfoo"]
    assert subprocess.run(["bash", "-n"], input=script, text=True, check=False).returncode == 0


def test_the_help_says_how_the_cpus_are_counted(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["slurm", "--help"])
    assert "(default: 1 + data.num_workers for every rank the task runs" in " ".join(capsys.readouterr().out.split())


FAKE_SRUN = """#!/bin/bash
echo "srun $*" >> "$FAKE_LOG"
if [ "${FAKE_SCANCEL:-0}" = 1 ]; then kill -TERM "$PPID"; sleep 0.2; fi  # scancel signals the batch shell too
exit "$FAKE_SRUN_EXIT"
"""
FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$FAKE_LOG"
if [ "$1" = show ]; then echo node-a; echo node-b; fi
"""


@pytest.mark.parametrize(
    ("srun_exit", "scancel", "requeued"),
    [(75, False, True), (0, False, False), (1, False, False), (143, False, False), (75, True, False)],
    ids=["preempted", "done", "failed", "killed", "scancelled"],
)
def test_the_script_requeues_on_exit_75_only(
    srun_exit: int, scancel: bool, requeued: bool, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    script = tmp_path / "job.sbatch"
    script.write_text(_generate(capsys, tmp_path, "--max-restarts", "2"))
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (fake_bin / name).write_text(text)
        (fake_bin / name).chmod(0o755)
    log = tmp_path / "calls.log"
    env = {
        **os.environ,
        "PATH": f"{fake_bin}:{os.environ['PATH']}",
        "FAKE_LOG": str(log),
        "FAKE_SRUN_EXIT": str(srun_exit),
        "FAKE_SCANCEL": "1" if scancel else "0",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_CPUS_PER_TASK": "4",  # what sbatch sets from #SBATCH --cpus-per-task, and srun no longer reads
    }
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == srun_exit, result.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == "scontrol show hostnames node-[a-b]"
    srun = calls[1]  # the rendezvous at the first host, on the port derived from the job id
    assert (
        srun.startswith("srun --ntasks-per-node=1 --cpus-per-task=4 bash -c ")
        and "--master-addr node-a --master-port 24242" in srun
    )
    assert "--max-restarts 2" in srun and "--run-id gpt-4242 --auto-resume" in srun
    assert "--shutdown-timeout 105" in srun  # --signal-seconds 120, less a margin
    assert ("scontrol requeue 4242" in calls) == requeued, calls
    assert ("requeueing job 4242" in result.stdout) == requeued


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpus-per-node", "0"], "--gpus-per-node=0: must be at least 1"),
        (["--time", "soon"], "--time='soon' is not a SLURM time limit"),
        (["--time", "1", "--signal-seconds", "120"], "--signal-seconds=120 is not shorter than --time=1 (60 s)"),
        (["--signal-seconds", "70000"], "--signal-seconds=70000: must be 1..65535"),
        (["--one-task-per-gpu", "--max-restarts", "1"], "--max-restarts restarts the processes of a node"),
        (["--partition", "a b"], "--partition='a b': expected a SLURM name"),
        (["--run-id", "../x"], "run.id='../x'"),
        (["--python", "/usr/bin/python\ntouch /tmp/PWNED #"], "holds a control character"),  # no line of its own
        (["--cpus-per-task", "0"], "--cpus-per-task=0: must be at least 1"),
        (["--mem", "1.5G"], "--mem='1.5G' is not a memory size sbatch reads"),
        (["--mem", "200 GB"], "--mem='200 GB' is not a memory size sbatch reads"),
        (["--sbatch-option=constraint=h100"], "--sbatch-option='constraint=h100': expected one sbatch option"),
        (["--sbatch-option=--qos=high --constraint=h100"], "holds a space, a quote or a backslash"),
        (["--sbatch-option=--comment='a b'"], "holds a space, a quote or a backslash"),
        (["--sbatch-option=--qos=high\n#SBATCH --x"], "--sbatch-option='--qos=high\\n#SBATCH --x' holds a newline"),
        (["--sbatch-option=--time=1:00:00"], "writes #SBATCH --time itself. Fix: use --time LIMIT"),
        (["--sbatch-option=-c8"], "writes #SBATCH --cpus-per-task itself. Fix: use --cpus-per-task N"),
        (["--sbatch-option=--signal=B:USR1@60"], "Fix: use --signal-seconds S"),
        (["--sbatch-option=--no-requeue"], "the script requeues itself"),
        (["--mem", "200G", "--sbatch-option=--mem-per-gpu=80G"], "sbatch takes one of --mem, --mem-per-cpu"),
    ],
)
def test_bad_flags_are_refused_before_anything_is_printed(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["slurm", "gpt", "--nodes", "2", "--gpus-per-node", "4", *flags])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert message in captured.err


def test_a_working_folder_sbatch_cannot_read_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """sbatch splits and unquotes #SBATCH lines itself: --chdir cannot hold a space or a quote."""
    folder = tmp_path / "my runs" / "it's"
    folder.mkdir(parents=True)
    monkeypatch.chdir(folder)
    assert main(["slurm", "gpt", "--nodes", "2", "--gpus-per-node", "4"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "holds a space, a quote or a backslash" in captured.err


def test_gpus_per_node_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["slurm", "gpt", "--nodes", "2"]) == 2
    assert "--gpus-per-node N is required" in capsys.readouterr().err


def test_time_limit_forms() -> None:
    assert [time_limit_seconds(t) for t in ("90", "5:30", "24:00:00", "2-12", "1-00:30", "1-00:00:10")] == [
        5400,
        330,
        86400,
        216000,
        88200,
        86410,
    ]
    assert time_limit_seconds("UNLIMITED") is None
    # "A time limit of zero requests that no time limit be imposed" (sbatch's man page): not a limit to refuse.
    assert [time_limit_seconds(t) for t in ("0", "0:00:00", "0-0")] == [None, None, None]
    assert time_limit_seconds("0:30") == 30
