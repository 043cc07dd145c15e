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


def test_the_lesions_of_a_noisy_map_are_the_even_odd_region_of_its_contours():
    """Thousands of contours (an early model's noisy map) are combined in pairs (:func:`_even_odd`), not one after
    the other: the region must be the one the rule gives, taken ring by ring (islands in holes in lesions)."""
    from skimage.measure import find_contours

    from wsi_milssl.inference.exports import _even_odd

    rng = np.random.default_rng(0)
    grid = rng.random((60, 60)) * 0.3
    grid[rng.random((60, 60)) < 0.25] = 0.9
    grid[5:25, 5:25] = 0.95
    grid[10:15, 10:15] = 0.1
    grid[12, 12] = 0.99
    polys = lesion_polygons(grid, origin_lv0=(0, 0), stride_lv0=1, patch_size_lv0=1, threshold=0.5)
    assert len(polys) > 100 and any(p.interiors for p in polys)
    rings = [shapely.make_valid(shapely.Polygon(c[:, ::-1])) for c in find_contours(np.pad(grid, 1, constant_values=0.0),
                                                                                     0.5, fully_connected="high")
             if len(c) >= 4]
    rings = [r for r in rings if r.area > 0]
    one_by_one = shapely.GeometryCollection()
    for ring in sorted(rings, key=lambda g: -g.area):
        one_by_one = shapely.symmetric_difference(one_by_one, ring)
    assert _even_odd(rings).equals(one_by_one)
    assert shapely.union_all(polys).equals(shapely.affinity.translate(one_by_one, -0.5, -0.5))
    assert _even_odd([]).is_empty
