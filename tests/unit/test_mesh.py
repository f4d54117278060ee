from __future__ import annotations

import pytest

from support import nano_config
from trainmesh.config import ConfigError
from trainmesh.config.validate import validate
from trainmesh.strategies import MeshShape, resolve_parallelism
from trainmesh.strategies.mesh import MeshError


def test_degrees_resolve_and_infer() -> None:
    assert MeshShape.resolve(8) == MeshShape(dp_shard=8)
    assert MeshShape.resolve(8, dp_replicate=2) == MeshShape(dp_replicate=2, dp_shard=4)
    assert MeshShape.resolve(8, dp_replicate=-1, dp_shard=4) == MeshShape(dp_replicate=2, dp_shard=4)
    assert MeshShape.resolve(8, pp=2, tp=2) == MeshShape(pp=2, dp_shard=2, tp=2)
    assert MeshShape.resolve(8, pp=-1, dp_shard=2, tp=2) == MeshShape(pp=2, dp_shard=2, tp=2)
    # without sharding, data parallelism is replication: its degree is kept under dp_replicate
    assert MeshShape.resolve(8, pp=2, sharded=False) == MeshShape(pp=2, dp_replicate=4)
    assert MeshShape(pp=2, dp_shard=2, tp=2).describe() == "pp 2 × dp_shard 2 × tp 2"


@pytest.mark.parametrize(
    ("world", "degrees", "message"),
    [
        (8, {"dp_replicate": 3}, "dp_replicate=3 = 3 ranks does not divide the world size 8"),
        (
            8,
            {"dp_replicate": 2, "dp_shard": 2},
            "dp_replicate=2 × dp_shard=2 = 4 ranks does not equal the world size 8",
        ),
        (8, {"dp_replicate": -1}, "at most one degree can be -1"),
        (8, {"dp_replicate": 0}, "parallel.dp_replicate=0: a degree is a positive number"),
        (6, {"pp": 4}, "pp=4 = 4 ranks does not divide the world size 6"),
        (4, {"pp": 2, "tp": 4}, "pp=2 × tp=4 = 8 ranks does not divide the world size 4"),
    ],
)
def test_bad_degrees_name_the_keys_and_the_fix(world: int, degrees: dict[str, int], message: str) -> None:
    with pytest.raises(MeshError, match="Fix|positive") as info:
        MeshShape.resolve(world, **degrees)
    assert message in str(info.value)


def test_strategy_and_model_parallel_combinations() -> None:
    assert resolve_parallelism("auto", 4, tp=2) == ("fsdp", MeshShape(dp_shard=2, tp=2))
    assert resolve_parallelism("auto", 2, tp=2) == ("single", MeshShape(tp=2))
    assert resolve_parallelism("auto", 4, pp=2) == ("ddp", MeshShape(pp=2, dp_replicate=2))
    with pytest.raises(ValueError, match=r"'ddp' cannot combine with tensor parallelism.*--parallel.strategy=fsdp"):
        resolve_parallelism("ddp", 4, tp=2)
    with pytest.raises(ValueError, match=r"'single' keeps one model replica.*leaves 2 data-parallel replicas"):
        resolve_parallelism("single", 4, pp=2)
    with pytest.raises(ValueError, match=r"parallel.dp_shard=1 with parallel.dp_replicate=2 shards nothing"):
        resolve_parallelism("fsdp", 2, dp_replicate=2, dp_shard=1)


def test_validate_checks_the_mesh_before_launch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = nano_config(tmp_path, "--parallel.strategy=fsdp", "--parallel.dp_replicate=3")
    with pytest.raises(ConfigError, match="does not divide the world size 4"):
        validate(config, 4)
    fsdp = nano_config(tmp_path, "--parallel.strategy=fsdp", "--parallel.dp_replicate=2", "--train.global_batch=16")
    assert validate(fsdp, 4).dp_size == 4
    # pipeline and tensor peers read the same batch: the data-parallel size is what is left
    three_d = nano_config(tmp_path, "--parallel.pp=2", "--parallel.tp=2", "--train.global_batch=16")
    assert validate(three_d, 8).dp_size == 2


def test_pipeline_micro_batches_must_divide_the_micro_batch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = nano_config(tmp_path, "--parallel.pp=2", "--train.micro_batch=6", "--parallel.pipeline.microbatches=4")
    with pytest.raises(ConfigError, match=r"train.micro_batch=6 cannot be cut into.*microbatches=3"):
        validate(config, 2)
    fp16 = nano_config(tmp_path, "--parallel.tp=2", "--train.precision=16-mixed")
    with pytest.raises(ConfigError, match=r"16-mixed.*--train.precision=bf16-mixed"):
        validate(fp16, 2)
