"""What each `trainmesh` command does (the parser is in trainmesh.cli, which imports this module only once
the command line has been parsed)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import re
import shlex
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainmesh.checkpoint.catalog import CHECKPOINT_DIR, list_checkpoints
from trainmesh.config import Config
from trainmesh.config.schema import RunConfig
from trainmesh.core.dist import select_device
from trainmesh.core.env import DistEnv
from trainmesh.core.files import make_dirs, read_bytes
from trainmesh.core.rank_logs import LOGS_DIR, NO_LOG_DIR, LogSettings
from trainmesh.job import Job, check_data, resolve
from trainmesh.launch import LaunchError, LaunchOptions, launch
from trainmesh.metrics.trackers import check_installed
from trainmesh.precision import check_precision_supported
from trainmesh.recipes import Recipe, get_recipe
from trainmesh.resume import load_run_config
from trainmesh.rundir import (
    LAUNCH_CONFIG_FILE,
    MAX_CONFIG_BYTES,
    RunLock,
    check_auto_resume,
    launch_line,
    new_job_id,
    record_new_run,
    take_run_dir,
    write_launch_config,
)

log = logging.getLogger("trainmesh")


def launch_options(args: argparse.Namespace) -> LaunchOptions:
    """The launch flags of `run`, `check` and `bench` (cli/launch_flags.py, which also reads torchrun's PET_
    variables) as LaunchOptions."""
    backend = os.environ.get("PET_RDZV_BACKEND", "c10d")
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


def run_script(args: argparse.Namespace) -> int:
    """`trainmesh run train.py ...`: the script and its arguments on every rank; its ranks' output goes to the
    console, as under plain torchrun, or with --log-dir into files (a script has no run folder to keep them in)."""
    opts = launch_options(args)
    if opts.logs.log_dir is None:
        opts = dataclasses.replace(opts, logs=dataclasses.replace(opts.logs, log_dir=NO_LOG_DIR))
    return launch(opts, [args.target, *args.rest], module=False)


def cmd_run(args: argparse.Namespace, overrides: list[str]) -> int:
    """`trainmesh run <recipe>`: check everything, claim the run folder, launch; a resume continues from the run's
    own config (resume.py)."""
    opts = launch_options(args)
    start = load_run_config(args.config, overrides, args.target, auto_resume=args.auto_resume)
    jobs = resolve_all(start.config, opts)  # before anything is written
    config = jobs[0].config
    check_this_machine(config, opts)
    run_id, out_dir = config.run.id, Path(config.run.out_dir)
    suffix = opts.default_run_suffix()  # the nodes of a multi-node job agree on their folder and job id
    if suffix and not run_id:
        run_id = f"{config.run.recipe}-{re.sub(r'[^A-Za-z0-9._-]', '-', suffix)}"
    auto = check_auto_resume(args.auto_resume, config.checkpoint.resume, run_id)
    run_dir = take_run_dir(out_dir, run_id, config.run.recipe, config.checkpoint.resume)
    hint = resume_command(args, config, run_dir.name)
    if start.run_dir is not None:
        log.info("%s", start.describe())
        if start.finished:
            longer = resume_command(args, config, run_dir.name, f"--train.max_steps={2 * start.step}")
            log.warning(
                "run %s has finished: its newest checkpoint is at step %d, train.max_steps=%d; nothing to train. "
                "To train it longer: %s",
                run_dir.name,
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
    auto = auto and bool(list_checkpoints(run_dir))  # --auto-resume: resume once there is something to resume
    job = jobs[0].named(run_dir.name, resume=config.checkpoint.resume or elastic or auto)
    return launch_into(opts, jobs, job, run_dir, suffix or new_job_id(), hint)


def resume_command(args: argparse.Namespace, config: Config, run_id: str, *overrides: str) -> str:
    """The command that continues run `run_id`: this launch's own flags (`args.relaunch`, which the CLI keeps
    from the command line as typed), --resume and the run's name, and where its folder is when that is not the
    default (the run's config.toml has the rest); `overrides` after them."""
    relaunch = getattr(args, "relaunch", None) or ["trainmesh", "run", config.run.recipe]
    where = [] if config.run.out_dir == RunConfig.out_dir else [f"--run.out_dir={config.run.out_dir}"]
    extra = [*where, *overrides]
    return shlex.join([*relaunch, "--resume", "--run-id", run_id, *(["--", *extra] if extra else [])])


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


def cmd_check(args: argparse.Namespace, overrides: list[str]) -> int:
    opts = launch_options(args)
    from trainmesh.plan.check import memory_lines

    start = load_run_config(args.config, overrides, args.target, auto_resume=args.auto_resume)
    if start.run_dir is not None:
        print(start.describe())
    for job in resolve_all(start.config, opts):
        strategy, dims = job.layout
        print(f"world size {job.world_size}: OK — {strategy} on {dims.describe()}; {job.batch.describe()}")
        print("\n".join(memory_lines(job, opts.nproc())))
    return 0


def cmd_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    """`trainmesh plan`: the table and the command to run, on stdout (trainmesh.plan.command does the work)."""
    from trainmesh.plan.command import plan_command

    text, code = plan_command(args, overrides)
    print(text)
    return code


def cmd_ckpt(args: argparse.Namespace) -> int:
    from trainmesh.checkpoint.export import ExportUsageError
    from trainmesh.checkpoint.inspect import checkpoints_at, describe, verify_all

    if args.action != "export" and (args.output is not None or args.force or args.format is not None):
        log.error("-o/--output, --force and --format apply to `trainmesh ckpt export` only")
        return 2
    try:
        if args.action == "inspect":
            print("\n\n".join(describe(ckpt) for ckpt in checkpoints_at(Path(args.path))))
            return 0
        if args.action == "export":
            return _export(args)
        if args.action == "upgrade":
            return _upgrade(checkpoints_at(Path(args.path)))
        verdicts = verify_all(Path(args.path))
    except ExportUsageError:
        raise  # the command needs fixing: exit 2 (cli.main), like any other command-line problem
    except (FileNotFoundError, ValueError) as e:  # a checkpoint refused: exit 1, as `verify` finding a problem
        log.error("%s", e)
        return 1
    for verdict in verdicts:
        print(f"OK      {verdict.path}" if verdict.ok else f"INVALID {verdict.path}")
        for problem in verdict.problems:
            print(f"        {problem}")
    return 0 if all(v.ok for v in verdicts) else 1


def _export(args: argparse.Namespace) -> int:
    """`trainmesh ckpt export [--format safetensors|hf]`: one safetensors file under trainmesh's names, or a
    folder whose contents the recipe that converts to that format decides."""
    from trainmesh.checkpoint.export import export_checkpoint, export_folder

    if args.format in (None, "safetensors"):
        done = export_checkpoint(Path(args.path), args.output, force=args.force)
    else:
        assert args.format == "hf", args.format  # the parser's choices
        from trainmesh.recipes.gpt.hf_export import HFFormat

        done = export_folder(Path(args.path), HFFormat(), args.output, force=args.force)
    print(f"exported step {done.step} of {done.checkpoint}")
    print(f"  -> {done.path}: {done.tensors} tensors, {done.bytes:,} bytes")
    return 0


def _upgrade(checkpoints: list[Path]) -> int:
    """Upgrade each checkpoint with the recipe that saved it, under the run folder's lock (not while it trains)."""
    from trainmesh.checkpoint.state import TrainerState
    from trainmesh.checkpoint.upgrade import upgrade_checkpoint

    def convert(state: dict[str, Any], saved: TrainerState) -> list[str]:
        recipe = get_recipe(str(saved.config.get("run", {}).get("recipe", "gpt")))
        return recipe.upgrade_checkpoint(state, saved.config.get("model", {}))

    folder = checkpoints[0].parent
    in_run = folder.name == CHECKPOINT_DIR  # a checkpoint copied elsewhere has no run folder to lock
    with RunLock(folder.parent, new_job_id()) if in_run else contextlib.nullcontext():
        for ckpt in checkpoints:
            changes = upgrade_checkpoint(ckpt, convert)
            print(f"upgraded {ckpt}:" if changes else f"current  {ckpt} (nothing to convert)")
            for change in changes:
                print(f"        {change}")
    return 0
