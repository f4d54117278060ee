"""The device mesh: how the world's ranks split into named parallel dimensions, pp × dp_replicate × dp_shard × tp =
world size, row-major with tp innermost, so tensor-parallel peers are consecutive ranks.

Details: docs/internals.md#strategiesmeshpy
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


class MeshError(ValueError):
    """Degrees that do not fit the world size; the message names the keys and a fix."""


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @classmethod
    def resolve(
        cls,
        world_size: int,
        *,
        pp: int = 1,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        tp: int = 1,
        sharded: bool = True,
    ) -> ParallelDims:
        """Fill in the -1 degree and check that the degrees multiply to `world_size`. `sharded`: the
        data-parallel flavour is fsdp; otherwise data parallelism only replicates, and its degree is
        dp_replicate × dp_shard, kept under dp_replicate."""
        degrees = {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp}
        given = ", ".join(f"parallel.{k}={v}" for k, v in degrees.items() if v != 1)
        for key, value in degrees.items():
            if value == 0 or value < -1:
                raise MeshError(f"parallel.{key}={value}: a degree is a positive number, or -1 to infer it")
        inferred = [k for k, v in degrees.items() if v == -1]
        if len(inferred) > 1:
            raise MeshError(
                f"{given}: at most one degree can be -1 (inferred), got {len(inferred)} "
                f"({', '.join('parallel.' + k for k in inferred)}). Fix: set all but one of them."
            )
        known = math.prod(v for v in degrees.values() if v != -1)
        if world_size % known or (not inferred and known != world_size):
            shown = " × ".join(f"{k}={v}" for k, v in degrees.items() if v not in (-1, 1)) or "1"
            raise MeshError(
                f"{given or 'the parallel degrees'}: {shown} = {known} ranks does not "
                f"{'divide' if inferred else 'equal'} the world size {world_size}. Fix: degrees whose product is "
                f"{world_size}, with one of them -1 to take the rest (e.g. --parallel.dp_shard=-1)."
            )
        if inferred:
            degrees[inferred[0]] = world_size // known
        if not sharded:
            degrees = {**degrees, "dp_replicate": degrees["dp_replicate"] * degrees["dp_shard"], "dp_shard": 1}
        return cls(**degrees)

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_size * self.tp

    def describe(self) -> str:
        return " × ".join(f"{name} {getattr(self, name)}" for name in DIMS if getattr(self, name) > 1) or "1 rank"


class ParallelMesh:
    """The mesh: the DeviceMesh of some ParallelDims (built collectively) and its named sub-meshes. Only
    dimensions larger than 1 exist in it, so no process groups of one rank are created."""

    def __init__(self, dims: ParallelDims, device_type: str) -> None:
        self.dims = dims
        names = tuple(name for name in DIMS if getattr(dims, name) > 1) or ("dp_shard",)
        sizes = tuple(getattr(dims, name) for name in names)
        self.device_mesh: DeviceMesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)

    def _has(self, name: str) -> bool:
        return name in (self.device_mesh.mesh_dim_names or ())

    def coordinate(self, name: str) -> int:
        """This rank's index along dimension `name` (0 for a dimension of size 1)."""
        return self.device_mesh.get_local_rank(name) if self._has(name) else 0

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """The data-parallel sub-mesh: (dp_replicate, dp_shard), or whichever of them exists."""
        names = tuple(n for n in ("dp_replicate", "dp_shard") if self._has(n))
        return self.device_mesh[names] if names else None

    def dp_group(self) -> dist.ProcessGroup | None:
        """One process group over this rank's data-parallel replicas (both data-parallel dimensions);
        None when there is one replica. Collective: every rank calls it."""
        dp_mesh = self.dp_mesh
        if dp_mesh is None:
            return None
        if dp_mesh.ndim == 1:
            return dp_mesh.get_group()
        # Ranks with equal pp and tp coordinates, i.e. the (dp_replicate, dp_shard) slices of the mesh.
        ranks = self.device_mesh.mesh.reshape(self.dims.pp, self.dims.dp_size, self.dims.tp).transpose(1, 2)
        group, _ = dist.new_subgroups_by_enumeration(ranks.reshape(-1, self.dims.dp_size).tolist())
        return group

    @property
    def dp_rank(self) -> int:
        return self.coordinate("dp_replicate") * self.dims.dp_shard + self.coordinate("dp_shard")

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self.device_mesh["tp"] if self._has("tp") else None

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        return self.device_mesh.get_group("pp") if self._has("pp") else None

    def pp_peer(self, stage_rank: int) -> int:
        """The global rank of this rank's pipeline peer at pipeline position `stage_rank`."""
        group = self.pp_group
        assert group is not None
        return dist.get_global_rank(group, stage_rank)
