"""Configuration: schema (typed sections), loading (TOML + dotted overrides) and cross-section checks."""

from trainmesh.config.loader import ConfigError, build_config, dump_toml, load_toml, merge_overrides
from trainmesh.config.schema import Config, ModelConfig
from trainmesh.config.validate import load_config, validate

__all__ = [
    "Config",
    "ConfigError",
    "ModelConfig",
    "build_config",
    "dump_toml",
    "load_config",
    "load_toml",
    "merge_overrides",
    "validate",
]
