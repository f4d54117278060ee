"""The pipeline schedules `parallel.pipeline.schedule` names, and the conditions torch sets on them: checked before
launch without importing the pipelining machinery (strategies/pipeline.py runs them)."""

from __future__ import annotations

from trainmesh.config.schema import PIPELINE_SCHEDULES, PipelineConfig

# our name: (torch's schedule name, stages per rank, placement of stages on ranks)
SCHEDULES: dict[str, tuple[str, int, str]] = {
    "gpipe": ("GPipe", 1, "loop"),
    "1f1b": ("1F1B", 1, "loop"),
    "interleaved_1f1b": ("Interleaved1F1B", 2, "loop"),
    "looped_bfs": ("LoopedBFS", 2, "loop"),
    "interleaved_zero_bubble": ("InterleavedZeroBubble", 2, "loop"),
    "zbv_zero_bubble": ("ZBVZeroBubble", 2, "v"),
    "dualpipev": ("DualPipeV", 2, "v"),
}
assert tuple(SCHEDULES) == PIPELINE_SCHEDULES, "parallel.pipeline.schedule's choices are the schedules above"


def schedule_problem(options: PipelineConfig, pp: int) -> str | None:
    """What is wrong with running `options` on `pp` pipeline ranks (torch's own conditions), or None."""
    m, stages = options.microbatches, pp * SCHEDULES[options.schedule][1]
    given = f"parallel.pipeline.schedule={options.schedule!r} with parallel.pipeline.microbatches={m}"
    if options.schedule in ("1f1b", "dualpipev") and m < stages:
        return f"{given}: it needs a micro-batch per stage ({stages}). Fix: --parallel.pipeline.microbatches={stages}."
    rounds = max(1, m // pp)
    if options.schedule in ("interleaved_1f1b", "interleaved_zero_bubble") and m % rounds:
        fits = rounds * pp
        return (
            f"{given} on parallel.pp={pp}: it runs micro-batches in rounds of {pp}, so the count must be a "
            f"multiple of {rounds} (m // pp). Fix: --parallel.pipeline.microbatches={fits}."
        )
    return None


def shared_across_v_message(schedule: str, names: list[str]) -> str:
    return (
        f"parallel.pipeline.schedule={schedule!r} puts the first and the last stage on one rank, and the "
        f"weight they share ({', '.join(names)}) cannot be shared by two stages under ddp or fsdp replicas, "
        "tensor parallelism or parallel.meta_init. Fix: a schedule with the stages in a loop (1f1b, "
        "interleaved_1f1b, looped_bfs, interleaved_zero_bubble)."
    )
