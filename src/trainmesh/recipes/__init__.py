"""Built-in recipes, by name (`trainmesh run <recipe>`)."""

from __future__ import annotations

from collections.abc import Callable

from trainmesh.recipes.base import Recipe
from trainmesh.recipes.gpt import GPTRecipe
from trainmesh.recipes.resnet import ResNetRecipe

RECIPES: dict[str, Callable[[], Recipe]] = {"gpt": GPTRecipe, "resnet": ResNetRecipe}

__all__ = ["RECIPES", "Recipe", "get_recipe"]


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; built-in recipes: {', '.join(sorted(RECIPES))}")
    return RECIPES[name]()
