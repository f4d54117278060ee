"""How the GPT is cut for model parallelism, from outside the model code: a Megatron-style tensor-parallel plan and a
pipeline split, applied by the strategies; parameter names never change.

Details: docs/internals.md#recipesgptparallelpy
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainmesh.recipes.gpt.model import GPT, GPTConfig, embed_tokens
from trainmesh.strategies.blocks import find_blocks


def check_tensor_parallel(cfg: GPTConfig, tp: int) -> None:
    """The degrees a GPT can be cut into: whole heads and whole vocabulary rows per rank."""
    for key, value in (("model.n_head", cfg.n_head), ("model.vocab_size", cfg.vocab_size)):
        if value % tp:
            raise ValueError(
                f"{key}={value} cannot be split evenly over parallel.tp={tp} ranks. "
                f"Fix: a parallel.tp that divides {value}, or change {key}."
            )


def check_pipeline(cfg: GPTConfig, stages: int) -> None:
    """Every pipeline stage needs at least one block."""
    if stages > cfg.n_layer:
        raise ValueError(
            f"model.n_layer={cfg.n_layer} blocks cannot fill {stages} pipeline stages (parallel.pp × stages "
            f"per rank). Fix: a smaller parallel.pp, a schedule with one stage per rank, or model.n_layer >= {stages}."
        )


def parallelize_gpt(model: nn.Module, mesh: DeviceMesh) -> None:
    """Apply tensor parallelism in place to a GPT or one of its pipeline stages."""
    # imported here: DTensor's second of import only where tensor parallelism runs (core/dtensors.py)
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    block_plan = {  # Megatron's: column-parallel in, row-parallel out, one all-reduce per sub-layer
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(),
    }
    cfg = model.cfg
    assert isinstance(cfg, GPTConfig)
    check_tensor_parallel(cfg, mesh.size())
    for block in find_blocks(model):
        parallelize_module(block, mesh, block_plan)
    wte, lm_head = getattr(model, "wte", None), getattr(model, "lm_head", None)
    tied = isinstance(wte, nn.Embedding) and isinstance(lm_head, nn.Linear) and lm_head.weight is wte.weight
    if isinstance(wte, nn.Embedding):  # token ids replicated in, embeddings summed over the vocabulary shards
        parallelize_module(model, mesh, {"wte": RowwiseParallel(input_layouts=Replicate())})
    if isinstance(lm_head, nn.Linear):  # logits gathered whole: the loss needs every vocabulary entry
        parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
        if tied and isinstance(wte, nn.Embedding):  # both shard the (V, C) matrix by rows: one tensor again
            lm_head.weight = wte.weight


class GPTStage(nn.Module):
    """Pipeline stage `index` of `count`. It shares the model's submodules under the model's names,
    so its parameters, gradients and checkpoint keys are the model's."""

    def __init__(self, model: GPT, index: int, count: int) -> None:
        super().__init__()
        check_pipeline(model.cfg, count)
        n = model.cfg.n_layer
        self.cfg = model.cfg
        self.first, self.last = index == 0, index == count - 1
        if self.first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        lo, hi = index * n // count, (index + 1) * n // count
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(lo, hi)})
        if self.last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: token ids (B, T); others: hidden states (B, T, C). Last: logits (B, T, V)."""
        if self.first:
            x = embed_tokens(self.wte, self.wpe, self.drop, x)
        for block in self.blocks.values():
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def pipeline_stage_gpt(model: nn.Module, index: int, count: int) -> nn.Module:
    assert isinstance(model, GPT)
    return GPTStage(model, index, count)
