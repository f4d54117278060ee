"""Ray Train: trainmesh's worker inside `ray.train.torch.TorchTrainer` (docs/clusters.md, "Ray Train"). `fit` resolves
the job, claims the run folder and runs `run_worker` in every Ray worker.

Details: docs/internals.md#compatraypy
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray.train
from ray.train.torch import TorchConfig, TorchTrainer

from trainmesh.config import Config, ConfigError
from trainmesh.core.dist import existing_group_env
from trainmesh.core.logging import get_logger
from trainmesh.job.launcher import check_inputs
from trainmesh.job.resume import check_resumable
from trainmesh.job.rundir import RunFolder
from trainmesh.job.spec import Job, resolve
from trainmesh.job.worker import run_worker
from trainmesh.metrics.sinks import METRICS_FILE, read_metrics
from trainmesh.recipes import Recipe

log = get_logger(__name__)


@dataclass(frozen=True)
class RayRun:
    """What `fit` returns: trainmesh's run folder and Ray's result."""

    run_dir: Path
    result: ray.train.Result
    """Ray's record of the run. Ray Train 2's `metrics` keep only metrics reported with a Ray checkpoint, which
    trainmesh does not make: read `records()` instead."""

    def records(self) -> list[dict[str, Any]]:
        """The run's metrics.jsonl: a record per logged window (`kind` "train") and evaluation ("val")."""
        return read_metrics(self.run_dir / METRICS_FILE)


def prepare(config: Config, num_workers: int, recipe: Recipe | None = None) -> tuple[Job, Path]:
    """On the driver, before Ray starts anything: the job resolved once for `num_workers` ranks (every check of
    `trainmesh check`), and its run folder (absolute: Ray's workers run in directories of their own), named."""
    check_inputs(config, recipe)  # as `trainmesh run` does: the trackers' packages, the data
    job = resolve(config, num_workers, recipe=recipe)
    out_dir = Path(job.config.run.out_dir).absolute()
    folder = RunFolder.take(out_dir, job.run_id, job.config.run.recipe, resume=job.resume)
    job = job.named(folder.name, resume=job.resume)
    # From here on, a checkpoint in the folder of a new run is its own: Ray restarted the workers (below).
    folder.refuse_other_runs_checkpoints(job.resume)
    check_resumable(job.config, folder.path)
    return job, folder.path


def train_loop_config(job: Job, run_dir: Path, launch_id: str | None = None) -> dict[str, Any]:
    """TorchTrainer's `train_loop_config` for `train_loop_per_worker`. `launch_id`: the id with which the driver
    holds the run folder's lock (`fit` does); None: rank 0 takes it."""
    return {
        "config": job.config,
        "recipe": job.recipe,
        "run_dir": str(run_dir.absolute()),
        "launch_id": launch_id,
        "cwd": os.getcwd(),  # relative paths in the config (data, caches) mean what they mean on the driver
    }


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """In each Ray worker: train the job as one rank of the process group Ray set up, then report the final
    numbers to Ray once (every worker does: Ray's report is a barrier), for its callbacks (`after_report`)."""
    context = ray.train.get_context()
    env = existing_group_env(context.get_local_rank(), context.get_local_world_size())
    if env is None:
        raise RuntimeError(
            "no torch process group in this Ray worker: train_loop_per_worker needs Ray Train's TorchTrainer, "
            "which sets one up (a DataParallelTrainer with another backend does not)."
        )
    run_dir = Path(loop_config["run_dir"])
    config: Config = loop_config["config"]
    resumed = RunFolder(run_dir).resumed_if_checkpointed(config)
    if resumed is not config:
        # The folder held none when the job started (`prepare`), so Ray restarted the workers after a failure
        # (RunConfig's FailureConfig): continue from this job's newest checkpoint, as torchrun's restarts do.
        log.warning("Ray restarted the workers: continuing from the newest checkpoint in %s", run_dir)
        config = resumed
    with _in_directory(Path(loop_config["cwd"])):
        result = run_worker(config, run_dir, recipe=loop_config["recipe"], launch_id=loop_config["launch_id"], env=env)
    metrics = {
        "steps": result.steps,
        "train_loss": result.train_loss,
        "val_loss": result.val_loss,
        "exit_code": result.exit_code,
        "checkpoint": str(result.checkpoint or ""),
        "run_dir": str(run_dir),
    }
    # Ray destroys the group after this returns. The wrapped model (its DDP reducer holds the group) goes
    # first, while the group is alive: see core.dist.teardown on pytorch/pytorch#56297.
    del result
    gc.collect()
    ray.train.report(metrics)


def fit(
    config: Config,
    scaling_config: ray.train.ScalingConfig,
    run_config: ray.train.RunConfig | None = None,
    torch_config: TorchConfig | None = None,
    recipe: Recipe | None = None,
) -> RayRun:
    """Train `config` (complete, from `trainmesh.job.spec.load_config`) on Ray Train's workers; the launcher's part
    (resolve, run folder, its lock, the resume's check) runs here, on the driver. `run_config` defaults to one that
    keeps Ray's own records in `<run>/ray`; with its FailureConfig(max_failures=N), each restart of the workers
    continues from the run's newest checkpoint."""
    workers = scaling_config.num_workers
    if not isinstance(workers, int):  # a Ray Tune search space: the job is resolved for one world size
        raise ConfigError(
            f"ScalingConfig(num_workers={workers!r}): trainmesh resolves the job for one number of ranks before Ray "
            "starts. Fix: ScalingConfig(num_workers=N)."
        )
    job, run_dir = prepare(config, workers, recipe)
    folder = RunFolder(run_dir)
    with folder.held_for(job):
        log.info("run directory: %s; %s", run_dir, job.batch.describe())
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config=train_loop_config(job, run_dir, folder.job_id),
            scaling_config=scaling_config,
            run_config=run_config or ray.train.RunConfig(name="ray", storage_path=str(run_dir)),
            torch_config=torch_config,
        )
        result = trainer.fit()
    return RayRun(run_dir, result)


@contextlib.contextmanager
def _in_directory(path: Path) -> Iterator[None]:
    """Run in the driver's working directory while training, when this node has it (Ray moves each worker into
    a directory of its own); back to Ray's afterwards."""
    if not path.is_dir():
        log.warning("the driver's directory %s is not on this node: relative paths in the config may not resolve", path)
        yield
        return
    previous = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)
