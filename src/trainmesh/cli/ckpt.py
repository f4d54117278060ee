"""`trainmesh ckpt verify | inspect | export | upgrade`."""

from __future__ import annotations

import argparse
import contextlib
import logging
from pathlib import Path
from typing import Any

from trainmesh.checkpoint.catalog import CHECKPOINT_DIR
from trainmesh.job.rundir import RunFolder
from trainmesh.recipes import get_recipe

log = logging.getLogger("trainmesh")


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
    with RunFolder(folder.parent) if in_run else contextlib.nullcontext():
        for ckpt in checkpoints:
            changes = upgrade_checkpoint(ckpt, convert)
            print(f"upgraded {ckpt}:" if changes else f"current  {ckpt} (nothing to convert)")
            for change in changes:
                print(f"        {change}")
    return 0
