"""Memory per rank, predicted: model states by ZeRO stage, in bytes, and the bytes per element of each precision.
The first piece of `trainmesh plan`; the GPT's activations are in activations.py.

Details: docs/internals.md#appsplanmemorypy
"""

from __future__ import annotations

from dataclasses import dataclass

ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class ElementBytes:
    """Bytes per element of what a precision (train.precision) stores in its two dtypes."""

    param: int
    """Weights, and what runs in their dtype: the embeddings, the residual stream, the LayerNorms (autocast leaves the
    embeddings and adds alone, and LayerNorm, given fp32 input and weights, in fp32; bf16-true has no autocast)."""
    compute: int
    """Matmul inputs and outputs: autocast's dtype under the mixed precisions. Where it differs from `param`,
    autocast also makes a copy of each matmul weight in it (see activations.py)."""


ELEMENT_BYTES = {
    "32-true": ElementBytes(4, 4),
    "bf16-mixed": ElementBytes(4, 2),
    "16-mixed": ElementBytes(4, 2),
    "bf16-true": ElementBytes(2, 2),
}


def element_bytes(precision: str) -> ElementBytes:
    if precision not in ELEMENT_BYTES:
        raise ValueError(f"train.precision={precision!r} is not one of {', '.join(ELEMENT_BYTES)}")
    return ELEMENT_BYTES[precision]


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each part of the model state."""

    weights: float
    """The copy forward and backward use."""
    grads: float
    optimizer: float
    """Everything the optimizer keeps besides: for mixed precision, the fp32 master weights too."""

    @classmethod
    def adamw(cls, precision: str) -> StateBytes:
        """trainmesh with AdamW: weights, gradients and both moments in the parameter dtype, fp32 under 32-true and
        the autocast precisions (bf16-mixed, 16-mixed), bf16 under bf16-true."""
        size = element_bytes(precision).param
        return cls(size, size, 2 * size)


@dataclass(frozen=True)
class ModelStates:
    """Bytes per rank of each part of the model state."""

    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


def model_states(params: int, ranks: int, stage: int, per_param: StateBytes) -> ModelStates:
    """Model-state bytes per rank for `params` parameters over `ranks` data-parallel ranks at ZeRO `stage`."""
    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage {stage} is not one of {ZERO_STAGES}")
    if params < 0 or ranks < 1:
        raise ValueError(f"need params >= 0 and ranks >= 1, not {params} and {ranks}")

    def share(part: float, partitioned_from: int) -> float:
        return params * part / (ranks if stage >= partitioned_from else 1)

    return ModelStates(
        weights=share(per_param.weights, 3),
        grads=share(per_param.grads, 2),
        optimizer=share(per_param.optimizer, 1),
    )
