"""What a rank of one pipeline stage of one layout is made of, for rank_memory.py: the stage's shape (its
parameters, blocks, micro-batch pieces and activations), its model state (parameters, gradients, optimizer, and what
CPU offload keeps in host memory) and FSDP's gathered units.

Details: docs/internals.md#appsplanrank_memorypy
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainmesh.apps.plan.activations import INT64, GPTActivations, gpt_activations
from trainmesh.apps.plan.layouts import Candidate
from trainmesh.apps.plan.memory import PrecisionBytes, StateBytes, element_bytes
from trainmesh.apps.plan.model import ModelSpec, Param
from trainmesh.apps.plan.schedules import interleaved_forwards, loss_rank, pieces_in_flight


@dataclass(frozen=True)
class StageShape:
    """What the parts of a stage's memory share, for one (spec, cand, precision, stage)."""

    stage: int
    held: list[Param]
    fsdp: bool
    shard: int
    """Ranks each parameter is sharded over: FSDP's, else 1."""
    in_pipeline: bool
    """FSDP inside a pipeline's schedule."""
    last: bool
    blocks: int
    checkpointed: int
    """Of `blocks`: those under activation checkpointing."""
    piece: int
    """Samples in one micro-batch piece."""
    in_flight: float
    """Pieces whose activations the stage holds at once (pieces_in_flight)."""
    stream: int
    """Bytes per element of what a pipeline stage sends on: the residual stream, in the parameters' dtype under ddp
    and single."""
    logits: float
    """A piece's logits in fp32 (on the last stage; else 0)."""
    output: float
    """A piece's output on the last stage: its logits in the compute dtype."""
    kept: float
    """A pipeline's last stage's pieces whose output it keeps (else 1)."""
    cached: float
    """Autocast's cached copies of checkpointed blocks' weights alive in a pipeline's backward (else 0)."""
    weight_grad: float
    """In a pipeline, a block's largest weight's gradient as its backward makes it, in the compute dtype (FSDP's
    gathered dtype, the same), before it joins the earlier pieces' (else 0: the `grads` part holds it)."""
    activations: float
    """The `activations` part (_stage_activations)."""
    act: GPTActivations
    """Per-piece activation figures."""

    @classmethod
    def of(cls, spec: ModelSpec, cand: Candidate, precision: PrecisionBytes, stage: int) -> StageShape:
        """The shared quantities of a rank of stage `stage`."""
        fsdp = cand.strategy == "fsdp"
        activations, act = _stage_activations(spec, cand, precision, stage)
        blocks = spec.blocks_of_stage(stage, cand.pp)
        checkpointed = checkpointed_blocks(cand, blocks)
        last = stage == loss_rank(cand)
        piece = cand.micro_batch // cand.microbatches
        logits = 4.0 * spec.seq * piece * spec.vocab if last else 0.0
        in_flight = pieces_in_flight(cand, stage)
        # torch's pipeline stage keeps each piece's output, the logits in the compute dtype, until that piece's
        # backward ends: the last stage's pieces in flight (all of them under GPipe) at every moment; the current
        # one's output is the compute-dtype copy already counted (or, under 32-true, the logits themselves)
        output, kept = logits / 4 * precision.activation, 1.0
        if cand.pp > 1 and last:
            kept = interleaved_forwards(cand, stage)[-1] if cand.schedule == "interleaved_1f1b" else in_flight
        # a pipeline runs backward inside its schedule's autocast, whose cached copies of checkpointed blocks'
        # weights are then alive (elsewhere autocast has exited and freed them)
        cached = checkpointed * act.block_weight_copy if cand.pp > 1 else 0.0
        held = spec.stage_params(stage, cand.pp, loss_rank(cand))
        largest = sorted([p for p in held if p.block is not None], key=lambda p: math.prod(p.shape))[-1:]
        weight_grad = param_bytes(largest, cand.tp, 1, precision.activation) if cand.pp > 1 else 0.0
        return cls(
            stage=stage,
            held=held,
            fsdp=fsdp,
            shard=cand.dp_shard if fsdp else 1,
            in_pipeline=fsdp and cand.pp > 1,
            last=last,
            blocks=blocks,
            checkpointed=checkpointed,
            piece=piece,
            in_flight=in_flight,
            stream=element_bytes(precision.activations_under(cand.strategy)).param,
            logits=logits,
            output=output,
            kept=kept,
            cached=cached,
            weight_grad=weight_grad,
            activations=activations,
            act=act,
        )


@dataclass(frozen=True)
class ModelState:
    """A stage's model state: its parts' bytes on the device, what CPU offload keeps in host memory instead (`host`),
    whether FSDP's gradients accumulate unsharded (in `grads`) or, under hybrid sharding, as fp32 shards not yet
    all-reduced (`partial_grads`, in `grads` too), the stage's gradients unsharded in fp32 (`whole_grads`), and the
    rows beyond this rank's of an embedding gradient that comes back whole."""

    params: float
    grads: float
    optimizer: float
    host: dict[str, float]
    unsharded_grads: bool
    partial_grads: bool
    whole_grads: float
    whole_embedding: float


def model_state(shape: StageShape, cand: Candidate, precision: PrecisionBytes, accum: int) -> ModelState:
    """The `params`, `grads` and `optimizer` parts, and what CPU offload moves to host memory."""
    held, shard = shape.held, shape.shard
    state = StateBytes.adamw(precision.name)  # per element of each parameter
    params = param_bytes(held, cand.tp, shard, state.weights)
    optimizer = param_bytes(held, cand.tp, shard, state.optimizer) + 4 * len(held)  # and a 4-byte step per tensor
    # FSDP keeps gradients unsharded while they accumulate over the micro-steps (no_sync; unless it reduce-scatters
    # every micro-step). A pipeline's schedule reduce-scatters at its end, every micro-step, and keeps them unsharded
    # over its pieces (torch's PipelineStage defers gradient sync to the schedule's end): `temporaries`
    unsharded_grads = shape.fsdp and accum > 1 and not cand.reduce_every_microstep and not shape.in_pipeline
    # whole gradients accumulate in FSDP's reduce dtype, fp32 (strategies/fsdp.py), whatever the parameters' dtype
    whole_grads = param_bytes(held, cand.tp, 1, 4)
    grads = whole_grads if unsharded_grads else param_bytes(held, cand.tp, shard, state.grads)
    # Reduce-scattering every micro-step under hybrid sharding, FSDP all-reduces across replicas at the last only,
    # and until then keeps each unit's shards in its fp32 reduce dtype instead of gradients (its partial reduce
    # output, on the device even under offload): twice the bytes of bf16 gradients
    partial_grads = shape.fsdp and not shape.in_pipeline and accum > 1 and cand.reduce_every_microstep
    partial_grads = partial_grads and cand.dp_replicate > 1
    grads = param_bytes(held, cand.tp, shard, 4) if partial_grads else grads
    if cand.strategy == "ddp" and accum > 1 and cand.pp == 1:  # DDP's buckets, allocated once, beside the gradients
        grads *= 2  # of the micro-steps before the last (zero_grad(set_to_none) leaves them to autograd; the dry run
        # found this). A pipeline's micro-steps all synchronise: its pieces' own gradients are in the temporaries
    # a vocabulary-parallel embedding's gradient comes back whole when no head on the stage shares the weight: held
    # so (the pipeline's clipping takes this rank's rows), or under fsdp, in its fp32, until it is reduce-scattered
    # (temporaries): the rest of the vocabulary's rows, beyond this rank's
    first = shape.stage == 0
    embedding = [p for p in held if p.name == "wte.weight"] if cand.pp > 1 and cand.tp > 1 and first else []
    grad_bytes = 4 if shape.fsdp else state.grads
    whole_embedding = param_bytes(embedding, 1, 1, grad_bytes) - param_bytes(embedding, cand.tp, 1, grad_bytes)
    grads += 0.0 if shape.fsdp else whole_embedding
    host: dict[str, float] = {}
    if cand.kind == "fsdp-offload":  # state in host memory; gradients still accumulating stay on the device
        host = {"params": params, "grads": param_bytes(held, cand.tp, shard, state.grads), "optimizer": optimizer}
        params, optimizer, grads = 0.0, 0.0, grads if unsharded_grads or partial_grads else 0.0
    return ModelState(params, grads, optimizer, host, unsharded_grads, partial_grads, whole_grads, whole_embedding)


@dataclass(frozen=True)
class FsdpUnits:
    """Bytes of FSDP's gathered parameters: the root unit (embeddings, final norm, head: gathered through forward and
    backward) and the largest block's (both 0 without FSDP), the whole stage, and the `gathered` part (FSDP grad-op
    keeps every unit gathered from forward to backward)."""

    root: float
    block: float
    whole: float
    gathered: float


def fsdp_units(shape: StageShape, cand: Candidate, precision: PrecisionBytes) -> FsdpUnits:
    """The sizes of FSDP's gathered units on the stage, in the gathered dtype."""
    held, shard = shape.held, shape.shard

    def gathered_bytes(params: list[Param]) -> float:
        # FSDP gathers every rank's shard, each padded to the largest (dim 0 rounded up to a multiple of the ranks)
        return shard * param_bytes(params, cand.tp, shard, precision.gather)

    whole = gathered_bytes(held)
    gathered = whole if cand.kind == "fsdp-grad-op" else 0.0
    root = block = 0.0
    if shape.fsdp:
        root = gathered_bytes([p for p in held if p.block is None])
        in_blocks = {p.block for p in held if p.block is not None}
        block = max((gathered_bytes([p for p in held if p.block == b]) for b in in_blocks), default=0.0)
    return FsdpUnits(root, block, whole, gathered)


def _stage_activations(
    spec: ModelSpec, cand: Candidate, precision: PrecisionBytes, stage: int
) -> tuple[float, GPTActivations]:
    """Activation bytes a rank of `stage` holds at most (its pieces in flight), and the per-piece figures."""
    piece = cand.micro_batch // cand.microbatches
    act = gpt_activations(
        spec.n_layer,
        spec.n_head,
        spec.n_embd,
        spec.vocab,
        spec.seq,
        piece,
        precision=precision.activations_under(cand.strategy),
        checkpoint_every=cand.checkpoint_every,
        tp=cand.tp,
    )
    blocks = spec.blocks_of_stage(stage, cand.pp)
    plain = blocks - checkpointed_blocks(cand, blocks)
    last, first = stage == loss_rank(cand), stage == 0
    in_blocks = plain * act.per_block + (blocks - plain) * act.checkpointed_block
    ids = INT64 * (piece * spec.seq + spec.seq)  # the embedding's token ids and positions: the first stage's
    ends = (ids if first else 0) + (act.outside - ids if last else 0)
    # autocast's weight copies are cached once per step, not once per piece in flight
    copies = plain * act.block_weight_copy + (act.head_weight_copy if last else 0)
    in_flight = pieces_in_flight(cand, stage)
    if cand.schedule != "interleaved_1f1b" or cand.pp == 1:
        return float((in_blocks + ends - copies) * in_flight + copies), act
    # the pipeline's first and last stages are a rank's first and last local stages, with their own pieces in flight
    forwards, head_copy = interleaved_forwards(cand, stage), act.head_weight_copy if last else 0
    ends = (ids * forwards[0] if first else 0) + ((act.outside - ids - head_copy) * forwards[-1] if last else 0)
    return float((in_blocks - copies + head_copy) * in_flight + ends + copies), act


def checkpointed_blocks(cand: Candidate, blocks: int) -> int:
    """Blocks of a stage under activation checkpointing: block i of the stage when i % k == 0."""
    return math.ceil(blocks / cand.checkpoint_every) if cand.checkpoint_every else 0


def param_bytes(params: list[Param], tp: int, shard: int, per_element: float) -> float:
    """Bytes of `params` on the most loaded rank, tensor-parallel over `tp` and sharded over `shard` ranks."""
    return float(sum(p.local_numel(tp, shard) for p in params) * per_element)
