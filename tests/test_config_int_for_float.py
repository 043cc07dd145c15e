"""An int given for a float setting (``--set tile.magnification=10`` against the file's ``10.0``) is the same
setting: equal configs, the same JSON, the same stamp digest, so nothing runs again (review AS, finding 4)."""

from __future__ import annotations

import json

import pytest

from wsi_milssl.config import (EvaluateConfig, HeatmapConfig, LabelConfig, SynthConfig, TileConfig, TrainConfig,
                               config_from_mapping, config_hash, config_to_dict)
from wsi_milssl.errors import ConfigError
from wsi_milssl.pipeline import load_pipeline

CASES = [
    (TileConfig, {"magnification": 10, "entropy_threshold_bits": 5, "mask_mpp": 16}),
    (TileConfig, {"target_mpp": 1, "min_tissue": 0, "slide_mpp": 1}),
    (LabelConfig, {"positive_fraction": 1}),
    (HeatmapConfig, {"vmax": 1, "smooth_um": 50, "nms_radius_um": 500, "mask_mpp": 16}),
    (EvaluateConfig, {"margin_um": 75, "froc_mpp": 1}),
    (SynthConfig, {"mpp": 1, "tumor_slide_fraction": 1}),
    (TrainConfig, {"lam": 25, "mode": "features", "lr": 1, "momentum": 0, "colour_jitter": 0}),
]


@pytest.mark.parametrize("cls,ints", CASES, ids=[c[0].__name__ + "-" + next(iter(c[1])) for c in CASES])
def test_an_int_for_a_float_field_makes_the_same_config(cls, ints):
    floats = {k: float(v) if isinstance(v, int) else v for k, v in ints.items()}
    a = config_from_mapping(cls, ints)
    b = config_from_mapping(cls, floats)
    assert a == b
    assert json.dumps(config_to_dict(a), sort_keys=True) == json.dumps(config_to_dict(b), sort_keys=True)
    assert config_hash(a) == config_hash(b)
    for key in ints:
        if key != "mode":
            assert type(getattr(a, key)) is float, key


def test_bools_and_int_fields_are_not_coerced():
    with pytest.raises(ConfigError, match=r"TileConfig.magnification must be int or float; got True"):
        TileConfig(magnification=True)
    assert type(TileConfig(patch_size_px=224).patch_size_px) is int
    assert TrainConfig(mode="features", lam=25).lam == 25.0


PIPELINE = """
[pipeline]
name = "t"
[data]
train_slides = "slides"
test_slides = "slides"
train_labels = "labels.csv"
test_labels = "labels.csv"
train_annotations = "annotations"
test_annotations = "annotations"
[tile]
magnification = 10.0
patch_size_px = 64
[heatmap]
smooth_um = 50.0
"""


def test_a_set_int_gives_the_stamp_digest_of_the_files_float(tmp_path):
    from wsi_milssl.pipeline.digests import stage_settings
    from wsi_milssl.pipeline.stamps import stamp_digest

    path = tmp_path / "p.toml"
    path.write_text(PIPELINE)
    as_float = load_pipeline(path)
    as_int = load_pipeline(path, overrides=["tile.magnification=10", "heatmap.smooth_um=50"])
    for stage in ("tile", "heatmap"):
        assert stamp_digest(stage_settings(as_int, stage), {}) == stamp_digest(stage_settings(as_float, stage), {})
    other = load_pipeline(path, overrides=["tile.magnification=20"])
    assert stage_settings(other, "tile") != stage_settings(as_float, "tile")
