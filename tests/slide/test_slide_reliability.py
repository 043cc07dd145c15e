"""Issue 14 rows 8, 9 and 12: resolution tags that are not a microscope's, reads finer than the scan,
and slides whose header opens but whose pixels do not decode."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import tifffile

from wsi_milssl.config import TileConfig
from wsi_milssl.errors import ConfigError, MissingResolutionError, ResolutionError, SlideReadError
from wsi_milssl.slide import open_slide, plan_read
from wsi_milssl.synth.pyramid import write_pyramidal_tiff
from wsi_milssl.tiling import tile_slides


def _noise(x0, y0, x1, y1):
    rng = np.random.default_rng(x0 * 7919 + y0)
    return rng.integers(60, 200, (y1 - y0, x1 - x0, 3), dtype=np.uint8)


def _tagged_tiff(path, *, resolution, unit, size=512):
    """A one-level tiled JPEG TIFF whose only resolution is the TIFF tag ``resolution`` per ``unit``."""
    tifffile.imwrite(path, _noise(0, 0, size, size), tile=(256, 256), compression="jpeg", photometric="rgb",
                     resolution=(resolution, resolution), resolutionunit=unit, metadata=None)
    return path


# -- row 8: a resolution tag that is not a microscope's ---------------------------------------------

def test_72_dpi_tag_is_ignored_with_a_warning_naming_slide_mpp(tmp_path, caplog):
    """Row 8: OpenSlide's boxes.tiff (72 dpi) was read as 352.78 µm/px 'from metadata'."""
    path = _tagged_tiff(tmp_path / "boxes.tiff", resolution=72, unit="INCH")
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.slide.reader"):
        slide = open_slide(path)
    assert slide.properties["openslide.mpp-x"].startswith("352.77")  # what OpenSlide reports
    assert "boxes.tiff: ignoring the resolution in its metadata (72 pixels per inch = 352.778 µm/px)" in caplog.text
    assert "Pass the level-0 resolution with --slide-mpp" in caplog.text
    assert slide.mpp_source == "none" and slide.ignored_metadata_mpp == pytest.approx(25400 / 72)
    with pytest.raises(MissingResolutionError, match=r"boxes\.tiff: the slide has no MPP \(its metadata says 72 "
                                                      r"pixels per inch = 352\.778 µm/px, which is not a "
                                                      r"microscope's resolution\).*Fix: .*--slide-mpp"):
        slide.mpp
    assert open_slide(path, mpp_override=0.5).mpp == 0.5


def test_72_dpi_slide_fails_in_tile_with_the_slide_mpp_fix(tmp_path):
    path = _tagged_tiff(tmp_path / "boxes.tiff", resolution=72, unit="INCH")
    run = tile_slides([path], tmp_path / "out", TileConfig(magnification=20, patch_size_px=64))
    assert run.results[0].status == "failed" and "--slide-mpp" in run.results[0].error


@pytest.mark.parametrize("resolution, unit, mpp", [
    (40_000, "CENTIMETER", 0.25),   # a scanner's tag
    (101_600, "INCH", 0.25),         # the same resolution in inches: OpenSlide reads it, so do we
    (2_000, "CENTIMETER", 5.0),      # a low-magnification scan is still plausible
])
def test_plausible_tags_are_used(tmp_path, resolution, unit, mpp):
    slide = open_slide(_tagged_tiff(tmp_path / "s.tif", resolution=resolution, unit=unit))
    assert slide.mpp_source == "metadata" and slide.mpp == pytest.approx(mpp)


@pytest.mark.parametrize("resolution, unit", [(300, "INCH"), (1_200, "INCH"), (10_000_000, "CENTIMETER")])
def test_implausible_tags_are_ignored(tmp_path, resolution, unit):
    slide = open_slide(_tagged_tiff(tmp_path / "s.tif", resolution=resolution, unit=unit))
    assert slide.mpp_source == "none" and slide.ignored_metadata_mpp is not None
    with pytest.raises(MissingResolutionError, match="--slide-mpp"):
        slide.mpp


# -- row 9: reading finer than the scan ----------------------------------------------------------------

@pytest.fixture(scope="module")
def half_micron_slide(tmp_path_factory):
    path = tmp_path_factory.mktemp("half") / "coarse.tif"
    return write_pyramidal_tiff(path, _noise, width=1024, height=1024, mpp=0.5)


def test_plan_refuses_upsampling_unless_allowed():
    with pytest.raises(ResolutionError, match=r"slide: reading at 0\.25 µm/px would upsample this slide, which is "
                                              r"scanned at 0\.5 µm/px \(2\.00x .*Fix: .*--allow-upsample"):
        plan_read(0.5, (1.0, 2.0), target_mpp=0.25)
    plan = plan_read(0.5, (1.0, 2.0), target_mpp=0.25, allow_upsample=True)
    assert plan.level == 0 and plan.residual_scale == pytest.approx(0.5)
    # within 1 %: the slide's own resolution, not an upsampling
    assert plan_read(0.2525, (1.0, 2.0), target_mpp=0.25).level == 0
    assert plan_read(0.243, (1.0, 4.0), target_mpp=0.25).residual_scale == pytest.approx(0.25 / 0.243)
    assert plan_read(0.25, (1.0, 4.0), target_mpp=0.25).residual_scale == 1.0


def test_reader_plan_names_the_slide_and_honours_allow_upsample(half_micron_slide):
    with open_slide(half_micron_slide) as slide:
        with pytest.raises(ResolutionError, match=r"coarse\.tif: reading at 0\.25 µm/px would upsample this slide, "
                                                  r"which is scanned at 0\.5 µm/px"):
            slide.plan(target_mpp=0.25)
        assert slide.plan(target_mpp=0.25, allow_upsample=True).residual_scale == pytest.approx(0.5)
        assert slide.plan(target_mpp=0.5).residual_scale == 1.0
    with open_slide(half_micron_slide, allow_upsample=True) as slide:
        patch = slide.read_region(256, 256, 64, target_mpp=0.25)
        assert patch.shape == (64, 64, 3)


def test_tile_at_40x_on_a_half_micron_slide_fails_alone(half_micron_slide, synth_slides, tmp_path):
    """Row 9: `tile --magnification 40` on a 0.5 µm/px slide used to upsample it 2x silently."""
    run = tile_slides([half_micron_slide, synth_slides["normal"]], tmp_path / "out",
                      TileConfig(magnification=40, patch_size_px=256, entropy_threshold_bits=4.0))
    by_stem = {r.slide: r for r in run.results}
    assert by_stem["coarse"].status == "failed"
    assert "coarse.tif: reading at 0.25 µm/px would upsample this slide, which is scanned at 0.5 µm/px" \
        in by_stem["coarse"].error and "--allow-upsample" in by_stem["coarse"].error
    assert by_stem[synth_slides["normal"].stem].status == "ok"  # 0.25 µm/px: served as it is
    assert not list((tmp_path / "out").glob("coarse.*"))


def test_allow_upsample_is_a_tile_setting_outside_the_settings_hash():
    assert TileConfig().allow_upsample is False
    assert TileConfig(allow_upsample=True).settings_hash() == TileConfig().settings_hash()
    from wsi_milssl.errors import ConfigError

    with pytest.raises(ConfigError, match="allow_upsample"):
        TileConfig(allow_upsample="yes")


def test_tile_with_allow_upsample_tiles_the_coarse_slide(half_micron_slide, tmp_path):
    run = tile_slides([half_micron_slide], tmp_path / "out",
                      TileConfig(magnification=40, patch_size_px=256, entropy_threshold_bits=0.0, tissue="none",
                                 allow_upsample=True))
    assert run.results[0].status == "ok" and run.results[0].n_patches > 0


# -- row 12: the header opens, the pixels do not ------------------------------------------------------

def corrupt_tiles(src, dst):
    """Copy ``src`` (a tiled JPEG TIFF) to ``dst`` with a bogus JPEG marker in every tile, as in
    OpenSlide's unreadable.svs: OpenSlide opens it, every tile read fails with 'Bogus marker length'."""
    shutil.copy(src, dst)
    with tifffile.TiffFile(dst) as tf:
        spans = [(o, n) for page in tf.pages for o, n in zip(page.dataoffsets, page.databytecounts) if n > 8]
    with open(dst, "r+b") as fh:
        for offset, _ in spans:
            fh.seek(offset + 2)  # after the JPEG SOI marker: a DQT segment of impossible length 1
            fh.write(b"\xff\xdb\x00\x01")
    return dst


def test_check_pixels_reports_corrupt_tiles(half_micron_slide, tmp_path):
    bad = corrupt_tiles(half_micron_slide, tmp_path / "unreadable.tif")
    with open_slide(bad) as slide:  # the header is fine
        assert slide.dimensions == (1024, 1024) and slide.mpp == pytest.approx(0.5)
        with pytest.raises(SlideReadError, match=r"unreadable\.tif: OpenSlide opens the slide but cannot decode its "
                                                 r"pixels at level 0 \(Bogus marker length\)\. Fix: the file is "
                                                 r"corrupt"):
            slide.check_pixels()
    with open_slide(half_micron_slide) as slide:
        slide.check_pixels()


def test_a_truncated_slide_is_named_incomplete_not_unsupported(synth_slides, tmp_path):
    """A slide whose copy or download stopped early (its TIFF directories point past its end) used to get
    OpenSlide's 'does not recognise this file ... give a pyramidal slide OpenSlide supports'; it is an
    incomplete file, and the fix is to copy it again. A file that is not a TIFF keeps the old message."""
    data = Path(synth_slides["normal"]).read_bytes()
    cut = tmp_path / "cut.tif"
    cut.write_bytes(data[: len(data) // 3])
    with pytest.raises(SlideReadError) as err:
        open_slide(cut)
    message = str(err.value)
    assert message.startswith(f"{cut}: this TIFF file is incomplete: its directories point to byte ")
    assert f"the file ends after {len(data) // 3:,} bytes" in message
    assert message.endswith("Fix: copy or download the slide again.")
    text = tmp_path / "text.tif"
    text.write_text("not a slide\n")
    with pytest.raises(SlideReadError, match="OpenSlide does not recognise this file"):
        open_slide(text)


@pytest.mark.parametrize("n_bytes, why", [(0, "this file is empty (0 bytes)"),
                                          (8, "this TIFF file ends inside its header, after 8 bytes"),
                                          (200, "this TIFF file ends inside its header, after 200 bytes")])
def test_an_empty_slide_or_one_cut_inside_its_header_is_named_incomplete(synth_slides, tmp_path, n_bytes, why):
    """Review AD: a 0-byte file (the most common stopped copy) and a TIFF cut inside its first directory were
    still 'not a whole-slide image ... give a pyramidal slide'."""
    cut = tmp_path / "cut.tif"
    cut.write_bytes(Path(synth_slides["normal"]).read_bytes()[:n_bytes])
    with pytest.raises(SlideReadError) as err:
        open_slide(cut)
    assert str(err.value) == (f"{cut}: {why} (a copy or download that stopped early). Fix: copy or download the "
                              "slide again.")


def test_files_and_folders_another_user_may_not_read_are_one_line_each(synth_slides, tmp_path, monkeypatch):
    """Review CB (shared lab storage): a slide without read permission was a PermissionError traceback (`info`,
    `evaluate`) or a line without a fix, and a folder that may be read but not listed (mode 711) a traceback. The
    tests run as root, whom permissions do not stop: the operating system's answers stand in for another user's."""
    import os

    from wsi_milssl.tiling import find_slides

    secret = tmp_path / "secret.tif"
    shutil.copy(synth_slides["normal"], secret)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == secret else real_access(p, mode, **kw))
    with pytest.raises(SlideReadError, match=rf"^{re.escape(str(secret))}: cannot read this slide file \(permission "
                                             r"denied\)\. Fix: ask its owner for read access, or leave it out of "
                                             r"the slides\.$"):
        open_slide(secret)
    folder = tmp_path / "archive"
    folder.mkdir()
    real_iterdir = Path.iterdir

    def iterdir(self):
        if self == folder:
            raise PermissionError(13, "Permission denied", str(self))
        return real_iterdir(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(folder))}: cannot list this folder \(permission denied\), "
                                        r"so its slides cannot be found\. Fix: give the slide files themselves"):
        find_slides([folder])
