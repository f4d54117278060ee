"""The device mesh: how the world's ranks split into named data-parallel dimensions.

    dp_replicate × dp_shard = world size
    (dp_replicate, dp_shard) = (1, N): every rank holds 1/N of the model (FSDP full sharding)
                             = (R, N/R): R replicas, each sharded over N/R ranks (hybrid sharding)

Rank r sits at (r // dp_shard, r % dp_shard): a shard group is a block of consecutive ranks, which
on a multi-node job means one node, so the heavy all-gathers and reduce-scatters stay on the fast
intra-node links and only the replicas' all-reduce crosses nodes. One degree may be -1, meaning
"the rest of the world".
"""

from __future__ import annotations

from dataclasses import dataclass


class MeshError(ValueError):
    """Degrees that do not fit the world size; the message names the keys and a fix."""


@dataclass(frozen=True)
class MeshShape:
    dp_replicate: int
    dp_shard: int

    @classmethod
    def resolve(cls, world_size: int, dp_replicate: int = 1, dp_shard: int = -1) -> MeshShape:
        """Fill in a -1 degree and check that the degrees multiply to `world_size`."""
        given = f"parallel.dp_replicate={dp_replicate}, parallel.dp_shard={dp_shard}"
        for key, value in (("parallel.dp_replicate", dp_replicate), ("parallel.dp_shard", dp_shard)):
            if value == 0 or value < -1:
                raise MeshError(f"{key}={value}: a degree is a positive number, or -1 to infer it")
        if dp_replicate == -1 and dp_shard == -1:
            raise MeshError(f"{given}: at most one degree can be -1 (inferred). Fix: set one of them.")
        known = max(dp_replicate, 1) * max(dp_shard, 1)
        if world_size % known:
            raise MeshError(
                f"{given} does not divide the world size {world_size}. "
                f"Fix: degrees whose product is {world_size} (one may be -1)."
            )
        replicate = world_size // known if dp_replicate == -1 else dp_replicate
        shard = world_size // known if dp_shard == -1 else dp_shard
        if replicate * shard != world_size:
            raise MeshError(
                f"{given}: {replicate} × {shard} = {replicate * shard} ranks, but the world size is {world_size}. "
                f"Fix: degrees whose product is {world_size}, e.g. --parallel.dp_shard=-1."
            )
        return cls(replicate, shard)

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dims(self) -> tuple[int, ...]:
        """The mesh's shape: 2-D (replicate, shard) for hybrid sharding, 1-D (shard) otherwise."""
        return (self.dp_replicate, self.dp_shard) if self.dp_replicate > 1 else (self.dp_shard,)

    @property
    def names(self) -> tuple[str, ...]:
        return ("dp_replicate", "dp_shard") if self.dp_replicate > 1 else ("dp_shard",)
