"""GPT language-model recipe."""

from trainmesh.recipes.gpt.model import GPT, GPTConfig
from trainmesh.recipes.gpt.recipe import GPTRecipe

__all__ = ["GPT", "GPTConfig", "GPTRecipe"]
