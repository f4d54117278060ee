"""Configuration: schema (typed sections) and loading (TOML + dotted overrides).

Resolving a config for a recipe and the cross-section checks live in `trainmesh.job.spec`, which
depends on the recipes (they depend on this package, so it is not re-exported here).
"""

from trainmesh.config.loader import ConfigError, build_config, dump_toml, load_toml, merge_overrides
from trainmesh.config.schema import Config, ModelConfig

__all__ = [
    "Config",
    "ConfigError",
    "ModelConfig",
    "build_config",
    "dump_toml",
    "load_toml",
    "merge_overrides",
]
