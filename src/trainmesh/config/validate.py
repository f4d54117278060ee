"""Resolve a config for a recipe and check it against the world it will run in — before any launch."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainmesh.config.loader import (
    ConfigError,
    build_config,
    config_to_dict,
    load_toml,
    merge_overrides,
    parse_override,
)
from trainmesh.config.schema import Config
from trainmesh.recipes import get_recipe
from trainmesh.strategies import MeshShape, PipelineOptions, resolve_parallelism
from trainmesh.strategies.pipeline import schedule_problem
from trainmesh.train.batch import BatchMathError, BatchPlan


def load_config(path: str | Path | None, overrides: list[str], recipe: str | None = None) -> Config:
    """Defaults < TOML file < overrides; `recipe` (from the command line) must agree with run.recipe."""
    in_toml = load_toml(path) if path else {}
    data = merge_overrides(in_toml, overrides)
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
    except ValueError as e:  # a key's value, an unknown key, recipe or tokenizer
        keys_set_here = [parse_override(o)[0] for o in overrides]
        raise ConfigError(_with_origin(str(e), path, _dotted_keys(in_toml), keys_set_here)) from None
    return config


def _with_origin(message: str, path: str | Path | None, file_keys: set[str], override_keys: list[str]) -> str:
    """`message`, saying where the key it names was set: the config file, or an override on the command line."""
    for key in re.findall(r"\b[a-z_0-9]+(?:\.[a-z_0-9]+)+\b", message):
        if key in override_keys:
            return f"{message} (set on the command line: --{key}=...)"
        if key in file_keys:
            return f"config file {str(path)!r}: {message}"
    return message


def _dotted_keys(table: dict[str, Any], prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for key, value in table.items():
        keys |= _dotted_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}"}
    return keys


def parallel_layout(config: Config, world_size: int) -> tuple[str, MeshShape]:
    """The data-parallel strategy and the mesh the parallel.* keys describe for `world_size` ranks."""
    par = config.parallel
    return resolve_parallelism(
        par.strategy, world_size, pp=par.pp, dp_replicate=par.dp_replicate, dp_shard=par.dp_shard, tp=par.tp
    )


def validate(config: Config, world_size: int, other_world_sizes: Sequence[int] = ()) -> BatchPlan:
    """Cross-section checks for a given world size; returns the batch plan they imply. `other_world_sizes`:
    the sizes the same job may also run at (elastic), so that a suggested batch fix holds at all of them."""
    par, train = config.parallel, config.train
    recipe = get_recipe(config.run.recipe)
    try:
        strategy, shape = parallel_layout(config, world_size)
        recipe.check_parallel(config, strategy, shape)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    problem = shape.pp > 1 and schedule_problem(PipelineOptions(**config_to_dict(par.pipeline)), shape.pp)
    if problem:
        raise ConfigError(problem)
    if shape.pp * shape.tp > 1 and par.fsdp.cpu_offload and strategy == "fsdp":
        raise ConfigError(
            f"parallel.fsdp.cpu_offload=true with parallel.pp={shape.pp} / parallel.tp={shape.tp} is not supported "
            "(stages pass activations, and tensor-parallel layers communicate, on the accelerator). "
            "Fix: --parallel.fsdp.cpu_offload=false."
        )
    if shape.pp > 1 and train.micro_batch % par.pipeline.microbatches:
        fits = _divisor(train.micro_batch, par.pipeline.microbatches)
        raise ConfigError(
            f"train.micro_batch={train.micro_batch} cannot be cut into parallel.pipeline.microbatches="
            f"{par.pipeline.microbatches} equal pieces for the pipeline. Fix: a train.micro_batch that is a "
            f"multiple of {par.pipeline.microbatches}, or --parallel.pipeline.microbatches={fits}."
        )
    if shape.pp * shape.tp > 1 and train.precision == "16-mixed":
        raise ConfigError(
            f"train.precision='16-mixed' with parallel.pp={shape.pp} / parallel.tp={shape.tp}: the loss scaler's "
            "overflow check would see only this rank's part of the gradients, and ranks could disagree on skipping a "
            "step. Fix: --train.precision=bf16-mixed."
        )
    try:
        others = [parallel_layout(config, w)[1].dp_size for w in other_world_sizes if w != world_size]
        return BatchPlan.derive(train, shape.dp_size, recipe.tokens_per_sample(config.model), others)
    except BatchMathError as e:
        raise ConfigError(str(e)) from None


def _divisor(n: int, near: int) -> int:
    """The divisor of n closest to `near` (a suggestion for a fix)."""
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - near))
