"""Where a profiled step's time went, read from a torch.profiler Chrome trace (what [profile] writes):
the step's phases (the loop's trainmesh.* marks) and the GPU's kernel time by kind, per step, against the
wall time (the GPU's idle share).

    from trainmesh.metrics.trace import format_breakdown, step_breakdown
    print("\n".join(format_breakdown(step_breakdown(json.loads(Path(trace).read_text())))))
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

TOP_KERNELS = 8  # the kernels that take the most time, listed under the categories
# GPU kernel categories, first match wins (lower-cased substrings of the kernel name). Inductor's
# fused kernels are named after the ops they fuse ("triton_poi_fused_..._attention_..."), so a Triton
# kernel is "triton" unless it is a template (triton_tem_*: a matmul, or flex attention). cuDNN's SDPA
# (what torch 2.11 picks on an H100) runs "cudnn_generated_fort_native_sdpa_sm90_flash_*" kernels and,
# in backward, two helpers: cudnn::fusion::compute_dot_do_o_* and convert_dq_to_16bits.
KERNEL_RULES: list[tuple[str, tuple[str, ...]]] = [
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "dot_do_o", "convert_dq")),
    ("optimizer", ("adam", "multi_tensor")),
    ("matmul", ("gemm", "sm90", "cutlass", "nvjet", "matmul")),
]


def kernel_category(name: str) -> str:
    low = name.lower()
    if low.startswith("triton"):
        if low.startswith("triton_tem"):  # an Inductor template: a matmul, or flex attention
            return "attention" if "attention" in low else "matmul"
        return "triton"
    return next((cat for cat, keys in KERNEL_RULES if any(k in low for k in keys)), "other")


def _busy_us(spans: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: GPU time with at least one kernel or copy running."""
    total, end = 0.0, -math.inf
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def step_breakdown(trace: dict[str, Any]) -> dict[str, Any]:
    """Step-time breakdown of a torch.profiler Chrome trace: phases (trainmesh.* annotations) and GPU
    kernel time by category, in mean ms per profiled step. Events without a duration are skipped."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and isinstance(e.get("dur"), int | float)]
    annotations = [e for e in events if e.get("cat") in ("user_annotation", "cpu_op")]
    step_events = [e for e in annotations if str(e.get("name", "")).startswith("ProfilerStep#")]
    phase_events = [e for e in events if e.get("cat") == "user_annotation" and str(e["name"]).startswith("trainmesh.")]
    steps = len({e["name"] for e in step_events}) or sum(
        e["name"] == "trainmesh.forward_backward" for e in phase_events
    )
    steps = max(steps, 1)
    if step_events:
        wall_us = sum(float(e["dur"]) for e in step_events)
    elif phase_events:
        wall_us = max(float(e["ts"]) + float(e["dur"]) for e in phase_events) - min(
            float(e["ts"]) for e in phase_events
        )
    else:
        wall_us = 0.0
    phases: dict[str, float] = {}
    for e in phase_events:
        name = str(e["name"]).removeprefix("trainmesh.")
        phases[name] = phases.get(name, 0.0) + float(e["dur"]) / 1000 / steps
    kernels: dict[str, float] = {}
    by_name: dict[str, float] = {}
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    for e in gpu:
        cat = kernel_category(str(e.get("name", ""))) if e["cat"] == "kernel" else "memcpy/memset"
        kernels[cat] = kernels.get(cat, 0.0) + float(e["dur"]) / 1000 / steps
        name = str(e.get("name", "")).removeprefix("void ")
        name = f"[{cat}] " + name.replace("at::native::", "").replace("(anonymous namespace)::", "")[:100]
        by_name[name] = by_name.get(name, 0.0) + float(e["dur"]) / 1000 / steps
    busy_ms = _busy_us((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu if "ts" in e) / 1000 / steps
    step_ms = wall_us / 1000 / steps
    return {
        "steps": steps,
        "step_ms": step_ms,
        "phases_ms": phases,
        "kernels_ms": dict(sorted(kernels.items(), key=lambda kv: -kv[1])),
        "top_kernels_ms": dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]),
        "kernel_sum_ms": sum(kernels.values()),
        "gpu_busy_ms": busy_ms,
        "gpu_idle_fraction": max(0.0, 1 - busy_ms / step_ms) if gpu and step_ms > 0 else None,
    }


def format_breakdown(b: dict[str, Any]) -> list[str]:
    """`step_breakdown`'s result as report lines."""
    lines = [f"  {b['steps']} profiled steps, {b['step_ms']:.2f} ms per step (wall, ProfilerStep spans)"]
    lines += [f"    phase {name:<17} {ms:8.2f} ms/step" for name, ms in b["phases_ms"].items()]
    for cat, ms in b["kernels_ms"].items():
        share = ms / b["kernel_sum_ms"] if b["kernel_sum_ms"] else 0.0
        lines.append(f"    GPU {cat:<19} {ms:8.2f} ms/step  ({share:.0%} of GPU time)")
    lines += [f"      {ms:8.2f} ms/step  {name}" for name, ms in b["top_kernels_ms"].items()]
    if b["gpu_idle_fraction"] is None:
        lines.append("    no GPU kernels in the trace")
    else:
        lines.append(
            f"    GPU kernels {b['kernel_sum_ms']:.2f} ms/step summed, busy {b['gpu_busy_ms']:.2f} ms of "
            f"{b['step_ms']:.2f} ms wall: GPU idle {b['gpu_idle_fraction']:.1%}"
        )
    return lines
