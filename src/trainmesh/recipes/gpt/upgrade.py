"""Checkpoints of the GPT from before its q, k and v projections were fused into `attn.qkv`, converted to the fused,
head-by-head layout; the model computes the same function.

Details: docs/internals.md#recipesgptupgradepy
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from trainmesh.recipes.gpt.model import SIZES

Parts = Callable[[str], list[str]]
"""The three old names of a fused one."""
_SEPARATE = re.compile(r"(?P<block>.*\.attn)\.(?P<which>[qkv])\.(?P<kind>weight|bias)")


def fuse_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_head: int) -> torch.Tensor:
    """Three (C, ...) projections -> one (3C, ...) whose rows go head by head: q_h, k_h, v_h for each head h."""
    per_head = [t.reshape(n_head, t.shape[0] // n_head, *t.shape[1:]) for t in (q, k, v)]  # (H, Q, ...)
    return torch.stack(per_head, dim=1).reshape(3 * q.shape[0], *q.shape[1:])  # (H, 3, Q, ...) -> (3C, ...)


def fuse_qkv(state: dict[str, Any], model_config: dict[str, Any]) -> list[str]:
    """Convert a full checkpoint state ({"model": ..., "optim": {"state", "param_groups"}}) in place; returns
    one line per fused projection (none: the state has the current layout)."""
    model = state["model"]
    fused = {m["block"] + ".qkv." + m["kind"] for key in model if (m := _SEPARATE.fullmatch(key))}
    if not fused:
        return []
    n_head = int(model_config.get("n_head") or SIZES[model_config.get("size", "tiny")][1])

    def parts(name: str) -> list[str]:
        block, kind = name.rsplit(".qkv.", 1)
        return [f"{block}.{which}.{kind}" for which in "qkv"]

    state["model"] = _fused_dict(model, fused, parts, lambda q, k, v: fuse_heads(q, k, v, n_head))
    optim = state.get("optim", {})
    moments = optim.get("state", {})
    if moments:
        optim["state"] = _fused_dict(moments, fused, parts, lambda q, k, v: _fuse_moments(q, k, v, n_head))
    for group in optim.get("param_groups", []):
        group["params"] = _fused_names(group["params"], fused, parts)
    return [f"{', '.join(parts(name))} -> {name}" for name in sorted(fused)]


def _fused_dict(
    values: dict[str, Any], fused: set[str], parts: Parts, fuse: Callable[[Any, Any, Any], Any]
) -> dict[str, Any]:
    """`values` with the three entries of each fused name replaced by one, where the first of them was."""
    out: dict[str, Any] = {}
    first = {parts(name)[0]: name for name in fused}
    dropped = {part for name in fused for part in parts(name)}
    for key, value in values.items():
        if key in first:
            name = first[key]
            missing = [p for p in parts(name) if p not in values]
            if missing:
                raise ValueError(f"the checkpoint has {key} but not {', '.join(missing)}: it cannot be converted")
            out[name] = fuse(*(values[p] for p in parts(name)))
        elif key not in dropped:
            out[key] = value
    return out


def _fuse_moments(q: dict[str, Any], k: dict[str, Any], v: dict[str, Any], n_head: int) -> dict[str, Any]:
    """An optimizer's per-parameter state: tensors shaped like the parameter are fused (AdamW's moments),
    the rest (the step count, equal for all three) is q's."""
    return {
        key: fuse_heads(value, k[key], v[key], n_head) if isinstance(value, torch.Tensor) and value.dim() > 0 else value
        for key, value in q.items()
    }


def _fused_names(names: list[Any], fused: set[str], parts: Parts) -> list[Any]:
    """An optimizer param group's parameter names, the three of each fused projection as one."""
    first = {parts(name)[0]: name for name in fused}
    dropped = {part for name in fused for part in parts(name)}
    return [first.get(n, n) for n in names if n in first or n not in dropped]
