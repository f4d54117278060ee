"""The per-rank entry point: `python -m trainmesh <recipe> --config F [--section.key=value ...]`.

The same worker runs under `trainmesh run` (which passes the resolved config and run directory),
plain `torchrun -m trainmesh ...`, SLURM's `srun python -m trainmesh ...`, and a single plain `python`.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from trainmesh.config import Config, ConfigError, dump_toml
from trainmesh.config.loader import config_to_dict
from trainmesh.config.validate import load_config, parallel_layout, validate
from trainmesh.recipes import Recipe, get_recipe
from trainmesh.rundir import default_run_name, write_config
from trainmesh.runtime.dist import store_client
from trainmesh.runtime.env import DistEnv
from trainmesh.runtime.logging import configure_logging, get_logger
from trainmesh.runtime.runtime import Runtime
from trainmesh.strategies import BlockOptions, DDPOptions, FSDPOptions, PipelineOptions
from trainmesh.train.loop import TrainResult, train
from trainmesh.train.preemption import EXIT_PREEMPTED, PreemptionWatch
from trainmesh.train.watchdog import StallWatchdog

log = get_logger(__name__)


def build_runtime(config: Config) -> Runtime:
    strategy, mesh = parallel_layout(config, DistEnv.from_environ().world_size)
    return Runtime(
        strategy=strategy,
        precision=config.train.precision,
        device=config.dist.device,
        backend=config.dist.backend,
        timeout_s=config.dist.timeout_s,
        init_timeout_s=config.dist.init_timeout_s,
        debug=config.dist.debug,
        ddp=DDPOptions(**config_to_dict(config.parallel.ddp)),
        fsdp=FSDPOptions(**config_to_dict(config.parallel.fsdp)),
        blocks=BlockOptions(config.parallel.activation_checkpointing, config.train.compile),
        mesh=mesh,
        pipeline=PipelineOptions(**config_to_dict(config.parallel.pipeline)),
        deterministic=config.run.deterministic,
    )


def run_worker(
    config: Config,
    run_dir: Path | None = None,
    recipe: Recipe | None = None,
    before_teardown: Callable[[TrainResult], None] | None = None,
) -> TrainResult:
    """Train `config` in this process as one rank of the job described by the environment.

    `recipe` defaults to the built-in named by run.recipe; pass your own `Recipe` subclass to train it.
    `before_teardown` runs on every rank while the process group still exists, e.g. to gather a
    sharded (fsdp) model's full weights with DTensor.full_tensor().
    """
    validate(config, DistEnv.from_environ().world_size)  # the real world size, e.g. under srun
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    runtime = build_runtime(config)
    try:
        # An elastic restart continues from the newest checkpoint. The restart count is each node's own (a
        # node that replaces a lost one starts at 0 among nodes that restarted) and resuming is collective,
        # so the ranks agree: when any rank restarted, or was asked to resume, all resume.
        config.checkpoint.resume = bool(runtime.all_reduce(float(restarted or config.checkpoint.resume), "max"))
        if run_dir is None:  # rank 0 names the run; everyone uses its choice
            name = config.run.name or default_run_name(config.run.recipe)
            run_dir = Path(runtime.broadcast_object(str(Path(config.run.out_dir) / name)))
        if runtime.is_main_process:
            write_config(run_dir, config)
            log.info("run directory: %s", run_dir)
            log.info("resolved config:\n%s", dump_toml(config_to_dict(config)))
        runtime.barrier()
        stall_watch = StallWatchdog(
            run_dir, config.dist.stall_timeout_s, runtime.rank, runtime.world_size, store_client("watchdog")
        )
        with PreemptionWatch() as preemption, stall_watch as watchdog:
            result = train(config, recipe or get_recipe(config.run.recipe), runtime, run_dir, preemption, watchdog)
        if runtime.is_main_process:
            _report(result, run_dir)
        if before_teardown is not None:
            before_teardown(result)
    except BaseException as e:
        # Report at once, on every rank: peers may fail next, and torchrun then stops this process too.
        if not isinstance(e, (KeyboardInterrupt, SystemExit)):
            log.error("rank %d failed: %s", runtime.rank, e, exc_info=True)
        runtime.teardown(success=False)
        raise
    runtime.teardown(success=True)
    return result


def _report(result: TrainResult, run_dir: Path) -> None:
    if result.preempted:
        log.warning(
            "preempted at step %d; checkpoint %s. Continue with: --resume --run-id %s (exit code %d)",
            result.steps,
            result.checkpoint,
            run_dir.name,
            EXIT_PREEMPTED,
        )
        return
    start = "" if math.isnan(result.initial_val_loss) else f" (at start {result.initial_val_loss:.4f})"
    log.info(
        "done: %d steps | train loss %.4f | val loss %.4f%s", result.steps, result.train_loss, result.val_loss, start
    )
    log.info("run directory: %s (config.toml, metrics.jsonl, tensorboard/, loss.png, checkpoints/)", run_dir)
    if result.sample:
        log.info("sample from the trained model:\n%s\n%s\n%s", "-" * 60, result.sample, "-" * 60)


def parse_worker_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m trainmesh", description=__doc__)
    parser.add_argument("recipe", help="recipe to train (gpt)")
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("--run-dir", help="run directory (default: <run.out_dir>/<run.name>)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    args, rest = parser.parse_known_args(argv)
    overrides = [a for a in rest if a != "--"]
    bad = [a for a in overrides if not (a.startswith("--") and "=" in a and "." in a.split("=", 1)[0])]
    if bad:
        parser.error(f"unrecognised arguments {bad}; overrides look like --section.key=value")
    return args, overrides


@record  # torchrun reports the rank and traceback of a failed worker from this
def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_worker_args(sys.argv[1:] if argv is None else argv)
    configure_logging(int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))))
    try:
        if args.resume:
            overrides.append("--checkpoint.resume=true")
        config = load_config(args.config, overrides, args.recipe)
        result = run_worker(config, Path(args.run_dir) if args.run_dir else None)
    except ConfigError as e:
        logging.getLogger("trainmesh").error("config error: %s", e)
        return 2
    return EXIT_PREEMPTED if result.preempted else 0


if __name__ == "__main__":
    sys.exit(main())
