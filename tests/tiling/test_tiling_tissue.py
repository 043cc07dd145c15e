"""Tissue detection: Otsu on HSV saturation after a median blur, small objects/holes, registry."""

from __future__ import annotations

import numpy as np
import pytest

from wsi_milssl.slide.tissue import (
    TISSUE_DETECTORS,
    TissueMask,
    detect_tissue,
    register_tissue_detector,
    saturation_uint8,
)


def _thumb(rng) -> tuple[np.ndarray, np.ndarray]:
    """256 x 256 glass with a stained disc (r 70 px) that has a hole (r 4 px) and a far speck (3 x 3 px)."""
    img = np.clip(rng.normal(242, 2, (256, 256, 3)), 0, 255).astype(np.uint8)
    yy, xx = np.mgrid[:256, :256]
    disc = (yy - 128) ** 2 + (xx - 110) ** 2 < 70**2
    hole = (yy - 128) ** 2 + (xx - 110) ** 2 < 4**2
    stain = np.clip(rng.normal([200, 120, 180], 15, (256, 256, 3)), 0, 255).astype(np.uint8)
    img[disc & ~hole] = stain[disc & ~hole]
    img[20:23, 230:233] = (120, 40, 140)
    return img, disc


def test_saturation_of_grey_and_colour():
    img = np.array([[[200, 200, 200], [255, 0, 0], [0, 0, 0], [200, 100, 200]]], np.uint8)
    np.testing.assert_array_equal(saturation_uint8(img), [[0, 255, 0, 127]])


def test_otsu_finds_the_disc_fills_holes_and_drops_specks():
    img, disc = _thumb(np.random.default_rng(0))
    mask = detect_tissue(img, method="otsu", mpp=8.0)  # 8 µm/px: the speck is 576 µm², the hole ~800 µm²
    iou = (mask & disc).sum() / (mask | disc).sum()
    assert iou > 0.95
    assert mask[128, 110]  # the small hole is filled
    assert not mask[15:28, 225:238].any()  # the speck is removed


def test_blank_slide_gives_no_tissue_and_none_gives_all():
    blank = np.clip(np.random.default_rng(1).normal(243, 2, (128, 128, 3)), 0, 255).astype(np.uint8)
    assert not detect_tissue(blank, method="otsu", mpp=8.0).any()
    assert detect_tissue(blank, method="none", mpp=8.0).all()


def test_registry_accepts_new_detectors_and_rejects_unknown():
    @register_tissue_detector("test-left-half")
    def left(rgb, *, mpp):
        m = np.zeros(rgb.shape[:2], bool)
        m[:, : rgb.shape[1] // 2] = True
        return m

    try:
        mask = detect_tissue(np.zeros((4, 6, 3), np.uint8), method="test-left-half", mpp=1.0)
        assert mask[:, :3].all() and not mask[:, 3:].any()
    finally:
        TISSUE_DETECTORS.pop("test-left-half")
    with pytest.raises(ValueError, match="unknown tissue detector 'nope'; registered detectors: none, otsu"):
        detect_tissue(np.zeros((4, 4, 3), np.uint8), method="nope", mpp=1.0)


def test_tissue_fraction_matches_brute_force():
    rng = np.random.default_rng(2)
    mask = rng.random((40, 50)) > 0.6
    tm = TissueMask(mask=mask, thumbnail=np.zeros((40, 50, 3), np.uint8), downsample_xy=(16.0, 16.0))
    coords = np.array([[0, 0], [64, 32], [16 * 46, 16 * 36], [8, 8]])
    frac = tm.fraction(coords, 64)
    assert frac.dtype == np.float32
    assert frac[0] == pytest.approx(mask[0:4, 0:4].mean())
    assert frac[1] == pytest.approx(mask[2:6, 4:8].mean())
    assert frac[2] == pytest.approx(mask[36:40, 46:50].mean())
    assert frac[3] == pytest.approx(mask[0:5, 0:5].mean())  # unaligned squares cover every touched pixel


def test_the_settings_know_the_built_in_tissue_detectors_as_the_registry_does():
    """TileConfig, HeatmapConfig and TilingPlan check `tissue` against BUILTIN_TISSUE_DETECTORS without importing
    the slide stack (review CH: a feature pipeline's `run` imported OpenSlide and scikit-image for it); the registry
    must hold the same names, and a detector registered by the caller counts once it is."""
    import subprocess
    import sys

    from wsi_milssl.config.tile import BUILTIN_TISSUE_DETECTORS, tissue_detectors
    from wsi_milssl.slide.tissue import TISSUE_DETECTORS

    assert sorted(BUILTIN_TISSUE_DETECTORS) == sorted(n for n in TISSUE_DETECTORS if n in ("none", "otsu")) == \
        sorted(n for n in TISSUE_DETECTORS if TISSUE_DETECTORS[n].__module__ == "wsi_milssl.slide.tissue")
    assert tissue_detectors() == sorted(TISSUE_DETECTORS)
    code = ("import sys\nfrom wsi_milssl.config import HeatmapConfig, TileConfig\nTileConfig(tissue='otsu')\n"
            "HeatmapConfig(tissue='none')\nprint('skimage' in sys.modules, 'openslide' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False False"


def test_an_unknown_detector_says_where_a_registered_one_is_known():
    """Review CP: a detector registered in the user's code is unknown to the command line, and the error did not
    say why."""
    import pytest

    from wsi_milssl.config import TileConfig
    from wsi_milssl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"got 'mine'\. A name registered with register_tissue_detector in your own "
                                          r"code is known only in a Python process that has imported that code"):
        TileConfig(tissue="mine")
