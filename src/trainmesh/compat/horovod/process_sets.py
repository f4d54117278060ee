"""Horovod's process sets (hvd.ProcessSet, hvd.add_process_set, process_set= arguments): a collective over some
of the ranks, on a torch.distributed subgroup (dist.new_group).

As under Horovod, add_process_set() and remove_process_set() are called by every rank, in the same order;
collectives on a set are called by its members only. hvd.join() answers only collectives of the global set.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from trainmesh.compat.horovod.basics import at_shutdown, rank, size


class ProcessSet:
    """Some ranks of the job (sorted, distinct); registered by hvd.add_process_set(), which gives it an id."""

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        self.ranks: list[int] | None = sorted(set(ranks)) if ranks is not None else None
        self.process_set_id: int | None = None
        self.group: dist.ProcessGroup | None = None  # None: the default group (the global set)

    def _members(self) -> list[int]:
        return self.ranks if self.ranks is not None else list(range(size()))

    def size(self) -> int:
        return len(self._members())

    def rank(self) -> int:
        """This process's rank within the set; -1 when it is not a member."""
        members = self._members()
        return members.index(rank()) if rank() in members else -1

    def included(self) -> bool:
        return rank() in self._members()

    def __repr__(self) -> str:
        if self is global_process_set:
            return "hvd.global_process_set"
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()
global_process_set.process_set_id = 0
_registered: dict[int, ProcessSet] = {}


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set (or a list of ranks) on every rank: a collective call, as under Horovod."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    assert ps.ranks is not None, "the global process set is registered already"
    if ps.process_set_id is not None:
        raise ValueError(f"hvd.add_process_set: {ps!r} is registered already")
    if not ps.ranks or ps.ranks[0] < 0 or ps.ranks[-1] >= size():
        raise ValueError(f"hvd.add_process_set({ps.ranks}): the ranks must be some of 0..{size() - 1}")
    for other in _registered.values():
        if other.ranks == ps.ranks:
            raise ValueError(f"hvd.add_process_set({ps.ranks}): {other!r} has the same ranks")
    ps.group = None if len(ps.ranks) == size() else dist.new_group(ps.ranks)
    ps.process_set_id = max(_registered, default=0) + 1
    _registered[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set added by add_process_set(); False for the global set or one not registered. Every rank
    calls it, in the same order (Horovod's rule), so every rank destroys the set's torch subgroup together: a
    job that adds and removes sets in a loop would otherwise keep each one's connections until exit."""
    if process_set.process_set_id is None or _registered.get(process_set.process_set_id) is not process_set:
        return False
    del _registered[process_set.process_set_id]
    process_set.process_set_id = None
    if process_set.group is not None and dist.is_initialized():
        # The set keeps the destroyed group (not None, the global set's): an optimizer still holding the set fails
        # rather than reducing over every rank. A non-member holds NON_GROUP_MEMBER, for which torch does nothing.
        dist.destroy_process_group(process_set.group)
    return True


def forget_process_sets() -> None:
    """hvd.shutdown(): the sets added since hvd.init() are gone, as under Horovod."""
    for ps in list(_registered.values()):
        remove_process_set(ps)


at_shutdown.append(forget_process_sets)


def resolve(process_set: object, what: str, members_only: bool = True) -> ProcessSet:
    """The set a collective runs on: a registered set, of which this rank must be a member (`members_only`)."""
    if process_set is None or process_set is global_process_set:
        return global_process_set
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"{what}(process_set={process_set!r}): give a hvd.ProcessSet (or hvd.global_process_set)")
    if process_set.process_set_id is None:
        raise ValueError(
            f"{what}: {process_set!r} is not registered. Fix: hvd.add_process_set(...) on every rank first"
        )
    if members_only and not process_set.included():
        raise ValueError(
            f"{what}: rank {rank()} is not in {process_set!r}; only its members may call collectives on it"
        )
    return process_set
