"""hvd.Compression: what gradients (and hvd.allreduce's tensors) travel as; `compress` before the all-reduce,
`decompress` after, as Horovod's. fp16 reduces floating-point tensors in float16 (its rounding) and casts them back;
other tensors travel unchanged."""

from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """Horovod's interface: compress(tensor) -> (tensor, ctx); decompress(tensor, ctx) -> tensor."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class NoneCompressor(Compressor):
    """No compression: the tensor travels as it is."""


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.is_floating_point() and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """hvd.Compression.none and hvd.Compression.fp16, as in Horovod."""

    none = NoneCompressor
    fp16 = FP16Compressor
