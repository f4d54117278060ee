"""Resolve once: what the user asked for (a config) and where it runs (a world size) become one frozen `Job`
(`resolve(config, world_size)`), checked before any process starts or any file is written; downstream only reads it.

Details: docs/internals.md#jobspecpy
"""

from __future__ import annotations

import dataclasses
import math
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainmesh.config.loader import (
    ConfigError,
    build_config,
    config_to_dict,
    deep_merge,
    dump_toml,
    load_toml,
    merge_overrides,
    parse_override,
)
from trainmesh.config.schema import Config
from trainmesh.core.batch import BatchMathError, BatchSplit
from trainmesh.core.env import DistEnv
from trainmesh.recipes import Recipe, get_recipe
from trainmesh.strategies import Layout, check_layout, resolve_parallelism

if TYPE_CHECKING:
    from trainmesh.runtime.runtime import Runtime


@dataclass(frozen=True)
class Job:
    """A config resolved for one world size: what every rank of the job runs. Build it with `resolve`."""

    config: Config
    """Complete: the recipe's derived model settings (vocabulary size, classes, channels) are filled in."""
    world_size: int
    layout: Layout
    """The data-parallel strategy (`auto` resolved) and the degrees of the device mesh."""
    batch: BatchSplit
    """Global batch = micro-batch × accumulation steps × data-parallel ranks."""
    recipe: Recipe
    """The built-in recipe run.recipe names, or the caller's own (recipes hold no state)."""

    @property
    def run_id(self) -> str:
        """The run folder's name under run.out_dir; empty until the launcher (or rank 0) names it."""
        return self.config.run.id

    @property
    def gradient_mode_matters(self) -> bool:
        """Whether parallel.fsdp.reduce_every_microstep changes anything: fsdp sharding over ranks, accumulating
        micro-steps, no pipeline (a pipeline's stages reduce every micro-step as it is)."""
        strategy, dims = self.layout
        return strategy == "fsdp" and dims.pp == 1 and dims.dp_shard > 1 and self.batch.accum_steps > 1

    @property
    def resume(self) -> bool:
        """Whether the run continues from its newest checkpoint (checkpoint.resume, or an elastic launch)."""
        return self.config.checkpoint.resume

    def named(self, run_id: str, *, resume: bool) -> Job:
        """This job with its run id and resume decision made (a new Job; this one is unchanged)."""
        run = dataclasses.replace(self.config.run, id=run_id)
        checkpoint = dataclasses.replace(self.config.checkpoint, resume=resume)
        return dataclasses.replace(self, config=dataclasses.replace(self.config, run=run, checkpoint=checkpoint))

    def config_dict(self) -> dict[str, Any]:
        """The config as recorded in `config.toml` and in every checkpoint."""
        return config_to_dict(self.config)

    def config_toml(self) -> str:
        return dump_toml(self.config_dict())

    def runtime(self, env: DistEnv | None = None) -> Runtime:
        """The Runtime of this job in this process (collective: every rank of the job creates it)."""
        from trainmesh.runtime.runtime import Runtime  # imported here: `trainmesh check` never needs it

        c = self.config
        return Runtime(
            precision=c.train.precision,
            float8=c.float8,
            parallel=c.parallel,
            dist_config=c.dist,
            compile=c.train.compile,
            deterministic=c.run.deterministic,
            tf32=c.train.tf32,
            env=env,
            layout=self.layout,
        )


def load_config(
    path: str | Path | None, overrides: list[str], recipe: str | None = None, base: dict[str, Any] | None = None
) -> Config:
    """Defaults < `base` < TOML file < overrides, completed by the recipe (`Recipe.complete_model`); `recipe` (from
    the command line) must agree with run.recipe. `base`: a run's recorded config, when resuming it (resume.py)."""
    in_toml = load_toml(path) if path else {}
    data = merge_overrides(deep_merge(base or {}, in_toml), overrides)
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
        return _complete(build_config(data, chosen.model_config_cls), chosen)
    except ValueError as e:  # a key's value, an unknown key, recipe or tokenizer
        keys_set_here = [parse_override(o)[0] for o in overrides]
        raise ConfigError(_with_origin(str(e), path, _dotted_keys(in_toml), keys_set_here)) from None


_completed: dict[int, tuple[weakref.ref[Config], type[Recipe]]] = {}
"""Configs completed in this process, by identity (a config may hold lists: not hashable), with their recipe."""


def _complete(config: Config, recipe: Recipe) -> Config:
    """`config` with the recipe's derived model settings filled in (`Recipe.complete_model`), once per process:
    completing reads files (the data's manifest, the tokenizer, model.init_from's config.json), and a config
    completed already (the worker's, from load_config, then resolved) is complete."""
    known = _completed.get(id(config))
    if known is not None and known[0]() is config and known[1] is type(recipe):
        return config
    complete = dataclasses.replace(config, model=recipe.complete_model(config))
    key = id(complete)
    _completed[key] = (weakref.ref(complete, lambda _: _completed.pop(key, None)), type(recipe))
    return complete


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


def check_data(config: Config, recipe: Recipe | None = None) -> None:
    """The data the config names is there and readable for its recipe (`recipe`: the caller's own, else the
    built-in one run.recipe names); ConfigError saying what to fix."""
    try:
        (recipe or get_recipe(config.run.recipe)).check_data(config)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def resolve(
    config: Config, world_size: int, other_world_sizes: Sequence[int] = (), recipe: Recipe | None = None
) -> Job:
    """The Job of `config` (from `load_config`, or built in code) at `world_size` ranks, after every check across
    sections (ConfigError naming the keys and a fix). `other_world_sizes`: the sizes the same job may also run
    at (elastic), so that a suggested batch fix holds at all of them. `recipe`: your own, instead of the
    built-in one run.recipe names."""
    recipe = recipe or get_recipe(config.run.recipe)
    par, train = config.parallel, config.train
    try:
        config = _complete(config, recipe)  # done already for a config from load_config
        layout = resolve_parallelism(par, world_size)
        check_layout(par, layout, train.precision, config.float8)
        recipe.check_parallel(config, layout.dims)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if layout.dims.pp > 1 and train.micro_batch % par.pipeline.microbatches:
        fits = _divisor(train.micro_batch, par.pipeline.microbatches)
        raise ConfigError(
            f"train.micro_batch={train.micro_batch} cannot be cut into parallel.pipeline.microbatches="
            f"{par.pipeline.microbatches} equal pieces for the pipeline. Fix: a train.micro_batch that is a "
            f"multiple of {par.pipeline.microbatches}, or --parallel.pipeline.microbatches={fits}."
        )
    if train.precision == "fp8-mixed":
        _check_fp8_tokens(train.micro_batch, par.pipeline.microbatches if layout.dims.pp > 1 else 1, recipe, config)
    try:
        others = [resolve_parallelism(par, w).dims.dp_size for w in other_world_sizes if w != world_size]
        batch = BatchSplit.derive(
            micro_batch=train.micro_batch,
            global_batch=train.global_batch,
            global_batch_tokens=train.global_batch_tokens,
            dp_size=layout.dims.dp_size,
            tokens_per_sample=recipe.tokens_per_sample(config.model),
            other_dp_sizes=others,
        )
    except (BatchMathError, ValueError) as e:
        raise ConfigError(str(e)) from None
    return Job(config, world_size, layout, batch, recipe)


def _check_fp8_tokens(micro_batch: int, pieces: int, recipe: Recipe, config: Config) -> None:
    """A float8 weight gradient is a matmul over the tokens of a forward, and float8 matmuls (torch._scaled_mm)
    need their inner dimension to be a multiple of 16: so must a micro-batch piece's token count be. Checked for
    token recipes (others feed their linear layers one row per sample, and their widths decide what converts)."""
    per_sample = recipe.tokens_per_sample(config.model)
    tokens = micro_batch // pieces * per_sample
    if not per_sample or tokens % 16 == 0:
        return
    step = pieces * 16 // math.gcd(16, per_sample)  # the micro-batches whose pieces hold a multiple of 16 tokens
    split = f" / parallel.pipeline.microbatches={pieces}" if pieces > 1 else ""
    raise ConfigError(
        f"train.precision='fp8-mixed': a forward of train.micro_batch={micro_batch}{split} samples × {per_sample} "
        f"tokens holds {tokens} tokens, but float8 matmuls need a multiple of 16 (the weight gradients are matmuls "
        f"over the tokens). Fix: --train.micro_batch={-(-micro_batch // step) * step} (a multiple of {step}), or "
        "--train.precision=bf16-mixed."
    )


def _divisor(n: int, near: int) -> int:
    """The divisor of n closest to `near` (a suggestion for a fix)."""
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - near))
