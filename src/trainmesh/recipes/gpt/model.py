"""A GPT language model in the nanoGPT mould: pre-norm blocks, causal self-attention through
`scaled_dot_product_attention` (flash attention where the device has it), tied input/output
embeddings, and GPT-2's initialisation (residual projections scaled by 1/sqrt(2·n_layer)).

Model code knows nothing of parallelism; strategies wrap it from outside.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from trainmesh.config.schema import ModelConfig
from trainmesh.core.dtensors import is_dtensor
from trainmesh.layers.linear_cross_entropy import linear_cross_entropy

IGNORE_INDEX = -100

# name: (n_layer, n_head, n_embd). The gpt2-* sizes are GPT-2's published shapes.
SIZES: dict[str, tuple[int, int, int]] = {
    "nano": (2, 2, 32),  # tests
    "tiny": (4, 4, 128),  # the CPU default: trains in minutes on two cores
    "small": (6, 6, 384),
    "gpt2": (12, 12, 768),  # 124M
    "gpt2-medium": (24, 16, 1024),  # 350M
    "gpt2-large": (36, 20, 1280),  # 774M
}


@dataclass(frozen=True)
class GPTConfig(ModelConfig):
    size: str = "tiny"
    """Named shape: nano | tiny | small | gpt2 (124M) | gpt2-medium (350M) | gpt2-large (774M)."""
    n_layer: int = 0
    """Transformer blocks; 0: from size (with init_from: from its config.json)."""
    n_head: int = 0
    """Attention heads; 0: from size (with init_from: from its config.json)."""
    n_embd: int = 0
    """Embedding width; 0: from size (with init_from: from its config.json)."""
    block_size: int = 128
    """Context length in tokens (the sequence length of each sample)."""
    vocab_size: int = 0
    """Vocabulary size; 0: from the tokenizer or init_from (GPT-2 runs usually pad 50257 up to 50304 for speed)."""
    dropout: float = 0.0
    """Dropout probability on attention weights and residual branches."""
    bias: bool = True
    """Biases in linear layers and LayerNorms (GPT-2 has them)."""
    init_from: str = ""
    """A local folder of Hugging Face GPT-2 weights (model.safetensors, config.json) to start from; "": random."""
    loss_chunk_tokens: int = 0
    """Training's head and loss this many tokens at a time, fused (layers/linear_cross_entropy.py): the (tokens ×
    vocabulary) logits never exist whole, which frees most activation memory for a larger micro-batch; 0: whole.
    Not with parallel.pp or parallel.tp > 1. docs/gpu.md gives its measured effect."""

    def __post_init__(self) -> None:
        if self.size not in SIZES:
            raise ValueError(f"model.size={self.size!r} is not one of {', '.join(SIZES)}")
        # The size's values are filled in when built, so the written config states the shape (frozen: no other way).
        # With init_from, the shape left at 0 comes from the folder's config.json instead (the recipe's
        # complete_model), so the size's values must not take the place of "unset" here.
        if not self.init_from:
            for key, value in zip(("n_layer", "n_head", "n_embd"), SIZES[self.size], strict=True):
                object.__setattr__(self, key, getattr(self, key) or value)
        if self.n_head and self.n_embd % self.n_head:
            raise ValueError(
                f"model.n_embd={self.n_embd} must be divisible by model.n_head={self.n_head} "
                f"(each head gets n_embd / n_head dimensions)"
            )
        if self.block_size < 1:
            raise ValueError(f"model.block_size={self.block_size} must be >= 1")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"model.dropout={self.dropout} must be in [0, 1)")
        if self.loss_chunk_tokens < 0:
            raise ValueError(
                f"model.loss_chunk_tokens={self.loss_chunk_tokens} must be >= 0 (0: the head's logits whole; e.g. "
                "8192: 8192 tokens' logits at a time)"
            )


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.dropout = cfg.dropout
        # One projection for q, k and v (one matmul, as nanoGPT), its outputs laid out head by head:
        # [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]. A column-parallel shard of it is then whole heads with their
        # own q, k and v, which tensor parallelism needs (nanoGPT's q | k | v order would give a rank only q).
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj.residual_scale = True  # type: ignore[assignment]  # GPT-2 init marker
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, H, 3, Q) -> three (B, H, T, Q); H is this rank's share of the heads under tensor parallelism
        q, k, v = self.qkv(x).view(B, T, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)  # (B, H, T, Q)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, H·Q)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj.residual_scale = True  # type: ignore[assignment]
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(
        self, cfg: GPTConfig, seed: int | None = None, weights: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        """`seed`: of the initial weights (default: torch's current seed); `weights`: full tensors by parameter
        name that take the place of random ones (see `init_gpt_weights`). Built on the meta device
        (`with torch.device("meta")`), the weights are left to `init_gpt_weights`, after sharding."""
        super().__init__()
        assert cfg.vocab_size > 0, "vocab_size must be resolved (from the tokenizer) before building"
        assert min(cfg.n_layer, cfg.n_head, cfg.n_embd) > 0, "the shape must be resolved (complete_model) first"
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying: one matrix embeds and un-embeds
        self.init_seed = torch.initial_seed() if seed is None else seed
        """The seed of the initial weights (`init_gpt_weights` gives a meta-built model the same ones)."""
        init_gpt_weights(self, self.init_seed, weights)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab). Given the `targets` (B, T) with model.loss_chunk_tokens set:
        their summed cross-entropy (a scalar) instead, the head computed with the loss a chunk at a time."""
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        chunk = self.cfg.loss_chunk_tokens
        if targets is not None and chunk:
            return linear_cross_entropy(self.ln_f(x), self.lm_head.weight, targets, chunk, IGNORE_INDEX)
        return self.head(x)

    # The two ends of the network, also used by the pipeline stages that hold them (recipes/gpt/parallel.py).
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return embed_tokens(self.wte, self.wpe, self.drop, idx)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden states (B, T, C) -> logits (B, T, V)."""
        return self.lm_head(self.ln_f(x))

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; without position embeddings by default (the MFU convention)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N + 12·L·H·Q·T (nanoGPT / PaLM appendix B)."""
        c = self.cfg
        return 6 * self.num_params() + 12 * c.n_layer * c.n_head * (c.n_embd // c.n_head) * c.block_size

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float, top_k: int) -> torch.Tensor:
        """Extend idx (B, T) by sampling `max_new_tokens` tokens."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.cfg.block_size :]
            logits = self(context)[:, -1, :] / temperature  # (B, V)
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits.float(), dim=-1), num_samples=1)  # (B, 1)
            idx = torch.cat((idx, nxt), dim=1)
        return idx


def embed_tokens(wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """Token ids (B, T) -> token + position embeddings (B, T, C), for a GPT or its first pipeline stage."""
    _, T = idx.shape
    if wpe.num_embeddings < T:
        raise ValueError(f"sequence of {T} tokens exceeds model.block_size={wpe.num_embeddings}")
    pos = torch.arange(T, device=idx.device)
    return drop(wte(idx) + wpe(pos))


def init_gpt_weights(module: nn.Module, seed: int, weights: Mapping[str, torch.Tensor] | None = None) -> None:
    """GPT-2's initialisation of a GPT or any part of one (a pipeline stage, a sharded model).

    Every parameter draws from its own random stream, seeded by (seed, parameter name), so the values
    do not depend on how the model is cut: the whole model, its pipeline stages and its shards get the
    same weights (a DTensor receives this rank's part of the same full tensor; the full tensor is made
    one parameter at a time). The head is tied to the token embedding and draws from its stream.
    A parameter whose name is in `weights` takes that full tensor instead (cast to its dtype), by the
    same path, so loaded weights reach every layout too (`weights` may read them lazily, one at a time).
    Parameters still on the meta device are skipped.
    """
    configs = [cfg for m in module.modules() if isinstance(cfg := getattr(m, "cfg", None), GPTConfig)]
    n_layer = configs[0].n_layer  # a GPT or a GPTStage carries its config
    with torch.no_grad():
        for prefix, owner in module.named_modules():
            for short, param in owner.named_parameters(recurse=False):
                if param.is_meta:
                    continue
                name = f"{prefix}.{short}" if prefix else short
                name = "wte.weight" if name.endswith("lm_head.weight") else name
                shape = tuple(param.shape)  # a DTensor's is the full tensor's
                if weights is not None and name in weights:
                    full = weights[name]
                    assert tuple(full.shape) == shape, f"{name}: given {tuple(full.shape)}, the model has {shape}"
                else:
                    full = _initial_value(owner, short, shape, seed, name, n_layer)
                _fill(param, full)


def _initial_value(
    owner: nn.Module, short: str, shape: tuple[int, ...], seed: int, name: str, n_layer: int
) -> torch.Tensor:
    if isinstance(owner, nn.LayerNorm) or short == "bias":
        return torch.ones(shape) if short == "weight" and isinstance(owner, nn.LayerNorm) else torch.zeros(shape)
    std = 0.02
    if getattr(owner, "residual_scale", False):
        std /= math.sqrt(2 * n_layer)  # keeps the residual stream's variance flat
    stream = int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little")
    return torch.randn(shape, generator=torch.Generator().manual_seed(stream >> 1)) * std


def _fill(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy `full` into `param`, or this rank's part of it when `param` is a DTensor."""
    if is_dtensor(param):
        from torch.distributed.tensor import distribute_tensor

        part = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(part)
    else:
        param.copy_(full)  # casts: a bf16 file into fp32 parameters, or the reverse


def summed_lm_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over non-ignored targets; the loop divides by the global count. `output`: the logits, or
    the summed loss itself where the GPT computed it with its head (model.loss_chunk_tokens)."""
    if output.dim() <= 1:  # the loss; nn.DataParallel (parallel.strategy=dp) gathers its replicas' into a vector
        return output.sum()
    logits = output
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
