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


FP8_NOT_PLANNED = (
    "trainmesh plan does not model train.precision='fp8-mixed' yet: its step time is bf16-mixed's less what float8 "
    "matmuls save net of their casts, which depends on the layer sizes (small layers can be slower) and needs a "
    "measurement on a float8 GPU. Fix: plan with --train.precision=bf16-mixed: fp8-mixed holds about the same memory "
    "(the same fp32 weights, gradients and AdamW state, and bf16 activations), and take its layout."
)


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per element of each kind of tensor under train.precision (ELEMENT_BYTES), for the planner."""

    name: str

    def __post_init__(self) -> None:
        if self.name == "fp8-mixed":
            raise ValueError(FP8_NOT_PLANNED)

    @property
    def weight(self) -> int:
        """Bytes per element of the parameters' dtype."""
        return element_bytes(self.name).param

    @property
    def activation(self) -> int:
        """Bytes per element of the compute dtype (matmul inputs and outputs)."""
        return element_bytes(self.name).compute

    @property
    def gather(self) -> int:
        """FSDP all-gathers parameters in the compute dtype (bf16 under the mixed precisions)."""
        return self.activation

    def activations_under(self, strategy: str) -> str:
        """The precision whose activations a strategy's forward saves: under fsdp a mixed precision's gathered
        weights (LayerNorms and embeddings too) are already 16-bit, so the residual stream is, and autocast copies
        nothing: bf16-true's bytes (activations.py)."""
        mixed = self.name in ("bf16-mixed", "16-mixed")
        return "bf16-true" if strategy == "fsdp" and mixed else self.name

    def compute_dtype(self, tf32: bool) -> str:
        """The dtype the matmuls run in (a key of the cluster's FLOP/s): bf16, or under 32-true tf32 or fp32."""
        if self.name != "32-true":
            return "bf16"
        return "tf32" if tf32 else "fp32"


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
