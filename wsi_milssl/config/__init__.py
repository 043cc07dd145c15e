"""Frozen, validated configuration dataclasses, one module per stage, and their helpers."""

from wsi_milssl.config.base import (
    check_choice,
    check_range,
    check_type,
    config_from_mapping,
    config_hash,
    config_to_dict,
    load_toml,
    write_resolved_config,
)
from wsi_milssl.config.synth import SynthConfig

__all__ = [
    "SynthConfig",
    "check_choice",
    "check_range",
    "check_type",
    "config_from_mapping",
    "config_hash",
    "config_to_dict",
    "load_toml",
    "write_resolved_config",
]
