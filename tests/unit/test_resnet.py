"""The ResNet recipe on its own: architecture (parameter counts equal torchvision's published ones),
shapes, FLOPs, config checks, the digits and image-folder data, deterministic augmentation, the
validation metrics, and SyncBatchNorm without a process group."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from trainmesh import Runtime
from trainmesh.config import ConfigError
from trainmesh.config.schema import DistConfig
from trainmesh.job.spec import load_config
from trainmesh.layers import SyncBatchNorm, convert_sync_batchnorm
from trainmesh.recipes.resnet import ResNet, ResNetConfig, ResNetRecipe
from trainmesh.recipes.resnet.data import (
    DIGITS_FILE,
    Augment,
    ImageDataset,
    TensorImages,
    load_image_data,
    split_ids,
)
from trainmesh.recipes.resnet.model import count_macs
from trainmesh.train.loop import _evaluate

# torchvision's resnetXX(num_classes=1000) parameter counts, the published reference.
TORCHVISION_PARAMS = {18: 11_689_512, 34: 21_797_672, 50: 25_557_032, 101: 44_549_160, 152: 60_192_808}


def _imagenet(depth: int, **kw: int | str) -> ResNetConfig:
    return ResNetConfig(depth=depth, num_classes=1000, in_channels=3, image_size=224, stem="imagenet", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("depth", sorted(TORCHVISION_PARAMS))
def test_parameter_counts_match_torchvision(depth: int) -> None:
    with torch.device("meta"):  # counting needs no memory or initialisation
        model = ResNet(_imagenet(depth))
    assert sum(p.numel() for p in model.parameters()) == TORCHVISION_PARAMS[depth]


def test_forward_shapes_and_flops() -> None:
    small = ResNet(ResNetConfig(depth=18, width=8, num_classes=7, in_channels=1, image_size=16))
    assert small.cfg.stem == "small"  # auto: under 64 pixels
    assert small(torch.randn(2, 1, 16, 16)).shape == (2, 7)
    big = ResNet(ResNetConfig(depth=50, width=8, num_classes=5, in_channels=3, image_size=64))
    assert big.cfg.stem == "imagenet"
    assert big(torch.randn(2, 3, 64, 64)).shape == (2, 5)
    with torch.device("meta"):  # published: 1.81 and 4.09 GMACs at 224 pixels
        assert count_macs(ResNet(_imagenet(18)), (1, 3, 224, 224)) == pytest.approx(1.814e9, rel=2e-3)
        assert count_macs(ResNet(_imagenet(50)), (1, 3, 224, 224)) == pytest.approx(4.089e9, rel=2e-3)


def test_zero_init_residual_starts_blocks_at_zero() -> None:
    model = ResNet(ResNetConfig(depth=50, width=4, num_classes=2, in_channels=1, zero_init_residual=True))
    block = model.stages[0][0]
    assert torch.count_nonzero(block.bn3.weight) == 0 and torch.count_nonzero(block.bn1.weight) > 0


def test_config_checks_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"model.depth=20 is not one of 18, 34, 50, 101, 152"):
        load_config(None, ["--model.depth=20"], "resnet")
    with pytest.raises(ConfigError, match=r"model.norm='group'.*batch, sync_batch"):
        load_config(None, ["--model.norm=group"], "resnet")
    config = load_config(None, [], "resnet")
    model = config.model
    assert isinstance(model, ResNetConfig)
    assert (model.num_classes, model.in_channels, model.hflip, model.stem) == (10, 1, False, "small")


def test_digits_split_is_fixed_and_disjoint() -> None:
    augment = Augment(4, False)
    a = load_image_data("embedded", 32, 0, 0.2, augment, seed=1)
    b = load_image_data("digits", 32, 0, 0.2, augment, seed=2)
    assert len(a.train.source) == 1438 and len(a.val) == 359 and a.num_classes == 10 and a.in_channels == 1
    x, y = a.val[0]
    assert x.shape == (1, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert torch.equal(x, b.val[0][0])  # the split and normalisation do not depend on run.seed
    assert set(a.val.source.labels) == set(range(10))
    train_ids, val_ids = split_ids(1797, 0.2)
    assert not set(train_ids) & set(val_ids) and len(train_ids) + len(val_ids) == 1797


def test_the_digits_ship_with_trainmesh(monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded digits are the package's own file (scikit-learn's digits.csv.gz, byte for byte), read without
    scikit-learn, with their licence beside them."""
    monkeypatch.setitem(sys.modules, "sklearn", None)  # any import of scikit-learn fails
    data = load_image_data("embedded", 8, 0, 0.2, Augment(0, False), seed=0)
    assert len(data.train.source) + len(data.val.source) == 1797
    pixels = data.train.source.images * 16  # type: ignore[attr-defined]  # 8×8: no resize, counts 0..16
    assert torch.equal(pixels, pixels.round()) and pixels.min() == 0 and pixels.max() == 16
    assert hashlib.sha256(DIGITS_FILE.read_bytes()).hexdigest() == (
        "09f66e6debdee2cd2b5ae59e0d6abbb73fc2b0e0185d2e1957e9ebb51e23aa22"
    )
    assert "CC BY 4.0" in DIGITS_FILE.with_name("digits.LICENSE").read_text(encoding="utf-8")


def test_augmentation_is_a_function_of_seed_pass_and_image() -> None:
    images = torch.rand(5, 3, 8, 8)
    source = TensorImages(images, [0, 1, 0, 1, 0])
    mean, std = torch.zeros(3, 1, 1), torch.ones(3, 1, 1)
    data = ImageDataset(source, mean, std, Augment(2, True), seed=7, passes=4)
    again = ImageDataset(source, mean, std, Augment(2, True), seed=7, passes=4)
    assert len(data) == 20
    for j in range(len(data)):
        assert torch.equal(data[j][0], again[j][0])  # any order, any process: the id decides
        assert data[j][1] == source.labels[j % 5]
    passes = [data[3 + 5 * p][0] for p in range(4)]  # image 3 in each pass: fresh augmentation
    assert any(not torch.equal(passes[0], other) for other in passes[1:])
    other_seed = ImageDataset(source, mean, std, Augment(2, True), seed=8, passes=4)
    assert any(not torch.equal(data[j][0], other_seed[j][0]) for j in range(len(data)))
    plain = ImageDataset(source, mean, std, Augment(0, False), seed=7, passes=4)
    assert len(plain) == 5 and torch.equal(plain[2][0], images[2])  # nothing random: one pass, untouched
    flips = ImageDataset(source, mean, std, Augment(0, True), seed=7, passes=50)
    flipped = [not torch.equal(flips[j][0], images[j % 5]) for j in range(len(flips))]
    assert all(torch.equal(flips[j][0], images[j % 5].flip(-1)) for j in range(len(flips)) if flipped[j])
    assert 0.3 < sum(flipped) / len(flipped) < 0.7


def _write_tree(root: Path) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for label, name in enumerate(["cat", "dog"]):
        (root / name).mkdir(parents=True)
        for i in range(5):
            np.save(root / name / f"{i}.npy", rng.random((12, 10)).astype(np.float32) * 0.1 + label * 0.8)
            pixels = rng.integers(0, 50, (20, 16, 3), dtype=np.uint8) + label * 200
            Image.fromarray(pixels.astype(np.uint8)).save(root / name / f"{i}.png")
    (root / "notes.txt").write_text("ignored")


def test_image_folder_loader(tmp_path: Path) -> None:
    _write_tree(tmp_path)
    data = load_image_data(str(tmp_path), 16, 3, 0.2, Augment(2, True), seed=0)
    assert data.num_classes == 2 and data.in_channels == 3
    assert len(data.train.source) == 16 and len(data.val) == 4
    labels = data.train.source.labels + data.val.source.labels
    assert sorted(labels) == [0] * 10 + [1] * 10  # class = sub-folder, sorted by name
    x, y = data.val[0]
    assert x.shape == (3, 16, 16) and int(y) in (0, 1)
    gray = load_image_data(str(tmp_path), 8, 1, 0.2, Augment(0, False), seed=0)
    assert gray.val[0][0].shape == (1, 8, 8)
    # A split given on disk is used as it is.
    split = tmp_path.parent / f"{tmp_path.name}-split"
    _write_tree(split / "train")
    _write_tree(split / "val")
    given = load_image_data(str(split), 16, 3, 0.5, Augment(0, False), seed=0)
    assert len(given.train) == 20 and len(given.val) == 20
    config = load_config(None, [f"--data.source={tmp_path}"], "resnet")
    assert config.model.num_classes == 2 and config.model.hflip is True  # type: ignore[attr-defined]


def test_evaluation_reports_top1_from_one_forward() -> None:
    recipe = ResNetRecipe()
    config = load_config(None, ["--model.width=4", "--model.image_size=16"], "resnet")
    runtime = Runtime(strategy="single", dist_config=DistConfig(device="cpu"))
    _, val = recipe.prepare(config, runtime)
    model = recipe.build_model(config, runtime)
    ids = [[0, 1, 2, 3], [4, 5, 6]]
    loss, extra = _evaluate(model, val, ids, recipe, runtime)
    x = torch.stack([val[i][0] for i in range(7)])
    y = torch.stack([val[i][1] for i in range(7)])
    model.eval()
    with torch.no_grad():
        logits = model(x)
    assert loss == pytest.approx(nn.functional.cross_entropy(logits, y).item(), rel=1e-5)
    assert extra == {"val_top1": pytest.approx((logits.argmax(1) == y).float().mean().item())}
    assert recipe.count_targets((x, y)) == 7
    assert recipe.flops_per_token(model) > 0
    with torch.device("meta"):  # training ResNet-50 at 224 px: 3 passes × 2 FLOPs × 4.09 GMACs (torchvision)
        resnet50 = ResNet(_imagenet(50))
    assert recipe.flops_per_token(resnet50) == pytest.approx(3 * 2 * 4.089e9, rel=3e-3)


def test_sync_batchnorm_without_a_process_group_is_batchnorm() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 3, 4, 4) * 2 + 1
    bn = nn.BatchNorm2d(3)
    sync = SyncBatchNorm(3)
    sync.load_state_dict(bn.state_dict())
    for _ in range(2):
        torch.testing.assert_close(sync(x), bn(x), atol=0, rtol=0)
    torch.testing.assert_close(sync.state_dict(), bn.state_dict(), atol=0, rtol=0)


def test_convert_sync_batchnorm_keeps_parameters_buffers_and_mode() -> None:
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.Sequential(nn.BatchNorm1d(2).eval()))
    model[1].running_mean.fill_(0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = [id(p) for p in model.parameters()]
    converted = convert_sync_batchnorm(model)
    assert isinstance(converted[1], SyncBatchNorm) and isinstance(converted[2][0], SyncBatchNorm)
    assert converted[1].training and not converted[2][0].training
    assert [id(p) for p in converted.parameters()] == params  # an optimizer built before still holds them
    assert converted.state_dict().keys() == before.keys()
    for key, value in converted.state_dict().items():
        assert torch.equal(value, before[key]), key
