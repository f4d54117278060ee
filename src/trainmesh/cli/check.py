"""`trainmesh check`: resolve and check a job at every world size it may run at, with its memory per rank against
this machine's devices or, with --cluster, the target's (`check --parity` is cli/parity.py)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import torch

from trainmesh.apps.plan.check import choose_gradient_mode, local_cluster, memory_lines
from trainmesh.apps.plan.cluster import Cluster, get_cluster
from trainmesh.config import ConfigError
from trainmesh.job.launcher import launch_options, resolve_all
from trainmesh.job.resume import load_run_config
from trainmesh.job.spec import Job


def cmd_check(args: argparse.Namespace, overrides: list[str]) -> int:
    opts = launch_options(args)
    target = _target_devices(args, opts.nproc())  # before the config: a bad flag is the first thing said
    start = load_run_config(args.config, overrides, args.target, auto_resume=args.auto_resume)
    if start.run_dir is not None:
        print(start.describe())
    jobs, why = choose_gradient_mode(resolve_all(start.config, opts), target)
    if why:
        print(why)
    for job in jobs:
        strategy, dims = job.layout
        print(f"world size {job.world_size}: OK — {strategy} on {dims.describe()}; {job.batch.describe()}")
        print("\n".join(memory_lines(job, target)))
        if args.dry_run:
            print("\n".join(_dry_run_lines()(job, target)))
    if args.cluster is None and opts.nnodes != "1":
        print("  (memory against this machine's devices: add --cluster h100, or a cluster file, for the target's)")
    return 0


def _target_devices(args: argparse.Namespace, processes_per_node: int) -> Cluster:
    """The devices memory is compared with: --cluster's, else this machine's; less --memory-margin."""
    margin = args.memory_margin
    if margin is not None and not 0 <= margin < 1:
        raise ConfigError(f"--memory-margin={margin}: the fraction of device memory kept free, from 0 to below 1")
    try:
        cluster = (
            get_cluster(args.cluster, 1, processes_per_node) if args.cluster else local_cluster(processes_per_node)
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return cluster if margin is None else dataclasses.replace(cluster, memory_margin=margin)


def _dry_run_lines() -> Callable[[Job, Cluster], list[str]]:
    """The dry run's report, imported only when asked: it is built on torch's private fake-tensor and fake-group
    tools (apps/plan/fake.py, written against torch 2.13), which another torch may lack."""
    try:
        from trainmesh.apps.plan.dryrun import dry_run_lines
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            f"--dry-run uses torch's fake tensors and fake process group as torch 2.13 has them, and this torch "
            f"({torch.__version__}) differs: {e}. Fix: check without --dry-run (the plan's memory line), or run it "
            "where torch 2.13 is installed."
        ) from None
    return dry_run_lines
