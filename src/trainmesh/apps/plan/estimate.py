"""One layout on one cluster: memory per rank by component, for the most loaded pipeline stage, and the time of a step
by phase (compute, exposed communication, optimizer, offload).

Details: docs/internals.md#appsplanestimatepy
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainmesh.apps.plan.activations import INT64, GPTActivations, gpt_activations
from trainmesh.apps.plan.cluster import Cluster
from trainmesh.apps.plan.layouts import Candidate
from trainmesh.apps.plan.memory import StateBytes, element_bytes
from trainmesh.apps.plan.model import ModelSpec, Param
from trainmesh.strategies import SCHEDULES

MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "gathered", "temporaries", "overhead")
TIME_PARTS = ("compute", "bubble", "comm", "optimizer", "offload")
OPTIMIZER_BYTES_PER_PARAM = 32  # fp32 AdamW: read p, g, m, v; write p, m, v (28); clipping reads g (4)
DDP_BUCKET_BYTES = 25 * 2**20


FP8_NOT_PLANNED = (
    "trainmesh plan does not model train.precision='fp8-mixed' yet: its step time is bf16-mixed's less what float8 "
    "matmuls save net of their casts, which depends on the layer sizes (small layers can be slower) and needs a "
    "measurement on a float8 GPU. Fix: plan with --train.precision=bf16-mixed: fp8-mixed holds about the same memory "
    "(the same fp32 weights, gradients and AdamW state, and bf16 activations), and take its layout."
)


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per element of each kind of tensor under train.precision (memory.ELEMENT_BYTES)."""

    name: str

    def __post_init__(self) -> None:
        if self.name == "fp8-mixed":
            raise ValueError(FP8_NOT_PLANNED)

    @property
    def weight(self) -> int:
        return element_bytes(self.name).param

    @property
    def activation(self) -> int:
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
        if self.name != "32-true":
            return "bf16"
        return "tf32" if tf32 else "fp32"


@dataclass(frozen=True)
class Estimate:
    candidate: Candidate
    memory: dict[str, float]
    """Bytes on the most loaded rank, by MEMORY_PARTS (device memory; offloaded state is in `host`)."""
    host: float
    """Bytes the most loaded rank keeps in host memory (CPU offload)."""
    stage: int
    """The pipeline stage of the most loaded rank."""
    time: dict[str, float]
    """Seconds per optimizer step, by TIME_PARTS."""
    fits: bool

    @property
    def total_memory(self) -> float:
        return sum(self.memory.values())

    @property
    def step_time(self) -> float:
        return sum(self.time.values())


def _bytes(params: list[Param], tp: int, shard: int, per_element: float) -> float:
    return float(sum(p.local_numel(tp, shard) for p in params) * per_element)


def pieces_in_flight(cand: Candidate, stage: int) -> float:
    """Micro-batch pieces whose activations stage `stage` holds at once under the candidate's schedule (for a rank
    with several stages, in pieces through all of its blocks)."""
    m, p = cand.microbatches, cand.pp
    if p == 1:
        return 1
    _, per_rank, _ = SCHEDULES[cand.schedule]
    if cand.schedule in ("gpipe", "looped_bfs"):  # every forward before the first backward
        return m
    if per_rank == 1:  # 1F1B: stage i warms up with p − i forwards before its first backward
        return min(m, p - stage)
    if cand.schedule == "interleaved_1f1b":
        return sum(interleaved_forwards(cand, stage)) / per_rank
    return min(m, p * (1 + (p - 1) / (p * per_rank)))


def interleaved_forwards(cand: Candidate, stage: int) -> list[int]:
    """Under torch's Interleaved1F1B, the forwards rank `stage` has run, by its local stage, when its first backward
    starts: its warm-up, (stages per rank − 1) · r + 2 · (pp − 1 − rank) with r pieces a round (pp, or all m when
    m < pp: torch's _get_warmup_ops), and one more unless that was all, the local stage changing every r."""
    m, p = cand.microbatches, cand.pp
    per_rank = SCHEDULES[cand.schedule][1]
    per_round = m // max(1, m // p)
    warm_up = min((per_rank - 1) * per_round + 2 * (p - 1 - stage), m * per_rank)
    counts = [0] * per_rank
    for k in range(warm_up + (warm_up < m * per_rank)):
        counts[(k // per_round) % per_rank] += 1
    return counts


def estimate_layout(
    spec: ModelSpec, cand: Candidate, precision: PrecisionBytes, cluster: Cluster, accum: int, tf32: bool
) -> Estimate:
    """Memory of the most loaded rank (the stage whose total is largest) and the time of a step."""
    stages = [stage_memory(spec, cand, precision, cluster, accum, stage) for stage in range(cand.pp)]
    stage = max(range(cand.pp), key=lambda i: sum(stages[i][0].values()))
    parts, host = stages[stage]
    time = step_time(spec, cand, precision, cluster, accum, tf32)
    return Estimate(cand, parts, sum(host.values()), stage, time, fits=sum(parts.values()) <= cluster.usable_memory)


def stage_memory(
    spec: ModelSpec, cand: Candidate, precision: PrecisionBytes, cluster: Cluster, accum: int, stage: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Bytes by MEMORY_PARTS on a rank of pipeline stage `stage`, and those it keeps in host memory instead (CPU
    offload: params, optimizer, and the gradients once reduced)."""
    held = spec.stage_params(stage, cand.pp)
    fsdp = cand.strategy == "fsdp"
    shard = cand.dp_shard if fsdp else 1
    state = StateBytes.adamw(precision.name)  # per element of each parameter
    params = _bytes(held, cand.tp, shard, state.weights)
    optimizer = _bytes(held, cand.tp, shard, state.optimizer) + 4 * len(held)  # and a 4-byte step per tensor
    # FSDP keeps gradients unsharded while they accumulate over the micro-steps (no_sync; unless it reduce-scatters
    # every micro-step). A pipeline's schedule reduce-scatters at its end, every micro-step, and keeps them unsharded
    # over its pieces (torch's PipelineStage defers gradient sync to the schedule's end): `temporaries`, below
    in_pipeline = fsdp and cand.pp > 1
    unsharded_grads = fsdp and accum > 1 and not cand.reduce_every_microstep and not in_pipeline
    # whole gradients accumulate in FSDP's reduce dtype, fp32 (strategies/fsdp.py), whatever the parameters' dtype
    whole_grads = _bytes(held, cand.tp, 1, 4)
    grads = whole_grads if unsharded_grads else _bytes(held, cand.tp, shard, state.grads)
    if cand.strategy == "ddp" and accum > 1 and cand.pp == 1:  # DDP's buckets, allocated once, beside the gradients
        grads *= 2  # of the micro-steps before the last (zero_grad(set_to_none) leaves them to autograd; the dry run
        # found this). A pipeline's micro-steps all synchronise: its pieces' own gradients are in the temporaries
    # a vocabulary-parallel embedding's gradient comes back whole when no head on the stage shares the weight: held
    # so (the pipeline's clipping takes this rank's rows), or under fsdp, in its fp32, until it is reduce-scattered
    # (temporaries): the rest of the vocabulary's rows, beyond this rank's
    embedding = [p for p in held if p.name == "wte.weight"] if cand.pp > 1 and cand.tp > 1 and stage == 0 else []
    grad_bytes = 4 if fsdp else state.grads
    whole_embedding = _bytes(embedding, 1, 1, grad_bytes) - _bytes(embedding, cand.tp, 1, grad_bytes)
    grads += 0.0 if fsdp else whole_embedding
    host: dict[str, float] = {}
    if cand.kind == "fsdp-offload":  # state in host memory; gradients still accumulating stay on the device
        host = {"params": params, "grads": _bytes(held, cand.tp, shard, state.grads), "optimizer": optimizer}
        params, optimizer, grads = 0.0, 0.0, grads if unsharded_grads else 0.0

    activations, act = _stage_activations(spec, cand, precision, stage)
    blocks = spec.blocks_of_stage(stage, cand.pp)
    checkpointed = _checkpointed(cand, blocks)
    last = stage == cand.pp - 1
    piece = cand.micro_batch // cand.microbatches
    # what a pipeline stage sends on: the residual stream, in the parameters' dtype under ddp and single
    stream = element_bytes(precision.activations_under(cand.strategy)).param

    # FSDP gathers every rank's shard, each padded to the largest (dim 0 rounded up to a multiple of the ranks)
    whole = shard * _bytes(held, cand.tp, shard, precision.gather)
    gathered = whole if cand.kind == "fsdp-grad-op" else 0.0
    # The peak is one of three moments (found with the dry run, dryrun.py), each on top of what the other parts hold.
    # The loss's forward, on the last stage: the logits in the compute dtype and their fp32 copy (one tensor under
    # 32-true), and autocast's cached weight copies of checkpointed blocks, kept until autocast exits. The loss's
    # backward: the fp32 logits' gradient twice, nll_loss's and log_softmax's. The last block's backward: under fsdp
    # the units it gathers and their gradients before they are reduced, with checkpointing its recomputed
    # activations (on top of nearly all saved activations still). At all three, a step's first gradients do not
    # exist yet unless earlier micro-steps or 1F1B pieces made some, or DDP's buckets (allocated once) hold them.
    logits = 4.0 * spec.seq * piece * spec.vocab if last else 0.0
    compute_copy = logits / 4 * precision.activation if precision.activation != 4 else 0.0
    in_flight = pieces_in_flight(cand, stage)
    # torch's pipeline stage keeps each piece's output, the logits in the compute dtype, until that piece's backward
    # ends: the last stage's pieces in flight (all of them under GPipe) at every moment; the current one's output is
    # the compute-dtype copy already counted (or, under 32-true, the logits themselves)
    output, kept = logits / 4 * precision.activation, 1.0
    if cand.pp > 1 and last:
        kept = interleaved_forwards(cand, stage)[-1] if cand.schedule == "interleaved_1f1b" else in_flight
    loss_forward = logits + compute_copy + (kept - 1) * output + checkpointed * act.block_weight_copy if last else 0.0
    no_grads_yet = grads if accum == 1 and cand.pp == 1 and cand.strategy != "ddp" else 0.0
    # a pipeline runs backward inside its schedule's autocast, whose cached copies of checkpointed blocks' weights
    # are then alive (elsewhere autocast has exited and freed them)
    cached = checkpointed * act.block_weight_copy if cand.pp > 1 else 0.0
    blocks_backward = (act.recompute_peak if checkpointed else 0.0) + cached
    if cand.pp > 1:  # on a stage without the loss, a block's backward is the moment (the MLP's hidden gradient and a
        # matmul input's, in the compute dtype, and the stream's)
        tokens, c, compute = piece * spec.seq, spec.n_embd, precision.activation
        blocks_backward += tokens * (4 * c / cand.tp * compute + c * compute + (c * stream if stream != compute else 0))
        blocks_backward += kept * output if last else 0.0
    in_block = blocks_backward  # what a block's backward itself holds
    root = block = 0.0
    if fsdp:  # the root unit (embeddings, final norm, head: gathered through forward and backward) and the block
        # computing (held in `gathered` already under grad-op; the block that backward prefetches is not there yet
        # at the peak, the dry run finds, but with checkpointing the recomputed forward's prefetch is), and the
        # gradients of the root and the block, in the gathered dtype (FSDP's param_dtype) before they are reduced
        # (while they accumulate unsharded, they are in `grads` already)
        root = shard * _bytes([p for p in held if p.block is None], cand.tp, shard, precision.gather)
        in_blocks = {p.block for p in held if p.block is not None}
        block = max(
            (shard * _bytes([p for p in held if p.block == b], cand.tp, shard, precision.gather) for b in in_blocks),
            default=0.0,
        )
        units = root + (2 if checkpointed else 1) * block  # a recomputed forward prefetches the next block too
        if not in_pipeline:
            blocks_backward += 0.0 if gathered else units
            blocks_backward += 0.0 if unsharded_grads else root + block
        elif not gathered:  # a schedule regathers units for each piece's backward: the root and two blocks during
            # a block's (three when a recomputed forward prefetches another of the stage's), or a unit twice (its
            # all-gather buffer and the parameters) as it is copied out
            during = root + (3 if checkpointed and blocks > 1 else 2) * block
            blocks_backward = max(blocks_backward + during, 2 * (root + block))
    # a pipeline's last stage keeps each piece's output, the compute-dtype logits, until that piece's backward
    loss_backward = 2 * logits + (kept * output + cached if cand.pp > 1 and last else 0.0)
    temporaries = max(loss_forward, loss_backward, blocks_backward) - no_grads_yet  # the last block is the first
    temporaries = max(temporaries, 0.0)  # to make gradients in backward: the others' do not exist yet either
    if cand.pp > 1:
        copies = (blocks - checkpointed) * act.block_weight_copy + (act.head_weight_copy if last else 0.0)
        per_piece = (activations - copies) / in_flight  # autocast's weight copies are the step's, not a piece's
        later = max(0.0, min(in_flight - 1, cand.microbatches - 2))  # pieces ahead at the second piece's end
        # the pieces' gradients exist once the first piece's backward is done: inside a later piece, beside the
        # activations of all but that first piece (and of those no forward is left to replace)
        freed = (in_flight - min(in_flight, cand.microbatches - 1)) * per_piece
        piece_grads = _pieces_gradients(cand, grads, whole_grads, accum)
        moments = [temporaries + max(0.0, piece_grads - freed)]
        # The end of a piece's backward, its gradients made: the first piece's (the most pieces ahead; under FSDP,
        # which casts each piece's embedding gradient to its fp32 one), or the second's (the fewest behind it of the
        # most ahead; DDP adds its embedding gradient to the first piece's there)
        # a piece's last new gradient, before it is added to the earlier pieces': the embedding's (whole on the first
        # stage), the head's on the last, a block's weight's on the others; beside autocast's cached weight copies and
        # their gradients, and on the last stage its output, the logits
        new_grad = [p for p in held if p.name == "wte.weight"] or sorted(held, key=lambda p: math.prod(p.shape))[-1:]
        ending = _bytes(new_grad, 1 if stage == 0 else cand.tp, 1, precision.gather if fsdp else 4)
        ending += 2.0 * (blocks * act.block_weight_copy + (act.head_weight_copy if last else 0))
        ending += output if last else 0.0
        if in_pipeline and not gathered:  # torch's schedule turns FSDP's resharding after backward off until the
            # last piece: each unit stays gathered until the next forward passes it, so by a piece's last block's
            # backward the stage's whole parameters are, beside what that backward holds and its block's gradient
            ending = whole + max(in_block + block, ending)
        ahead = [later] + ([in_flight - 1] if fsdp else [])  # second piece's end; the first's under FSDP
        moments += [ending + pieces * per_piece - activations + piece_grads for pieces in ahead]
        temporaries = max(moments)
        temporaries += _schedule_memory(spec, cand, stage, stream)
        temporaries += whole_embedding if fsdp else 0.0
    parts = {
        "params": params,
        "grads": grads,
        "optimizer": optimizer,
        "activations": activations,
        "gathered": gathered,
        "temporaries": temporaries,
        "overhead": cluster.overhead,
    }
    return parts, host


def _schedule_memory(spec: ModelSpec, cand: Candidate, stage: int, stream: float) -> float:
    """What a pipeline stage holds all through its schedule, besides the parts (found with the dry run): torch's
    receive buffers, one per piece and direction for each of the rank's stages (two or more under interleaved and V
    schedules), kept from the first step on; on the first stage, the outputs of its other pieces in flight (sent on
    as they are)."""
    _, per_rank, shape = SCHEDULES[cand.schedule]
    first = stage == 0  # this rank holds the pipeline's first stage (no forward input to receive) and its last
    last = stage == (0 if shape == "v" else cand.pp - 1)  # (no gradient to receive): a V puts it back on rank 0
    tokens = cand.micro_batch // cand.microbatches * spec.seq
    sent = tokens * spec.n_embd * stream  # a piece's residual stream
    out = cand.microbatches * sent * (2 * per_rank - first - last)
    if first:
        out += sent * (pieces_in_flight(cand, stage) - 1)
    return out


def _pieces_gradients(cand: Candidate, grads: float, whole_grads: float, accum: int) -> float:
    """Gradients a pipeline stage holds beside the parts once a piece's backward is done: DDP's own gradients of the
    pieces before the last (accumulated under no_sync) beside its buckets; FSDP's, whole until the schedule ends
    (beside the sharded ones that earlier micro-steps reduced, under accumulation)."""
    out = grads if cand.kind == "ddp" and cand.microbatches > 1 else 0.0
    if cand.strategy == "fsdp":
        out += max(0.0, whole_grads - (grads if accum == 1 else 0.0))
    return out


def _checkpointed(cand: Candidate, blocks: int) -> int:
    """Blocks of a stage under activation checkpointing: block i of the stage when i % k == 0."""
    return math.ceil(blocks / cand.checkpoint_every) if cand.checkpoint_every else 0


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
    plain = blocks - _checkpointed(cand, blocks)
    last, first = stage == cand.pp - 1, stage == 0
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


def step_time(
    spec: ModelSpec, cand: Candidate, precision: PrecisionBytes, cluster: Cluster, accum: int, tf32: bool
) -> dict[str, float]:
    """Seconds per optimizer step by TIME_PARTS. The pipeline runs at its slowest stage's pace; the step ends when
    the stage with the most to do after it (optimizer, data-parallel traffic) is done."""
    ranks_here = min(cand.dp * cand.tp * cand.pp, cluster.devices_per_node)
    slowdown = cluster.busy_slowdown if ranks_here > 1 else 1.0  # devices of a node sharing memory (CPU cores)
    flops = cluster.flops(precision.compute_dtype(tf32 and cluster.device == "cuda")) / slowdown
    slots = [_slot(spec, cand, precision, cluster, stage, flops, slowdown) for stage in range(cand.pp)]
    compute, comm, backward = max(slots, key=lambda s: s[0] + s[1])
    per_rank = SCHEDULES[cand.schedule][1]
    bubble_slots = 0.0 if cand.pp == 1 else (cand.pp - 1) / (1 if cand.schedule in ("gpipe", "1f1b") else per_rank)
    m = cand.microbatches
    pipeline = {"compute": accum * m * compute, "bubble": accum * bubble_slots * (compute + comm)}
    after = [
        _after_pipeline(spec, cand, precision, cluster, accum, stage, m * compute, m * backward, slowdown)
        for stage in range(cand.pp)
    ]
    tail = max(after, key=lambda t: sum(t.values()))
    return {
        **pipeline,
        "comm": accum * m * comm + tail["comm"],
        "optimizer": tail["optimizer"],
        "offload": tail["offload"],
    }


def _slot(
    spec: ModelSpec,
    cand: Candidate,
    precision: PrecisionBytes,
    cluster: Cluster,
    stage: int,
    flops: float,
    slowdown: float,
) -> tuple[float, float, float]:
    """(compute seconds, tensor-parallel and pipeline communication seconds, backward compute) of one piece on
    `stage`."""
    piece = cand.micro_batch // cand.microbatches
    tokens = piece * spec.seq
    act_bytes = tokens * spec.n_embd * precision.activation
    stream = tokens * spec.n_embd * element_bytes(precision.activations_under(cand.strategy)).param
    tp_link, pp_link = cluster.link(cand.tp, 1), cluster.link(cand.pp, cand.dp * cand.tp)
    blocks = spec.blocks_of_stage(stage, cand.pp)
    checkpointed = _checkpointed(cand, blocks)
    last, first = stage == cand.pp - 1, stage == 0
    forward = blocks * spec.matmul_flops_per_token(side="block")
    forward += spec.matmul_flops_per_token(side="head") if last else 0
    recompute = checkpointed * spec.matmul_flops_per_token(side="block")
    share = cluster.forward_share  # of a forward + backward's time
    # the calibrated fixed cost of a whole model's step, for this stage's share of the work (not cut by tp: each
    # rank launches every kernel), once per piece
    fixed = cluster.step_overhead * slowdown * (forward + share * recompute) / (spec.train_flops_per_token() / 3)
    split = (1 - cluster.tp_unsplit) / cand.tp + cluster.tp_unsplit  # of the per-token work, on this rank
    work = tokens * 3 * forward * split / flops
    again = tokens * 3 * recompute * split / flops * share  # the checkpointed blocks' second forward
    compute = work + again + fixed
    backward = (1 - share) * (work + fixed) + again
    comm = (4 * blocks + 2 * checkpointed) * tp_link.time("all_reduce", act_bytes, cand.tp)
    if first:
        comm += tp_link.time("all_reduce", act_bytes, cand.tp)
    if last:
        logits = tokens * spec.vocab * precision.activation
        comm += tp_link.time("all_gather", logits, cand.tp) + tp_link.time("all_reduce", act_bytes, cand.tp)
    sends = (not first) + (not last)  # receive activations / send them on; the same for gradients back
    comm += 2 * sends * pp_link.time("p2p", stream, 2)
    return compute, comm, backward


def _after_pipeline(
    spec: ModelSpec,
    cand: Candidate,
    precision: PrecisionBytes,
    cluster: Cluster,
    accum: int,
    stage: int,
    micro: float,
    backward: float,
    slowdown: float,
) -> dict[str, float]:
    """A stage's exposed data-parallel communication, optimizer step and offload copies per step."""
    held = spec.stage_params(stage, cand.pp)
    shard = cand.dp_shard if cand.strategy == "fsdp" else 1
    local = sum(p.local_numel(cand.tp, shard) for p in held)
    optimizer_bytes = local * OPTIMIZER_BYTES_PER_PARAM * precision.weight / 4
    out = {"comm": _data_parallel_comm(spec, cand, precision, cluster, accum, stage, micro, backward)}
    if cand.kind == "fsdp-offload":  # the fp32 shards up for each gather, the reduced gradients down
        out["optimizer"] = optimizer_bytes / cluster.host_bandwidth
        # each micro-step's gathers bring the fp32 shard up; reduced gradients go down once a step, or after every
        # micro-step when it reduce-scatters each
        down = accum if cand.reduce_every_microstep else 1
        out["offload"] = (accum * 2 + down) * local * precision.weight / cluster.host.bandwidth
    else:
        out["optimizer"] = optimizer_bytes / cluster.mem_bandwidth * slowdown
        out["offload"] = 0.0
    return out


def _data_parallel_comm(
    spec: ModelSpec,
    cand: Candidate,
    precision: PrecisionBytes,
    cluster: Cluster,
    accum: int,
    stage: int,
    micro: float,
    backward: float,
) -> float:
    """Exposed seconds of a stage's data-parallel collectives per step; `micro`/`backward`: compute of one
    micro-step and of its backward, which communication may hide behind."""
    if cand.dp == 1:
        return 0.0
    held = spec.stage_params(stage, cand.pp)
    unsharded = _bytes(held, cand.tp, 1, 1)  # elements of this stage's (tensor-parallel) parameters
    hide = cluster.overlap
    if cand.strategy == "ddp":
        link = cluster.link(cand.dp_replicate, cand.tp)
        buckets = max(1, math.ceil(4 * unsharded / DDP_BUCKET_BYTES))
        total = link.time("all_reduce", 4 * unsharded, cand.dp_replicate, messages=buckets)
        return max(total / buckets, total - hide * backward)  # the last bucket cannot hide
    units = spec.blocks_of_stage(stage, cand.pp) + 1
    shard_link = cluster.link(cand.dp_shard, cand.tp)
    gather = shard_link.time("all_gather", precision.gather * unsharded, cand.dp_shard, messages=units)
    regather = gather if cand.kind != "fsdp-grad-op" else 0.0
    reduce = scatter = shard_link.time("reduce_scatter", 4 * unsharded, cand.dp_shard, messages=units)
    if cand.dp_replicate > 1:
        replicate_link = cluster.link(cand.dp_replicate, cand.dp_shard * cand.tp)
        reduce += replicate_link.time("all_reduce", 4 * unsharded / cand.dp_shard, cand.dp_replicate, messages=units)
    # FSDP2 copies each gathered unit out of the all-gather buffer, and each unsharded gradient into the
    # reduce-scatter buffer: memory-bound copies (read + write) on the critical path; and its calibrated own time
    # per unit
    gather_copies = 2 * unsharded * precision.gather * (2 if regather else 1) / cluster.mem_bandwidth
    reduce_copies = 2 * unsharded * 4 / cluster.mem_bandwidth
    forward = micro - backward
    per_micro = gather_copies + units * cluster.fsdp_unit_overhead + max(gather / units, gather - hide * forward)
    # in backward the re-gathers (and, at the last micro-step or at every one, the reduce-scatters) share the link:
    # hidden together; the all-reduce across hybrid replicas waits for the last
    # (a pipeline's schedule reduces its stage's gradients at the end of every micro-step's schedule run)
    every = cand.reduce_every_microstep or cand.pp > 1
    during = regather + (scatter if every else 0.0)
    quiet = max(during / units, during - hide * backward) + (reduce_copies if every else 0.0)
    last = reduce_copies + max((regather + reduce) / units, regather + reduce - hide * backward)
    return accum * per_micro + (accum - 1) * quiet + last
