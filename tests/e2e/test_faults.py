"""Faults during a real `trainmesh run` (2 processes, torchrun's agent, restarts allowed): the run
finishes, resumes from the newest committed checkpoint, and ends bit for bit where the uninterrupted
run ends — weights, optimizer state, and every per-step loss after the resume point."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from support import nano_toml, rank_output, train_rank
from trainmesh.checkpoint import latest_checkpoint, list_checkpoints, read_full_state, verify
from trainmesh.testing import run_distributed

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
OVERRIDES = ["--train.max_steps=8", "--checkpoint.every=2", "--checkpoint.final=true", "--model.dropout=0.1"]


def _command(root: Path, name: str, *flags: str, restarts: int = 1, overrides: list[str] = OVERRIDES) -> list[str]:
    return [
        str(BIN / "trainmesh"),
        "run",
        "gpt",
        "--config",
        str(nano_toml(root)),
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(restarts),
        "--run-id",
        name,
        *flags,
        "--",
        *overrides,
    ]


def _env(fault: str = "") -> dict[str, str]:
    """The environment of a launch: `trainmesh` on the PATH, as the commands trainmesh prints expect."""
    path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "OMP_NUM_THREADS": "1", "TRAINMESH_FAULT": fault}


def _train(
    root: Path, name: str, *flags: str, fault: str = "", restarts: int = 1, overrides: list[str] = OVERRIDES
) -> subprocess.CompletedProcess[str]:
    cmd = _command(root, name, *flags, restarts=restarts, overrides=overrides)
    return subprocess.run(cmd, cwd=root, env=_env(fault), capture_output=True, text=True, timeout=150, check=False)


def _losses(run_dir: Path) -> dict[int, float]:
    """The last logged loss of every step (a restarted attempt re-logs the steps it repeats)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor], dict[int, float]]:
    root = tmp_path_factory.mktemp("faults")
    # In this process's workers (the same worker code and config as `trainmesh run`, without its start-up)
    run_distributed(train_rank, 2, args=(str(root), [*OVERRIDES, "--run.id=reference"]))
    run_dir = root / "runs" / "reference"
    final = latest_checkpoint(run_dir)
    assert final is not None and final.name == "step_00000008"
    return root, read_full_state(final), _losses(run_dir)


def _assert_same_as_reference(root: Path, name: str, reference: tuple[Path, dict, dict]) -> None:
    _, ref_state, ref_losses = reference
    run_dir = root / "runs" / name
    final = latest_checkpoint(run_dir)
    assert final is not None and final.name == "step_00000008"
    state, reference_state = _tensors(read_full_state(final)), _tensors(ref_state)
    assert state.keys() == reference_state.keys() and any(k.startswith("optim.state.") for k in state)
    for key, value in reference_state.items():  # the model and every optimizer moment
        assert torch.equal(state[key], value), key
    assert _losses(run_dir) == ref_losses


def _tensors(state: object, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state dict by its dotted path."""
    if isinstance(state, torch.Tensor):
        return {prefix.rstrip("."): state}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else []
    return {k: v for key, value in items for k, v in _tensors(value, f"{prefix}{key}.").items()}


@pytest.mark.parametrize(
    ("faults", "resumed"),
    [
        ("rank=1,step=3,kind=sigkill;rank=0,step=7,kind=exception", [2, 6]),
        ("rank=0,step=3,kind=exit;rank=1,step=5,kind=segfault", [2, 4]),
    ],
    ids=["sigkill-then-exception", "exit-then-segfault"],
)
def test_dying_ranks_are_restarted_and_the_run_ends_exactly_as_uninterrupted(
    faults: str, resumed: list[int], reference: tuple
) -> None:
    """Each kind of death (SIGKILL, an exception, os._exit, a segfault), two per run at different steps:
    each restart resumes from the newest checkpoint, and the run ends as the uninterrupted one."""
    root = reference[0]
    name = "-".join(re.findall(r"kind=(\w+)", faults))
    result = _train(root, name, fault=faults, restarts=2)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [int(s) for s in re.findall(r"resumed from \S*step_(\d+)", result.stderr)]
    assert steps == resumed, result.stderr[-2000:]
    _assert_same_as_reference(root, name, reference)


def test_killed_while_saving_resumes_from_the_previous_checkpoint(reference: tuple) -> None:
    root = reference[0]
    result = _train(root, "mid-save", fault="rank=0,step=4,kind=sigkill,phase=checkpoint")
    assert result.returncode == 0, result.stderr[-3000:]
    # step 4 was never committed, so the restart began at 2
    assert re.search(r"resumed from \S*step_00000002", result.stderr), result.stderr[-2000:]
    _assert_same_as_reference(root, "mid-save", reference)


def test_restarts_exhausted_fail_loudly_and_leave_only_committed_checkpoints(reference: tuple) -> None:
    root = reference[0]
    result = _train(root, "exhausted", fault="rank=1,step=5,kind=sigkill", restarts=0)
    assert result.returncode == 1
    assert "rank 1 failed first: killed by signal SIGKILL" in result.stderr
    checkpoints = list_checkpoints(root / "runs" / "exhausted")
    assert [p.name for p in checkpoints] == ["step_00000002", "step_00000004"]
    assert all((p / "trainer_state.json").is_file() for p in checkpoints)


STOP = ["--train.max_steps=60", "--checkpoint.final=true", "--model.dropout=0.1"]


@pytest.fixture(scope="module")
def stop_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("stop")
    run_distributed(train_rank, 2, args=(str(root), [*STOP, "--run.id=ref"]))
    return root, read_full_state(latest_checkpoint(root / "runs" / "ref"))["model"]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("sig", "code", "said", "group", "workers"),
    [
        (signal.SIGTERM, 75, "preemption requested (SIGTERM): stopping at step", False, 0),
        (signal.SIGINT, 130, "Ctrl-C: stopping at step", False, 0),
        # As SLURM's time limit sends it: to every process of the job, DataLoader workers included.
        (signal.SIGTERM, 75, "preemption requested (SIGTERM): stopping at step", True, 1),
    ],
    ids=["sigterm", "ctrl-c", "sigterm-to-every-process-with-loader-workers"],
)
def test_a_stop_signal_stops_at_a_step_boundary_and_relaunch_continues_exactly(
    sig: signal.Signals,
    code: int,
    said: str,
    group: bool,
    workers: int,
    stop_reference: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """Preemption (SIGTERM) or Ctrl-C (SIGINT, to the launcher as a terminal sends it): every rank stops at the
    same step, saves, exits (75, 130) without a traceback; `--resume` then ends bit for bit where an
    uninterrupted run ends. `group`: the signal goes to the launcher's whole process group, so DataLoader
    worker processes (`workers` per rank) get it too; they must not die of it."""
    root, reference = stop_reference
    name = f"stop-{sig.name}-{workers}"
    overrides = [*STOP, f"--data.num_workers={workers}"]
    job = subprocess.Popen(
        _command(root, name, restarts=0, overrides=overrides),
        cwd=root,
        env=_env(),
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=group,
    )
    metrics = root / "runs" / name / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 10):
        time.sleep(0.2)  # until training is well under way
    if group:
        os.killpg(job.pid, sig)
    else:
        job.send_signal(sig)
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == code, stderr[-3000:]
    stopped = latest_checkpoint(root / "runs" / name)
    assert stopped is not None and 0 < int(stopped.name[5:]) < 60, stderr[-2000:]
    assert said in stderr, stderr[-3000:]
    printed = re.search(r"Continue with: (.*)", stderr)
    assert printed, stderr[-3000:]
    hint = shlex.split(printed.group(1))
    where = f"--run.out_dir={root / 'runs'}"  # the run is not under ./runs: the command says where
    assert hint[:3] == ["trainmesh", "run", "gpt"] and hint[-5:] == ["--resume", "--run-id", name, "--", where], hint
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "forcefully exiting" not in stderr, stderr[-3000:]  # each rank exited by itself, its workers stopped
    config = root / "runs" / name / "config.toml"
    recorded = config.read_bytes()
    if sig == signal.SIGINT:  # while here: a resume with another model is refused before launch, plainly
        other = subprocess.run(
            [*hint, "--", "--model.n_layer=3"], cwd=root, env=_env(), capture_output=True, text=True, timeout=60
        )
        assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr[-3000:]
        assert "model.n_layer: the checkpoint has 2, this command gives 3" in other.stderr, other.stderr[-3000:]
        assert "torchrun" not in other.stderr  # nothing was launched
        assert config.read_bytes() == recorded  # and the run's config is as it was
    resumed = subprocess.run(hint, cwd=root, env=_env(), capture_output=True, text=True, timeout=150)  # as printed
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {stopped}" in resumed.stderr
    assert f"run {name} continues from step {int(stopped.name[5:])} with its own config" in resumed.stderr
    final = read_full_state(latest_checkpoint(root / "runs" / name))  # type: ignore[arg-type]
    for key, value in reference.items():
        assert torch.equal(final["model"][key], value), key


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


# Three stalls in one run, one per attempt (rank, after step, the stuck rank's own frame when it can dump it):
STALLS = [
    ("rank=1,step=3,kind=sigstop", 1, 3, None),  # a stopped process runs nothing at all
    ("rank=0,step=5,kind=hang", 0, 5, "_fire"),  # holds the GIL: no Python thread runs, faulthandler's C timer acts
    ("rank=1,step=7,kind=sleep,phase=data", 1, 6, "_fire"),  # a stuck data read: the rank's own watchdog sees it
]


def test_stalls_are_diagnosed_torn_down_and_restarted(reference: tuple) -> None:
    root = reference[0]
    faults = ";".join(fault for fault, *_ in STALLS)
    result = _train(root, "stalls", fault=faults, restarts=3, overrides=[*OVERRIDES, "--dist.stall_timeout_s=3"])
    assert result.returncode == 0, result.stderr[-3000:]
    stalls = root / "runs" / "stalls" / "stalls"
    for attempt, (fault, stuck, after, frame) in enumerate(STALLS):  # one folder per attempt
        (folder,) = stalls.glob(f"*-attempt_{attempt}")
        report = (folder / "report.txt").read_text()
        assert f"Did not arrive: rank(s) {stuck}." in report, (fault, report)
        assert "completed no step for" in report and f"after step {after}." in report, (fault, report)
        waiting_peer = (folder / f"rank_{1 - stuck}.txt").read_text()
        assert re.search(r'trainmesh/train/loop.py", line \d+ in train', waiting_peer), (fault, waiting_peer)
        if frame:  # the stuck rank's own stack names the frame it is stuck in
            stack = (folder / f"rank_{stuck}.txt").read_text()
            assert re.search(rf'trainmesh/train/faults.py", line \d+ in {frame}', stack), (fault, stack)
    assert not list(stalls.glob("*-attempt_3"))  # the last attempt did not stall (and left no empty files)
    assert not _processes_mentioning("runs/stalls "), "a process of a stalled attempt survived"
    _assert_same_as_reference(root, "stalls", reference)


ASYNC = [*OVERRIDES, "--checkpoint.async_save=true"]


def _can_mount_a_small_disk() -> bool:
    probe = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=30, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _can_mount_a_small_disk(), reason="needs `unshare -rm` (a user namespace) for a small tmpfs")
def test_a_really_full_disk_says_where_and_how_much_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """A run on a 1.2 MB file system (a tmpfs in a user namespace): its first checkpoints fit, a later one
    does not. Every rank stops with the same plain message naming the file, the free and the needed space;
    what was committed before still verifies."""
    disk = tmp_path / "disk"
    disk.mkdir()
    trainmesh = str(BIN / "trainmesh")
    logs = ["--log-dir", str(tmp_path / "logs")]  # off the small disk, which is gone when its namespace ends
    run = [*_command(tmp_path, "full", *logs, restarts=0, overrides=["--train.max_steps=8", "--checkpoint.every=1"])]
    run += [f"--run.out_dir={disk}"]
    script = (
        f"mount -t tmpfs -o size=1200k tmpfs {shlex.quote(str(disk))} || exit 99; {shlex.join(run)}; echo RUN_EXIT=$?; "
        f"{shlex.quote(trainmesh)} ckpt verify {shlex.quote(str(disk / 'full'))}; echo VERIFY_EXIT=$?"
    )
    result = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert "RUN_EXIT=2" in result.stdout, result.stdout + result.stderr[-3000:]
    said = r"\[rank(\d)\] ERROR saving checkpoint \S+ failed on rank\(s\) \[[\d, ]+\]: (.*)"
    found = re.findall(said, result.stderr) + re.findall(said, rank_output(tmp_path / "logs", 1))  # rank 1: in its log
    assert sorted(rank for rank, _ in found) == ["0", "1"], result.stderr[-3000:]
    message = found[0][1]
    assert re.search(r"No space left on device writing \S*full/checkpoints/\.step_\d+\.tmp", message), message
    assert re.search(r"[\d.]+ MiB was free then, and a checkpoint of this run takes about [\d.]+ MiB", message), message
    assert "Traceback" not in result.stderr
    assert "VERIFY_EXIT=0" in result.stdout and "OK      " in result.stdout, result.stdout


def test_async_checkpoints_hold_the_same_bytes_survive_a_kill_and_the_last_is_durable(reference: tuple) -> None:
    """Saved in the background while training goes on (and mutates the weights in place), killed after step
    5 and resumed: every checkpoint holds exactly the state of its own step, the blocking saves' state, and
    the final one is committed before the process exits."""
    root = reference[0]
    result = _train(root, "async", fault="rank=1,step=5,kind=sigkill", overrides=ASYNC)
    assert result.returncode == 0, result.stderr[-3000:]
    # the save of step 4 may or may not have been committed when step 5 ended: either is a valid resume
    assert re.search(r"resumed from \S*step_0000000[24]", result.stderr), result.stderr[-2000:]
    run_dir = root / "runs" / "async"
    checkpoints = list_checkpoints(run_dir)
    assert [p.name for p in checkpoints] == [f"step_{s:08d}" for s in (2, 4, 6, 8)]
    for checkpoint in checkpoints:
        assert verify(checkpoint).ok, checkpoint
        saved = _tensors(read_full_state(checkpoint))
        blocking = _tensors(read_full_state(root / "runs" / "reference" / "checkpoints" / checkpoint.name))
        assert saved.keys() == blocking.keys()
        assert all(torch.equal(saved[k], v) for k, v in blocking.items()), checkpoint
    _assert_same_as_reference(root, "async", reference)


def test_a_full_disk_during_an_async_save_fails_every_rank_alike_and_keeps_the_previous_checkpoint(
    reference: tuple,
) -> None:
    """Injected in the background writer (a really full disk, synchronous saves: the test above)."""
    root, overrides = reference[0], ASYNC
    name = "disk-full-async"
    result = _train(root, name, fault="rank=1,step=4,kind=diskfull,phase=checkpoint", overrides=overrides, restarts=0)
    assert result.returncode == 2  # a problem for the user to fix, said plainly
    run_dir = root / "runs" / name
    for rank in (0, 1):  # the same error, reported by each rank itself (rank 1 in its log, not on the console)
        failed = r"saving checkpoint \S*step_00000004 failed on rank\(s\) \[1\]: No space left on device"
        said = result.stderr if rank == 0 else rank_output(run_dir / "logs", 1)
        assert re.search(rf"\[rank{rank}\] ERROR {failed}", said), result.stderr[-3000:]
    assert "was free then, and a checkpoint of this run takes about" in result.stderr
    assert "Traceback" not in result.stderr
    checkpoints = list_checkpoints(run_dir)
    assert [p.name for p in checkpoints] == ["step_00000002"] and verify(checkpoints[0]).ok
    assert not list((run_dir / "checkpoints").glob("step_00000004*"))  # nothing half-written is left


def test_a_rank_that_cannot_stop_in_time_makes_the_stop_a_failure_that_names_it(tmp_path: Path) -> None:
    """After SIGTERM the launcher exits 75 ("stopped with a checkpoint": the sbatch script requeues on it) only
    when every rank says so. Rank 1 hangs holding the GIL, so it cannot act on the signal (nor can rank 0, which
    waits for it in a collective); the agent SIGKILLs both after --shutdown-timeout, and the launcher says
    which ranks did not stop and exits 143."""
    name = "cannot-stop"
    job = subprocess.Popen(
        _command(tmp_path, name, "--shutdown-timeout", "2", restarts=0, overrides=STOP),
        cwd=tmp_path,
        env=_env("rank=1,step=2,kind=hang"),
        stderr=subprocess.PIPE,
        text=True,
    )
    fired = tmp_path / "runs" / name / ".faults" / "0"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not fired.exists() and job.poll() is None:
        time.sleep(0.1)
    time.sleep(0.5)  # into the sleep
    job.send_signal(signal.SIGTERM)
    _, stderr = job.communicate(timeout=60)
    assert job.returncode == 143, stderr[-3000:]
    for rank in (0, 1):
        assert f"SIGTERM: rank {rank} did not stop with a checkpoint: it recorded no exit code" in stderr, stderr
    assert "not every rank stopped with a checkpoint; trainmesh run gpt" in stderr
    assert "--resume --run-id cannot-stop -- --run.out_dir=" in stderr
    assert "continues from the newest committed checkpoint" in stderr
    assert "every rank stopped at a step boundary" not in stderr
