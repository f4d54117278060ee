"""Measured per-rank memory, by component, and step time of parallel layouts: what `trainmesh plan` must predict.

Each layout is a list of trainmesh config overrides and a world size. It runs in fresh gloo processes on the CPU
(`trainmesh.launch.spawn.run_distributed`, one thread per rank; more ranks than cores are oversubscribed), and every
rank builds exactly what a trainmesh run builds: `trainmesh.job.spec.load_config(config, overrides, "gpt")`,
`resolve(config, world_size)` -> Job, `job.runtime()`, then the training loop's own set-up
(`trainmesh.train.setup.set_up`: data, `recipe.build_model`, `runtime.setup` with the recipe's parallel plan,
`build_optimizer`, the loader) and the loop's own step (`trainmesh.train.loop.train_step`: the step's
micro-batches, `strategy.forward_backward` with the recipe's objective, `runtime.clip_grad_norm`, `runtime.step`,
`zero_grad`). Before anything runs, the parent resolves every layout, so that one trainmesh refuses is reported
with its error instead of being launched.

On every rank, in bytes of this rank's local tensors (a DTensor counts its local shard, `.to_local()`), in one
step after the warm-up steps:

- params: every parameter of the rank's model (its shards, or its pipeline stage), at rest after the step;
- grads: every `p.grad` after backward and clipping, when the optimizer starts its step (an optimizer step
  pre-hook), before `zero_grad`;
- optimizer: every tensor in `optimizer.state` after the step (AdamW: exp_avg, exp_avg_sq, step);
- act_peak (`trainmesh.apps.plan.probes.SavedActivations`, which the dry run uses too): the peak of the *live*
  activations saved for backward during the step. A
  `torch.autograd.graph.saved_tensors_hooks` pack hook sees every tensor autograd saves; each storage is counted
  once (views such as q, k, v of one qkv output are one storage) while any tensor saved on it is alive (a weak
  reference per saved tensor tells when autograd, in backward, lets go of it), and the total is taken at every
  pack. A pipeline schedule (1F1B) frees one micro-batch's saved tensors while later ones are being saved, so
  only a live peak is its memory. Parameters and their views (linear layers save their weight; under FSDP the
  all-gathered one) are not activations and are left out. A block under activation checkpointing saves nothing
  through these hooks (its own take over) and keeps only its input, so block inputs are recorded by a forward
  pre-hook as well (the same storage as ln_1's saved input without checkpointing: counted once). Split into
  act_peak_blocks / act_peak_outside: the two parts of the total at its peak (outside the blocks: embeddings,
  final LayerNorm, head, the loss's log-softmax);
- gathered_params (`probes.GatheredParams`): FSDP's unsharded parameters still registered in the model when a
  forward ends (a forward hook on each outermost FSDP unit, after FSDP's own), held in addition to the shards until
  backward; the largest over the step's forwards. Parameters that are not the ones registered at rest are the
  gathered ones (with tensor parallelism they are DTensors too). Without FSDP: 0;
- step_ms: the median wall time of `--steps` whole loop steps (`train_step`: reading the micro-batches, forward,
  backward, clip, optimizer step, zero_grad), each after a barrier, after `--warmup` steps and the memory step.

Not counted: the recomputed activations of a checkpointed block during its own backward (they go to the
checkpoint's hooks), a pipeline stage's output tensors held by the schedule until their backward (one
(micro-batch, T, C) tensor per micro-batch in flight, not saved by autograd), autograd's gradient buffers and
communication buffers. `gathered_params` is sampled at the ends of forwards only.

    OMP_NUM_THREADS=1 python benchmarks/plan_measure.py [--only ddp fsdp ...] [--world-sizes 1 2]
        [--micro-batch 4 --warmup 2 --steps 5 --config F.toml] [--json measured.json]
        [--extra NAME WORLD_SIZE "parallel.x=... ..."] [-- --model.size=tiny ...]

Overrides after `--` apply to every layout, after the default model (`DEFAULT_MODEL`), so they replace it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from memory import local, local_bytes
from trainmesh.apps.plan.probes import GatheredParams, SavedActivations
from trainmesh.config import ConfigError
from trainmesh.core.env import DistEnv
from trainmesh.job.spec import Job, load_config, resolve
from trainmesh.launch.spawn import DistributedTestError, run_distributed
from trainmesh.metrics.profiler import StepProfiler
from trainmesh.runtime.runtime import Runtime
from trainmesh.strategies.blocks import find_blocks
from trainmesh.train.hooks import RunHooks
from trainmesh.train.loop import train_step
from trainmesh.train.setup import Session, set_up

MiB = 2**20
DEFAULT_MODEL = ("--model.size=small", "--model.block_size=128", "--model.vocab_size=4096")
"""GPT small (6 blocks, 6 heads, C = 384), 128 tokens. The byte tokenizer of the embedded corpus needs a vocabulary
of 256; 4096 (divisible by any tp used here) makes the embedding, tied head and the loss's log-softmax visible
beside the blocks (1.6M of 12.2M parameters), as they are in real GPTs, and each pipeline end holds its copy."""
RUN = (
    "--run.progress=false",
    "--train.eval_every=0",
    "--checkpoint.final=false",
    "--sample.max_new_tokens=0",
    "--dist.device=cpu",
    "--dist.backend=gloo",
)
"""What every measured run sets: CPU and gloo, nothing but training steps."""


def pp2(schedule: str) -> tuple[str, ...]:
    """Two pipeline stages on `schedule`, each micro-batch cut into 4 pieces."""
    return ("--parallel.pp=2", f"--parallel.pipeline.schedule={schedule}", "--parallel.pipeline.microbatches=4")


@dataclass(frozen=True)
class Case:
    """One layout to measure: a name, a world size and the trainmesh overrides that ask for it."""

    name: str
    world_size: int
    overrides: tuple[str, ...]


CASES: tuple[Case, ...] = (
    Case("single", 1, ()),
    Case("single +AC", 1, ("--parallel.activation_checkpointing=1",)),
    Case("ddp", 2, ("--parallel.strategy=ddp",)),
    Case("ddp +AC", 2, ("--parallel.strategy=ddp", "--parallel.activation_checkpointing=1")),
    Case("fsdp", 2, ("--parallel.strategy=fsdp",)),
    Case("fsdp grad-op", 2, ("--parallel.strategy=fsdp", "--parallel.fsdp.reshard_after_forward=false")),
    Case("fsdp offload", 2, ("--parallel.strategy=fsdp", "--parallel.fsdp.cpu_offload=true")),
    Case("fsdp +AC", 2, ("--parallel.strategy=fsdp", "--parallel.activation_checkpointing=1")),
    Case("pp2 1f1b", 2, pp2("1f1b")),
    Case("pp2 gpipe", 2, pp2("gpipe")),
    Case("tp2", 2, ("--parallel.tp=2",)),
    Case("hsdp 2x2", 4, ("--parallel.strategy=fsdp", "--parallel.dp_replicate=2", "--parallel.dp_shard=2")),
    Case("pp2 x ddp2", 4, ("--parallel.strategy=ddp", *pp2("1f1b"))),
    Case("tp2 x fsdp2", 4, ("--parallel.strategy=fsdp", "--parallel.tp=2")),
    Case("pp2 x fsdp2 x tp2", 8, ("--parallel.strategy=fsdp", "--parallel.tp=2", *pp2("1f1b"))),
)
"""The layouts the planner is validated on: every one the CPU can run."""


# -- what one rank measures --------------------------------------------------------------------------------------------
def tensor_bytes(tensors: Iterator[Any]) -> int:
    return sum(local_bytes(t) for t in tensors if isinstance(t, torch.Tensor))


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values())


@dataclass
class Trainer:
    """The loop's step, as `trainmesh.train.loop._run` calls it (`train_step` sets the learning rate itself)."""

    job: Job
    runtime: Runtime
    session: Session
    batches: Iterator[Any]
    done: int = 0

    def step(self) -> None:
        self.done += 1
        train_step(self.session, self.done, self.batches, None)  # no metrics window here

    def timed_step(self) -> float:
        """Seconds of one step, started together on every rank (on a GPU: until the device is done with it)."""
        self.synchronize()
        self.runtime.barrier()
        start = time.perf_counter()
        self.step()
        self.synchronize()
        return time.perf_counter() - start

    def synchronize(self) -> None:
        if self.runtime.device.type == "cuda":
            torch.cuda.synchronize(self.runtime.device)


def measure_memory(trainer: Trainer) -> dict[str, int]:
    """One step with every memory probe on: bytes per component on this rank (see the module docstring)."""
    model, optimizer = trainer.session.raw_model, trainer.session.optimizer
    saved = SavedActivations(find_blocks(model))
    gathered = GatheredParams(model)
    grads: list[int] = []

    def before_optimizer_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        del opt, args, kwargs
        grads.append(tensor_bytes(p.grad for p in model.parameters()))

    handle = optimizer.register_step_pre_hook(before_optimizer_step)
    cuda = trainer.runtime.device.type == "cuda"
    if cuda:  # the device's own peak of this step too (what the allocator handed out; not its cache or context)
        trainer.synchronize()
        torch.cuda.reset_peak_memory_stats(trainer.runtime.device)
    try:
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            trainer.step()
    finally:
        handle.remove()
        peak, gathered_bytes = saved.close(), gathered.close()
    activations = {
        "act_peak": peak,
        "act_peak_blocks": saved.peak_split["blocks"],
        "act_peak_outside": saved.peak_split["outside"],
        "act_held_after_step": sum(saved.now.values()),
    }
    assert len(grads) == 1, f"the optimizer stepped {len(grads)} times in one step"
    device = {"device_peak": torch.cuda.max_memory_allocated(trainer.runtime.device)} if cuda else {}
    return {
        **device,
        "params": tensor_bytes(model.parameters()),
        "grads": grads[0],
        "optimizer": optimizer_bytes(optimizer),
        **activations,
        "gathered_params": gathered_bytes,
    }


def coordinates(runtime: Runtime) -> dict[str, int]:
    """This rank's place on the mesh: pipeline stage, tensor-parallel index, data-parallel replica."""
    mesh = runtime.strategy.mesh
    if mesh is None:
        return {"pp": 0, "tp": 0, "dp": runtime.strategy.dp_rank}
    return {"pp": mesh.coordinate("pp"), "tp": mesh.coordinate("tp"), "dp": mesh.dp_rank}


def count_parameters(job: Job, runtime: Runtime) -> int:
    """The whole model's parameters (a tied weight once), from a build on the meta device."""
    with torch.device("meta"):
        model = job.recipe.build_model(job.config, runtime)
    return sum(p.numel() for p in model.parameters())


def rank_main(
    rank: int, config_path: str | None, overrides: list[str], run_dir: str, warmup: int, steps: int
) -> dict[str, Any]:
    """In each rank: build what `trainmesh run` builds, take `warmup` steps, one measured step, `steps` timed ones."""
    del rank
    env = DistEnv.from_environ()
    job = resolve(load_config(config_path, overrides, "gpt"), env.world_size)
    runtime = job.runtime(env)
    folder = Path(run_dir)
    with StepProfiler(job.config.profile, folder, runtime.rank, runtime.device) as profiler:
        session = set_up(job.config, job.batch, job.recipe, runtime, folder, RunHooks(), profiler)
        try:
            trainer = Trainer(job, runtime, session, iter(session.loader))
            for _ in range(warmup):
                trainer.step()
            memory = measure_memory(trainer)
            times = [trainer.timed_step() for _ in range(steps)]
        finally:
            session.checkpointer.close()
            if session.writer:
                session.writer.close()
    return {
        "rank": runtime.rank,
        "coords": coordinates(runtime),
        "n_params": count_parameters(job, runtime),
        "param_numel": sum(local(p).numel() for p in session.raw_model.parameters()),
        **memory,
        "step_ms": 1000 * statistics.median(times),
        "step_ms_all": [1000 * t for t in times],
    }


# -- the parent: layouts in, results out ---------------------------------------------------------------------------
def case_overrides(case: Case, common: Sequence[str], micro_batch: int) -> list[str]:
    """Every override of a layout's run, in order (later wins): the run's, the model's, the layout's."""
    return [*RUN, *DEFAULT_MODEL, f"--train.micro_batch={micro_batch}", *case.overrides, *common]


def resolve_case(case: Case, overrides: list[str], config_path: str | None) -> Job | str:
    """The Job trainmesh resolves for a layout, or why it refuses it (its ConfigError / ValueError message)."""
    try:
        return resolve(load_config(config_path, overrides, "gpt"), case.world_size)
    except (ConfigError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


def measure_layout(
    case: Case,
    common: Sequence[str] = (),
    *,
    micro_batch: int = 4,
    config_path: str | None = None,
    warmup: int = 2,
    steps: int = 5,
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """Measure one layout on `case.world_size` fresh gloo ranks. `common`: overrides added to every layout's (after
    the default model, so they may replace it). Returns its JSON record: status ok | refused (by trainmesh's
    resolve, before launch) | failed (a rank raised), and per rank the measurements (see the module docstring)."""
    overrides = case_overrides(case, common, micro_batch)
    record: dict[str, Any] = {"name": case.name, "world_size": case.world_size, "overrides": overrides}
    job = resolve_case(case, overrides, config_path)
    if isinstance(job, str):
        return {**record, "status": "refused", "error": job}
    layout = {"strategy": job.layout.strategy, "dims": asdict(job.layout.dims), "batch": job.batch.describe()}
    record |= layout | {"config": job.config_dict()}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="plan_measure_") as run_dir:
        call = (config_path, overrides, run_dir, warmup, steps)
        try:
            ranks = run_distributed(rank_main, case.world_size, call, timeout_s=timeout_s)
        except DistributedTestError as e:
            return {**record, "status": "failed", "error": str(e), "wall_s": time.perf_counter() - started}
    n_params = ranks[0]["n_params"]
    per_rank = [{k: v for k, v in r.items() if k != "n_params"} for r in ranks]
    return {**record, "status": "ok", "n_params": n_params, "wall_s": time.perf_counter() - started, "ranks": per_rank}


def measure_layouts(
    cases: Sequence[Case],
    common: Sequence[str] = (),
    *,
    micro_batch: int = 4,
    config_path: str | None = None,
    warmup: int = 2,
    steps: int = 5,
) -> list[dict[str, Any]]:
    """`measure_layout` for each case, in order, one after another (each in its own processes)."""
    results = []
    for case in cases:
        result = measure_layout(
            case, common, micro_batch=micro_batch, config_path=config_path, warmup=warmup, steps=steps
        )
        print(f"  {case.name:<20} {case.world_size} ranks: {result['status']} ({result.get('wall_s', 0):.0f} s)")
        results.append(result)
    return results


def print_table(results: list[dict[str, Any]]) -> None:
    head = (
        f"{'layout':<18} {'rank':>4} {'pp/tp/dp':>8} | {'params':>7} {'grads':>7} {'optim':>7} | {'act pk':>7}"
        f" {'in blk':>7} {'outside':>7} | {'gath.p':>7} | {'step ms':>8}"
    )
    print(head)
    print("-" * len(head))
    for result in results:
        if result["status"] != "ok":
            print(f"{result['name']:<18} {result['status'].upper()}: {result['error']}")
            continue
        for r in result["ranks"]:
            c = r["coords"]
            print(
                f"{result['name']:<18} {r['rank']:>4} {c['pp']:>2}/{c['tp']}/{c['dp']:<3} |"
                f" {r['params'] / MiB:7.2f} {r['grads'] / MiB:7.2f} {r['optimizer'] / MiB:7.2f} |"
                f" {r['act_peak'] / MiB:7.2f} {r['act_peak_blocks'] / MiB:7.2f} {r['act_peak_outside'] / MiB:7.2f} |"
                f" {r['gathered_params'] / MiB:7.2f} | {r['step_ms']:8.0f}"
            )
    print(
        "\nMiB per rank. params / grads / optim: at rest after the step, grads before zero_grad; act pk: the live peak"
        "\nof activations saved for backward (storage-deduplicated, parameters excluded), split in / outside blocks at"
        "\nthat peak; gath.p: FSDP's unsharded parameters held at the end of a forward; step ms: median per rank"
        "\n(oversubscribed: more ranks than cores)."
    )


def select(cases: Sequence[Case], only: list[str] | None, world_sizes: list[int] | None) -> list[Case]:
    known = {case.name for case in cases}
    unknown = sorted(set(only or ()) - known)
    if unknown:
        raise SystemExit(f"--only: unknown layout(s) {unknown}; known: {', '.join(sorted(known))}")
    return [
        case
        for case in cases
        if (only is None or case.name in only) and (world_sizes is None or case.world_size in world_sizes)
    ]


def dashed(overrides: list[str]) -> tuple[str, ...]:
    return tuple(o if o.startswith("--") else f"--{o}" for o in overrides)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The script's options, and the trainmesh overrides after `--`."""
    common: list[str] = []
    if "--" in argv:
        argv, common = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="measure only these layouts (names as listed)")
    parser.add_argument("--world-sizes", nargs="+", type=int, metavar="N", help="only layouts of these world sizes")
    parser.add_argument(
        "--extra",
        nargs=3,
        action="append",
        default=[],
        metavar=("NAME", "WORLD_SIZE", "OVERRIDES"),
        help='another layout, e.g. --extra "fsdp 4" 4 "parallel.strategy=fsdp parallel.fsdp.prefetch=0" (overrides '
        "space-separated, their leading -- left out, as argparse would take them for options)",
    )
    parser.add_argument("--micro-batch", type=int, default=4, help="train.micro_batch (pipeline: a multiple of 4)")
    parser.add_argument("--config", help="a trainmesh TOML config under the overrides")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the measured ones")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (their median is step_ms)")
    parser.add_argument("--json", help="also write the results as JSON here")
    return parser.parse_args(argv), common


def main() -> None:
    args, common = parse_args(sys.argv[1:])
    extra = [Case(name, int(size), dashed(shlex.split(text))) for name, size, text in args.extra]
    cases = select(CASES, args.only, args.world_sizes) + extra
    started, load_before = time.perf_counter(), os.getloadavg()
    print(f"measuring {len(cases)} layouts, GPT {' '.join(DEFAULT_MODEL)} {' '.join(common)}", flush=True)
    results = measure_layouts(
        cases, common, micro_batch=args.micro_batch, config_path=args.config, warmup=args.warmup, steps=args.steps
    )
    total_s = time.perf_counter() - started
    print()
    print_table(results)
    print(f"total {total_s:.0f} s")
    if args.json:
        out = {
            "benchmark": "plan_measure",
            "command": shlex.join([sys.executable, *sys.argv]),
            "torch": torch.__version__,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "micro_batch": args.micro_batch,
            "warmup": args.warmup,
            "steps": args.steps,
            "bytes": "every memory figure is in bytes of this rank's local tensors",
            "total_s": total_s,
            "load_average": {"before": load_before, "after": os.getloadavg()},
            "layouts": results,
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
