"""A pipeline with a [features] table: synth -> tile -> label -> features -> train (a head on the
features) -> heatmap (its probabilities on the stores' grid) -> evaluate; a second run skips all."""

from __future__ import annotations

import json

import pytest

from tinypipeline import GENERATED_SLIDES
from wsi_milssl.errors import ConfigError
from wsi_milssl.features import read_feature_file
from wsi_milssl.pipeline import load_pipeline, run_pipeline

TINY = """
[pipeline]
name = "tiny-features"
""" + GENERATED_SLIDES + """[features]
encoder = "resnet18"
weights = "random"
num_workers = 0
[train]
epochs = 3
mu = 0.2
mu_ramp_epochs = 1
[heatmap]
thumbnail_px = 256
[evaluate]
thumbnail_px = 128
"""


def test_tiny_feature_pipeline_runs_every_stage_then_skips(tmp_path):
    toml = tmp_path / "tiny.toml"
    toml.write_text(TINY)
    spec = load_pipeline(toml, out_dir=tmp_path / "out")
    assert spec.feature_stage and spec.section("train")["mode"] == "features"
    outcomes = run_pipeline(spec)
    assert [(o.stage, o.status) for o in outcomes] == [
        (s, "ran") for s in ("synth", "tile", "label", "features", "train", "heatmap", "evaluate")]
    out = tmp_path / "out"
    ff = read_feature_file(out / "features" / "test" / "synth_000.h5")
    assert ff.features.shape[1] == 512 and ff.instance_label is not None
    saved = json.loads((out / "model" / "config.json").read_text())
    assert saved["model"] == "mlp" and saved["mode"] == "features"
    sidecar = json.loads((out / "heatmaps" / "test" / "synth_000_probs.json").read_text())
    assert sidecar["source"] == "features" and sidecar["stride_lv0"] == ff.attrs["stride_lv0"]
    metrics = json.loads((out / "evaluation" / "metrics.json").read_text())
    assert metrics["n_slides"] == 2 and metrics["froc"] is not None and metrics["instance_auc"] is not None
    assert [o.status for o in run_pipeline(spec)] == ["skipped"] * 7


def test_features_table_is_checked_with_the_rest(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(TINY.replace('encoder = "resnet18"', 'encoder = "resnet18"\ndtype = "int8"'))
    with pytest.raises(ConfigError, match=r"\[features\]: FeaturesConfig.dtype must be one of 'float32', 'float16'"):
        load_pipeline(bad)
    images = tmp_path / "images.toml"
    images.write_text(TINY.replace("[train]\n", '[train]\nmode = "images"\n'))
    with pytest.raises(ConfigError, match=r"with a \[features\] table the head trains on features"):
        load_pipeline(images)
    plain = tmp_path / "plain.toml"
    plain.write_text(TINY.replace('[features]\nencoder = "resnet18"\nweights = "random"\nnum_workers = 0\n', ""))
    spec = load_pipeline(plain, out_dir=tmp_path / "o")
    assert not spec.feature_stage
    with pytest.raises(ConfigError, match="stage 'features' is not part of this pipeline"):
        run_pipeline(spec, until="features")


def test_packaged_feature_pipeline_loads():
    from importlib.resources import files

    spec = load_pipeline(files("wsi_milssl") / "pipelines" / "camelyon16-features.toml")
    assert spec.feature_stage and spec.section("features")["encoder"] == "resnet50_trunc"
    assert spec.section("train")["model"] == "mlp" and set(spec.sets) == {"train", "test"}
