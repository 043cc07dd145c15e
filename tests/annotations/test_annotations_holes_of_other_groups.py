"""GeoJSON -> ASAP XML keeps the holes of polygons whose group is neither tumour nor non-tumour.

Such a group (a QuPath class ``Metastasis``, a derived class ``Tumor: Positive``, an unclassified
polygon) becomes tumour only when the file is read with ``--tumor-groups``; its holes used to be dropped
with a warning about "non-tumour polygons", so the XML read back as tumour covered the holes too.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import shapely

from wsi_milssl.annotations import UNCLASSIFIED, read_annotations, read_asap_xml
from wsi_milssl.annotations.geometry import tumor_fraction
from wsi_milssl.cli import main


def _square(x0, y0, x1, y1):
    return [[x0, y0], [x1, y0], [x1, y1], [x0, y1], [x0, y0]]


def _feature(rings, name, classification):
    props = {"objectType": "annotation", "name": name}
    if classification is not None:
        props["classification"] = classification
    return {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": rings}, "properties": props}


def _write(path, features):
    path.write_text(json.dumps({"type": "FeatureCollection", "features": features}))
    return path


DONUT = [_square(1000, 1000, 3000, 3000), _square(1500, 1500, 2500, 2500)]


@pytest.mark.parametrize("classification, group", [
    ({"name": "Metastasis"}, "Metastasis"),
    ({"names": ["Tumor", "Positive"]}, "Tumor: Positive"),
    (None, UNCLASSIFIED),
])
def test_holes_of_a_polygon_of_another_group_are_kept_in_xml(tmp_path, caplog, classification, group):
    src = _write(tmp_path / "m.geojson", [_feature(DONUT, "M", classification)])
    xml = tmp_path / "m.xml"
    with caplog.at_level(logging.WARNING):
        assert main(["annotations", "convert", str(src), str(xml)]) == 0
    assert "dropped the holes" not in caplog.text

    as_tumour = {group: "tumor", "_2": "non_tumor"}
    original = read_annotations(src, group_map=as_tumour).region
    back = read_annotations(xml, group_map=as_tumour).region
    assert original.area == 3_000_000
    assert back.area == pytest.approx(3_000_000, rel=1e-12)
    assert shapely.symmetric_difference(back, original).area <= 1e-6
    # the patches evaluate would count as tumour are the same (a 256 px grid over the slide)
    xs, ys = np.meshgrid(np.arange(0, 4096, 256), np.arange(0, 4096, 256))
    grid = np.stack([xs.ravel(), ys.ravel()], axis=1)
    np.testing.assert_allclose(tumor_fraction(back, grid, 256), tumor_fraction(original, grid, 256), atol=1e-6)

    polygons, _ = read_asap_xml(xml)
    assert {p.group for p in polygons} == {group}  # the group is kept, and no _2 polygon carves other tumour
    vertices = {tuple(v) for p in polygons for v in p.coords_lv0}
    assert {tuple(v) for ring in DONUT for v in ring} <= vertices  # every vertex kept
    # read with the default groups (the polygon's group unknown), there is still no tumour
    assert read_annotations(xml).region.is_empty


def test_a_tumour_island_in_the_hole_of_a_polygon_of_another_group(tmp_path):
    src = _write(tmp_path / "i.geojson", [
        _feature(DONUT, "M", {"name": "Metastasis"}),
        _feature([_square(1800, 1800, 2200, 2200)], "island", {"name": "Tumor"}),
    ])
    xml = tmp_path / "i.xml"
    assert main(["annotations", "convert", str(src), str(xml)]) == 0
    for group_map in (None, {"Metastasis": "tumor", "Tumor": "tumor", "_2": "non_tumor"},
                      {"Tumor": "tumor", "Metastasis": "non_tumor"}):
        original = read_annotations(src, group_map=group_map).region
        back = read_annotations(xml, group_map=group_map).region
        assert back.area == pytest.approx(original.area, rel=1e-12)
        assert shapely.symmetric_difference(back, original).area <= 1e-6


def test_non_tumour_holes_are_still_dropped_with_the_non_tumour_warning(tmp_path, caplog):
    src = _write(tmp_path / "e.geojson", [_feature(DONUT, "E", {"name": "Exclusion"})])
    xml = tmp_path / "e.xml"
    with caplog.at_level(logging.WARNING):
        assert main(["annotations", "convert", str(src), str(xml)]) == 0
    assert "cannot hold holes of non-tumour polygons; dropped the holes of 1 polygon(s): E" in caplog.text
