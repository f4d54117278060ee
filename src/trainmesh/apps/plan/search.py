"""Every layout of a job on a cluster, estimated and sorted: what `trainmesh plan` prints. Each runs at the largest
micro-batch that fits; a layout that fits none is kept, flagged.

Details: docs/internals.md#appsplansearchpy
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from trainmesh.apps.plan.cluster import Cluster
from trainmesh.apps.plan.estimate import Estimate, estimate_layout
from trainmesh.apps.plan.layouts import Candidate, candidates
from trainmesh.apps.plan.memory import PrecisionBytes
from trainmesh.apps.plan.model import ModelSpec
from trainmesh.config import Config
from trainmesh.recipes.gpt.model import GPTConfig
from trainmesh.strategies import SCHEDULES

MICRO_BATCHES = [2**k for k in range(10, -1, -1)]


@dataclass(frozen=True)
class Workload:
    """What is planned: the model, its precision and the global batch in sequences."""

    spec: ModelSpec
    precision: PrecisionBytes
    global_batch: int
    tf32: bool

    @classmethod
    def from_config(cls, config: Config, global_batch: int) -> Workload:
        model = config.model
        if not isinstance(model, GPTConfig):
            raise ValueError(
                f"trainmesh plan models transformers: run.recipe={config.run.recipe!r} is not supported. "
                "Fix: plan the gpt recipe (its shape flags: --model.size, --model.n_layer, ...)."
            )
        return cls(ModelSpec(model), PrecisionBytes(config.train.precision), global_batch, config.train.tf32)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.spec.seq


def estimate(work: Workload, cand: Candidate, cluster: Cluster) -> Estimate:
    """Memory and step time of `cand` running `work` on `cluster`."""
    accum = work.global_batch // (cand.dp * cand.micro_batch)
    return estimate_layout(work.spec, cand, work.precision, cluster, accum, work.tf32)


def refused_by_shape(spec: ModelSpec, cand: Candidate) -> bool:
    """What `resolve` refuses for this model's shape (recipes/gpt/parallel.py), known before estimating: heads or
    vocabulary that do not split over the tensor-parallel degree, more pipeline stages than blocks. Estimating such
    layouts first would fail (activations.py refuses the same tp) or take minutes (thousands of empty stages)."""
    tp_splits = spec.n_head % cand.tp == 0 and spec.vocab % cand.tp == 0
    return not tp_splits or cand.pp * SCHEDULES[cand.schedule][1] > spec.n_layer


def plan_layouts(config: Config, work: Workload, cluster: Cluster) -> list[Estimate]:
    """The fastest micro-batch that fits of every layout trainmesh accepts (the smallest where none fits), fastest
    first; those that fit before the others. Pipelines run the config's schedule."""
    groups: dict[tuple[object, ...], list[Candidate]] = defaultdict(list)
    micro = sorted({*MICRO_BATCHES, config.train.micro_batch}, reverse=True)
    schedule = config.parallel.pipeline.schedule
    for cand in candidates(
        config, cluster.world_size, cluster.devices_per_node, cluster.nodes, work.global_batch, micro, schedule
    ):
        if refused_by_shape(work.spec, cand):
            continue
        key = (cand.kind, cand.pp, cand.tp, cand.dp_replicate, cand.dp_shard, cand.checkpoint_every)
        groups[(*key, cand.reduce_every_microstep)].append(cand)
    chosen: list[Estimate] = []
    for group in groups.values():
        estimates = [estimate(work, cand, cluster) for cand in group]  # largest micro-batch first
        fitting = [e for e in estimates if e.fits]
        best = min(fitting, key=lambda e: e.step_time) if fitting else estimates[-1]
        if best.candidate.job(config, work.global_batch, cluster.world_size) is not None:
            chosen.append(best)
    return rank(chosen, cluster.time_error)


def simplicity(cand: Candidate) -> tuple[int, ...]:
    """Fewer moving parts first: ddp (or one device), then the fsdp kinds, offload; tensor or pipeline parallelism
    after data parallelism alone; activation checkpointing and per-micro-step reduce-scatters last."""
    kind = {"single": 0, "ddp": 0, "fsdp": 1, "fsdp-grad-op": 1, "hsdp": 1, "fsdp-offload": 2}[cand.kind]
    return ((cand.tp > 1) + (cand.pp > 1), kind, int(cand.checkpoint_every > 0), int(cand.reduce_every_microstep))


def rank(estimates: list[Estimate], error: float) -> list[Estimate]:
    """Those that fit first. Among them, repeatedly: the fastest left and every layout within `error` of its time
    (which the model cannot tell apart), simpler first; those that do not fit after, fastest first."""
    left = sorted((e for e in estimates if e.fits), key=lambda e: e.step_time)
    ranked: list[Estimate] = []
    while left:
        close = [e for e in left if e.step_time <= left[0].step_time * (1 + error)]
        ranked += sorted(close, key=lambda e: (simplicity(e.candidate), e.step_time))
        left = left[len(close) :]
    return ranked + sorted((e for e in estimates if not e.fits), key=lambda e: e.step_time)


def mfu(work: Workload, est: Estimate, cluster: Cluster) -> float:
    """Model FLOPs (Megatron's count, no recomputation) per second over the cluster's peak for the precision."""
    peak = cluster.peak_flops[work.precision.compute_dtype(work.tf32 and cluster.device == "cuda")]
    return work.spec.train_flops_per_token() * work.tokens_per_step / est.step_time / (cluster.world_size * peak)
