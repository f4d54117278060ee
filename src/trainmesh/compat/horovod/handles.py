"""Horovod's handles for collectives in flight (hvd.poll, hvd.synchronize) and the *_async calls' start: a name
in flight is refused, and a call that meets another rank in hvd.barrier() is deferred (rounds.py).

Details: docs/internals.md#compathorovodopspy
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import torch.distributed as dist

from trainmesh.compat.horovod.basics import at_shutdown
from trainmesh.compat.horovod.errors import HorovodInternalError
from trainmesh.compat.horovod.rounds import Deferred, defer, deferral_lock, flush, forget_deferred

T = TypeVar("T")


class Handle(Generic[T]):
    """A collective in flight, or deferred (launch()): pass it to hvd.poll() or hvd.synchronize()."""

    def __init__(self, works: Sequence[dist.Work | None], finish: Callable[[], T]) -> None:
        self._works = [w for w in works if w is not None]
        self._finish: Callable[[], T] | None = finish
        self._result: T | None = None
        self._lock = threading.Lock()  # threads may wait on one handle: finish (a copy, a division) runs once
        self._started = True  # launch() sets these three for a collective it deferred
        self._group: dist.ProcessGroup | None = None
        self._name: str | None = None
        self._error: Exception | None = None  # a deferred collective's, raised where it is waited for

    def done(self) -> bool:
        return self._start("polling") and self._finished()

    def wait(self) -> T:
        try:
            while not self._start("waiting"):
                time.sleep(0.01)  # the other ranks are still in hvd.barrier() with deferred calls of their own
            with self._lock:
                if self._finish is not None:
                    for work in self._works:
                        work.wait()
                    self._result, self._finish = self._finish(), None
        finally:
            _release(self)
        return self._result  # type: ignore[return-value]  # set above, once

    def in_flight(self) -> bool:
        """Not started, or started and not finished (Horovod's name for it: a name in use)."""
        return not self._started or not self._finished()

    def _finished(self) -> bool:
        return self._finish is None or all(w.is_completed() for w in self._works)

    def _start(self, asking: str) -> bool:
        """Whether the collective has started: a deferred one starts with the group's deferred ones before it
        (`asking`: "waiting", this rank cannot go on until it has, or "polling")."""
        with deferral_lock:
            if self._started:
                return True
            if not flush(self._group, asking):
                return False
        if self._error is not None:
            raise self._error
        if not self._started:
            raise HorovodInternalError(
                "a collective deferred behind hvd.barrier() never started: hvd.shutdown() came first"
            )
        return True


class _Group(Handle[list[T]]):
    """One handle for several (the grouped calls): its result is theirs, in order."""

    def __init__(self, handles: Sequence[Handle[T]]) -> None:
        super().__init__([], lambda: [h.wait() for h in handles])
        self._parts = list(handles)

    def done(self) -> bool:
        return all(h.done() for h in self._parts)


def group_handle(handles: Sequence[Handle[T]]) -> Handle[list[T]]:
    """One handle for several collectives (the grouped calls): its result is theirs, in order."""
    return _Group(handles)


_in_use: dict[str, Handle[Any]] = {}
"""*_async collectives by name (by call kind: 'allreduce.x'): Horovod refuses a second one of a name in flight."""


def _release(handle: Handle[Any]) -> None:
    if handle._name is not None and _in_use.get(handle._name) is handle:
        del _in_use[handle._name]


def launch(what: str, name: str | None, group: dist.ProcessGroup | None, start: Callable[[], Handle[T]]) -> Handle[T]:
    """An *_async call's collective (`start`: its round, with Role.DEFERRABLE, and its collective), started now, or,
    while the other ranks are in hvd.barrier() (which Horovod's does not wait for), deferred until this rank's next
    round on the group or its handle is polled or waited for; the ranks run their collectives in the same order."""
    key = None if name is None else f"{what}.{name}"
    holder = _in_use.get(key) if key is not None else None
    if holder is not None and holder.in_flight():
        raise ValueError(
            f"hvd.{what}: a collective named {name!r} is still in flight, and Horovod refuses a second one of the "
            "same name. Fix: hvd.synchronize() the first, or give this one another name."
        )
    handle: Handle[T] = Handle([], lambda: None)  # type: ignore[arg-type,return-value]  # filled in by begin()
    handle._started, handle._group, handle._name = False, group, key

    def begin() -> None:
        try:
            started = start()
        except Deferred:
            raise
        except Exception as e:  # the ranks disagreed (every rank raises, here or where it is waited for), or gloo
            handle._error = e
            _release(handle)
            raise
        handle._works, handle._finish, handle._started = started._works, started._finish, True

    if key is not None:
        _in_use[key] = handle
    try:
        begin()
    except Deferred:
        defer(group, begin)
    return handle


def _forget() -> None:
    _in_use.clear()
    forget_deferred()


at_shutdown.append(_forget)


def poll(handle: Handle[Any]) -> bool:
    """True when the collective behind `handle` has finished (synchronize() will not wait). A collective deferred
    behind the other ranks' hvd.barrier() starts here (the call waits for them to arrive at a collective)."""
    return handle.done()


def synchronize(handle: Handle[T]) -> T:
    """Wait for the collective behind `handle`; returns its result (the same tensor for in-place calls)."""
    if not isinstance(handle, Handle):
        raise ValueError(f"hvd.synchronize() takes a handle from an *_async call, not {type(handle).__name__}")
    return handle.wait()
