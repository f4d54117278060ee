"""SyncBatchNorm that also runs on CPU with gloo: batch statistics over the data-parallel group through one
differentiable all-reduce, applied from outside by `convert_sync_batchnorm`.

Details: docs/internals.md#layerssync_batchnormpy
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


# `_BatchNorm` is the base torch.nn.SyncBatchNorm uses too: code that recognises batch norms by it
# (e.g. mixed-precision policies that keep norms in fp32) treats this layer like any batch norm, and the
# parameters, buffers and state-dict keys are those of nn.BatchNorm*, so checkpoints interchange. It is
# the one private torch name we build on, on purpose: the public alternatives do not fit. A subclass of
# nn.SyncBatchNorm is refused by DDP on CPU modules ("SyncBatchNorm layers only work with GPU
# modules"), and nn.BatchNorm2d would claim a dimensionality this layer does not have.
class SyncBatchNorm(_BatchNorm):
    """Batch norm whose training-mode statistics cover every rank of `process_group`.

    `process_group=None` means the default (world) group once one is initialised; without an
    initialised group, or with a group of one rank, it behaves exactly like `nn.BatchNorm*`.
    Takes inputs of shape (N, C, ...) like `nn.BatchNorm1d/2d/3d`.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of shape (N, C, ...), got {tuple(input.shape)}")

    def _group_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # Like torch.nn.SyncBatchNorm: synchronise only when training with batch statistics. Evaluation
        # (running statistics) never communicates.
        ranks = self._group_size()
        if not self.training or ranks == 1:
            return super().forward(input)  # exactly nn.BatchNorm*
        self._check_input_dim(input)
        if input.numel() // input.size(1) * ranks < 2:  # the loop's micro-batches are the same size on all ranks
            raise ValueError(
                f"SyncBatchNorm needs more than 1 value per channel when training; got input {tuple(input.shape)} "
                f"on each of {ranks} ranks. Fix: a larger micro-batch."
            )
        return self._synced_forward(input)

    def _synced_forward(self, x: torch.Tensor) -> torch.Tensor:
        channels = x.size(1)
        reduce_dims = [0, *range(2, x.dim())]  # every dimension but the channels
        shape = [1, channels] + [1] * (x.dim() - 2)  # broadcast per channel: (1, C, 1, ...)
        xf = x.float()  # statistics in fp32 at least, as batch norm does under autocast
        var_r, mean_r = torch.var_mean(xf, dim=reduce_dims, correction=0)  # (C,), (C,)
        n_r = x.numel() // channels
        mean64, var64 = mean_r.double(), var_r.double()
        count = torch.full((1,), float(n_r), dtype=torch.float64, device=x.device)
        packed = torch.cat([count, n_r * mean64, n_r * (var64 + mean64 * mean64)])  # (1 + 2C,)
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        packed = _SumOverRanks.apply(packed, group)  # (1 + 2C,) sums over ranks; differentiable
        total = packed[0].detach()  # N, kept on the device (reading it here would stall a GPU)
        mean = packed[1 : 1 + channels] / total
        var = (packed[1 + channels :] / total - mean * mean).clamp(min=0)  # biased, for normalising

        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach() * total / (total - 1))

        invstd = torch.rsqrt(var.float() + self.eps)  # (C,)
        y = (xf - mean.float().view(shape)) * invstd.view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        """The same update nn.BatchNorm* makes, from the global statistics (identical on every rank)."""
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased_var.to(self.running_var.dtype), alpha=factor)


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) with its gradient: every rank's loss depends on the sum, and the total loss is
    the sum of the ranks' losses, so the gradient for each rank's input is the sum of the incoming
    gradients over ranks — another all-reduce. (torch.distributed.nn.functional.all_reduce does the
    same but is deprecated as of torch 2.13 in favour of a private module.)"""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def convert_sync_batchnorm(module: nn.Module, process_group: dist.ProcessGroup | None = None) -> nn.Module:
    """Replace every batch norm in `module` (nn.BatchNorm1d/2d/3d, torch's SyncBatchNorm) by
    `SyncBatchNorm` over `process_group`, keeping the same parameter objects (an optimizer built before
    still holds them), buffers and train/eval mode. Returns the converted module (a new object when
    `module` itself is a batch norm, else `module` changed in place)."""
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        converted = SyncBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats, process_group
        )
        if module.affine:
            converted.weight = module.weight
            converted.bias = module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
        return converted
    for name, child in module.named_children():
        new = convert_sync_batchnorm(child, process_group)
        if new is not child:
            setattr(module, name, new)
    return module
