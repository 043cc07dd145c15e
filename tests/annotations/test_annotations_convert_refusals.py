"""Conversions that would write an unreadable or empty file are refused; polygons of fewer than 3
vertices become valid GeoJSON (review findings)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from wsi_milssl.annotations import PolygonAnnotation, convert_annotations, read_asap_xml, write_asap_xml
from wsi_milssl.cli import main
from wsi_milssl.errors import AnnotationError


def _feature(name="A", group="Tumor", object_type="annotation"):
    ring = [[0, 0], [10, 0], [10, 10], [0, 10], [0, 0]]
    return {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": [ring]},
            "properties": {"objectType": object_type, "name": name, "classification": {"name": group}}}


@pytest.mark.parametrize("name, group, char", [
    ("bad\u0000name", "Tumor", "U+0000"),
    ("bad\u0001name", "Tumor", "U+0001"),
    ("ok", "Tum\ud800or", "U+D800"),
    ("ok", "Tumor\ufffe", "U+FFFE"),
])
def test_names_xml_cannot_hold_are_refused_naming_the_annotation(tmp_path, name, group, char):
    src = tmp_path / "in.geojson"
    src.write_text(json.dumps({"type": "FeatureCollection", "features": [_feature(name, group)]}))
    out = tmp_path / "out.xml"
    with pytest.raises(AnnotationError) as info:
        convert_annotations(src, out)
    message = str(info.value)
    assert message.startswith(f"{out}: annotation {name!r} cannot be written as ASAP XML: its ")
    assert f"holds the character {char}, which XML 1.0 cannot hold. Fix: remove that character" in message
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["in.geojson"]


def test_a_group_name_xml_cannot_hold_is_refused(tmp_path):
    ann = PolygonAnnotation("ok", "_0", np.zeros((3, 2)))
    with pytest.raises(AnnotationError, match=r"group 'x\\x02' cannot be written as ASAP XML: its Name"):
        write_asap_xml([ann], tmp_path / "out.xml", groups=["_0", "x\x02"])


def test_printable_unicode_names_still_round_trip(tmp_path):
    name = "Läsion \u00e9 \u4e2d \U0001F600 <&>\t"
    write_asap_xml([PolygonAnnotation(name, "_0", np.zeros((3, 2)))], tmp_path / "a.xml")
    assert read_asap_xml(tmp_path / "a.xml")[0][0].name == name


def test_a_file_of_detections_only_is_refused_and_nothing_written(tmp_path, capsys):
    """A heatmap's <stem>_patches.geojson holds QuPath detections: converting it wrote an empty
    <Annotations /> and exited 0."""
    src = tmp_path / "s_patches.geojson"
    src.write_text(json.dumps({"type": "FeatureCollection",
                               "features": [_feature(f"p{k}", object_type="detection") for k in range(3)]}))
    out = tmp_path / "s.xml"
    assert main(["annotations", "convert", str(src), str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("error: ") == 1 and "Traceback" not in err, err
    assert (f"error: {src}: no annotation to convert: skipped 3 object(s) that are not annotations (detection: 3); "
            f"only QuPath annotations are read. Nothing was written to {out}. Fix: ") in err
    assert "_patches.geojson of patch detections" in err
    assert not out.exists()


def test_an_xml_of_annotations_without_coordinates_is_refused(tmp_path):
    src = tmp_path / "e.xml"
    src.write_text('<ASAP_Annotations><Annotations><Annotation Name="A" Type="Polygon" PartOfGroup="_0">'
                   "<Coordinates /></Annotation></Annotations></ASAP_Annotations>")
    with pytest.raises(AnnotationError, match=r"no annotation to convert: skipped 1 annotation\(s\) without "
                                              r"coordinates: A\. Nothing was written"):
        convert_annotations(src, tmp_path / "e.geojson")
    assert not (tmp_path / "e.geojson").exists()


def test_skipped_objects_beside_annotations_are_a_warning_and_empty_input_converts(tmp_path, caplog):
    src = tmp_path / "mixed.geojson"
    src.write_text(json.dumps({"type": "FeatureCollection",
                               "features": [_feature("a"), _feature("d", object_type="detection")]}))
    with caplog.at_level(logging.WARNING):
        convert_annotations(src, tmp_path / "mixed.xml")
    assert "skipped 1 object(s) that are not annotations (detection: 1)" in caplog.text
    assert [a.name for a in read_asap_xml(tmp_path / "mixed.xml")[0]] == ["a"]
    empty = tmp_path / "empty.geojson"
    empty.write_text('{"type": "FeatureCollection", "features": []}')
    convert_annotations(empty, tmp_path / "empty.xml")  # nothing was left out: an empty file is faithful
    assert read_asap_xml(tmp_path / "empty.xml")[0] == []


def test_polygons_of_one_or_two_vertices_become_a_point_and_a_line_and_come_back(tmp_path):
    anns = [PolygonAnnotation("one", "_0", np.array([[5.0, 6.0]])),
            PolygonAnnotation("two", "_0", np.array([[5.0, 6.0], [7.0, 8.0]])),
            PolygonAnnotation("three", "_0", np.array([[0.0, 0.0], [4.0, 0.0], [0.0, 3.0]]),
                              holes_lv0=(np.array([[1.0, 1.0]]),))]
    write_asap_xml(anns, tmp_path / "a.xml")
    convert_annotations(tmp_path / "a.xml", tmp_path / "a.geojson")
    features = json.loads((tmp_path / "a.geojson").read_text())["features"]
    geoms = {f["properties"]["name"]: f["geometry"] for f in features}
    assert geoms["one"] == {"type": "Point", "coordinates": [5.0, 6.0]}
    assert geoms["two"] == {"type": "LineString", "coordinates": [[5.0, 6.0], [7.0, 8.0]]}
    for f in features:  # every Polygon ring has at least 4 positions, first == last
        if f["geometry"]["type"] == "Polygon":
            assert all(len(r) >= 4 and r[0] == r[-1] for r in f["geometry"]["coordinates"])
    convert_annotations(tmp_path / "a.geojson", tmp_path / "b.xml")
    assert (tmp_path / "b.xml").read_bytes() == (tmp_path / "a.xml").read_bytes()


def test_a_hole_of_fewer_than_three_vertices_is_dropped_from_geojson_with_a_warning(tmp_path, caplog):
    from wsi_milssl.annotations import write_geojson

    ann = PolygonAnnotation("p", "Tumor", np.array([[0.0, 0.0], [9.0, 0.0], [0.0, 9.0]]),
                            holes_lv0=(np.array([[1.0, 1.0], [2.0, 1.0]]),))
    with caplog.at_level(logging.WARNING):
        write_geojson([ann], tmp_path / "h.geojson")
    rings = json.loads((tmp_path / "h.geojson").read_text())["features"][0]["geometry"]["coordinates"]
    assert len(rings) == 1 and "dropped 1 hole(s) of fewer than 3 vertices of 'p'" in caplog.text
