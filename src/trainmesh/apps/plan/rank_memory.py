"""Memory of one rank of one layout, by component: what a rank of each pipeline stage holds at its step's peak (the
model state, activations, FSDP's gathered parameters, the temporaries of the peak's moment), on the device and in
host memory. The time of a step is estimate.py's.

Details: docs/internals.md#appsplanrank_memorypy
"""

from __future__ import annotations

import math

from trainmesh.apps.plan.cluster import Cluster
from trainmesh.apps.plan.layouts import Candidate
from trainmesh.apps.plan.memory import PrecisionBytes, StateBytes
from trainmesh.apps.plan.model import ModelSpec
from trainmesh.apps.plan.schedules import schedule_memory
from trainmesh.apps.plan.stage_parts import FsdpUnits, ModelState, StageShape, fsdp_units, model_state, param_bytes

MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "gathered", "temporaries", "overhead")


def stage_memory(
    spec: ModelSpec, cand: Candidate, precision: PrecisionBytes, cluster: Cluster, accum: int, stage: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Bytes by MEMORY_PARTS on a rank of pipeline stage `stage`, and those it keeps in host memory instead (CPU
    offload: params, optimizer, and the gradients once reduced)."""
    shape = StageShape.of(spec, cand, precision, stage)
    state = model_state(shape, cand, precision, accum)
    units = fsdp_units(shape, cand, precision)
    in_block = _block_backward(spec, shape, cand, precision)
    temporaries = _step_moments(spec, shape, cand, precision, accum, state, units, in_block)
    if cand.pp > 1:
        temporaries = _pipeline_moments(spec, shape, cand, precision, accum, state, units, in_block, temporaries)
    parts = {
        "params": state.params,
        "grads": state.grads,
        "optimizer": state.optimizer,
        "activations": shape.activations,
        "gathered": units.gathered,
        "temporaries": temporaries,
        "overhead": cluster.overhead,
    }
    return parts, state.host


def _block_backward(spec: ModelSpec, shape: StageShape, cand: Candidate, precision: PrecisionBytes) -> float:
    """Bytes a block's backward itself holds beside the parts (without FSDP's units and the gradient it is making,
    `weight_grad`): with checkpointing its recomputed activations, and in a pipeline autocast's cached weight copies
    and the gradients of the MLP's hidden state and of the stream, and of the cached copies."""
    act = shape.act
    # inside a pipeline's autocast, a recomputed forward finds its weights' copies cached: it makes none again
    recomputed = act.recompute_peak - (act.block_weight_copy if cand.pp > 1 else 0)
    in_block = (recomputed if shape.checkpointed else 0.0) + shape.cached
    if cand.pp > 1:  # on a stage without the loss, a block's backward is the moment
        in_block += _mlp_gradients(spec, shape, cand, precision) + _copies_gradients(shape, cand)
        in_block += shape.kept * shape.output if shape.last else 0.0
    return in_block


def _mlp_gradients(spec: ModelSpec, shape: StageShape, cand: Candidate, precision: PrecisionBytes) -> float:
    """As a block's backward runs its MLP's: the hidden state's gradient and a matmul input's, in the compute dtype,
    and the stream's."""
    tokens, c, compute, stream = shape.piece * spec.seq, spec.n_embd, precision.activation, shape.stream
    return tokens * (4 * c / cand.tp * compute + c * compute + (c * stream if stream != compute else 0))


def _copies_gradients(shape: StageShape, cand: Candidate) -> float:
    """In a pipeline, the gradients of autocast's cached weight copies, in the compute dtype, that a piece's backward
    holds until it ends (the copies were made in the first piece's forward, so autograd runs their casts last), less
    what the blocks it has been through freed of that piece's activations: the most of it as a block's backward
    starts (found with the dry run: 7 blocks' copies' gradients beside a checkpointed 7B stage's last block; without
    checkpointing a block frees more than its copy, so 0 unless pieces are short)."""
    act, k = shape.act, cand.checkpoint_every
    held = most = 0.0
    for i in reversed(range(shape.blocks)):  # the stage's blocks in backward's order
        checkpointed = bool(k) and i % k == 0
        most = max(most, held)
        freed = act.checkpointed_block if checkpointed else act.per_block - act.block_weight_copy
        held += act.block_weight_copy - freed
    return most


def _step_moments(
    spec: ModelSpec,
    shape: StageShape,
    cand: Candidate,
    precision: PrecisionBytes,
    accum: int,
    state: ModelState,
    units: FsdpUnits,
    in_block: float,
) -> float:
    """The `temporaries` part without a pipeline (with one, what _pipeline_moments adds to): bytes the step's peak
    holds beyond the other parts, at the largest of its three moments."""
    # The peak is one of three moments (found with the dry run, dryrun.py), each on top of what the other parts hold.
    # The loss's forward, on the last stage: the logits in the compute dtype and their fp32 copy (one tensor under
    # 32-true), and autocast's cached weight copies of checkpointed blocks, kept until autocast exits. The loss's
    # backward: the fp32 logits' gradient twice, nll_loss's and log_softmax's. The blocks' backward (_blocks_backward):
    # under fsdp the units they gather and their gradients before they are reduced, with checkpointing the recomputed
    # activations. At the loss's moments, a step's first gradients do not exist yet unless earlier micro-steps or
    # 1F1B pieces made some, or DDP's buckets (allocated once) hold them; the blocks' backward counts those it makes.
    logits, output, kept, last = shape.logits, shape.output, shape.kept, shape.last
    compute_copy = logits / 4 * precision.activation if precision.activation != 4 else 0.0
    checkpointed_copies = shape.checkpointed * shape.act.block_weight_copy
    loss_forward = logits + compute_copy + (kept - 1) * output + checkpointed_copies if last else 0.0
    # a pipeline's last stage keeps each piece's output, the compute-dtype logits, until that piece's backward
    loss_backward = 2 * logits + (kept * output + shape.cached if cand.pp > 1 and last else 0.0)
    no_grads_yet = state.grads if accum == 1 and cand.pp == 1 and cand.strategy != "ddp" else 0.0
    blocks_backward = _blocks_backward(spec, shape, cand, precision, state, units, in_block, no_grads_yet > 0)
    return max(max(loss_forward, loss_backward, blocks_backward) - no_grads_yet, 0.0)


def _blocks_backward(
    spec: ModelSpec,
    shape: StageShape,
    cand: Candidate,
    precision: PrecisionBytes,
    state: ModelState,
    units: FsdpUnits,
    in_block: float,
    grads_pending: bool,
) -> float:
    """Bytes the blocks' backward holds beside the parts at its largest moment: what a block's backward holds
    (`in_block`) and under FSDP the units it gathers and, without a pipeline, their gradients."""
    if not shape.fsdp:
        return in_block + shape.weight_grad
    if not shape.in_pipeline and not state.unsharded_grads:
        return _fsdp_blocks_backward(spec, shape, cand, precision, state, units, grads_pending)
    # FSDP's root unit and the block computing (held in `gathered` already under grad-op; the block that backward
    # prefetches is not there yet at the last block's peak, the dry run finds, but with checkpointing the recomputed
    # forward's prefetch is). Gradients accumulating unsharded are in `grads` already.
    root, block, gathered = units.root, units.block, units.gathered
    blocks_backward = in_block + shape.weight_grad
    if not shape.in_pipeline:
        blocks_backward += 0.0 if gathered else root + (2 if shape.checkpointed else 1) * block
    elif not gathered:  # a schedule regathers units for each piece's backward: the root and two of the stage's
        # blocks during a block's (three when a recomputed forward prefetches another; on the last stage without
        # checkpointing, one: the prefetched block is not there yet at the peak, as without a pipeline), or units
        # twice (an all-gather buffer beside the parameters copied out of it): the root and a block both, or on a
        # stage of one block the larger of the two. On a checkpointed last stage the moment is the end of the
        # recomputed forward (the dry run finds the peak at the block's last dropout): no weight's gradient yet.
        if shape.last and shape.checkpointed:
            blocks_backward -= shape.weight_grad
        blocks = 3 if shape.checkpointed else 1 if shape.last else 2
        copied = 2 * (root + block) if shape.blocks > 1 else root + block + max(root, block)
        blocks_backward = max(blocks_backward + root + min(shape.blocks, blocks) * block, copied)
    return blocks_backward


def _fsdp_blocks_backward(
    spec: ModelSpec,
    shape: StageShape,
    cand: Candidate,
    precision: PrecisionBytes,
    state: ModelState,
    units: FsdpUnits,
    pending: bool,
) -> float:
    """Without a pipeline, FSDP reduce-scattering each block's gradients as its backward ends: the bytes beside the
    parts at the largest moment of the blocks' backward, block by block in backward's order, and of the root's after
    them (found with the dry run: for a 7B at 512 ranks the second block's, under hybrid sharding over 8 the
    second-to-last's; with a large vocabulary and short sequences or checkpointing, the root's). `pending`: the
    step's sharded gradients are not in the parts yet (its only micro-step makes them)."""
    act, k, root, block = shape.act, cand.checkpoint_every, units.root, units.block
    params = [p for p in shape.held if p.block is not None]
    one_block = [p for p in params if p.block == params[0].block]
    head = max((p for p in shape.held if p.block is None), key=lambda p: math.prod(p.shape))
    # Within a block's backward, its MLP's (the hidden gradients and the largest weight's gradient as it is made) or
    # its attention's (every weight's gradient, less the MLP's activations freed by then), beside the head's part of
    # the tied weight's gradient; FSDP holds the block's in the gathered dtype until the block's reduce-scatter
    largest = max(one_block, key=lambda p: math.prod(p.shape))
    mlp = _mlp_gradients(spec, shape, cand, precision) + param_bytes([largest], cand.tp, 1, precision.gather)
    mlp_saved = shape.piece * spec.seq * 8 * spec.n_embd / cand.tp * precision.activation  # the GELU's input, output
    attention = param_bytes(one_block, cand.tp, 1, precision.gather) - mlp_saved
    computing = max(mlp, attention) + param_bytes([head], cand.tp, 1, precision.gather)
    reducing = block / precision.gather * 4  # the block before's gradients, in their reduce-scatter's fp32 input
    grad_bytes = StateBytes.adamw(precision.name).grads
    # Each block done: its sharded gradients, on the device unless offloaded, when this micro-step makes them (a
    # step's only one, or the last after partial shards). Under hybrid sharding FSDP holds its all-reduced shard,
    # in the fp32 reduce dtype, on the device until backward ends (its all-reduce state): that shard is the gradient
    # itself for fp32 gradients not offloaded; and it takes the place of the block's partial shard, which is freed
    offload = cand.kind == "fsdp-offload"
    makes_grads = (pending or state.partial_grads) and not offload
    made = param_bytes(params, cand.tp, shape.shard, grad_bytes) / shape.blocks if makes_grads else 0.0
    fp32_shard = param_bytes(one_block, cand.tp, shape.shard, 4)
    all_reduced = fp32_shard if cand.dp_replicate > 1 and (grad_bytes != 4 or offload) else 0.0
    all_reduced -= fp32_shard if state.partial_grads else 0.0
    most, balance = 0.0, -float(act.outside)  # the head's and loss's saved tensors are freed (and the ids' few bytes)
    for i in reversed(range(shape.blocks)):
        checkpointed, last = bool(k) and i % k == 0, i == shape.blocks - 1
        # gathered: the root, the block and the one backward prefetches (in the last block's only as its recomputed
        # forward's prefetch); under grad-op the whole stage, less each block resharded as its backward ended
        prefetched = block if i > 0 and (checkpointed or not last) else 0.0
        gathered = -(shape.blocks - 1 - i) * block if units.gathered else root + block + prefetched
        recomputed = act.recompute_peak if checkpointed else 0.0
        most = max(most, balance + computing + recomputed + gathered + (0.0 if last else reducing))
        # done: what it saved is freed, its gradients made and its all-reduced shard kept (above)
        freed = act.checkpointed_block if checkpointed else act.per_block
        balance += made + all_reduced - freed
    # then the root's backward, every block done: the embedding's part of the tied weight's gradient beside the
    # head's and their sum, beside the root gathered (under grad-op: every block resharded) and the first block's
    # reduce-scatter input
    tied = param_bytes([head], cand.tp, 1, precision.gather)
    return max(most, balance + 3 * tied + root - units.gathered + reducing)


def _pipeline_moments(
    spec: ModelSpec,
    shape: StageShape,
    cand: Candidate,
    precision: PrecisionBytes,
    accum: int,
    state: ModelState,
    units: FsdpUnits,
    in_block: float,
    temporaries: float,
) -> float:
    """The `temporaries` part of a pipeline stage: the largest of the step's moments (`temporaries`, _step_moments')
    with the pieces' gradients beside it, and the ends of a piece's backward; plus what its schedule holds all
    through."""
    act, activations, in_flight, last = shape.act, shape.activations, shape.in_flight, shape.last
    copies = (shape.blocks - shape.checkpointed) * act.block_weight_copy + (act.head_weight_copy if last else 0.0)
    per_piece = (activations - copies) / in_flight  # autocast's weight copies are the step's, not a piece's
    later = max(0.0, min(in_flight - 1, cand.microbatches - 2))  # pieces ahead at the second piece's end
    # the pieces' gradients exist once the first piece's backward is done: inside a later piece, beside the
    # activations of all but that first piece (and of those no forward is left to replace)
    freed = (in_flight - min(in_flight, cand.microbatches - 1)) * per_piece
    piece_grads = _pieces_gradients(cand, state.grads, state.whole_grads, accum)
    moments = [temporaries + max(0.0, piece_grads - freed)]
    # The end of a piece's backward, its gradients made: the first piece's (the most pieces ahead; under FSDP,
    # which casts each piece's embedding gradient to its fp32 one), or the second's (the fewest behind it of the
    # most ahead; DDP adds its embedding gradient to the first piece's there)
    ending = _piece_end(spec, shape, cand, precision, units, in_block)
    ahead = [later] + ([in_flight - 1] if shape.fsdp else [])  # second piece's end; the first's under FSDP
    moments += [ending + pieces * per_piece - activations + piece_grads for pieces in ahead]
    out = max(moments)
    out += schedule_memory(spec, cand, shape.stage, shape.stream)
    out += state.whole_embedding if shape.fsdp else 0.0
    return out


def _piece_end(
    spec: ModelSpec, shape: StageShape, cand: Candidate, precision: PrecisionBytes, units: FsdpUnits, in_block: float
) -> float:
    """Bytes the end of a piece's backward holds beside the parts and the activations of the pieces ahead."""
    held, act, last = shape.held, shape.act, shape.last
    # a piece's last new gradient, before it is added to the earlier pieces': the embedding's (whole on the first
    # stage), the head's on the last, a block's weight's on the others; beside autocast's cached weight copies and
    # their gradients, and on the last stage its output, the logits
    new_grad = [p for p in held if p.name == "wte.weight"] or sorted(held, key=lambda p: math.prod(p.shape))[-1:]
    ending = param_bytes(new_grad, 1 if shape.stage == 0 else cand.tp, 1, precision.gather if shape.fsdp else 4)
    ending += 2.0 * (shape.blocks * act.block_weight_copy + (act.head_weight_copy if last else 0))
    ending += shape.output if last else 0.0
    if shape.in_pipeline and not units.gathered:  # torch's schedule turns FSDP's resharding after backward off
        # until the last piece: each unit stays gathered until the next forward passes it, so by a piece's last
        # block's backward the stage's whole parameters are, beside what that backward holds, or at its end beside
        # its block's gradients (gathered dtype) and the stream's gradient
        tokens = shape.piece * spec.seq
        block_done = units.block + tokens * spec.n_embd * (precision.activation + shape.stream)
        ending = units.whole + max(in_block + shape.weight_grad, block_done, ending)
    return ending


def _pieces_gradients(cand: Candidate, grads: float, whole_grads: float, accum: int) -> float:
    """Gradients a pipeline stage holds beside the parts once a piece's backward is done: DDP's own gradients of the
    pieces before the last (accumulated under no_sync) beside its buckets; FSDP's, whole until the schedule ends
    (beside the sharded ones that earlier micro-steps reduced, under accumulation)."""
    out = grads if cand.kind == "ddp" and cand.microbatches > 1 else 0.0
    if cand.strategy == "fsdp":
        out += max(0.0, whole_grads - (grads if accum == 1 else 0.0))
    return out
