"""The parity probe: per-step fingerprints of a run's loss, gradients and weights, for `trainmesh check --parity`;
off unless TRAINMESH_PARITY_RECORD names a file.

Details: docs/internals.md#trainparitypy
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from trainmesh.core.dtensors import is_dtensor
from trainmesh.core.env import read_var
from trainmesh.core.files import open_file
from trainmesh.runtime.runtime import Runtime

ENV_VAR = "TRAINMESH_PARITY_RECORD"
NUDGE_VAR = "TRAINMESH_PARITY_NUDGE"
"""Set (to 1) for the run that measures the spread: its gradients get rounding-sized noise at every step (`nudge`)."""
NUDGE_UNITS, NUDGE_RMS_UNITS = 4, 0.125
"""The noise `nudge` adds to each gradient element: NUDGE_UNITS units of the compute dtype's epsilon of the element,
plus NUDGE_RMS_UNITS units of the tensor's root mean square. Another order of summation changes an element by a
unit or two of rounding; an element that is nearly zero because its terms cancel, by a unit of the terms, far
more than of itself (the part of the noise that scales with the tensor), and Adam turns such elements' tiny
gradients into updates of their own. Calibrated on the nano GPT (see trainmesh.apps.parity.compare)."""
CHECKSUMS = ("sum", "l1", "l2", "wsum")
"""The fingerprint of a tensor, in this order."""
SUM, L1, L2, WSUM = range(4)
TINY = 1e-30
"""Scales below this count as zero (an all-zero tensor equals another all-zero one)."""
_HASH = 2654435761  # Knuth's multiplicative hash constant: position i weighs ((i * _HASH) mod 2^32) / 2^32 * 2 - 1

Digest = list[float]


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """[sum, L1, L2, weighted sum] of `tensor` in float64, on its device (one host sync per batch, not each)."""
    x = tensor.detach().reshape(-1).double()
    position = torch.arange(x.numel(), dtype=torch.int64, device=x.device)
    weight = ((position * _HASH) % 2**32).double() / 2**32 * 2 - 1
    return torch.stack([x.sum(), x.abs().sum(), x.norm(), (x * weight).sum()])


def relative_difference(a: Digest, b: Digest, checksum: int) -> float:
    """How far two fingerprints are apart in one checksum, relative to the tensors' size. The sums are divided
    by the larger L1 norm, not by themselves: a sum near zero (a bias gradient whose elements cancel) would
    turn rounding into a huge relative difference. Non-finite values are equal only to the same value."""
    x, y = a[checksum], b[checksum]
    if not (math.isfinite(x) and math.isfinite(y)):
        return 0.0 if (x == y or (math.isnan(x) and math.isnan(y))) else math.inf
    scale = max(abs(a[L1]), abs(b[L1])) if checksum in (SUM, WSUM) else max(abs(x), abs(y))
    return abs(x - y) / max(scale, TINY)


def scalar_difference(x: float, y: float) -> float:
    """|x - y| relative to the larger of the two (the loss, the gradient norm)."""
    return relative_difference([x, abs(x), 0.0, 0.0], [y, abs(y), 0.0, 0.0], SUM)


@torch.no_grad()
def nudge(grad: torch.Tensor, step: int, eps: float) -> None:
    """Add rounding-sized noise (NUDGE_UNITS) to each element of this rank's part of `grad`, its sign pseudo-random
    by position and step: about what another order of summation (another process count, another strategy) leaves in
    a gradient. Replicas and tied copies hold equal tensors and get equal noise (under FSDP each shard is scaled by
    its own RMS: it is noise all the same)."""
    local = grad.to_local() if is_dtensor(grad) else grad
    if local.numel() == 0:
        return
    position = torch.arange(local.numel(), dtype=torch.int64, device=local.device).reshape(local.shape)
    sign = torch.where((position * _HASH + step * 40503) % 2**32 < 2**31, -1.0, 1.0).to(local.dtype)
    rms = float(local.double().square().mean().sqrt())
    local.add_(sign * (NUDGE_UNITS * eps * local.abs() + NUDGE_RMS_UNITS * eps * rms))


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded tensor gathered whole: collective over its mesh, so its holders call it in the same order."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


class ParityProbe:
    """Records one run for the parity check (docs/internals.md#trainparitypy); build it with `from_environ`."""

    def __init__(self, path: Path, nudge: bool = False) -> None:
        self.path = path
        self.nudge = nudge
        self._started = False
        self._names: dict[str, str] = {}  # this rank's parameter name -> the whole model's
        self._stages: dict[str, int] = {}  # whole-model name -> the pipeline stage that holds it here
        self._used: list[str] = []  # whole-model names in the order the first forward used them
        self._hooks: list[RemovableHandle] | None = []  # None once the order is sent
        self._grads: dict[str, Digest | None] = {}
        self._grad_norm = math.nan

    @classmethod
    def from_environ(cls) -> ParityProbe | None:
        """The probe the parity command asked for, or None (normal runs)."""
        path = read_var(ENV_VAR)
        return cls(Path(path), nudge=read_var(NUDGE_VAR) == "1") if path else None

    def before_step(self, runtime: Runtime, model: nn.Module) -> None:
        """Before the first step's forward: the run's header, the initial weights, and the order hooks."""
        if self._started:
            return
        self._started = True
        aliases = runtime.strategy.whole_model_names
        first_name: dict[int, str] = {}  # a weight tied within this rank's modules: its first name
        for name, param in model.named_parameters(remove_duplicate=False):
            first = first_name.setdefault(id(param), name)
            self._names[name] = aliases.get(first, first)
        stages = runtime.strategy.parameter_stages()
        self._stages = {self._names[n]: stages.get(n, 0) for n, _ in model.named_parameters()}
        hooks = []
        for prefix, module in model.named_modules():
            names = [self._names[f"{prefix}.{n}" if prefix else n] for n, _ in module.named_parameters(recurse=False)]
            if names:
                hooks.append(module.register_forward_pre_hook(self._note_use(names)))
        self._hooks = hooks
        shapes = {
            self._names[n]: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
            for n, p in model.named_parameters()
        }
        merged = self._merge(runtime, {"weights": self._fingerprints(model, lambda p: p), "params": shapes})
        if merged is not None:
            header = {
                "kind": "run",
                "world_size": runtime.world_size,
                "strategy": runtime.strategy.name,
                "compute_dtype": str(runtime.precision.compute_dtype).removeprefix("torch."),
                "params": merged.pop("params"),
            }
            with open_file(self.path, "w", encoding="utf-8") as f:  # a fresh record for this run
                f.write(json.dumps(header) + "\n")
                f.write(json.dumps({"kind": "step", "step": 0, **merged}) + "\n")

    def _note_use(self, names: list[str]) -> Callable[[nn.Module, Any], None]:
        def used(module: nn.Module, args: Any) -> None:
            self._used.extend(n for n in names if n not in self._used)

        return used

    def gradients(
        self, step: int, runtime: Runtime, model: nn.Module, grad_norm: torch.Tensor, max_norm: float
    ) -> None:
        """After Runtime.clip_grad_norm (docs/internals.md#trainparitypy); `grad_norm` is its pre-clip norm."""
        for hook in self._hooks or []:  # the first forward is over: its order is known
            hook.remove()
        if self.nudge:
            eps = torch.finfo(
                runtime.precision.compute_dtype
            ).eps  # fp32's would leave bf16's first steps without a spread
            for param in model.parameters():
                if param.grad is not None:
                    nudge(param.grad, step, eps)
        self._grad_norm = float(grad_norm)
        # Both clipping paths (torch's clip_grad_norm_ and strategies.gradients) scale by this factor.
        factor = min(1.0, max_norm / (self._grad_norm + 1e-6)) if max_norm > 0 else 1.0
        if not math.isfinite(factor) or factor <= 0:
            factor = 1.0  # non-finite gradients: recorded as they are
        digests = self._fingerprints(model, lambda p: p.grad)
        self._grads = {k: None if d is None else [v / factor for v in d] for k, d in digests.items()}

    def after_step(
        self, step: int, runtime: Runtime, model: nn.Module, loss: torch.Tensor, targets: float, stepped: bool
    ) -> None:
        """After the optimizer step `step` (from 1): rank 0 appends the step's line. `loss`: this rank's summed
        loss of the step; `targets`: the global batch's target count."""
        mine: dict[str, Any] = {
            "weights": self._fingerprints(model, lambda p: p),
            "grads": self._grads,
            "loss": float(loss),
        }
        if self._hooks is not None:  # the first step: the order its forward used the parameters in
            mine["order"] = [(self._stages[n], i, n) for i, n in enumerate(self._used)]
            self._hooks = None
        merged = self._merge(runtime, mine)
        if merged is None:
            return
        loss_sum = merged.pop("loss_sum")
        line = {
            "kind": "step",
            "step": step,
            "loss": loss_sum / targets if targets > 0 else math.nan,
            "grad_norm": self._grad_norm,
            "stepped": stepped,
            **merged,
        }
        with open_file(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    def _fingerprints(
        self, model: nn.Module, pick: Callable[[nn.Parameter], torch.Tensor | None]
    ) -> dict[str, Digest | None]:
        """Fingerprints of `pick(p)` for this rank's parameters under their whole-model names (None where it is
        None: a parameter without a gradient)."""
        found: dict[str, torch.Tensor | None] = {}
        for name, param in model.named_parameters():  # the same order on every holder of a sharded tensor
            tensor = pick(param)
            found[self._names[name]] = None if tensor is None else fingerprint(_whole(tensor.detach()))
        present = [t for t in found.values() if t is not None]
        values = torch.stack(present).cpu().tolist() if present else []
        it = iter(values)
        return {name: None if t is None else next(it) for name, t in found.items()}

    def _merge(self, runtime: Runtime, mine: dict[str, Any]) -> dict[str, Any] | None:
        """Collective: every rank's fingerprints, merged on rank 0 (None elsewhere). Each parameter keeps its
        first holder's; another holder's copy that differs is noted under "replicas" (kind -> name -> [rank,
        relative difference]). The loss is summed over ranks (each rank holds its micro-batches' share)."""
        everyone = runtime.all_gather_object(mine)
        if not runtime.is_main_process:
            return None
        merged: dict[str, Any] = {}
        if "params" in mine:  # shapes and dtypes: each rank knows its own stage's
            merged["params"] = {k: v for theirs in everyone for k, v in theirs["params"].items()}
        replicas: dict[str, dict[str, list[float]]] = {}
        for kind in ("grads", "weights"):
            if kind not in mine:
                continue
            table: dict[str, Digest | None] = {}
            for rank, theirs in enumerate(everyone):
                for name, digest in theirs[kind].items():
                    if name not in table:
                        table[name] = digest
                        continue
                    ours = table[name]
                    if ours is None or digest is None:
                        worst = 0.0 if ours is digest else math.inf
                    else:
                        worst = max(relative_difference(ours, digest, c) for c in (SUM, L2, WSUM))
                    if worst > replicas.get(kind, {}).get(name, [0, 0.0])[1]:
                        replicas.setdefault(kind, {})[name] = [rank, worst]
            merged[kind] = table
        merged["replicas"] = replicas
        if "loss" in mine:
            merged["loss_sum"] = math.fsum(theirs["loss"] for theirs in everyone)
        if "order" in mine:
            order: list[str] = []
            for _, _, name in sorted({tuple(e) for theirs in everyone for e in theirs["order"]}):
                if name not in order:  # by stage, then by first use within the stage
                    order.append(name)
            merged["order"] = order
        return merged
