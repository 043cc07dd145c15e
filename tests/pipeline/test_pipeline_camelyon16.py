"""pipelines/camelyon16.toml: settings that the CAMELYON16 protocol needs."""

from __future__ import annotations

from pathlib import Path

from wsi_milssl.config import HeatmapConfig, config_from_mapping, load_toml

ROOT = Path(__file__).resolve().parents[2]


def test_camelyon16_detection_threshold_keeps_the_froc_curve_whole():
    """FROC averages sensitivities up to 8 FP/slide; a threshold of 0.5 cut the curve short."""
    raw = load_toml(ROOT / "pipelines" / "camelyon16.toml")
    config = config_from_mapping(HeatmapConfig, raw["heatmap"])
    assert config.detection_threshold <= HeatmapConfig().detection_threshold <= 0.1
