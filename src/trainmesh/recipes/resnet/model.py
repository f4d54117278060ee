"""ResNet-18/34/50/101/152 (He et al., 2015) in torchvision's layout, written here so the recipe needs no torchvision,
with a `small` stem and a `width` for small images and CPUs.

Details: docs/internals.md#recipesresnetmodelpy
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from trainmesh.config.schema import ModelConfig

# depth: (block type, blocks per stage)
DEPTHS: dict[int, tuple[str, tuple[int, int, int, int]]] = {
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
    152: ("bottleneck", (3, 8, 36, 3)),
}
NORMS = ("batch", "sync_batch")
STEMS = ("auto", "imagenet", "small")
SMALL_STEM_BELOW = 64  # stem=auto picks the small stem for images under this many pixels a side


@dataclass(frozen=True)
class ResNetConfig(ModelConfig):
    depth: int = 18
    """Layers: 18 | 34 (basic blocks) | 50 | 101 | 152 (bottleneck blocks)."""
    width: int = 64
    """Channels of the first stage (64 in the paper); the stages have width × 1, 2, 4, 8 (× 4 for bottlenecks)."""
    num_classes: int = 0
    """Output classes; 0: from the data (10 for digits, the number of class folders for an image folder)."""
    in_channels: int = 0
    """Input channels; 0: from the data (1 for digits, 3 (RGB) for an image folder; 1 reads folders as grayscale)."""
    image_size: int = 32
    """Side in pixels of the square images the model sees (the data is resized to it, bilinear)."""
    stem: str = "auto"
    """auto (small under 64 px, else imagenet) | imagenet (7×7 stride-2 conv + max-pool) | small (3×3 stride-1 conv)."""
    norm: str = "batch"
    """batch (BatchNorm, statistics per rank) | sync_batch (statistics over all data-parallel ranks; CPU/gloo too)."""
    zero_init_residual: bool = False
    """Start each block's last BatchNorm scale at 0, so every residual block begins as the identity."""
    channels_last: bool = False
    """Channels-last memory format on CUDA (faster convolutions with tensor cores); ignored on CPU, with a log line."""
    crop_padding: int = 4
    """Training augmentation: zero-pad by this many pixels and crop back at a random offset; 0: no random crop."""
    hflip: bool | None = None
    """Training augmentation, random horizontal flips: true | false | unset or "auto": image folders yes, digits
    no (a mirrored 3 is no digit)."""

    def __post_init__(self) -> None:
        if self.depth not in DEPTHS:
            raise ValueError(f"model.depth={self.depth} is not one of {', '.join(map(str, DEPTHS))}")
        for key, value, allowed in (
            ("model.stem", self.stem, STEMS),
            ("model.norm", self.norm, NORMS),
        ):
            if value not in allowed:
                raise ValueError(f"{key}={value!r} is not allowed; choose one of: {', '.join(allowed)}")
        for name, number, low in (
            ("model.width", self.width, 1),
            ("model.num_classes", self.num_classes, 0),
            ("model.in_channels", self.in_channels, 0),
            ("model.image_size", self.image_size, 8),
            ("model.crop_padding", self.crop_padding, 0),
        ):
            if number < low:
                raise ValueError(f"{name}={number} must be >= {low}")
        if self.stem == "auto":  # resolved when built, so the written config says which (frozen: no other way)
            object.__setattr__(self, "stem", "small" if self.image_size < SMALL_STEM_BELOW else "imagenet")


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)  # bias is redundant before a norm


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    """Identity when shapes agree, else a strided 1×1 projection (the paper's option B)."""
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(_conv1x1(cin, cout, stride), nn.BatchNorm2d(cout))


class BasicBlock(nn.Module):
    """Two 3×3 convolutions (ResNet-18/34)."""

    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = _conv3x3(cin, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = _shortcut(cin, planes, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1×1 reduce, 3×3 (strided), 1×1 expand ×4 (ResNet-50/101/152)."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = _conv1x1(cin, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, planes * 4)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.shortcut = _shortcut(cin, planes * 4, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return torch.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        assert cfg.num_classes > 0 and cfg.in_channels > 0, "resolve num_classes/in_channels from the data first"
        self.cfg = cfg
        w = cfg.width
        if cfg.stem == "imagenet":  # (B, C, H, W) -> (B, w, H/4, W/4)
            self.stem = nn.Sequential(
                nn.Conv2d(cfg.in_channels, w, 7, stride=2, padding=3, bias=False),
                nn.BatchNorm2d(w),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(3, stride=2, padding=1),
            )
        else:  # small: (B, C, H, W) -> (B, w, H, W)
            self.stem = nn.Sequential(_conv3x3(cfg.in_channels, w), nn.BatchNorm2d(w), nn.ReLU(inplace=True))
        kind, counts = DEPTHS[cfg.depth]
        block = BasicBlock if kind == "basic" else Bottleneck
        stages: list[nn.Module] = []
        cin = w
        for i, count in enumerate(counts):  # each later stage halves H and W and doubles the channels
            planes = w * 2**i
            blocks: list[nn.Module] = []
            for j in range(count):
                blocks.append(block(cin, planes, stride=2 if i > 0 and j == 0 else 1))
                cin = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(cin, cfg.num_classes)
        self._init_weights(cfg.zero_init_residual)

    def _init_weights(self, zero_init_residual: bool) -> None:
        # He initialisation for ReLU networks (torchvision's choice); norms start as the identity.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:  # each block then starts as its shortcut (Goyal et al., 2017)
            for m in self.modules():
                if isinstance(m, BasicBlock):
                    nn.init.zeros_(m.bn2.weight)
                elif isinstance(m, Bottleneck):
                    nn.init.zeros_(m.bn3.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return classify(self.head, self.stages(self.stem(like_stem(x, self.stem))))


def like_stem(x: torch.Tensor, stem: nn.Module) -> torch.Tensor:
    """Images (B, C, H, W) in the memory format of the stem's first convolution: channels-last for a model
    converted to it (model.channels_last on CUDA), so the whole network runs channels-last."""
    weight = cast(nn.Conv2d, cast(nn.Sequential, stem)[0]).weight
    if weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous():
        return x.contiguous(memory_format=torch.channels_last)
    return x


def classify(head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Features (B, C', H', W') -> logits (B, num_classes), by global average pooling and the head
    (of a ResNet, or of its last pipeline stage)."""
    return head(x.mean(dim=(2, 3)))


class ResNetStage(nn.Module):
    """Pipeline stage `index` of `count`: the stem on the first, an even share of the residual blocks
    (in order, across the model's stages), pooling and the head on the last. It shares the model's
    submodules under the model's names (stages.<i>.<j>), so parameters and checkpoints are the model's."""

    def __init__(self, model: ResNet, index: int, count: int) -> None:
        super().__init__()
        blocks = [
            (str(i), str(j), block)
            for i, stage in enumerate(model.stages)
            for j, block in enumerate(cast(nn.Sequential, stage))
        ]
        assert count <= len(blocks), "checked before launch (ResNetRecipe.check_parallel)"
        self.first, self.last = index == 0, index == count - 1
        if self.first:
            self.stem = model.stem
        self.stages = nn.ModuleDict()
        for i, j, block in blocks[index * len(blocks) // count : (index + 1) * len(blocks) // count]:
            if i not in self.stages:
                self.stages[i] = nn.ModuleDict()
            cast(nn.ModuleDict, self.stages[i])[j] = block
        if self.last:
            self.head = model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: images (B, C, H, W); others: features. Last: logits (B, num_classes)."""
        if self.first:
            x = self.stem(like_stem(x, self.stem))
        for stage in self.stages.values():
            for block in cast(nn.ModuleDict, stage).values():
                x = block(x)
        return classify(self.head, x) if self.last else x


def count_macs(model: nn.Module, input_shape: tuple[int, ...]) -> int:
    """Multiply-accumulates of one forward pass over convolutions and linear layers, counted on a real
    forward of a zero input with hooks (exact for any stem, width or depth; norms and pooling, a few
    percent, are left out as is usual). Runs in eval mode, so batch-norm buffers are untouched."""
    total = 0

    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        nonlocal total
        if isinstance(module, nn.Conv2d):
            per_output = module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
            total += output.numel() * per_output
        elif isinstance(module, nn.Linear):
            total += output.numel() * module.in_features

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    was_training = model.training
    param = next(model.parameters())
    try:
        model.eval()
        with torch.no_grad():
            model(torch.zeros(input_shape, dtype=param.dtype, device=param.device))
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return total
