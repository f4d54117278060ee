"""ResNet image-classification recipe (ResNet-18/34/50/101/152, BatchNorm or SyncBatchNorm)."""

from trainmesh.recipes.resnet.model import ResNet, ResNetConfig
from trainmesh.recipes.resnet.recipe import ResNetRecipe

__all__ = ["ResNet", "ResNetConfig", "ResNetRecipe"]
