"""A pipeline with a [features] table whose encoder weights are not there (review AO, finding 1): "cached"
weights that are not in the library's cache, or a weights file that does not exist. They were found only when
the features stage started, after tile and label (hours on CAMELYON16), with a fix naming the option of
`wsi-milssl features` (--weights PATH). Now the run is refused before its first stage, and the fix names the
pipeline's setting ([features] weights, --set features.weights=PATH). A run whose features stage is up to
date does not need the encoder, and is not refused."""

from __future__ import annotations

import pytest
import torch

from tinypipeline import GENERATED_SLIDES
from wsi_milssl.errors import ConfigError
from wsi_milssl.mil.resnet import ResNet18
from wsi_milssl.pipeline import load_pipeline, run_pipeline

PIPELINE = """
[pipeline]
name = "weights"
""" + GENERATED_SLIDES + """[features]
encoder = "resnet18"
weights = "cached"
num_workers = 0
[train]
epochs = 1
mu_ramp_epochs = 1
"""


@pytest.fixture()
def empty_cache(tmp_path, monkeypatch):
    """An empty torchvision cache ($TORCH_HOME/hub/checkpoints)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    return tmp_path / "torch" / "hub" / "checkpoints"


def _toml(tmp_path, text=PIPELINE):
    toml = tmp_path / "weights.toml"
    toml.write_text(text)
    return toml


def test_cached_weights_that_are_not_there_are_refused_before_synth(tmp_path, empty_cache):
    spec = load_pipeline(_toml(tmp_path), out_dir=tmp_path / "out")
    ran = []
    with pytest.raises(ConfigError) as info:
        run_pipeline(spec, on_stage=ran.append)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'weights.toml'} [features]: encoder 'resnet18': no downloaded weights "
                              f"found in the library's cache ({empty_cache}/resnet18-*.pth)")
    assert "Fix: set [features] weights to a local weights file (weights = \"PATH\", or --set features.weights=PATH" \
           in message
    assert "--weights" not in message
    assert ran == [] and not (tmp_path / "out" / "slides").exists()  # synth never ran


def test_a_weights_file_that_does_not_exist_is_refused_naming_the_set_that_gave_it(tmp_path, empty_cache,
                                                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = load_pipeline(_toml(tmp_path), out_dir=tmp_path / "out", overrides=["features.weights=nope.pth"])
    with pytest.raises(ConfigError) as info:
        run_pipeline(spec)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'weights.toml'} [features] with --set features.weights=nope.pth: "
                              "nope.pth: weights file not found (encoder 'resnet18').")
    assert f"Fix: set [features] weights to the path of a local state dict (--set features.weights=PATH; a " \
           f"relative path is resolved against the current folder, {tmp_path})" in message
    assert "--weights" not in message
    assert not (tmp_path / "out" / "slides").exists()


def test_the_features_command_still_names_its_option(tmp_path, empty_cache):
    from wsi_milssl.features import create_encoder

    with pytest.raises(ConfigError, match=r"Fix: pass --weights PATH to a local weights file"):
        create_encoder("resnet18", weights="cached")
    with pytest.raises(ConfigError, match=r"weights file not found \(encoder 'resnet18'\)\. Fix: pass the path of a "
                                          r"local state dict with --weights, or --weights cached / random\."):
        create_encoder("resnet18", weights=str(tmp_path / "nope.pth"))


def test_a_run_whose_features_are_up_to_date_does_not_need_the_weights(tmp_path, empty_cache):
    """Cached weights are not fingerprinted: once features ran, the cache may be emptied, and a run that does not
    run the features stage again is not refused; one that does (--force features) is, before it starts."""
    empty_cache.mkdir(parents=True)
    torch.save(ResNet18(num_classes=1).state_dict(), empty_cache / "resnet18-f37072fd.pth")
    spec = load_pipeline(_toml(tmp_path), out_dir=tmp_path / "out")
    assert [o.status for o in run_pipeline(spec, until="features")] == ["ran"] * 4
    (empty_cache / "resnet18-f37072fd.pth").unlink()
    assert [o.status for o in run_pipeline(spec, until="features")] == ["skipped"] * 4
    stamp = (tmp_path / "out" / ".pipeline" / "features.json").read_bytes()
    with pytest.raises(ConfigError, match=r"no downloaded weights found .*Fix: set \[features\] weights"):
        run_pipeline(spec, until="features", force=["features"])
    assert (tmp_path / "out" / ".pipeline" / "features.json").read_bytes() == stamp  # nothing was marked
