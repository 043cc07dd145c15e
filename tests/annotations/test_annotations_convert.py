"""ASAP XML <-> GeoJSON conversion keeps every vertex and group; the CLI converts files."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from wsi_milssl.annotations import (
    PolygonAnnotation,
    convert_annotations,
    read_annotations,
    read_asap_xml,
    write_asap_xml,
)
from wsi_milssl.errors import AnnotationError


def _xml_content(path):
    """(annotations [(name, type, group, color, [(x, y) as text]...)], groups [(name, color)]) via stdlib."""
    root = ET.parse(path).getroot()
    anns = [
        (el.get("Name"), el.get("Type"), el.get("PartOfGroup"), el.get("Color"),
         [(c.get("X"), c.get("Y")) for c in el.iter("Coordinate")])
        for el in root.iter("Annotation")
    ]
    groups = [(g.get("Name"), g.get("Color")) for g in root.iter("Group")]
    return anns, groups


def _cli(argv):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(required=True)
    importlib.import_module("wsi_milssl.cli.annotations").register(sub)
    args = parser.parse_args(argv)
    return args.run(args)


def test_synth_xml_round_trip_is_lossless(synth_slides, tmp_path):
    src = synth_slides["tumor"].with_suffix(".xml")
    gj = convert_annotations(src, tmp_path / "a.geojson")
    back = convert_annotations(gj, tmp_path / "a.xml")
    assert _xml_content(back) == _xml_content(src)
    assert back.read_bytes() == src.read_bytes()
    doc = json.loads(gj.read_text())
    assert doc["type"] == "FeatureCollection"
    assert {f["properties"]["classification"]["name"] for f in doc["features"]} <= {"_0", "_1", "_2"}


def test_round_trip_keeps_odd_vertices_types_and_groups(tmp_path):
    rng = np.random.default_rng(3)
    anns = [
        PolygonAnnotation("irrational", "_0", rng.uniform(0, 1e5, (500, 2)) / 3.0),
        PolygonAnnotation("spline", "Tumor", np.array([[0.1, 0.2], [1e-7, 5.5], [3.3333333333333335, 1e15]]),
                          color="#123ABC", type="Spline"),
        PolygonAnnotation("closed", "_1", np.array([[0, 0], [10, 0], [10, 10], [0, 0]], float)),
        PolygonAnnotation("dot", "_2", np.array([[5.5, 6.5]]), type="Dot"),
        PolygonAnnotation("points", "None", np.array([[1, 2], [3, 4.25]]), type="PointSet"),
        PolygonAnnotation("ruler", "Exclusion", np.array([[1, 2], [3, 4.25]]), type="Measurement"),
        PolygonAnnotation("odd group", "My Group ü", np.array([[0, 0], [1, 0], [0, 1]], float)),
    ]
    src = write_asap_xml(anns, tmp_path / "src.xml", groups=["_0", "_1", "_2", "Tumor", "None", "Exclusion",
                                                            "My Group ü", "Empty group"])
    gj = tmp_path / "mid.geojson"
    assert _cli(["annotations", "convert", str(src), str(gj)]) == 0
    back = tmp_path / "back.xml"
    assert _cli(["annotations", "convert", str(gj), str(back)]) == 0
    assert _xml_content(back) == _xml_content(src)
    polys, groups = read_asap_xml(back)
    np.testing.assert_array_equal(polys[0].coords_lv0, anns[0].coords_lv0)  # bit-exact float64
    assert "Empty group" in groups


def test_geojson_holes_become_non_tumour_polygons_in_xml(tmp_path, caplog):
    ring = [[0, 0], [100, 0], [100, 100], [0, 100], [0, 0]]
    hole = [[20, 20], [40, 20], [40, 40], [20, 40], [20, 20]]
    doc = {"type": "FeatureCollection", "features": [
        {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": [ring, hole]},
         "properties": {"objectType": "annotation", "name": "T", "classification": {"name": "Tumor"}}},
        {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": [
            [[200, 0], [300, 0], [300, 100], [200, 100], [200, 0]], [[220, 20], [240, 20], [240, 40], [220, 20]]]},
         "properties": {"objectType": "annotation", "name": "E", "classification": {"name": "Exclusion"}}},
    ]}
    src = tmp_path / "holes.geojson"
    src.write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING):
        out = convert_annotations(src, tmp_path / "holes.xml")
    assert "dropped the holes of 1 polygon(s): E" in caplog.text
    anns, _ = _xml_content(out)
    assert ("T hole 0", "Polygon", "_2") == anns[2][:3]
    assert read_annotations(out).region.area == pytest.approx(read_annotations(src).region.area) == 10_000 - 400


def test_convert_refuses_same_file_and_unknown_suffix(synth_slides, tmp_path):
    src = synth_slides["tumor"].with_suffix(".xml")
    with pytest.raises(AnnotationError, match="input and output are the same file"):
        convert_annotations(src, src)
    with pytest.raises(AnnotationError, match=r"cannot tell the output format from suffix '\.txt'"):
        convert_annotations(src, tmp_path / "out.txt")
