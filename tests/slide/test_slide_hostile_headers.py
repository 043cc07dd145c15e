"""Review ES, A4 and A5: a slide whose x and y µm/px disagree was scaled by their mean without a word (0.25 and 10
gave 5.125 µm/px), and a huge slide without a small pyramid level made `tile` ask OpenSlide for the whole level as
a thumbnail (terabytes; an empty `MemoryError:`)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import tifffile

from wsi_milssl.errors import MissingResolutionError, SlideReadError
from wsi_milssl.slide import open_slide
from wsi_milssl.slide import reader as reader_module


def _tiled_tiff(path, *, mpp_x: float, mpp_y: float):
    image = np.full((512, 512, 3), (200, 120, 180), np.uint8)
    tifffile.imwrite(path, image, tile=(256, 256), compression="jpeg", photometric="rgb",
                     resolution=(1e4 / mpp_x, 1e4 / mpp_y), resolutionunit="CENTIMETER")
    return path


def test_x_and_y_resolutions_that_disagree_are_not_used(tmp_path, caplog):
    path = _tiled_tiff(tmp_path / "aniso.tif", mpp_x=0.25, mpp_y=10.0)
    with caplog.at_level(logging.WARNING), open_slide(path) as slide:
        assert slide.metadata_mpp is None
        with pytest.raises(MissingResolutionError) as err:  # review EU, C1: the error said "not a microscope's
            slide.mpp  # resolution" of their mean, the true reason in a warning that -q hides
    assert "its x and y µm/px differ (0.25 and 10)" in caplog.text and "--slide-mpp" in caplog.text
    assert str(err.value).startswith(f"{path}: the slide has no MPP (its metadata's x and y µm/px differ (0.25 and "
                                     "10), where a microscope's pixels are square) and no objective power")
    caplog.clear()
    with caplog.at_level(logging.WARNING), open_slide(_tiled_tiff(tmp_path / "square.tif", mpp_x=0.25,
                                                                  mpp_y=0.2501)) as slide:
        assert slide.metadata_mpp == pytest.approx(0.25005)
    assert "differ" not in caplog.text


def test_a_thumbnail_of_a_level_too_large_to_read_whole_is_one_error(tmp_path, monkeypatch):
    path = _tiled_tiff(tmp_path / "flat.tif", mpp_x=0.25, mpp_y=0.25)  # one level: 512 x 512 px
    monkeypatch.setattr(reader_module, "MAX_THUMBNAIL_SOURCE_PX", 512 * 512 - 1)
    with open_slide(path) as slide, pytest.raises(SlideReadError) as err:
        slide.thumbnail(max_size_px=64)
    assert str(err.value).startswith(f"{path}: no pyramid level small enough to draw a thumbnail from: the smallest "
                                     "is level 0, 512 x 512 px")
    assert "--pyramid" in str(err.value)


def test_a_thumbnail_comes_from_a_coarser_level_when_the_nearest_is_too_large(synth_slides, monkeypatch):
    """Review ET: the first guard refused a pyramidal slide whose level nearest the thumbnail's size was over the
    bound (an SVS's 4x steps), where a coarser level serves."""
    with open_slide(synth_slides["tumor"]) as slide:
        dims = slide._slide.level_dimensions
        assert len(dims) >= 3
        expected, ds = slide.thumbnail(max_size_px=1024)
        best = slide._slide.get_best_level_for_downsample(max(dims[0]) / 1024)
        monkeypatch.setattr(reader_module, "MAX_THUMBNAIL_SOURCE_PX", dims[best][0] * dims[best][1] - 1)
        coarser, ds2 = slide.thumbnail(max_size_px=1024)
    assert coarser.shape == expected.shape and ds2 == ds
    assert np.abs(coarser.astype(int) - expected.astype(int)).mean() < 12  # the same picture, less sharp


def test_an_objective_power_that_gives_no_microscopes_resolution_is_not_used(tmp_path):
    """Review ES, B9: an objective power of 4e8 (no MPP) gave 0.0000 µm/px, and `tile` asked for petabytes."""
    from wsi_milssl.errors import MissingResolutionError

    path = tmp_path / "plain.tif"
    tifffile.imwrite(path, np.full((512, 512, 3), 200, np.uint8), tile=(256, 256), photometric="rgb")
    with open_slide(path) as slide:
        slide.metadata_mpp, slide.objective_power = None, 4e8  # as an Aperio header's "AppMag = 400000000" reads
        assert slide.mpp_source == "objective-power"
        with pytest.raises(MissingResolutionError, match=r"its objective power 4e\+08x gives .* µm/px, which is "
                                                         r"not a microscope's resolution.* Fix: pass the level-0 "
                                                         r"resolution with --slide-mpp"):
            slide.mpp


def test_a_tiling_plan_nested_past_pythons_limit_is_one_error():
    """Review ES, B6: a store's tiling_plan of 100,000 nested lists ended `features` and `train` in a
    RecursionError traceback."""
    from wsi_milssl.errors import ConfigError
    from wsi_milssl.tiling.plan import TilingPlan

    with pytest.raises(ConfigError, match=r"^store x: the tiling plan is not valid JSON \(RecursionError"):
        TilingPlan.from_json("[" * 100_000 + "]" * 100_000, source="store x")


def test_a_generated_set_of_too_many_slides_is_refused():
    from wsi_milssl.config import SynthConfig
    from wsi_milssl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"n_slides must satisfy 1 <= value <= 100000; got 100000000000"):
        SynthConfig(n_slides=10 ** 11)
