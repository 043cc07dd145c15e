"""Rules of today's feature-settings checks found too strict by review: runs saved before the feature
files' settings were recorded still resume, features that differ only in precision may be mixed, and a
slide moved or copied is the same slide, not a name collision."""

from __future__ import annotations

from pathlib import Path

import pytest

from wsi_milssl.errors import CheckpointError
from wsi_milssl.features.schema import settings_differences
from wsi_milssl.features.stage import _other_slide
from wsi_milssl.mil.run_folder import _check_resume_config

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


def test_a_moved_or_copied_slide_is_the_same_slide_and_another_one_is_not(tmp_path):
    slide = tmp_path / "a" / "s.tif"
    slide.parent.mkdir()
    slide.write_bytes(b"x" * 100)
    moved = tmp_path / "b" / "s.tif"
    moved.parent.mkdir()
    moved.write_bytes(b"x" * 100)
    other = tmp_path / "c" / "s.tif"
    other.parent.mkdir()
    other.write_bytes(b"y" * 70)
    here = lambda p: (str(p), None)  # noqa: E731  (size from the file)
    assert not _other_slide(here(slide), here(slide))
    assert not _other_slide(here(slide), here(moved))  # a copy of the same size
    assert _other_slide(here(slide), here(other))  # another slide of the same name, still there
    gone = tmp_path / "gone" / "s.tif"
    # the recorded slide is gone (moved, archived): its recorded size decides
    assert not _other_slide((str(gone), 100), here(moved))
    assert _other_slide((str(gone), 100), here(other))  # was replaced silently (review)
    assert _other_slide((str(gone), None), here(moved))  # a file of an earlier version: unknown, refused


def test_features_of_another_slide_of_the_same_name_are_not_replaced_when_its_file_is_gone(
        tmp_path, synth_slides, synth_dir):
    import shutil

    from feature_fixtures import TILE
    from wsi_milssl.config import FeaturesConfig
    from wsi_milssl.features import extract_features

    fast = FeaturesConfig(encoder="resnet18", weights="random", num_workers=0, batch_size=64, amp="off")
    train, test = tmp_path / "train", tmp_path / "test"
    train.mkdir()
    test.mkdir()
    shutil.copy(synth_slides["tumor"], train / "s.tif")
    shutil.copy(synth_slides["normal"], test / "s.tif")
    assert (train / "s.tif").stat().st_size != (test / "s.tif").stat().st_size
    feats = tmp_path / "feats"
    assert extract_features([train / "s.tif"], feats, fast, tile=TILE).ok
    made = (feats / "s.h5").read_bytes()
    shutil.move(train, tmp_path / "archived")  # the training slides archived
    run = extract_features([test / "s.tif"], feats, fast, tile=TILE)
    assert not run.ok and "made from another slide file" in run.results[0].error
    assert (feats / "s.h5").read_bytes() == made
    # the training slide itself, moved: the same slide (its size), made again from the new path
    moved = extract_features([tmp_path / "archived" / "s.tif"], feats, fast, tile=TILE)
    assert moved.ok and moved.results[0].status == "ok"


def test_an_earlier_versions_feature_file_whose_slide_is_gone_says_what_is_unknown(tmp_path):
    import h5py

    from wsi_milssl.errors import StoreError
    from wsi_milssl.features.stage import _check_existing

    path = tmp_path / "s.h5"
    with h5py.File(path, "w") as fh:
        fh.attrs.update(schema="wsi-milssl-features", slide_path=str(tmp_path / "gone" / "s.tif"))
    given = tmp_path / "new" / "s.tif"
    given.parent.mkdir()
    given.write_bytes(b"x" * 10)
    with pytest.raises(StoreError, match=r"made by an earlier version, which did not record the size of their slide "
                                         r"file, and that file .* is gone"):
        _check_existing(path, {}, "h", "src", slide=(str(given), 10))

