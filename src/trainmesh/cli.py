"""The `trainmesh` command: run, check, env, ckpt.

trainmesh run gpt --config configs/gpt-tiny.toml --nproc-per-node 2 -- --optim.lr=3e-4
trainmesh run examples/custom_loop.py --epochs 2     # any torchrun-style script
trainmesh check gpt --config configs/gpt2-124m.toml --nproc-per-node 8 --nnodes 4
trainmesh env
trainmesh ckpt verify runs/<name>                     # or: ckpt inspect runs/<name>/checkpoints/step_...
trainmesh ckpt export runs/<name>                     # newest valid checkpoint -> runs/<name>/export/*.safetensors
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from pathlib import Path

from trainmesh.checkpoint.catalog import list_checkpoints
from trainmesh.config import Config, dump_toml
from trainmesh.config.loader import config_to_dict
from trainmesh.config.validate import load_config, validate
from trainmesh.launch import LaunchError, LaunchOptions, launch
from trainmesh.rundir import (
    CONFIG_FILE,
    RunLock,
    claim_new_run_dir,
    create_run_dir,
    existing_run_dir,
    new_job_id,
    write_config,
)
from trainmesh.runtime.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR, UserError
from trainmesh.runtime.logging import configure_logging
from trainmesh.train.batch import BatchPlan

log = logging.getLogger("trainmesh")


def _add_launch_flags(parser: argparse.ArgumentParser, defaults: bool = True) -> None:
    d = (lambda value: value) if defaults else (lambda value: argparse.SUPPRESS)
    g = parser.add_argument_group("launch (torchrun)")
    g.add_argument("--nproc-per-node", default=d("auto"), help="processes per node: N or auto (all GPUs, else 2)")
    g.add_argument("--nnodes", default=d("1"), help="nodes: N, or MIN:MAX for elastic membership")
    g.add_argument("--node-rank", type=int, default=d(0), help="this node's rank (static rendezvous)")
    g.add_argument("--master-addr", default=d(None), help="address of node 0 (static rendezvous)")
    g.add_argument("--master-port", type=int, default=d(None), help="port on node 0 (default: a free one)")
    g.add_argument("--rdzv-endpoint", default=d(None), help="HOST:PORT of the c10d rendezvous (elastic)")
    g.add_argument("--rdzv-id", default=d(None), help="job id shared by all nodes (c10d rendezvous)")
    g.add_argument("--max-restarts", type=int, default=d(0), help="restarts of the worker group on failure")
    g.add_argument("--join-timeout", type=int, default=d(300), help="seconds the nodes may take to meet (default 300)")
    g.add_argument("--rdzv-conf", default=d(None), help="more c10d rendezvous settings: KEY=VALUE[,...] (torchrun's)")


def _add_recipe_flags(parser: argparse.ArgumentParser, defaults: bool = True) -> None:
    d = (lambda value: value) if defaults else (lambda value: argparse.SUPPRESS)
    g = parser.add_argument_group("recipe")
    g.add_argument("--config", default=d(None), help="TOML config file (see configs/)")
    g.add_argument("--run-id", default=d(None), help="run directory name under run.out_dir (= run.name)")
    g.add_argument("--resume", action="store_true", default=d(False), help="continue from the newest checkpoint")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainmesh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="train a recipe or launch a script on every rank",
        description="Launch a built-in recipe (gpt) or a torchrun-style script. For a recipe, dotted config "
        "overrides follow, optionally after --: --optim.lr=3e-4 --train.precision=bf16-mixed. For a script, "
        "everything after the script path is passed to it.",
    )
    run.add_argument("target", help="recipe name (gpt) or path to a .py script")
    _add_launch_flags(run)
    _add_recipe_flags(run)
    run.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    check = sub.add_parser("check", help="validate a config for a world size and print the batch plan")
    check.add_argument("target", help="recipe name")
    _add_launch_flags(check)
    _add_recipe_flags(check)
    check.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    sub.add_parser("env", help="versions, devices, backends and distributed environment variables")
    ckpt = sub.add_parser("ckpt", help="verify, describe or export checkpoints (offline, one process)")
    ckpt.add_argument(
        "action",
        choices=["verify", "inspect", "export"],
        help="verify: check against the manifests; export: model weights to one safetensors file",
    )
    ckpt.add_argument(
        "path",
        help="a checkpoint directory, or a run directory (verify, inspect: all its checkpoints; "
        "export: its newest one that verifies)",
    )
    ckpt.add_argument(
        "-o",
        "--output",
        type=Path,
        default=None,
        help="export: the .safetensors file to write (default: <run>/export/model_step_XXXXXXXX.safetensors)",
    )
    ckpt.add_argument("--force", action="store_true", help="export: overwrite an existing output file")
    return parser


def _split_recipe_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Flags may also follow the recipe name; the leftovers must be --section.key=value overrides."""
    tail = argparse.ArgumentParser(add_help=False)
    _add_launch_flags(tail, defaults=False)
    _add_recipe_flags(tail, defaults=False)
    tokens = list(args.rest)
    _, rest = tail.parse_known_args([t for t in tokens if t != "--"], namespace=args)
    overrides = [t for t in rest if t.startswith("--") and "=" in t and "." in t.split("=", 1)[0]]
    unknown = [t for t in rest if t not in overrides]
    if unknown:
        parser.error(f"unrecognised arguments {unknown}; config overrides look like --section.key=value")
    if args.run_id:
        overrides.append(f"--run.name={args.run_id}")
    if args.resume:
        overrides.append("--checkpoint.resume=true")
    return overrides


def _launch_options(args: argparse.Namespace) -> LaunchOptions:
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
        rdzv_conf=args.rdzv_conf,
    )


def _validate_all(config: Config, opts: LaunchOptions) -> list[tuple[int, BatchPlan]]:
    """Check the config at every world size this launch may run at (several when elastic)."""
    return [(world, validate(config, world)) for world in opts.world_sizes()]


def cmd_run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.target.endswith(".py") or Path(args.target).is_file():
        if not Path(args.target).is_file():
            parser.error(f"script {args.target!r} does not exist")
        return launch(_launch_options(args), [args.target, *args.rest], module=False)
    overrides = _split_recipe_args(parser, args)
    opts = _launch_options(args)
    config = load_config(args.config, overrides, args.target)
    plans = _validate_all(config, opts)  # before any process starts or any file is written
    out_dir = Path(config.run.out_dir)
    suffix = opts.default_run_suffix()  # the nodes of a multi-node job agree on their folder and job id
    if suffix and not config.run.name:
        config.run.name = f"{config.run.recipe}-{re.sub(r'[^A-Za-z0-9._-]', '-', suffix)}"
    if config.checkpoint.resume:
        run_dir = existing_run_dir(out_dir, config.run.name)  # a misspelled --run-id is refused
    elif config.run.name:
        run_dir = create_run_dir(out_dir, config.run.name)
    else:
        run_dir = claim_new_run_dir(out_dir, config.run.recipe)
    config.run.name = run_dir.name
    low, high = opts.node_bounds()
    if low < high and not config.checkpoint.resume:
        # Membership changes restart every worker, and a node that did not fail (one joining, or its
        # peers when a job grows) keeps restart count 0: so every (re)start of an elastic job continues
        # from the run's newest checkpoint, when there is one.
        config.checkpoint.resume = True
        log.info(
            "elastic --nnodes %s: workers continue from this run's newest checkpoint when they (re)start", opts.nnodes
        )
    job = suffix or new_job_id()
    with RunLock(run_dir, job) as lock:
        if not config.checkpoint.resume and list_checkpoints(run_dir):
            newest = list_checkpoints(run_dir)[-1].name
            raise LaunchError(
                f"{run_dir} already holds checkpoints (newest: {newest}); a new run there would collide with them. "
                f"Fix: --resume --run-id {run_dir.name} to continue it, or another --run-id for a new run."
            )
        config_path = _write_or_match_config(run_dir, config, joined=lock.joined)
        for world, plan in plans:
            log.info("world size %d: %s", world, plan.describe())
        entry = ["trainmesh", config.run.recipe, "--config", str(config_path), "--run-dir", str(run_dir)]
        return launch(opts, [*entry, "--job", job], module=True, run_name=run_dir.name)


def _write_or_match_config(run_dir: Path, config: Config, joined: bool) -> Path:
    """The launch holding the lock writes the run's config; another node of the same job (sharing the
    folder) checks that its own config is the same, instead of overwriting it under running workers."""
    if not joined:
        return write_config(run_dir, config)
    path = run_dir / CONFIG_FILE
    deadline = time.monotonic() + 30
    while not path.is_file() and time.monotonic() < deadline:  # the node holding the lock writes it first
        time.sleep(0.2)
    ours = dump_toml(config_to_dict(config))
    theirs = path.read_text() if path.is_file() else ""
    if theirs != ours:
        diff = [line for line in ours.splitlines() if line not in theirs.splitlines()][:5]
        raise LaunchError(
            f"another node of this job wrote {path} with a different config (this node has: {'; '.join(diff)}). "
            "Fix: launch every node with the same --config and overrides."
        )
    return path


def cmd_check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    overrides = _split_recipe_args(parser, args)
    opts = _launch_options(args)
    config = load_config(args.config, overrides, args.target)
    for world, plan in _validate_all(config, opts):
        print(f"world size {world}: OK — {plan.describe()}")
    return 0


def cmd_ckpt(args: argparse.Namespace) -> int:
    from trainmesh.checkpoint.inspect import checkpoints_at, describe, verify_all

    if args.action != "export" and (args.output is not None or args.force):
        log.error("-o/--output and --force apply to `trainmesh ckpt export` only")
        return 2
    try:
        if args.action == "inspect":
            print("\n\n".join(describe(ckpt) for ckpt in checkpoints_at(Path(args.path))))
            return 0
        if args.action == "export":
            from trainmesh.checkpoint.export import export_checkpoint

            done = export_checkpoint(Path(args.path), args.output, force=args.force)
            print(f"exported step {done.step} of {done.checkpoint}")
            print(f"  -> {done.path}: {done.tensors} tensors, {done.bytes:,} bytes")
            return 0
        verdicts = verify_all(Path(args.path))
    except (FileNotFoundError, ValueError) as e:
        log.error("%s", e)
        return 1
    for verdict in verdicts:
        print(f"OK      {verdict.path}" if verdict.ok else f"INVALID {verdict.path}")
        for problem in verdict.problems:
            print(f"        {problem}")
    return 0 if all(v.ok for v in verdicts) else 1


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "env":
            from trainmesh.runtime.report import environment_report

            print(environment_report())
            return 0
        if args.command == "check":
            return cmd_check(parser, args)
        if args.command == "ckpt":
            return cmd_ckpt(args)
        return cmd_run(parser, args)
    except UserError as e:
        log.error("%s", e)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:  # before torchrun's agent took over the signal: nothing was started yet
        log.warning("interrupted (Ctrl-C) before the workers started")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
