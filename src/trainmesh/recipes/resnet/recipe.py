"""The ResNet recipe: an image classifier on scikit-learn's digits or an image folder, with BatchNorm or
SyncBatchNorm, reporting validation top-1 accuracy next to the loss."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from trainmesh.config.schema import Config
from trainmesh.layers import convert_sync_batchnorm
from trainmesh.recipes.base import Recipe
from trainmesh.recipes.resnet.data import DIGITS_SOURCES, Augment, ImageData, folder_classes, load_image_data
from trainmesh.recipes.resnet.model import ResNet, ResNetConfig, count_macs
from trainmesh.runtime.logging import get_logger

if TYPE_CHECKING:
    from trainmesh.runtime.runtime import Runtime

log = get_logger(__name__)


class ResNetRecipe(Recipe):
    name = "resnet"
    model_config_cls = ResNetConfig
    eval_metrics = ("top1",)

    def __init__(self) -> None:
        self.data: ImageData | None = None
        self.device = torch.device("cpu")
        self.sync_batchnorm = False  # convert to SyncBatchNorm (norm=sync_batch with several dp ranks)
        self.channels_last = False  # decided in build_model: CUDA only

    def complete_config(self, config: Config) -> None:
        model = config.model
        assert isinstance(model, ResNetConfig)
        digits = config.data.source in DIGITS_SOURCES
        if model.hflip == "auto":
            model.hflip = "false" if digits else "true"
        if digits:
            model.num_classes = model.num_classes or 10
            model.in_channels = model.in_channels or 1
            return
        root = Path(config.data.source).expanduser()
        if root.is_dir():  # a folder only the worker nodes see is resolved in prepare() instead
            model.num_classes = model.num_classes or len(folder_classes(root))
            model.in_channels = model.in_channels or 3

    def prepare(self, config: Config, runtime: Runtime) -> None:
        model = config.model
        assert isinstance(model, ResNetConfig)
        if model.hflip == "auto":  # a config built without load_config
            self.complete_config(config)
        augment = Augment(model.crop_padding, model.hflip == "true")
        data = load_image_data(
            config.data.source, model.image_size, model.in_channels, config.data.val_fraction, augment, config.run.seed
        )
        if model.num_classes and model.num_classes < data.num_classes:
            raise ValueError(
                f"model.num_classes={model.num_classes} but data.source={config.data.source!r} has "
                f"{data.num_classes} classes. Fix: --model.num_classes={data.num_classes} (or 0: from the data)."
            )
        model.num_classes = model.num_classes or data.num_classes
        model.in_channels = model.in_channels or data.in_channels
        self.data = data
        self.device = runtime.device
        if runtime.is_main_process:
            log.info("%s", data.description)
        if model.norm == "sync_batch":
            # Statistics are synchronised over the data-parallel group, which today is the whole world.
            if runtime.dp_size not in (1, runtime.world_size):
                raise ValueError(
                    f"model.norm='sync_batch' needs the data-parallel group, but {runtime.dp_size} of "
                    f"{runtime.world_size} ranks are data-parallel, which is not supported yet. "
                    "Fix: --model.norm=batch."
                )
            self.sync_batchnorm = runtime.dp_size > 1

    def build_model(self, config: Config) -> nn.Module:
        cfg = config.model
        assert isinstance(cfg, ResNetConfig)
        model: nn.Module = ResNet(cfg)
        if self.sync_batchnorm:
            model = convert_sync_batchnorm(model)  # default group: the world, the data-parallel group today
        elif cfg.norm == "sync_batch":
            log.info("model.norm=sync_batch with one data-parallel rank: plain BatchNorm (nothing to synchronise)")
        self.channels_last = cfg.channels_last and self.device.type == "cuda"
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        elif cfg.channels_last:
            log.info("model.channels_last is ignored on %s: it speeds up CUDA convolutions only", self.device.type)
        return model

    def datasets(self) -> tuple[Dataset[Any], Dataset[Any]]:
        assert self.data is not None, "prepare() first"
        return self.data.train, self.data.val

    def _logits(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return module(x).float()  # (B, classes); the loss in fp32 under any precision

    def loss_sum(self, module: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch  # (B, C, S, S), (B,)
        return F.cross_entropy(self._logits(module, x), y, reduction="sum")

    def count_targets(self, batch: Any) -> int:
        return int(batch[1].numel())

    def eval_sums(self, module: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        logits = self._logits(module, x)  # one forward for both the loss and the accuracy
        return {
            "loss": F.cross_entropy(logits, y, reduction="sum"),
            "top1": (logits.argmax(dim=1) == y).sum(),
        }

    def blocks(self, model: nn.Module) -> list[nn.Module] | None:
        """The residual blocks of every stage."""
        if not isinstance(model, ResNet):
            return None
        return [block for stage in model.stages.children() for block in stage.children()]

    def flops_per_token(self, model: nn.Module) -> float:
        """Training FLOPs per sample: 3 × the forward's (backward ≈ 2 × forward), 2 FLOPs per MAC."""
        if not isinstance(model, ResNet):
            return 0.0
        cfg = model.cfg
        return 3.0 * 2.0 * count_macs(model, (1, cfg.in_channels, cfg.image_size, cfg.image_size))
