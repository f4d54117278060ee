"""`trainmesh run`: a recipe (check everything, claim the run folder, launch) or any torchrun-style script."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
from pathlib import Path

from trainmesh.apps.plan.check import choose_gradient_mode, local_cluster
from trainmesh.config import Config
from trainmesh.config.schema import RunConfig
from trainmesh.job.launcher import check_this_machine, launch_into, launch_options, resolve_all
from trainmesh.job.resume import load_run_config
from trainmesh.job.rundir import RunFolder
from trainmesh.launch import launch
from trainmesh.launch.rank_logs import NO_LOG_DIR

log = logging.getLogger("trainmesh")


def run_script(args: argparse.Namespace) -> int:
    """`trainmesh run train.py ...`: the script and its arguments on every rank; its ranks' output goes to the
    console, as under plain torchrun, or with --log-dir into files (a script has no run folder to keep them in)."""
    opts = launch_options(args)
    if opts.logs.log_dir is None:
        opts = dataclasses.replace(opts, logs=dataclasses.replace(opts.logs, log_dir=NO_LOG_DIR))
    return launch(opts, [args.target, *args.rest], module=False)


def cmd_run(args: argparse.Namespace, overrides: list[str]) -> int:
    """`trainmesh run <recipe>`: check everything, claim the run folder, launch; a resume continues from the run's
    own config (job/resume.py)."""
    opts = launch_options(args)
    start = load_run_config(args.config, overrides, args.target, auto_resume=args.auto_resume)
    jobs, why = choose_gradient_mode(resolve_all(start.config, opts), local_cluster(opts.nproc()))  # before writing
    if why:  # each node's launcher decides on its own devices: alike on alike nodes
        mixed = "; on nodes with different devices set it explicitly" if opts.nnodes != "1" else ""
        log.info("%s%s", why, mixed)
    config = jobs[0].config
    check_this_machine(config, opts)
    suffix = opts.default_run_suffix()  # the nodes of a multi-node job agree on their folder and job id
    run_id = config.run.id or (RunFolder.shared_name(config.run.recipe, suffix) if suffix else "")
    auto = RunFolder.check_auto_resume(args.auto_resume, config.checkpoint.resume, run_id)
    out_dir, resume = Path(config.run.out_dir), config.checkpoint.resume
    folder = RunFolder.take(out_dir, run_id, config.run.recipe, resume=resume, job_id=suffix)
    hint = resume_command(args, config, folder.name)
    if start.run_dir is not None:
        log.info("%s", start.describe())
        if start.finished:
            longer = resume_command(args, config, folder.name, f"--train.max_steps={2 * start.step}")
            log.warning(
                "run %s has finished: its newest checkpoint is at step %d, train.max_steps=%d; nothing to train. "
                "To train it longer: %s",
                folder.name,
                start.step,
                config.train.max_steps,
                longer,
            )
            return 0
    low, high = opts.node_bounds()
    # Membership changes restart every worker, and a node that did not fail (one joining, or its peers when a
    # job grows) keeps restart count 0: so every (re)start of an elastic job continues from the run's newest
    # checkpoint, when there is one.
    elastic = low < high and not config.checkpoint.resume
    if elastic:
        log.info(
            "elastic --nnodes %s: workers continue from this run's newest checkpoint when they (re)start", opts.nnodes
        )
    auto = auto and folder.has_checkpoints()  # --auto-resume: resume once there is something to resume
    job = jobs[0].named(folder.name, resume=resume or elastic or auto)
    return launch_into(opts, jobs, job, folder, hint)


def resume_command(args: argparse.Namespace, config: Config, run_id: str, *overrides: str) -> str:
    """The command that continues run `run_id`: this launch's own flags (`args.relaunch`, which the CLI keeps
    from the command line as typed), --resume and the run's name, and where its folder is when that is not the
    default (the run's config.toml has the rest); `overrides` after them."""
    relaunch = getattr(args, "relaunch", None) or ["trainmesh", "run", config.run.recipe]
    where = [] if config.run.out_dir == RunConfig.out_dir else [f"--run.out_dir={config.run.out_dir}"]
    extra = [*where, *overrides]
    return shlex.join([*relaunch, "--resume", "--run-id", run_id, *(["--", *extra] if extra else [])])
