"""The GPT recipe's model in Hugging Face's GPT-2 layout, and back: names, tensor layouts and config.json, as pure
functions whose values round-trip exactly.

Details: docs/internals.md#recipesgpthfpy
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from trainmesh.data.gpt2 import EOT  # GPT-2's <|endoftext|>: its bos and eos token
from trainmesh.recipes.gpt.model import GPTConfig
from trainmesh.recipes.gpt.upgrade import fuse_heads

HF_PREFIX = "transformer."
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
"""GPT-2 activations equal to the GPT's F.gelu(approximate="tanh") (two implementations of one formula)."""

_BLOCK = re.compile(r"blocks\.(?P<i>\d+)\.(?P<rest>.+)")
_HF_BLOCK = re.compile(r"h\.(?P<i>\d+)\.(?P<rest>.+)")
# (trainmesh's module in a block, GPT-2's, whether the weight is a Conv1D: stored transposed)
_BLOCK_MODULES = [
    ("ln_1", "ln_1", False),
    ("attn.qkv", "attn.c_attn", True),
    ("attn.proj", "attn.c_proj", True),
    ("ln_2", "ln_2", False),
    ("mlp.fc", "mlp.c_fc", True),
    ("mlp.proj", "mlp.c_proj", True),
]
_TO_HF = {ours: (hf, conv) for ours, hf, conv in _BLOCK_MODULES}
_FROM_HF = {hf: (ours, conv) for ours, hf, conv in _BLOCK_MODULES}
_TOP = {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"}
HF_BUFFERS = re.compile(r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias")
"""Causal-mask buffers that older GPT-2 files hold (e.g. OpenAI's gpt2 on the hub): not weights, ignored."""


def hf_name(name: str) -> str:
    """GPT-2's name of a trainmesh GPT parameter (KeyError for a name GPT-2 has no place for)."""
    if name in _TOP:
        return HF_PREFIX + name
    m = _BLOCK.fullmatch(name)
    module, _, kind = m["rest"].rpartition(".") if m else ("", "", "")
    if m is None or module not in _TO_HF or kind not in ("weight", "bias"):
        raise KeyError(name)
    return f"{HF_PREFIX}h.{m['i']}.{_TO_HF[module][0]}.{kind}"


def split_heads(qkv: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of `fuse_heads`: (3C, ...) with rows head by head -> (3C, ...) with rows q | k | v."""
    rest = qkv.shape[1:]
    per_head = qkv.reshape(n_head, 3, qkv.shape[0] // (3 * n_head), *rest)  # (H, 3, Q, ...)
    return per_head.transpose(0, 1).reshape(qkv.shape)  # (3, H, Q, ...) -> (3C, ...)


def to_hf_tensor(name: str, tensor: torch.Tensor, n_head: int) -> torch.Tensor:
    """A trainmesh GPT parameter in GPT-2's layout (contiguous, its own memory)."""
    m = _BLOCK.fullmatch(name)
    module = m["rest"].rpartition(".")[0] if m else ""
    if module == "attn.qkv":
        tensor = split_heads(tensor, n_head)
    if tensor.dim() == 2 and _TO_HF.get(module, ("", False))[1]:
        tensor = tensor.t()
    return tensor.contiguous().clone()


def from_hf_tensor(name: str, tensor: torch.Tensor, n_head: int) -> torch.Tensor:
    """A GPT-2 tensor (its name with or without `transformer.`) in trainmesh's layout."""
    m = _HF_BLOCK.fullmatch(name.removeprefix(HF_PREFIX))
    module = m["rest"].rpartition(".")[0] if m else ""
    if tensor.dim() == 2 and _FROM_HF.get(module, ("", False))[1]:
        tensor = tensor.t()
    if module == "attn.c_attn":
        q, k, v = tensor.chunk(3, dim=0)
        tensor = fuse_heads(q, k, v, n_head)
    return tensor.contiguous()


def to_hf_state(state: Mapping[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """A trainmesh GPT's full state dict -> GPT-2's, as `GPT2LMHeadModel.save_pretrained` writes it (the tied
    head left out). A model without biases (model.bias=false) gets zero biases: exactly the same function."""
    missing = sorted(set(gpt_names(cfg)) - set(state))
    unknown = sorted(set(state) - set(gpt_names(cfg, bias=True)))
    if missing or unknown:
        found = [
            f"{what}: {', '.join(names[:4])}" for what, names in (("missing", missing), ("unknown", unknown)) if names
        ]
        raise ValueError(f"the state is not the GPT of its model config: {'; '.join(found)}")
    out: dict[str, torch.Tensor] = {}
    for name in gpt_names(cfg, bias=True):
        if name == "lm_head.weight":
            continue
        if name not in state:  # a bias of a model without biases: zero, in the dtype of its weight
            weight = state[name.rsplit(".", 1)[0] + ".weight"]
            out[hf_name(name)] = torch.zeros(weight.shape[0], dtype=weight.dtype)
            continue
        out[hf_name(name)] = to_hf_tensor(name, state[name].detach().cpu(), cfg.n_head)
    return out


def gpt_names(cfg: GPTConfig, bias: bool | None = None) -> list[str]:
    """The parameter names of a GPT of `cfg` in state-dict order (with biases if `bias`, default cfg.bias)."""
    bias = cfg.bias if bias is None else bias
    kinds = ("weight", "bias") if bias else ("weight",)
    names = ["wte.weight", "wpe.weight"]
    for i in range(cfg.n_layer):
        names += [f"blocks.{i}.{module}.{kind}" for module, _, _ in _BLOCK_MODULES for kind in kinds]
    return [*names, *(f"ln_f.{kind}" for kind in kinds), "lm_head.weight"]


def hf_shapes(cfg: GPTConfig, vocab_size: int, n_positions: int) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of a GPT-2 file of this shape, by its name without `transformer.`."""
    c = cfg.n_embd
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (vocab_size, c), "wpe.weight": (n_positions, c)}
    per_module = {"ln_1": (c,), "attn.c_attn": (c, 3 * c), "attn.c_proj": (c, c), "ln_2": (c,)}
    per_module |= {"mlp.c_fc": (c, 4 * c), "mlp.c_proj": (4 * c, c)}
    for i in range(cfg.n_layer):
        for module, weight in per_module.items():
            shapes[f"h.{i}.{module}.weight"] = weight
            shapes[f"h.{i}.{module}.bias"] = (weight[-1],)
    return shapes | {"ln_f.weight": (c,), "ln_f.bias": (c,)}


def hf_config(cfg: GPTConfig, dtype: torch.dtype, gpt2_tokens: bool) -> dict[str, Any]:
    """config.json of `GPT2LMHeadModel` for a GPT of `cfg` whose weights are of `dtype`; `gpt2_tokens`: it was
    trained on GPT-2's tokenizer (then <|endoftext|> is its bos and eos token)."""
    eot = EOT if gpt2_tokens and cfg.vocab_size > EOT else None
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,  # as trained, padded rows included (e.g. 50304)
        "n_positions": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,  # 4 · n_embd, as the GPT's MLP
        "activation_function": "gelu_new",  # the tanh approximation, as the GPT's F.gelu(approximate="tanh")
        "layer_norm_epsilon": 1e-5,  # nn.LayerNorm's default, which the GPT uses
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "tie_word_embeddings": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "initializer_range": 0.02,
        # transformers 5 reads "dtype"; earlier versions read "torch_dtype" (5 still accepts it, silently).
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }


def hf_problems(config: Mapping[str, Any]) -> list[str]:
    """What in a GPT-2 config.json the GPT cannot compute as GPT-2 does (empty: nothing)."""
    expected: list[tuple[str, Any, Any]] = [
        ("model_type", "gpt2", None),
        ("layer_norm_epsilon", 1e-5, 1e-5),
        ("scale_attn_weights", True, True),
        ("scale_attn_by_inverse_layer_idx", False, False),
        ("reorder_and_upcast_attn", False, False),  # a numerical variant: upcasts attention to fp32
        ("add_cross_attention", False, False),
        ("tie_word_embeddings", True, True),
    ]
    problems = [
        f"{key}={config.get(key, default)!r} (trainmesh's GPT has {want!r})"
        for key, want, default in expected
        if config.get(key, default) != want
    ]
    activation = config.get("activation_function", "gelu_new")
    if activation not in ACTIVATIONS:
        tanh = " or ".join(ACTIVATIONS)
        problems.append(f"activation_function={activation!r} (trainmesh's GPT has the tanh gelu: {tanh})")
    n_embd, n_inner = config.get("n_embd"), config.get("n_inner")
    if n_inner is not None and n_inner != 4 * int(n_embd or 0):
        problems.append(f"n_inner={n_inner} (trainmesh's GPT has 4 · n_embd = {4 * int(n_embd or 0)})")
    return problems
