"""Pipeline schedules as the planner sees them: which rank holds the last stage and its loss, the micro-batch pieces a
stage holds at once under each of torch's schedules, and the receive buffers a stage keeps all through its schedule
(both found with the dry run, dryrun.py).

Details: docs/internals.md#appsplanschedulespy
"""

from __future__ import annotations

from trainmesh.apps.plan.layouts import Candidate
from trainmesh.apps.plan.model import ModelSpec
from trainmesh.strategies import SCHEDULES


def loss_rank(cand: Candidate) -> int:
    """The pipeline rank that holds the last stage (the head and the loss): pp − 1, or 0 under a V schedule (rank r
    holds stages r and 2·pp − 1 − r)."""
    return 0 if SCHEDULES[cand.schedule][2] == "v" else cand.pp - 1


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


def schedule_memory(spec: ModelSpec, cand: Candidate, stage: int, stream: float) -> float:
    """What a pipeline stage holds all through its schedule, besides the parts (found with the dry run): torch's
    receive buffers, one per piece and direction for each of the rank's stages (two or more under interleaved and V
    schedules), kept from the first step on; on the first stage, the outputs of its other pieces in flight (sent on
    as they are)."""
    per_rank = SCHEDULES[cand.schedule][1]
    first = stage == 0  # this rank holds the pipeline's first stage (no forward input to receive) and its last
    last = stage == loss_rank(cand)  # (no gradient to receive)
    tokens = cand.micro_batch // cand.microbatches * spec.seq
    sent = tokens * spec.n_embd * stream  # a piece's residual stream
    out = cand.microbatches * sent * (2 * per_rank - first - last)
    if first:
        out += sent * (pieces_in_flight(cand, stage) - 1)
    return out
