from __future__ import annotations

from pathlib import Path

import pytest

from support import nano_config
from trainmesh.config import ConfigError
from trainmesh.config.schema import ParallelConfig
from trainmesh.job.spec import load_config, resolve
from trainmesh.recipes.resnet.model import ResNet, ResNetConfig, ResNetStage
from trainmesh.strategies import ParallelDims, resolve_parallelism
from trainmesh.strategies.mesh import MeshError
from trainmesh.strategies.pipeline import _merge


def test_degrees_resolve_and_infer() -> None:
    assert ParallelDims.resolve(8) == ParallelDims(dp_shard=8)
    assert ParallelDims.resolve(8, dp_replicate=2) == ParallelDims(dp_replicate=2, dp_shard=4)
    assert ParallelDims.resolve(8, dp_replicate=-1, dp_shard=4) == ParallelDims(dp_replicate=2, dp_shard=4)
    assert ParallelDims.resolve(8, pp=2, tp=2) == ParallelDims(pp=2, dp_shard=2, tp=2)
    assert ParallelDims.resolve(8, pp=-1, dp_shard=2, tp=2) == ParallelDims(pp=2, dp_shard=2, tp=2)
    # without sharding, data parallelism is replication: its degree is kept under dp_replicate
    assert ParallelDims.resolve(8, pp=2, sharded=False) == ParallelDims(pp=2, dp_replicate=4)
    assert ParallelDims(pp=2, dp_shard=2, tp=2).describe() == "pp 2 × dp_shard 2 × tp 2"


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
        ParallelDims.resolve(world, **degrees)
    assert message in str(info.value)


def test_strategy_and_model_parallel_combinations() -> None:
    assert resolve_parallelism(ParallelConfig(tp=2), 4) == ("fsdp", ParallelDims(dp_shard=2, tp=2))
    assert resolve_parallelism(ParallelConfig(tp=2), 2) == ("single", ParallelDims(tp=2))
    assert resolve_parallelism(ParallelConfig(pp=2), 4) == ("ddp", ParallelDims(pp=2, dp_replicate=2))
    with pytest.raises(ValueError, match=r"'ddp' cannot combine with tensor parallelism.*--parallel.strategy=fsdp"):
        resolve_parallelism(ParallelConfig(strategy="ddp", tp=2), 4)
    with pytest.raises(ValueError, match=r"'single' keeps one model replica.*leaves 2 data-parallel replicas"):
        resolve_parallelism(ParallelConfig(strategy="single", pp=2), 4)
    with pytest.raises(ValueError, match=r"parallel.dp_shard=1 with parallel.dp_replicate=2 shards nothing"):
        resolve_parallelism(ParallelConfig(strategy="fsdp", dp_replicate=2, dp_shard=1), 2)


def test_resolve_checks_the_mesh_before_launch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = nano_config(tmp_path, "--parallel.strategy=fsdp", "--parallel.dp_replicate=3")
    with pytest.raises(ConfigError, match="does not divide the world size 4"):
        resolve(config, 4)
    fsdp = nano_config(tmp_path, "--parallel.strategy=fsdp", "--parallel.dp_replicate=2", "--train.global_batch=16")
    assert resolve(fsdp, 4).batch.dp_size == 4
    # pipeline and tensor peers read the same batch: the data-parallel size is what is left
    three_d = nano_config(tmp_path, "--parallel.pp=2", "--parallel.tp=2", "--train.global_batch=16")
    assert resolve(three_d, 8).batch.dp_size == 2


def test_pipeline_micro_batches_must_divide_the_micro_batch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = nano_config(tmp_path, "--parallel.pp=2", "--train.micro_batch=6", "--parallel.pipeline.microbatches=4")
    with pytest.raises(ConfigError, match=r"train.micro_batch=6 cannot be cut into.*microbatches=3"):
        resolve(config, 2)
    fp16 = nano_config(tmp_path, "--parallel.tp=2", "--train.precision=16-mixed")
    with pytest.raises(ConfigError, match=r"16-mixed.*--train.precision=bf16-mixed"):
        resolve(fp16, 2)


PP_INTERLEAVED = ["--parallel.pp=2", "--parallel.pipeline.schedule=interleaved_1f1b"]


@pytest.mark.parametrize(
    ("overrides", "world", "message", "fix"),
    [  # the fix: what the message tells the user to do, as overrides (quoted in the message where it gives them)
        (
            ["--parallel.pp=4", "--parallel.pipeline.microbatches=2", "--model.n_layer=4"],
            4,
            "it needs a micro-batch per stage (4)",
            ["--parallel.pipeline.microbatches=4"],
        ),
        (
            [*PP_INTERLEAVED, "--parallel.pipeline.microbatches=5", "--model.n_layer=4"],
            2,
            "multiple of 2 (m // pp)",
            ["--parallel.pipeline.microbatches=4"],
        ),
        (
            ["--parallel.pp=2", "--parallel.pipeline.schedule=interleaved_1f1b"],
            2,
            "model.n_layer=2 blocks cannot fill 4",
            ["--model.n_layer=4"],
        ),
        (
            ["--parallel.pp=2", "--parallel.pipeline.schedule=zbv_zero_bubble", "--model.n_layer=4"],
            4,
            "puts the first and the last stage on one rank",
            ["--parallel.pipeline.schedule=interleaved_1f1b"],
        ),
        (
            ["--parallel.pp=2", "--parallel.strategy=fsdp", "--parallel.fsdp.cpu_offload=true"],
            4,
            "cpu_offload=true with parallel.pp=2",
            ["--parallel.fsdp.cpu_offload=false"],
        ),
        (
            ["--parallel.tp=2", "--model.n_head=3", "--model.n_embd=48"],
            2,
            "model.n_head=3 cannot be split evenly",
            ["--model.n_head=4"],
        ),
        (
            ["--parallel.tp=2", "--parallel.dp_replicate=2", "--parallel.dp_shard=1"],
            4,
            "shards nothing",
            ["--parallel.dp_replicate=1", "--parallel.dp_shard=-1"],
        ),
    ],
)
def test_model_parallel_settings_are_refused_before_launch_and_the_fix_works(
    tmp_path: Path, overrides: list[str], world: int, message: str, fix: list[str]
) -> None:
    base = ["--train.micro_batch=8", "--train.global_batch=0"]
    with pytest.raises(ConfigError, match="Fix") as info:
        resolve(nano_config(tmp_path, *base, *overrides), world)
    assert message in str(info.value)
    if fix[0] in str(info.value):  # a fix given as a flag is given whole
        assert all(f in str(info.value) for f in fix), str(info.value)
    resolve(nano_config(tmp_path, *base, *overrides, *fix), world)  # and it is a fix


def test_the_resnet_recipe_refuses_tensor_parallelism_and_meta_builds() -> None:
    for key, message in (("--parallel.tp=2", "no tensor-parallel plan"), ("--parallel.meta_init=true", "meta")):
        config = load_config(None, [key, "--train.micro_batch=8"], "resnet")
        with pytest.raises(ConfigError, match=message):
            resolve(config, 2)


def test_stages_held_by_one_rank_are_merged_at_every_depth() -> None:
    """Interleaved ResNet-34 on 2 ranks: rank 1 holds stages 1 and 3 of 4, which both hold blocks of the
    model's stage 2 (a nested container): none may be lost."""
    model = ResNet(ResNetConfig(depth=34, width=4, image_size=16, num_classes=10, in_channels=1))
    parts = [ResNetStage(model, index, 4) for index in (1, 3)]
    held = dict(_merge(parts).named_parameters())
    assert held.keys() == {name for part in parts for name, _ in part.named_parameters()}
    assert "stages.2.0.conv1.weight" in held and "stages.2.5.conv1.weight" in held
