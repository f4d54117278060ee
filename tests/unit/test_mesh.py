from __future__ import annotations

import pytest

from support import nano_config
from trainmesh.config import ConfigError
from trainmesh.config.validate import validate
from trainmesh.strategies import MeshShape
from trainmesh.strategies.mesh import MeshError


def test_degrees_resolve_and_infer() -> None:
    assert MeshShape.resolve(8) == MeshShape(1, 8)
    assert MeshShape.resolve(8, dp_replicate=2) == MeshShape(2, 4)
    assert MeshShape.resolve(8, dp_replicate=-1, dp_shard=4) == MeshShape(2, 4)
    assert MeshShape(2, 4).dims == (2, 4) and MeshShape(1, 4).names == ("dp_shard",)


@pytest.mark.parametrize(
    ("world", "replicate", "shard", "message"),
    [
        (8, 3, -1, "does not divide the world size 8"),
        (8, 2, 2, "2 × 2 = 4 ranks, but the world size is 8"),
        (8, -1, -1, "at most one degree can be -1"),
        (8, 0, -1, "parallel.dp_replicate=0: a degree is a positive number"),
    ],
)
def test_bad_degrees_name_the_keys_and_the_fix(world: int, replicate: int, shard: int, message: str) -> None:
    with pytest.raises(MeshError, match="Fix|positive") as info:
        MeshShape.resolve(world, replicate, shard)
    assert message in str(info.value)


def test_validate_checks_the_mesh_before_launch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = nano_config(tmp_path, "--parallel.strategy=fsdp", "--parallel.dp_replicate=3")
    with pytest.raises(ConfigError, match="does not divide the world size 4"):
        validate(config, 4)
    ddp = nano_config(tmp_path, "--parallel.strategy=ddp", "--parallel.dp_replicate=2")
    with pytest.raises(ConfigError, match="shape fsdp's mesh"):
        validate(ddp, 4)
    fsdp = nano_config(tmp_path, "--parallel.strategy=fsdp", "--parallel.dp_replicate=2", "--train.global_batch=16")
    assert validate(fsdp, 4).dp_size == 4
