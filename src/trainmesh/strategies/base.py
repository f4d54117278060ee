"""The Strategy seam: how the model is wrapped, how gradients are synchronised and how state is saved.

The training loop calls only these methods (`forward_backward`, `evaluate`, `no_sync`,
`clip_grad_norm`, `state_dicts`); it never asks which strategy it runs under, so FSDP, tensor and
pipeline parallelism plug in here without touching the loop.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainmesh.core.env import DistEnv
from trainmesh.precision import Precision
from trainmesh.strategies.blocks import find_blocks, transform_blocks
from trainmesh.strategies.gradients import clip_gradients
from trainmesh.strategies.mesh import ParallelMesh
from trainmesh.strategies.plan import ParallelPlan


def place(module: nn.Module, device: torch.device) -> nn.Module:
    """`module` on `device`: moved only where a parameter or buffer is elsewhere (moving one in place would swap
    every tensor, which the fake tensors of `trainmesh check --dry-run` cannot be)."""
    tensors = [*module.parameters(), *module.buffers()]
    if any(t.device != device for t in tensors):
        module.to(device)
    return module


@dataclass(frozen=True)
class Objective:
    """What to compute on a batch. Forward and loss are separate steps, since a pipeline runs the
    forward over several ranks and computes the loss on the last."""

    split: Callable[[Any], tuple[Any, Any]]
    """batch -> (model input, targets)"""
    loss: Callable[[Any, Any], torch.Tensor]
    """(output, targets) -> the loss summed over the targets"""
    sums: Callable[[Any, Any], dict[str, torch.Tensor]]
    """(output, targets) -> validation sums, the summed loss under "loss" (Recipe.output_sums)"""
    forward: Callable[[nn.Module, Any, Any], Any] = lambda module, inputs, targets: module(inputs)
    """(module, input, targets) -> output: where the model is not split into pipeline stages, the model may take the
    targets too (Recipe.forward; a GPT then computes its head with the loss, model.loss_chunk_tokens)"""


class Strategy(ABC):
    """One way of placing a model on devices and keeping its replicas or shards consistent."""

    name: str

    def __init__(
        self,
        env: DistEnv,
        device: torch.device,
        *,
        mesh: ParallelMesh | None = None,
        activation_checkpointing: int = 0,
        compile: bool = False,
    ) -> None:
        self.env = env
        self.device = device
        self.activation_checkpointing = activation_checkpointing
        """Recompute every Nth block's activations in backward (parallel.activation_checkpointing; 0: none)."""
        self.compile = compile
        """torch.compile the model (train.compile): as one graph or block by block, see compiles_whole_model."""
        self.mesh = mesh
        """The device mesh when there is model parallelism (tp, pp) or fsdp; None otherwise."""

    # -- data-parallel geometry: which slice of each global batch this process reads ----------------
    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas whose gradients are averaged."""
        return self.mesh.dims.dp_size if self.mesh else 1

    @property
    def dp_rank(self) -> int:
        return self.mesh.dp_rank if self.mesh else 0

    @property
    def owns_loss(self) -> bool:
        """Whether this rank reports its replica's loss and counts its targets. Tensor-parallel peers
        compute the same loss and pipeline stages before the last none, so exactly one rank of each
        replica does; the loop sums over all ranks and gets every target once."""
        return self.mesh is None or self.mesh.coordinate("tp") == 0

    @property
    def seed_rank(self) -> int:
        """Ranks with the same number draw the same random numbers (dropout): tensor-parallel peers
        must, since they hold the same replicated activations."""
        return self.env.rank // (self.mesh.dims.tp if self.mesh else 1)

    @property
    def collective_forward(self) -> bool:
        """Whether a forward pass communicates (sharded parameters, tensor parallelism): then every
        rank must run the same number of forwards, e.g. in evaluation, and none may run one alone."""
        return self.mesh is not None and self.mesh.tp_mesh is not None

    @property
    def holds_whole_model(self) -> bool:
        """Whether every rank runs the whole model's forward (not so for pipeline stages)."""
        return True

    @property
    def devices_per_process(self) -> int:
        """Accelerators one process computes on (several only for nn.DataParallel); used for MFU."""
        return 1

    # -- model --------------------------------------------------------------------------------------
    def setup_module(self, module: nn.Module, plan: ParallelPlan | None = None) -> nn.Module:
        """Apply tensor parallelism (parallel.tp > 1), transform the blocks (strategies/blocks.py), then
        place and wrap the model; returns the module to train. The order is fixed, see plan.py."""
        plan = plan or ParallelPlan()
        blocks = find_blocks(module) if plan.blocks is None else plan.blocks
        on_meta = any(p.is_meta for p in module.parameters())
        if on_meta and plan.init_weights is None:
            raise ValueError(
                "the model was built on the meta device (parallel.meta_init=true), but nothing initialises "
                "its weights afterwards. Fix: --parallel.meta_init=false, or give the recipe's ParallelPlan "
                "an init_weights function."
            )
        tp_mesh = self.mesh.tp_mesh if self.mesh else None
        if tp_mesh is not None:
            if plan.tensor_parallel is None:
                raise ValueError(
                    f"parallel.tp={tp_mesh.size()}, but this recipe has no tensor-parallel plan. "
                    "Fix: --parallel.tp=1 (use parallel.dp_shard or parallel.pp to spread the model instead)."
                )
            if not on_meta:
                place(module, self.device)
            plan.tensor_parallel(module, tp_mesh)
        whole = self.compile and self.compiles_whole_model
        transform_blocks(
            module, blocks, checkpoint_every=self.activation_checkpointing, compile=self.compile and not whole
        )
        if whole:
            # In place (names and state-dict keys stay), and inside the wrapper, so that evaluation and sampling,
            # which run the unwrapped model, are compiled too; DDP's graph splitting at its buckets still applies.
            module.compile()
        if on_meta and not self.shards_parameters:  # DDP broadcasts real weights when it wraps
            self._materialize(module, plan)
        wrapped = self.wrap(module, blocks)
        if on_meta and self.shards_parameters:  # storage for this rank's shards only
            self._materialize(module, plan)
        return wrapped

    @property
    def compiles_whole_model(self) -> bool:
        """Whether train.compile compiles the wrapped model as one graph (fewer launches and host work per
        step; under DDP, torch's DDPOptimizer still cuts it at the gradient buckets so communication overlaps
        backward) rather than each block (needed where blocks are sharded or split across ranks)."""
        return False

    @property
    def shards_parameters(self) -> bool:
        """Whether `wrap` replaces parameters by shards (then a meta model is materialised after it)."""
        return False

    @property
    def materialize_device(self) -> torch.device:
        """Where the parameters of a model built on the meta device get their storage."""
        return self.device

    def _materialize(self, module: nn.Module, plan: ParallelPlan) -> None:
        """Storage for the meta parameters, then their initial values. `to_empty` makes one tensor per
        module, so parameters shared between modules (tied weights) are tied again."""
        assert plan.init_weights is not None
        holders: dict[int, list[tuple[nn.Module, str]]] = {}
        for owner in module.modules():
            for name, param in owner.named_parameters(recurse=False):
                holders.setdefault(id(param), []).append((owner, name))
        module.to_empty(device=self.materialize_device)
        for (first_owner, first_name), *others in (h for h in holders.values() if len(h) > 1):
            shared = getattr(first_owner, first_name)
            for owner, name in others:
                if getattr(owner, name) is not shared:
                    setattr(owner, name, shared)
        plan.init_weights(module)

    @abstractmethod
    def wrap(self, module: nn.Module, blocks: list[nn.Module]) -> nn.Module:
        """Move the model to its device(s) and wrap it for this strategy."""

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The user's own module inside any wrapper (for sampling, export, parameter counts)."""
        inner = getattr(module, "module", None)
        return inner if isinstance(inner, nn.Module) else module

    @property
    def whole_model_names(self) -> dict[str, str]:
        """This rank's names of parameters that the whole model calls otherwise: a weight tied across pipeline
        stages is the last stage's `lm_head.weight` here and the model's `wte.weight`. Empty elsewhere."""
        return {}

    def parameter_stages(self) -> dict[str, int]:
        """The pipeline stage that holds each of this rank's parameters, by name (its first, when two stages on
        this rank share one); empty without pipeline parallelism, where the whole model is stage 0."""
        return {}

    @contextlib.contextmanager
    def no_sync(self, module: nn.Module, enabled: bool) -> Iterator[None]:
        """Skip gradient synchronisation for non-final micro-steps of an accumulation window."""
        del module, enabled
        yield

    def forward_backward(
        self,
        module: nn.Module,
        batch: Any,
        objective: Objective,
        scale: Callable[[], float],
        precision: Precision,
        mark: Callable[[str], None] | None = None,
    ) -> torch.Tensor:
        """Run forward and backward on one micro-batch; returns this rank's share of the reported loss
        (the summed loss, detached; zero where another rank reports it, see `owns_loss`).

        `scale()` turns the summed loss into this micro-batch's share of the global mean, with
        the gradient averaging of data parallelism already accounted for (see core/batch.py). It is
        called after the forward, so the all-reduce it may wait for overlaps the forward pass.
        """
        inputs, targets = objective.split(batch)
        with precision.autocast():
            loss = objective.loss(objective.forward(module, inputs, targets), targets)
        scaled = loss * scale()
        if mark is not None:
            mark("backward")
        precision.backward(scaled)
        return loss.detach() if self.owns_loss else torch.zeros_like(loss.detach())

    @torch.no_grad()
    def evaluate(
        self, module: nn.Module, batch: Any, objective: Objective, precision: Precision
    ) -> dict[str, torch.Tensor] | None:
        """Validation sums of one batch (`objective.sums`); None on ranks that do not own the loss.
        Runs the user's module, outside any data-parallel wrapper (whose forward may communicate)."""
        inputs, targets = objective.split(batch)
        with precision.autocast():
            sums = objective.sums(objective.forward(self.unwrap(module), inputs, targets), targets)
        return sums if self.owns_loss else None

    def clip_grad_norm(self, module: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip to `max_norm` (no clipping when <= 0) and return the total norm before clipping."""
        if self.mesh is not None and self.mesh.tp_mesh is not None:  # tensor-parallel shards beside plain tensors
            return clip_gradients(list(module.parameters()), max_norm)
        limit = max_norm if max_norm > 0 else float("inf")
        return torch.nn.utils.clip_grad_norm_(module.parameters(), limit)

    # -- state --------------------------------------------------------------------------------------
    def state_dicts(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        """Model and optimizer state keyed by parameter name, free of wrapper prefixes (DCP-ready)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict  # here: 1 s of import, for saving

        return get_state_dict(module, optimizer)

    def load_state_dicts(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        model_state: dict[str, Any],
        optim_state: dict[str, Any],
    ) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(module, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)

    def rank_state(self) -> dict[str, Any]:
        """State of this rank alone that a resume needs (e.g. a comm hook's error feedback), as CPU tensors and
        plain values: saved in the checkpoint's per-rank file, loaded with weights_only."""
        return {}

    def load_rank_state(self, saved: dict[str, Any]) -> None:
        """Restore `rank_state()`'s output, saved by this rank of a job of the same world size."""
        del saved

    def on_skipped_step(self) -> None:
        """The step's gradients were not finite and the optimizer skipped it: forget what was built from them."""
        return  # most strategies keep nothing of a step's gradients

    @property
    def hears_of_skips(self) -> bool:
        """Whether `on_skipped_step` must run as the step is skipped (then the loop reads its decision at once)."""
        return False
