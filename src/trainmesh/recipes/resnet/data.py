"""Images for the ResNet recipe: the digits trainmesh ships (nothing to download) or a folder tree, with a fixed
validation split and augmentation drawn from the sample id, so that resume stays bit-exact at any world size.

Details: docs/internals.md#recipesresnetdatapy
"""

from __future__ import annotations

import gzip
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F
from torch.utils.data import Dataset

from trainmesh.core.errors import UserError

DIGITS_SOURCES = ("embedded", "digits")
DIGITS_FILE = Path(__file__).with_name("digits.csv.gz")  # package data (pyproject.toml), CC BY 4.0: digits.LICENSE
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
SPLIT_SEED = 0  # the train/val split never depends on run.seed
AUGMENTED_IDS = 2**22  # training ids in all when augmenting (passes = this // images)
STATS_IMAGES = 1000  # images used to estimate the normalisation mean and std


class ImageDataError(UserError, ValueError):
    """An image source that cannot be trained on as it is (missing, no classes, unreadable images)."""


class ImageSource:
    """Labelled images, each as a float tensor (C, S, S) with values in [0, 1]."""

    labels: list[int]

    def __len__(self) -> int:
        return len(self.labels)

    def image(self, index: int) -> torch.Tensor:
        raise NotImplementedError


class TensorImages(ImageSource):
    """Images held in memory (the digits): (N, C, S, S) in [0, 1]."""

    def __init__(self, images: torch.Tensor, labels: list[int]) -> None:
        assert images.dim() == 4 and images.size(0) == len(labels)
        self.images, self.labels = images, labels

    def image(self, index: int) -> torch.Tensor:
        return self.images[index]


class FileImages(ImageSource):
    """Images decoded from files on each access (DataLoader workers share the work), then resized."""

    def __init__(self, files: list[Path], labels: list[int], channels: int, size: int) -> None:
        self.files, self.labels, self.channels, self.size = files, labels, channels, size

    def image(self, index: int) -> torch.Tensor:
        return resize(match_channels(read_image(self.files[index]), self.channels), self.size)


@dataclass(frozen=True)
class Augment:
    """Random crop after zero padding, and an optional horizontal flip, drawn from `gen` only."""

    crop_padding: int
    hflip: bool

    @property
    def active(self) -> bool:
        return self.crop_padding > 0 or self.hflip

    def __str__(self) -> str:
        parts = [f"random crop (padding {self.crop_padding})"] if self.crop_padding else []
        return "augmentation: " + " + ".join(parts + (["horizontal flip"] if self.hflip else []))

    def __call__(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        _, h, w = x.shape  # (C, H, W)
        p = self.crop_padding
        dy, dx = torch.randint(0, 2 * p + 1, (2,), generator=gen).tolist()  # always drawn: a fixed stream
        flip = bool(torch.rand((), generator=gen) < 0.5)
        if p:
            x = F.pad(x, (p, p, p, p))[:, dy : dy + h, dx : dx + w]
        if self.hflip and flip:
            x = x.flip(-1)
        return x


class ImageDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """(image (C, S, S) normalised, label) pairs; with `augment`, `passes` differently augmented copies
    of each image, sample id j being image j % n in pass j // n (docs/internals.md#recipesresnetdatapy)."""

    def __init__(
        self,
        source: ImageSource,
        mean: torch.Tensor,
        std: torch.Tensor,
        augment: Augment | None = None,
        seed: int = 0,
        passes: int = 1,
    ) -> None:
        self.source, self.mean, self.std, self.augment, self.seed = source, mean, std, augment, seed
        self.passes = passes if augment is not None and augment.active else 1

    def __len__(self) -> int:
        return len(self.source) * self.passes

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is outside 0..{len(self) - 1}")
        pass_, image_id = divmod(index, len(self.source))
        x = self.source.image(image_id)  # (C, S, S) in [0, 1]
        if self.augment is not None and self.augment.active:
            x = self.augment(x, torch.Generator().manual_seed(sample_seed(self.seed, pass_, image_id)))
        x = (x - self.mean) / self.std
        return x.float(), torch.tensor(self.source.labels[image_id], dtype=torch.int64)


def sample_seed(seed: int, pass_: int, image_id: int) -> int:
    """A 64-bit seed for one (run seed, pass, image): a hash, so nearby ids get unrelated streams."""
    digest = hashlib.blake2b(f"{seed}/{pass_}/{image_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass
class ImageData:
    train: ImageDataset
    val: ImageDataset
    num_classes: int
    in_channels: int
    description: str


def load_image_data(
    source: str, image_size: int, in_channels: int, val_fraction: float, augment: Augment, seed: int
) -> ImageData:
    """Train and validation datasets for `data.source`; `in_channels` 0 keeps the source's own."""
    if source in DIGITS_SOURCES:
        train_src, val_src, classes = _digits(image_size, in_channels or 1, val_fraction)
        name = "embedded digits"
    else:
        train_src, val_src, classes = _folder(Path(source).expanduser(), image_size, in_channels or 3, val_fraction)
        name = f"image folder {source}"
    mean, std = channel_stats(train_src)
    passes = max(1, AUGMENTED_IDS // len(train_src))
    train = ImageDataset(train_src, mean, std, augment, seed, passes)
    val = ImageDataset(val_src, mean, std)
    shape = "×".join(map(str, train_src.image(0).shape))
    text = f"{name}: {len(train_src):,} train / {len(val_src):,} val images of {shape}, {len(classes)} classes"
    if train.passes > 1:
        text += f"; {augment}; {train.passes:,} augmented passes of the training images per sampler epoch"
    return ImageData(train, val, len(classes), train_src.image(0).size(0), text)


def split_ids(n: int, val_fraction: float) -> tuple[list[int], list[int]]:
    """(train ids, val ids): a fixed random `val_fraction` of 0..n-1 for validation (at least one)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    return sorted(order[n_val:]), sorted(order[:n_val])


def _digits(size: int, channels: int, val_fraction: float) -> tuple[ImageSource, ImageSource, list[str]]:
    with gzip.open(DIGITS_FILE, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.uint8)  # (N, 65): 8×8 pixel counts 0..16, then the digit
    pixels = table[:, :64].astype(np.float32) / 16.0
    images = torch.from_numpy(pixels).view(-1, 1, 8, 8)  # (N, 1, 8, 8), rows of the image as in the file
    images = match_channels(resize(images, size), channels)  # (N, C, S, S)
    labels = [int(t) for t in table[:, 64]]
    train_ids, val_ids = split_ids(len(labels), val_fraction)

    def subset(ids: list[int]) -> TensorImages:
        return TensorImages(images[ids], [labels[i] for i in ids])

    return subset(train_ids), subset(val_ids), [str(d) for d in range(10)]


def folder_classes(root: Path) -> list[str]:
    """Class names of an image folder: its sub-folders (those of root/train if split), sorted."""
    base = root / "train" if _has_split(root) else root
    if not base.is_dir():
        raise ImageDataError(
            f"data.source={str(root)!r} is neither 'embedded' (the digits) nor a folder. "
            "Fix: --data.source=<a folder of class sub-folders>, or embedded."
        )
    classes = sorted(p.name for p in base.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise ImageDataError(f"data.source={str(root)!r} has no class sub-folders (expected root/<class>/<image>)")
    return classes


def _has_split(root: Path) -> bool:
    return (root / "train").is_dir() and (root / "val").is_dir()


def _folder(root: Path, size: int, channels: int, val_fraction: float) -> tuple[ImageSource, ImageSource, list[str]]:
    classes = folder_classes(root)
    if _has_split(root):
        train_files, train_labels = _scan(root / "train", classes)
        val_files, val_labels = _scan(root / "val", classes)
    else:
        files, labels = _scan(root, classes)
        train_ids, val_ids = split_ids(len(files), val_fraction)
        train_files, train_labels = [files[i] for i in train_ids], [labels[i] for i in train_ids]
        val_files, val_labels = [files[i] for i in val_ids], [labels[i] for i in val_ids]
    return (
        FileImages(train_files, train_labels, channels, size),
        FileImages(val_files, val_labels, channels, size),
        classes,
    )


def _scan(base: Path, classes: list[str]) -> tuple[list[Path], list[int]]:
    files: list[Path] = []
    labels: list[int] = []
    unknown = sorted(p.name for p in base.iterdir() if p.is_dir() and p.name not in classes)
    if unknown:
        raise ImageDataError(f"{base} has class folders {unknown} that the training set does not have")
    for label, name in enumerate(classes):
        found = sorted(p for p in (base / name).glob("*") if p.suffix.lower() in (*IMAGE_SUFFIXES, ".npy"))
        files += found
        labels += [label] * len(found)
    if len(files) < 2:
        raise ImageDataError(f"{base} holds {len(files)} images (.npy or {', '.join(IMAGE_SUFFIXES)}); need at least 2")
    return files, labels


def read_image(path: Path) -> torch.Tensor:
    """A file as a float tensor (C, H, W) in [0, 1]."""
    if path.suffix.lower() == ".npy":
        array = np.load(path, allow_pickle=False)
    else:
        try:
            from PIL import Image
        except ImportError as e:
            raise ModuleNotFoundError(
                f"reading {path.suffix} images needs Pillow. Fix: pip install pillow, or store images as .npy"
            ) from e
        with Image.open(path) as img:
            array = np.asarray(img.convert("RGB" if img.mode not in ("L", "I;16", "I", "F") else "L"))
    scale = 255.0 if array.dtype == np.uint8 else 1.0
    x = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32) / scale)
    if x.dim() == 2:
        return x.unsqueeze(0)  # (1, H, W)
    if x.dim() == 3:
        return x.permute(2, 0, 1)  # (H, W, C) -> (C, H, W)
    raise ImageDataError(f"{path}: expected an image of shape (H, W) or (H, W, C), got {tuple(x.shape)}")


def match_channels(x: torch.Tensor, channels: int) -> torch.Tensor:
    """Grayscale to `channels` copies, RGB(A) to grayscale by averaging; (..., C, H, W)."""
    have = x.size(-3)
    if have == 4 and channels != 4:  # RGBA: drop alpha
        x, have = x[..., :3, :, :], 3
    if have == channels:
        return x
    if have == 1:
        return x.expand(*x.shape[:-3], channels, *x.shape[-2:]).contiguous()
    if channels == 1:
        return x.mean(dim=-3, keepdim=True)
    raise ImageDataError(f"cannot turn a {have}-channel image into model.in_channels={channels}")


def resize(x: torch.Tensor, size: int) -> torch.Tensor:
    """Bilinear resize of (C, H, W) or (N, C, H, W) to size × size (antialiased when shrinking)."""
    if tuple(x.shape[-2:]) == (size, size):
        return x
    batched = x if x.dim() == 4 else x.unsqueeze(0)
    out = F.interpolate(batched, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
    return out if x.dim() == 4 else out[0]


def channel_stats(source: ImageSource) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std (C, 1, 1) of up to STATS_IMAGES evenly spaced images."""
    ids = torch.linspace(0, len(source) - 1, min(STATS_IMAGES, len(source))).round().long().unique().tolist()
    pixels = torch.stack([source.image(i) for i in ids]).double()  # (K, C, S, S)
    mean = pixels.mean(dim=(0, 2, 3))
    std = pixels.std(dim=(0, 2, 3)).clamp(min=1e-6)
    return mean.float().view(-1, 1, 1), std.float().view(-1, 1, 1)
