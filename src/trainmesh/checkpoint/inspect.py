"""`trainmesh ckpt verify|inspect`: check and describe checkpoints offline, in one process.

Verification comes first and gates everything else: the files must match the manifest (no damage), and
what they hold must read as a trainmesh checkpoint: a valid trainer state, and DCP metadata that the
allow-listing unpickler of reader.py accepts (a checkpoint from elsewhere cannot run code here).
"""

from __future__ import annotations

from pathlib import Path

from trainmesh.checkpoint.catalog import check_checkpoint, list_checkpoints
from trainmesh.checkpoint.manifest import Verdict
from trainmesh.checkpoint.reader import saved_tensors
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
    total = 0
    for section in ("model", "optim"):
        names = sorted(k for k in tensors if k.startswith(section + "."))
        count = sum(tensors[k].size.numel() for k in names)
        total += count
        lines.append(f"  {section}: {len(names)} tensors, {count:,} elements")
        if section == "model":
            for name in names:
                meta = tensors[name]
                lines.append(f"    {name[len('model.') :]:<40} {tuple(meta.size)!s:<16} {meta.properties.dtype}")
    files = [p for p in ckpt.rglob("*") if p.is_file() and not p.is_symlink()]
    lines.append(f"  files: {sum(p.stat().st_size for p in files):,} bytes")
    return "\n".join(lines)
