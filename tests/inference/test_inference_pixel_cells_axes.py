"""Review EA (mutation test): every test of ``pixel_cells`` gave the same downsample along x and y, so taking the
rows' downsample for the columns went unnoticed (a thumbnail is rounded per axis, so its two downsamples differ)."""

from __future__ import annotations

import numpy as np

from wsi_milssl.inference.heatmap import pixel_cells


def test_columns_take_the_x_downsample_and_rows_the_y_downsample():
    # one patch of 100 level-0 px every 100 px: 4 columns x 2 rows; a 8-px-wide, 8-px-high image at 50 px per
    # pixel along x and 25 px per pixel along y covers 400 x 200 level-0 px
    r, rin, c, cin = pixel_cells((8, 8), (50.0, 25.0), origin_lv0=(0, 0), stride_lv0=100, patch_size_lv0=100,
                                 grid_shape=(2, 4))
    assert c.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]  # centres at 25, 75, ..., 375 level-0 px
    assert r.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]  # centres at 12.5, 37.5, ..., 187.5 level-0 px
    assert cin.all() and rin.all()
    # the origin shifts x and y each by its own offset
    r, _, c, _ = pixel_cells((8, 8), (50.0, 25.0), origin_lv0=(100, 0), stride_lv0=100, patch_size_lv0=100,
                             grid_shape=(2, 3))
    assert c.tolist() == [0, 0, 0, 0, 1, 1, 2, 2] and r.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert np.issubdtype(c.dtype, np.integer)
