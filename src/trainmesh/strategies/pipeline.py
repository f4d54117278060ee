"""Pipeline parallelism (`parallel.pp > 1`) on `torch.distributed.pipelining`: the recipe's stages on their ranks,
run on one of its schedules (gpipe, 1f1b, interleaved, zero-bubble, dualpipev), each stage wrapped by the
data-parallel strategy.

Details: docs/internals.md#strategiespipelinepy
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from trainmesh.config.schema import PipelineConfig
from trainmesh.core.env import DistEnv
from trainmesh.precision import Precision
from trainmesh.strategies.base import Objective, Strategy
from trainmesh.strategies.gradients import clip_gradients
from trainmesh.strategies.mesh import ParallelMesh
from trainmesh.strategies.plan import ParallelPlan
from trainmesh.strategies.schedules import SCHEDULES, schedule_problem, shared_across_v_message

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)


class PipelineStrategy(Strategy):
    name = "pipeline"

    @property
    def collective_forward(self) -> bool:
        return True

    def __init__(
        self, env: DistEnv, device: torch.device, inner: Strategy, options: PipelineConfig, *, mesh: ParallelMesh
    ) -> None:
        super().__init__(
            env, device, mesh=mesh, activation_checkpointing=inner.activation_checkpointing, compile=inner.compile
        )
        problem = schedule_problem(options, mesh.dims.pp)
        if problem:
            raise ValueError(problem)
        self.inner, self.options = inner, options
        self.pp, self.pp_rank = mesh.dims.pp, mesh.coordinate("pp")
        _, per_rank, style = SCHEDULES[options.schedule]
        self.num_stages = self.pp * per_rank
        if style == "v":  # rank r holds stages r and 2p-1-r
            self.stage_ids = [self.pp_rank, self.num_stages - 1 - self.pp_rank]
        else:  # rank r holds stages r, r+p, r+2p, ...
            self.stage_ids = list(range(self.pp_rank, self.num_stages, self.pp))
        self._stages: dict[int, nn.Module] = {}  # stage index -> its (wrapped) module, this rank's only
        self.pipeline_stages: list[Any] = []
        """torch's PipelineStage objects of this rank, in stage order (e.g. to time their compute)."""
        self._schedule: Any = None
        self._step_options: dict[str, Any] = {}
        self._step_losses: list[torch.Tensor] = []
        self._loss: Callable[[Any, Any], torch.Tensor] | None = None
        # weights tied across pipeline ranks: (this rank's copy, its holders' group, counted in the norm here)
        self._tied: list[tuple[nn.Parameter, dist.ProcessGroup | None, bool]] = []
        self._inferred = False  # whether the schedule has run once (and learned the stages' shapes)
        self._canonical: dict[str, str] = {}  # this rank's name of a tied weight -> the whole model's

    @property
    def schedule(self) -> Any:
        """torch's schedule object this rank steps (None until setup_module)."""
        return self._schedule

    @property
    def dp_size(self) -> int:
        return self.inner.dp_size

    @property
    def dp_rank(self) -> int:
        return self.inner.dp_rank

    @property
    def owns_loss(self) -> bool:
        return self.num_stages - 1 in self.stage_ids and self.inner.owns_loss

    @property
    def holds_whole_model(self) -> bool:
        return False

    def _stage_rank(self, stage: int) -> int:
        """The pipeline position (0..pp-1) of the rank that runs `stage`."""
        if SCHEDULES[self.options.schedule][2] == "v":
            return stage if stage < self.pp else self.num_stages - 1 - stage
        return stage % self.pp

    # -- model --------------------------------------------------------------------------------------
    def setup_module(self, module: nn.Module, plan: ParallelPlan | None = None) -> nn.Module:
        """Build this rank's stages, give each tensor parallelism, block transforms and the data-parallel
        wrapper, and the schedule; returns one module that holds this rank's parameters under their
        original names (for the optimizer and checkpoints)."""
        if plan is None or plan.pipeline_stage is None:
            raise ValueError(
                f"parallel.pp={self.pp}, but this recipe cannot be cut into pipeline stages. Fix: --parallel.pp=1."
            )
        tied = _tied_names(module)
        parts: list[nn.Module] = []
        for index in self.stage_ids:
            stage = plan.pipeline_stage(module, index, self.num_stages)
            parts.append(stage)
            inside = {id(m) for m in stage.modules()}  # the plan's blocks that this stage holds
            blocks = None if plan.blocks is None else [b for b in plan.blocks if id(b) in inside]
            stage_plan = ParallelPlan(blocks, plan.tensor_parallel, init_weights=plan.init_weights)
            self._stages[index] = self.inner.setup_module(stage, stage_plan)
        held = _merge(parts)
        self._build_schedule()
        self._tie_across_stages(held, tied)
        # A tied weight held here under another name than the whole model's (the last stage's
        # lm_head.weight for wte.weight) keeps its optimizer state under the whole model's name in
        # checkpoints, so they load into any strategy.
        local = set(dict(held.named_parameters()))
        self._canonical = {name: group[0] for group in tied if group[0] not in local for name in group if name in local}
        return held

    def _build_schedule(self) -> None:
        # Imported here, where it is used: torch.distributed.pipelining imports torch._dynamo, about half a
        # second that every process of a job without pipeline parallelism would spend for nothing.
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        torch_name, per_rank, _ = SCHEDULES[self.options.schedule]
        group = self.mesh.pp_group if self.mesh else None
        stages = [PipelineStage(self._stages[i], i, self.num_stages, self.device, group=group) for i in self.stage_ids]
        self.pipeline_stages = stages
        schedule_class = get_schedule_class(torch_name)
        self._schedule = schedule_class(
            stages if per_rank > 1 else stages[0],
            n_microbatches=self.options.microbatches,
            loss_fn=self._stage_loss,
            scale_grads=False,  # our loss already carries the global-mean scale
        )
        # The last stage would keep every piece's output (the logits) to return them merged, until the next step
        # begins; the loop needs only the losses (a torch whose step takes return_outputs can be told so)
        step = inspect.signature(self._schedule.step).parameters
        self._step_options = {"return_outputs": False} if "return_outputs" in step else {}

    def _stage_loss(self, output: Any, targets: Any) -> torch.Tensor:
        assert self._loss is not None
        return self._loss(output, targets)

    def _tie_across_stages(self, held: nn.Module, tied: list[list[str]]) -> None:
        """Find weights tied across ranks of the pipeline (held under different names on different
        ranks) and make a group of those ranks, for every pipeline of the mesh, to sum their gradients.

        A V schedule puts the first and the last stage on one rank. A weight tied between them stays one
        tensor there only without sharding, tensor parallelism, a meta build or DDP (two DDP wrappers
        cannot share a parameter); otherwise it would silently become two weights, so it is refused."""
        assert self.mesh is not None and self.mesh.pp_group is not None
        names = dict(held.named_parameters(remove_duplicate=False))
        mine = [[name for name in group if name in names] for group in tied]
        for here in mine:
            if len(here) > 1 and (len({id(names[n]) for n in here}) > 1 or self.inner.dp_size > 1):
                raise ValueError(shared_across_v_message(self.options.schedule, here))
        everyone: list[Any] = [None] * self.pp
        dist.all_gather_object(everyone, [bool(m) for m in mine], group=self.mesh.pp_group)
        # One pipeline per column: the mesh (pp, dp_replicate, dp_shard, tp) numbers ranks in that order, so pipeline
        # position h of column c is rank h * columns + c (computed, not read from the mesh tensor, which a dry run
        # makes fake)
        columns = self.mesh.dims.world_size // self.pp
        for i, names_here in enumerate(mine):
            holders = [r for r in range(self.pp) if everyone[r][i]]
            if len(holders) < 2:
                continue
            ranks = [[h * columns + col for h in holders] for col in range(columns)]
            group, _ = dist.new_subgroups_by_enumeration(ranks)  # collective: every rank makes every group
            if names_here:
                self._tied.append((names[names_here[0]], group, self.pp_rank == holders[0]))

    def wrap(self, module: nn.Module, blocks: list[nn.Module]) -> nn.Module:
        raise AssertionError("each stage is wrapped by the data-parallel strategy, in setup_module")

    @property
    def whole_model_names(self) -> dict[str, str]:
        return dict(self._canonical)

    def parameter_stages(self) -> dict[str, int]:
        stages: dict[str, int] = {}
        for index in sorted(self._stages):  # stage names are the whole model's (the stages share its submodules)
            for name, _ in self.inner.unwrap(self._stages[index]).named_parameters():
                stages.setdefault(name, index)
        return stages

    # -- state --------------------------------------------------------------------------------------
    def state_dicts(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        model_state, optim_state = super().state_dicts(module, optimizer)
        return model_state, _renamed(optim_state, self._canonical)

    def load_state_dicts(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        model_state: dict[str, Any],
        optim_state: dict[str, Any],
    ) -> None:
        local = {canonical: name for name, canonical in self._canonical.items()}
        super().load_state_dicts(module, optimizer, model_state, _renamed(optim_state, local))

    # -- one step -----------------------------------------------------------------------------------
    def forward_backward(
        self,
        module: nn.Module,
        batch: Any,
        objective: Objective,
        scale: Callable[[], float],
        precision: Precision,
        mark: Callable[[str], None] | None = None,
    ) -> torch.Tensor:
        """One pass of the schedule over the micro-batch (cut into `microbatches` pieces); returns the
        summed loss on the rank that owns it, zero elsewhere. The schedule interleaves forward and backward
        passes, so the step-time breakdown counts all of it as forward (`mark` is not called)."""
        del module, mark
        inputs, targets = objective.split(batch)
        losses: list[torch.Tensor] = []

        def loss(output: Any, targets: Any) -> torch.Tensor:
            summed = objective.loss(output, targets)
            losses.append(summed.detach())
            return summed * scale()

        self._loss = loss
        hooks = [] if self._inferred else self._infer_shapes_in_eval_mode()
        with precision.autocast():
            if 0 in self.stage_ids:
                self._schedule.step(inputs, target=targets, **self._step_options)
            else:
                self._schedule.step(target=targets, **self._step_options)
        for hook in hooks:
            hook.remove()
        self._inferred, self._loss = True, None
        # In the first step torch also calls the loss once on uninitialised activations to learn the
        # gradient shapes: only the last `microbatches` losses are the batch's.
        losses = losses[-self.options.microbatches :]
        total = torch.stack(losses).sum() if losses else torch.zeros((), device=self.device)
        return total if self.owns_loss else torch.zeros_like(total)

    def _infer_shapes_in_eval_mode(self) -> list[RemovableHandle]:
        """torch's PipelineStage learns the shapes passed between stages in the first step, by one
        forward of each stage, on uninitialised tensors for all but the first stage. Run that forward in
        eval mode, so it leaves no trace: batch-norm statistics are not updated (they would turn to
        NaN) and dropout draws no random numbers."""
        hooks = []
        for module in self._stages.values():
            first = [True]

            def to_eval(mod: nn.Module, args: Any, first: list[bool] = first) -> None:
                if first[0]:
                    mod.eval()

            def back_to_train(mod: nn.Module, args: Any, output: Any, first: list[bool] = first) -> None:
                if first[0]:
                    first[0] = False
                    mod.train()

            hooks += [module.register_forward_pre_hook(to_eval), module.register_forward_hook(back_to_train)]
        return hooks

    def clip_grad_norm(self, module: nn.Module, max_norm: float) -> torch.Tensor:
        """Sum the gradients of weights tied across stages, then clip by the norm over all stages."""
        params = [p for p in module.parameters() if p.grad is not None]
        duplicates: set[int] = set()
        for p, group, counts_here in self._tied:
            if p.grad is None:
                continue
            if isinstance(p, DTensor) and isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                # e.g. a vocabulary-parallel embedding's gradient comes back replicated: take this
                # rank's rows, so both holders all-reduce the same part
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
            dist.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, group=group)
            if not counts_here:
                duplicates.add(id(p))
        counted = [p for p in params if id(p) not in duplicates]
        assert self.mesh is not None
        return clip_gradients(params, max_norm, group=self.mesh.pp_group, counted=counted)

    @torch.no_grad()
    def evaluate(
        self, module: nn.Module, batch: Any, objective: Objective, precision: Precision
    ) -> dict[str, torch.Tensor] | None:
        """A forward through the stages in order, passing activations point to point (any batch shape,
        unlike a schedule); the last stage computes the sums."""
        del module
        inputs, targets = objective.split(batch)
        x: Any = inputs
        with precision.autocast():
            for stage in range(self.num_stages):
                owner = self._stage_rank(stage)
                if owner != self.pp_rank:
                    continue
                if stage > 0 and self._stage_rank(stage - 1) != owner:
                    x = self._recv(self._stage_rank(stage - 1))
                x = self.inner.unwrap(self._stages[stage])(x)
                if stage < self.num_stages - 1 and self._stage_rank(stage + 1) != owner:
                    self._send(x, self._stage_rank(stage + 1))
            if self.owns_loss:
                return objective.sums(x, targets)
        return None

    def _send(self, tensor: torch.Tensor, pp_rank: int) -> None:
        assert self.mesh is not None and tensor.dim() <= 6
        header = torch.zeros(8, dtype=torch.int64)
        header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
        peer = self.mesh.pp_peer(pp_rank)
        dist.send(header.to(self.device), dst=peer)
        dist.send(tensor.contiguous(), dst=peer)

    def _recv(self, pp_rank: int) -> torch.Tensor:
        assert self.mesh is not None
        peer = self.mesh.pp_peer(pp_rank)
        header = torch.zeros(8, dtype=torch.int64, device=self.device)
        dist.recv(header, src=peer)
        ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
        tensor = torch.empty(header[2 : 2 + ndim].tolist(), dtype=dtype, device=self.device)
        dist.recv(tensor, src=peer)
        return tensor


def _tied_names(module: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one tensor (e.g. GPT's wte.weight and lm_head.weight)."""
    names: dict[int, list[str]] = defaultdict(list)
    for name, param in module.named_parameters(remove_duplicate=False):
        names[id(param)].append(name)
    return [group for group in names.values() if len(group) > 1]


def _renamed(optim_state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """An optimizer state dict (keyed by parameter name) with parameters renamed by `names`."""
    if not names:
        return optim_state
    groups = [{**group, "params": [names.get(p, p) for p in group["params"]]} for group in optim_state["param_groups"]]
    return {
        **optim_state,
        "state": {names.get(k, k): v for k, v in optim_state["state"].items()},
        "param_groups": groups,
    }


def _merge(parts: list[nn.Module]) -> nn.Module:
    """One module holding the submodules of all `parts` under their names, so parameter names are
    those of the whole model. Containers held by several parts (blocks.<i>, ResNet's stages.<i>.<j>)
    are merged at every depth."""
    if len(parts) == 1:
        return parts[0]
    merged = nn.Module()
    for part in parts:
        _merge_into(merged, part)
    held = {id(p) for p in merged.parameters()}
    assert held == {id(p) for part in parts for p in part.parameters()}, "a stage's parameters were lost"
    return merged


def _merge_into(target: nn.Module, part: nn.Module) -> None:
    for name, child in part.named_children():
        current = getattr(target, name, None)
        if current is None or current is child:
            target.add_module(name, child)
        elif isinstance(current, nn.ModuleDict) and isinstance(child, nn.ModuleDict):
            combined = nn.ModuleDict(dict(current.items()))  # a new container: the stages keep theirs
            _merge_into(combined, child)
            target.add_module(name, combined)
        else:
            raise ValueError(f"pipeline stages on one rank both hold a different {name!r}")
