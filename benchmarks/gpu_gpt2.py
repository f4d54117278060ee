"""GPU training throughput: trainmesh's loop vs a plain build-nanogpt-style loop, GPT-2 124M on one device.

Both sides train GPT-2 small (12 layers, 768 wide, 1024 context, vocab 50304) in bf16-mixed with
torch.compile, SDPA flash attention, fused AdamW and TF32 on, with micro-batch 16 × 1024 tokens and no
gradient accumulation, on the same batches of the GPT recipe's own training set. The plain side is the
single-file model below (nanoGPT's model.py layout, the whole model compiled) and build-nanogpt's loop.
Both read the loss back (`loss.item()` and a CUDA synchronise; trainmesh's metrics record) every
`--log-every` steps: 10 by default, as configs/gpt2-124m.toml logs; 1 is build-nanogpt's print every
step. Step times are the means over those windows. Rounds are interleaved in one process (trainmesh,
plain, trainmesh, plain, ...) and the first `--warmup` steps of each round are dropped. Figures:
tokens/s, step time (median, p10-p90), MFU, and ratio = trainmesh tokens/s / plain tokens/s (target
>= 1.00; MFU target >= 50% on an H100). A last, profiled trainmesh round breaks a step down by phase and
by GPU kernel category (from the torch.profiler trace trainmesh writes with [profile] enabled).

Without CUDA it runs a nano model in 32-true, uncompiled, for a few steps, so CI keeps it working.

    python benchmarks/gpu_gpt2.py [--rounds 4 --steps 60 --warmup 10 --log-every 10 --json out.json]

Extra `--section.key=value` arguments are passed to trainmesh's config (both sides read it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from plain_gpt import PlainConfig, PlainGPT
from trainmesh.config import Config
from trainmesh.core.batch import BatchSplit
from trainmesh.data.sharding import GlobalBatchSampler
from trainmesh.job.spec import load_config, resolve
from trainmesh.metrics.mfu import FORMULA, Peak, device_peak, mfu
from trainmesh.metrics.sinks import METRICS_FILE, read_metrics
from trainmesh.metrics.trace import format_breakdown, step_breakdown
from trainmesh.recipes import get_recipe
from trainmesh.recipes.gpt.model import GPTConfig
from trainmesh.runtime.runtime import Runtime
from trainmesh.train import loop
from trainmesh.train.optim import lr_at

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "gpt2-124m.toml"
RATIO_TARGET, MFU_TARGET = 1.00, 0.50
VOCAB = 50304


def plain_round(
    config: Config, data: Dataset[Any], plan: BatchSplit, device: torch.device, steps: int, warmup: int, every: int
) -> dict[str, Any]:
    """build-nanogpt's loop: forward with the loss, backward, clip, AdamW; every `every` steps loss.item() and a
    synchronise (build-nanogpt: every step), timed as the window's mean step."""
    m, opt, cuda = config.model, config.optim, device.type == "cuda"
    assert isinstance(m, GPTConfig)
    if config.train.precision not in ("bf16-mixed", "32-true"):
        raise SystemExit(f"the plain side runs bf16-mixed or 32-true, not train.precision={config.train.precision}")
    torch.manual_seed(config.run.seed)
    raw = PlainGPT(PlainConfig(m.block_size, m.vocab_size, m.n_layer, m.n_head, m.n_embd, m.dropout, m.bias)).to(device)
    model = torch.compile(raw) if config.train.compile else raw
    params = [p for p in raw.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": opt.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, fused=cuda or None)
    bf16 = config.train.precision == "bf16-mixed"
    # The same batches as trainmesh's side: the same sampler over the same dataset.
    sampler = GlobalBatchSampler(len(data), plan, 0, config.run.seed, config.data.shuffle)  # type: ignore[arg-type]
    batches = iter(DataLoader(data, batch_sampler=sampler, num_workers=config.data.num_workers, pin_memory=cuda))
    times: list[float] = []
    loss_value = float("nan")
    t0 = time.perf_counter()
    for step in range(steps):
        x, y = (t.to(device, non_blocking=True) for t in next(batches))
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(raw.parameters(), config.train.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, opt, steps)
        optimizer.step()
        if (step + 1) % every == 0:
            loss_value = loss.item()
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            times.append(1000 * (now - t0) / every)
            t0 = now
    peak_gb = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    return {
        "ms": times[warmup // every :],
        "loss": loss_value,
        "peak_mem_gb": peak_gb,
        "params": sum(p.numel() for p in params),
    }


# -- the trainmesh side -----------------------------------------------------------------------------
def trainmesh_round(
    config_file: str, overrides: list[str], rt: Runtime, out: Path, name: str, warmup: int
) -> dict[str, Any]:
    config = load_config(config_file, [*overrides, f"--run.out_dir={out}", f"--run.id={name}"], "gpt")
    run_dir = out / name
    loop.train(config, resolve(config, rt.world_size).batch, get_recipe("gpt"), rt, run_dir)
    records = sorted((x for x in read_metrics(run_dir / METRICS_FILE) if x["kind"] == "train"), key=lambda x: x["step"])
    steps, every = config.train.max_steps, config.run.log_every
    assert [x["step"] for x in records] == list(range(every, steps + 1, every)), "expected a record per window"
    # step_time_ms: the window's mean step, data loading and its own logging included
    kept = [x for x in records if x["step"] - every >= warmup]
    return {
        "ms": [x["step_time_ms"] for x in kept],
        "logged_mfu": [x["mfu"] for x in kept if "mfu" in x],
        "loss": records[-1]["loss"],
        "peak_mem_gb": records[-1].get("peak_mem_gb"),
        "run_dir": run_dir,
    }


def profiled_round(args: argparse.Namespace, overrides: list[str], rt: Runtime, out: Path) -> dict[str, Any]:
    wait, active = args.warmup, args.profile_steps
    extra = [f"--profile.{k}={v}" for k, v in (("enabled", "true"), ("wait", wait), ("warmup", 1), ("active", active))]
    steps = wait + 1 + active + 1
    extra.append(f"--train.max_steps={-(-steps // args.log_every) * args.log_every}")  # whole logging windows
    run_dir = trainmesh_round(args.config, [*overrides, *extra], rt, out, "profile", 0)["run_dir"]
    traces = sorted((run_dir / "profile" / "rank_0").glob("*.pt.trace.json"), key=lambda p: p.stat().st_mtime)
    if not traces:
        print("\nprofiled round: no trace was written")
        return {"skipped": "no trace written"}
    breakdown = step_breakdown(json.loads(traces[-1].read_text()))
    print(f"\n== profiled trainmesh round: {traces[-1]} ==")
    print("\n".join(format_breakdown(breakdown)))
    return {"trace": str(traces[-1]), **breakdown}


# -- reporting --------------------------------------------------------------------------------------
def stats(ms: list[float], tokens_per_step: int, flops_per_token: float, peak: Peak | None) -> dict[str, Any]:
    p10, p50, p90 = np.percentile(ms, [10, 50, 90]).tolist()
    tokens_per_s = tokens_per_step / (p50 / 1000)
    return {
        "median_ms": p50,
        "p10_ms": p10,
        "p90_ms": p90,
        "n": len(ms),
        "tokens_per_s": tokens_per_s,
        "mfu": mfu(flops_per_token, tokens_per_s, peak),
    }


def header(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"command": shlex.join([sys.executable, *sys.argv]), "torch": torch.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {"device": props.name, "sm_count": props.multi_processor_count, "memory_gb": props.total_memory / 2**30}
        nccl = torch.cuda.nccl.version()  # a tuple; an int in older torch
        info |= {"cuda": torch.version.cuda, "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            query = "--query-gpu=driver_version,clocks.max.sm,power.limit"
            smi = subprocess.run(
                ["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True, timeout=20
            )
            info["nvidia_smi"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout else None
    else:
        info |= {"device": f"cpu ({torch.get_num_threads()} threads)", "cuda": None}
    return info


def report(
    args: argparse.Namespace, info: dict[str, Any], peak: Peak | None, tm: list[Any], pl: list[Any]
) -> dict[str, Any]:
    fpt = info["flops_per_token"]
    sides = {
        name: stats([t for r in rounds for t in r["ms"]], info["tokens_per_step"], fpt, peak)
        | {"peak_mem_gb": rounds[-1]["peak_mem_gb"], "final_loss": rounds[-1]["loss"]}
        for name, rounds in (("trainmesh", tm), ("plain", pl))
    }
    logged = [v for r in tm for v in r["logged_mfu"]]  # trainmesh's own per-step MFU, a cross-check
    sides["trainmesh"]["logged_mfu_median"] = float(np.median(logged)) if logged else None
    ratio = sides["trainmesh"]["tokens_per_s"] / sides["plain"]["tokens_per_s"]
    verdict = "PASS" if ratio >= RATIO_TARGET else "BELOW TARGET"
    print("\n== GPU training throughput: trainmesh loop vs plain build-nanogpt loop, GPT-2, one process ==")
    for key in ("command", "device", "nvidia_smi", "sm_count", "torch", "cuda", "nccl"):
        if info.get(key) is not None:
            print(f"{key}: {info[key]}")
    print(f"model: {info['model']}; parameters trainmesh {info['params_trainmesh']:,}, plain {info['params_plain']:,}")
    print(f"{info['plan']}; precision {info['precision']}, compile {info['compile']}, tf32 {info['tf32']}")
    print(
        f"{args.rounds} rounds × {args.steps} steps per side, first {args.warmup} dropped per round; loss read back "
        f"(a host sync) every {args.log_every} step(s) on both sides, step times are means over those windows"
    )
    print(f"MFU: {peak.describe() if peak else FORMULA + '; no known peak for this device: no MFU'}")
    print(f"     6·N + 12·L·H·Q·T = {fpt:,.0f} FLOPs per token")
    for name, s in sides.items():
        mfu_text = f"MFU {s['mfu']:.1%}" if s["mfu"] is not None else "MFU n/a"
        mem = f"   peak mem {s['peak_mem_gb']:.1f} GiB" if s["peak_mem_gb"] is not None else ""
        print(
            f"  {name:<10} {s['tokens_per_s']:>11,.0f} tok/s   median {s['median_ms']:8.2f} ms   "
            f"p10-p90 {s['p10_ms']:.2f}-{s['p90_ms']:.2f}   n={s['n']}   {mfu_text}{mem}"
        )
    rounds = []
    for i, (a, b) in enumerate(zip(tm, pl, strict=True)):
        rounds.append({"trainmesh_median_ms": float(np.median(a["ms"])), "plain_median_ms": float(np.median(b["ms"]))})
        ma, mb = rounds[-1].values()
        print(f"  round {i}: trainmesh {ma:.2f} ms, plain {mb:.2f} ms, ratio {mb / ma:.3f}; ", end="")
        print(f"final loss {a['loss']:.4f} / {b['loss']:.4f}")
    print(f"ratio trainmesh tok/s ÷ plain tok/s = {ratio:.4f}   target >= {RATIO_TARGET:.2f}   {verdict}")
    if (tm_mfu := sides["trainmesh"]["mfu"]) is not None:
        mfu_verdict = "PASS" if tm_mfu >= MFU_TARGET else "BELOW TARGET"
        print(f"trainmesh MFU {tm_mfu:.1%}   target >= {MFU_TARGET:.0%} on an H100   {mfu_verdict}")
    targets = {"ratio_target": RATIO_TARGET, "mfu_target": MFU_TARGET, "verdict": verdict}
    settings = {"steps": args.steps, "rounds": args.rounds, "warmup": args.warmup, "args": vars(args)}
    return {**info, **settings, **sides, "round_medians": rounds, "ratio": ratio, **targets}


# -- main -------------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: CUDA when present")
    parser.add_argument("--steps", type=int, help="optimizer steps per side per round (default 40; CPU 6)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds, trainmesh then plain (default 4; CPU 2)")
    parser.add_argument("--warmup", type=int, help="steps dropped at the start of every round (default 10; CPU 2)")
    parser.add_argument(
        "--log-every",
        type=int,
        help="steps between reading the loss back (a host sync) on both sides, trainmesh's run.log_every; the "
        "default 10 is configs/gpt2-124m.toml's; 1 is build-nanogpt's print every step (CPU default 1)",
    )
    parser.add_argument("--size", help="model.size (default gpt2; CPU nano)")
    parser.add_argument("--block-size", type=int, help="sequence length (default 1024; CPU 64)")
    parser.add_argument("--micro-batch", type=int, help="sequences per step = global batch (default 16; CPU 4)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, help="torch.compile (default: on CUDA)")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, help="profiled round (default: on CUDA)")
    parser.add_argument("--profile-steps", type=int, default=5, help="steps the profiled round records")
    parser.add_argument("--config", default=str(CONFIG), help="trainmesh TOML config")
    parser.add_argument("--json", help="also write the results as JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the run folders (and traces); print where")
    parser.add_argument("--verbose", action="store_true", help="keep trainmesh's INFO logging")
    args, rest = parser.parse_known_args(argv)
    bad = [a for a in rest if not (a.startswith("--") and "=" in a and "." in a.split("=", 1)[0])]
    if bad:
        parser.error(f"unrecognised arguments {bad}; config overrides look like --section.key=value")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    gpu_defaults = {"steps": 60, "rounds": 4, "warmup": 10, "log_every": 10, "size": "gpt2", "block_size": 1024}
    cpu_defaults = {"steps": 6, "rounds": 2, "warmup": 2, "log_every": 1, "size": "nano", "block_size": 64}
    gpu_defaults["micro_batch"], cpu_defaults["micro_batch"] = 16, 4
    for key, value in (gpu_defaults if cuda else cpu_defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.compile = cuda if args.compile is None else args.compile
    args.profile = cuda if args.profile is None else args.profile
    args.cuda = cuda
    if not 0 <= args.warmup < args.steps or args.rounds < 1:
        parser.error("need --rounds >= 1 and 0 <= --warmup < --steps")
    if args.log_every < 1 or args.steps % args.log_every or args.warmup % args.log_every:
        parser.error("--log-every must divide --steps and --warmup (steps are timed in windows of that many)")
    return args, rest


def fresh_memory(device: torch.device) -> None:
    """Free what the last round left, so neither side inherits the other's memory (or its peak)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def main() -> int:
    args, extra = parse_args(sys.argv[1:])
    overrides = [
        *(f"--model.{k}={v}" for k, v in (("size", args.size), ("block_size", args.block_size), ("vocab_size", VOCAB))),
        f"--train.max_steps={args.steps}",
        f"--train.micro_batch={args.micro_batch}",
        f"--train.global_batch={args.micro_batch}",  # no gradient accumulation
        "--train.global_batch_tokens=0",
        f"--train.compile={str(args.compile).lower()}",
        f"--run.log_every={args.log_every}",
        "--train.eval_every=0",
        f"--train.eval_samples={args.micro_batch}",
        "--checkpoint.final=false",
        "--sample.max_new_tokens=0",
        "--run.progress=false",
    ]
    if not args.cuda:
        overrides += ["--dist.device=cpu", "--train.precision=32-true"]
    overrides += extra
    base = load_config(args.config, overrides, "gpt")
    job = resolve(base, 1)
    plan = job.batch
    # One process, world size 1: no torchrun, no process group. Its train.tf32 (on by default, as build-nanogpt
    # sets it) is a process-wide setting: the plain side runs under the same.
    rt = job.runtime()
    if not args.verbose:
        rt.log.setLevel("WARNING")
    recipe = get_recipe("gpt")
    train_set, _ = recipe.prepare(base, rt)  # both sides read this, in the same order
    with torch.device("meta"):  # trainmesh's own model, shapes only: its parameter count and FLOPs per token
        tm_model = recipe.build_model(base, rt)
    peak = device_peak(rt.device, rt.precision.peak_dtype, rt.tf32)
    info = header(rt.device) | {
        "model": f"size={args.size} vocab={VOCAB} block={args.block_size}",
        "plan": plan.describe(),
        "precision": base.train.precision,
        "compile": base.train.compile,
        "tf32": rt.tf32,
        "params_trainmesh": sum(p.numel() for p in tm_model.parameters()),
        "tokens_per_step": plan.tokens_per_step,
        "flops_per_token": recipe.flops_per_token(tm_model),
        "peak_tflops": peak.flops / 1e12 if peak else None,
    }
    print(f"{info['device']}; torch {info['torch']}; {info['model']}; {plan.describe()}", flush=True)
    out = Path(tempfile.mkdtemp(prefix="gpu-gpt2-"))
    tm: list[dict[str, Any]] = []
    pl: list[dict[str, Any]] = []
    try:
        for r in range(args.rounds):
            fresh_memory(rt.device)
            tm.append(trainmesh_round(args.config, overrides, rt, out, f"trainmesh-{r}", args.warmup))
            fresh_memory(rt.device)
            pl.append(plain_round(base, train_set, plan, rt.device, args.steps, args.warmup, args.log_every))
            medians = [float(np.median(side[-1]["ms"])) for side in (tm, pl)]
            print(f"round {r}: median trainmesh {medians[0]:.2f} ms, plain {medians[1]:.2f} ms", flush=True)
        info["params_plain"] = pl[-1]["params"]
        if info["params_plain"] != info["params_trainmesh"]:
            raise SystemExit(f"not the same model: {info['params_trainmesh']:,} vs {info['params_plain']:,} parameters")
        result = report(args, info, peak, tm, pl)
        fresh_memory(rt.device)
        result["profile"] = profiled_round(args, overrides, rt, out) if args.profile else None
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
            print(f"wrote {args.json}")
    finally:
        if args.keep:
            print(f"run folders kept in {out}")
        else:
            shutil.rmtree(out, ignore_errors=True)
    rt.teardown(success=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
