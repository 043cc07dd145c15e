"""HeatmapConfig validation, TOML + CLI options, and the checkpoint's tiling settings."""

from __future__ import annotations

import argparse

import pytest

from wsi_milssl.cli.heatmap import heatmap_config_from_args
from wsi_milssl.config import HeatmapConfig, TileConfig
from wsi_milssl.errors import ConfigError
from wsi_milssl.inference import TilingSettings, resolve_runtime


@pytest.mark.parametrize("kwargs, message", [
    ({"colormap": "rainbowz"}, r"HeatmapConfig.colormap must be one of .*'jet'.*; got 'rainbowz'"),
    ({"alpha": 1.5}, r"HeatmapConfig.alpha must satisfy 0.0 <= value <= 1.0; got 1.5"),
    ({"vmin": 0.6, "vmax": 0.4}, r"HeatmapConfig.vmin must be below vmax; got vmin=0.6, vmax=0.4"),
    ({"annotation_color": "green"}, r"HeatmapConfig.annotation_color must be a colour '#RRGGBB'; got 'green'"),
    ({"batch_size": -1}, r"HeatmapConfig.batch_size must satisfy 0 <= value"),
    ({"device": "tpu"}, r"HeatmapConfig.device must be one of 'auto', 'cpu', 'cuda'; got 'tpu'"),
    ({"tissue": "magic"}, r"HeatmapConfig.tissue must be one of .*'otsu'.*; got 'magic'"),
    ({"nms_radius_um": -1.0}, r"HeatmapConfig.nms_radius_um must satisfy 0.0 <= value"),
    ({"channels_last": 1}, r"HeatmapConfig.channels_last must be bool; got 1"),
])
def test_invalid_settings_are_rejected_with_the_field_and_value(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        HeatmapConfig(**kwargs)


def test_toml_then_options(tmp_path):
    toml = tmp_path / "h.toml"
    toml.write_text('[heatmap]\nalpha = 0.3\ncolormap = "viridis"\nnms_radius_um = 500.0\n')
    args = argparse.Namespace(config=toml, alpha=0.7, colormap=None, no_colorbar=True)
    config = heatmap_config_from_args(args)
    assert (config.alpha, config.colormap, config.nms_radius_um, config.colorbar) == (0.7, "viridis", 500.0, False)
    toml.write_text("alfa = 0.3\n")
    with pytest.raises(ConfigError, match="unknown key\\(s\\) alfa for HeatmapConfig"):
        heatmap_config_from_args(argparse.Namespace(config=toml))


def test_tiling_settings_come_from_the_checkpoint_with_tile_stage_fallbacks():
    cfg = {"target_mpp": 0.5, "patch_size_px": 224, "entropy_threshold_bits": 4.5,
           "store_settings": {"stride_px": 112, "tissue_detector": "none", "min_tissue": 0.3}}
    t = TilingSettings.from_checkpoint_config(cfg, config=HeatmapConfig()).plan
    assert (t.target_mpp, t.patch_size_px, t.stride_px, t.entropy_threshold_bits) == (0.5, 224, 112, 4.5)
    assert (t.tissue, t.min_tissue, t.mask_mpp) == ("none", 0.3, TileConfig().mask_mpp)
    t = TilingSettings.from_checkpoint_config(cfg, config=HeatmapConfig(tissue="otsu", min_tissue=0.5,
                                                                        mask_mpp=4.0)).plan
    assert (t.tissue, t.min_tissue, t.mask_mpp) == ("otsu", 0.5, 4.0)
    t = TilingSettings.from_checkpoint_config({"target_mpp": 1.0, "patch_size_px": 64}, config=HeatmapConfig()).plan
    assert (t.stride_px, t.entropy_threshold_bits, t.tissue) == (64, TileConfig().entropy_threshold_bits, "otsu")


def test_runtime_on_the_cpu_uses_bf16_channels_last_and_worker_preprocessing():
    rt = resolve_runtime(HeatmapConfig(device="cpu", num_workers=2))
    assert rt.device.type == "cpu" and rt.channels_last and rt.num_workers == 2 and rt.preprocess_in_workers
    assert str(rt.amp_dtype) == "torch.bfloat16"
    rt = resolve_runtime(HeatmapConfig(device="cpu", num_workers=0, amp="off", channels_last=False))
    assert rt.amp_dtype is None and rt.preprocess_in_workers and not rt.channels_last
    assert resolve_runtime(HeatmapConfig(device="cpu")).num_workers >= 1
