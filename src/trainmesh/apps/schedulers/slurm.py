"""`trainmesh slurm`: an sbatch script that trains a config and requeues itself when stopped at its time limit (SIGTERM
to the tasks, exit 75, `scontrol requeue`).

Details: docs/internals.md#appsschedulersslurmpy
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from trainmesh.apps.schedulers.common import (
    SchedulerError,
    agent_shutdown_timeout,
    breaks_a_line,
    cpus_per_rank,
    positive,
)

SIGNAL_SECONDS_MAX = 65535  # sbatch's limit for sig_time
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_NAME = re.compile(r"[A-Za-z0-9._:-]+")  # partitions and accounts: letters, digits and a few marks
_UNREADABLE = re.compile(r"[\s'\"\\]")  # what sbatch's reading of #SBATCH lines splits at or unquotes
_MEM = re.compile(r"\d+[KMGTkmgt]?")  # sbatch --mem: megabytes, or a unit K, M, G or T; 0: all of a node's memory
_OPTION = re.compile(r"(--[A-Za-z][-A-Za-z0-9]*|-[A-Za-z])(.*)")  # one sbatch option: its name, and its value
_SHORT = {"-J": "--job-name", "-N": "--nodes", "-c": "--cpus-per-task", "-t": "--time", "-p": "--partition"}
_SHORT.update({"-A": "--account", "-o": "--output", "-D": "--chdir"})  # sbatch's one-letter names of _WRITTEN's
_WRITTEN = {  # the #SBATCH options the script writes itself, and how to ask for what they set instead
    "--job-name": "use --job-name NAME",
    "--nodes": "use --nodes N",
    "--ntasks-per-node": "use --one-task-per-gpu for a task per GPU (the default is a task per node)",
    "--gpus-per-node": "use --gpus-per-node G",
    "--cpus-per-task": "use --cpus-per-task N",
    "--mem": "use --mem SIZE",
    "--exclusive": "use --exclusive",
    "--time": "use --time LIMIT",
    "--partition": "use --partition NAME",
    "--account": "use --account NAME",
    "--signal": "use --signal-seconds S (the requeue at the time limit is built on it)",
    "--requeue": "leave it out: the script requeues itself when stopped at its time limit",
    "--no-requeue": "leave it out: the script requeues itself when stopped at its time limit",
    "--open-mode": "leave it out: every attempt of the job appends to one output file",
    "--output": "leave it out, or edit the printed script: every attempt appends to slurm-%x-%j.out",
    "--chdir": "run `trainmesh slurm` in the folder the job should run in",
}


@dataclass(frozen=True)
class SlurmJob:
    """What the sbatch script asks for and runs; `check` refuses what cannot work, naming the flag."""

    recipe: str
    config: str
    """Absolute path of the TOML config (the batch script may run in another directory)."""
    overrides: tuple[str, ...]
    nodes: int
    gpus_per_node: int
    python: str
    """The Python with trainmesh installed, at the same path on every node."""
    workdir: str
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    job_name: str | None = None
    run_id: str | None = None
    """The run's name; default `<recipe>-$SLURM_JOB_ID`, the same on every requeue of the job."""
    signal_seconds: int = 120
    one_task_per_gpu: bool = False
    max_restarts: int = 0
    cpus_per_task: int | None = None
    """None: a CPU for every rank of the task and each of its loader workers (`task_cpus`)."""
    num_workers: int = 0
    """The config's data.num_workers: DataLoader worker processes of each rank."""
    mem: str | None = None
    """Memory per node in sbatch's --mem syntax (200G; 0: all of it); None: the partition's default."""
    exclusive: bool = False
    sbatch_options: tuple[str, ...] = ()
    """Other #SBATCH options, each one option (`--constraint=h100`)."""

    @property
    def tasks_per_node(self) -> int:
        return self.gpus_per_node if self.one_task_per_gpu else 1

    @property
    def task_cpus(self) -> int:
        """--cpus-per-task, or enough for the ranks a task runs and their loader workers, which SLURM otherwise may
        give one core together (a site without a default of CPUs per GPU)."""
        if self.cpus_per_task is not None:
            return self.cpus_per_task
        return self.gpus_per_node // self.tasks_per_node * cpus_per_rank(self.num_workers)

    def check(self) -> None:
        positive(self.nodes, "--nodes")
        positive(self.gpus_per_node, "--gpus-per-node")
        if not 1 <= self.signal_seconds <= SIGNAL_SECONDS_MAX:
            raise SchedulerError(
                f"--signal-seconds={self.signal_seconds}: must be 1..{SIGNAL_SECONDS_MAX} (sbatch's --signal limit)"
            )
        limit = time_limit_seconds(self.time) if self.time is not None else None
        if limit is not None and self.signal_seconds >= limit:
            raise SchedulerError(
                f"--signal-seconds={self.signal_seconds} is not shorter than --time={self.time} ({limit} s): the job "
                "would be told to stop before it starts. Fix: a smaller --signal-seconds or a longer --time."
            )
        for flag, value in (("--partition", self.partition), ("--account", self.account)):
            if value is not None and not _NAME.fullmatch(value):
                raise SchedulerError(f"{flag}={value!r}: expected a SLURM name (letters, digits, '.', '_', ':', '-')")
        if self.job_name is not None and not _JOB_NAME.fullmatch(self.job_name):
            raise SchedulerError(
                f"--job-name={self.job_name!r}: expected letters, digits, '.', '_' and '-', at most 64 characters"
            )
        if _UNREADABLE.search(self.workdir):
            raise SchedulerError(
                f"the working folder {self.workdir!r} holds a space, a quote or a backslash, which sbatch's reading of "
                "#SBATCH --chdir cannot take (it splits and unquotes the line itself). Fix: run `trainmesh slurm` from "
                "a folder whose path has none, or make a symlink to this one without them and run it from there."
            )
        if self.max_restarts and self.one_task_per_gpu:
            raise SchedulerError(
                "--max-restarts restarts the processes of a node through torchrun's agent, which "
                "--one-task-per-gpu does not use. Fix: drop one of them (SLURM then requeues on preemption only)."
            )
        if self.max_restarts < 0:
            raise SchedulerError(f"--max-restarts={self.max_restarts}: must be 0 or more")
        if self.cpus_per_task is not None:
            positive(self.cpus_per_task, "--cpus-per-task")
        if self.mem is not None and not _MEM.fullmatch(self.mem):
            raise SchedulerError(
                f"--mem={self.mem!r} is not a memory size sbatch reads. Fix: a whole number with a unit K, M, G or T "
                "(200G, 512000M; no unit: megabytes), or 0 for all of each node's memory."
            )
        for option in self.sbatch_options:
            _check_sbatch_option(option, self.mem is not None)


def _check_sbatch_option(option: str, mem_given: bool) -> None:
    """One more `#SBATCH` line: a single option that sbatch reads as typed, and none the script sets already."""
    flag = f"--sbatch-option={option!r}"
    if breaks_a_line(option):
        raise SchedulerError(
            f"{flag} holds a newline or another control character: it would end the #SBATCH line and start another "
            "line of the script. Fix: one option per --sbatch-option, on one line."
        )
    match = _OPTION.fullmatch(option)
    if match is None:
        raise SchedulerError(
            f"{flag}: expected one sbatch option, starting with '-': --constraint=h100, --qos=high, -Ch100. Fix: "
            "--sbatch-option=--NAME=VALUE (with '=', so that the option is read as the value of --sbatch-option)."
        )
    name, value = match.groups()
    if _UNREADABLE.search(option):
        raise SchedulerError(
            f"{flag} holds a space, a quote or a backslash, which sbatch's reading of #SBATCH lines splits or "
            "unquotes. Fix: one option per --sbatch-option (repeat it for several), without spaces or quotes."
        )
    if name.startswith("--") and not (value == "" or value.startswith("=")):
        raise SchedulerError(f"{flag}: expected --NAME or --NAME=VALUE")
    name = _SHORT.get(name, name)
    if name in _WRITTEN:
        raise SchedulerError(f"{flag}: the script writes #SBATCH {name} itself. Fix: {_WRITTEN[name]}.")
    if mem_given and name in ("--mem-per-cpu", "--mem-per-gpu"):
        raise SchedulerError(
            f"{flag} and --mem: sbatch takes one of --mem, --mem-per-cpu and --mem-per-gpu. Fix: drop one of them."
        )


def time_limit_seconds(value: str) -> int | None:
    """sbatch --time in seconds (None: no limit). Forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S; UNLIMITED, INFINITE,
    and a time of zero, which asks SLURM for no limit (sbatch's man page)."""
    if value.upper() in ("UNLIMITED", "INFINITE"):
        return None
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", value)
    if not match:
        raise SchedulerError(
            f"--time={value!r} is not a SLURM time limit. Fix: minutes (90), hours:minutes:seconds (24:00:00) or "
            "days-hours[:minutes[:seconds]] (2-00:00:00)."
        )
    days, first, second, third = (int(g) if g is not None else None for g in match.groups())
    assert first is not None
    if not any((days, first, second, third)):
        return None
    if days is None:  # M, M:S or H:M:S
        if second is None:
            return first * 60
        return first * 60 + second if third is None else first * 3600 + second * 60 + third
    return days * 86400 + first * 3600 + (second or 0) * 60 + (third or 0)


def render_sbatch(job: SlurmJob, checked: list[str], command_line: str) -> str:
    """The batch script. `checked`: how the config runs (one line per world size), recorded as comments."""
    job.check()
    run_id = shlex.quote(job.run_id) if job.run_id else f'"{job.recipe}-${{SLURM_JOB_ID}}"'
    head = [
        "#!/bin/bash",
        f"# Generated by: {command_line}",
        *(f"# checked: {line}" for line in checked),
        f"#SBATCH --job-name={job.job_name or job.recipe}",
        f"#SBATCH --nodes={job.nodes}",
        f"#SBATCH --ntasks-per-node={job.tasks_per_node}",
        f"#SBATCH --gpus-per-node={job.gpus_per_node}",
        *_cpus_comment(job),
        f"#SBATCH --cpus-per-task={job.task_cpus}",
        *([f"#SBATCH --mem={job.mem}"] if job.mem is not None else []),
        *(["#SBATCH --exclusive"] if job.exclusive else []),
        *([f"#SBATCH --time={job.time}"] if job.time else []),
        *([f"#SBATCH --partition={job.partition}"] if job.partition else []),
        *([f"#SBATCH --account={job.account}"] if job.account else []),
        f"#SBATCH --signal=TERM@{job.signal_seconds}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --output=slurm-%x-%j.out",
        f"#SBATCH --chdir={job.workdir}",
        *(f"#SBATCH {option}" for option in job.sbatch_options),
    ]
    body = _BODY.format(
        python=shlex.quote(job.python),
        run_id=run_id,
        launch=_launch_per_gpu(job) if job.one_task_per_gpu else _launch_per_node(job),
    )
    return "\n".join(head) + "\n" + body


def _cpus_comment(job: SlurmJob) -> list[str]:
    """How the default --cpus-per-task was counted, for a reader of the script (nothing when it was given)."""
    if job.cpus_per_task is not None:
        return []
    ranks = job.gpus_per_node // job.tasks_per_node
    per = "a rank" if ranks == 1 else f"{ranks} ranks"
    return [f"# CPUs per task: {per} x (1 + {job.num_workers} DataLoader workers each, data.num_workers)"]


def _training_args(job: SlurmJob) -> str:
    """The config and the overrides, on a continuation line of their own (nothing when there are none)."""
    config = ["--config", job.config] if job.config else []  # none: the recipe's defaults and the overrides
    args = " ".join(shlex.quote(a) for a in [*config, *job.overrides])
    return f" \\\n    {args}" if args else ""


def _launch_per_node(job: SlurmJob) -> str:
    restarts = f" --max-restarts {job.max_restarts}" if job.max_restarts else ""
    # torchrun's agent gives its ranks 30 s after a SIGTERM by default, then SIGKILLs them: give them the window
    # --signal asks SLURM for instead.
    shutdown = agent_shutdown_timeout(job.signal_seconds)
    return (
        "# One task per node: trainmesh run starts one process per GPU; node 0 (the first host) hosts the rendezvous.\n"
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
        "# The port: MASTER_PORT if set, else derived from the job id, so that jobs sharing a node differ.\n"
        "MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}\n"
        "export PYTHON MASTER_ADDR MASTER_PORT\n"
        "# SLURM_NODEID differs per task, so a shell in each task reads it. --shutdown-timeout: how long each\n"
        "# node's agent lets its ranks save after the SIGTERM before it SIGKILLs them "
        f"(--signal={job.signal_seconds} s, less a margin).\n"
        f"{_SRUN_CPUS_WHY}srun --ntasks-per-node=1 {_SRUN_CPUS} bash -c "
        '\'exec "$PYTHON" -m trainmesh.cli run --node-rank "$SLURM_NODEID" "$@"\' bash \\\n'
        f"    {job.recipe} --nnodes {job.nodes} --nproc-per-node {job.gpus_per_node}{restarts} \\\n"
        f"    --shutdown-timeout {shutdown} \\\n"
        '    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --run-id "$RUN_ID" --auto-resume'
        + _training_args(job)
    )


def _launch_per_gpu(job: SlurmJob) -> str:
    return (
        "# One task per GPU: each reads its rank from SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID and uses\n"
        "# cuda:$SLURM_LOCALID, so every task must see all GPUs of its node (no --gpu-bind to one GPU per task).\n"
        f'{_SRUN_CPUS_WHY}srun {_SRUN_CPUS} "$PYTHON" -m trainmesh {job.recipe} --run.id="$RUN_ID" --auto-resume'
        + _training_args(job)
    )


_SRUN_CPUS = '--cpus-per-task="$SLURM_CPUS_PER_TASK"'
_SRUN_CPUS_WHY = (  # sbatch's and srun's man pages, 22.05 on
    "# srun's --cpus-per-task repeats #SBATCH's: since SLURM 22.05 srun no longer inherits it, and would give each\n"
    "# task one CPU, shared by the ranks it runs and all their DataLoader workers.\n"
)

_BODY = """
PYTHON={python}  # the Python with trainmesh installed, at this path on every node
RUN_ID={run_id}  # the same on every requeue: SLURM keeps the job id
echo "trainmesh: job $SLURM_JOB_ID, attempt $((${{SLURM_RESTART_COUNT:-0}} + 1)), run $RUN_ID"

# --signal above sends SIGTERM to the tasks only. scancel and SLURM's preemption also signal this shell: trap
# it, so the shell keeps waiting for the tasks to save (bash runs the trap once srun returns), and remember it.
shell_signalled=0
trap 'shell_signalled=1' TERM

{launch}
code=$?

# 75: the tasks stopped at the time-limit signal with a checkpoint. Put the job back in the queue (same job id,
# same run id): the next attempt continues from that checkpoint. Not after scancel (it means stop), nor after
# SLURM's preemption (it requeues --requeue jobs itself), which both signal this shell too.
if [ "$code" -eq 75 ] && [ "$shell_signalled" -eq 0 ]; then
    echo "trainmesh: stopped at the time limit with a checkpoint (exit 75); requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$code"
"""
