"""Extrapolated scaling: what `trainmesh plan`'s model predicts from 1 to 4096 H100s, against published figures.

Nothing is measured here: every number is the planner's prediction (`trainmesh.apps.plan.search.plan_layouts`) on the
`h100` preset (`get_cluster("h100", nodes, 8)`; 1 GPU is one node of one device). For each model, scaling mode and
GPU count it takes the fastest layout that fits the device memory (what `trainmesh plan` recommends) and records
its name, micro-batch, step time by phase, tokens/s per GPU, MFU, speedup and efficiency against the smallest
point, and the shares of the step in the planner's `comm` phase (collectives not hidden behind compute, and FSDP2's
copies into and out of its buffers) and in the pipeline bubble. Results: docs/plan_scaling.json and .png.

Models (both bf16-mixed, AdamW, no dropout):

- GPT-2 124M: model.size=gpt2, vocabulary 50304, context 1024.
- a GPT-shaped 7B: 32 blocks × 4096 wide, 32 heads, context 4096, vocabulary 32000 (6.6B parameters): trainmesh's
  GPT (LayerNorm, GELU MLP, learned positions, tied head), not Llama (RMSNorm, SwiGLU, RoPE, GQA, untied head).

Scaling modes:

- strong: a fixed global batch, the one these models train with and the anchors ran: GPT-2 512 × 1024 tokens
  (0.5M, llm.c, modded-nanogpt, build-nanogpt), 7B 1024 × 4096 (4M, Llama-2's batch). It stops where the batch
  cannot be cut further: every rank needs a whole sequence, and a pipeline one per stage.
- weak: a fixed batch per GPU: GPT-2 64 sequences (the 8 × 64 × 1024 of llm.c and modded-nanogpt on 8 H100s, so
  the 8-GPU point is the anchors' setup), 7B 4 × 4096 = 16,384 tokens (torchtitan's Llama-3.1 8B runs on 8 and
  128 H100s: local batch 2 × 8192). The global batch then grows with the GPUs (GPT-2 at 4096 GPUs: 268M tokens per
  step, far beyond any sensible batch for the model): weak scaling is a throughput figure, not a training recipe.

Speedup: strong, step time(smallest) / step time(N); weak, tokens/s(N) / tokens/s(smallest); efficiency = speedup
÷ (N / smallest). MFU = 72·L·h²·(1 + s/6h) + 6·h·V FLOPs per token (Megatron's count, attention non-causal) ×
tokens/s ÷ (N × the preset's dense bf16 peak). Published anchors are converted with the same FLOPs per token.
For each absolute anchor the script also solves for the compute efficiency (`Cluster.efficiency`, the preset's
assumed 45% of peak) at which the planner's estimate of the chosen layout equals the published figure: what a
calibration would have to find.

    PYTHONPATH=src python benchmarks/plan_scaling.py [--json docs/plan_scaling.json --plot docs/plan_scaling.png]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from trainmesh.apps.plan.cluster import Cluster, GiB, get_cluster
from trainmesh.apps.plan.estimate import TIME_PARTS, Estimate
from trainmesh.apps.plan.search import Workload, estimate, mfu, plan_layouts
from trainmesh.cli.plan import ASSUMPTIONS
from trainmesh.job.spec import load_config

GPUS = tuple(8 * 2**k for k in range(10))  # 8 … 4096, whole nodes of 8


@dataclass(frozen=True)
class Model:
    key: str
    label: str
    overrides: tuple[str, ...]
    strong_batch: int
    """Sequences per optimizer step, strong scaling."""
    weak_per_gpu: int
    """Sequences per GPU per optimizer step, weak scaling."""
    gpus: tuple[int, ...]


MODELS = (
    Model(
        "gpt2",
        "GPT-2 124M",
        ("--model.size=gpt2", "--model.vocab_size=50304", "--model.block_size=1024", "--train.precision=bf16-mixed"),
        512,
        64,
        (1, *GPUS),
    ),
    Model(
        "gpt7b",
        "GPT-shaped 7B",
        (
            *("--model.n_layer=32", "--model.n_head=32", "--model.n_embd=4096", "--model.vocab_size=32000"),
            *("--model.block_size=4096", "--train.precision=bf16-mixed"),
        ),
        1024,
        4,
        GPUS,  # 7B × 16 bytes of AdamW state do not fit one 80 GB GPU
    ),
)


def cluster_for(gpus: int, preset: str = "h100") -> Cluster:
    return get_cluster(preset, max(1, gpus // 8), min(8, gpus))


@dataclass
class Point:
    gpus: int
    global_batch: int
    work: Workload
    cluster: Cluster
    best: Estimate

    @property
    def tokens_per_gpu(self) -> float:
        return self.work.tokens_per_step / self.best.step_time / self.gpus

    @property
    def mfu(self) -> float:
        return mfu(self.work, self.best, self.cluster)

    def share(self, part: str) -> float:
        return self.best.time[part] / self.best.step_time


def plan_point(model: Model, gpus: int, global_batch: int, preset: str = "") -> Point | None:
    """The fastest layout that fits, or None when no layout splits the batch over `gpus` (or none fits)."""
    config = load_config(None, list(model.overrides), "gpt")
    work, cluster = Workload.from_config(config, global_batch), cluster_for(gpus, preset or "h100")
    fitting = [e for e in plan_layouts(config, work, cluster) if e.fits]
    best = min(fitting, key=lambda e: e.step_time) if fitting else None  # not plan's simplest-of-close-calls
    return Point(gpus, global_batch, work, cluster, best) if best else None


def sweep(model: Model, mode: str) -> tuple[list[Point], list[str]]:
    points: list[Point] = []
    notes: list[str] = []
    for gpus in model.gpus:
        batch = model.strong_batch if mode == "strong" else model.weak_per_gpu * gpus
        point = plan_point(model, gpus, batch)
        if point is None:
            notes.append(f"{gpus} GPUs: no layout splits {batch} sequences of this model over {gpus} GPUs and fits")
        else:
            points.append(point)
    return points, notes


def speedup(points: list[Point], p: Point, mode: str) -> float:
    base = points[0]
    if mode == "strong":
        return base.best.step_time / p.best.step_time
    return (p.tokens_per_gpu * p.gpus) / (base.tokens_per_gpu * base.gpus)


def row(points: list[Point], p: Point, mode: str) -> dict[str, Any]:
    s = speedup(points, p, mode)
    c = p.best.candidate
    return {
        "gpus": p.gpus,
        "global_batch": p.global_batch,
        "tokens_per_step": p.work.tokens_per_step,
        "layout": c.name,
        "micro_batch": c.micro_batch,
        "accumulation": p.global_batch // (c.dp * c.micro_batch),
        "overrides": c.overrides(p.global_batch),
        "step_s": p.best.step_time,
        "time_s": p.best.time,
        "tokens_per_s_per_gpu": p.tokens_per_gpu,
        "mfu": p.mfu,
        "speedup": s,
        "efficiency": s / (p.gpus / points[0].gpus),
        "shares": {k: p.share(k) for k in TIME_PARTS},
        "memory_gib": p.best.total_memory / GiB,
    }


def efficiency_to_match(p: Point, tokens_per_gpu: float) -> float | None:
    """The cluster efficiency at which the planner's estimate of `p`'s layout gives `tokens_per_gpu` (None: not
    even at 100% of peak)."""

    def rate(eff: float) -> float:
        est = estimate(p.work, p.best.candidate, replace(p.cluster, efficiency=eff))
        return p.work.tokens_per_step / est.step_time / p.gpus

    lo, hi = 0.01, 1.0
    if rate(hi) < tokens_per_gpu:
        return None
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate(mid) < tokens_per_gpu else (lo, mid)
    return hi


@dataclass(frozen=True)
class Published:
    """A published figure and the prediction it is compared with."""

    name: str
    source: str
    metric: str
    """'tok/s/GPU' or 'MFU' (absolute); 'efficiency' or 'MFU ratio' (from `base` to `gpus` GPUs)."""
    value: float
    model: str
    mode: str
    """'strong', 'weak'; 'measured' (1 GPU, 16 × 1024 tokens per step); 'a100' (8 GPUs of the a100 preset)."""
    gpus: int
    base: int = 0


# fmt: off
PUBLISHED = (
    Published("trainmesh, 1×H100, GPT-2, 16×1024", "BENCHMARKS.md (GPU, 2026-11-23)", "tok/s/GPU", 403_973, "gpt2",
              "measured", 1),
    Published("plain build-nanogpt loop, same run", "BENCHMARKS.md (GPU, 2026-11-23)", "tok/s/GPU", 441_606, "gpt2",
              "measured", 1),
    Published("llm.c, 8×H100, GPT-2, 8×64×1024", "modded-nanogpt records 2024-10-13_llmc: 140 ms", "tok/s/GPU",
              468_000, "gpt2", "strong", 8),
    Published("modded-nanogpt PyTorch 2.5, 8×H100", "modded-nanogpt records 2024-10-18: 141.8 ms", "tok/s/GPU",
              462_000, "gpt2", "strong", 8),
    Published("Modal nanoGPT speedrun, 2→8 nodes", "modal-labs/multinode-training-guide#27: 115→30 ms", "efficiency",
              115 / 30 / 4, "gpt2", "strong", 64, 16),
    Published("torchtitan Llama-3.1 8B FSDP, 8×H100", "torchtitan benchmarks/llama3_h100_202412", "MFU", 0.33,
              "gpt7b", "weak", 8),
    Published("torchtitan FSDP + compile, 8×H100", "torchtitan benchmarks/llama3_h100_202412", "MFU", 0.39, "gpt7b",
              "weak", 8),
    Published("torchtitan 8B FSDP weak, 8→128 H100", "torchtitan: 5,762 → 5,605 TPS/GPU", "efficiency", 5605 / 5762,
              "gpt7b", "weak", 128, 8),
    Published("Megatron-Core, up to 47% MFU on H100", "Megatron-LM README (41%→47%, 2B→462B)", "MFU", 0.47, "gpt7b",
              "weak", 4096),
    Published("Megatron-Core GPT-3 175B strong 96→4608", "Megatron-LM README: MFU 47% → 42%", "MFU ratio", 42 / 47,
              "gpt7b", "strong", 4096, 128),
    Published("llm.c, 8×A100 80GB, GPT-2 (a100 preset)", "llm.c scripts/run_gpt2_124M.sh: ~300 ms", "tok/s/GPU",
              218_000, "gpt2", "a100", 8),
)
# fmt: on


@dataclass(frozen=True)
class Anchor:
    published: Published
    predicted: float
    published_mfu: float | None = None
    """An absolute figure as MFU on the planner's FLOPs per token."""
    needed: float | None = None
    """The compute efficiency at which the prediction equals the published figure (absolute figures)."""

    @property
    def absolute(self) -> bool:
        return self.published.metric in ("tok/s/GPU", "MFU")

    @property
    def difference(self) -> float:
        return self.predicted / self.published.value - 1

    @property
    def compared_with(self) -> str:
        pub = self.published
        span = f"{pub.base}→{pub.gpus} GPUs" if pub.base else f"{pub.gpus} GPU{'s' if pub.gpus > 1 else ''}"
        mode = {"measured": "16×1024 tokens", "a100": "a100 preset"}.get(pub.mode, pub.mode)
        return f"{next(m.label for m in MODELS if m.key == pub.model)}, {mode}, {span}"


def anchor(pub: Published, series: dict[tuple[str, str], list[Point]]) -> Anchor:
    if pub.mode in ("measured", "a100"):
        point = plan_point(MODELS[0], pub.gpus, 16 if pub.mode == "measured" else 512, "a100" * (pub.mode == "a100"))
        assert point is not None
        points = [point]
    else:
        points = series[(pub.model, pub.mode)]
    at = {p.gpus: p for p in points}
    p = at[pub.gpus]
    if pub.metric == "MFU ratio":
        return Anchor(pub, p.mfu / at[pub.base].mfu)
    if pub.metric == "efficiency":
        return Anchor(pub, speedup(points, p, pub.mode) / speedup(points, at[pub.base], pub.mode) / (p.gpus / pub.base))
    per_gpu = p.cluster.peak_flops["bf16"] / p.work.spec.train_flops_per_token()  # tokens/s per GPU at 100% MFU
    tokens = pub.value if pub.metric == "tok/s/GPU" else pub.value * per_gpu
    predicted = p.tokens_per_gpu if pub.metric == "tok/s/GPU" else p.mfu
    return Anchor(pub, predicted, tokens / per_gpu, efficiency_to_match(p, tokens))


def assumptions(cluster: Cluster, seq: dict[str, int]) -> list[str]:
    """The preset's figures, read from the cluster object, and the model's assumptions."""
    intra, inter = cluster.intra.costs["all_reduce"], cluster.inter.costs["all_reduce"]
    return [
        f"{cluster.name} preset: {cluster.devices_per_node} GPUs per node, {cluster.memory / GiB:.0f} GiB each; "
        f"dense bf16 peak {cluster.peak_flops['bf16'] / 1e12:.0f} TFLOP/s, {cluster.efficiency:.0%} of it achieved "
        f"(assumed, uncalibrated); optimizer at {cluster.mem_bandwidth / 1e12:.2f} TB/s",
        f"NVLink {intra.bandwidth / 1e9:.0f} GB/s bus bandwidth, {intra.latency * 1e6:.0f} µs per latency step; "
        f"InfiniBand {inter.bandwidth / 1e9:.0f} GB/s per GPU (one NIC each), {inter.latency * 1e6:.0f} µs per step; "
        f"a group spanning nodes with k ranks on each node uses k NICs (at most the NVLink figure); every FSDP unit "
        f"and DDP bucket pays its collective's latency steps; overlap {cluster.overlap:.0%} of the compute",
        *ASSUMPTIONS[2:],
        "workloads (bf16-mixed, AdamW), sequences × tokens: "
        + "; ".join(
            f"{m.label} strong {m.strong_batch} × {seq[m.key]}, weak {m.weak_per_gpu} × {seq[m.key]} per GPU"
            for m in MODELS
        )
        + "; at each point the fastest layout that fits the GPU's memory",
    ]


def plot(series: dict[tuple[str, str], list[Point]], found: list[Anchor], text: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trainmesh.metrics.sinks import write_figure

    fig, axes = plt.subplots(2, 2, figsize=(14, 10.5), dpi=100)
    (ax_s, ax_e), (ax_m, ax_c) = axes
    colors = {"gpt2": "C0", "gpt7b": "C3"}
    for (key, mode), points in series.items():
        label, color = f"{next(m.label for m in MODELS if m.key == key)}, {mode}", colors[key]
        style = "o-" if mode == "strong" else "s--"
        g = [p.gpus for p in points]
        rows = [row(points, p, mode) for p in points]
        for ax, field in ((ax_s, "speedup"), (ax_e, "efficiency"), (ax_m, "mfu")):
            ax.plot(g, [r[field] for r in rows], style, color=color, markersize=3.5, label=label)
        if mode == "strong":
            ax_c.plot(g, [r["shares"]["comm"] for r in rows], style, color=color, label=f"{label}: comm")
            ax_c.plot(g, [r["shares"]["bubble"] for r in rows], "x:", color=color, label=f"{label}: bubble")
            for r in (rows[0], rows[len(rows) // 2], rows[-1]):
                at = (r["gpus"], r["speedup"])
                ax_s.annotate(r["layout"], at, xytext=(4, -10), textcoords="offset points", fontsize=6.5, color=color)
            ideal = f"ideal from {g[0]} GPU{'s' if g[0] > 1 else ''}"
            ax_s.plot([g[0], g[-1]], [1, g[-1] / g[0]], color=color, alpha=0.25, linewidth=4, label=ideal)
        else:  # the weak curves' layout, at their largest point
            at, above = (rows[-1]["gpus"], rows[-1]["mfu"]), 8 if key == "gpt2" else -22
            ax_m.annotate(rows[-1]["layout"], at, xytext=(-75, above), textcoords="offset points", fontsize=6.5,
                          color=color)  # fmt: skip
    markers = iter("*PXDv^<>phH")
    for a in found:
        pub = a.published
        if a.published_mfu and pub.mode != "a100":
            ax_m.plot([pub.gpus], [a.published_mfu], next(markers), color=colors[pub.model], markersize=8,
                      markeredgecolor="k", markeredgewidth=0.5, label=f"published: {pub.name}")  # fmt: skip
    ax_m.plot([96, 4608], [0.47, 0.42], "o:", color="0.4", label="published: Megatron-Core GPT-3 175B, strong 96→4608")
    cluster = series[("gpt2", "strong")][0].cluster
    ax_s.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="speedup vs the smallest point",
             title="Speedup (strong: step time; weak: tokens/s); layout chosen at three points")  # fmt: skip
    ax_e.set(xscale="log", xlabel="GPUs", ylabel="efficiency = speedup / (N / N₀)", ylim=(0, 1.1),
             title="Scaling efficiency")  # fmt: skip
    ax_m.set(xscale="log", xlabel="GPUs", ylim=(0, 0.55), title="MFU predicted (lines) and published (markers)",
             ylabel=f"MFU (Megatron's FLOPs / {cluster.peak_flops['bf16'] / 1e12:.0f} TFLOP/s dense bf16)")  # fmt: skip
    ax_c.set(xscale="log", xlabel="GPUs", ylabel="share of the step", ylim=(0, 1),
             title="Strong scaling: 'comm' (exposed collectives + FSDP copies), bubble")  # fmt: skip
    for ax in axes.flat:
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6.5, loc="lower left" if ax is ax_m else "best")
    fig.suptitle("trainmesh plan: predicted scaling on H100 clusters (a model, not a measurement)")
    fig.text(0.01, 0.005, "\n".join(f"• {t}" for t in text), fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.1, 1, 0.97))
    write_figure(fig, path)


def print_series(key: str, mode: str, points: list[Point], notes: list[str]) -> None:
    model = next(m for m in MODELS if m.key == key)
    per = f"{model.strong_batch} sequences" if mode == "strong" else f"{model.weak_per_gpu} sequences per GPU"
    print(f"\n{model.label}, {mode} scaling ({per} of {points[0].work.spec.seq} tokens):")
    head = f"{'GPUs':>5} {'batch':>7} {'layout':<30} {'micro':>5} {'acc':>3} {'step ms':>9} {'tok/s/GPU':>10}"
    print(head + f" {'MFU':>6} {'speedup':>8} {'eff':>6} {'comm':>5} {'bubble':>6} {'GiB':>5}")
    for p in points:
        r = row(points, p, mode)
        print(
            f"{p.gpus:5d} {p.global_batch:7d} {r['layout']:<30} {r['micro_batch']:5d} {r['accumulation']:3d} "
            f"{r['step_s'] * 1e3:9.2f} {r['tokens_per_s_per_gpu']:10,.0f} {r['mfu']:6.1%} {r['speedup']:8.1f} "
            f"{r['efficiency']:6.1%} {r['shares']['comm']:5.1%} {r['shares']['bubble']:6.1%} {r['memory_gib']:5.1f}"
        )
    for note in notes:
        print(f"  ({note})")


def print_anchors(found: list[Anchor]) -> None:
    print("\nPrediction against published figures (difference = predicted / published − 1):")
    head = f"{'anchor':<42} {'metric':<10} {'published':>10} {'predicted':>10} {'diff':>7} {'eff. to match':>13}"
    print(head + "  compared with; source")
    for a in found:
        pub = a.published
        fmt = "{:,.0f}" if pub.metric == "tok/s/GPU" else "{:.1%}"
        needed = "—" if not a.absolute else f"{a.needed:.1%}" if a.needed is not None else "> 100%"
        print(
            f"{pub.name:<42} {pub.metric:<10} {fmt.format(pub.value):>10} {fmt.format(a.predicted):>10} "
            f"{a.difference:+7.1%} {needed:>13}  {a.compared_with}; {pub.source}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="docs/plan_scaling.json")
    parser.add_argument("--plot", default="docs/plan_scaling.png")
    args = parser.parse_args()
    start = time.perf_counter()
    series: dict[tuple[str, str], list[Point]] = {}
    notes: dict[tuple[str, str], list[str]] = {}
    for model in MODELS:
        for mode in ("strong", "weak"):
            series[(model.key, mode)], notes[(model.key, mode)] = sweep(model, mode)
            print_series(model.key, mode, series[(model.key, mode)], notes[(model.key, mode)])
    found = [anchor(pub, series) for pub in PUBLISHED]
    print_anchors(found)
    text = assumptions(cluster_for(8), {m.key: series[(m.key, "strong")][0].work.spec.seq for m in MODELS})
    print("\nassumptions:\n" + "\n".join(f"  - {t}" for t in text))
    out = {
        "what": "trainmesh plan's predictions (not measurements): fastest layout that fits, per GPU count",
        "command": "PYTHONPATH=src python benchmarks/plan_scaling.py",
        "assumptions": text,
        "cluster": asdict(cluster_for(8)),  # one node of the preset; the sweeps scale `nodes`
        "models": {
            m.key: {
                "label": m.label,
                "overrides": list(m.overrides),
                "n_params": series[(m.key, "strong")][0].work.spec.n_params,
                "flops_per_token": series[(m.key, "strong")][0].work.spec.train_flops_per_token(),
                "strong_global_batch": m.strong_batch,
                "weak_per_gpu": m.weak_per_gpu,
            }
            for m in MODELS
        },
        "series": [
            {"model": k, "mode": mode, "points": [row(pts, p, mode) for p in pts], "notes": notes[(k, mode)]}
            for (k, mode), pts in series.items()
        ],
        "anchors": [{**asdict(a), "difference": a.difference, "compared_with": a.compared_with} for a in found],
    }
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    plot(series, found, text, Path(args.plot))
    print(f"\nwrote {args.json} and {args.plot} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
