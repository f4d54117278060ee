"""hvd.elastic: Horovod's elastic API (run, State, ObjectState, TorchState, ElasticSampler) on torchrun's elastic
launch.

Horovod recovers inside the process: a worker that fails raises HorovodInternalError on the others, which restore
their last commit, rebuild the ring without it and go on; hosts that join raise HostsUpdatedInterrupt. Under
torchrun (`trainmesh run --nnodes MIN:MAX --max-restarts N`) any failure or membership change restarts every
worker process instead, so the script starts again from its top: `run` syncs the state from rank 0 and calls the
function, and what survives a restart is what the script saves to disk and loads before it (a commit is kept in
memory, as Horovod's). `check_host_updates` never raises: torchrun, not the script, handles new hosts.
HorovodInternalError (the ranks disagreed on a collective, a bug in the script) is not retried.
"""

from __future__ import annotations

import copy
import functools
import math
import random
from collections.abc import Callable, Iterator, Sized
from typing import Any, TypeVar

import torch

from trainmesh.compat.horovod.basics import rank, size
from trainmesh.compat.horovod.errors import HostsUpdatedInterrupt
from trainmesh.compat.horovod.functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

R = TypeVar("R")


class State:
    """State kept across reset events: commit() saves it, restore() goes back to the last commit, sync() gives
    every rank rank 0's."""

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Callbacks run after a reset event (here: after a HostsUpdatedInterrupt the script raised itself)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state in memory, then check for host updates (never any here)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Horovod raises HostsUpdatedInterrupt here when hosts came or went; under torchrun the whole group is
        restarted instead, so there is never anything to raise."""

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Called after a reset event, before the state is synced again."""


class ObjectState(State):
    """Plain Python values, given as keyword arguments and kept as attributes (rank 0's after sync())."""

    def __init__(self, **kwargs: Any) -> None:
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__()

    def save(self) -> None:
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = broadcast_object(self._saved_state, root_rank=0)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Horovod's sampler: the dataset's indices (shuffled by seed + epoch) split over the ranks, without those
    recorded as processed this epoch (record_batch), so a restored state resumes mid-epoch. Call set_epoch() at
    the end of an epoch."""

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.processed_num = epoch, 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Every rank has processed `batch_size` more samples."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.epoch, self.processed_num = state_dict["epoch"], state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        self.num_replicas, self.rank = size(), rank()
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)  # the same order on every rank
        self.remaining_indices = indices[self.processed_num :]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = self.remaining_indices[:]
        indices += indices[: self.total_size - len(indices)]  # padded to divide evenly, as DistributedSampler
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


class _Handler:
    """How TorchState saves, restores and syncs one kind of value (a model, an optimizer, a sampler)."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        if isinstance(self.value, torch.nn.Module):
            broadcast_parameters(self.value.state_dict(), root_rank=0)
        elif isinstance(self.value, torch.optim.Optimizer):
            broadcast_optimizer_state(self.value, root_rank=0)
        else:
            self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=0))


class TorchState(ObjectState):
    """Horovod's TorchState: a model, an optimizer, ElasticSamplers (their state_dict()s are saved, restored and
    synced from rank 0) and plain values (as ObjectState)."""

    def __init__(
        self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, **kwargs: Any
    ) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        kinds = (torch.nn.Module, torch.optim.Optimizer, ElasticSampler)
        handled = {name: value for name, value in kwargs.items() if isinstance(value, kinds)}
        self._handlers = {name: _Handler(value) for name, value in handled.items()}
        for name, value in handled.items():
            object.__setattr__(self, name, value)
        # Horovod keeps every value without a handler (None included) as a plain attribute, saved and restored
        plain = {name: value for name, value in kwargs.items() if name not in handled}
        super().__init__(**plain)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:  # state.model = new_model: track the new one
            handlers[name] = _Handler(value)
        super().__setattr__(name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()


def run(func: Callable[..., R]) -> Callable[..., R]:
    """Horovod's decorator: `func(state, ...)` runs after the state is synced from rank 0. A HostsUpdatedInterrupt
    (only a script's own) restores nothing, resets the state and runs it again; any other exception ends the
    process, and torchrun's agent restarts the group when it has restarts left (see the module's docstring)."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> R:
        skip_sync = False
        while True:
            if not skip_sync:
                state.sync()
            try:
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as e:
                skip_sync = e.skip_sync
            state.on_reset()

    return wrapper
