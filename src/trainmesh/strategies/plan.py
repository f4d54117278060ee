"""`ParallelPlan`: what a recipe tells the strategies about its model's structure.

Model code knows nothing of parallelism. The recipe describes, from outside, how its model is cut:

    blocks           the repeated units, checkpointed and sharded one by one (and compiled one by one
                     where they are sharded or split across ranks; else the model compiles whole)
    tensor_parallel  a function that turns the weights of one model (or pipeline stage) into
                     tensor-parallel DTensors on a 1-D mesh (e.g. recipes/gpt/parallel.py)
    pipeline_stage   a function that builds pipeline stage `i` of `n` as a module that shares the
                     model's submodules and keeps their parameter names (so checkpoints are the same
                     for every strategy)
    init_weights     initialises a model, or any part of it, in place: needed for a model built on the
                     meta device, which gets real storage only for what this rank holds after sharding

They are applied in a fixed order (strategies/base.py): pipeline split, tensor parallel, activation
checkpointing, torch.compile, then the data-parallel wrapper (DDP or FSDP). A model built on the meta
device is materialised and initialised after sharding (fsdp) or just before the wrapper (the others).
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
