"""`trainmesh plan`'s model: the parameter table against the real GPT and its tensor-parallel and FSDP shards, the
layouts against trainmesh's own resolver, the link and pipeline arithmetic, the calibration fit, and rankings
that a correct model must produce."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from trainmesh.apps.plan.calibrate import SIZES, _cluster, _fit, _fit_compute, _fit_fsdp, _fit_tensor_parallel
from trainmesh.apps.plan.cluster import PRESETS, Link, get_cluster, load_calibration, save_calibration
from trainmesh.apps.plan.layouts import Candidate, candidates
from trainmesh.apps.plan.memory import PrecisionBytes
from trainmesh.apps.plan.model import ModelSpec
from trainmesh.apps.plan.schedules import pieces_in_flight
from trainmesh.apps.plan.search import Workload, estimate, plan_layouts
from trainmesh.core.machine import host_memory
from trainmesh.job.spec import load_config, resolve
from trainmesh.recipes.gpt.model import GPT, GPTConfig

pytestmark = pytest.mark.timeout(60)


def _config(*overrides: str):  # type: ignore[no-untyped-def]
    return load_config(None, ["--model.size=nano", "--model.vocab_size=64", "--model.block_size=16", *overrides], "gpt")


def test_the_parameter_table_is_the_models() -> None:
    cfg = GPTConfig(size="nano", vocab_size=64, block_size=16)
    spec = ModelSpec(cfg)
    model = GPT(cfg)
    assert spec.n_params == sum(p.numel() for p in model.parameters())  # the tied matrix once
    assert {p.name: p.shape for p in spec.params} == {n: tuple(p.shape) for n, p in model.named_parameters()}
    # pipeline: the first stage embeds, the last holds the head's copy of the tied matrix too
    first, last = (spec.stage_params(s, 2) for s in (0, 1))
    assert "wte.weight" in {p.name for p in first} and "wte.weight" in {p.name for p in last}
    assert "ln_f.weight" in {p.name for p in last} and "wpe.weight" not in {p.name for p in last}
    assert sum(spec.blocks_of_stage(s, 2) for s in range(2)) == cfg.n_layer
    assert sum(math.prod(p.shape) for p in first + last) == spec.n_params + math.prod(model.wte.weight.shape)


def test_local_sizes_follow_tensor_parallel_and_fsdp_chunks() -> None:
    spec = ModelSpec(GPTConfig(size="nano", vocab_size=64, block_size=16))
    by_name = {p.name: p for p in spec.params}
    qkv, proj, bias = (
        by_name["blocks.0.attn.qkv.weight"],
        by_name["blocks.0.attn.proj.weight"],
        "blocks.0.attn.proj.bias",
    )
    assert qkv.local_numel(2, 1) == 48 * 32 and proj.local_numel(2, 1) == 32 * 16  # rows / columns cut
    assert by_name[bias].local_numel(2, 1) == 32  # a row-parallel bias stays whole
    # FSDP: torch.chunk's first (largest) chunk of dim 0, after tensor parallelism
    assert by_name["wpe.weight"].local_numel(1, 3) == math.ceil(16 / 3) * 32
    assert qkv.local_numel(2, 4) == 12 * 32
    assert len(torch.chunk(torch.empty(16, 32), 3)[0]) == math.ceil(16 / 3)


def test_every_candidate_launches_and_the_overrides_select_it() -> None:
    config = _config()
    found = list(candidates(config, 8, 4, 2, 16, [4, 2]))
    kinds = {c.kind for c in found}
    assert kinds == {"ddp", "fsdp", "fsdp-grad-op", "fsdp-offload", "hsdp", "single"}
    assert {(c.pp, c.tp) for c in found} >= {(1, 1), (2, 1), (1, 2), (2, 2), (2, 4)}
    for cand in found:
        job = cand.job(config, 16, 8)
        if job is None:  # refused by trainmesh: only where the nano model cannot be cut (2 heads, 2 blocks)
            assert cand.tp > 2 or cand.pp > 2, cand
            continue
        again = load_config(None, [*_overrides(), *cand.overrides(16)], "gpt")
        assert again.parallel == job.config.parallel and again.train == job.config.train
        assert Candidate.from_job(job) == cand, cand.name


def _overrides() -> list[str]:
    return ["--model.size=nano", "--model.vocab_size=64", "--model.block_size=16"]


def test_ring_collectives_and_links() -> None:
    link = Link.uniform(bandwidth=100.0, latency=1.0)
    assert link.time("all_reduce", 800, 8) == pytest.approx(
        2 * 7 / 8 * 8 + 2 * 3
    )  # 2(n−1)/n · bytes/bw + 2·log2 n hops
    assert link.time("all_gather", 800, 8) == pytest.approx(7 / 8 * 8 + 7)  # a ring: n − 1 steps
    assert link.time("p2p", 800, 2) == pytest.approx(8 + 1)
    assert link.time("all_reduce", 800, 1) == 0.0
    h100 = get_cluster("h100", nodes=4, devices_per_node=None)
    assert h100.world_size == 32
    assert h100.link(8, 1) is h100.intra and h100.link(4, 2) is h100.intra
    # a group of 6 on 8-GPU nodes straddles two nodes for some of its copies: between nodes, at one NIC
    assert h100.link(6, 1).costs["all_reduce"].bandwidth == h100.inter.costs["all_reduce"].bandwidth
    # across nodes, a group with k ranks on each node drives k NICs (up to NVLink's bandwidth); a send uses one
    nic, nvlink = h100.inter.costs["all_reduce"].bandwidth, h100.intra.costs["all_reduce"].bandwidth
    assert h100.link(2, 8).costs["all_reduce"].bandwidth == nic  # one rank per node
    assert h100.link(8, 4).costs["all_reduce"].bandwidth == 2 * nic  # two per node
    assert h100.link(32, 1).costs["all_reduce"].bandwidth == min(8 * nic, nvlink)
    assert h100.link(32, 1).costs["p2p"].bandwidth == h100.inter.costs["p2p"].bandwidth
    assert link.time("all_gather", 800, 8, messages=4) == pytest.approx(7 / 8 * 8 + 4 * 7)  # latency per message


def test_pipeline_pieces_in_flight_per_schedule() -> None:
    one_f_one_b = Candidate("single", 4, 1, 1, 1, 0, 8, 8)
    assert [pieces_in_flight(one_f_one_b, s) for s in range(4)] == [4, 3, 2, 1]
    gpipe = Candidate("single", 4, 1, 1, 1, 0, 8, 8, schedule="gpipe")
    assert [pieces_in_flight(gpipe, s) for s in range(4)] == [8] * 4


def test_bubble_is_p_minus_one_slots_of_m_plus_p_minus_one() -> None:
    work = Workload.from_config(_config("--train.precision=32-true"), 8)
    free = Link.uniform(bandwidth=math.inf, latency=0.0)  # communication free: the bubble alone
    cluster = dataclasses.replace(get_cluster("h100", nodes=1, devices_per_node=2), intra=free, inter=free)
    est = estimate(work, Candidate("single", 2, 1, 1, 1, 0, 8, 4), cluster)
    assert est.time["bubble"] / (est.time["compute"] + est.time["bubble"]) == pytest.approx(1 / 5, rel=0.05)


@pytest.mark.parametrize(
    ("kind", "share", "hops"),
    [("all_reduce", 1, 2), ("all_gather", 1 / 2, 1), ("reduce_scatter", 1 / 2, 1), ("p2p", 1, 1)],
)
def test_calibration_fit_recovers_every_collectives_latency_and_bandwidth(kind: str, share: float, hops: int) -> None:
    """Timed between 2 ranks: an all-reduce moves 2(n−1)/n = 1 of its buffer per rank in 2·log2 n = 2 latency steps;
    an all-gather or reduce-scatter moves (n−1)/n = 1/2 of it in n − 1 = 1 step; a send all of it in 1."""
    bandwidth, latency = 2e9, 50e-6
    seconds = [hops * latency + share * size / bandwidth for size in SIZES]
    fitted = _fit(kind, seconds)
    assert fitted.bandwidth == pytest.approx(bandwidth, rel=1e-6)
    assert fitted.latency == pytest.approx(latency, rel=1e-6)


def test_calibrated_figures_are_the_measurements_fitted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory bandwidth is AdamW's and clipping's 32 bytes per parameter over the optimizer step's time; the
    FLOP rate and fixed cost come from the two micro-batches, t = fixed + FLOPs / rate."""
    config = _config("--train.micro_batch=8", "--train.precision=32-true")
    params, flops_per_sequence = 28_032, 172_032 * 16  # the nano GPT: P, and Megatron's FLOPs per token × s
    rate, fixed = 2e10, 0.004
    compute = {
        "forward_backward_s": {b: fixed + flops_per_sequence * b / rate for b in (8, 2)},
        "forward_share": 0.3,
        "optimizer_s": 0.002,
        "rss_before_model": 3e8,
    }
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    links = Link.uniform(1e9, 1e-5)
    cluster = _cluster(config, "cpu", compute, links)
    assert cluster.mem_bandwidth == pytest.approx(32 * params / 0.002)
    assert cluster.peak_flops["fp32"] == pytest.approx(rate) and cluster.step_overhead == pytest.approx(fixed)
    assert (cluster.forward_share, cluster.overhead, cluster.devices_per_node) == (0.3, 3e8, 4)
    assert cluster.memory == host_memory() / 4 and cluster.intra == cluster.inter == links


def test_calibration_files_read_back(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "cal.json"
    save_calibration(PRESETS["a100"], path)
    assert load_calibration(path) == PRESETS["a100"]
    path.write_text("{not json")
    with pytest.raises(ValueError, match="trainmesh plan --calibrate"):
        load_calibration(path)
    with pytest.raises(ValueError, match="does not exist"):
        load_calibration(tmp_path / "none.json")


def test_a_7b_model_needs_sharding_on_h100s() -> None:
    """16 bytes per parameter: 7B under DDP is 112 GB, over an 80 GB H100; FSDP over 8 fits."""
    config = load_config(
        None,
        [
            *("--model.size=gpt2", "--model.n_layer=32", "--model.n_head=32", "--model.n_embd=4096"),
            *("--model.vocab_size=32000", "--model.block_size=4096", "--train.precision=bf16-mixed"),
        ],
        "gpt",
    )
    work = Workload.from_config(config, 64)
    assert 6.5e9 < work.spec.n_params < 7e9
    h100 = get_cluster("h100", nodes=1, devices_per_node=8)
    rows = {e.candidate.name: e for e in plan_layouts(config, work, h100)}
    assert not rows["ddp(8)"].fits and rows["ddp(8)"].memory["optimizer"] > 50e9
    assert rows["fsdp(8) +AC"].fits
    assert rows["fsdp(8) +AC"].memory["params"] == pytest.approx(4 * work.spec.n_params / 8, rel=0.01)
    # pipeline × FSDP: the schedule reduce-scatters at its end, every micro-step, so gradients are sharded between
    # micro-steps; within it torch's PipelineStage keeps them whole and regathers units for each piece's backward
    # (temporaries). CPU offload keeps gradients on the device while they accumulate
    pp_fsdp = estimate(work, Candidate("fsdp", 2, 1, 1, 4, 1, 2, 2), get_cluster("h100", 1, 8))
    shards = pp_fsdp.memory["params"]  # fp32, a quarter of the stage's
    assert pp_fsdp.memory["grads"] == pytest.approx(shards, rel=0.01) and pp_fsdp.memory["gathered"] == 0
    assert pp_fsdp.memory["temporaries"] > 3 * shards + 2 * 2 * 32000 * 4096  # the whole fp32 gradients; the
    # embedding unit twice in bf16 as it is copied out of its all-gather buffer
    offload = estimate(Workload.from_config(config, 128), Candidate("fsdp-offload", 1, 1, 1, 8, 1, 2, 1), h100)
    assert offload.memory["grads"] == pytest.approx(4 * work.spec.n_params, rel=0.01) and offload.host > 0
    # FSDP's root unit (embeddings and head) is gathered, with its gradients, through forward and backward
    root = sum(math.prod(p.shape) for p in work.spec.params if p.block is None)
    assert rows["fsdp(8) +AC"].memory["temporaries"] > root * (2 + 4)


def test_precision_sizes_and_bad_input() -> None:
    assert (
        PrecisionBytes("bf16-true").weight,
        PrecisionBytes("bf16-mixed").weight,
        PrecisionBytes("bf16-mixed").gather,
    ) == (2, 4, 2)
    assert PrecisionBytes("32-true").compute_dtype(tf32=True) == "tf32"
    with pytest.raises(ValueError, match="--cluster='tpu'"):
        get_cluster("tpu", 1, None)
    with pytest.raises(ValueError, match="--nodes=0"):
        get_cluster("h100", 0, None)
    with pytest.raises(ValueError, match="not supported"):
        Workload.from_config(load_config(None, [], "resnet"), 8)


def test_calibration_recovers_the_compute_rate_and_the_tensor_parallel_share() -> None:
    """What calibrate fits from its timings is what the estimate then reproduces: the FLOP rate and fixed cost per
    step from two micro-batches, and the share tensor parallelism leaves undivided from one tp=2 timing."""
    config = _config("--train.micro_batch=8")
    spec = ModelSpec(config.model)  # type: ignore[arg-type]
    rate, fixed = 2e10, 0.004
    seconds = {b: fixed + spec.train_flops_per_token() * spec.seq * b / rate for b in (8, 2)}
    assert _fit_compute(spec, seconds) == pytest.approx((rate, fixed))
    assert _fit_compute(spec, {8: seconds[8]}) == pytest.approx(
        (spec.train_flops_per_token() * spec.seq * 8 / seconds[8], 0)
    )
    cpu = dataclasses.replace(
        PRESETS["a100"],
        device="cpu",
        peak_flops=dict.fromkeys(("bf16", "tf32", "fp32"), rate),
        efficiency=1.0,
        step_overhead=fixed,
        devices_per_node=2,
        busy_slowdown=1.3,
        tp_unsplit=0.35,
    )
    work = Workload.from_config(config, 8)
    measured = estimate(work, Candidate("single", 1, 2, 1, 1, 0, 8, 1), cpu)
    tp_seconds = measured.time["compute"] + measured.time["comm"]
    assert _fit_tensor_parallel(config, dataclasses.replace(cpu, tp_unsplit=0.0), tp_seconds) == pytest.approx(0.35)
    cpu = dataclasses.replace(cpu, fsdp_unit_overhead=0.002)
    sharded = estimate(Workload.from_config(config, 16), Candidate("fsdp", 1, 1, 1, 2, 0, 8, 1), cpu)
    fsdp_seconds = sharded.time["compute"] + sharded.time["comm"]
    assert _fit_fsdp(config, dataclasses.replace(cpu, fsdp_unit_overhead=0.0), fsdp_seconds) == pytest.approx(0.002)
    # a busy node slows every multi-process layout's compute and optimizer, not one process alone
    alone = estimate(work, Candidate("single", 1, 1, 1, 1, 0, 8, 1), cpu)
    ddp = estimate(Workload.from_config(config, 16), Candidate("ddp", 1, 1, 2, 1, 0, 8, 1), cpu)
    assert ddp.time["compute"] == pytest.approx(1.3 * alone.time["compute"])
    assert ddp.time["optimizer"] == pytest.approx(1.3 * alone.time["optimizer"])


def test_fsdp_alone_on_one_device_is_planned_as_sharded_over_it() -> None:
    """One process: FSDP wraps over its one rank (CPU offload moves the state to host memory), unlike fsdp beside
    tensor-parallel ranks with one replica, which wraps nothing."""
    fsdp = ["--parallel.strategy=fsdp"]
    alone = resolve(load_config(None, [*fsdp, "--parallel.fsdp.cpu_offload=true"], "gpt"), 1)
    beside = resolve(load_config(None, [*fsdp, "--parallel.tp=2"], "gpt"), 2)
    assert Candidate.from_job(alone).kind == "fsdp-offload"
    assert Candidate.from_job(beside).kind == "single"
