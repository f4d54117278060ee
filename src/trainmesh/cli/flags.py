"""The `trainmesh` command line's parser: every command's flags, the launch flags in launch_flags.py (argparse
only; no torch, no trainmesh imports beyond the bottom layer, so `trainmesh --help` is instant)."""

from __future__ import annotations

import argparse
import json
from importlib import metadata
from pathlib import Path
from typing import Any

from trainmesh.cli.launch_flags import add_launch_flags, refuse_bad_environment
from trainmesh.cli.scheduler_flags import add_scheduler_flags

RECIPE_NAMES = ("gpt", "resnet")
"""trainmesh.recipes.RECIPES' names, written out so that the parser needs no recipe (torch) import; a test
keeps the two equal."""


def _add_recipe_flags(parser: argparse.ArgumentParser, defaults: bool = True, resume: bool = True) -> None:
    d = (lambda value: value) if defaults else (lambda value: argparse.SUPPRESS)
    g = parser.add_argument_group("recipe")
    g.add_argument("--config", default=d(None), help="TOML config file (see configs/)")
    g.add_argument("--run-id", default=d(None), help="run directory name under run.out_dir (= run.id)")
    if resume:
        g.add_argument("--resume", action="store_true", default=d(False), help="continue from the newest checkpoint")
        g.add_argument(
            "--auto-resume",
            action="store_true",
            default=d(False),
            help="continue the run named by --run-id from its newest checkpoint when it has one, else start it: for "
            "a scheduler that reruns the same command (SLURM requeue, Kubernetes restarts)",
        )


def _add_bench_flags(parser: argparse.ArgumentParser, defaults: bool = True) -> None:
    """`trainmesh bench`'s own flags; checked by trainmesh.apps.bench.points, with messages that say how
    to fix them (argparse's choices= and type= would not)."""
    d = (lambda value: value) if defaults else (lambda value: argparse.SUPPRESS)
    g = parser.add_argument_group("bench")
    g.add_argument(
        "--mode",
        default=d("weak"),
        help="weak (the batch per process fixed, the global batch grows) | strong (the global batch fixed) | both",
    )
    g.add_argument(
        "--nprocs",
        default=d(None),
        help="process counts per node, e.g. 1,2,3 (default: 1, 2, 4, ... up to --nproc-per-node, else up to the "
        "GPUs or the CPU cores / OMP_NUM_THREADS)",
    )
    g.add_argument("--steps", type=int, default=d(20), help="timed steps per point (default 20)")
    g.add_argument("--warmup", type=int, default=d(5), help="steps before the timed ones, not timed (default 5)")
    g.add_argument(
        "--oversubscribe",
        action="store_true",
        default=d(False),
        help="allow more processes than the machine runs side by side (they then share cores or devices)",
    )


def _add_memory_margin(group: argparse._ArgumentGroup, default: Any) -> None:
    """--memory-margin, of `trainmesh check` and `plan` alike."""
    group.add_argument(
        "--memory-margin",
        type=float,
        default=default,
        help="fraction of device memory kept free for what is not modelled (default 0.1, or the cluster file's)",
    )


def _add_check_flags(parser: argparse.ArgumentParser, defaults: bool = True) -> None:
    """`trainmesh check`'s own flags: the devices the job is for."""
    d = (lambda value: value) if defaults else (lambda value: argparse.SUPPRESS)
    g = parser.add_argument_group("memory (the predicted memory per rank, against the devices the job will run on)")
    g.add_argument(
        "--cluster",
        default=d(None),
        help="a100 | h100 | h200 | this (calibrated) | a cluster JSON file (docs/plan.md): compare memory per rank "
        "with its devices instead of this machine's",
    )
    _add_memory_margin(g, d(None))
    g.add_argument(
        "--dry-run",
        action="store_true",
        default=d(False),
        help="also build the job at its world size here, on fake tensors and a fake process group, run one step of "
        "a rank of each role and show its memory by component beside the prediction (gpt recipe, no pipelines; "
        "seconds to minutes, nothing of the real size allocated)",
    )


def _add_parity_flags(parser: argparse.ArgumentParser, defaults: bool = True) -> None:
    """`trainmesh check --parity`'s flags; checked by trainmesh.cli.parity (messages that say how to fix)."""
    d = (lambda value: value) if defaults else (lambda value: argparse.SUPPRESS)
    g = parser.add_argument_group("parity (compare two trainings step by step)")
    g.add_argument(
        "--parity",
        action="store_true",
        default=d(False),
        help="run the job twice and compare loss, gradient norm and every parameter's gradients and weights per "
        "step: the launch's processes against 1 process, or --parity-a against --parity-b; exit 0 equal, 1 not",
    )
    g.add_argument("--parity-steps", type=int, default=d(None), help="steps to compare (default 5)")
    g.add_argument(
        "--parity-a",
        default=d(None),
        help="side A's own overrides, e.g. --parity-a='parallel.strategy=ddp' (space-separated section.key=value)",
    )
    g.add_argument(
        "--parity-b", default=d(None), help="side B's own overrides, e.g. --parity-b='train.precision=bf16-mixed'"
    )
    g.add_argument(
        "--parity-rtol",
        type=float,
        default=d(None),
        help="the relative tolerance floor instead of the dtype's (default: 64 eps for fp32, 4 eps for 16-bit)",
    )


def _add_plan_flags(parser: argparse.ArgumentParser, defaults: bool = True) -> None:
    """`trainmesh plan`'s own flags; checked by trainmesh.cli.plan (messages that say how to fix)."""
    d = (lambda value: value) if defaults else (lambda value: argparse.SUPPRESS)
    g = parser.add_argument_group("plan")
    g.add_argument(
        "--cluster",
        default=d("h100"),
        help="a100 | h100 | h200 (8 GPUs a node) | this (calibrated) | a JSON file describing one (docs/plan.md)",
    )
    g.add_argument("--nodes", type=int, default=d(1), help="nodes (default 1)")
    g.add_argument("--devices-per-node", type=int, default=d(None), help="devices a node (default: the cluster's)")
    g.add_argument(
        "--global-batch",
        type=int,
        default=d(None),
        help="sequences per optimizer step (default: the config's, else train.micro_batch on every rank)",
    )
    _add_memory_margin(g, d(None))
    g.add_argument("--top", type=int, default=d(20), help="rows to print (default 20)")
    g.add_argument("--json", default=d(None), help="also write every layout's figures here")
    g.add_argument(
        "--calibrate",
        action="store_true",
        default=d(False),
        help="measure this machine (compute, memory bandwidth, collectives) and save it for --cluster this",
    )
    g.add_argument("--calibration", default=d(None), help="the calibration file (default ~/.cache/trainmesh/...)")


def _add_data_parser(sub: Any) -> None:
    """`trainmesh data prepare`; the values are checked by trainmesh.data.prepare.PrepareOptions."""
    data = sub.add_parser("data", help="prepare token shards for training from text, JSON Lines, Parquet, datasets")
    actions = data.add_subparsers(dest="action", required=True)
    prepare = actions.add_parser(
        "prepare",
        help="tokenise documents into llm.c-style train/val shards and a manifest (docs/data.md)",
        description="Tokenise text files (each one document), JSON Lines and Parquet files (a document a record), "
        "saved Hugging Face datasets and folders of these, in parallel processes, into "
        "<out>/<name>_train_000000.bin, ..., <name>_val_000000.bin, ... (llm.c's layout) and manifest.json. "
        "Train on it with --data.source=<out>. Details: docs/data.md.",
    )
    prepare.add_argument("inputs", nargs="+", type=Path, metavar="INPUT", help="files and folders to read")
    prepare.add_argument("-o", "--out", type=Path, required=True, help="the folder to write (new or empty)")
    # Defaults are PrepareOptions' (None here: not given), written out in the help only.
    prepare.add_argument("--tokenizer", help="byte | gpt2 (default byte, as data.tokenizer)")
    prepare.add_argument("--text-field", help="JSON field / Parquet or dataset column holding the text (default text)")
    prepare.add_argument(
        "--val-fraction",
        type=float,
        help="share of the tokens held out for validation: every round(1/F)-th block of 65,536 (default 0.05)",
    )
    prepare.add_argument("--shard-tokens", type=int, help="tokens per shard file (default 100,000,000, llm.c's)")
    prepare.add_argument("--workers", type=int, help="tokenising processes (default: one per available CPU)")
    prepare.add_argument(
        "--force", action="store_true", help="replace an --out an earlier prepare wrote (once the new one is done)"
    )
    prepare.add_argument("--no-progress", action="store_true", help="no progress bar (none is drawn off a terminal)")


DESCRIPTION = """One PyTorch training job from one CPU to many GPU machines. For example:

  trainmesh run gpt --config configs/gpt-tiny.toml --nproc-per-node 2 -- --optim.lr=3e-4
  trainmesh check gpt --config configs/gpt2-124m.toml --nproc-per-node 8 --nnodes 4 --rdzv-endpoint 10.0.0.1:29400
  trainmesh plan gpt --config configs/gpt2-124m.toml --cluster h100 --nodes 4   # every layout: memory, step time
  trainmesh run train.py --nproc-per-node 2      # any torchrun-style script

Every command and flag: docs/cli.md; `trainmesh <command> --help` for one."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainmesh", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"trainmesh {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="train a recipe or launch a script on every rank",
        description=f"Launch a built-in recipe ({', '.join(RECIPE_NAMES)}) or a torchrun-style script. For a recipe, "
        "dotted config overrides follow, optionally after --: --optim.lr=3e-4 --train.precision=bf16-mixed. "
        "For a script, everything after the script path is passed to it.",
    )
    run.add_argument("target", help=f"recipe name ({' | '.join(RECIPE_NAMES)}) or path to a .py script")
    add_launch_flags(run)
    _add_recipe_flags(run)
    run.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    check = sub.add_parser(
        "check",
        help="resolve a config for the launch's world size(s): layout and batch split; --parity: compare two trainings",
        description="Resolve a recipe's config at every world size the launch flags imply and print the layout and "
        "batch split. With --parity, train it twice for a few steps (the launch's processes vs 1, or --parity-a vs "
        "--parity-b) and report the first step and parameter where the two differ beyond tolerance.",
    )
    check.add_argument("target", help=f"recipe name ({' | '.join(RECIPE_NAMES)})")
    _add_check_flags(check)
    add_launch_flags(check)
    _add_recipe_flags(check)
    _add_parity_flags(check)
    check.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    bench = sub.add_parser(
        "bench",
        help="scaling experiment: the same job at 1, 2, 4, ... processes, weak and/or strong",
        description="Run a recipe at several process counts (each a trainmesh run with its own run folder) and write "
        "bench.json, bench.md and scaling.png into a bench folder under run.out_dir. Weak scaling keeps the batch "
        "per process, strong scaling the global batch. Dotted config overrides follow, optionally after --.",
    )
    bench.add_argument("target", help=f"recipe name ({' | '.join(RECIPE_NAMES)})")
    add_launch_flags(bench)
    _add_recipe_flags(bench, resume=False)
    _add_bench_flags(bench)
    bench.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    env = sub.add_parser("env", help="versions, devices, backends and distributed environment variables")
    env.add_argument(
        "--full",
        action="store_true",
        help="add PyTorch's own report (torch.utils.collect_env: OS, compilers, CUDA, cuDNN, GPU driver, packages)",
    )
    sub.add_parser(  # parsed by trainmesh.compat.horovodrun (main hands it the arguments): horovodrun's own flags
        "horovodrun",
        add_help=False,
        help="run a Horovod script: horovodrun -np N [-H ...] mapped onto run's launch (trainmesh horovodrun --help)",
    )
    for command, what in (
        ("slurm", "an sbatch script that trains a config and requeues itself at its time limit"),
        ("k8s", "Kubernetes manifests (Kubeflow PyTorchJob or JobSet) that train a config"),
    ):
        scheduler = sub.add_parser(
            command,
            help=f"print {what}",
            description=f"Check a recipe's config for the job's world size(s), as `trainmesh check` does, and print "
            f"{what}; see docs/clusters.md. Dotted config overrides follow, optionally after --.",
        )
        scheduler.add_argument("target", help=f"recipe name ({' | '.join(RECIPE_NAMES)})")
        _add_recipe_flags(scheduler, resume=False)
        add_scheduler_flags(scheduler, command)
        scheduler.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    plan = sub.add_parser(
        "plan",
        help="predict memory per rank and step time for every layout of a job on a cluster, fastest first",
        description="Every parallel layout trainmesh can run the job in (ddp, fsdp and its variants, CPU offload, "
        "activation checkpointing, pipeline and tensor parallel), its memory per rank by component and its step "
        "time, sorted; the fastest that fits as a trainmesh run command. Config overrides follow the recipe.",
    )
    plan.add_argument("target", nargs="?", default="gpt", help="recipe name (gpt)")
    _add_recipe_flags(plan, resume=False)
    _add_plan_flags(plan)
    plan.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    ckpt = sub.add_parser("ckpt", help="verify, describe, export or upgrade checkpoints (offline, one process)")
    ckpt.add_argument(
        "action",
        choices=["verify", "inspect", "export", "upgrade"],
        help="verify: check against the manifests; export: model weights to one safetensors file (or --format hf: a "
        "Hugging Face GPT-2 folder); upgrade: rewrite checkpoints saved by an older trainmesh in the current model "
        "layout (the originals are kept)",
    )
    ckpt.add_argument(
        "path",
        help="a checkpoint directory, or a run directory (verify, inspect, upgrade: all its checkpoints; "
        "export: its newest one that verifies)",
    )
    ckpt.add_argument(
        "-o",
        "--output",
        type=Path,
        default=None,
        help="export: the .safetensors file to write (default: <run>/export/model_step_XXXXXXXX.safetensors), or "
        "with --format hf the folder (default: <run>/export/hf_step_XXXXXXXX)",
    )
    ckpt.add_argument(
        "--force",
        action="store_true",
        help="export: replace an existing output file, or a folder an earlier export wrote",
    )
    ckpt.add_argument(
        "--format",
        choices=["safetensors", "hf"],
        default=None,
        help="export: safetensors (default: one file, trainmesh's names) | hf (a folder that transformers' "
        "GPT2LMHeadModel.from_pretrained loads: GPT-2's names, config.json, and the tokenizer of gpt2-tokenizer runs)",
    )
    _add_data_parser(sub)
    return parser


def split_recipe_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Flags may also follow the recipe name; the leftovers must be --section.key=value overrides."""
    tail = argparse.ArgumentParser(prog=f"{parser.prog} {args.command}", add_help=False)
    _add_recipe_flags(tail, defaults=False, resume=args.command not in ("bench", "plan", "slurm", "k8s"))
    if args.command == "bench":
        _add_bench_flags(tail, defaults=False)
    if args.command == "check":
        _add_parity_flags(tail, defaults=False)
        _add_check_flags(tail, defaults=False)
    if args.command == "plan":
        _add_plan_flags(tail, defaults=False)
    elif args.command in ("slurm", "k8s"):
        add_scheduler_flags(tail, args.command, defaults=False)
    else:
        add_launch_flags(tail, defaults=False)
    tokens = list(args.rest)
    _, rest = tail.parse_known_args([t for t in tokens if t != "--"], namespace=args)
    refuse_bad_environment(parser, args)
    overrides = [t for t in rest if _is_override(t)]
    unknown = [t for t in rest if t not in overrides]
    if unknown:
        parser.error(f"unrecognised arguments {unknown}; config overrides look like --section.key=value")
    if args.run_id and args.command not in ("slurm", "k8s"):  # theirs is the job's, e.g. gpt-$SLURM_JOB_ID
        overrides.append(f"--run.id={json.dumps(args.run_id)}")  # quoted: `--run-id 0` is a name, not a number
    if getattr(args, "resume", False):
        overrides.append("--checkpoint.resume=true")
    return overrides


_NAMING_THE_RUN = ("--config", "--run-id")  # flags with a value that a resume takes from the run
_RESUME_FLAGS = ("--resume", "--auto-resume")


def relaunch_tokens(argv: list[str], program: list[str]) -> list[str]:
    """`program` and the command line `argv` (`run <recipe> ...`) without the config, the run's name, the resume
    flags and the overrides: the launch flags as the user typed them, which a command that resumes the run repeats
    (its config.toml holds the rest). Flags are recognised under argparse's abbreviations and `_` spellings too."""
    kept, tokens = list(program), iter(argv)
    for token in tokens:
        flag = _full_flag(token.split("=", 1)[0])
        if flag in _NAMING_THE_RUN:
            if "=" not in token:
                next(tokens, None)  # its value
        elif token != "--" and flag not in _RESUME_FLAGS and not _is_override(token):
            kept.append(token)
    return kept


def _full_flag(name: str) -> str:
    """One of the flags a resume command drops, as `name` abbreviates or spells it (argparse accepts a unique
    prefix: one of these flags' prefixes is theirs); else `name`."""
    spelled = name.replace("_", "-")
    if name.startswith("--") and len(spelled) > 2:  # argparse refused an ambiguous prefix (--r, --re) already
        for flag in (*_NAMING_THE_RUN, *_RESUME_FLAGS):
            if flag.startswith(spelled):
                return flag
    return name


def _is_override(token: str) -> bool:
    return token.startswith("--") and "=" in token and "." in token.split("=", 1)[0]


def _version() -> str:
    try:
        return metadata.version("trainmesh")
    except metadata.PackageNotFoundError:
        return "(not installed)"
