"""`trainmesh check`: resolve and check a job at every world size it may run at, with its memory per rank
(`check --parity` is cli/parity.py)."""

from __future__ import annotations

import argparse

from trainmesh.apps.plan.check import memory_lines
from trainmesh.job.launcher import launch_options, resolve_all
from trainmesh.job.resume import load_run_config


def cmd_check(args: argparse.Namespace, overrides: list[str]) -> int:
    opts = launch_options(args)
    start = load_run_config(args.config, overrides, args.target, auto_resume=args.auto_resume)
    if start.run_dir is not None:
        print(start.describe())
    for job in resolve_all(start.config, opts):
        strategy, dims = job.layout
        print(f"world size {job.world_size}: OK — {strategy} on {dims.describe()}; {job.batch.describe()}")
        print("\n".join(memory_lines(job, opts.nproc())))
    return 0
