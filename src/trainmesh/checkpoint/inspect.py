"""`trainmesh ckpt verify|inspect`: check and describe checkpoints offline, in one process.

Verification comes first and gates everything else: DCP's `.metadata` is a pickle, so it is read only
once its hash matches the manifest.
"""

from __future__ import annotations

import json
from pathlib import Path

from trainmesh.checkpoint.catalog import list_checkpoints
from trainmesh.checkpoint.dcp import saved_tensors
from trainmesh.checkpoint.manifest import Verdict, verify


def checkpoints_at(path: Path) -> list[Path]:
    """A checkpoint directory itself, or every committed checkpoint of a run directory."""
    if (path / "manifest.json").exists() or (path / ".metadata").exists():
        return [path]
    found = list_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"{path} is neither a checkpoint nor a run directory with checkpoints")
    return found


def verify_all(path: Path) -> list[Verdict]:
    return [verify(ckpt) for ckpt in checkpoints_at(path)]


def describe(ckpt: Path) -> str:
    """Step, provenance and every tensor (name, shape, dtype) of a verified checkpoint."""
    verdict = verify(ckpt)
    if not verdict.ok:
        raise ValueError("refusing to read an unverified checkpoint:\n  " + "\n  ".join(verdict.problems))
    state = json.loads((ckpt / "trainer_state.json").read_text())
    lines = [
        f"checkpoint {ckpt}",
        f"  step {state['step']}, {state['samples_seen']:,} samples seen, saved by {state['world_size']} rank(s)",
        "  versions: " + ", ".join(f"{k} {v}" for k, v in state["versions"].items()),
        f"  recipe {state['config']['run']['recipe']}, model {state['config']['model']}",
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
    lines.append(f"  files: {sum(p.stat().st_size for p in ckpt.rglob('*') if p.is_file()):,} bytes")
    return "\n".join(lines)
