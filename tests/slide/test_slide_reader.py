"""Reading slides at a physical resolution through OpenSlide."""

from __future__ import annotations

import numpy as np
import pytest
import tifffile
from PIL import Image

from wsi_milssl.errors import MissingResolutionError, SlideReadError
from wsi_milssl.slide import SlideReader, magnification_to_mpp, open_slide, plan_read


class RecordingReader(SlideReader):
    """A real SlideReader that remembers which pyramid levels it read from."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.levels_read: list[int] = []

    def read_level(self, x_lv0, y_lv0, level, size):
        self.levels_read.append(level)
        return super().read_level(x_lv0, y_lv0, level, size)


def _tissue_origin(slide: SlideReader, size_lv0: int) -> tuple[int, int]:
    """Top-left of a level-0 square of ``size_lv0`` px with the most tissue (darkest thumbnail)."""
    thumb, ds = slide.thumbnail(max_size_px=256)
    grey = thumb.mean(axis=2)
    k = max(1, int(size_lv0 / ds))
    best, pos = 1e9, (0, 0)
    for y in range(0, grey.shape[0] - k, max(1, k // 2)):
        for x in range(0, grey.shape[1] - k, max(1, k // 2)):
            v = grey[y : y + k, x : x + k].mean()
            if v < best:
                best, pos = v, (x, y)
    return int(pos[0] * ds), int(pos[1] * ds)


def test_magnification_scale_is_documented_one():
    assert magnification_to_mpp(40) == pytest.approx(0.25)
    assert magnification_to_mpp(20) == pytest.approx(0.5)
    assert magnification_to_mpp(10) == pytest.approx(1.0)
    assert magnification_to_mpp(10, mpp_at_40x=0.243) == pytest.approx(0.972)


def test_plan_picks_largest_level_not_exceeding_needed_downsample():
    downsamples = (1.0, 2.0004, 4.0008, 8.0016)
    assert plan_read(0.25, downsamples, target_mpp=1.0).level == 2  # 4.0008 counts as 4
    plan = plan_read(0.25, downsamples, target_mpp=0.75)  # needs 3x: level 1, residual 1.5
    assert plan.level == 1
    assert plan.residual_scale == pytest.approx(3 / 2.0004)
    assert plan_read(0.25, downsamples, target_mpp=0.2, allow_upsample=True).level == 0  # finer than level 0


def test_10x_read_matches_downsampled_level0_and_uses_level_below(synth_slides):
    path = synth_slides["tumor"]
    with RecordingReader(path) as slide:
        assert slide.mpp == pytest.approx(0.25)
        x, y = _tissue_origin(slide, 1024)
        patch = slide.read_region(x, y, 256, target_mpp=magnification_to_mpp(10))
        assert patch.shape == (256, 256, 3) and patch.dtype == np.uint8
        assert slide.levels_read == [2]  # the 4x level, not level 0
        level0 = slide.read_level(x, y, 0, (1024, 1024))
    reference = np.asarray(Image.fromarray(level0).reduce(4)).astype(float)
    assert reference.std() > 10  # tissue, not blank background
    assert np.abs(patch.astype(float) - reference).mean() < 3.0


def test_non_integer_residual_is_resampled_with_antialiasing(synth_slides):
    with RecordingReader(synth_slides["tumor"]) as slide:
        x, y = _tissue_origin(slide, 768)
        patch = slide.read_region(x, y, 256, target_mpp=0.75)  # 3x: level 1 (2x) then 1.5x
        assert slide.levels_read == [1]
        level0 = slide.read_level(x, y, 0, (768, 768))
    reference = np.asarray(Image.fromarray(level0).resize((256, 256), Image.Resampling.BOX)).astype(float)
    # two resampling chains (level-1 JPEG then 1.5x, versus level-0 JPEG then 3x) differ a little more
    assert np.abs(patch.astype(float) - reference).mean() < 4.0


def test_unopenable_file_names_file_and_fix(tmp_path):
    bad = tmp_path / "not_a_slide.tif"
    bad.write_text("this is not a TIFF")
    with pytest.raises(SlideReadError, match=r"not_a_slide\.tif.*Fix"):
        open_slide(bad)
    with pytest.raises(SlideReadError, match=r"missing\.svs: slide file not found"):
        open_slide(tmp_path / "missing.svs")


def _write_plain_tiff(path, *, description=None, resolution=True):
    img = np.full((1024, 1024, 3), 210, np.uint8)
    kw = dict(tile=(256, 256), compression="jpeg", photometric="rgb", metadata=None)
    with tifffile.TiffWriter(path) as tif:
        extra = {"resolution": (40000.0, 40000.0), "resolutionunit": "CENTIMETER"} if resolution else {}
        tif.write(img, description=description, **kw, **extra)
        tif.write(img[::4, ::4].copy(), subfiletype=1, description=description and "reduced", **kw)
    return path


def test_slide_without_mpp_or_objective_power_names_file_and_override(tmp_path):
    path = _write_plain_tiff(tmp_path / "no_mpp.tif", resolution=False)
    slide = open_slide(path)
    with pytest.raises(MissingResolutionError, match=r"no_mpp\.tif.*no MPP and no objective power.*--slide-mpp"):
        slide.mpp
    assert open_slide(path, mpp_override=0.5).mpp == 0.5


def test_info_takes_the_level_0_override_as_slide_mpp_like_tile_and_heatmap(tmp_path, capsys):
    from wsi_milssl.cli import main

    path = _write_plain_tiff(tmp_path / "no_mpp.tif", resolution=False)
    assert main(["info", str(path)]) == 1
    assert "--slide-mpp" in capsys.readouterr().err
    for option in ("--slide-mpp", "--mpp"):  # --mpp: the older name, still accepted
        assert main(["info", str(path), option, "0.5"]) == 0
        out, err = capsys.readouterr()
        assert "0.5" in out
        # review EW, B2: in tile and features --mpp is the resolution read at; info's is said to be the slide's own
        assert ("--mpp 0.5 is taken as --slide-mpp" in err) == (option == "--mpp"), err


def test_objective_power_is_the_fallback_when_mpp_is_missing(tmp_path):
    desc = "Aperio Image Library v12.0.15 \r\n1024x1024 [0,0 1024x1024] (256x256) JPEG/RGB Q=90|AppMag = 20"
    path = _write_plain_tiff(tmp_path / "apmag.svs", description=desc, resolution=False)
    with open_slide(path) as slide:
        assert slide.vendor == "aperio"
        assert slide.mpp_source == "objective-power"
        assert slide.mpp == pytest.approx(0.5)
