"""The launcher side of `trainmesh run`, `check` and `bench`: the launch flags, what is checked before anything
starts, and the launch of a resolved job into its run folder (job/rundir.py)."""

from __future__ import annotations

import argparse
import dataclasses
import logging

from trainmesh.config import Config
from trainmesh.core.dist import select_device
from trainmesh.core.env import DistEnv, read_var
from trainmesh.core.files import make_dirs
from trainmesh.job.rundir import RunFolder
from trainmesh.job.spec import Job, check_data, resolve
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
    opts: LaunchOptions, jobs: list[Job], job: Job, folder: RunFolder, resume_hint: str | None = None
) -> int:
    """Hold the run folder, write (or, on a node that joins, match) the job's config there and launch its workers;
    the exit code for the CLI. `jobs`: the job at every world size the launch may run at, for the log; the folder's
    `job_id` is the same on every node of a multi-node job; `resume_hint`: the command that continues the run after
    a stop (None: none to print)."""
    with folder.held_for(job, resume_hint) as config_path:
        if opts.logs.log_dir is None:  # every rank's output, kept in the run folder (a real folder inside it)
            logs_dir = str(make_dirs(folder.path, LOGS_DIR))
            opts = dataclasses.replace(opts, logs=dataclasses.replace(opts.logs, log_dir=logs_dir))
        for each in jobs:
            log.info("world size %d: %s", each.world_size, each.batch.describe())
        entry = ["trainmesh", job.config.run.recipe, "--config", str(config_path), "--run-dir", str(folder.path)]
        argv = [*entry, "--job", folder.job_id]
        return launch(opts, argv, module=True, run_id=folder.name, resume_hint=resume_hint)
