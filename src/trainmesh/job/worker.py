"""The per-rank entry point: `python -m trainmesh <recipe> --config F [--section.key=value ...]`.

The same worker runs under `trainmesh run` (which passes the resolved config and run directory),
plain `torchrun -m trainmesh ...`, SLURM's `srun python -m trainmesh ...`, and a single plain `python`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from trainmesh.config import Config, ConfigError
from trainmesh.config.schema import RUN_ID
from trainmesh.core.dist import current_env, store_client
from trainmesh.core.env import DistEnv, launcher_rank, restart_count
from trainmesh.core.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR, UserError
from trainmesh.core.logging import configure_logging, get_logger
from trainmesh.job.resume import load_run_config
from trainmesh.job.rundir import SAME_CONFIG_FIX, RunFolder, RunFolderError, config_identity
from trainmesh.job.spec import Job, load_config, resolve
from trainmesh.launch.exit_records import record_exit, record_start
from trainmesh.recipes import Recipe
from trainmesh.runtime.runtime import Runtime
from trainmesh.train.faults import FaultSchedule
from trainmesh.train.hooks import RunHooks
from trainmesh.train.loop import TrainResult, train
from trainmesh.train.parity import ParityProbe
from trainmesh.train.preemption import PreemptionWatch
from trainmesh.train.watchdog import StallWatchdog, attempt_label

log = get_logger(__name__)


def run_worker(
    config: Config,
    run_dir: Path | None = None,
    recipe: Recipe | None = None,
    before_teardown: Callable[[TrainResult], None] | None = None,
    launch_id: str | None = None,
    env: DistEnv | None = None,
) -> TrainResult:
    """Train `config` (complete, from `trainmesh.job.spec.load_config`) in this process as one rank of the job
    described by the environment, or of the process group that exists already (Ray Train's: adopted, and left
    for its owner to destroy).

    `recipe` defaults to the built-in named by run.recipe; pass your own `Recipe` subclass to train it.
    `before_teardown` runs on every rank while the process group still exists, e.g. to gather a
    sharded (fsdp) model's full weights with DTensor.full_tensor(). `launch_id` is the id of the launch that
    holds the run folder's lock (`trainmesh run` passes it); without it, rank 0 takes the lock. `env`: this
    process's place in the job, where its caller knows better (Ray Train's context knows the node-local ranks);
    by default the existing process group's, else the environment's.
    """
    env = env or current_env()  # a process group set up already (by Ray Train, say) is adopted: its rank and size
    job = resolve(config, env.world_size, recipe=recipe)  # the real world size, e.g. under srun
    runtime = job.runtime(env)
    folder: RunFolder | None = None
    try:
        # An elastic restart continues from the newest checkpoint. The restart count is each node's own (a node
        # that replaces a lost one starts at 0 among nodes that restarted), so the ranks agree: when any rank
        # restarted, or was asked to resume, all resume.
        restarted = restart_count() > 0
        resume = _agree_on_config(job, runtime, wants_resume=restarted or job.resume)
        folder = _take_folder(job, run_dir, launch_id, runtime, check_resume=job.resume and not restarted)
        # What config.toml and every checkpoint record; a --run-dir of any other name leaves run.id as it is.
        job = job.named(folder.name if RUN_ID.fullmatch(folder.name) else job.run_id, resume=resume)
        runtime.agreed(folder.hold_as_worker)  # every rank, for its lifetime
        runtime.on_main(lambda: folder.record_new_run(job.config))  # a new run's record, from its start
        result = _train(job, folder, runtime)
        if runtime.is_main_process:
            _log_result(result, folder.path, job.config.run.recipe, launch_id is not None)
        if before_teardown is not None:
            before_teardown(result)
    except BaseException as e:
        # Report at once, on every rank: peers may fail next, and torchrun then stops this process too.
        if not isinstance(e, (UserError, KeyboardInterrupt, SystemExit)):  # user errors: main says what to fix
            log.error("rank %d failed: %s", runtime.rank, e, exc_info=True)
        runtime.teardown(success=False)
        raise
    finally:
        if folder is not None:
            folder.release()
    runtime.teardown(success=True)
    return result


def _agree_on_config(job: Job, runtime: Runtime, wants_resume: bool) -> bool:
    """Collective: refuse a job whose ranks run different configs (the nodes of a job each read their own
    launcher's config file), and decide whether it resumes: when any rank `wants_resume`."""
    identity = json.dumps(config_identity(job.config), sort_keys=True)
    views = runtime.all_gather_object((hashlib.sha256(identity.encode()).hexdigest(), wants_resume))
    odd = [rank for rank, (digest, _) in enumerate(views) if digest != views[0][0]]
    if odd:  # every rank raises
        raise ConfigError(
            f"rank(s) {odd} were started with another config than rank 0 (the nodes of this job were launched with "
            f"different configs or overrides). {SAME_CONFIG_FIX}"
        )
    return any(wants for _, wants in views)


def _take_folder(
    job: Job, run_dir: Path | None, launch_id: str | None, runtime: Runtime, check_resume: bool
) -> RunFolder:
    """Collective: the run folder, named by rank 0 when the launcher did not, and locked for this job (by the
    launcher that passed `launch_id`, else by rank 0 here). Every rank gets the same folder or error; `check_resume`:
    a run to resume must have a folder already."""
    run = job.config.run
    outcome: tuple[str, str] = ("", "")
    folder = None
    if runtime.is_main_process:
        try:
            if run_dir is not None:  # named by the launcher (which made it) or the library's caller
                folder = RunFolder.named(run_dir.parent, run_dir.name, launch_id)
            else:
                folder = RunFolder.take(Path(run.out_dir), run.id, run.recipe, resume=check_resume, job_id=launch_id)
            folder.lock()  # with `launch_id`: joins the lock of the launcher that started this job
            outcome = (str(folder.path), "")
        except UserError as e:
            outcome = ("", str(e))
    path, error = runtime.broadcast_object(outcome)
    if error:
        raise RunFolderError(error)
    return folder or RunFolder(Path(path), launch_id)


def _train(job: Job, folder: RunFolder, runtime: Runtime) -> TrainResult:
    """Train `job` in `folder`, under the preemption watch, the stall watchdog and the test hooks."""
    if runtime.is_main_process:
        strategy, dims = job.layout
        recipe, where = job.config.run.recipe, dims.describe()
        log.info("%s recipe, %s on %s; run directory: %s", recipe, strategy, where, folder.path)
        log.log(logging.INFO if job.config.log.verbose else logging.DEBUG, "resolved config:\n%s", job.config_toml())
    label = runtime.broadcast_object(attempt_label())  # rank 0's: every rank reports into one folder
    stall_watch = StallWatchdog(
        folder.path, job.config.dist.stall_timeout_s, runtime.rank, runtime.world_size, store_client("watchdog"), label
    )
    faults = FaultSchedule.from_environ(runtime.rank, folder.path)  # the test hook, parsed once
    with PreemptionWatch() as preemption, stall_watch as watchdog:

        def started(step: int) -> None:  # config.toml is replaced once the run's checkpoint has loaded
            runtime.on_main(lambda: folder.commit_config(job.config, step))

        hooks = RunHooks(preemption, watchdog, faults, ParityProbe.from_environ(), started)
        return train(job.config, job.batch, job.recipe, runtime, folder.path, hooks)


def _log_result(result: TrainResult, run_dir: Path, recipe: str, by_trainmesh_run: bool) -> None:
    if result.preempted:
        log.warning(
            "stopped at step %d with checkpoint %s (exit code %d)", result.steps, result.checkpoint, result.exit_code
        )
        if not by_trainmesh_run:  # else its launcher prints the command, with the launch flags it was given
            log.warning("%s", _continue_hint(run_dir, recipe))
        return
    start = "" if math.isnan(result.initial_val_loss) else f" (at start {result.initial_val_loss:.4f})"
    log.info(
        "done: %d steps | train loss %.4f | val loss %.4f%s", result.steps, result.train_loss, result.val_loss, start
    )
    log.info("run directory: %s (config.toml, metrics.jsonl, tensorboard/, loss.png, checkpoints/)", run_dir)
    if result.sample:
        log.info("sample from the trained model:\n%s\n%s\n%s", "-" * 60, result.sample, "-" * 60)


def _continue_hint(run_dir: Path, recipe: str) -> str:
    """How to continue a run that this worker's own launcher (plain python, torchrun, srun, mpirun) started."""
    worker_args = ["-m", "trainmesh", recipe, "--resume", "--run-dir", str(run_dir)]
    if current_env().source == "single":
        return f"Continue with: {shlex.join([sys.executable, *worker_args])}"
    return f"To continue, launch this job again as before, the worker's arguments now: {shlex.join(worker_args)}"


def parse_worker_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m trainmesh", description=__doc__)
    parser.add_argument("recipe", help="recipe to train (gpt | resnet)")
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("--run-dir", help="run directory (default: <run.out_dir>/<run.id>)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    parser.add_argument(
        "--auto-resume",
        action="store_true",
        help="continue the run named by --run.id from its newest checkpoint when it has one, else start it",
    )
    parser.add_argument("--job", help=argparse.SUPPRESS)  # the launch that holds the run folder's lock
    args, rest = parser.parse_known_args(argv)
    overrides = [a for a in rest if a != "--"]
    bad = [a for a in overrides if not (a.startswith("--") and "=" in a and "." in a.split("=", 1)[0])]
    if bad:
        parser.error(f"unrecognised arguments {bad}; overrides look like --section.key=value")
    return args, overrides


@record  # torchrun reports the rank and traceback of a failed worker from this
def main(argv: list[str] | None = None) -> int:
    record_start()  # for the launcher's report after a stop (launch/exit_records.py)
    code, saved = _main(argv)
    record_exit(code, stopped_with_checkpoint=saved)
    return code


def _main(argv: list[str] | None) -> tuple[int, bool]:
    """The exit code, and whether the rank stopped at a step boundary with a checkpoint (on SIGTERM or Ctrl-C)."""
    args, overrides = parse_worker_args(sys.argv[1:] if argv is None else argv)
    configure_logging(launcher_rank())  # torchrun's, MPI's or SLURM's: only rank 0 logs at INFO
    try:
        if args.resume:
            overrides.append("--checkpoint.resume=true")
        run_dir = Path(args.run_dir) if args.run_dir else None
        if args.job:  # started by `trainmesh run`, with the config it resolved (a resume's from the run's own)
            config = load_config(args.config, overrides, args.recipe)
        else:  # plain python, torchrun, srun: a resume starts from the run's own config here
            start = load_run_config(args.config, overrides, args.recipe, auto_resume=args.auto_resume, run_dir=run_dir)
            if start.run_dir is not None:
                log.info("%s", start.describe())
            config = start.config
        if args.auto_resume:
            RunFolder.check_auto_resume(True, args.resume, config.run.id or (run_dir.name if run_dir else ""))
            run_dir = run_dir or Path(config.run.out_dir) / config.run.id  # named: created when missing
            config = RunFolder(run_dir).resumed_if_checkpointed(config)  # else a new run: nothing to resume yet
        result = run_worker(config, run_dir, launch_id=args.job)
    except UserError as e:
        log.error("%s", e)  # what to fix, one line per rank: a traceback would only hide it
        return EXIT_USER_ERROR, False
    except KeyboardInterrupt:
        log.warning("stopped by Ctrl-C before a step boundary: nothing was saved by this attempt")
        return EXIT_INTERRUPTED, False
    return result.exit_code, result.preempted


if __name__ == "__main__":
    sys.exit(main())
