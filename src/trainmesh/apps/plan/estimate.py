"""One layout on one cluster: the time of a step by phase (compute, exposed communication, optimizer, offload), and
with rank_memory.py's memory per rank by component, for the most loaded pipeline stage, the layout's estimate.

Details: docs/internals.md#appsplanestimatepy
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainmesh.apps.plan.cluster import Cluster
from trainmesh.apps.plan.layouts import Candidate
from trainmesh.apps.plan.memory import PrecisionBytes, element_bytes
from trainmesh.apps.plan.model import ModelSpec
from trainmesh.apps.plan.rank_memory import stage_memory
from trainmesh.apps.plan.schedules import loss_rank
from trainmesh.apps.plan.stage_parts import checkpointed_blocks, param_bytes
from trainmesh.strategies import SCHEDULES

TIME_PARTS = ("compute", "bubble", "comm", "optimizer", "offload")
OPTIMIZER_BYTES_PER_PARAM = 32  # fp32 AdamW: read p, g, m, v; write p, m, v (28); clipping reads g (4)
DDP_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Estimate:
    candidate: Candidate
    memory: dict[str, float]
    """Bytes on the most loaded rank, by rank_memory.MEMORY_PARTS (device memory; offloaded state is in `host`)."""
    host: float
    """Bytes the most loaded rank keeps in host memory (CPU offload)."""
    stage: int
    """The pipeline stage of the most loaded rank."""
    time: dict[str, float]
    """Seconds per optimizer step, by TIME_PARTS."""
    fits: bool

    @property
    def total_memory(self) -> float:
        """Bytes on the most loaded rank's device, all parts together."""
        return sum(self.memory.values())

    @property
    def step_time(self) -> float:
        """Seconds per optimizer step, all phases together."""
        return sum(self.time.values())


def estimate_layout(
    spec: ModelSpec, cand: Candidate, precision: PrecisionBytes, cluster: Cluster, accum: int, tf32: bool
) -> Estimate:
    """Memory of the most loaded rank (the stage whose total is largest) and the time of a step."""
    stages = [stage_memory(spec, cand, precision, cluster, accum, stage) for stage in range(cand.pp)]
    stage = max(range(cand.pp), key=lambda i: sum(stages[i][0].values()))
    parts, host = stages[stage]
    time = step_time(spec, cand, precision, cluster, accum, tf32)
    return Estimate(cand, parts, sum(host.values()), stage, time, fits=sum(parts.values()) <= cluster.usable_memory)


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
    checkpointed = checkpointed_blocks(cand, blocks)
    last, first = stage == loss_rank(cand), stage == 0
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
    # each of the rank's stages receives activations from the stage before and sends them on (and gradients back),
    # but the pipeline's first and last stage; a V's rank pp − 1 holds two stages next to each other
    _, per_rank, placement = SCHEDULES[cand.schedule]
    sends = 2 * per_rank - first - last if placement != "v" else 4 - 2 * first - 2 * (stage == cand.pp - 1)
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
    held = spec.stage_params(stage, cand.pp, loss_rank(cand))
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
    held = spec.stage_params(stage, cand.pp, loss_rank(cand))
    unsharded = param_bytes(held, cand.tp, 1, 1)  # elements of this stage's (tensor-parallel) parameters
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
