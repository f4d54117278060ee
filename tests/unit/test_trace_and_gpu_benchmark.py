"""The step breakdown of a profiler trace (trainmesh.metrics.trace) on a hand-made trace, and a whole run of
benchmarks/gpu_gpt2.py on the CPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from trainmesh.metrics import trace

GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off"
FLASH = (
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, "
    "cutlass::bfloat16_t>, false, true, false, false, true, true, false, false>(Flash_fwd_params)"
)
BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_gpt2.py"


# Kernel names as they appear in H100 traces of GPT-2 training (torch 2.11, CUDA 13), and their category.
KERNELS = {
    GEMM: "matmul",
    "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT": "matmul",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>": "matmul",
    # flash attention is built on cutlass: attention must win over the matmul rule
    FLASH: "attention",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64>>": "attention",
    "fmha_cutlassF_bf16_aligned_64x128_rf_sm80": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_kernel0_0": "attention",
    "void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*, void const*, void*)": "attention",
    "void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*, unsigned int)": "attention",
    # Inductor names fused kernels after the ops they fuse: still Triton, not attention
    "triton_poi_fused__scaled_dot_product_flash_attention_view_3": "triton",
    "triton_per_fused__to_copy_add_native_layer_norm_0": "triton",
    "triton_tem_fused_addmm_7": "matmul",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4>>": "optimizer",
    "void at::native::fused_adam_kernel": "optimizer",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>": "other",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>": "other",
}


@pytest.mark.parametrize(("name", "category"), KERNELS.items())
def test_kernel_categories(name: str, category: str) -> None:
    assert trace.kernel_category(name) == category


def _x(cat: str, name: str, ts: float, dur: float, **extra: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1, **extra}


def _synthetic_trace() -> dict[str, Any]:
    """Two 10 ms steps. Per step: phases data 1, forward_backward 6, optimizer 2, log 0.5 ms; GPU work
    gemm 3 + nvjet 1 (matmul 4), flash 1.5 (overlapping the gemm by 0.5), Triton 0.5, Adam 0.75,
    elementwise 0.25 (other), one 0.2 ms copy; the GPU is busy 7.7 ms of each 10 ms step."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}},  # metadata: no dur
        {"ph": "i", "cat": "kernel", "name": "sm90_gemm_instant", "ts": 5, "s": "t"},  # instant: no dur
        {"ph": "X", "cat": "kernel", "name": "sm90_gemm_without_duration", "ts": 5},
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 1, "ts": 10},  # flow arrows
    ]
    for step in range(2):
        t = 10_000.0 * step
        events += [
            _x("user_annotation", f"ProfilerStep#{step + 3}", t, 10_000),
            _x("user_annotation", "trainmesh.data", t, 1_000),
            _x("user_annotation", "trainmesh.forward_backward", t + 1_000, 6_000),
            _x("user_annotation", "trainmesh.optimizer", t + 7_000, 2_000),
            _x("user_annotation", "trainmesh.log", t + 9_000, 500),
            _x("gpu_user_annotation", "trainmesh.forward_backward", t + 1_500, 6_500),  # not a CPU phase
            _x("cpu_op", "aten::mm", t + 1_100, 50),
            _x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", t + 1_000, 200),
            _x("kernel", GEMM, t + 1_200, 3_000),
            _x("kernel", "triton_poi_fused__scaled_dot_product_flash_attention_view_3", t + 5_200, 500),
            _x("kernel", "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT", t + 5_700, 1_000),
            _x("kernel", FLASH, t + 3_700, 1_500, tid=7),  # another stream, overlaps the gemm
            _x("kernel", "void at::native::vectorized_elementwise_kernel<4>", t + 6_700, 250),
            _x("kernel", "void at::native::fused_adam_kernel", t + 7_200, 750),
        ]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def test_step_breakdown_of_a_trace() -> None:
    b = trace.step_breakdown(_synthetic_trace())
    assert b["steps"] == 2
    assert b["step_ms"] == pytest.approx(10.0)
    assert b["phases_ms"] == pytest.approx({"data": 1.0, "forward_backward": 6.0, "optimizer": 2.0, "log": 0.5})
    assert b["kernels_ms"] == pytest.approx(
        {"matmul": 4.0, "attention": 1.5, "optimizer": 0.75, "triton": 0.5, "other": 0.25, "memcpy/memset": 0.2}
    )
    assert list(b["top_kernels_ms"].items())[:2] == [(f"[matmul] {GEMM}", 3.0), (f"[attention] {FLASH[5:105]}", 1.5)]
    assert b["kernel_sum_ms"] == pytest.approx(7.2)
    assert b["gpu_busy_ms"] == pytest.approx(6.7)  # 7.2 summed, less the 0.5 ms where two streams overlap
    assert b["gpu_idle_fraction"] == pytest.approx(0.33)
    json.dumps(b)  # goes into the --json results as it is


def test_step_breakdown_without_step_marks_or_kernels() -> None:
    """A CPU trace, or one without ProfilerStep spans: steps from the phases, wall from their extent."""
    events = [e for e in _synthetic_trace()["traceEvents"] if not str(e.get("name", "")).startswith("ProfilerStep")]
    b = trace.step_breakdown({"traceEvents": [e for e in events if e.get("cat") not in ("kernel", "gpu_memcpy")]})
    assert b["steps"] == 2
    assert b["step_ms"] == pytest.approx(9.75)  # first data phase start to last log phase end, per step
    assert b["phases_ms"]["forward_backward"] == pytest.approx(6.0)
    assert b["kernels_ms"] == {} and b["gpu_idle_fraction"] is None
    assert trace.step_breakdown({"traceEvents": []})["steps"] == 1  # empty: no division by zero


@pytest.mark.slow
def test_benchmark_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    cmd = [
        sys.executable,
        str(BENCHMARK),
        *("--device", "cpu", "--rounds", "2", "--steps", "6", "--warmup", "2", "--size", "nano"),
        *("--block-size", "32", "--micro-batch", "4", "--profile", "--profile-steps", "2", "--json", str(out)),
        f"--data.cache_dir={tmp_path / 'cache'}",
        "--data.max_corpus_mb=0.25",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=110, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ratio trainmesh tok/s ÷ plain tok/s" in proc.stdout
    result = json.loads(out.read_text())
    for side in ("trainmesh", "plain"):
        assert result[side]["median_ms"] > 0 and result[side]["tokens_per_s"] > 0
        assert result[side]["n"] == 2 * (6 - 2)  # rounds × kept steps
        assert result[side]["mfu"] is None  # no known peak on a CPU
    assert result["params_trainmesh"] == result["params_plain"] > 0
    assert math.isfinite(result["ratio"]) and result["ratio"] > 0
    assert len(result["round_medians"]) == 2
    assert result["profile"]["steps"] == 2, result["profile"]
    assert result["profile"]["phases_ms"]["forward_backward"] > 0


def test_the_planners_gpu_validation_runs_on_cpu(tmp_path: Path) -> None:
    """benchmarks/plan_gpu.py (make gpu-check's calibration of the planner): without CUDA, one nano layout through the
    same measurement and comparison, so the command is ready for a GPU visit."""
    out = tmp_path / "plan_gpu.json"
    script = BENCHMARK.parent / "plan_gpu.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(script), "--json", str(out)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and [row["layout"] for row in result["rows"]] == ["single mb8"]
    assert result["rows"][0]["measured"]["params"] == result["rows"][0]["predicted"]["params"] > 0
