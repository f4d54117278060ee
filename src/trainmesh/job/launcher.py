"""What each `trainmesh` command does (the parser is in trainmesh.cli, which imports this module only once
the command line has been parsed)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from pathlib import Path

from trainmesh.checkpoint.catalog import list_checkpoints
from trainmesh.config import Config
from trainmesh.core.dist import select_device
from trainmesh.core.env import DistEnv, read_var
from trainmesh.core.files import make_dirs, read_bytes
from trainmesh.job.resolve import Job, check_data, resolve
from trainmesh.job.rundir import (
    LAUNCH_CONFIG_FILE,
    MAX_CONFIG_BYTES,
    RunLock,
    launch_line,
    record_new_run,
    write_launch_config,
)
from trainmesh.launch import LaunchError, LaunchOptions, launch
from trainmesh.launch.rank_logs import LOGS_DIR, LogSettings
from trainmesh.metrics.trackers import check_installed
from trainmesh.precision import check_precision_supported
from trainmesh.recipes import Recipe

log = logging.getLogger("trainmesh")


def launch_options(args: argparse.Namespace) -> LaunchOptions:
    """The launch flags of `run`, `check` and `bench` (cli/launch_flags.py, which also reads torchrun's PET_
    variables) as LaunchOptions."""
    backend = read_var("PET_RDZV_BACKEND", "c10d")
    if backend not in ("c10d", "static"):  # set by Kubeflow's training operator from elasticPolicy.rdzvBackend
        raise LaunchError(
            f"PET_RDZV_BACKEND={backend!r}: trainmesh meets through torch's c10d rendezvous (with --rdzv-endpoint) "
            "or a static one (--master-addr). Fix: elasticPolicy.rdzvBackend: c10d in the PyTorchJob."
        )
    return LaunchOptions(
        nproc_per_node=str(args.nproc_per_node),
        nnodes=str(args.nnodes),
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        max_restarts=args.max_restarts,
        join_timeout_s=args.join_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
        rdzv_conf=args.rdzv_conf,
        standalone=args.standalone,
        logs=LogSettings(args.log_dir, args.redirects, args.tee, args.local_ranks_filter),
    )


def check_launch(config: Config, opts: LaunchOptions) -> None:
    """Check the launch flags, the trackers' packages and the data (before anything is started or written)."""
    opts.check()
    check_inputs(config)


def check_inputs(config: Config, recipe: Recipe | None = None) -> None:
    """What any launcher checks before it starts anything: the trackers' packages and the data (`recipe`: the
    caller's own, else the built-in run.recipe names)."""
    check_installed(config.log)
    check_data(config, recipe)


def check_this_machine(config: Config, opts: LaunchOptions) -> None:
    """What only the machine that launches can tell, before the run folder is made: that its device runs
    train.precision (fp8-mixed needs a GPU of compute capability 8.9 or newer). `check` leaves this out: it
    also plans runs for other machines. The workers check again, each on its own device."""
    here = DistEnv(0, 0, 1, opts.nproc(), "127.0.0.1", 0, "single")  # local rank 0 of this node's processes
    try:
        device = select_device(config.dist.device, here)
    except RuntimeError:
        return  # no such device here: every worker says so, with the fix
    check_precision_supported(config.train.precision, device, config.float8)


def resolve_all(config: Config, opts: LaunchOptions) -> list[Job]:
    """Check the launch flags and the data, and resolve the job at every world size this launch may run at
    (several when elastic)."""
    check_launch(config, opts)
    worlds = opts.world_sizes()
    return [resolve(config, world, worlds) for world in worlds]


def launch_into(
    opts: LaunchOptions, jobs: list[Job], job: Job, run_dir: Path, launch_id: str, resume_hint: str | None = None
) -> int:
    """Hold `run_dir`'s lock, write (or, on a node that joins, match) the job's config there and launch its
    workers; the exit code for the CLI. `jobs`: the job at every world size the launch may run at, for the log;
    `launch_id`: the same on every node of a multi-node job; `resume_hint`: the command that continues the run
    after a stop (None: none to print)."""
    with hold_run_dir(job, run_dir, launch_id, resume_hint) as config_path:
        if opts.logs.log_dir is None:  # every rank's output, kept in the run folder (a real folder inside it)
            logs_dir = str(make_dirs(run_dir, LOGS_DIR))
            opts = dataclasses.replace(opts, logs=dataclasses.replace(opts.logs, log_dir=logs_dir))
        for each in jobs:
            log.info("world size %d: %s", each.world_size, each.batch.describe())
        entry = ["trainmesh", job.config.run.recipe, "--config", str(config_path), "--run-dir", str(run_dir)]
        return launch(opts, [*entry, "--job", launch_id], module=True, run_id=run_dir.name, resume_hint=resume_hint)


@contextlib.contextmanager
def hold_run_dir(job: Job, run_dir: Path, launch_id: str, resume_hint: str | None = None) -> Iterator[Path]:
    """A launcher's hold on `run_dir` while its workers run: the folder's lock (which the workers' rank 0 joins
    with `launch_id`), no checkpoints of another run there, and the job's config written for its workers (or, on
    a node that joins, matched); yields that file's path. The run's config.toml is the workers' to replace, once
    they have loaded its checkpoint (rundir.commit_config): a launch that fails before leaves it as it was."""
    with RunLock(run_dir, launch_id) as lock:
        refuse_other_runs_checkpoints(job, run_dir, resume_hint)
        path = _write_or_match_config(run_dir, job, launch_id, joined=lock.joined)
        if not lock.joined:
            record_new_run(run_dir, job.config)
        # The file stays when this launch ends: the workers of nodes that joined it may restart and read it again.
        yield path


def refuse_other_runs_checkpoints(job: Job, run_dir: Path, resume_hint: str | None = None) -> None:
    """A new run (not resuming) must start in a folder without checkpoints: they would collide with its own."""
    found = [] if job.resume else list_checkpoints(run_dir)
    if found:
        again = resume_hint or "set checkpoint.resume = true (--resume on the command line)"
        raise LaunchError(
            f"{run_dir} already holds checkpoints (newest: {found[-1].name}); a new run there would collide with "
            f"them. Continue that run with: {again}\nOr start a new run under another --run-id."
        )


def _write_or_match_config(run_dir: Path, job: Job, launch_id: str, joined: bool) -> Path:
    """The launch holding the lock writes the config its workers read; another node of the same job (sharing the
    folder) checks that its own config is the same, instead of overwriting it under running workers."""
    if not joined:
        return write_launch_config(run_dir, job.config, launch_id)
    path = run_dir / LAUNCH_CONFIG_FILE

    def written() -> str:  # this launch's file: an earlier launch's may still be there (a requeued job's)
        try:
            text = read_bytes(path, MAX_CONFIG_BYTES).decode(errors="replace")
        except (OSError, ValueError):
            return ""
        return text if text.startswith(launch_line(launch_id)) else ""

    deadline = time.monotonic() + 30
    while not written() and time.monotonic() < deadline:  # the node holding the lock writes it first
        time.sleep(0.2)
    # checkpoint.resume may differ: a node restarted later (--auto-resume) finds the checkpoints the first start
    # had not made yet, and the workers agree on resuming among themselves.
    ours, theirs = _without_resume(job.config_toml()), _without_resume(written())
    if theirs != ours:
        diff = [line for line in ours if line not in theirs][:5]
        raise LaunchError(
            f"another node of this job wrote {path} with a different config (this node has: {'; '.join(diff)}). "
            "Fix: launch every node with the same --config and overrides."
        )
    return path


def _without_resume(config_toml: str) -> list[str]:
    return [line for line in config_toml.splitlines() if not line.startswith(("resume = ", "#"))]
