"""`fp8-mixed`: bf16 autocast, with the model's linear layers computing their matmuls in float8 through torchao.
Tied layers, and those whose sizes are not multiples of 16, stay in bf16; checkpoints move freely between
precisions.

Details: docs/internals.md#precisionfp8py
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainmesh.config.schema import Float8Config
from trainmesh.core.logging import get_logger
from trainmesh.precision.amp import MixedPrecision

log = get_logger(__name__)

FP8_MIN_CAPABILITY = (8, 9)
"""torchao's requirement for float8 matmuls (torchao.utils.is_sm_at_least_89): Ada, Hopper and newer."""


class Float8MixedPrecision(MixedPrecision):
    """`fp8-mixed`: bf16 autocast, float8 matmuls in the linear layers `float8_linears` chooses."""

    name = "fp8-mixed"

    def __init__(self, device: torch.device, options: Float8Config | None = None) -> None:
        super().__init__(device, torch.bfloat16)
        self.options = options or Float8Config()
        self._precompute_for: list[nn.Module] = []

    def convert_module(self, module: nn.Module) -> nn.Module:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        opts = self.options
        config = dataclasses.replace(
            Float8LinearConfig.from_recipe_name(opts.recipe),
            enable_fsdp_float8_all_gather=opts.fsdp_all_gather,
            emulate=opts.emulate,
        )
        chosen, kept = float8_linears(module)
        carried = {name: _own_attributes(module.get_submodule(name)) for name in chosen}
        converted = convert_to_float8_training(module, config=config, module_filter_fn=lambda _, fqn: fqn in chosen)
        for name, attributes in carried.items():
            # Float8Linear.from_float builds a new module: what the model set on its Linear (the GPT's
            # residual_scale, which its init reads again after a meta build) must survive the swap.
            new = converted.get_submodule(name)
            for key, value in attributes.items():
                if key not in vars(new):
                    setattr(new, key, value)
        how = f"{opts.recipe} scaling" + (", emulated" if opts.emulate else "")
        how += ", float8 all-gather under fsdp" if opts.fsdp_all_gather else ""
        kept_text = "; ".join(f"{name} ({why})" for name, why in kept.items()) or "none"
        if chosen:
            log.info(
                "fp8-mixed: %d linear layers compute in float8 (%s); kept in bf16: %s", len(chosen), how, kept_text
            )
        else:
            log.info(
                "fp8-mixed: no linear layer can compute in float8 (kept in bf16: %s): this runs as bf16-mixed",
                kept_text,
            )
        return converted

    def attach(self, module: nn.Module) -> None:
        if self.options.fsdp_all_gather:
            self._precompute_for.append(module)

    def step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> bool:
        optimizer.step() if closure is None else optimizer.step(closure)  # a step() of its own may take none
        if self._precompute_for:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            for module in self._precompute_for:  # the next forward's float8 all-gathers use these scales
                precompute_float8_dynamic_scale_for_fsdp(module)
        return True

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16  # what flows between layers: float8 is only inside the converted matmuls

    @property
    def peak_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn  # the converted linear layers' matmuls (attention and the head: bf16)


def float8_linears(module: nn.Module) -> tuple[list[str], dict[str, str]]:
    """The names of the `nn.Linear` modules fp8-mixed converts, and of those it keeps in bf16 with the reason."""
    owners: dict[int, list[str]] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        for param in sub.parameters(recurse=False):
            owners.setdefault(id(param), []).append(name)
    chosen: list[str] = []
    kept: dict[str, str] = {}
    for name, sub in module.named_modules():
        if not isinstance(sub, nn.Linear):
            continue
        shared = sorted({o for p in sub.parameters(recurse=False) for o in owners[id(p)] if o != name})
        if shared:
            kept[name] = f"weight shared with {', '.join(shared)}"
        elif sub.in_features % 16 or sub.out_features % 16:
            kept[name] = f"{sub.in_features}->{sub.out_features} features, not multiples of 16"
        else:
            chosen.append(name)
    return chosen, kept


def _own_attributes(module: nn.Module) -> dict[str, Any]:
    """Plain attributes set on a module instance (not nn.Module's own bookkeeping)."""
    return {k: v for k, v in vars(module).items() if not k.startswith("_")}


def fp8_problem(precision: str, device_type: str, capability: tuple[int, int] | None, device_name: str) -> str | None:
    """Why `device_type` (with its CUDA compute capability and name) cannot run float8 matmuls; None when it can."""
    fix = "--train.precision=bf16-mixed, or --float8.emulate=true to test fp8-mixed's numerics (slower)"
    if device_type != "cuda":
        return (
            f"train.precision={precision!r} computes in float8 on NVIDIA tensor cores of compute capability "
            f"{_capability(FP8_MIN_CAPABILITY)} or newer (Ada, Hopper, Blackwell: L4, L40S, H100, H200, B200), but "
            f"the device here is {device_type}. Fix: run on such a GPU, or {fix}."
        )
    if capability is not None and capability < FP8_MIN_CAPABILITY:
        return (
            f"train.precision={precision!r} needs float8 tensor cores: compute capability "
            f"{_capability(FP8_MIN_CAPABILITY)} or newer (Ada, Hopper, Blackwell: L4, L40S, H100, H200, B200), but "
            f"{device_name} has compute capability {_capability(capability)}. Fix: {fix} on this GPU."
        )
    return None


def _capability(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"


def torchao_problem(precision: str) -> str | None:
    """A message when torchao's float8 training cannot be imported: not installed, or installed but broken (a build
    for another torch, a release without the API used here); None when it can. Only fp8-mixed imports torchao. Its
    own `Failed to load ..._C_*.so` warnings, at import, are about its C++ kernels (mxfp8, CUTLASS), which float8
    training does not use."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: F401
    except ModuleNotFoundError as e:
        if not (e.name or "torchao").startswith("torchao"):  # torchao is there, but a module it needs is not
            return _broken_torchao(precision, e)
        return (
            f"train.precision={precision!r} needs torchao (its float8 training: torchao>=0.10, trainmesh's [fp8] "
            f"extra), which is not installed here ({e}). Fix: pip install 'trainmesh[fp8]', or "
            "--train.precision=bf16-mixed."
        )
    except Exception as e:  # an import that fails another way: a build for another torch or Python, an older API
        return _broken_torchao(precision, e)
    return None


def _broken_torchao(precision: str, error: Exception) -> str:
    try:
        installed = f"torchao {importlib.metadata.version('torchao')}"
    except importlib.metadata.PackageNotFoundError:
        installed = "torchao"
    return (
        f"train.precision={precision!r} needs torchao's float8 training (Float8LinearConfig, "
        f"convert_to_float8_training), but {installed} fails to import it with torch {torch.__version__} here "
        f"({type(error).__name__}: {error}). Fix: install a torchao release built for this torch (pip install -U "
        "'trainmesh[fp8]'), or --train.precision=bf16-mixed."
    )
