"""Resolve a config for a recipe and check it against the world it will run in — before any launch."""

from __future__ import annotations

from pathlib import Path

from trainmesh.config.loader import ConfigError, build_config, load_toml, merge_overrides
from trainmesh.config.schema import Config
from trainmesh.recipes import get_recipe
from trainmesh.strategies import DISTRIBUTED, MeshShape, resolve_strategy_name
from trainmesh.train.batch import BatchMathError, BatchPlan


def load_config(path: str | Path | None, overrides: list[str], recipe: str | None = None) -> Config:
    """Defaults < TOML file < overrides; `recipe` (from the command line) must agree with run.recipe."""
    data = load_toml(path) if path else {}
    data = merge_overrides(data, overrides)
    in_file = data.get("run", {}).get("recipe")
    if recipe and in_file and in_file != recipe:
        raise ConfigError(
            f"the command names recipe {recipe!r} but the config has run.recipe={in_file!r}. "
            f"Fix: trainmesh run {in_file} ..., or change run.recipe."
        )
    name = recipe or in_file or "gpt"
    data.setdefault("run", {})["recipe"] = name
    try:
        chosen = get_recipe(name)
        config = build_config(data, chosen.model_config_cls)
        chosen.complete_config(config)
    except ConfigError:
        raise
    except ValueError as e:  # unknown recipe or tokenizer
        raise ConfigError(str(e)) from None
    return config


def validate(config: Config, world_size: int) -> BatchPlan:
    """Cross-section checks for a given world size; returns the batch plan they imply."""
    par = config.parallel
    try:
        strategy = resolve_strategy_name(par.strategy, world_size)
        if strategy == "fsdp":
            MeshShape.resolve(world_size, par.dp_replicate, par.dp_shard)
        elif (par.dp_replicate, par.dp_shard) != (1, -1):
            raise ConfigError(
                f"parallel.dp_replicate={par.dp_replicate} / parallel.dp_shard={par.dp_shard} shape fsdp's mesh, "
                f"but parallel.strategy resolves to {strategy!r}. Fix: --parallel.strategy=fsdp, or leave them "
                "at 1 / -1."
            )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    dp_size = world_size if strategy in DISTRIBUTED else 1
    recipe = get_recipe(config.run.recipe)
    try:
        return BatchPlan.derive(config.train, dp_size, recipe.tokens_per_sample(config.model))
    except BatchMathError as e:
        raise ConfigError(str(e)) from None
