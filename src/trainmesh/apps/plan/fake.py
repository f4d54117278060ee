"""The private PyTorch tools behind `trainmesh check --dry-run`, kept in this one module (written against torch 2.13):
the fake process group (`torch.testing._internal.distributed.fake_pg`: one process plays one rank of any world size,
no collective moves data), `FakeTensorMode` (tensors with shapes, dtypes and devices but no storage), and the memory
tracker of `torch.distributed._tools` (`MemTracker`: every live storage, from torch's own dispatch). What this module
adapts, and why, is in `fake_rank`'s and `LiveBytes`'s docstrings.

Details: docs/internals.md#appsplanfakepy
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.parallel.distributed as ddp_module
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining._utils import InferenceMode, _StageMeta, extract_tensor_metas
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import _redistribute as redistribute
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

# what static_pipeline and first_pieces replace: a torch without them fails on import here
_WARMUP_P2P, _INITIALISE = _PipelineSchedule._warmup_p2p, _PipelineSchedule._initialize_pp_stages
TOTAL = "Total"


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int) -> Iterator[FakeTensorMode]:
    """This process as rank `rank` of `world_size` on the fake process group, and the FakeTensorMode to enter for
    the model and its step (tensors created in it are fake; a model built on the meta device gets fake storage when
    it is materialised). The Runtime is made before entering it (its device mesh is made of real rank numbers).
    torch's own code is adapted for the block, because it reads tensor values that fake tensors and the fake group
    do not have:

    - a DeviceMesh that FSDP makes from the Runtime's (tensor parallelism's and FSDP's dimensions together)
      computes its coordinates outside fake mode;
    - DDP compares parameter shapes across ranks and reads the futures of its all-reduces: no check (the ranks
      build one model), and an async all-reduce returns its own input as the result;
    - DTensor works out the global shape of an op's result on fake tensors of that shape: in a fake mode of its
      own, so that the tracker does not count them (in a real run they are fake too);
    - object collectives (the pipeline's tied-weight discovery) answer with this rank's own object, what a
      peer of the same role sends.
    """
    if dist.is_initialized():
        raise RuntimeError("a dry run needs a process of its own: this one has a process group already")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with _patched():
            yield FakeTensorMode(allow_non_fake_inputs=True)
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _forget_meshes() -> None:
    """DTensor caches the shardings it worked out, with their device meshes, and a mesh compares equal to another of
    its shape whatever its ranks: a later rank in this process (another pipeline stage) would be handed this one's
    mesh, whose process groups are gone."""
    caches = (
        getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),  # its C++ dispatch's
        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear,
        getattr(ShardingPropagator._propagate_tensor_meta_cached, "cache_clear", None),
        getattr(getattr(redistribute, "_gen_transform_infos", None), "cache_clear", None),
        getattr(redistribute, "clear_redistribute_planner_cache", None),
    )
    for clear in caches:  # each where this torch has it
        if clear is not None:
            clear()


@contextlib.contextmanager
def _patching() -> Iterator[Callable[[Any, str, Callable[..., Any]], None]]:
    """A `patch(owner, name, replacement)` whose replacements last for the block."""
    originals: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, replacement: Callable[..., Any]) -> None:
        originals.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    try:
        yield patch
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)


@contextlib.contextmanager
def _patched() -> Iterator[None]:
    mesh_init = DeviceMesh.__init__

    @functools.wraps(mesh_init)
    def real_mesh_init(self: DeviceMesh, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            mesh_init(self, *args, **kwargs)

    all_reduce = dist.all_reduce

    def done_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        work = all_reduce(tensor, *args, **kwargs)
        return _Done(tensor) if kwargs.get("async_op") else work

    propagate = ShardingPropagator._propagate_tensor_meta_non_cached
    shapes = FakeTensorMode(allow_non_fake_inputs=True)  # DTensor's global-shape tensors: no rank's memory

    @functools.wraps(propagate)
    def propagate_apart(self: ShardingPropagator, *args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily(), shapes:  # the tracker counts the rank's fake mode only
            return propagate(self, *args, **kwargs)

    with _patching() as patch:
        patch(DeviceMesh, "__init__", real_mesh_init)
        patch(ShardingPropagator, "_propagate_tensor_meta_non_cached", propagate_apart)
        patch(ddp_module, "_verify_param_shape_across_processes", lambda *args, **kwargs: None)
        patch(dist, "all_reduce", done_all_reduce)
        patch(dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(slice(None), [obj] * len(out)))
        patch(dist, "broadcast_object_list", lambda objects, src=None, group=None, **kwargs: None)
        yield


@contextlib.contextmanager
def static_pipeline(boundaries: Sequence[torch.Tensor]) -> Iterator[None]:
    """Pipeline stages that know their neighbours' shapes. torch's PipelineStage learns them at the first step, by a
    vote and metadata sent by value between the ranks, which the fake group does not carry: here each stage is told
    them instead (`boundaries[i]`: what stage i receives, the token ids for the first; the last: what the last stage
    puts out), as a stage given `input_args` and `output_args` is, and checks them against every tensor that passes
    (torch's own validation, which a run turns on with TORCH_DISTRIBUTED_DEBUG=DETAIL). Then the dry run's step is
    every step's: the first step's shape inference, an extra forward and backward, does not happen."""

    def told(schedule: _PipelineSchedule, stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            i = stage.stage_index
            inputs, outputs = extract_tensor_metas((boundaries[i],)), extract_tensor_metas((boundaries[i + 1],))
            stage._user_meta = _StageMeta(inputs=inputs, outputs=outputs)
            stage._inference_mode = InferenceMode.STATIC
            stage._runtime_validate = True

    with _patching() as patch:
        patch(_PipelineSchedule, "_warmup_p2p", told)
        yield


@contextlib.contextmanager
def first_pieces(schedule: _PipelineSchedule, run: int) -> Iterator[None]:
    """Steps of `schedule` over the first `run` of its micro-batch pieces (given a batch of that many), its stages
    set up as for all of them: the receive buffers torch makes at the first step, one per piece and direction, are
    made for every piece. Under 1F1B the pieces after a stage's warm-up and two more repeat the steady state (one
    forward, one backward) those went through, so they hold nothing new (dryrun.pieces_to_run)."""
    full = schedule._n_microbatches
    initialise = _PipelineSchedule._initialize_pp_stages

    def for_every_piece(self: _PipelineSchedule, *args: Any, **kwargs: Any) -> Any:
        self._n_microbatches = full
        try:
            return initialise(self, *args, **kwargs)
        finally:
            self._n_microbatches = run

    with _patching() as patch:
        patch(_PipelineSchedule, "_initialize_pp_stages", for_every_piece)
        schedule._n_microbatches = run
        try:
            yield
        finally:
            schedule._n_microbatches = full


def pipeline_buffers(stages: Sequence[Any]) -> list[torch.Tensor]:
    """The receive buffers torch's PipelineStage objects hold (made at the first step, one per piece and direction,
    kept for the stage's life): activations from the stage before, gradients from the stage after."""
    tables = [table for stage in stages for table in (stage.args_recv_info, stage.grad_recv_info)]
    infos = [info for table in tables for piece in table.values() for info in piece]
    return [info.buffer for info in infos if isinstance(getattr(info, "buffer", None), torch.Tensor)]


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """torch's warnings about the model (FSDP's note on views of outputs, DTensor's on sequential all-reduces), which
    a run prints once and a dry run would print for every rank: the run's own are where they belong."""
    chatty = logging.getLogger("torch.distributed.tensor._redistribute")
    level = chatty.level
    chatty.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        chatty.setLevel(level)


class _Done:
    """The work of an all-reduce that is done: its future holds the tensor, as gloo's and NCCL's do."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        self.future.set_result([tensor])

    def wait(self, timeout: Any = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self.future


class LiveBytes(MemTracker):
    """torch's MemTracker, for what it sees of every storage made while it is entered and still alive: `current()`
    and `peak()` (since `reset_peak()`), in bytes, all devices together (its breakdown by when a storage was made is
    not the planner's components: probes.py measures those).
    MemTracker refuses a module called twice at the top level (it keeps per-module statistics of one iteration):
    micro-steps and pipeline pieces do that, so that module's statistics, which nothing here reads, are dropped
    first (only its own: a rank's other pipeline stage still has backwards to run)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # A view makes no storage, so there is nothing to count: skipping MemTracker's look-up of its outputs saves
        # a fifth of a dry run where views abound (FSDP cuts every parameter into a view per rank). Same bytes.
        if func.is_view and DTensor not in types:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            name = self._mod_tracker.get_known_fqn(module)
            if set(self._mod_tracker.parents) - {name} == {"Global"}:
                del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state: Any) -> None:
        del peak_state  # the peak of all storages only: the per-module peaks cost a pass over every module per op
        for device, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snap[TOTAL]:
                self._peak_mem[device] = snap[TOTAL]
                self._peak_mem_snap[device] = dict(snap)

    def reset_peak(self) -> None:
        """From now on: the peak of what is alive from here."""
        self._peak_mem = {device: snap[TOTAL] for device, snap in self._curr_mem_snap.items()}
        self._peak_mem_snap = {device: dict(snap) for device, snap in self._curr_mem_snap.items()}

    def current(self) -> int:
        return sum(snap.get(TOTAL, 0) for snap in self.get_tracker_snapshot("current").values())

    def peak(self) -> int:
        return sum(snap.get(TOTAL, 0) for snap in self.get_tracker_snapshot("peak").values())
