"""Per-block model transforms, in a fixed order: activation checkpointing, then torch.compile (then a
sharding strategy wraps each block).

A block is one repeated unit of the model (a transformer layer, a residual stage). The recipe names
them (`ParallelPlan.blocks`); by default they are the modules held in `nn.ModuleList`s (or
`nn.ModuleDict`s, as in a pipeline stage). Both transforms
change a block in place and keep its parameter names, so checkpoints load across settings.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def find_blocks(module: nn.Module) -> list[nn.Module]:
    """The modules inside the outermost `nn.ModuleList`s (or `nn.ModuleDict`s) of `module`, in order."""
    blocks: list[nn.Module] = []
    for child in module.children():
        if isinstance(child, nn.ModuleList):
            blocks.extend(child)
        elif isinstance(child, nn.ModuleDict):
            blocks.extend(child.values())
        else:
            blocks.extend(find_blocks(child))
    return blocks


def transform_blocks(module: nn.Module, blocks: list[nn.Module], *, checkpoint_every: int, compile: bool) -> None:
    """Checkpoint every `checkpoint_every`-th block's activations (parallel.activation_checkpointing; 0: none)
    and compile each block, in place; compile `module` whole when it has no blocks."""
    for i, block in enumerate(blocks):
        if checkpoint_every > 0 and i % checkpoint_every == 0:
            checkpoint_activations(block)
        if compile:
            block.compile()
    if compile and not blocks:
        module.compile()


def checkpoint_activations(block: nn.Module) -> None:
    """Make `block` keep only its inputs in forward and recompute the rest in backward.

    Done by replacing the instance's forward, not by wrapping it in another module, so parameter
    names stay the same. The RNG state is restored for the recomputation, so dropout masks match.
    """
    block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
