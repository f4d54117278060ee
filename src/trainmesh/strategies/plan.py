"""`ParallelPlan`: what a recipe tells the strategies about its model's structure (blocks, tensor parallelism,
pipeline stages, weight initialisation), so that model code knows nothing of parallelism.

Details: docs/internals.md#strategiesplanpy
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

TensorParallelPlan = Callable[[nn.Module, DeviceMesh], None]
PipelineSplit = Callable[[nn.Module, int, int], nn.Module]  # (model, stage index, number of stages)


@dataclass
class ParallelPlan:
    blocks: list[nn.Module] | None = None
    """The model's repeated units; None: the modules in its nn.ModuleLists / nn.ModuleDicts."""
    tensor_parallel: TensorParallelPlan | None = None
    """Applies tensor parallelism in place (needed for parallel.tp > 1)."""
    pipeline_stage: PipelineSplit | None = None
    """Builds one pipeline stage (needed for parallel.pp > 1)."""
    init_weights: Callable[[nn.Module], None] | None = None
    """Initialises the parameters of a model or a part of one (needed for a model on the meta device)."""
