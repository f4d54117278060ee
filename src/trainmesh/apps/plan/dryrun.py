"""The dry run of `trainmesh check --dry-run`: the real job at its real world size, on this one machine. For one rank
of each pipeline stage it builds what a trainmesh run builds (`job.runtime()`, the recipe's model on the meta device,
`runtime.setup` with the recipe's parallel plan, `build_optimizer`) on the fake process group with fake tensors
(fake.py), runs one optimizer step through the strategy (its micro-steps' forward and backward, clipping, the
optimizer step), and reports what PyTorch's memory trackers saw: the most bytes of each component held at any
moment, and the step's peak. Nothing of the real size is allocated; the planner's prediction for the same rank
(rank_memory.stage_memory) stands beside it.

Details: docs/internals.md#appsplandryrunpy
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainmesh.apps.plan.check import where_from
from trainmesh.apps.plan.cluster import Cluster, GiB, size_unit
from trainmesh.apps.plan.fake import LiveBytes, fake_rank, first_pieces, pipeline_buffers, quiet, static_pipeline
from trainmesh.apps.plan.layouts import Candidate
from trainmesh.apps.plan.memory import PrecisionBytes
from trainmesh.apps.plan.model import ModelSpec
from trainmesh.apps.plan.probes import GatheredParams, SavedActivations, optimizer_bytes, storage_bytes
from trainmesh.apps.plan.rank_memory import stage_memory
from trainmesh.config import Config, ConfigError
from trainmesh.core.env import DistEnv
from trainmesh.core.machine import host_memory
from trainmesh.job.spec import Job, resolve
from trainmesh.recipes.gpt.model import GPTConfig
from trainmesh.runtime.runtime import Runtime
from trainmesh.strategies.blocks import find_blocks
from trainmesh.strategies.pipeline import PipelineStrategy
from trainmesh.train.optim import build_optimizer

COMPONENTS = ("params", "grads", "optimizer", "activations", "gathered", "temporaries")
"""The planner's memory parts (rank_memory.MEMORY_PARTS) less its constant overhead, which nothing in a step
allocates."""
TOLERANCE = 0.05
"""The planner and the dry run agree on a component when they differ by at most this fraction of the larger."""
RUN_AS = {"16-mixed": "bf16-mixed", "fp8-mixed": "bf16-mixed"}
"""Precisions the fake CPU step runs as another that holds the same bytes: fp16's loss scaler reads its overflow
flag on the host (a fake tensor has no value), and float8 kernels need a GPU; both keep fp32 weights, gradients and
AdamW state and 16-bit activations, as bf16-mixed does."""


def bookkeeping_bytes(world_size: int) -> float:
    """Host memory a dry run takes here, whatever the model's size: torch itself and the fake step (about 350 MiB
    for a 7B model at 64 and at 512 ranks), and per rank of the world its process-group and shard-view objects
    (measured at under 5 KiB; 8 KiB counted)."""
    return 0.5 * GiB + 8 * 1024 * world_size


@dataclass(frozen=True)
class RankMemory:
    """What one rank held during its step, in bytes."""

    rank: int
    stage: int
    """Its pipeline stage (0 without a pipeline)."""
    components: dict[str, int]
    """By COMPONENTS: parameters (and buffers) and optimizer state as they are all step; the most gradient bytes
    held between micro-steps and as the optimizer starts; the peak of autograd's saved tensors (probes.py); FSDP's
    gathered parameters held after forward; temporaries: the peak less all of those."""
    peak: int
    """The most bytes held at any moment, all components together."""
    seconds: float
    """Wall time to build and run this rank here."""
    pieces: int
    """Micro-batch pieces its step ran of each micro-step (pieces_to_run; 1 without a pipeline)."""


@dataclass(frozen=True)
class DryRun:
    job: Job
    """The job as it ran: on the meta device first, on the CPU, in a precision of the same bytes (RUN_AS)."""
    ranks: list[RankMemory]
    micro_steps: int

    @property
    def most_loaded(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.peak)


def dry_run_job(job: Job) -> Job:
    """`job` as the dry run builds it: its model on the meta device (materialised as fake tensors after sharding), on
    the CPU over the fake group, uncompiled, in RUN_AS's precision. Refuses what it cannot build, naming the key."""
    config = job.config
    if not isinstance(config.model, GPTConfig):
        raise ConfigError(
            f"trainmesh check --dry-run runs the gpt recipe, not run.recipe={config.run.recipe!r}. Fix: check "
            "without --dry-run (its memory line is the plan's prediction where the recipe has one)."
        )
    need = bookkeeping_bytes(job.world_size)
    if need > host_memory():
        raise ConfigError(
            f"a dry run at {job.world_size:,} ranks would need about {need / GiB:.1f} GiB of this machine's memory for "
            f"its bookkeeping (process groups and FSDP's shard views per rank of the world), and it has "
            f"{host_memory() / GiB:.1f} GiB. Fix: dry-run a smaller world size (--nnodes, --nproc-per-node) with the "
            "same per-rank shapes (the same parallel.tp, micro-batch and shard sizes)."
        )
    train = dataclasses.replace(
        config.train, precision=RUN_AS.get(config.train.precision, config.train.precision), compile=False
    )
    run_as = dataclasses.replace(
        config,
        train=train,
        parallel=dataclasses.replace(config.parallel, meta_init=True),
        dist=dataclasses.replace(config.dist, device="cpu", backend="auto"),
    )
    return resolve(run_as, job.world_size)


def stage_ranks(job: Job) -> list[int]:
    """The first rank of each pipeline stage (the device mesh's order is pp, dp_replicate, dp_shard, tp): ranks
    of a stage hold the same shapes (FSDP pads shards to one size; tensor-parallel ranks split heads and the
    vocabulary evenly) and differ only in their data."""
    dims = job.layout.dims
    per_stage = dims.world_size // dims.pp
    return [stage * per_stage for stage in range(dims.pp)]


def dry_run(job: Job, micro_steps: int | None = 2, stages: list[int] | None = None) -> DryRun:
    """Run one step of every pipeline stage of `job` (or of `stages`) here. `micro_steps`: of the step's
    accumulation micro-steps, how many to run (None: all; 2, the default, shows the memory of any number, see
    run_rank)."""
    fake = dry_run_job(job)
    steps = fake.batch.accum_steps if micro_steps is None else max(1, min(micro_steps, fake.batch.accum_steps))
    if fake.layout.dims.pp > 1 and fake.config.parallel.strategy == "ddp":  # a DDP pipeline synchronises every
        # micro-step, and DDP's reducer then rebuilds its buckets in C++, which needs real memory: one micro-step
        # (later ones accumulate into the same gradients; FSDP's keep the reduced shards beside: two show that)
        steps = 1
    ranks = stage_ranks(fake)
    chosen = range(len(ranks)) if stages is None else stages
    return DryRun(fake, [run_rank(fake, ranks[s], s, steps, pieces_to_run(fake, s)) for s in chosen], steps)


STEADY = 2
"""Under 1F1B, the pieces a stage runs after its warm-up: the first backward (no piece's gradients yet) and the
second (every piece in flight beside the gradients of the first), which every later one repeats."""


def pieces_to_run(job: Job, stage: int) -> int:
    """The micro-batch pieces a pipeline stage's dry run steps through: under 1F1B its warm-up and STEADY more (the
    pieces after them go through the same moments again: one forward, one backward, the same pieces in flight), the
    receive buffers of all made all the same (fake.first_pieces); under the other schedules, whose pieces in flight
    depend on all of them, every piece. 1 without a pipeline."""
    dims, options = job.layout.dims, job.config.parallel.pipeline
    if dims.pp == 1:
        return 1
    if options.schedule != "1f1b":
        return options.microbatches
    return min(options.microbatches, dims.pp - stage + STEADY)


def run_rank(job: Job, rank: int, stage: int, micro_steps: int, pieces: int | None = None) -> RankMemory:
    """One rank's step under the trackers. The optimizer's state is created first (AdamW makes it at its first
    step), so the tracked step holds what every later step holds. Micro-steps before the last accumulate without
    synchronising (the strategy's no_sync) and hold what the first of them holds, so 2 show the memory of any
    number. `pieces`: of a pipeline's micro-batch pieces, how many each micro-step runs (pieces_to_run's by
    default; fewer than all only under 1F1B)."""
    pieces = pieces_to_run(job, stage) if pieces is None else pieces
    start = time.perf_counter()
    dims = job.layout.dims
    env = DistEnv(rank, rank, dims.world_size, dims.world_size, "127.0.0.1", 0, "adopted")  # one node of them all
    with fake_rank(rank, dims.world_size) as fake_tensors, quiet():
        runtime = job.runtime(env)
        with torch.device("meta"):
            whole = job.recipe.build_model(job.config, runtime)
        # cast for the precision on the meta device, before fake mode (which would turn a cast parameter into a
        # fake one that materialising cannot swap); setup's own cast then finds nothing left to do
        whole = runtime.precision.convert_module(whole)
        pipeline = static_pipeline(pipeline_boundaries(job, runtime, whole)) if dims.pp > 1 else nullcontext()
        with fake_tensors, pipeline:
            memory = _step(job, runtime, whole, micro_steps, pieces)
        runtime.teardown()
    return RankMemory(rank, stage, *memory, time.perf_counter() - start, pieces)


def pipeline_boundaries(job: Job, runtime: Runtime, whole: nn.Module) -> list[torch.Tensor]:
    """What passes between the pipeline's stages, for one piece of a micro-batch, on the meta device: what each stage
    receives (the token ids for the first) and, last, what the last stage puts out; from the stages' own forwards, with
    autograd on (torch gives a stage gradients for what requires them)."""
    strategy = runtime.strategy
    assert isinstance(strategy, PipelineStrategy)
    cut = job.recipe.parallel_plan(whole).pipeline_stage
    assert cut is not None
    piece = job.batch.micro_batch // strategy.options.microbatches
    x = torch.zeros((piece, job.batch.tokens_per_sample), dtype=torch.long, device="meta")
    boundaries = [x]
    # FSDP's mixed precision computes, and sends, in its dtype (where it wraps: over more than one replica)
    cast = getattr(strategy.inner, "param_dtype", None) if strategy.dp_size > 1 else None
    for index in range(strategy.num_stages):
        x = cut(whole, index, strategy.num_stages)(x)
        boundaries.append(x.to(cast) if cast is not None and x.is_floating_point() else x)
    return boundaries


def _step(job: Job, runtime: Runtime, whole: nn.Module, micro_steps: int, pieces: int) -> tuple[dict[str, int], int]:
    """Set the model up as a run does and measure one step: each component's most bytes (COMPONENTS) and the peak.
    Tracked from the set-up on: what it leaves allocated (DDP's gradient buckets, say) is memory the step holds."""
    live = LiveBytes()
    with live:
        # fake tensors hold no values: initialising them would only cost time (a sixth of the 7B's dry run at 64
        # ranks, each DTensor's whole value made and cut up), and the set-up's peak is not the step's
        plan = dataclasses.replace(job.recipe.parallel_plan(whole), init_weights=_no_values)
        model = runtime.setup(whole, plan=plan)
        raw = runtime.unwrap(model)
        optimizer = build_optimizer(raw, job.config.optim, runtime.device)
        _create_optimizer_state(raw, optimizer)
        shape = (job.batch.micro_batch, job.batch.tokens_per_sample)
        batch = (torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.long))  # ids and targets
        strategy, schedule = runtime.strategy, None
        if isinstance(strategy, PipelineStrategy) and pieces < strategy.options.microbatches:
            if strategy.options.schedule != "1f1b":  # whose pieces in flight depend on all of them
                raise ValueError(f"only a 1F1B step repeats its pieces: {strategy.options.schedule} runs them all")
            rows, schedule = job.batch.micro_batch // strategy.options.microbatches * pieces, strategy.schedule
            batch = (batch[0][:rows], batch[1][:rows])  # the first pieces' (views: the whole batch is held)
        # the same all step: parameters (and buffers), optimizer state, the batch (which the plan counts in the
        # activations: the embedding and the loss save it)
        params, state = storage_bytes([*raw.parameters(), *raw.buffers()]), optimizer_bytes(optimizer)
        steady = params + state + storage_bytes(batch)
        live.reset_peak()
        stages = getattr(strategy, "pipeline_stages", [])
        # beside the state between micro-steps: the gradients (and a pipeline's receive buffers, in temporaries)
        with first_pieces(schedule, pieces) if schedule is not None else nullcontext():
            held = _one_step(
                job,
                runtime,
                model,
                optimizer,
                batch,
                micro_steps,
                lambda: live.current() - steady - storage_bytes(pipeline_buffers(stages)),
            )
        saved, gathered = held.pop()
    parts = {"params": params, "grads": max(held), "optimizer": state, "activations": saved, "gathered": gathered}
    peak = live.peak()
    return {**parts, "temporaries": max(0, peak - sum(parts.values()))}, peak


def _no_values(module: nn.Module) -> None:
    del module


def _one_step(
    job: Job,
    runtime: Runtime,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    micro_steps: int,
    beside_state: Callable[[], int],
) -> list[Any]:
    """The step, as the loop runs it through the strategy: what is held beside the state between micro-steps and as
    the optimizer starts (the gradients), then (the peak of saved activations, the gathered parameters)."""
    raw = runtime.unwrap(model)
    saved, gathered = SavedActivations(find_blocks(raw)), GatheredParams(raw)
    objective = job.recipe.objective()
    scale = 1.0 / (job.batch.global_batch * job.batch.tokens_per_sample)
    held: list[Any] = []
    hook = optimizer.register_step_pre_hook(lambda *_: held.append(beside_state()))
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        for i in range(micro_steps):
            with runtime.no_sync(model, enabled=i < micro_steps - 1):
                runtime.strategy.forward_backward(model, batch, objective, lambda: scale, runtime.precision)
            held.append(beside_state())
        runtime.clip_grad_norm(model, optimizer, job.config.train.grad_clip)
        runtime.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    hook.remove()
    return [*held, (saved.close(), gathered.close())]


def _create_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One optimizer step on zero gradients: the state AdamW creates at its first step, without a forward."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@dataclass(frozen=True)
class Comparison:
    """The planner's prediction for a rank beside the dry run's measurement, in bytes."""

    rank: RankMemory
    predicted: dict[str, float]
    """By COMPONENTS, and 'peak': their sum (the planner's total less its constant overhead)."""

    @property
    def measured(self) -> dict[str, float]:
        return {**self.rank.components, "peak": float(self.rank.peak)}

    def error(self, part: str) -> float:
        """|predicted − measured| over the larger of the two (0 when both are 0)."""
        p, m = self.predicted[part], self.measured[part]
        return abs(p - m) / max(p, m) if max(p, m) else 0.0

    def disagreements(self, tolerance: float = TOLERANCE) -> list[str]:
        return [part for part in (*COMPONENTS, "peak") if self.error(part) > tolerance]


def compare(run: DryRun, config: Config, cluster: Cluster) -> list[Comparison]:
    """The planner's memory for each rank of `run` (its stage, the job's layout and accumulation), from `config`:
    the job as the user asked for it (the plan predicts 16-mixed as bf16-mixed too; fp8-mixed it refuses)."""
    job = run.job
    cand, spec = Candidate.from_job(job), ModelSpec(job.config.model)  # type: ignore[arg-type]
    cand = _without_offload(cand, job)  # on this CPU offload moves nothing: the dry run measures the job it offloads
    precision = PrecisionBytes(RUN_AS.get(config.train.precision, config.train.precision))
    out = []
    for rank in run.ranks:
        # the micro-steps run (two show any number: the plan's figures differ only between one and more)
        steps = min(job.batch.accum_steps, run.micro_steps)
        predicted, _ = stage_memory(spec, cand, precision, cluster, steps, rank.stage)
        predicted = {part: predicted[part] for part in COMPONENTS}
        out.append(Comparison(rank, {**predicted, "peak": sum(predicted.values())}))
    return out


def dry_run_lines(job: Job, cluster: Cluster) -> list[str]:
    """`trainmesh check --dry-run`'s report for `job`: each rank's memory by component, and where the planner's
    prediction differs from it by more than TOLERANCE."""
    run = dry_run(job)
    seconds = sum(r.seconds for r in run.ranks)
    m = job.config.parallel.pipeline.microbatches
    fewer = sorted({r.pieces for r in run.ranks if job.layout.dims.pp > 1 and r.pieces < m})
    ran = "-".join(str(n) for n in dict.fromkeys([fewer[0], fewer[-1]])) if fewer else ""
    pieces = f", of the {m} pieces the first {ran} a stage (1F1B's warm-up and {STEADY} more: the rest repeat them)"
    pieces = pieces if fewer else ""
    lines = [
        f"  dry run here ({len(run.ranks)} rank(s) of {job.world_size} on fake tensors and a fake process group, "
        f"{run.micro_steps} micro-step(s){pieces}, {seconds:.1f} s):"
    ]
    for comparison in compare(run, job.config, cluster):
        rank, measured = comparison.rank, comparison.measured
        unit, scale = size_unit(measured["peak"])
        parts = ", ".join(f"{part} {measured[part] / scale:.2f}" for part in COMPONENTS)
        who = f"rank {rank.rank}" + (f" (pipeline stage {rank.stage})" if job.layout.dims.pp > 1 else "")
        lines.append(f"    {who}: peak {measured['peak'] / scale:.2f} {unit} = {parts} {unit}")
        off = comparison.disagreements()
        if not off:
            lines.append(f"    the plan agrees within {TOLERANCE:.0%} on every component and the peak")
        for part in off:
            predicted = comparison.predicted[part] / scale
            lines.append(
                f"    the plan differs on {part}: {predicted:.2f} {unit} predicted, {measured[part] / scale:.2f} "
                f"{unit} here ({comparison.error(part):.0%})"
            )
    most = float(run.most_loaded.peak)
    cand = Candidate.from_job(job)
    if cand.kind == "fsdp-offload":
        host = _offloaded(job, cluster, run.most_loaded.stage)
        most -= host
        unit, scale = size_unit(host)
        lines.append(
            f"  CPU offload moves nothing here (host memory is this machine's only memory): measured, and compared, "
            f"is the FSDP job it offloads; on the devices offload takes {host / scale:.2f} {unit} off its peak"
        )
    if most > cluster.usable_memory:
        unit, scale = size_unit(most)
        usable = cluster.usable_memory / scale
        lines.append(
            f"  WARNING: the dry run's peak, {most / scale:.2f} {unit}, is more than the {usable:.2f} {unit} usable "
            f"per {cluster.device} rank{where_from(cluster)}. Fix: see `trainmesh plan` for layouts that fit."
        )
    return lines


def _without_offload(cand: Candidate, job: Job) -> Candidate:
    """The candidate of the FSDP job an offload layout offloads (Candidate.from_job's order: hybrid, then grad-op)."""
    if cand.kind != "fsdp-offload":
        return cand
    fsdp = job.config.parallel.fsdp
    kind = "hsdp" if cand.dp_replicate > 1 else "fsdp" if fsdp.reshard_after_forward else "fsdp-grad-op"
    return dataclasses.replace(cand, kind=kind)


def _offloaded(job: Job, cluster: Cluster, stage: int) -> float:
    """How much less a rank of `stage` holds on its device with CPU offload than the FSDP job it offloads, by the plan
    (the parameters, the optimizer state and, once reduced, the gradients; never the reduced and the accumulating
    gradients both)."""
    cand, spec = Candidate.from_job(job), ModelSpec(job.config.model)  # type: ignore[arg-type]
    precision = PrecisionBytes(RUN_AS.get(job.config.train.precision, job.config.train.precision))
    accum = job.batch.accum_steps
    offload, _ = stage_memory(spec, cand, precision, cluster, accum, stage)
    fsdp, _ = stage_memory(spec, _without_offload(cand, job), precision, cluster, accum, stage)
    return sum(fsdp.values()) - sum(offload.values())
