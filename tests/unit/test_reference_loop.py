"""An absolute reference: trainmesh's training against a plain PyTorch loop written here, step by step.

Every parity test compares trainmesh with trainmesh (N ranks against one, strategy against strategy), so a bug
that scales every gradient alike on every layout (a loss normalised by twice the target count, accumulation
that forgets to divide by the micro-steps, gradients doubled before clipping) passes them all. Here the same
model, batches and optimizer train through trainmesh, once by the GPT recipe's loop as the worker runs it in
one process (`run_worker`) and once by a user's own loop on `Runtime` (docs/library.md), and through a loop of
plain torch that uses no trainmesh code but the model class and the data: loss = cross-entropy averaged over
the targets, backward of loss / micro-steps, clip_grad_norm_, step, zero_grad. The per-step loss, gradient norm
(before clipping), gradients the optimizer sees and weights must agree, with SGD (whose update shows a gradient's
scale; with clipping active only the norm shows it) and AdamW (which all but hides it from the update), clipping on
and off, accumulation 1 and more. Where both sides do the same arithmetic, they agree bit for bit.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainmesh.train.setup
from support import PaddedTargets, nano_config, train_records
from trainmesh.config.schema import Config, DistConfig, OptimConfig
from trainmesh.job.worker import run_worker
from trainmesh.recipes.base import Datasets
from trainmesh.recipes.gpt import GPTRecipe
from trainmesh.recipes.gpt.model import GPT, IGNORE_INDEX, GPTConfig
from trainmesh.runtime.runtime import Runtime
from trainmesh.train.parity import ParityProbe

Weights = dict[str, torch.Tensor]
Batch = tuple[torch.Tensor, torch.Tensor]  # tokens (B, T), targets (B, T)
MakeOptimizer = Callable[[nn.Module], torch.optim.Optimizer]


@dataclass
class Trace:
    """One run, step by step. `weights[0]` are the initial weights, `weights[k]` those after step k."""

    losses: list[float] = field(default_factory=list)
    """The mean loss over the step's targets."""
    grad_norms: list[float] = field(default_factory=list)
    """The global gradient norm before clipping."""
    grads: list[Weights] = field(default_factory=list)
    """The gradients the optimizer stepped with (after clipping)."""
    weights: list[Weights] = field(default_factory=list)


def _weights(model: nn.Module) -> Weights:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _grads(model: nn.Module) -> Weights:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


# -- the reference: plain PyTorch -----------------------------------------------------------------------------
def plain_training(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: list[list[Batch]],
    max_norm: float,
    lr: Callable[[int], float] | None = None,
    global_mean: bool = False,
) -> Trace:
    """Train `model` on `steps` (each a list of micro-batches) in plain torch. `max_norm` 0: no clipping (the
    norm is measured all the same). `lr(k)`: the learning rate of step k (from 0). `global_mean`: divide each
    micro-batch's summed loss by the step's whole target count, the mean over the step's targets when micro-batches
    hold different numbers of them; otherwise the mean over each micro-batch's targets divided by the micro-steps."""
    trace = Trace(weights=[_weights(model)])
    params = list(model.parameters())
    for k, micro_batches in enumerate(steps):
        if lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr(k)
        accum = len(micro_batches)
        total = sum(int((y != IGNORE_INDEX).sum()) for _, y in micro_batches)
        step_loss = 0.0
        for x, y in micro_batches:
            logits = model(x)  # (B, T, V)
            flat_logits, flat_y = logits.reshape(-1, logits.size(-1)), y.reshape(-1)
            if global_mean:
                loss = F.cross_entropy(flat_logits, flat_y, ignore_index=IGNORE_INDEX, reduction="sum") / total
            else:
                loss = F.cross_entropy(flat_logits, flat_y) / accum
            loss.backward()
            step_loss += loss.item()
        if max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        trace.losses.append(step_loss)
        trace.grad_norms.append(float(norm))
        trace.grads.append(_grads(model))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        trace.weights.append(_weights(model))
    return trace


def assert_same_trace(got: Trace, ref: Trace, rel: float = 0, atol: float = 0, loss_rel: float = 0) -> None:
    """Step by step, the first difference named: the gradient norm, gradients and weights within `rel` and `atol`,
    the loss within `loss_rel` (0: bit for bit)."""
    assert len(got.weights) == len(ref.weights) > 1, (len(got.weights), len(ref.weights))
    _assert_close(got.weights[0], ref.weights[0], 0, 0, "the initial weights")
    for k in range(len(ref.losses)):
        where = f"step {k + 1}"
        assert got.losses[k] == pytest.approx(ref.losses[k], rel=loss_rel, abs=0), f"{where}: loss"
        assert got.grad_norms[k] == pytest.approx(ref.grad_norms[k], rel=rel, abs=0), f"{where}: gradient norm"
        _assert_close(got.grads[k], ref.grads[k], rel, atol, f"{where}: gradients")
        _assert_close(got.weights[k + 1], ref.weights[k + 1], rel, atol, f"{where}: weights")


def _assert_close(got: Weights, ref: Weights, rel: float, atol: float, what: str) -> None:
    assert got.keys() == ref.keys(), what
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=rel, atol=atol, msg=_prefixed(f"{what}, {name}"))


def _prefixed(where: str) -> Callable[[str], str]:
    return lambda message: f"{where}: {message}"


# -- (a) the GPT recipe's loop, as the worker runs it in one process ------------------------------------------
class Recorder(ParityProbe):
    """The loop's probe seam (the parity check's), recording whole tensors instead of fingerprints: the weights
    before the first step and after each, and the gradients right after Runtime.clip_grad_norm."""

    def __init__(self) -> None:
        super().__init__(Path(os.devnull))
        self.trace = Trace()

    def before_step(self, runtime: Runtime, model: nn.Module) -> None:
        if not self.trace.weights:
            self.trace.weights.append(_weights(model))

    def gradients(
        self, step: int, runtime: Runtime, model: nn.Module, grad_norm: torch.Tensor, max_norm: float
    ) -> None:
        self.trace.grad_norms.append(float(grad_norm))
        self.trace.grads.append(_grads(model))

    def after_step(
        self, step: int, runtime: Runtime, model: nn.Module, loss: torch.Tensor, targets: float, stepped: bool
    ) -> None:
        assert stepped
        self.trace.losses.append(float(loss) / targets)
        self.trace.weights.append(_weights(model))


class DataGPT(GPTRecipe):
    """The GPT recipe, keeping its training set for the reference to read; `padded`: with a sample-dependent
    number of trailing targets masked, so micro-batches hold different numbers of targets."""

    def __init__(self, padded: bool = False) -> None:
        super().__init__()
        self.padded = padded
        self.train_set: Any = None

    def prepare(self, config: Config, runtime: Runtime) -> Datasets:
        train, val = super().prepare(config, runtime)
        if self.padded:
            block_size = config.model.block_size  # type: ignore[attr-defined]
            train, val = PaddedTargets(train, block_size), PaddedTargets(val, block_size)
        self.train_set = train
        return Datasets(train, val)


def _sgd(model: nn.Module, lr: float = 0.0) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def _adamw_as_documented(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The recipe's optimizer as docs/config.md describes it: AdamW, matrices and embeddings decayed."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def _lr(cfg: OptimConfig, max_steps: int) -> Callable[[int], float]:
    """optim's schedule for step k (from 0): linear warmup to lr, then a cosine down to min_lr."""

    def lr(k: int) -> float:
        if k < cfg.warmup_steps:
            return cfg.lr * (k + 1) / cfg.warmup_steps
        progress = (k - cfg.warmup_steps) / (max_steps - cfg.warmup_steps)
        return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))

    return lr


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 40 kB text file (tokenised once, into a cache beside it) for every recipe run here: the embedded corpus
    would walk the standard library for each run."""
    folder = tmp_path_factory.mktemp("corpus")
    words = ["tensor", "gradient", "rank", "shard", "loss", "step", "batch", "norm", "clip", "mesh", "the", "a"]
    gen = torch.Generator().manual_seed(0)
    text = " ".join(words[int(i)] for i in torch.randint(len(words), (7000,), generator=gen))
    (folder / "text.txt").write_text(text)
    return folder


RECIPE_CASES = {  # optimizer, grad_clip, micro-steps per step, padded targets, model.loss_chunk_tokens
    "adamw-clip-accum1": ("adamw", 1.0, 1, False, 0),
    "adamw-noclip-accum2": ("adamw", 0.0, 2, False, 0),
    "sgd-clip-accum1": ("sgd", 0.5, 1, False, 0),
    "sgd-noclip-accum2-padded": ("sgd", 0.0, 2, True, 0),
    # the head fused with the loss, 48 tokens at a time (a micro-batch holds 128): the plain head's arithmetic, but
    # the weight's gradient is summed over chunks, so the last bits may differ (SGD: the update shows their scale)
    "sgd-noclip-accum2-padded-chunked": ("sgd", 0.0, 2, True, 48),
}


@pytest.mark.parametrize("case", RECIPE_CASES)
def test_the_recipe_loop_trains_as_plain_pytorch_does(
    case: str, corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    optimizer, clip, accum, padded, chunk = RECIPE_CASES[case]
    micro = 4
    config = nano_config(
        tmp_path,
        f"--model.loss_chunk_tokens={chunk}",
        f"--data.source={corpus / 'text.txt'}",
        f"--data.cache_dir={corpus / 'cache'}",
        "--data.shuffle=false",  # step k reads samples k·G .. (k+1)·G - 1 in order: the reference needs no sampler
        f"--train.micro_batch={micro}",
        f"--train.global_batch={micro * accum}",
        f"--train.grad_clip={clip}",
        "--train.max_steps=4",
        "--dist.device=cpu",  # fp32 on the CPU, as the reference, on a machine with a GPU too
    )
    if optimizer == "sgd":  # the recipe builds AdamW; SGD's update is proportional to the gradient
        monkeypatch.setattr(trainmesh.train.setup, "build_optimizer", lambda model, cfg, device: _sgd(model, cfg.lr))
    recorder, recipe = Recorder(), DataGPT(padded)
    monkeypatch.setattr(ParityProbe, "from_environ", classmethod(lambda cls: recorder))  # the worker's probe
    run_dir = tmp_path / "runs" / "trainmesh"
    run_worker(config, run_dir, recipe=recipe)
    got = recorder.trace

    model_cfg = config.model
    assert isinstance(model_cfg, GPTConfig)
    model = GPT(model_cfg, config.run.seed)  # the recipe's model class and seed
    opt = _sgd(model) if optimizer == "sgd" else _adamw_as_documented(model, config.optim)
    steps = [
        [_collate(recipe.train_set, range((k * accum + j) * micro, (k * accum + j + 1) * micro)) for j in range(accum)]
        for k in range(config.train.max_steps)
    ]
    ref = plain_training(model, opt, steps, clip, _lr(config.optim, config.train.max_steps), global_mean=padded)

    if clip:  # clipping took part: it hides a gradient's scale from the update, not from the norm
        assert max(ref.grad_norms) > clip, ref.grad_norms
    # Micro-batches of 128 or 256 targets: the loop's scale (1 / count) and the mean's division are the same exact
    # arithmetic, so everything is bit for bit. Padded counts are not powers of two: the loop multiplies by 1 / count
    # where the mean divides by it, and sums the step's loss in float64, so they may differ in the last bit.
    rel, atol, loss_rel = (1e-6, 1e-8, 1e-6) if padded else (0, 0, 0)
    if chunk:
        rel, atol, loss_rel = 1e-5, 1e-7, 1e-6
    assert_same_trace(got, ref, rel, atol, loss_rel)
    logged = train_records(run_dir)  # what the user sees: metrics.jsonl, one record per step (run.log_every=1)
    assert [r["step"] for r in logged] == list(range(1, len(ref.losses) + 1))
    assert [r["loss"] for r in logged] == pytest.approx(ref.losses, rel=loss_rel, abs=0)
    assert [r["grad_norm"] for r in logged] == pytest.approx(ref.grad_norms, rel=rel, abs=0)


def _collate(dataset: Any, ids: range) -> Batch:
    samples = [dataset[i] for i in ids]
    return torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples])


# -- (b) a user's own loop on Runtime (docs/library.md) -------------------------------------------------------
def runtime_training(
    model: nn.Module, make_optimizer: MakeOptimizer, steps: list[list[Batch]], max_norm: float
) -> Trace:
    """The loop of docs/library.md, one process: the Runtime places and wraps, the user's code computes the loss."""
    rt = Runtime(dist_config=DistConfig(device="cpu"))
    trace = Trace(weights=[_weights(model)])
    try:
        model, optimizer = rt.setup(model, make_optimizer(model))
        for micro_batches in steps:
            accum, step_loss = len(micro_batches), 0.0
            for i, batch in enumerate(micro_batches):
                x, y = rt.to_device(batch)
                last = i == accum - 1
                with rt.no_sync(model, enabled=not last), rt.autocast():
                    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                scaled = loss / accum
                rt.backward(scaled)
                step_loss += scaled.item()
            norm = rt.clip_grad_norm(model, optimizer, max_norm=max_norm)
            trace.losses.append(step_loss)
            trace.grad_norms.append(float(norm))
            trace.grads.append(_grads(rt.unwrap(model)))
            assert rt.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            trace.weights.append(_weights(rt.unwrap(model)))
    finally:
        rt.teardown()
    return trace


def _library_batches(vocab: int, seq: int, micro: int, accum: int, n_steps: int) -> Iterator[list[Batch]]:
    gen = torch.Generator().manual_seed(0)
    for _ in range(n_steps):
        yield [(torch.randint(vocab, (micro, seq), generator=gen), torch.randint(vocab, (micro, seq), generator=gen))
               for _ in range(accum)]  # fmt: skip


OPTIMIZERS: dict[str, MakeOptimizer] = {
    "sgd": lambda model: torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
    "adamw": lambda model: torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
}


@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("clip", [0.0, 0.5])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_runtime_loop_trains_as_plain_pytorch_does(optimizer: str, clip: float, accum: int) -> None:
    cfg = GPTConfig(size="nano", block_size=16, vocab_size=64)
    model = GPT(cfg, seed=0)
    reference = copy.deepcopy(model)  # the same initial weights, the head still tied to the embedding
    steps = list(_library_batches(cfg.vocab_size, cfg.block_size, micro=4, accum=accum, n_steps=3))
    got = runtime_training(model, OPTIMIZERS[optimizer], steps, clip)
    ref = plain_training(reference, OPTIMIZERS[optimizer](reference), steps, clip)
    if clip:
        assert max(ref.grad_norms) > clip, ref.grad_norms
    assert_same_trace(got, ref)  # the same arithmetic in the same order: bit for bit
