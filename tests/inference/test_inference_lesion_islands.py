"""The heatmap's <stem>_lesions.xml: a lesion inside the hole of another must survive ASAP XML (no holes)."""

from __future__ import annotations

import numpy as np
import pytest
import shapely

from wsi_milssl.annotations import read_annotations
from wsi_milssl.inference.exports import lesion_polygons, write_lesions


def test_lesions_inside_a_lesion_hole_survive_in_the_xml(tmp_path):
    grid = np.zeros((9, 9), np.float32)
    grid[1:8, 1:8] = 0.9   # a ring of positive cells ...
    grid[2:7, 2:7] = 0.0   # ... around a negative ring ...
    grid[4, 4] = 0.8       # ... around a positive cell: a lesion in the hole of another
    polys = lesion_polygons(grid, origin_lv0=(0, 0), stride_lv0=64, patch_size_lv0=64, threshold=0.5)
    assert len(polys) == 2 and len(polys[0].interiors) == 1 and polys[0].interiors[0].convex_hull.contains(polys[1])
    written = write_lesions(tmp_path / "s_lesions.geojson", tmp_path / "s_lesions.xml", polys, grid=grid,
                            origin_lv0=(0, 0), stride_lv0=64, patch_size_lv0=64, mpp=0.5)
    expected = shapely.union_all(polys)
    for path in written.values():
        region = read_annotations(path).region
        assert region.area == pytest.approx(expected.area, rel=1e-12)
        assert shapely.symmetric_difference(region, expected).area <= 1e-9 * expected.area, path
