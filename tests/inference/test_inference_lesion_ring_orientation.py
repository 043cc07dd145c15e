"""<stem>_lesions.geojson follows RFC 7946 3.1.6 (review AN, finding 4): exterior rings counter-clockwise,
holes clockwise, by the signed (shoelace) area of the coordinate values; they were written the other way
round (shapely.normalize's orientation)."""

from __future__ import annotations

import json

import numpy as np


def _signed_area(ring) -> float:
    r = np.asarray(ring, dtype=np.float64)
    return 0.5 * float(np.sum(r[:-1, 0] * r[1:, 1] - r[1:, 0] * r[:-1, 1]))


def test_lesion_geojson_rings_are_ccw_outside_and_cw_for_holes(tmp_path):
    from wsi_milssl.annotations import read_annotations
    from wsi_milssl.inference.exports import lesion_polygons, write_lesions

    grid = np.full((12, 12), 0.1, np.float32)
    grid[1:7, 1:7] = 0.9     # a lesion with a hole
    grid[3:5, 3:5] = 0.2
    grid[9, 9] = 0.8          # a lone positive cell
    polys = lesion_polygons(grid, origin_lv0=(500, 700), stride_lv0=64, patch_size_lv0=64, threshold=0.5)
    written = write_lesions(tmp_path / "s_lesions.geojson", tmp_path / "s_lesions.xml", polys, grid=grid,
                            origin_lv0=(500, 700), stride_lv0=64, patch_size_lv0=64, mpp=0.5)
    features = json.loads(written["lesions_geojson"].read_text())["features"]
    assert len(features) == 2
    rings = [f["geometry"]["coordinates"] for f in features]
    assert len(rings[0]) == 2  # exterior and one hole
    for exterior, *holes in rings:
        assert _signed_area(exterior) > 0
        assert all(_signed_area(h) < 0 for h in holes)
    for path in written.values():  # the region read back is the same from either file
        region = read_annotations(path).region
        assert region.symmetric_difference(polys[0].union(polys[1])).area < 1e-6 * region.area
