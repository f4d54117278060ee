"""The plainest GPT: nanoGPT's model.py in one file (one fused q/k/v projection, split q | k | v), the
baseline the benchmarks hold trainmesh's GPT against."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.nn import functional as F


@dataclasses.dataclass
class PlainConfig:
    block_size: int
    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float
    bias: bool


class PlainAttention(nn.Module):
    def __init__(self, c: PlainConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias)  # q, k, v in one projection
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.c_proj.NANOGPT_SCALE_INIT = 1  # type: ignore[assignment]
        self.resid_dropout = nn.Dropout(c.dropout)
        self.n_head, self.n_embd, self.dropout = c.n_head, c.n_embd, c.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, 2))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=drop, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class PlainMLP(nn.Module):
    def __init__(self, c: PlainConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd, bias=c.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * c.n_embd, c.n_embd, bias=c.bias)
        self.c_proj.NANOGPT_SCALE_INIT = 1  # type: ignore[assignment]
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class PlainBlock(nn.Module):
    def __init__(self, c: PlainConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.attn = PlainAttention(c)
        self.ln_2 = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.mlp = PlainMLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class PlainGPT(nn.Module):
    def __init__(self, c: PlainConfig) -> None:
        super().__init__()
        self.config = c
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(c.vocab_size, c.n_embd),
                "wpe": nn.Embedding(c.block_size, c.n_embd),
                "drop": nn.Dropout(c.dropout),
                "h": nn.ModuleList(PlainBlock(c) for _ in range(c.n_layer)),
                "ln_f": nn.LayerNorm(c.n_embd, bias=c.bias),
            }
        )
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # type: ignore[union-attr]
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = 0.02 * (2 * self.config.n_layer) ** -0.5 if hasattr(module, "NANOGPT_SCALE_INIT") else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.transformer
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = t.drop(t.wte(idx) + t.wpe(pos))  # type: ignore[operator]
        for block in t.h:  # type: ignore[union-attr]
            x = block(x)
        logits = self.lm_head(t.ln_f(x))  # type: ignore[operator]
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
