"""Rules of today's feature-settings checks found too strict by review: runs saved before the feature
files' settings were recorded still resume, features that differ only in precision may be mixed, and a
slide moved or copied is the same slide, not a name collision."""

from __future__ import annotations

from pathlib import Path

import pytest

from wsi_milssl.errors import CheckpointError
from wsi_milssl.features.schema import settings_differences
from wsi_milssl.features.stage import _other_slide
from wsi_milssl.mil.selftrain import _check_resume_config

OURS = {"settings_hash": "h1", "encoder": "resnet18", "encoder_weights_sha256": "a" * 64, "encoder_kwargs": "{}",
        "feature_dtype": "float32", "input_size_px": 224, "amp": "bfloat16", "target_mpp": 0.5, "patch_size_px": 256}


def test_a_run_saved_before_the_feature_settings_were_recorded_resumes():
    old = {"store_settings": {"feature_encoder": "resnet18", "feature_encoder_weights_sha256": None}}
    now = {"store_settings": {"feature_encoder": "resnet18", "feature_encoder_weights_sha256": None,
                              "feature_settings": dict(OURS)}}
    _check_resume_config(old, now, Path("last.pt"))  # was "cannot resume with different settings"
    other = {"store_settings": {**now["store_settings"], "feature_encoder": "resnet50_trunc"}}
    with pytest.raises(CheckpointError, match="cannot resume with different settings"):
        _check_resume_config(old, other, Path("last.pt"))


def test_features_that_differ_only_in_precision_may_be_mixed():
    half = {**OURS, "settings_hash": "h2", "feature_dtype": "float16", "amp": "off"}
    assert settings_differences(OURS, half) == []
    assert settings_differences(OURS, {**half, "input_size_px": 256}) == ["input_size_px 224 vs 256"]
    # files that do not record what the hash covers are still compared by it
    bare = {"settings_hash": "h3", "encoder": "resnet18"}
    assert settings_differences({"settings_hash": "h4", "encoder": "resnet18"}, bare) == ["settings_hash h4 vs h3"]


def test_a_moved_or_copied_slide_is_the_same_slide(tmp_path):
    slide = tmp_path / "a" / "s.tif"
    slide.parent.mkdir()
    slide.write_bytes(b"x" * 100)
    moved = tmp_path / "b" / "s.tif"
    moved.parent.mkdir()
    moved.write_bytes(b"x" * 100)
    assert not _other_slide(slide, slide)
    assert not _other_slide(slide, moved)  # a copy of the same size
    assert not _other_slide(tmp_path / "gone" / "s.tif", moved)  # the recorded file is gone: moved
    other = tmp_path / "c" / "s.tif"
    other.parent.mkdir()
    other.write_bytes(b"y" * 70)
    assert _other_slide(slide, other)  # another slide of the same name, still there
