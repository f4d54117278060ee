"""A language model's head and cross-entropy in one step, a chunk of tokens at a time (`model.loss_chunk_tokens`).

The head's logits are (tokens × vocabulary): for GPT-2 at micro-batch 64, 3.3 G values, 6.6 GB in bf16 and twice that
for the fp32 copy the loss takes, plus their gradient, which is most of the activation memory of the model and what
bounds its micro-batch on one GPU. Here each chunk's logits are made, turned into the chunk's loss and the gradient of
its logits at once (softmax minus the one-hot target, the loss being the last thing computed), multiplied into the
gradients of the hidden states and the weight, and freed: no more than one chunk's logits exist at a time, and nothing
is recomputed in the backward pass, which only scales the gradients kept from the forward by the incoming one.

Numerics follow the unfused head under autocast: the matmuls run in the autocast dtype (bf16, fp16) or the weight's,
the softmax and the loss in fp32; the weight's gradient is summed over chunks in fp32.
"""

from __future__ import annotations

from typing import Any

import torch


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int, ignore_index: int = -100
) -> torch.Tensor:
    """`cross_entropy(hidden @ weight.T, targets, reduction="sum", ignore_index=ignore_index)`, computed
    `chunk_tokens` tokens at a time. `hidden`: (..., C); `weight`: (V, C); `targets`: hidden's leading shape. Where no
    gradient is wanted (evaluation, torch.no_grad), only the loss is computed."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens}: a chunk needs at least one token")
    flat, flat_targets = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        loss: torch.Tensor = _LinearCrossEntropy.apply(flat, weight, flat_targets, chunk_tokens, ignore_index)
        return loss
    return _chunked(flat, weight, flat_targets, chunk_tokens, ignore_index, grads=False)[0]


def _chunked(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int, ignore: int, grads: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The summed loss and, with `grads`, its gradients with respect to `hidden` and `weight` (fp32)."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    with torch.autocast(device, enabled=False), torch.no_grad():  # the casts are explicit below
        w = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden) if grads else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if grads else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.size(0), chunk_tokens):
            h, t = hidden[start : start + chunk_tokens].to(dtype), targets[start : start + chunk_tokens]
            probs = (h @ w.T).float()  # this chunk's logits, made softmax in place below
            counted = t != ignore
            index = torch.where(counted, t, 0).unsqueeze(1)
            lse = torch.logsumexp(probs, dim=1)  # where, not a product: an ignored token's NaN stays out
            loss += torch.where(counted, lse - probs.gather(1, index).squeeze(1), 0.0).sum()
            if grad_hidden is None or grad_weight is None:
                continue
            probs.sub_(lse.unsqueeze(1)).exp_()  # d loss / d logits = softmax - one-hot, on counted tokens
            probs.scatter_add_(1, index, torch.full_like(index, -1, dtype=probs.dtype))
            probs.masked_fill_(~counted.unsqueeze(1), 0.0)
            grad_logits = probs.to(dtype)
            del probs
            grad_hidden[start : start + chunk_tokens] = grad_logits @ w
            grad_weight.add_(grad_logits.T @ h)
    return loss, grad_hidden, grad_weight


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int, ignore: int
    ) -> torch.Tensor:
        loss, grad_hidden, grad_weight = _chunked(hidden, weight, targets, chunk_tokens, ignore, grads=True)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable  # the gradients are numbers from the forward, not a graph
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_loss.float()
        return (grad_hidden * scale).to(grad_hidden.dtype), (grad_weight * scale).to(ctx.weight_dtype), None, None, None
