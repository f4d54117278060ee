"""The library path on one device: trainmesh's `Runtime` in a user's own loop against a raw PyTorch loop, Lightning
Fabric and Hugging Face Accelerate, in one process, on the same batches.

Every side trains trainmesh's GPT from the same initial weights on the same token batches with AdamW (fused on
CUDA), gradient clipping at 1.0, in bf16-mixed on CUDA (32-true on the CPU), and reads the loss back (`.item()`,
a host sync) every `--log-every` steps; step times are the means over those windows. What each library adds is
its own wrapping of the same calls: `rt.setup`/`rt.autocast`/`rt.backward`/`rt.clip_grad_norm`/`optimizer.step`,
`fabric.setup`/`fabric.backward`/`fabric.clip_gradients`, `accelerator.prepare`/`accelerator.backward`/
`accelerator.clip_grad_norm_`. Rounds are interleaved (raw, trainmesh, fabric, accelerate, raw, ...) and the first
`--warmup` windows of each round are dropped. The figure per side: median step time / the raw loop's (target for
trainmesh <= 1.01). A side whose package is not installed (`pip install lightning accelerate`) is left out.

    python benchmarks/library_loop.py [--rounds 4 --steps 60 --warmup 2 --log-every 10 --json out.json]

Without CUDA it runs the tiny GPT on the CPU (sequences of 128, micro-batch 8); with CUDA GPT-2 124M (1024, 16).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainmesh import Runtime
from trainmesh.config.schema import DistConfig
from trainmesh.metrics.mfu import device_peak, mfu
from trainmesh.recipes.gpt.model import GPT, GPTConfig

Batch = tuple[torch.Tensor, torch.Tensor]
Side = Callable[[nn.Module, list[Batch], argparse.Namespace], list[float]]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def _windows(steps: Iterator[torch.Tensor], every: int) -> list[float]:
    """Seconds per step of each window of `every` steps, the loss read back at its end (a host sync)."""
    times, start = [], time.perf_counter()
    for i, loss in enumerate(steps, start=1):
        if i % every == 0:
            loss.item()
            now = time.perf_counter()
            times.append((now - start) / every)
            start = now
    return times


def _optimizer(model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=device.type == "cuda")


def raw_side(model: nn.Module, data: list[Batch], args: argparse.Namespace) -> list[float]:
    device, dtype = args.device, args.dtype
    model = model.to(device)
    opt = _optimizer(model, device)

    def steps() -> Iterator[torch.Tensor]:
        for x, y in data:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype, enabled=dtype != torch.float32):
                loss = _loss(model, x, y)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            yield loss.detach()

    return _windows(steps(), args.log_every)


def trainmesh_side(model: nn.Module, data: list[Batch], args: argparse.Namespace) -> list[float]:
    rt = Runtime(precision=args.precision, dist_config=DistConfig(device=args.device.type))
    try:
        model, opt = rt.setup(model, _optimizer(model, args.device))

        def steps() -> Iterator[torch.Tensor]:
            for batch in data:
                x, y = rt.to_device(batch)
                with rt.autocast():
                    loss = _loss(model, x, y)
                rt.backward(loss)
                rt.clip_grad_norm(model, opt, max_norm=1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                yield loss.detach()

        return _windows(steps(), args.log_every)
    finally:
        rt.teardown()


def fabric_side(model: nn.Module, data: list[Batch], args: argparse.Namespace) -> list[float]:
    from lightning.fabric import Fabric

    precision = "bf16-mixed" if args.dtype == torch.bfloat16 else "32-true"
    fabric = Fabric(accelerator=args.device.type, devices=1, precision=precision)  # type: ignore[arg-type]
    model, opt = fabric.setup(model, _optimizer(model, args.device))

    def steps() -> Iterator[torch.Tensor]:
        for x, y in data:
            x, y = fabric.to_device((x, y))
            loss = _loss(model, x, y)  # fabric.setup's model runs its forward under the precision's autocast
            fabric.backward(loss)
            fabric.clip_gradients(model, opt, max_norm=1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            yield loss.detach()

    return _windows(steps(), args.log_every)


def accelerate_side(model: nn.Module, data: list[Batch], args: argparse.Namespace) -> list[float]:
    from accelerate import Accelerator

    mixed = "bf16" if args.dtype == torch.bfloat16 else "no"
    accelerator = Accelerator(mixed_precision=mixed, cpu=args.device.type == "cpu")
    model, opt = accelerator.prepare(model, _optimizer(model, args.device))

    def steps() -> Iterator[torch.Tensor]:
        for x, y in data:
            x, y = x.to(accelerator.device, non_blocking=True), y.to(accelerator.device, non_blocking=True)
            loss = _loss(model, x, y)  # prepare's model runs its forward under autocast
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            yield loss.detach()

    return _windows(steps(), args.log_every)


SIDES: dict[str, tuple[Side, str | None]] = {  # name: (side, the package it needs)
    "raw": (raw_side, None),
    "trainmesh": (trainmesh_side, None),
    "fabric": (fabric_side, "lightning"),
    "accelerate": (accelerate_side, "accelerate"),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, help="steps per side per round (default: 60 on CUDA, 30 on the CPU)")
    parser.add_argument("--warmup", type=int, default=2, help="windows dropped at the start of every round")
    parser.add_argument("--log-every", type=int, help="steps per loss read-back (default: 10 on CUDA, 5 on the CPU)")
    parser.add_argument("--json", help="also write the results as JSON here")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    args.device = torch.device("cuda" if cuda else "cpu")
    args.dtype = torch.bfloat16 if cuda else torch.float32
    args.precision = "bf16-mixed" if cuda else "32-true"
    args.steps = args.steps or (60 if cuda else 30)
    args.log_every = args.log_every or (10 if cuda else 5)
    args.cfg = (
        GPTConfig(size="gpt2", block_size=1024, vocab_size=50304) if cuda else GPTConfig(size="tiny", vocab_size=256)
    )
    args.micro = 16 if cuda else 8
    return args


def main() -> None:
    args = parse_args()
    if args.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    cfg: GPTConfig = args.cfg
    gen = torch.Generator().manual_seed(0)
    data = [
        (
            torch.randint(cfg.vocab_size, (args.micro, cfg.block_size), generator=gen),
            torch.randint(cfg.vocab_size, (args.micro, cfg.block_size), generator=gen),
        )
        for _ in range(args.steps)
    ]
    base = GPT(cfg, seed=0)
    sides = {name: side for name, (side, package) in SIDES.items() if not package or importlib.util.find_spec(package)}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name, side in sides.items():
            per_step = side(copy.deepcopy(base), data, args)[args.warmup :]
            times[name] += per_step
            print(f"round {r} {name:11s} {1000 * statistics.median(per_step):8.2f} ms/step", flush=True)
            if args.device.type == "cuda":
                torch.cuda.empty_cache()
    tokens = args.micro * cfg.block_size
    peak = device_peak(args.device, args.dtype)
    raw = statistics.median(times["raw"])
    results = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        value = mfu(base.flops_per_token(), tokens / med, peak)
        results[name] = {"median_ms": 1000 * med, "ratio_to_raw": med / raw, "tokens_per_s": tokens / med, "mfu": value}
        share = f", MFU {value:.1%}" if value is not None else ""
        print(f"{name:11s} {1000 * med:8.2f} ms/step  {tokens / med:12,.0f} tok/s  {med / raw:.3f}× raw{share}")
    missing = [name for name in SIDES if name not in sides]
    if missing:
        print(f"left out (package not installed): {', '.join(missing)}")
    if args.json:
        info: dict[str, Any] = {"device": str(args.device), "torch": torch.__version__, "micro_batch": args.micro}
        info |= {"block_size": cfg.block_size, "size": cfg.size, "rounds": args.rounds, "steps": args.steps}
        with open(args.json, "w") as f:
            json.dump({**info, "log_every": args.log_every, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
