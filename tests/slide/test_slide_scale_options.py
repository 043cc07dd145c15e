"""Scales that are no resolution (NaN, infinite, 0, negative, absurd) are one ConfigError, in `info`
and in the slide reader, not nan output or a ValueError/ZeroDivisionError traceback (review finding)."""

from __future__ import annotations

import numpy as np
import pytest

from wsi_milssl.cli import main
from wsi_milssl.errors import ConfigError
from wsi_milssl.slide import SlideReader, magnification_to_mpp, mpp_to_magnification, plan_read
from wsi_milssl.synth.pyramid import write_pyramidal_tiff


@pytest.fixture(scope="module")
def slide(tmp_path_factory):
    grey = lambda x0, y0, x1, y1: np.full((y1 - y0, x1 - x0, 3), 200, np.uint8)  # noqa: E731
    return write_pyramidal_tiff(tmp_path_factory.mktemp("s") / "s.tif", grey, width=512, height=512, mpp=0.5)


@pytest.mark.parametrize("option, values, low_high", [
    ("--slide-mpp", ["nan", "1e300", "0", "-1", "inf", "0.001"], "0.01 and 100"),
    ("--mpp-at-40x", ["nan", "0", "-0.25", "inf"], "0.01 and 100"),
    ("--magnifications", ["nan", "0", "-10", "inf", "1e9"], "0.1 and 200"),
])
def test_info_refuses_a_scale_that_is_no_resolution(slide, capsys, option, values, low_high):
    for value in values:
        code = main(["info", str(slide), option, value])
        out, err = capsys.readouterr()
        assert code == 2 and out == "", (value, out)  # a usage error
        assert err == f"error: {option} must be between {low_high}; got {float(value)!r}.\n", err


def test_info_still_describes_with_sound_options(slide, capsys):
    assert main(["info", str(slide), "--slide-mpp", "0.25", "--mpp-at-40x", "0.25", "--magnifications", "10"]) == 0
    assert "mpp:              0.2500 µm/px" in capsys.readouterr().out


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1.0])
def test_reader_refuses_an_override_that_is_no_resolution(slide, value):
    with pytest.raises(ConfigError, match=r"s\.tif: the level-0 µm per pixel given \(--slide-mpp\) must be a finite "
                                          r"number above 0; got "):
        SlideReader(slide, mpp_override=value)
    with pytest.raises(ConfigError, match=r"s\.tif: mpp_at_40x must be a finite number above 0"):
        SlideReader(slide, mpp_at_40x=value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -2.0])
def test_scale_conversions_refuse_values_that_are_no_scale(value):
    for call in (lambda: magnification_to_mpp(value), lambda: magnification_to_mpp(10, mpp_at_40x=value),
                 lambda: mpp_to_magnification(value), lambda: plan_read(value, [1.0], target_mpp=1.0),
                 lambda: plan_read(0.5, [1.0], target_mpp=value)):
        with pytest.raises(ConfigError, match="must be a finite number above 0; got"):
            call()
