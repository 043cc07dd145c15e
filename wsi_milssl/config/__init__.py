"""Frozen, validated configuration dataclasses, one module per stage, and their helpers."""

from wsi_milssl.config.base import (
    check_choice,
    check_range,
    check_type,
    coerce_float_fields,
    config_from_mapping,
    config_hash,
    config_to_dict,
    load_toml,
    write_resolved_config,
)
from wsi_milssl.config.evaluate import EvaluateConfig
from wsi_milssl.config.features import FeaturesConfig
from wsi_milssl.config.heatmap import HeatmapConfig
from wsi_milssl.config.label import LabelConfig
from wsi_milssl.config.synth import SynthConfig
from wsi_milssl.config.tile import TileConfig
from wsi_milssl.config.train import BenchmarkConfig, TrainConfig

__all__ = [
    "BenchmarkConfig",
    "TrainConfig",
    "EvaluateConfig",
    "FeaturesConfig",
    "HeatmapConfig",
    "LabelConfig",
    "SynthConfig",
    "TileConfig",
    "check_choice",
    "check_range",
    "check_type",
    "coerce_float_fields",
    "config_from_mapping",
    "config_hash",
    "config_to_dict",
    "load_toml",
    "write_resolved_config",
]
