"""The layouts `trainmesh plan` compares: every way to lay a job over a cluster's ranks that trainmesh accepts, each
checked by the same `resolve` that `trainmesh run` uses.

Details: docs/internals.md#appsplanlayoutspy
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

from trainmesh.config import Config, ConfigError
from trainmesh.job.spec import Job, resolve

KINDS = ("ddp", "fsdp", "fsdp-grad-op", "hsdp", "fsdp-offload", "single")
"""Data parallelism: ddp; fsdp full shard (ZeRO-3); fsdp without resharding after forward (ZeRO-2's
traffic); hybrid (shard inside a node, replicate across); fsdp with CPU offload; one replica."""


@dataclass(frozen=True)
class Candidate:
    kind: str
    pp: int
    tp: int
    dp_replicate: int
    dp_shard: int
    checkpoint_every: int
    micro_batch: int
    microbatches: int
    """Pipeline pieces per micro-batch (1 without a pipeline)."""
    schedule: str = "1f1b"
    reduce_every_microstep: bool = False
    """fsdp with accumulation: reduce-scatter every micro-step (gradients stay sharded; more communication)."""

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def name(self) -> str:
        """E.g. 'fsdp(8)', 'hsdp(2×4)·tp(2)', 'ddp(4)·pp(2) +AC'."""
        if self.kind == "hsdp":
            data = f"hsdp({self.dp_replicate}×{self.dp_shard})"
        else:
            data = f"{self.kind}({self.dp})" if self.kind != "single" else "single"
        model = [f"{d}({n})" for d, n in (("tp", self.tp), ("pp", self.pp)) if n > 1]
        parts = model if self.kind == "single" and model else [data, *model]
        marks = (" +AC" if self.checkpoint_every else "") + (" +RS" if self.reduce_every_microstep else "")
        return "·".join(parts) + marks

    @property
    def strategy(self) -> str:
        return {"ddp": "ddp", "single": "single"}.get(self.kind, "fsdp")

    def overrides(self, global_batch: int) -> list[str]:
        """The command-line overrides that select this layout in `trainmesh run`."""
        out = [
            f"--parallel.strategy={self.strategy}",
            f"--parallel.pp={self.pp}",
            f"--parallel.tp={self.tp}",
            f"--parallel.dp_replicate={self.dp_replicate}",
            f"--parallel.dp_shard={self.dp_shard}",
            f"--parallel.activation_checkpointing={self.checkpoint_every}",
            f"--train.micro_batch={self.micro_batch}",
            f"--train.global_batch={global_batch}",
            "--train.global_batch_tokens=0",
        ]
        if self.strategy == "fsdp":
            out += [
                f"--parallel.fsdp.reshard_after_forward={str(self.kind != 'fsdp-grad-op').lower()}",
                f"--parallel.fsdp.cpu_offload={str(self.kind == 'fsdp-offload').lower()}",
                f"--parallel.fsdp.reduce_every_microstep={str(self.reduce_every_microstep).lower()}",
            ]
        if self.pp > 1:
            out += [
                f"--parallel.pipeline.schedule={self.schedule}",
                f"--parallel.pipeline.microbatches={self.microbatches}",
            ]
        return out

    @classmethod
    def from_job(cls, job: Job) -> Candidate:
        """The candidate a resolved job runs (hybrid sharding's grad-op variant is planned as hybrid)."""
        strategy, dims = job.layout
        par = job.config.parallel
        kind = {"ddp": "ddp", "single": "single", "dp": "single"}.get(strategy, "fsdp")
        if dims.dp_size == 1 and dims.world_size > 1:  # fsdp over one data-parallel rank beside tensor or pipeline
            kind = "single"  # ranks wraps nothing (FSDPStrategy.wrap); alone, it shards over its one rank
        if kind == "fsdp":
            if par.fsdp.cpu_offload:
                kind = "fsdp-offload"
            elif dims.dp_replicate > 1:
                kind = "hsdp"
            elif not par.fsdp.reshard_after_forward:
                kind = "fsdp-grad-op"
        replicate, shard = (dims.dp_size, 1) if kind == "ddp" else (dims.dp_replicate, dims.dp_shard)
        return cls(
            kind,
            dims.pp,
            dims.tp,
            replicate,
            shard,
            par.activation_checkpointing,
            job.batch.micro_batch,
            par.pipeline.microbatches if dims.pp > 1 else 1,
            par.pipeline.schedule,
            job.gradient_mode_matters and bool(par.fsdp.reduce_every_microstep),  # auto, unresolved: false, as run
        )

    def config(self, base: Config, global_batch: int) -> Config:
        """`base` with this layout and batch (what `overrides` gives on the command line)."""
        par = base.parallel
        parallel = dataclasses.replace(
            par,
            strategy=self.strategy,
            pp=self.pp,
            tp=self.tp,
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard,
            activation_checkpointing=self.checkpoint_every,
            fsdp=dataclasses.replace(
                par.fsdp,
                reshard_after_forward=self.kind != "fsdp-grad-op",
                cpu_offload=self.kind == "fsdp-offload",
                reduce_every_microstep=(
                    self.reduce_every_microstep if self.strategy == "fsdp" else par.fsdp.reduce_every_microstep
                ),
            ),
        )
        if self.pp > 1:
            pipeline = dataclasses.replace(par.pipeline, schedule=self.schedule, microbatches=self.microbatches)
            parallel = dataclasses.replace(parallel, pipeline=pipeline)
        train = dataclasses.replace(
            base.train, micro_batch=self.micro_batch, global_batch=global_batch, global_batch_tokens=0
        )
        return dataclasses.replace(base, parallel=parallel, train=train)

    def job(self, base: Config, global_batch: int, world_size: int) -> Job | None:
        """The resolved job, or None when trainmesh refuses this layout for this model and batch."""
        try:
            return resolve(self.config(base, global_batch), world_size)
        except ConfigError:
            return None


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending (in O(√n): a cluster may have thousands of ranks)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _pieces(micro_batch: int, pp: int) -> int:
    """Pipeline pieces per micro-batch: the most up to 4 per stage that divide it, at least one per stage
    (1F1B needs it); 0 when none does."""
    fits = [m for m in divisors(micro_batch) if pp <= m <= 4 * pp]
    return max(fits) if fits else 0


def data_parallel_kinds(dp: int, tp: int, pp: int, devices_per_node: int, nodes: int) -> Iterator[tuple[str, int, int]]:
    """(kind, dp_replicate, dp_shard) for `dp` data-parallel ranks."""
    if dp == 1:
        yield "single", 1, 1
        return
    if tp == 1:
        yield "ddp", dp, 1
    yield "fsdp", 1, dp
    yield "fsdp-grad-op", 1, dp
    if tp == 1 and pp == 1:
        yield "fsdp-offload", 1, dp
    per_node = (
        devices_per_node // tp
    )  # the shard group's ranks are tp apart (mesh order pp, dp_replicate, dp_shard, tp)
    if nodes > 1 and 1 < per_node < dp and dp % per_node == 0:  # shard inside a node, replicate across nodes
        yield "hsdp", dp // per_node, per_node


def candidates(
    base: Config,
    world_size: int,
    devices_per_node: int,
    nodes: int,
    global_batch: int,
    micro_batches: list[int],
    schedule: str = "1f1b",
) -> Iterator[Candidate]:
    """Every layout of `world_size` ranks for the micro-batch sizes given (largest first), unresolved; pipelines
    with `schedule`."""
    for tp in (t for t in divisors(devices_per_node) if world_size % t == 0):
        for pp in divisors(world_size // tp):
            dp = world_size // (tp * pp)
            if global_batch % dp:
                continue
            for kind, replicate, shard in data_parallel_kinds(dp, tp, pp, devices_per_node, nodes):
                for every in (0, 1):
                    for micro in micro_batches:
                        if (global_batch // dp) % micro:
                            continue
                        pieces = _pieces(micro, pp) if pp > 1 else 1
                        if not pieces:
                            continue
                        yield Candidate(kind, pp, tp, replicate, shard, every, micro, pieces, schedule)
                        accumulates = global_batch // dp // micro > 1
                        if accumulates and pp == 1 and kind not in ("ddp", "single"):  # gradients kept sharded
                            yield Candidate(kind, pp, tp, replicate, shard, every, micro, pieces, schedule, True)
