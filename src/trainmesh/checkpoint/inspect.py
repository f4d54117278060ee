"""`trainmesh ckpt verify|inspect`: check and describe checkpoints offline, in one process; verification gates
everything else.

Details: docs/internals.md#checkpointinspectpy
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainmesh.checkpoint.catalog import check_checkpoint, list_checkpoints
from trainmesh.checkpoint.dcp import single_process_quiet
from trainmesh.checkpoint.manifest import Verdict
from trainmesh.checkpoint.reader import SafeLoadPlanner, SafeReader, saved_tensors
from trainmesh.checkpoint.state import TrainerState


def checkpoints_at(path: Path) -> list[Path]:
    """A checkpoint directory itself, or every committed checkpoint of a run directory."""
    if (path / "manifest.json").exists() or (path / ".metadata").exists():
        return [path]
    found = list_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"{path} is neither a checkpoint nor a run directory with checkpoints")
    return found


def verify_all(path: Path) -> list[Verdict]:
    return [Verdict(ckpt, check_checkpoint(ckpt)) for ckpt in checkpoints_at(path)]


def describe(ckpt: Path) -> str:
    """Step, provenance and every tensor (name, shape, dtype) of a verified checkpoint."""
    problems = check_checkpoint(ckpt)
    if problems:
        raise ValueError("refusing to read an unverified checkpoint:\n  " + "\n  ".join(problems))
    state = TrainerState.read(ckpt)
    run = state.config.get("run", {})
    lines = [
        f"checkpoint {ckpt}",
        f"  step {state.step}, {state.samples_seen:,} samples seen, saved by {state.world_size} rank(s)"
        + (f", global batch {state.global_batch:,}" if state.global_batch else ""),
        "  versions: " + ", ".join(f"{k} {v}" for k, v in state.versions.items()),
        f"  recipe {run.get('recipe') if isinstance(run, dict) else '?'}, model {state.config.get('model')}",
    ]
    tensors = saved_tensors(ckpt)
    model = {k.removeprefix("model."): v for k, v in sorted(tensors.items()) if k.startswith("model.")}
    lines.append(f"  model: {len(model)} tensors, {_describe_model(ckpt, model, tensors)}")
    for name, meta in model.items():
        lines.append(f"    {name:<40} {tuple(meta.size)!s:<16} {meta.properties.dtype}")
    optim = [meta for k, meta in tensors.items() if k.startswith("optim.")]
    lines.append(f"  optim: {len(optim)} tensors, {sum(meta.size.numel() for meta in optim):,} elements")
    files = [p for p in ckpt.rglob("*") if p.is_file() and not p.is_symlink()]
    lines.append(f"  files: {sum(p.stat().st_size for p in files):,} bytes")
    return "\n".join(lines)


def trained_names(tensors: dict[str, TensorStorageMetadata]) -> set[str]:
    """The names of the parameters the optimizer holds state for (`optim.state.<name>.<key>`), each once."""
    return {key.removeprefix("optim.state.").rsplit(".", 1)[0] for key in tensors if key.startswith("optim.state.")}


def tied_copies(ckpt: Path, model: dict[str, TensorStorageMetadata], trained: set[str]) -> dict[str, str]:
    """Model tensors that are a tied parameter stored again under another name: name -> the trained parameter's
    name. Only tensors without optimizer state of their own are read, with the trained ones of their shape and
    dtype, so that equal values (LayerNorm weights at their initial ones) never make two parameters one."""
    shape = {name: (tuple(meta.size), meta.properties.dtype) for name, meta in model.items()}
    partners = {
        name: [other for other in sorted(trained) if other in shape and shape[other] == shape[name]]
        for name in model
        if name not in trained
    }
    partners = {name: others for name, others in partners.items() if others}
    wanted = set(partners).union(*partners.values())
    if not wanted:
        return {}
    needed = sum(model[name].size.numel() * shape[name][1].itemsize for name in wanted)
    if needed > sum(f.stat().st_size for f in ckpt.glob("*.distcp")):  # metadata claiming more than is stored
        return {}  # (forged, or damaged): nothing is allocated for it
    values = {f"model.{name}": torch.empty(shape[name][0], dtype=shape[name][1]) for name in sorted(wanted)}
    with single_process_quiet():
        dcp.load(values, storage_reader=SafeReader(ckpt), planner=SafeLoadPlanner(), no_dist=True)
    ties = {}
    for name, others in partners.items():
        same = [other for other in others if torch.equal(values[f"model.{name}"], values[f"model.{other}"])]
        if same:
            ties[name] = same[0]
    return ties


def _describe_model(
    ckpt: Path, model: dict[str, TensorStorageMetadata], tensors: dict[str, TensorStorageMetadata]
) -> str:
    """The model's size as the run logged it: parameters, each once; buffers apart."""
    elements = sum(meta.size.numel() for meta in model.values())
    trained = trained_names(tensors) & model.keys()
    if not trained:  # no optimizer state (a step never taken, an optimizer that keeps none): nothing to tell by
        return f"{elements:,} elements (parameters and buffers: no optimizer state in the checkpoint tells them apart)"
    ties = tied_copies(ckpt, model, trained)
    untrained = [name for name in model if name not in trained and name not in ties]
    parameters = sum(model[name].size.numel() for name in trained)
    text = f"{parameters:,} parameters"
    if ties:
        tied = ", ".join(f"{name} is {other}" for name, other in ties.items())
        text += f" (tied, stored twice and counted once: {tied})"
    if untrained:
        count = sum(model[name].size.numel() for name in untrained)
        text += f"; {count:,} elements in {len(untrained)} tensors the optimizer does not train"
        text += f" (buffers, e.g. {untrained[0]})"
    return text
