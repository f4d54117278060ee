"""`trainmesh plan`'s estimate held to its formulas, written out here with the numbers: what DDP's all-reduce hides
behind, interleaved schedules' activations, CPU offload's copies, a middle pipeline stage's buffers, what activation
checkpointing saves, and the order of the table (layouts that do not fit last).

The model is the nano GPT (L = 2 blocks, a = 2 heads, h = 32, V = 64, s = 16 unless said) in 32-true, whose
P = V·h + s·h + L·(12h² + 13h) + 2h = 2048 + 512 + 2·12_704 + 64 = 28_032 parameters."""

from __future__ import annotations

import dataclasses
import math

import pytest

from trainmesh.apps.plan.cluster import PRESETS, Cluster, Cost, Link
from trainmesh.apps.plan.estimate import Estimate
from trainmesh.apps.plan.layouts import Candidate
from trainmesh.apps.plan.memory import PrecisionBytes
from trainmesh.apps.plan.model import ModelSpec
from trainmesh.apps.plan.rank_memory import stage_memory
from trainmesh.apps.plan.schedules import interleaved_forwards, pieces_in_flight
from trainmesh.apps.plan.search import Workload, estimate, plan_layouts, rank
from trainmesh.job.spec import load_config
from trainmesh.recipes.gpt.model import GPTConfig

pytestmark = pytest.mark.timeout(60)

FP32 = PrecisionBytes("32-true")
P = 2048 + 512 + 2 * (12 * 32**2 + 13 * 32) + 2 * 32


def _spec(n_layer: int = 2, n_head: int = 2, n_embd: int = 32, vocab_size: int = 64) -> ModelSpec:
    return ModelSpec(GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size, block_size=16))


def _cluster(**changes: object) -> Cluster:
    """Round figures: 1 GFLOP/s in every dtype, links that cost nothing, no fixed overhead per process."""
    free = Link.uniform(bandwidth=math.inf, latency=0.0)
    base = dataclasses.replace(
        PRESETS["h100"],
        devices_per_node=8,
        peak_flops=dict.fromkeys(("bf16", "tf32", "fp32"), 1e9),
        efficiency=1.0,
        intra=free,
        inter=free,
        overhead=0.0,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_the_nano_parameter_count() -> None:
    assert _spec().n_params == P == 28_032


def test_ddp_hides_its_all_reduce_behind_backward_only() -> None:
    """DDP's buckets are ready only as backward produces them: the forward cannot hide any of the all-reduce. A wider
    model (h = 1024, V = 1024, 8 heads) so that its fp32 gradients fill 5 buckets of 25 MiB (the last never hides)."""
    h, vocab, layers, seq = 1024, 1024, 2, 16
    spec = _spec(n_head=8, n_embd=h, vocab_size=vocab)
    params = vocab * h + seq * h + layers * (12 * h * h + 13 * h) + 2 * h
    assert spec.n_params == params == 26_259_456
    flops_per_token = 72 * layers * h**2 * (1 + seq / (6 * h)) + 6 * h * vocab  # Megatron's count
    compute = 8 * seq * flops_per_token / 1e9  # micro-batch 8 on each of 2 ranks, at 1 GFLOP/s
    backward = compute * 2 / 3  # the cluster's forward_share: 1/3
    bandwidth = 4e6
    all_reduce = 2 * (2 - 1) / 2 * 4 * params / bandwidth  # ring: 2(n−1)/n of the fp32 gradients
    assert all_reduce / 5 < all_reduce - compute < all_reduce - backward  # so that the wrong overlap shows

    cluster = _cluster(devices_per_node=2, intra=Link.uniform(bandwidth, 0.0), overlap=1.0)
    est = estimate(Workload(spec, FP32, 16, False), Candidate("ddp", 1, 1, 2, 1, 0, 8, 1), cluster)
    assert est.time["compute"] == pytest.approx(compute)
    assert est.time["comm"] == pytest.approx(all_reduce - backward)


def test_interleaved_schedules_hold_torchs_warm_up() -> None:
    """torch's Interleaved1F1B: rank r runs (v − 1)·p + 2·(p − 1 − r) forwards of its v stages before its first
    backward and one more, never more than it has (v·m): rank 0 holds Narayanan et al.'s p·(1 + (p − 1)/(p·v))
    micro-batches' activations (arXiv 2104.04473), later ranks fewer (the dry run agrees, test_dryrun.py)."""
    interleaved = Candidate("single", 4, 1, 1, 1, 0, 16, 16, schedule="interleaved_1f1b")  # v = 2
    assert [pieces_in_flight(interleaved, s) for s in range(4)] == [4 * (1 + 3 / 8), 4.5, 3.5, 2.5]
    few = dataclasses.replace(interleaved, micro_batch=4, microbatches=4)
    assert [pieces_in_flight(few, s) for s in range(4)] == [4, 4, 3.5, 2.5]
    # torch's rounds are of m // (m // p) pieces: all 6 when 6 pieces run on 4 ranks (never more than m a stage)
    six = dataclasses.replace(interleaved, micro_batch=6, microbatches=6)
    assert [interleaved_forwards(six, s) for s in range(4)] == [[6, 6], [6, 5], [6, 3], [6, 1]]
    two = dataclasses.replace(interleaved, micro_batch=2, microbatches=2)
    assert [interleaved_forwards(two, s) for s in range(4)] == [[2, 2], [2, 2], [2, 2], [2, 1]]

    # the bytes: 4 blocks on 2 ranks, a piece of one sequence (T = 16 tokens); rank 0 holds blocks 0 and 1 and
    # the token ids and positions; fp32 SDPA saves 4·T·(16h + 4 + a) per block. Rank 0 runs 5 forwards, 3 of its
    # first stage (which holds the ids) and 2 of its second: 2.5 pieces through its blocks, 3 sets of ids
    spec, tokens = _spec(n_layer=4), 16
    cand = Candidate("single", 2, 1, 1, 1, 0, 8, 8, schedule="interleaved_1f1b")
    in_blocks, ids = 2 * 4 * tokens * (16 * 32 + 4 + 2), 8 * (tokens + 16)
    assert (in_blocks, ids) == (66_304, 256)
    memory, _ = stage_memory(spec, cand, FP32, _cluster(), 1, 0)
    assert memory["activations"] == 2.5 * in_blocks + 3 * ids == 166_528


def test_cpu_offload_pays_its_host_copies() -> None:
    """fsdp-offload over 2 ranks, 2 accumulation steps: each micro-step's gather brings the fp32 shard up (2 per
    step) and the reduced gradients go down once: (2·2 + 1) copies of P/2 fp32 elements (every first dimension of
    the nano GPT is even: the shard is exactly half). AdamW steps on the CPU: 32 bytes per element of the shard."""
    host, host_memory = 1e6, 2e6
    cluster = _cluster(devices_per_node=2, host=Cost(host, 0.0), host_bandwidth=host_memory)
    work = Workload(_spec(), FP32, 16, False)  # 16 = 2 ranks × micro-batch 4 × 2 steps
    est = estimate(work, Candidate("fsdp-offload", 1, 1, 1, 2, 0, 4, 1), cluster)
    assert est.time["offload"] == pytest.approx((2 * 2 + 1) * (P / 2) * 4 / host) == pytest.approx(0.28032)
    assert est.time["optimizer"] == pytest.approx(32 * (P / 2) / host_memory)


def test_pipeline_stages_hold_their_schedules_buffers_and_moments() -> None:
    """3 stages of one block, 6 pieces of one sequence (s = 16, h = 32, V = 64, fp32): a piece's residual stream is
    s·h·4 = 2048 bytes. torch keeps a receive buffer per piece and direction: the first stage receives gradients
    (6 buffers), a middle one activations and gradients (12), the last activations (6). Stages without the loss peak
    in a block's backward, s·(4h + h)·4 = 10240 bytes (the MLP's hidden gradient, a matmul input's); the first also
    keeps the outputs of its other pieces in flight (1F1B: 3 − 1). Beside them, the gradient of the block's largest
    weight as backward makes it, 4h·h·4 = 16384 bytes, before it is added to the earlier pieces'. The last peaks in
    the larger of its block's
    backward, beside its piece's output (the logits, s·V·4 bytes, which torch's stage keeps until that backward
    ends), and the loss's, which holds the logits' fp32 gradient twice (nll_loss's and log_softmax's), 2·s·V·4 bytes
    (smaller here: V = 64). All as the dry run measures them."""
    spec, cand = _spec(n_layer=3), Candidate("single", 3, 1, 1, 1, 0, 6, 6)
    stream, block, logits = 16 * 32 * 4, 16 * 5 * 32 * 4 + 4 * 32 * 32 * 4, 16 * 64 * 4
    temporaries = [stage_memory(spec, cand, FP32, _cluster(), 1, stage)[0]["temporaries"] for stage in range(3)]
    assert 2 * logits < block + logits
    assert temporaries == [6 * stream + block + 2 * stream, 12 * stream + block, 6 * stream + block + logits]


def test_activation_checkpointing_keeps_each_blocks_input_only() -> None:
    """Micro-batch 2 (T = 32 tokens), fp32, one stage. A block saves 4·T·(16h + 4 + a) bytes; checkpointed, its input
    alone, 4·T·h, and its backward brings the rest back for a moment (a temporary, at another moment than the loss's
    backward, which holds the logits' fp32 gradient twice but no parameter gradient yet). Outside the blocks:
    4·T·(V + 2h + 2) + 8·(2T + s) + 4."""
    tokens, h, a, vocab = 32, 32, 2, 64
    block, kept = 4 * tokens * (16 * h + 4 + a), 4 * tokens * h
    outside = 4 * tokens * (vocab + 2 * h + 2) + 8 * (2 * tokens + 16) + 4
    logits_grad = 4 * tokens * vocab
    memory = {
        every: stage_memory(_spec(), Candidate("single", 1, 1, 1, 1, every, 2, 1), FP32, _cluster(), 1, 0)[0]
        for every in (0, 1)
    }
    assert memory[0]["activations"] == 2 * block + outside == 149_892
    assert memory[1]["activations"] == 2 * kept + outside == 25_476
    # in a one-micro-step step the gradients do not exist yet at the loss nor at the last block's backward (no DDP
    # buckets): what those moments hold beyond the other parts is less the gradients, here more than all of it
    grads = memory[0]["grads"]
    assert memory[0]["temporaries"] == max(0.0, 2 * logits_grad - grads) == 0.0
    assert memory[1]["temporaries"] == max(0.0, block - kept - grads) == 0.0
    accumulating = stage_memory(_spec(), Candidate("single", 1, 1, 1, 1, 1, 2, 1), FP32, _cluster(), 2, 0)[0]
    assert accumulating["temporaries"] == block - kept  # the first micro-step's gradients are there


def test_layouts_that_do_not_fit_come_last_however_fast() -> None:
    """500 kB per rank: ddp(2), the fastest layout, holds 16 bytes per parameter (P·16 = 448,512) plus its
    activations, and does not fit; it must still come after every layout that does."""
    config = load_config(
        None,
        ["--model.size=nano", "--model.vocab_size=64", "--model.block_size=16", "--train.precision=32-true"],
        "gpt",
    )
    cluster = dataclasses.replace(PRESETS["h100"], devices_per_node=2, overhead=0.0, memory=500_000.0)
    rows = plan_layouts(config, Workload.from_config(config, 2), cluster)
    fits = [e for e in rows if e.fits]
    too_big = [e for e in rows if not e.fits]
    assert fits and too_big and min(e.step_time for e in too_big) < max(e.step_time for e in fits)  # what to sort
    assert rows == fits + too_big
    assert [e.step_time for e in too_big] == sorted(e.step_time for e in too_big)


def _timed(cand: Candidate, seconds: float, fits: bool = True) -> Estimate:
    return Estimate(cand, {"params": 0.0}, 0.0, 0, {"compute": seconds}, fits)


def test_layouts_the_model_cannot_tell_apart_come_simplest_first() -> None:
    """Within the stated error of the fastest (15% for a preset), ddp before fsdp before tensor parallelism; a
    layout more than that slower stays behind, and one that does not fit comes last however fast."""
    ddp, fsdp = Candidate("ddp", 1, 1, 8, 1, 0, 4, 1), Candidate("fsdp-grad-op", 1, 1, 1, 8, 0, 4, 1)
    tp, slow = Candidate("fsdp", 1, 2, 1, 4, 0, 4, 1), Candidate("fsdp", 1, 1, 1, 8, 1, 4, 1)
    huge = Candidate("ddp", 1, 1, 8, 1, 0, 16, 1)
    rows = [_timed(fsdp, 0.998), _timed(tp, 0.95), _timed(ddp, 1.0), _timed(slow, 1.3), _timed(huge, 0.5, False)]
    ranked = rank(rows, PRESETS["h100"].time_error)
    assert PRESETS["h100"].time_error == 0.15
    assert [e.candidate for e in ranked] == [ddp, fsdp, tp, slow, huge]
    assert [e.candidate for e in rank(rows, 0.01)] == [tp, ddp, fsdp, slow, huge]  # sharper: tp is 5% ahead


def test_reducing_every_microstep_keeps_gradients_sharded_for_more_traffic() -> None:
    """fsdp over 2 ranks, 2 accumulation steps, fp32: by default each rank holds the whole gradients (4·P bytes)
    until the last micro-step; reducing every micro-step it holds its half (4·P/2), and pays one more
    reduce-scatter: at 1e6 B/s, 0 latency and nothing hidden, 2 reduce-scatters of 4·P bytes over 2 ranks move
    2 × (1/2)·4·P bytes = 4·P / 1e6 s instead of half that."""
    cluster = _cluster(devices_per_node=2, intra=Link.uniform(bandwidth=1e6, latency=0.0), overlap=0.0)
    work = Workload(_spec(), FP32, 16, False)  # 16 = 2 ranks × micro-batch 4 × 2 steps
    once = estimate(work, Candidate("fsdp", 1, 1, 1, 2, 0, 4, 1), cluster)
    every = estimate(work, Candidate("fsdp", 1, 1, 1, 2, 0, 4, 1, reduce_every_microstep=True), cluster)
    assert once.memory["grads"] == pytest.approx(4 * P) and every.memory["grads"] == pytest.approx(4 * P / 2)
    assert every.time["comm"] - once.time["comm"] == pytest.approx(4 * P / 2 / 1e6 + 2 * P * 4 / cluster.mem_bandwidth)
    assert "+RS" in Candidate("fsdp", 1, 1, 1, 2, 0, 4, 1, reduce_every_microstep=True).name


def test_plan_offers_both_fsdp_gradient_modes_and_check_costs_the_one_configured() -> None:
    from trainmesh.apps.plan.layouts import candidates
    from trainmesh.job.spec import resolve

    base = load_config(None, ["--train.global_batch=16", "--train.global_batch_tokens=0"], "gpt")
    found = {(c.kind, c.reduce_every_microstep) for c in candidates(base, 2, 2, 1, 16, [4]) if c.pp == c.tp == 1}
    assert ("fsdp", True) in found and ("fsdp", False) in found and ("ddp", True) not in found
    overrides = ["--parallel.strategy=fsdp", "--train.micro_batch=4", "--train.global_batch=16"]
    for every in (False, True):
        flag = f"--parallel.fsdp.reduce_every_microstep={str(every).lower()}"
        job = resolve(load_config(None, [*overrides, flag], "gpt"), 2)
        assert Candidate.from_job(job).reduce_every_microstep is every


def test_a_layout_fits_within_the_memory_less_the_margin() -> None:
    """ddp(2) of the nano GPT needs some bytes T per rank: with the device's memory just above T it fits without a
    margin and not with the default 10% one, which also shows in what check and plan print."""
    work = Workload(_spec(), FP32, 8, False)
    cand = Candidate("ddp", 1, 1, 2, 1, 0, 4, 1)
    total = estimate(work, cand, _cluster(devices_per_node=2, memory=1e12)).total_memory
    tight = _cluster(devices_per_node=2, memory=total * 1.05)
    assert tight.memory_margin == 0.10 and tight.usable_memory == pytest.approx(total * 1.05 * 0.9)
    assert not estimate(work, cand, tight).fits
    assert estimate(work, cand, dataclasses.replace(tight, memory_margin=0.0)).fits


def test_plan_lists_the_sharded_gradient_mode_beside_the_default() -> None:
    """Both fsdp gradient modes are rows of their own (a group by layout would keep only the faster one), and a job
    where the mode changes nothing (no accumulation) is costed as the default."""
    from trainmesh.job.spec import resolve

    config = load_config(None, ["--model.size=nano", "--train.micro_batch=2", "--train.global_batch=8"], "gpt")
    cluster = dataclasses.replace(PRESETS["h100"], devices_per_node=2)
    names = {e.candidate.name for e in plan_layouts(config, Workload.from_config(config, 8), cluster)}
    assert {"fsdp(2)", "fsdp(2) +RS"} <= names
    one_step = ["--parallel.strategy=fsdp", "--train.micro_batch=4", "--train.global_batch=8"]
    flag = "--parallel.fsdp.reduce_every_microstep=true"
    assert not Candidate.from_job(resolve(load_config(None, [*one_step, flag], "gpt"), 2)).reduce_every_microstep


@pytest.mark.parametrize("schedule", ["zbv_zero_bubble", "dualpipev"])
def test_a_v_schedule_holds_the_first_and_the_last_stage_on_rank_0(schedule: str) -> None:
    """Rank r of a V holds stages r and 2p − 1 − r: rank 0 has the embeddings, the final norm, the head (the tied
    matrix once) and the loss's logits; rank 1 only blocks. Both of rank 0's stages talk to rank 1, and rank
    p − 1's two stages to each other: each rank sends and receives twice per piece at pp 2 (4 times on a middle
    rank), where a loop's first and last rank do once."""
    spec = _spec(n_layer=4)
    names = [[p.name for p in spec.stage_params(rank, 2, 0)] for rank in (0, 1)]
    assert names[0].count("wte.weight") == 1 and "ln_f.weight" in names[0]
    assert all(name.startswith("blocks.") for name in names[1])
    v = Candidate("single", 2, 1, 1, 1, 0, 4, 4, schedule=schedule)
    memory = [stage_memory(spec, v, FP32, _cluster(), 1, rank)[0] for rank in (0, 1)]
    block = 12 * 32**2 + 13 * 32
    assert [m["params"] for m in memory] == [4 * P, 4 * 2 * block]  # rank 0: the nano's 2 blocks and all the rest
    assert memory[0]["activations"] > memory[1]["activations"]  # the loss's logits on rank 0
    slow = _cluster(intra=Link.uniform(bandwidth=1e6, latency=0.0), inter=Link.uniform(bandwidth=1e6, latency=0.0))
    loop = Candidate("single", 2, 1, 1, 1, 0, 4, 4)
    work = Workload(spec, FP32, 4, False)
    v_comm, loop_comm = (estimate(work, cand, slow).time["comm"] for cand in (v, loop))
    assert v_comm == pytest.approx(2 * loop_comm)
