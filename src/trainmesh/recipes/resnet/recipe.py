"""The ResNet recipe: an image classifier on UCI's handwritten digits (shipped) or an image folder, with BatchNorm or
SyncBatchNorm, reporting validation top-1 accuracy next to the loss."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

from trainmesh.config.schema import Config, ModelConfig
from trainmesh.core.logging import get_logger
from trainmesh.layers import convert_sync_batchnorm
from trainmesh.recipes.base import Datasets, Recipe
from trainmesh.recipes.resnet.data import (
    DIGITS_SOURCES,
    Augment,
    ImageDataError,
    folder_classes,
    load_image_data,
)
from trainmesh.recipes.resnet.model import DEPTHS, ResNet, ResNetConfig, ResNetStage, count_macs
from trainmesh.strategies.mesh import ParallelDims
from trainmesh.strategies.plan import ParallelPlan
from trainmesh.strategies.schedules import SCHEDULES

if TYPE_CHECKING:
    from trainmesh.runtime.runtime import Runtime

log = get_logger(__name__)


class ResNetRecipe(Recipe):
    name = "resnet"
    model_config_cls = ResNetConfig
    data_sources = "'embedded' (UCI's handwritten digits, shipped), or a folder of class sub-folders of images"
    # image_size too: model.stem=auto picks the stem (and so its weights' shapes) by it
    checkpoint_pins = tuple(
        f"model.{key}" for key in ("depth", "width", "num_classes", "in_channels", "stem", "image_size")
    )
    eval_metrics = ("top1",)

    def complete_model(self, config: Config) -> ModelConfig:
        """Classes and channels from the data (digits; an image folder this machine sees), flips by the data."""
        model = config.model
        assert isinstance(model, ResNetConfig)
        digits = config.data.source in DIGITS_SOURCES
        if model.hflip is None:
            model = replace(model, hflip=not digits)
        if digits:
            return replace(model, num_classes=model.num_classes or 10, in_channels=model.in_channels or 1)
        root = Path(config.data.source).expanduser()
        if root.is_dir():  # a folder only the worker nodes see is resolved when they resolve the job
            return replace(
                model, num_classes=model.num_classes or len(folder_classes(root)), in_channels=model.in_channels or 3
            )
        return model

    def prepare(self, config: Config, runtime: Runtime) -> Datasets:
        model = config.model
        assert isinstance(model, ResNetConfig)
        if not (model.num_classes and model.in_channels) or model.hflip is None:
            raise ValueError("model.num_classes, in_channels or hflip unset: complete the config first (load_config)")
        augment = Augment(model.crop_padding, bool(model.hflip))
        data = load_image_data(
            config.data.source, model.image_size, model.in_channels, config.data.val_fraction, augment, config.run.seed
        )
        if model.num_classes < data.num_classes:
            raise ImageDataError(
                f"model.num_classes={model.num_classes} but data.source={config.data.source!r} has "
                f"{data.num_classes} classes. Fix: --model.num_classes={data.num_classes} (or 0: from the data)."
            )
        if runtime.is_main_process:
            log.info("%s", data.description)
        return Datasets(data.train, data.val)

    def build_model(self, config: Config, runtime: Runtime) -> nn.Module:
        cfg = config.model
        assert isinstance(cfg, ResNetConfig)
        model: nn.Module = ResNet(cfg)
        if cfg.norm == "sync_batch" and runtime.strategy.dp_size > 1:
            # Statistics are synchronised over the data-parallel replicas only (not pipeline peers).
            model = convert_sync_batchnorm(model, runtime.data_parallel_group())  # None: the world
        elif cfg.norm == "sync_batch":
            log.info("model.norm=sync_batch with one data-parallel rank: plain BatchNorm (nothing to synchronise)")
        if cfg.channels_last and runtime.device.type == "cuda":  # the model then takes its inputs channels-last too
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        elif cfg.channels_last:
            log.info("model.channels_last is ignored on %s: it speeds up CUDA convolutions only", runtime.device.type)
        return model

    def output_loss(self, output: Any, targets: Any) -> torch.Tensor:
        return F.cross_entropy(output.float(), targets, reduction="sum")  # fp32 under any precision

    def count_targets(self, batch: Any) -> int:
        return int(batch[1].numel())

    def output_sums(self, output: Any, targets: Any) -> dict[str, torch.Tensor]:
        return {  # one forward for both the loss and the accuracy
            "loss": self.output_loss(output, targets),
            "top1": (output.argmax(dim=1) == targets).sum(),
        }

    def check_parallel(self, config: Config, dims: ParallelDims) -> None:
        super().check_parallel(config, dims)  # no tensor parallelism, no meta build
        cfg = config.model
        assert isinstance(cfg, ResNetConfig)
        stages = dims.pp * SCHEDULES[config.parallel.pipeline.schedule][1] if dims.pp > 1 else 1
        blocks = sum(DEPTHS[cfg.depth][1])
        if stages > blocks:
            raise ValueError(
                f"model.depth={cfg.depth} has {blocks} residual blocks, too few for {stages} pipeline stages "
                "(parallel.pp × stages per rank). Fix: a smaller parallel.pp, a schedule with one stage per rank, "
                "or a deeper model."
            )

    def parallel_plan(self, model: nn.Module) -> ParallelPlan:
        """The blocks (the residual blocks of every stage) and the pipeline split (no tensor parallelism)."""
        if not isinstance(model, ResNet):
            return ParallelPlan()
        return ParallelPlan(
            blocks=[block for stage in model.stages.children() for block in stage.children()],
            pipeline_stage=pipeline_stage_resnet,
        )

    def flops_per_token(self, model: nn.Module) -> float:
        """Training FLOPs per sample: 3 × the forward's (backward ≈ 2 × forward), 2 FLOPs per MAC."""
        if not isinstance(model, ResNet):
            return 0.0
        cfg = model.cfg
        return 3.0 * 2.0 * count_macs(model, (1, cfg.in_channels, cfg.image_size, cfg.image_size))


def pipeline_stage_resnet(model: nn.Module, index: int, count: int) -> nn.Module:
    assert isinstance(model, ResNet)
    return ResNetStage(model, index, count)
