"""Shared test helpers: a tiny GPT configuration, rank functions that train it and report back, and the bytes a
GPT forward leaves for backward (the activation model's measurement)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import Dataset

from trainmesh.checkpoint.state import TRAINER_STATE
from trainmesh.config import Config, dump_toml, load_toml
from trainmesh.config.loader import config_to_dict
from trainmesh.config.schema import DistConfig, ParallelConfig
from trainmesh.core.env import free_port
from trainmesh.job.spec import load_config
from trainmesh.job.worker import run_worker
from trainmesh.metrics.sinks import read_metrics
from trainmesh.recipes.base import Datasets, Recipe
from trainmesh.recipes.gpt import GPTRecipe
from trainmesh.recipes.gpt.model import GPT, IGNORE_INDEX, GPTConfig, summed_lm_loss
from trainmesh.recipes.gpt.parallel import parallelize_gpt
from trainmesh.runtime.runtime import Runtime
from trainmesh.strategies.plan import ParallelPlan
from trainmesh.train.loop import TrainResult

NANO = [
    "--model.size=nano",
    "--model.block_size=32",
    "--train.micro_batch=4",
    "--train.max_steps=4",
    "--train.eval_every=0",
    "--train.eval_samples=16",
    "--sample.max_new_tokens=0",
    "--run.progress=false",
    "--run.log_every=1",
    "--data.max_corpus_mb=0.25",
    "--checkpoint.final=false",
    "--optim.warmup_steps=2",
    "--optim.lr=1e-2",
    "--dist.timeout_s=20",  # a rank left waiting in a collective fails the test in seconds, not minutes
    "--dist.stall_timeout_s=30",  # and one stuck elsewhere is ended by the stall watchdog
]


def nano_config(root: Path, *overrides: str) -> Config:
    """A 2-layer, 32-wide GPT on a 0.25 MiB slice of the embedded corpus; trains in about a second."""
    return load_config(
        None, [*NANO, f"--data.cache_dir={root / 'cache'}", f"--run.out_dir={root / 'runs'}", *overrides], "gpt"
    )


class PaddedTargets(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Wraps a token dataset and masks a sample-dependent number of trailing targets with ignore_index,
    so micro-batches (and ranks) hold different numbers of targets."""

    def __init__(self, inner: Dataset[Any], block_size: int) -> None:
        self.inner = inner
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.inner[index]
        y = y.clone()
        masked = (index * 7) % (self.block_size - 1)  # 0 .. T-2 targets hidden, never all of them
        if masked:
            y[-masked:] = IGNORE_INDEX
        return x, y


class PaddedGPTRecipe(GPTRecipe):
    def prepare(self, config: Config, runtime: Runtime) -> Datasets:
        train, val = super().prepare(config, runtime)
        block_size = config.model.block_size  # type: ignore[attr-defined]
        return Datasets(PaddedTargets(train, block_size), PaddedTargets(val, block_size))


def train_rank(rank: int, root: str, overrides: list[str], padded: bool = False) -> dict[str, Any]:
    """Rank function for `run_distributed`: train the nano GPT and return weights and losses."""
    config = nano_config(Path(root), *overrides)
    recipe: Recipe | None = PaddedGPTRecipe() if padded else None
    params: dict[str, torch.Tensor] = {}
    sharded: list[str] = []

    def gather(result: TrainResult) -> None:  # while the group exists: fsdp parameters are shards
        state = result.model.state_dict()
        sharded.extend(k for k, v in state.items() if isinstance(v, DTensor) and v.to_local().numel() < v.numel())
        params.update({k: _full(v).detach().cpu().clone() for k, v in state.items()})

    run_dir = Path(root) / "runs" / config.run.id
    result = run_worker(config, run_dir, recipe=recipe, before_teardown=gather)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] if rank == 0 else []
    return {
        "rank": rank,
        "params": params,
        "sharded": sharded,  # names of parameters this rank held only a part of
        "train_loss": result.train_loss,
        "val_loss": result.val_loss,
        "losses": [r["loss"] for r in records if r["kind"] == "train"],  # logged per window (rank 0's log)
        "grad_norms": [r["grad_norm"] for r in records if r["kind"] == "train"],  # before clipping, per step
    }


def train_rank_runs(rank: int, root: str, runs: list[list[str]], padded: bool = False) -> list[dict[str, Any]]:
    """`train_rank` for several runs one after another in the same processes: one process start (most
    of a small test's time) for many settings. Each run joins and leaves its own process group, on a
    fresh port that rank 0 picks and hands over in a file (the last run's store may still hold its own)."""
    results = []
    spawn = os.environ["MASTER_PORT"]  # names this spawn's handover files: several spawns may share `root`
    for i, overrides in enumerate(runs):
        if i:
            handover = Path(root) / f"port_{spawn}_{i}"
            if rank == 0:
                (Path(root) / f"port_{spawn}_{i}.tmp").write_text(str(free_port()))
                (Path(root) / f"port_{spawn}_{i}.tmp").rename(handover)
            deadline = time.monotonic() + 60
            while not handover.exists():
                assert time.monotonic() < deadline, "rank 0 did not hand over the next port"
                time.sleep(0.05)
            os.environ["MASTER_PORT"] = handover.read_text()
        results.append(train_rank(rank, root, overrides, padded))
    return results


def assert_same_training(got: dict[str, Any], reference: dict[str, Any], what: str, rel: float = 1e-4) -> None:
    """The per-step losses and gradient norms (before clipping) of rank 0's log match the reference's.
    Parameters alone can hide a gradient off by a constant factor: with clipping active at every step,
    or without it, AdamW's update hardly depends on the gradient's scale; its norm does."""
    assert len(reference["losses"]) == len(reference["grad_norms"]) > 0, f"{what}: the reference logged no steps"
    assert got["losses"] == pytest.approx(reference["losses"], rel=rel), f"{what}: per-step losses"
    assert got["grad_norms"] == pytest.approx(reference["grad_norms"], rel=rel), f"{what}: per-step gradient norms"


def nano_toml(root: Path) -> Path:
    """The nano settings as a TOML file, for tests that drive the real command line."""
    path = root / "nano.toml"
    path.write_text(dump_toml(config_to_dict(nano_config(root))))
    return path


def _full(value: torch.Tensor) -> torch.Tensor:
    """A sharded (fsdp) parameter gathered whole; collective, so every rank calls it in the same order."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (from /proc, Linux only)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo.extend(children.get(found[-1], []))
    return found


def val_losses(run_dir: Path) -> list[float]:
    """Validation losses in order, the untrained model's (step 0) first."""
    return [r["val_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "val"]


def train_records(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]


def assert_learned(run_dir: Path, by: float) -> None:
    untrained, *_, trained = val_losses(run_dir)
    assert trained < untrained - by, (untrained, trained)
    assert train_records(run_dir)[-1]["peak_mem_gb"] > 0


def assert_config_recorded(run_dir: Path, since_step: int = 0) -> int:
    """config.toml in `run_dir` equals the config every checkpoint of the run (from step `since_step` on: those
    of the latest attempt) records, both being the Job's; returns how many checkpoints were compared."""
    written = load_toml(run_dir / "config.toml")
    states = sorted((run_dir / "checkpoints").glob(f"step_*/{TRAINER_STATE}"))
    states = [s for s in states if int(s.parent.name.removeprefix("step_")) >= since_step]
    for path in states:
        recorded = json.loads(path.read_text())["config"]
        assert _without_none(recorded) == written, f"{path} records another config than {run_dir / 'config.toml'}"
    return len(states)


def rank_output(log_dir: Path, rank: int, stream: str = "stderr") -> str:
    """What `rank` wrote to `stream` in the last attempt of the newest launch that kept its logs in `log_dir`
    (`<run>/logs` unless --log-dir said otherwise)."""
    launch = max(log_dir.iterdir(), key=lambda p: p.stat().st_mtime)
    attempt = max(launch.glob("attempt_*"), key=_attempt_order)
    return (attempt / f"rank_{rank}" / f"{stream}.log").read_text()


def _attempt_order(folder: Path) -> tuple[int, int]:
    """attempt_<n> sorts as (n, 1); attempt_<n>-<k>, a later round of attempt n (nodes joined or left), as (n, k)."""
    restart, _, round_ = folder.name.removeprefix("attempt_").partition("-")
    return int(restart), int(round_ or 1)


def _without_none(data: dict[str, Any]) -> dict[str, Any]:
    """As config.toml holds it: TOML has no null, so unset options are left out."""
    return {k: _without_none(v) if isinstance(v, dict) else v for k, v in data.items() if v is not None}


def refused_before_writing(tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """`trainmesh <argv>`, run in this process: exit code 2, no run folder written, no launch, no traceback; the
    message on stderr."""
    from trainmesh.cli import main

    assert main(list(argv)) == 2
    assert not (tmp_path / "runs").exists()
    err = capsys.readouterr().err
    assert "torchrun" not in err and "Traceback" not in err
    return err


def gpt_saved_bytes(
    shape: tuple[int, int, int, int, int, int],
    precision: str = "32-true",
    checkpoint_every: int = 0,
    attention: str = "flash",
    tp: int = 1,
) -> tuple[list[int], int, int]:
    """What one forward and loss of trainmesh's GPT (`shape`: n_layer, n_head, n_embd, vocab, seq, batch) leave for
    backward on this rank, set up as trainmesh trains it (Runtime.setup: the precision's module conversion, tensor
    parallelism by the GPT's plan, the blocks' checkpointing; the forward and loss under its autocast, as
    Strategy.forward_backward runs them), on the CPU: see `saved_activation_bytes`. `attention="math"` runs SDPA's
    unfused path; with `tp` > 1 call it in each of `tp` ranks (trainmesh.testing.run_distributed)."""
    n_layer, n_head, n_embd, vocab, seq, batch = shape
    parallel = ParallelConfig(tp=tp, activation_checkpointing=checkpoint_every)
    rt = Runtime(precision=precision, parallel=parallel, dist_config=DistConfig(device="cpu"), seed=0)
    cfg = GPTConfig(size="nano", n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=seq, vocab_size=vocab)
    raw = GPT(cfg)
    blocks = list(raw.blocks)
    model = rt.setup(raw, plan=ParallelPlan(tensor_parallel=parallelize_gpt))
    x, y = (torch.randint(vocab, (batch, seq)) for _ in range(2))  # the same on every rank (seed 0)

    def forward() -> None:
        kernel = sdpa_kernel(SDPBackend.MATH) if attention == "math" else contextlib.nullcontext()
        with rt.autocast(), kernel:
            summed_lm_loss(model(x), y)

    return saved_activation_bytes(model, blocks, forward)


def saved_activation_bytes(
    model: torch.nn.Module, blocks: list[torch.nn.Module], forward: Callable[[], object]
) -> tuple[list[int], int, int]:
    """What `forward()` leaves for backward: bytes held in each block, outside the blocks, and of both autocast's
    copies of weights. Each storage counts once (q, k and v are views of one), in this rank's local part (a DTensor
    its `.to_local()`), at its size when `forward` returns; storages of parameters are not activations. A checkpointed
    block keeps its input outside autograd's saved tensors (the checkpoint's own hooks take over inside it), so every
    block's input is recorded by a forward pre-hook too: the same storage ln_1 saves where it is not checkpointed."""
    params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[str, bool, torch.Tensor]] = {}
    where = ["outside"]

    def record(t: torch.Tensor, place: str) -> None:
        key = _local(t).untyped_storage().data_ptr()
        if key not in params and key not in seen:
            seen[key] = (place, _is_weight_copy(t), _local(t))

    def enter(index: int) -> Callable[[torch.nn.Module, tuple[Any, ...]], None]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            where[0] = str(index)
            record(args[0], where[0])

        return hook

    handles = [block.register_forward_pre_hook(enter(i)) for i, block in enumerate(blocks)]
    handles += [block.register_forward_hook(lambda *_: where.__setitem__(0, "outside")) for block in blocks]

    def pack(t: torch.Tensor) -> torch.Tensor:
        record(t, where[0])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    for handle in handles:
        handle.remove()
    per_block, outside, copies = [0] * len(blocks), 0, 0
    for place, copy, t in seen.values():
        size = t.untyped_storage().nbytes()
        copies += size if copy else 0
        if place == "outside":
            outside += size
        else:
            per_block[int(place)] += size
    return per_block, outside, copies


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _is_weight_copy(t: torch.Tensor) -> bool:
    """Whether `t` is (a transpose of) a cast of a leaf: autocast's copy of a weight, which a linear layer saves."""
    fn = t.grad_fn
    while fn is not None and fn.name() == "TBackward0":
        fn = fn.next_functions[0][0]
    if fn is None or fn.name() != "ToCopyBackward0":
        return False
    source = fn.next_functions[0][0]
    return source is not None and source.name() == "torch::autograd::AccumulateGrad"
