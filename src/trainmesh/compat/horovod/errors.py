"""Horovod's exception types: what a failed collective raises (horovod.common.exceptions)."""

from __future__ import annotations


class HorovodInternalError(RuntimeError):
    """A collective failed on every rank: under Horovod, ranks that disagree on a collective (its shape, dtype,
    operation or root rank) and a peer that failed; here, the ranks' disagreement (see agreement.py)."""


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod elastic's signal that hosts were added or removed. trainmesh never raises it (torchrun restarts
    the whole group instead); a script may, to make hvd.elastic.run reset and run again. `skip_sync`: without
    syncing the state first."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts were updated")
        self.skip_sync = skip_sync
