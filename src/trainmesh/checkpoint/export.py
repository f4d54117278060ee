"""`trainmesh ckpt export`: a checkpoint's model weights as one safetensors file, bit for bit, or as a folder in another
program's format (the recipe converts). The checkpoint is verified first; the output is written atomically.

Details: docs/internals.md#checkpointexportpy
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file

from trainmesh.checkpoint.catalog import CHECKPOINT_DIR, check_checkpoint, list_checkpoints
from trainmesh.checkpoint.dcp import read_full_state
from trainmesh.checkpoint.inspect import checkpoints_at
from trainmesh.checkpoint.manifest import MANIFEST as CHECKPOINT_MANIFEST
from trainmesh.checkpoint.state import TRAINER_STATE, TrainerState
from trainmesh.core.errors import UserError
from trainmesh.core.files import (
    FolderOwner,
    JsonFileError,
    check_replaceable,
    is_plain_name,
    make_dirs,
    read_json,
    remove_tree,
    replace_file,
    replace_folder,
    warn_moved_aside,
    write_atomically,
)
from trainmesh.core.logging import get_logger
from trainmesh.core.versions import versions

log = get_logger(__name__)

EXPORT_DIR = "export"
EXPORT_MARKER = "trainmesh_export.json"
"""Written last into a folder export: the files it wrote, so that --force replaces that folder and no other."""
MARKER_FORMAT = "trainmesh-export"
MAX_MARKER_BYTES = 1 << 20


class ExportError(UserError, ValueError):
    """The export was refused: an unverified checkpoint, a non-tensor entry, a model the format cannot hold."""


class ExportUsageError(ExportError):
    """The export command needs fixing: an existing output without --force, a file where a folder goes, a
    format the checkpoint's recipe has none of (the CLI's exit code 2, where a refused checkpoint gets 1)."""


class FolderFormat(Protocol):
    """A format whose export is a folder of files, written by the recipe that knows the model."""

    name: str
    """As --format names it; also the default output's prefix (`<run>/export/<name>_step_XXXXXXXX`)."""

    def check(self, state: TrainerState) -> None:
        """Refuse (ExportError) a checkpoint this format cannot hold, before its tensors are read."""

    def write(self, model_state: dict[str, torch.Tensor], state: TrainerState, folder: Path) -> int:
        """Write the files into `folder` (new and empty); returns how many tensors were written."""


def exported_files(folder: Path) -> set[str] | None:
    """The files an earlier folder export wrote into `folder` (its marker included), as its marker lists them;
    None when `folder` holds no marker of trainmesh's."""
    try:
        body = read_json(folder / EXPORT_MARKER, MAX_MARKER_BYTES)
        if not isinstance(body, dict) or body.get("format") != MARKER_FORMAT:
            return None
        listed = [name for name in body["files"] if is_plain_name(name)]
    except (JsonFileError, KeyError, TypeError):  # none, unreadable, or another layout
        return None
    return {EXPORT_MARKER, *listed}


EXPORTED = FolderOwner(
    command="trainmesh ckpt export",
    marker=EXPORT_MARKER,
    written=exported_files,
    error=ExportUsageError,
    other="-o another folder",
    unmarked_note="; exports made before this version have none: remove such a folder yourself",
)


@dataclass(frozen=True)
class Exported:
    checkpoint: Path
    path: Path
    step: int
    tensors: int
    bytes: int


def exportable_checkpoint(path: Path) -> Path:
    """`path` itself if it is a checkpoint that verifies; for a run directory, its newest one that does."""
    candidates = checkpoints_at(path)  # FileNotFoundError when it is neither
    is_run_dir = candidates != [path]
    problems: list[str] = []
    for ckpt in reversed(candidates):
        found = check_checkpoint(ckpt)
        if not found:
            return ckpt
        problems += found
        if is_run_dir:
            log.warning("skipping %s, which fails verification:\n  %s", ckpt, "\n  ".join(found))
    what = "no checkpoint of this run verifies" if is_run_dir else "refusing to export an unverified checkpoint"
    raise ExportError(f"{what}:\n  " + "\n  ".join(problems))


def default_output(ckpt: Path, step: int) -> Path:
    """`<run>/export/model_step_XXXXXXXX.safetensors` (next to the checkpoint's folder if not in a run)."""
    base = ckpt.parent.parent if ckpt.parent.name == CHECKPOINT_DIR else ckpt.parent
    return base / EXPORT_DIR / f"model_step_{step:08d}.safetensors"


def export_checkpoint(path: Path, out: Path | None = None, force: bool = False) -> Exported:
    """Verify, then write the model weights of a checkpoint (or a run's newest valid one) to safetensors."""
    if out is not None:
        refuse_inside_checkpoint(out)
    ckpt = exportable_checkpoint(path)
    state = TrainerState.read(ckpt)
    step = state.step
    in_run = out is None
    out = out if out is not None else default_output(ckpt, step)
    if out.is_dir():
        raise ExportUsageError(f"{out} is a directory. Fix: -o a file path, e.g. -o {out / 'model.safetensors'}")
    if out.exists() and not force:
        raise ExportUsageError(f"{out} already exists. Fix: pass --force to overwrite it, or -o another path.")
    tensors = standalone_tensors(read_full_state(ckpt)["model"])
    if in_run:  # inside the run folder: a real directory, not one planted as a symlink
        make_dirs(out.parent.parent, EXPORT_DIR)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
    save_safetensors(out, tensors, export_metadata(state))
    return Exported(ckpt, out, step, len(tensors), out.stat().st_size)


def export_folder(path: Path, fmt: FolderFormat, out: Path | None = None, force: bool = False) -> Exported:
    """Verify, then write a checkpoint's (or a run's newest valid one's) model as a folder in format `fmt`.

    The folder is written under a temporary name beside `out` and renamed into place (core/files.py
    `replace_folder`), so a failed export leaves nothing behind; an existing `out` is replaced (after the new
    one is complete, and put back if that fails) only with `force`, and only an empty folder or an earlier
    export's (`EXPORTED`); a symlink there is replaced, not followed."""
    if out is not None:
        refuse_inside_checkpoint(out)
    ckpt = exportable_checkpoint(path)
    state = TrainerState.read(ckpt)
    fmt.check(state)
    in_run = out is None
    out = out if out is not None else default_output(ckpt, state.step).with_name(f"{fmt.name}_step_{state.step:08d}")
    if out.exists() and not out.is_dir():
        raise ExportUsageError(f"{out} is a file; --format {fmt.name} writes a folder. Fix: -o a folder path.")
    check_replaceable(out, EXPORTED)  # with --force or without: checked again at the commit
    if os.path.lexists(out) and not force:  # lexists: a dangling symlink is something there too
        raise ExportUsageError(f"{out} already exists. Fix: pass --force to replace it, or -o another folder.")
    model_state = read_full_state(ckpt)["model"]
    if in_run:  # inside the run folder: a real directory, not one planted as a symlink
        make_dirs(out.parent.parent, EXPORT_DIR)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
    warn_moved_aside(out)
    tmp = out.with_name(f".{out.name}.tmp.{os.getpid()}")
    remove_tree(tmp)  # a leftover of a killed export that had this pid
    try:
        tmp.mkdir()
        tensors = fmt.write(model_state, state, tmp)
        written = sorted(os.listdir(tmp))
        assert all((tmp / name).is_file() for name in written), written  # a format writes files, no folders
        marker = {"format": MARKER_FORMAT, "export_format": fmt.name, "step": state.step, "files": written}
        write_atomically(tmp / EXPORT_MARKER, json.dumps(marker, indent=2) + "\n")
        try:
            replace_folder(tmp, out, replace=force, owner=EXPORTED)
        except FileExistsError:
            raise ExportUsageError(
                f"{out} appeared while the export was written (another export?); it is not replaced without "
                "--force. Fix: pass --force to replace it, or -o another folder."
            ) from None
    finally:
        remove_tree(tmp)
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    return Exported(ckpt, out, state.step, tensors, size)


def refuse_inside_checkpoint(out: Path) -> None:
    """Refuse an output inside a checkpoint (a file its manifest does not list fails verification, and the run no
    longer resumes from it) or inside a run's checkpoints/ folder (trainmesh's to manage: a folder there named
    like a checkpoint is taken for one)."""
    real = out.resolve()  # where the files would land, through any symlink
    for folder in (real, *real.parents):
        # A checkpoint's own marks: its manifest beside DCP's .metadata or its trainer state. Either alone is not
        # one: a stray .metadata in a home folder, or the trainer_state.json Hugging Face's Trainer writes.
        marked = (folder / ".metadata").is_file() or (folder / TRAINER_STATE).is_file()
        if marked and (folder / CHECKPOINT_MANIFEST).is_file():
            run = folder.parent.parent if folder.parent.name == CHECKPOINT_DIR else folder.parent
            why = "a file added to a checkpoint makes it fail verification (its manifest lists every file it holds)"
            where = f"the checkpoint {folder}"
        elif folder.name == CHECKPOINT_DIR and list_checkpoints(folder.parent):
            run = folder.parent
            why = "trainmesh manages that folder (it takes a folder there named like a checkpoint for one)"
            where = f"the run's checkpoints folder {folder}"
        else:
            continue
        raise ExportUsageError(
            f"-o {out} is inside {where}: {why}. Fix: -o outside {CHECKPOINT_DIR}/, e.g. "
            f"-o {run / EXPORT_DIR / out.name}, or no -o (the default is under {run / EXPORT_DIR}/)."
        )


def standalone_tensors(model_state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, none sharing memory with another (safetensors' rule): a tensor whose
    storage was already taken, as tied weights' is, gets its own copy; values are unchanged."""
    tensors: dict[str, torch.Tensor] = {}
    taken: set[int] = set()
    for name, value in model_state.items():
        if not isinstance(value, torch.Tensor):
            kind = type(value).__name__
            raise ExportError(f"model entry {name!r} is not a tensor ({kind}); safetensors files hold tensors only")
        tensor = value.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if storage in taken:
            tensor = tensor.clone()
        taken.add(tensor.untyped_storage().data_ptr())
        tensors[name] = tensor
    return tensors


def save_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """safetensors' `save_file`, written under a temporary name and renamed into place, with the mode of any new
    file (safetensors' own is 0600), as every format's export writes its weights."""
    replace_file(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def export_metadata(state: TrainerState) -> dict[str, str]:
    """The header metadata of an exported safetensors file: where it came from (string to string)."""
    run, model = state.config.get("run", {}), state.config.get("model", {})
    return {
        "format": "pt",  # the convention of Hugging Face loaders: PyTorch tensor layout
        "trainmesh.step": str(state.step),
        "trainmesh.recipe": str(run.get("recipe", "") if isinstance(run, dict) else ""),
        "trainmesh.model_config": json.dumps(model, sort_keys=True),
        "trainmesh.saved_with": json.dumps(state.versions, sort_keys=True),
        "trainmesh.exported_with": json.dumps(versions(), sort_keys=True),
    }
