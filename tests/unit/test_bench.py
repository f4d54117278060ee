"""`trainmesh bench` without launching anything: the batch each mode gives a point, the table math, and every
refusal of bad input (before any folder is written)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import nano_toml, refused_before_writing
from trainmesh.apps.bench.load import BUSY_MARGIN, LOAD_RULES, CpuSample, read_cpu, watch_point
from trainmesh.apps.bench.points import Machine, bench_points, choose_counts, timing_overrides
from trainmesh.apps.bench.report import Measured, Row, add_scaling, markdown_table, measure, write_json, write_markdown
from trainmesh.cli import main
from trainmesh.cli.bench import point_options
from trainmesh.launch import LaunchOptions
from trainmesh.metrics.breakdown import PHASES

pytestmark = pytest.mark.timeout(60)

PHASES_MS = dict.fromkeys(PHASES, 1.0)


def _measured(step_ms: float, throughput: float) -> Measured:
    return Measured(10, step_ms, step_ms, step_ms, throughput, PHASES_MS)


def _row(mode: str, processes: int, measured: Measured | None, exit_code: int | None = 0) -> Row:
    return Row(mode, processes, 8 * processes, 8, 1, 1024, processes, f"runs/b/n{processes}", exit_code, "", measured)


def test_weak_speedup_is_the_throughput_ratio_and_strong_the_step_time_ratio() -> None:
    rows = [
        _row("weak", 1, _measured(100.0, 1000.0)),
        _row("weak", 2, _measured(125.0, 1600.0)),  # weak: each rank's work stays the same, the step time grows
        _row("weak", 4, _measured(150.0, 2800.0)),
        _row("strong", 1, _measured(100.0, 1000.0)),
        _row("strong", 2, _measured(80.0, 1250.0)),
        _row("strong", 4, None, exit_code=1),  # failed: no figures, and no effect on the others
    ]
    add_scaling(rows)
    assert [r.speedup for r in rows] == pytest.approx([1.0, 1.6, 2.8, 1.0, 1.25, None])
    assert [r.ideal for r in rows] == [1.0, 2.0, 4.0, 1.0, 2.0, None]
    assert [r.efficiency for r in rows] == pytest.approx([1.0, 0.8, 0.7, 1.0, 0.625, None])
    table = markdown_table(rows, "tokens")
    assert "| 2 | weak | 16 | 125.0 (125.0–125.0) | 1,600 | 1.60× | 0.80 | 1.0 |" in table
    assert "| 4 | strong | 32 | failed (exit code 1) |" in table
    assert "speedup (weak: tokens/s(n) / tokens/s(1); strong: step ms(1) / step ms(n))" in table
    assert "efficiency (speedup / n)" in table


def test_weak_scaling_under_model_parallelism_is_ideal_at_the_data_parallel_ratio() -> None:
    """4 processes as 2 pipeline stages × 2 replicas double the batch of 1 process, not quadruple it."""
    base, grouped = _row("weak", 1, _measured(100.0, 1000.0)), _row("weak", 4, _measured(110.0, 1800.0))
    grouped.dp_ranks = 2
    strong = [_row("strong", 1, _measured(100.0, 1000.0)), _row("strong", 4, _measured(50.0, 2000.0))]
    strong[1].dp_ranks = 2
    add_scaling([base, grouped, *strong])
    assert (grouped.ideal, grouped.efficiency) == (2.0, pytest.approx(0.9))
    assert strong[1].ideal == 4.0  # the same work on four times the processes


def test_without_a_one_process_point_the_smallest_count_is_the_base() -> None:
    rows = [_row("weak", 2, _measured(100.0, 1000.0)), _row("weak", 4, _measured(100.0, 2000.0))]
    add_scaling(rows)
    assert [(r.speedup, r.ideal, r.efficiency) for r in rows] == [(1.0, 1.0, 1.0), (2.0, 2.0, 1.0)]
    assert "efficiency (speedup / (n/2))" in markdown_table(rows, "samples")


def test_a_failed_base_leaves_its_mode_without_speedups() -> None:
    rows = [_row("weak", 1, None, exit_code=2), _row("weak", 2, _measured(100.0, 1000.0))]
    add_scaling(rows)
    assert [r.speedup for r in rows] == [None, None]


def test_medians_are_taken_over_the_timed_steps_only() -> None:
    records = [{"kind": "val", "step": 0, "val_loss": 5.0}]
    for step, ms in enumerate([900.0, 800.0, 10.0, 30.0, 20.0], start=1):  # two slow warm-up steps
        records.append(
            {"kind": "train", "step": step, "step_time_ms": ms, **{f"time_{p}_ms": ms / len(PHASES) for p in PHASES_MS}}
        )
    m = measure(records, warmup=2, steps=3, units_per_step=400)
    assert (m.steps, m.step_ms, m.throughput) == (3, 20.0, 20_000.0)
    assert m.phases_ms["backward"] == pytest.approx(20 / len(PHASES)) and m.step_ms_p10 < m.step_ms < m.step_ms_p90
    with pytest.raises(ValueError, match=r"timed step\(s\) \[6\]"):
        measure(records, warmup=2, steps=4, units_per_step=400)


def test_weak_keeps_the_batch_per_rank_and_strong_the_global_batch(tmp_path: Path) -> None:
    """Base (1 process): global batch 24 = micro-batch 6 × 4 accumulation steps. Strong at 2 and 3 ranks: 12 and
    8 samples per rank, in the largest micro-batches of at most 6 that divide them."""
    config = str(nano_toml(tmp_path))
    overrides = ["--train.micro_batch=6", "--train.global_batch=24"]
    points = bench_points(config, overrides, "gpt", ("weak", "strong"), [1, 2, 3], 1, timing_overrides(7, 3))
    plans = [
        (p.mode, p.world_size, p.job.batch.global_batch, p.job.batch.micro_batch, p.job.batch.accum_steps)
        for p in points
    ]
    assert plans == [
        ("weak", 1, 24, 6, 4),
        ("weak", 2, 48, 6, 4),
        ("weak", 3, 72, 6, 4),
        ("strong", 1, 24, 6, 4),
        ("strong", 2, 24, 6, 2),
        ("strong", 3, 24, 4, 2),
    ]
    assert points[0].run_name == points[3].run_name == "n1-gb24-mb6"  # one job, run once for both modes
    train, ckpt, run = points[4].job.config.train, points[4].job.config.checkpoint, points[4].job.config.run
    assert (train.max_steps, train.eval_every, run.log_every, ckpt.every, ckpt.final) == (10, 0, 1, 0, False)
    assert not (tmp_path / "runs").exists()


def test_default_counts_are_powers_of_two_up_to_the_machine() -> None:
    cpu = Machine("cpu", 6, 6, 1, "test cpu")
    assert choose_counts(None, "auto", cpu, oversubscribe=False) == [1, 2, 4]
    assert choose_counts(None, "2", cpu, oversubscribe=False) == [1, 2]
    assert choose_counts([3, 5], "auto", cpu, oversubscribe=False) == [3, 5]
    assert choose_counts([8], "auto", cpu, oversubscribe=True) == [8]


def test_on_several_nodes_each_point_has_a_rendezvous_of_its_own(tmp_path: Path) -> None:
    """Every node counts the points alike, so they agree on it; a node that runs ahead meets no earlier point."""
    (point,) = bench_points(str(nano_toml(tmp_path)), [], "gpt", ("weak",), [2], 2, [])
    c10d = LaunchOptions(nproc_per_node="auto", nnodes="2", rdzv_endpoint="10.0.0.1:29400", rdzv_id="job")
    static = LaunchOptions(nnodes="2", node_rank=1, master_addr="10.0.0.1", master_port=29500)
    assert point_options(c10d, point, 3) == LaunchOptions(
        nproc_per_node="2", nnodes="2", rdzv_endpoint="10.0.0.1:29400", rdzv_id="job-3"
    )
    assert (point_options(static, point, 3).master_port, point_options(static, point, 3).nproc_per_node) == (
        29503,
        "2",
    )
    assert point_options(LaunchOptions(), point, 3) == LaunchOptions(nproc_per_node="2")  # one node: a free port


def _refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    return refused_before_writing(tmp_path, capsys, "bench", "gpt", "--config", str(nano_toml(tmp_path)), *flags)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--nprocs", "0,1"], ["--nprocs='0,1': '0' is not a process count", "Fix: e.g. --nprocs 1,2,4"]),
        (["--nprocs", "1,two"], ["'two' is not a process count", "whole numbers of at least 1"]),
        (["--nprocs", "1,2.5"], ["'2.5' is not a process count"]),
        (["--nprocs", "1,4096"], ["4096 process(es) per node is more than this machine runs", "--oversubscribe"]),
        (["--nproc-per-node", "4096"], ["per node is more than this machine runs side by side", "Fix: --nprocs 1"]),
        (["--nproc-per-node", "2", "--nprocs", "1,4"], ["above --nproc-per-node=2", "leave out --nproc-per-node"]),
        (
            ["--mode", "strong", "--nprocs", "1,3", "--oversubscribe"],
            [
                "--mode strong keeps the global batch",
                "4 / 3 = 1.33 samples per rank",
                "(of those given: 1)",
                "--train.global_batch=12",
            ],
        ),
        (["--mode", "fast"], ["--mode='fast' is not a scaling mode", "weak, strong, both", "Fix: e.g. --mode weak"]),
        (["--steps", "0"], ["--steps=0: each point needs at least 1 timed step"]),
        (["--warmup=-1"], ["--warmup=-1: must be 0 or more"]),
        (["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:29400"], ["--nnodes=1:2 is an elastic range"]),
        (["--", "--train.micro_batch=0"], ["train.micro_batch=0 must be >= 1"]),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], said: list[str]
) -> None:
    err = _refused(tmp_path, capsys, *flags)
    for text in said:
        assert text in err


def test_an_existing_run_id_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = str(nano_toml(tmp_path))
    (tmp_path / "runs" / "old").mkdir(parents=True)
    assert main(["bench", "gpt", "--config", config, "--run-id", "old"]) == 2
    assert "runs/old already exists" in capsys.readouterr().err
    assert list((tmp_path / "runs").iterdir()) == [tmp_path / "runs" / "old"]
    assert not list((tmp_path / "runs" / "old").iterdir())


def _samples(*samples: CpuSample) -> Iterator[CpuSample]:
    yield from samples


def _cpu(t: float, load: float, busy_s: float, steal_s: float = 0.0) -> CpuSample:
    """This fake node after `t` seconds: 2 cores, all their time counted (busy, stolen or idle)."""
    return CpuSample(t, load, busy_s, steal_s, 2 * t)


def test_a_point_on_a_quiet_node_is_recorded_without_warnings(tmp_path: Path) -> None:
    fake = _samples(_cpu(0.0, 0.1, 0.0), _cpu(1.0, 0.1, 0.05), _cpu(11.0, 1.2, 18.0, steal_s=0.2))
    code, load = watch_point(lambda: 0, threads=2, cores=2, sampler=lambda: next(fake), window_s=0)
    assert code == 0 and load.warnings == []
    assert (load.load_before, load.load_after) == (0.1, 1.2)
    assert load.busy_cores_before == pytest.approx(0.05) and load.steal == pytest.approx(0.01)

    rows = [_row("weak", 1, _measured(10.0, 100.0)), _row("strong", 1, _measured(10.0, 100.0))]
    for row in rows:
        row.load = load
    write_json(tmp_path / "bench.json", {}, rows)
    point = json.loads((tmp_path / "bench.json").read_text())["points"][0]
    assert point["load"] == {
        "load_before": 0.1,
        "load_after": 1.2,
        "busy_cores_before": pytest.approx(0.05),
        "steal_before": 0.0,
        "steal": pytest.approx(0.01),
        "warnings": [],
    }
    write_markdown(tmp_path / "bench.md", "t", [], rows, "tokens")
    text = (tmp_path / "bench.md").read_text()
    assert "| 1 | weak | 0.10 | 1.20 | 0.1 | 0.0% | 1.0% |" in text and LOAD_RULES in text and "WARNING" not in text


@pytest.mark.parametrize(
    ("before", "after", "said"),
    [
        # Another program keeps a core busy: a 2-process point on 2 cores has none free.
        (_cpu(1.0, 1.0, 1.0 + BUSY_MARGIN + 0.1), _cpu(11.0, 2.0, 20.0), "kept 1.6 core(s) busy just before it"),
        # The load average of the run in the issue: 6.75 on 2 cores.
        (_cpu(1.0, 0.2, 0.0), _cpu(11.0, 6.75, 20.0), "load average was 6.75 after it, on 2 core(s)"),
        # The hypervisor took 10% of the CPU time during the point.
        (_cpu(1.0, 0.2, 0.0), _cpu(11.0, 0.2, 20.0, steal_s=2.0), "the hypervisor stole 10% of the CPU time"),
    ],
)
def test_a_busy_node_makes_the_point_doubtful(before: CpuSample, after: CpuSample, said: str, tmp_path: Path) -> None:
    fake = _samples(_cpu(0.0, before.load, 0.0), before, after)
    _, load = watch_point(lambda: 0, threads=2, cores=2, sampler=lambda: next(fake), window_s=0)
    assert len(load.warnings) == 1 and said in load.warnings[0]
    rows = [_row("weak", 2, _measured(10.0, 100.0))]
    rows[0].load = load
    write_markdown(tmp_path / "bench.md", "t", [], rows, "tokens")
    text = (tmp_path / "bench.md").read_text()
    assert f"- WARNING: 2 process(es), weak: doubtful figures: {load.warnings[0]}" in text


def test_a_point_that_leaves_cores_free_tolerates_other_work() -> None:
    """1 process on 4 cores leaves 3 free: two busy cores elsewhere take none of its own."""
    fake = _samples(_cpu(0.0, 2.0, 0.0), CpuSample(1.0, 2.0, 2.0, 0.0, 4.0), CpuSample(11.0, 3.0, 32.0, 0.0, 44.0))
    _, load = watch_point(lambda: 0, threads=1, cores=4, sampler=lambda: next(fake), window_s=0)
    assert load.busy_cores_before == 2.0 and load.warnings == []


def test_the_node_is_read_from_the_system() -> None:
    first, second = read_cpu(), read_cpu()
    assert second.time >= first.time and first.load >= 0 and 0 <= first.steal_s <= first.busy_s <= first.total_s
