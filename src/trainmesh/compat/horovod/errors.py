"""Horovod's exception types: what a failed collective raises (horovod.common.exceptions)."""

from __future__ import annotations


class HorovodInternalError(RuntimeError):
    """A collective failed on every rank: under Horovod, ranks that disagree on a collective (its shape, dtype,
    operation or root rank) and a peer that failed; here, the ranks' disagreement (see agreement.py)."""


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod elastic's signal that hosts were added or removed; never raised here (hvd.elastic is not provided),
    defined so that scripts catching it import."""
