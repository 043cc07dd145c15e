"""ASAP XML has no holes: a hole that holds tumour must not carve that tumour away when written as XML."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import shapely

from wsi_milssl.annotations import (
    PolygonAnnotation,
    convert_annotations,
    read_annotations,
    read_asap_xml,
    write_annotations,
)
from wsi_milssl.annotations.geometry import without_holes


def _square(x0, y0, x1, y1):
    return [[x0, y0], [x1, y0], [x1, y1], [x0, y1], [x0, y0]]


def _feature(geometry, name, group):
    return {"type": "Feature", "geometry": geometry,
            "properties": {"objectType": "annotation", "name": name, "classification": {"name": group}}}


def _same_region(a, b):
    assert a.area > 0
    assert a.area == pytest.approx(b.area, rel=1e-12)
    assert shapely.symmetric_difference(a, b).area <= 1e-9 * a.area


def test_a_tumour_island_in_a_multipolygon_hole_survives_conversion_to_xml(tmp_path):
    donut = {"type": "MultiPolygon", "coordinates": [
        [_square(0, 0, 1000, 1000), _square(200, 200, 800, 800)],
        [_square(400, 400, 600, 600)],
    ]}
    src = tmp_path / "donut.geojson"
    src.write_text(json.dumps({"type": "FeatureCollection", "features": [_feature(donut, "T1", "Tumor")]}))
    xml = convert_annotations(src, tmp_path / "donut.xml")
    original = read_annotations(src).region
    assert original.area == 680_000
    _same_region(read_annotations(xml).region, original)
    polys, _ = read_asap_xml(xml)
    assert all(p.group in ("Tumor", "_2") for p in polys)
    # back to GeoJSON: the same region again
    _same_region(read_annotations(convert_annotations(xml, tmp_path / "back.geojson")).region, original)


def test_a_separate_tumour_polygon_in_a_hole_and_an_ordinary_hole(tmp_path):
    features = [
        _feature({"type": "Polygon", "coordinates": [_square(0, 0, 1000, 1000), _square(100, 100, 500, 500),
                                                     _square(600, 600, 900, 900)]}, "outer", "_0"),
        _feature({"type": "Polygon", "coordinates": [_square(200, 200, 300, 300)]}, "island", "_1"),
    ]
    src = tmp_path / "a.geojson"
    src.write_text(json.dumps({"type": "FeatureCollection", "features": features}))
    xml = convert_annotations(src, tmp_path / "a.xml")
    original = read_annotations(src).region
    assert original.area == 1_000_000 - 160_000 - 90_000 + 10_000
    _same_region(read_annotations(xml).region, original)
    holes = [p for p in read_asap_xml(xml)[0] if p.group == "_2"]
    # the ordinary hole is written as today: one polygon with the hole's own vertices
    assert any(np.array_equal(p.coords_lv0, np.array(_square(600, 600, 900, 900)[:-1], float)) for p in holes)
    assert all(shapely.Polygon(p.coords_lv0).is_valid for p in holes)


def test_tumour_inside_a_hole_of_an_exclusion_polygon_is_kept(tmp_path, caplog):
    features = [
        _feature({"type": "Polygon", "coordinates": [_square(0, 0, 1000, 1000)]}, "T", "Tumor"),
        _feature({"type": "Polygon", "coordinates": [_square(100, 100, 900, 900), _square(300, 300, 700, 700)]},
                 "E", "Exclusion"),
    ]
    src = tmp_path / "e.geojson"
    src.write_text(json.dumps({"type": "FeatureCollection", "features": features}))
    with caplog.at_level(logging.WARNING):
        xml = convert_annotations(src, tmp_path / "e.xml")
    original = read_annotations(src).region
    assert original.area == 1_000_000 - 640_000 + 160_000
    _same_region(read_annotations(xml).region, original)
    assert "dropped the holes" not in caplog.text


def test_irregular_nested_islands_round_trip_through_xml(tmp_path):
    # a lobed tumour with two holes; in one hole an island that has a hole with another island inside
    outer = shapely.Point(0, 0).buffer(5000, quad_segs=32).union(shapely.Point(4000, 0).buffer(3000))
    hole_a = shapely.Point(-1500, 500).buffer(2200, quad_segs=16)
    hole_b = shapely.Point(4500, 300).buffer(900, quad_segs=8)
    island = shapely.Point(-1400, 600).buffer(1500, quad_segs=16)
    island_hole = shapely.Point(-1300, 650).buffer(800, quad_segs=16)
    speck = shapely.Point(-1300, 650).buffer(200, quad_segs=4)
    shell = shapely.Polygon(outer.exterior, [hole_a.exterior, hole_b.exterior])
    mid = shapely.Polygon(island.exterior, [island_hole.exterior])

    def ann(name, poly):
        return PolygonAnnotation(name, "Tumor", np.asarray(poly.exterior.coords)[:-1],
                                 holes_lv0=tuple(np.asarray(r.coords)[:-1] for r in poly.interiors))

    anns = [ann("outer", shell), ann("mid", mid), ann("speck", speck)]
    expected = shapely.union_all([shell, mid, speck])
    for fmt in ("geojson", "asap"):
        path = write_annotations(anns, tmp_path / f"n.{'xml' if fmt == 'asap' else 'geojson'}")
        _same_region(read_annotations(path).region, expected)


def test_without_holes_gives_hole_free_pieces_covering_the_geometry():
    geometry = shapely.box(0, 0, 100, 100).difference(
        shapely.union_all([shapely.box(10, 10, 30, 30), shapely.box(50, 50, 70, 90), shapely.box(12, 60, 28, 80)]))
    pieces = without_holes(geometry)
    assert len(pieces) > 1 and all(len(p.interiors) == 0 and p.is_valid for p in pieces)
    assert sum(p.area for p in pieces) == pytest.approx(geometry.area)
    assert shapely.symmetric_difference(shapely.union_all(pieces), geometry).area < 1e-9
    square = shapely.box(0, 0, 1, 1)
    assert list(without_holes(square)) == [square]


def test_without_holes_takes_pieces_in_proportion_to_the_holes():
    """One cut line per hole at once cut every hole's strip again: 400 jittered holes gave 3,723 pieces
    (a ring with thousands of islands neared the XML reader's size cap); a median cut per round gives
    fewer pieces than holes here, with the same area and no hole left."""
    import numpy as np
    import shapely

    from wsi_milssl.annotations.geometry import without_holes

    rng = np.random.default_rng(0)
    holes = []
    for i in range(20):
        for j in range(20):
            x, y = 10 + 10 * i + rng.uniform(0, 4), 10 + 10 * j + rng.uniform(0, 4)
            holes.append(shapely.box(x, y, x + 2, y + 2))
    poly = shapely.Polygon(shapely.box(0, 0, 220, 220).exterior.coords, [h.exterior.coords for h in holes])
    pieces = without_holes(poly)
    assert len(pieces) <= 2 * len(holes)
    assert max(shapely.get_num_interior_rings(pieces)) == 0
    assert abs(shapely.union_all(pieces).area - poly.area) < 1e-6 * poly.area
