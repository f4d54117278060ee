"""The `trainmesh` command: run, check, bench, plan, env, slurm, k8s, ckpt, data, horovodrun.

trainmesh run gpt --config configs/gpt-tiny.toml --nproc-per-node 2 -- --optim.lr=3e-4
trainmesh run examples/custom_loop.py --epochs 2     # any torchrun-style script
trainmesh check gpt --config configs/gpt2-124m.toml --nproc-per-node 8 --nnodes 4 --rdzv-endpoint 10.0.0.1:29400
trainmesh check gpt --config configs/gpt-tiny.toml --nproc-per-node 2 --parity   # 2 processes train like 1?
trainmesh bench gpt --config configs/gpt-tiny.toml --nprocs 1,2 --mode both   # weak and strong scaling
trainmesh plan gpt --config configs/gpt2-124m.toml --cluster h100 --nodes 4   # every layout: memory, step time
trainmesh env [--full]                              # --full adds torch.utils.collect_env's report
trainmesh slurm gpt --config configs/gpt2-124m.toml --nodes 4 --gpus-per-node 8 --time 24:00:00 > gpt.sbatch
trainmesh k8s gpt --config configs/gpt2-124m.toml --nodes 4 --gpus-per-node 8 --image REGISTRY/trainmesh:TAG
trainmesh ckpt verify runs/<run-id>                   # or: ckpt inspect runs/<run-id>/checkpoints/step_...
trainmesh ckpt export runs/<run-id>                   # newest valid checkpoint -> runs/<run-id>/export/*.safetensors
trainmesh ckpt export --format hf runs/<run-id>       # ... as a Hugging Face GPT-2 folder (from_pretrained loads it)
trainmesh horovodrun -np 2 python train.py            # a Horovod script (import trainmesh.horovod as hvd)
trainmesh data prepare corpus/ --tokenizer gpt2 --out data/corpus   # text, JSON Lines, Parquet -> token shards

This package only parses (every command's flags are in flags.py): it imports no torch, so `trainmesh --help` is
instant. What each command does is in trainmesh.commands, imported once the command line is understood;
`data prepare` is trainmesh.data.prepare, called from here without importing trainmesh.commands, so that
neither it nor its workers load torch.
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
from trainmesh.core.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, EXIT_USER_ERROR, UserError
from trainmesh.core.logging import configure_logging

__all__ = ["RECIPE_NAMES", "build_parser", "main"]
log = logging.getLogger("trainmesh")


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["horovodrun"]:
        return _horovodrun(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "data":  # before `commands`, which imports torch: the tokenising processes stay small
            return _prepare_data(args)
        from trainmesh import commands  # torch and everything else, now that the command line is understood

        if args.command == "env":
            from trainmesh.core.report import environment_report, pytorch_report

            print(environment_report())
            if args.full:
                print("\n" + pytorch_report())
            return 0
        if args.command == "ckpt":
            return commands.cmd_ckpt(args)
        if args.command == "run" and (args.target.endswith(".py") or Path(args.target).is_file()):
            if not Path(args.target).is_file():
                parser.error(f"script {args.target!r} does not exist")
            refuse_bad_environment(parser, args)
            return commands.run_script(args)
        overrides = split_recipe_args(parser, args)
        if args.command == "bench":
            from trainmesh.bench.command import cmd_bench

            args.command_line = ["trainmesh", *argv]  # for bench.json
            return cmd_bench(args, overrides)
        if args.command == "plan":
            return commands.cmd_plan(args, overrides)
        if args.command in ("slurm", "k8s"):
            from trainmesh.schedulers.command import k8s_manifests, slurm_script

            args.command_line = ["trainmesh", *argv]  # recorded in the file
            print(slurm_script(args, overrides) if args.command == "slurm" else k8s_manifests(args, overrides), end="")
            return 0
        if args.command == "check":
            from trainmesh.parity.command import check_parity_flags, cmd_parity

            check_parity_flags(args)
            if args.parity:
                args.command_line = ["trainmesh", *argv]  # for parity.json
                return cmd_parity(args, overrides)
            return commands.cmd_check(args, overrides)
        args.relaunch = relaunch_tokens(argv, invoked_as())  # for the command that resumes the run, which it prints
        return commands.cmd_run(args, overrides)
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


def _horovodrun(argv: list[str]) -> int:
    """`trainmesh horovodrun ...`: horovodrun's flags (not argparse's: -np, and the command after them)."""
    from trainmesh import horovodrun

    try:
        args = horovodrun.parse(argv)
        if args is None:
            print(horovodrun.USAGE)
            return 0
        return horovodrun.launch_horovodrun(args)
    except UserError as e:
        log.error("%s", e)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        log.warning("interrupted (Ctrl-C) before the workers started")
        return EXIT_INTERRUPTED


def _prepare_data(args: argparse.Namespace) -> int:
    """`trainmesh data prepare` (trainmesh.data.prepare imports no torch)."""
    from trainmesh.core.signals import Terminated, sigterm_raises
    from trainmesh.data.prepare import PrepareOptions, prepare

    given = {k: getattr(args, k) for k in ("tokenizer", "text_field", "val_fraction", "shard_tokens", "workers")}
    options = PrepareOptions(
        inputs=tuple(args.inputs),
        out=args.out,
        force=args.force,
        progress=not args.no_progress,
        **{k: v for k, v in given.items() if v is not None},
    )
    try:
        with sigterm_raises():  # as Ctrl-C: prepare removes its staging folder (the default would leave it)
            done = prepare(options)
    except KeyboardInterrupt:
        log.warning("interrupted (Ctrl-C): nothing was written to %s", args.out)
        return EXIT_INTERRUPTED
    except Terminated:
        log.warning("terminated (SIGTERM): nothing was written to %s", args.out)
        return EXIT_TERMINATED
    manifest = done.manifest
    for name, split in (("train", manifest.train), ("val", manifest.val)):
        print(f"{name:5} {split.tokens:>15,} tokens in {len(split.shards)} shard(s), {split.documents:,} document(s)")
    print(
        f"wrote {done.folder}; train on it with: trainmesh run gpt --data.source={done.folder} "
        f"--data.tokenizer={manifest.tokenizer.name}"
    )
    return 0
