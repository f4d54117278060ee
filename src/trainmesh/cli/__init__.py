"""The `trainmesh` command: run, check, bench, plan, env, slurm, k8s, ckpt, data, horovodrun. This module only parses
(no torch: `--help` is instant), then imports the verb's own module.

Details: docs/internals.md#cli__init__py
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from pathlib import Path

from trainmesh.cli.flags import RECIPE_NAMES, build_parser, relaunch_tokens, split_recipe_args
from trainmesh.cli.launch_flags import refuse_bad_environment
from trainmesh.core.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR, UserError
from trainmesh.core.logging import configure_logging

__all__ = ["RECIPE_NAMES", "build_parser", "main"]
log = logging.getLogger("trainmesh")


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["horovodrun"]:
        from trainmesh.cli.horovodrun import cmd_horovodrun

        return cmd_horovodrun(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _dispatch(parser, args, argv)
    except UserError as e:
        log.error("%s", e)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:  # before torchrun's agent took over the signal: nothing was started yet
        log.warning("interrupted (Ctrl-C) before the workers started")
        return EXIT_INTERRUPTED


def invoked_as() -> list[str]:
    """How to run this command again, as a printed command must: `trainmesh` when that name on PATH is this very
    program, else the path it was started by (`.venv/bin/trainmesh` after `make run`), else python -m trainmesh.cli."""
    started = sys.argv[0]
    if os.path.basename(started) != "trainmesh":  # main() called from Python, or python -m trainmesh.cli
        return [sys.executable, "-m", "trainmesh.cli"]
    found = shutil.which("trainmesh")
    try:
        on_path = found is not None and os.path.samefile(found, started)
    except OSError:  # argv[0] is no path from here (a wrapper's exec -a)
        on_path = False
    return ["trainmesh"] if on_path else [started]


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> int:
    """Run the verb the command line names. Each verb's module (cli/<verb>.py) is imported only now: torch and
    everything else load once the command line is understood, and `data prepare` never loads torch."""
    if args.command == "data":
        from trainmesh.cli.data import cmd_data

        return cmd_data(args)
    if args.command == "env":
        from trainmesh.cli.env import cmd_env

        return cmd_env(args)
    if args.command == "ckpt":
        from trainmesh.cli.ckpt import cmd_ckpt

        return cmd_ckpt(args)
    if args.command == "run" and (args.target.endswith(".py") or Path(args.target).is_file()):
        if not Path(args.target).is_file():
            parser.error(f"script {args.target!r} does not exist")
        refuse_bad_environment(parser, args)
        from trainmesh.cli.run import run_script

        return run_script(args)
    overrides = split_recipe_args(parser, args)
    args.command_line = ["trainmesh", *argv]  # recorded in what bench, parity, slurm and k8s write
    if args.command == "bench":
        from trainmesh.cli.bench import cmd_bench

        return cmd_bench(args, overrides)
    if args.command == "plan":
        from trainmesh.cli.plan import cmd_plan

        return cmd_plan(args, overrides)
    if args.command in ("slurm", "k8s"):
        from trainmesh.cli.schedulers import k8s_manifests, slurm_script

        print(slurm_script(args, overrides) if args.command == "slurm" else k8s_manifests(args, overrides), end="")
        return 0
    if args.command == "check":
        from trainmesh.cli.parity import check_parity_flags, cmd_parity

        check_parity_flags(args)
        if args.parity:
            return cmd_parity(args, overrides)
        from trainmesh.cli.check import cmd_check

        return cmd_check(args, overrides)
    from trainmesh.cli.run import cmd_run

    args.relaunch = relaunch_tokens(argv, invoked_as())  # for the command that resumes the run, which it prints
    return cmd_run(args, overrides)
