"""Fixtures for the tile-stage tests: a slide with tissue in a known square, and store comparison."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from wsi_milssl.synth.pyramid import write_pyramidal_tiff

# 6144 x 6144 px at 0.25 µm/px: at 10x / 512 px the grid has 3 x 3 cells of 2048 level-0 px.
BOX_SLIDE_SIZE = 6144
# Textured "tissue" only inside this level-0 square, which lies inside the centre cell (2048, 2048).
BOX_LV0 = (2048 + 100, 2048 + 100, 4096 - 100, 4096 - 100)  # x0, y0, x1, y1


def _render_box(x0: int, y0: int, x1: int, y1: int) -> np.ndarray:
    """Glass (near white, slight noise) with H&E-coloured random texture inside BOX_LV0."""
    rng = np.random.default_rng((x0, y0))
    h, w = y1 - y0, x1 - x0
    out = np.full((h, w, 3), 244, np.uint8)
    out += rng.integers(0, 3, (h, w, 1), dtype=np.uint8)
    bx0, by0, bx1, by1 = BOX_LV0
    ix0, iy0 = max(x0, bx0), max(y0, by0)
    ix1, iy1 = min(x1, bx1), min(y1, by1)
    if ix0 < ix1 and iy0 < iy1:
        hh, ww = iy1 - iy0, ix1 - ix0
        # texture in 16-px cells so that it survives the 4x downsample of a 10x read
        coarse = rng.random((hh // 16 + 2, ww // 16 + 2, 1), dtype=np.float32)
        t = np.repeat(np.repeat(coarse, 16, axis=0), 16, axis=1)[:hh, :ww]
        pink = np.array([230, 140, 190], np.float32)
        purple = np.array([90, 50, 150], np.float32)
        tex = pink * (1 - t) + purple * t + rng.normal(0, 12, (hh, ww, 3)).astype(np.float32)
        out[iy0 - y0: iy1 - y0, ix0 - x0: ix1 - x0] = np.clip(tex, 0, 255).astype(np.uint8)
    return out


@pytest.fixture(scope="session")
def box_slide(tmp_path_factory) -> Path:
    """A 6144 x 6144 px pyramidal TIFF at 0.25 µm/px, glass except a textured square BOX_LV0."""
    path = tmp_path_factory.mktemp("box") / "box.tif"
    write_pyramidal_tiff(path, _render_box, width=BOX_SLIDE_SIZE, height=BOX_SLIDE_SIZE, mpp=0.25)
    return path


@pytest.fixture
def box_lv0() -> tuple[int, int, int, int]:
    return BOX_LV0


@pytest.fixture(scope="session")
def store_contents():
    """Function: store path -> dict of every array (JPEG patches as bytes) and the root attrs."""
    from wsi_milssl.store import open_store

    def read(path) -> dict:
        with open_store(path) as s:
            out = {name: s.read_array(name) for name in s.names()}
            if s.pixels == "jpeg":
                out["patches"] = s.read_jpeg(np.arange(len(s))) if len(s) else []
            out["attrs"] = s.attrs
            out["coords_attrs"] = s.array_attrs("coords")
        return out

    return read


def assert_same_contents(a: dict, b: dict, *, ignore_attrs: tuple[str, ...] = ()) -> None:
    assert set(a) == set(b)
    for key in a:
        if key in ("attrs", "coords_attrs"):
            da = {k: v for k, v in a[key].items() if k not in ignore_attrs}
            db = {k: v for k, v in b[key].items() if k not in ignore_attrs}
            assert da == db, key
        elif key == "patches" and isinstance(a[key], list):
            assert a[key] == b[key]
        else:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.fixture(scope="session")
def same_contents():
    """Function (a, b, ignore_attrs=()) asserting two store_contents dicts are equal."""
    return assert_same_contents
