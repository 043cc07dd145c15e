"""ASAP XML and GeoJSON readers: structure, group mapping, and bad or hostile input."""

from __future__ import annotations

import json
import logging
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from wsi_milssl.annotations import (
    GroupMap,
    PolygonAnnotation,
    annotation_format,
    find_annotation,
    list_annotation_files,
    read_annotations,
    read_asap_xml,
    read_geojson,
    write_asap_xml,
)
from wsi_milssl.errors import AnnotationError

ASAP_OK = """<?xml version="1.0"?>
<ASAP_Annotations>
  <Annotations>
    <Annotation Name="A" Type="Polygon" PartOfGroup="_0" Color="#F4FA58">
      <Coordinates>
        <Coordinate Order="0" X="0" Y="0" />
        <Coordinate Order="2" X="100" Y="100" />
        <Coordinate Order="1" X="100" Y="0" />
        <Coordinate Order="3" X="0" Y="100" />
      </Coordinates>
    </Annotation>
  </Annotations>
  <AnnotationGroups><Group Name="_0" PartOfGroup="None" Color="#FF0000"><Attributes /></Group></AnnotationGroups>
</ASAP_Annotations>
"""

BILLION_LAUGHS = """<?xml version="1.0"?>
<!DOCTYPE lolz [
 <!ENTITY lol "lol">
 <!ENTITY lol1 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
 <!ENTITY lol2 "&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;">
 <!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">
]>
<ASAP_Annotations><Annotations><Annotation Name="&lol3;" Type="Polygon" PartOfGroup="_0">
<Coordinates><Coordinate Order="0" X="0" Y="0"/></Coordinates></Annotation></Annotations></ASAP_Annotations>
"""

XXE = """<?xml version="1.0"?>
<!DOCTYPE foo [<!ENTITY xxe SYSTEM "file:///etc/passwd">]>
<ASAP_Annotations><Annotations><Annotation Name="&xxe;" Type="Polygon" PartOfGroup="_0">
<Coordinates><Coordinate Order="0" X="0" Y="0"/></Coordinates></Annotation></Annotations></ASAP_Annotations>
"""

EXTERNAL_DTD = """<?xml version="1.0"?>
<!DOCTYPE ASAP_Annotations SYSTEM "http://example.invalid/asap.dtd">
<ASAP_Annotations><Annotations/></ASAP_Annotations>
"""


def _write(path, text):
    path.write_text(text)
    return path


def test_read_synth_xml_matches_plain_parse(synth_slides):
    path = synth_slides["tumor"].with_suffix(".xml")
    polys, groups = read_asap_xml(path)
    root = ET.parse(path).getroot()
    expected = root.findall(".//Annotation")
    assert len(polys) == len(expected) > 0
    for ann, el in zip(polys, expected):
        assert ann.group == el.get("PartOfGroup")
        xy = np.array([[float(c.get("X")), float(c.get("Y"))] for c in el.iter("Coordinate")])
        np.testing.assert_array_equal(ann.coords_lv0, xy)
    assert list(groups) == ["_0", "_1", "_2"]


def test_coordinates_are_sorted_by_order(tmp_path):
    polys, _ = read_asap_xml(_write(tmp_path / "a.xml", ASAP_OK))
    np.testing.assert_array_equal(polys[0].coords_lv0, [[0, 0], [100, 0], [100, 100], [0, 100]])
    aset = read_annotations(tmp_path / "a.xml")
    assert aset.region.area == pytest.approx(10_000)


@pytest.mark.parametrize("text,what", [(BILLION_LAUGHS, "DOCTYPE"), (XXE, "DOCTYPE"), (EXTERNAL_DTD, "DOCTYPE")])
def test_hostile_xml_is_refused(tmp_path, text, what):
    path = _write(tmp_path / "evil.xml", text)
    with pytest.raises(AnnotationError, match=rf"evil\.xml: refused XML with a {what}.*line 2.*XXE"):
        read_annotations(path)


def test_malformed_xml_names_file_and_line(tmp_path):
    bad = ASAP_OK.replace("</Coordinates>\n    </Annotation>", "</Coordinates>\n    </Annotatio>", 1)
    path = _write(tmp_path / "broken.xml", bad)
    with pytest.raises(AnnotationError, match=r"broken\.xml: not well-formed XML at line 11, column \d+"):
        read_annotations(path)


def test_bad_coordinate_names_element_and_line(tmp_path):
    path = _write(tmp_path / "nan.xml", ASAP_OK.replace('X="100" Y="100"', 'X="abc" Y="100"'))
    with pytest.raises(AnnotationError, match=r"nan\.xml: line 7: <Coordinate Order='2'> of <Annotation Name='A'> "
                                              r"has X='abc', which is not a number"):
        read_asap_xml(path)
    path = _write(tmp_path / "nox.xml", ASAP_OK.replace('X="100" Y="100"', 'Y="100"'))
    with pytest.raises(AnnotationError, match=r"nox\.xml: line 7: .* has no X attribute"):
        read_asap_xml(path)


def test_decimal_comma_is_accepted(tmp_path):
    path = _write(tmp_path / "comma.xml", ASAP_OK.replace('X="100" Y="100"', 'X="100,5" Y="100"'))
    polys, _ = read_asap_xml(path)
    assert polys[0].coords_lv0[2, 0] == 100.5


@pytest.mark.parametrize("text", ["1_000", "\u0661\u0662", "0x10", "1e", "--1"])
def test_numbers_only_python_reads_are_refused(tmp_path, text):
    # float() took "1_000" as 1000 and Arabic-Indic digits as 12; no annotation tool writes them (review ES)
    path = _write(tmp_path / "odd.xml", ASAP_OK.replace('X="100" Y="100"', f'X="{text}" Y="100"'))
    with pytest.raises(AnnotationError, match=rf"odd\.xml: line 7: .* has X='{text}', which is not a number"):
        read_asap_xml(path)


@pytest.mark.parametrize("text, value", [(" 100.5 ", 100.5), ("+1e2", 100.0), (".5", 0.5), ("7.", 7.0),
                                         ("1,5E1", 15.0)])
def test_plain_number_spellings_are_read(tmp_path, text, value):
    path = _write(tmp_path / "ok.xml", ASAP_OK.replace('X="100" Y="100"', f'X="{text}" Y="100"'))
    polys, _ = read_asap_xml(path)
    assert polys[0].coords_lv0[2, 0] == value


def test_wrong_root_and_missing_file(tmp_path):
    path = _write(tmp_path / "other.xml", "<svg><g/></svg>")
    with pytest.raises(AnnotationError, match=r"other\.xml: line 1: root element is <svg>, expected <ASAP_Annotations>"):
        read_asap_xml(path)
    with pytest.raises(AnnotationError, match=r"missing\.xml: annotation file not found"):
        read_annotations(tmp_path / "missing.xml")


def _feature(geometry, cls=None, **props):
    properties = {"objectType": "annotation", **props}
    if cls is not None:
        properties["classification"] = {"name": cls, "color": [200, 0, 0]}
    return {"type": "Feature", "geometry": geometry, "properties": properties}


def _square(x, y, s):
    return [[x, y], [x + s, y], [x + s, y + s], [x, y + s], [x, y]]


def test_geojson_polygon_multipolygon_holes_and_classes(tmp_path):
    doc = {
        "type": "FeatureCollection",
        "features": [
            _feature({"type": "Polygon", "coordinates": [_square(0, 0, 100), _square(25, 25, 50)]}, "Tumor", name="T"),
            _feature({"type": "MultiPolygon", "coordinates": [[_square(200, 0, 10)], [_square(300, 0, 10)]]}, "tumor"),
            _feature({"type": "Polygon", "coordinates": [_square(0, 0, 10)]}, "Exclusion"),
            _feature({"type": "Polygon", "coordinates": [_square(500, 500, 10)]}, None),  # unclassified
            _feature({"type": "Polygon", "coordinates": [_square(600, 600, 10)]}, "Tumor", objectType="detection"),
        ],
    }
    path = tmp_path / "q.geojson"
    path.write_text(json.dumps(doc))
    polys, groups = read_geojson(path)
    assert [p.group for p in polys] == ["Tumor", "tumor", "tumor", "Exclusion", "Unclassified"]
    assert len(polys[0].holes_lv0) == 1 and len(polys[0].coords_lv0) == 4  # closing vertex dropped
    aset = read_annotations(path)
    # 100² - 50² (hole) - 10² (exclusion) + 2 x 10² (multipolygon); unclassified ignored
    assert aset.region.area == pytest.approx(10_000 - 2_500 - 100 + 200)
    assert groups["Tumor"] == "#C80000"


def test_geojson_qupath_array_and_bare_geometry(tmp_path):
    path = tmp_path / "arr.json"
    path.write_text(json.dumps([_feature({"type": "Polygon", "coordinates": [_square(0, 0, 10)]}, "Tumor")]))
    assert read_annotations(path).region.area == pytest.approx(100)
    path = tmp_path / "bare.geojson"
    path.write_text(json.dumps({"type": "Polygon", "coordinates": [_square(0, 0, 10)]}))
    aset = read_annotations(path, group_map=GroupMap(tumor=("Unclassified",), non_tumor=()))
    assert aset.region.area == pytest.approx(100)


def test_geojson_invalid_json_names_line(tmp_path):
    path = tmp_path / "bad.geojson"
    path.write_text('{\n  "type": "FeatureCollection",\n  "features": [\n    {"type": "Feature",,}\n  ]\n}\n')
    with pytest.raises(AnnotationError, match=r"bad\.geojson: invalid JSON at line 4, column \d+"):
        read_annotations(path)


def test_geojson_bad_coordinates_name_the_feature(tmp_path):
    path = tmp_path / "coords.geojson"
    doc = {"type": "FeatureCollection", "features": [
        _feature({"type": "Polygon", "coordinates": [_square(0, 0, 10)]}, "Tumor", name="ok"),
        _feature({"type": "Polygon", "coordinates": [[[0, 0], ["x", 1], [2, 2]]]}, "Tumor", name="lesion 7"),
    ]}
    path.write_text(json.dumps(doc))
    with pytest.raises(AnnotationError, match=r"coords\.geojson: feature 1 \('lesion 7'\), ring 0: position 1 "
                                              r"must be \[x, y\] numbers"):
        read_geojson(path)
    doc["features"][1]["geometry"] = {"type": "Circle", "coordinates": [0, 0]}
    path.write_text(json.dumps(doc))
    with pytest.raises(AnnotationError, match=r"feature 1 \('lesion 7'\): unsupported geometry type 'Circle'"):
        read_geojson(path)
    path.write_text(json.dumps({"type": "Topology"}))
    with pytest.raises(AnnotationError, match=r"top level is 'Topology'; expected a GeoJSON FeatureCollection"):
        read_geojson(path)


def test_group_map_is_configurable_and_case_insensitive(tmp_path):
    anns = [
        PolygonAnnotation("a", "Metastasis", np.array([[0, 0], [10, 0], [10, 10], [0, 10]], float)),
        PolygonAnnotation("b", "stroma", np.array([[0, 0], [5, 0], [5, 5], [0, 5]], float)),
    ]
    path = write_asap_xml(anns, tmp_path / "g.xml")
    gm = GroupMap(tumor=("metastasis",), non_tumor=("Stroma",))
    assert read_annotations(path, group_map=gm).region.area == pytest.approx(75)
    assert read_annotations(path, group_map={"METASTASIS": "tumor"}).region.area == pytest.approx(100)


def test_unknown_groups_and_points_warn(tmp_path, caplog):
    anns = [
        PolygonAnnotation("a", "_0", np.array([[0, 0], [10, 0], [10, 10], [0, 10]], float)),
        PolygonAnnotation("b", "Lymphocytes", np.array([[0, 0], [5, 0], [5, 5]], float)),
        PolygonAnnotation("c", "_0", np.array([[1, 1]], float), type="Dot"),
    ]
    path = write_asap_xml(anns, tmp_path / "w.xml")
    with caplog.at_level(logging.WARNING):
        aset = read_annotations(path)
        assert aset.region.area == pytest.approx(100)
    text = caplog.text
    assert "ignored 1 polygon(s) in group(s) 'Lymphocytes'" in text
    assert "type(s) Dot: they enclose no area" in text


def test_format_detection_and_find(tmp_path):
    (tmp_path / "s1.xml").write_text(ASAP_OK)
    (tmp_path / "S2.GeoJSON").write_text("{}")
    (tmp_path / "manifest.json").write_text('{"slides": []}')
    (tmp_path / "noext").write_text(ASAP_OK)
    assert annotation_format(tmp_path / "noext") == "asap"
    assert find_annotation("s1", tmp_path) == tmp_path / "s1.xml"
    assert find_annotation("s2", tmp_path) == tmp_path / "S2.GeoJSON"
    assert find_annotation("s3", tmp_path) is None
    assert [p.name for p in list_annotation_files(tmp_path)] == ["S2.GeoJSON", "s1.xml"]
    with pytest.raises(AnnotationError, match=r"annotation folder not found"):
        find_annotation("s1", tmp_path / "nope")
    # review EW, C7: a file given for the folder was "not found"
    given = tmp_path / "s1.xml"
    for call in (lambda: find_annotation("s1", given), lambda: list_annotation_files(given)):
        with pytest.raises(AnnotationError, match=rf"s1\.xml: is a file, not the annotation folder\. Fix: pass the "
                                                  rf"folder .* \(this file's is {tmp_path}\)\.$"):
            call()


def test_find_annotation_lists_a_folder_once_for_many_slides_and_sees_new_files(tmp_path, monkeypatch):
    # the case-insensitive fallback listed the whole folder once per slide: a cohort of n slides
    # without annotations cost n listings of n files
    for k in range(40):
        (tmp_path / f"Slide_{k:03d}.XML").write_text(ASAP_OK)
    listings = []
    real_iterdir = Path.iterdir

    def counting_iterdir(self):
        listings.append(self)
        return real_iterdir(self)

    monkeypatch.setattr(Path, "iterdir", counting_iterdir)
    found = [find_annotation(f"slide_{k:03d}", tmp_path) for k in range(40)]
    assert found == [tmp_path / f"Slide_{k:03d}.XML" for k in range(40)]
    assert [find_annotation(f"other_{k}", tmp_path) for k in range(20)] == [None] * 20
    assert len(listings) <= 1
    # a file added later is found (the folder's state changed), and a removed one is no longer returned
    (tmp_path / "OTHER_7.GeoJSON").write_text('{"type": "FeatureCollection", "features": []}')
    (tmp_path / "Slide_000.XML").unlink()
    stat = tmp_path.stat()
    os.utime(tmp_path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # coarse-clock file systems
    assert find_annotation("other_7", tmp_path) == tmp_path / "OTHER_7.GeoJSON"
    assert find_annotation("slide_000", tmp_path) is None
