"""The model as `trainmesh plan` sees it: every parameter's shape (the real GPT, built on the meta device), where a
layout puts it (pipeline stage, tensor-parallel and FSDP cuts), and the FLOPs of a step.

Details: docs/internals.md#appsplanmodelpy
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from trainmesh.recipes.gpt.model import GPT, GPTConfig

EMBED, HEAD = "embed", "head"
# parameter name suffix -> the dimension tensor parallelism cuts (None: kept whole on every rank)
_TP_DIM = {
    "attn.qkv.weight": 0,
    "attn.qkv.bias": 0,
    "attn.proj.weight": 1,
    "mlp.fc.weight": 0,
    "mlp.fc.bias": 0,
    "mlp.proj.weight": 1,
    "wte.weight": 0,
}


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    block: int | None
    """The block index, or None for the embeddings (EMBED side) and the final norm / head (HEAD side)."""
    side: str
    """EMBED, HEAD or 'block'."""
    tp_dim: int | None

    def local_numel(self, tp: int, shard: int) -> int:
        """Elements on the most loaded rank after tensor parallelism over `tp` and FSDP over `shard` ranks."""
        shape = list(self.shape)
        if self.tp_dim is not None and tp > 1:
            shape[self.tp_dim] //= tp
        if shard > 1:
            shape[0] = math.ceil(shape[0] / shard)
        return math.prod(shape)


@dataclass(frozen=True)
class ModelSpec:
    """A GPT's shape and its parameter table."""

    cfg: GPTConfig

    @property
    def n_layer(self) -> int:
        return self.cfg.n_layer

    @property
    def n_head(self) -> int:
        return self.cfg.n_head

    @property
    def n_embd(self) -> int:
        return self.cfg.n_embd

    @property
    def vocab(self) -> int:
        return self.cfg.vocab_size

    @property
    def seq(self) -> int:
        return self.cfg.block_size

    @cached_property
    def params(self) -> tuple[Param, ...]:
        with torch.device("meta"):
            model = GPT(self.cfg)
        table = []
        for name, p in model.named_parameters():  # the tied head weight once, as wte.weight
            parts = name.split(".")
            block = int(parts[1]) if parts[0] == "blocks" else None
            side = "block" if block is not None else (EMBED if parts[0] in ("wte", "wpe") else HEAD)
            tp_dim = next((d for suffix, d in _TP_DIM.items() if name.endswith(suffix)), None)
            table.append(Param(name, tuple(p.shape), block, side, tp_dim))
        return tuple(table)

    @property
    def n_params(self) -> int:
        return sum(math.prod(p.shape) for p in self.params)

    def stage_of_block(self, block: int, pp: int) -> int:
        return next(i for i in range(pp) if i * self.n_layer // pp <= block < (i + 1) * self.n_layer // pp)

    def stage_params(self, stage: int, pp: int, last: int | None = None) -> list[Param]:
        """The parameters pipeline rank `stage` of `pp` holds (all of them when pp = 1): its blocks, the embeddings on
        rank 0, the final norm and the head on rank `last` (the one with the pipeline's last stage: pp − 1 by
        default; 0 under a V schedule, where the tied matrix is then one tensor)."""
        last = pp - 1 if last is None else last
        held = []
        for p in self.params:
            if p.side == "block":
                assert p.block is not None
                if self.stage_of_block(p.block, pp) == stage:
                    held.append(p)
            elif (
                (p.side == EMBED and stage == 0)
                or (p.side == HEAD and stage == last)
                or (p.name == "wte.weight" and stage == last != 0)  # the head's copy of the tied matrix
            ):
                held.append(p)
        return held

    def blocks_of_stage(self, stage: int, pp: int) -> int:
        return (stage + 1) * self.n_layer // pp - stage * self.n_layer // pp

    def matmul_flops_per_token(self, *, side: str) -> float:
        """Forward FLOPs per token of the matrix products of one block (side 'block', attention's two
        products over the full, non-causal, sequence as Megatron and nanoGPT count them) or of the head."""
        h, s, v = self.n_embd, self.seq, self.vocab
        if side == "block":
            return 2 * 12 * h * h + 2 * 2 * s * h
        return 2 * h * v

    def train_flops_per_token(self) -> float:
        """Forward + backward (3× forward) FLOPs per token: 72·L·h²(1 + s/(6h)) + 6hV, Megatron's formula."""
        return 3 * (self.n_layer * self.matmul_flops_per_token(side="block") + self.matmul_flops_per_token(side=HEAD))
