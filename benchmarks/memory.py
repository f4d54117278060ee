"""Memory per rank: DDP vs FSDP (ZeRO), with CPU offload and activation checkpointing.

Each setup runs in its own pair of fresh gloo processes on the CPU (`trainmesh.launch.spawn.run_distributed`,
2 ranks × 1 thread): `Runtime(strategy=..., parallel=ParallelConfig(fsdp=FSDPConfig(...),
activation_checkpointing=...))`, a GPT
(`trainmesh.recipes.gpt.model.GPT`), `rt.setup(model)`, then AdamW built from the set-up model's parameters
(fsdp replaces them by shards), and one forward / backward / optimizer step on a fixed batch (the same
tokens in every setup; each rank has its own). On each rank it measures, in bytes of this rank's *local*
tensors (a DTensor counts its local shard, `.to_local()`):

- parameters: every parameter, at rest (after the step);
- gradients: every `p.grad`, after backward and before `zero_grad`;
- optimizer state: every tensor in `optimizer.state` (AdamW: exp_avg, exp_avg_sq, step), after the step;
- activations saved for backward: a `torch.autograd.graph.saved_tensors_hooks` pack hook around forward
  and loss sees every tensor autograd saves; each *storage* is counted once (views such as q, k, v of one
  qkv output are not double counted), at its size at the end of forward, i.e. what is held until
  backward. Saved tensors whose storage is a parameter's (linear layers save their weight; under FSDP
  the all-gathered weight) are not activations and are left out (JSON: `saved_params`). The rest is
  split into inside blocks and outside them (embeddings, final LayerNorm, lm_head, loss: the saved
  log-softmax of B×T×vocab floats is the largest). Activation checkpointing saves nothing inside a
  block (its own hooks take over there) and keeps only the block's input, outside autograd's saved
  tensors, so block inputs are recorded by a forward pre-hook on each block too (the same storage that
  ln_1 saves without checkpointing, so not counted twice).
- gathered parameters held between forward and backward (FSDP): the bytes of the unsharded parameters
  still registered in the model at the end of forward, held in addition to the shards. With
  `reshard_after_forward=false` that is every unit; with full shard none (trainmesh passes True
  explicitly, which reshards the root unit too; FSDP2's default, None, would keep the root gathered).
  DDP gathers nothing: 0.
- peak RSS (coarse): `resource.getrusage(RUSAGE_SELF).ru_maxrss` of each rank's process over its whole
  life (torch itself, the full model each rank builds before sharding, the step), and where Linux lets
  the peak be reset (/proc/self/clear_refs), the step's own peak above the resident size before it.

Beside the measurements it prints the theoretical per-rank bytes of fp32 AdamW for N ranks (Ψ parameters):
DDP/ZeRO-0 16Ψ, ZeRO-1 4Ψ + 4Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N, ZeRO-3 16Ψ/N.

    OMP_NUM_THREADS=1 python benchmarks/memory.py [--size small --batch 4 --block-size 128]
                                                  [--json docs/memory.json --plot docs/memory.png]
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from trainmesh.config.schema import FSDPConfig, ParallelConfig
from trainmesh.launch.spawn import run_distributed
from trainmesh.recipes.gpt.model import GPT, GPTConfig
from trainmesh.runtime.runtime import Runtime

MiB = 2**20
WORLD_SIZE = 2
STATE = ("params", "grads", "optimizer")
SAVED = ("act_blocks", "act_outside", "gathered_params")
"""Bars of the right-hand stack: activations saved in / outside blocks, gathered parameters held."""


@dataclass(frozen=True)
class Setup:
    name: str
    strategy: str
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    activation_checkpointing: int = 0
    zero: str = "ZeRO-0"
    """The theoretical level whose at-rest state this setup holds."""


SETUPS: tuple[Setup, ...] = (
    Setup("ddp", "ddp"),
    Setup("ddp +AC", "ddp", activation_checkpointing=1),
    Setup("fsdp", "fsdp", zero="ZeRO-3"),
    Setup("fsdp +AC", "fsdp", activation_checkpointing=1, zero="ZeRO-3"),
    Setup("fsdp no-reshard", "fsdp", reshard_after_forward=False, zero="ZeRO-3"),
    Setup("fsdp no-reshard +AC", "fsdp", reshard_after_forward=False, activation_checkpointing=1, zero="ZeRO-3"),
    Setup("fsdp cpu-offload", "fsdp", cpu_offload=True, zero="ZeRO-3"),
)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def local_bytes(t: torch.Tensor) -> int:
    lt = local(t)
    return lt.numel() * lt.element_size()


def storage_key(t: torch.Tensor) -> int:
    """The address of the storage behind `t`. Recording a tensor keeps its storage alive, so the address
    is not reused while it is counted, unless FSDP resized that storage to nothing (it frees gathered
    weights that way); `SavedTensors._record` then lets the new owner of the address replace it."""
    return int(t.untyped_storage().data_ptr())


class SavedTensors:
    """What autograd saves during forward, by storage: activations in / outside blocks, parameters."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        self.model = model
        self.where = "act_outside"
        self.seen: dict[int, tuple[str, torch.Tensor]] = {}
        self.handles = []
        for block in blocks:
            self.handles.append(block.register_forward_pre_hook(self._enter))
            self.handles.append(block.register_forward_hook(self._leave))

    def _param_storages(self) -> set[int]:
        # The parameters registered right now: FSDP swaps in the unsharded ones while a unit is gathered.
        return {local(p).untyped_storage().data_ptr() for p in self.model.parameters()} - {0}

    def _record(self, t: torch.Tensor, kind: str | None = None) -> None:
        t = local(t)
        key = storage_key(t)
        if t.untyped_storage().nbytes() == 0:
            return
        if key in self.seen and self.seen[key][1].untyped_storage().nbytes() > 0:
            return  # the same live storage (e.g. q, k and v are views of one qkv output)
        if kind is None:
            is_param = t.untyped_storage().data_ptr() in self._param_storages()
            kind = "params" if is_param else self.where
        self.seen[key] = (kind, t)

    def _enter(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        del module
        self.where = "act_blocks"
        for arg in args:  # the block input: what activation checkpointing keeps
            if isinstance(arg, torch.Tensor):
                self._record(arg, "act_blocks")

    def _leave(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        del module, args, output
        self.where = "act_outside"

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self._record(t)
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def held(self) -> dict[str, int]:
        """Bytes per kind still allocated now (call at the end of forward); forgets the tensors."""
        totals: dict[str, int] = defaultdict(int)
        for kind, t in self.seen.values():
            totals[kind] += t.untyped_storage().nbytes()
        self.seen.clear()
        for handle in self.handles:
            handle.remove()
        return {
            "act_blocks": totals["act_blocks"],
            "act_outside": totals["act_outside"],
            "saved_params": totals["params"],
        }


def proc_status(field: str) -> int | None:
    """A `kB` field of /proc/self/status in bytes (VmRSS, VmHWM), or None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset this process's peak resident size (VmHWM) to the current one; Linux >= 4.0."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def rank_main(rank: int, setup: dict[str, Any], size: str, vocab: int, block_size: int, batch: int) -> dict[str, Any]:
    fsdp = FSDPConfig(reshard_after_forward=setup["reshard_after_forward"], cpu_offload=setup["cpu_offload"])
    parallel = ParallelConfig(fsdp=fsdp, activation_checkpointing=setup["activation_checkpointing"])
    rt = Runtime(strategy=setup["strategy"], parallel=parallel, seed=0)
    raw = GPT(GPTConfig(size=size, vocab_size=vocab, block_size=block_size))
    n_params = sum(p.numel() for p in raw.parameters())  # tied wte/lm_head counted once
    blocks = list(raw.blocks)
    model = rt.setup(raw)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, vocab, (batch, block_size + 1), generator=torch.Generator().manual_seed(1000 + rank))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    rt.barrier()
    peak_reset = reset_peak_rss()
    rss_before = proc_status("VmRSS")
    start = time.perf_counter()
    tracker = SavedTensors(model, blocks)
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
        logits = model(inputs)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
    del logits
    saved = tracker.held()
    # FSDP registers a unit's unsharded parameters (plain tensors) while it is gathered, its shards
    # (DTensors) otherwise: the plain ones at the end of forward are the copies held until backward.
    gathered = sum(local_bytes(p) for p in model.parameters() if not isinstance(p, DTensor))
    if setup["strategy"] != "fsdp":
        gathered = 0  # DDP's parameters are the weights themselves, nothing is gathered
    rt.backward(loss)
    grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    step_s = time.perf_counter() - start
    step_peak = proc_status("VmHWM") if peak_reset else None
    optim = sum(local_bytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    params = sum(local_bytes(p) for p in model.parameters())
    return {
        "n_params": n_params,
        "params": params,
        "grads": grads,
        "optimizer": optim,
        **saved,
        "gathered_params": gathered,
        "loss": float(loss.detach()),
        "step_s": step_s,
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
        "step_peak_rss_above_start": (step_peak - rss_before) if step_peak and rss_before else -1,
    }


def theory(psi: int, n: int) -> dict[str, float]:
    """Per-rank bytes of weights + gradients + Adam moments in fp32 (ZeRO paper, fp32 variant)."""
    return {
        "ZeRO-0": 16 * psi,
        "ZeRO-1": 4 * psi + 4 * psi + 8 * psi / n,
        "ZeRO-2": 4 * psi + 12 * psi / n,
        "ZeRO-3": 16 * psi / n,
    }


def plot(results: dict[str, dict[str, Any]], levels: dict[str, float], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(15, 6.5))
    width = 0.38
    state_colors = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868"}
    saved_colors = {"act_blocks": "#c44e52", "act_outside": "#8172b3", "gathered_params": "#937860"}
    labels = {
        "params": "parameters",
        "grads": "gradients",
        "optimizer": "optimizer state (AdamW)",
        "act_blocks": "activations saved in blocks (incl. block inputs)",
        "act_outside": "activations saved outside blocks (emb, ln_f, lm_head, loss)",
        "gathered_params": "FSDP: gathered (unsharded) params held from forward to backward",
    }
    for i, name in enumerate(names):
        r = results[name]
        bottom = 0.0
        for key in STATE:
            ax.bar(
                i - width / 2,
                r[key] / MiB,
                width,
                bottom=bottom,
                color=state_colors[key],
                label=labels[key] if i == 0 else None,
            )
            bottom += r[key] / MiB
        ax.text(i - width / 2, bottom, f"{bottom:.0f}", ha="center", va="bottom", fontsize=8)
        bottom = 0.0
        for key in SAVED:
            ax.bar(
                i + width / 2,
                r[key] / MiB,
                width,
                bottom=bottom,
                color=saved_colors[key],
                hatch="//",
                edgecolor="white",
                label=labels[key] if i == 0 else None,
            )
            bottom += r[key] / MiB
        ax.text(i + width / 2, bottom, f"{bottom:.0f}", ha="center", va="bottom", fontsize=8)
    for level, value in levels.items():
        ax.axhline(value / MiB, color="black", linestyle=":", linewidth=1)
        ax.text(
            len(names) - 0.45,
            value / MiB,
            f"{level} theory: {value / MiB:.0f} MiB",
            va="center",
            fontsize=8,
            bbox={"facecolor": "white", "edgecolor": "none", "pad": 1},
        )
    ax.set_xticks(range(len(names)), names, rotation=15)
    ax.set_xlim(-0.6, len(names) + 0.9)
    ax.set_ylabel("MiB per rank")
    ax.set_xlabel("setup (left bar: state at rest, solid; right bar: held from forward to backward, hatched)")
    ax.set_title(title + "\ndotted: theoretical params + grads + AdamW state per rank (fp32, N = 2)", fontsize=11)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", help="GPT size (model.size): nano | tiny | small | gpt2 ...")
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--block-size", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--json", help="also write the results as JSON here")
    parser.add_argument("--plot", help="also draw a bar chart (PNG) here")
    args = parser.parse_args()

    started = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    per_rank: dict[str, list[dict[str, Any]]] = {}
    for setup in SETUPS:
        call = (asdict(setup), args.size, args.vocab, args.block_size, args.batch)
        ranks = run_distributed(rank_main, WORLD_SIZE, call, timeout_s=600)
        per_rank[setup.name] = ranks
        results[setup.name] = {k: max(r[k] for r in ranks) for k in ranks[0] if k != "loss"}  # the larger rank
        print(f"  ran {setup.name:<22} step {results[setup.name]['step_s']:.2f} s", flush=True)
    psi = results["ddp"]["n_params"]
    levels = theory(psi, WORLD_SIZE)
    ddp_state = sum(results["ddp"][k] for k in STATE)
    ddp_act = results["ddp"]["act_blocks"] + results["ddp"]["act_outside"]

    tokens = args.batch * args.block_size
    print(
        f"\nGPT {args.size}: Ψ = {psi:,} parameters (fp32), vocab {args.vocab}, {args.batch}×{args.block_size} tokens"
    )
    print(f"per rank, {WORLD_SIZE} gloo ranks on CPU, one AdamW step; MiB (the larger of the two ranks)\n")
    head = (
        f"{'setup':<21} {'params':>7} {'grads':>7} {'optim':>7} {'state':>7} {'÷DDP':>6} {'theory':>13}"
        f" | {'act blk':>7} {'act out':>7} {'act':>7} {'÷DDP':>6} {'gath.p':>7}"
        f" | {'maxrss':>7} {'step pk':>7}"
    )
    print(head)
    print("-" * len(head))
    for s in SETUPS:
        r = results[s.name]
        state = sum(r[k] for k in STATE)
        act = r["act_blocks"] + r["act_outside"]
        step_peak = f"{r['step_peak_rss_above_start'] / MiB:7.0f}" if r["step_peak_rss_above_start"] >= 0 else "    n/a"
        print(
            f"{s.name:<21} {r['params'] / MiB:7.1f} {r['grads'] / MiB:7.1f} {r['optimizer'] / MiB:7.1f}"
            f" {state / MiB:7.1f} {state / ddp_state:6.3f} {s.zero:>6} {levels[s.zero] / MiB:6.1f}"
            f" | {r['act_blocks'] / MiB:7.1f} {r['act_outside'] / MiB:7.1f} {act / MiB:7.1f} {act / ddp_act:6.3f}"
            f" {r['gathered_params'] / MiB:7.1f} | {r['ru_maxrss'] / MiB:7.0f} {step_peak}"
        )
    print("\ntheory, fp32 AdamW, per rank, N = 2:")
    formulas = {"ZeRO-0": "16Ψ (DDP)", "ZeRO-1": "4Ψ+4Ψ+8Ψ/N", "ZeRO-2": "4Ψ+12Ψ/N", "ZeRO-3": "16Ψ/N"}
    for level, value in levels.items():
        print(f"  {level}  {formulas[level]:<12} {value / MiB:8.1f} MiB   ({value / levels['ZeRO-0']:.3f} of DDP)")
    print(
        "\nstate = params + grads + optimizer at rest; act = activations saved for backward (storage-deduplicated)"
        "\ngath.p = FSDP's unsharded parameters still held at the end of forward, beside the shards (DDP: 0)"
        "\nmaxrss = ru_maxrss of the rank's process (coarse: torch, the unsharded model built before setup, the step)"
        "\nstep pk = the step's peak RSS above the RSS before it (coarse)"
        f"\ntotal {time.perf_counter() - started:.0f} s"
    )
    title = (
        f"Per-rank memory, GPT {args.size} ({psi / 1e6:.1f}M params, fp32 AdamW), {WORLD_SIZE} ranks, "
        f"{args.batch}×{args.block_size} tokens per rank (CPU, gloo)"
    )
    if args.plot:
        plot(results, levels, title, args.plot)
    if args.json:
        out = {
            "size": args.size,
            "vocab": args.vocab,
            "block_size": args.block_size,
            "batch": args.batch,
            "tokens_per_rank": tokens,
            "world_size": WORLD_SIZE,
            "psi": psi,
            "theory_bytes": levels,
            "setups": {s.name: asdict(s) for s in SETUPS},
            "results_bytes": results,
            "per_rank": per_rank,
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
