"""Two annotation files for one slide (review AN, finding 2): with <stem>.xml beside a different
<stem>.geojson, label / evaluate / heatmap silently used the XML. find_annotation now refuses two files
that describe different regions or groups (naming both and the fix) and takes the XML when they agree
(a converted copy); a folder of one file per slide is not parsed."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from wsi_milssl.annotations import convert_annotations, find_annotation, read_annotations
from wsi_milssl.annotations import io as annotations_io
from wsi_milssl.errors import AnnotationError


def _square(x, y, side):
    return [[x, y], [x + side, y], [x + side, y + side], [x, y + side], [x, y]]


def _geojson(path, *features):
    path.write_text(json.dumps({"type": "FeatureCollection", "features": [
        {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": rings},
         "properties": {"objectType": "annotation", "classification": {"name": group, "color": [200, 0, 0]}}}
        for group, rings in features]}))
    return path


@pytest.fixture()
def slide_xml(synth_slides, tmp_path):
    """The synthetic tumour slide's ASAP XML, copied into an annotation folder: (stem, folder, file)."""
    stem = synth_slides["tumor"].stem
    folder = tmp_path / "ann"
    folder.mkdir()
    xml = shutil.copy(synth_slides["tumor"].with_suffix(".xml"), folder / f"{stem}.xml")
    return stem, folder, xml


def test_a_different_geojson_beside_the_xml_is_refused_naming_both(slide_xml):
    stem, folder, xml = slide_xml
    other = _geojson(folder / f"{stem}.geojson", ("Tumor", [_square(3000, 3000, 800)]))
    with pytest.raises(AnnotationError, match=rf"^{stem}: two annotation files describe different regions: "
                                              rf"{re.escape(str(xml))} and {re.escape(str(other))} \(groups with "
                                              r"polygons only in .*\)\. Fix: remove or "
                                              "rename the one that is out of date"):
        find_annotation(stem, folder)


def test_the_same_groups_covering_other_areas_are_refused(tmp_path):
    _geojson(tmp_path / "s.geojson", ("Tumor", [_square(0, 0, 100)]))
    convert_annotations(tmp_path / "s.geojson", tmp_path / "s.xml")
    _geojson(tmp_path / "s.geojson", ("tumor", [_square(0, 0, 101)]))
    with pytest.raises(AnnotationError, match=r"the polygons of group\(s\) Tumor cover different areas\)\. Fix:"):
        find_annotation("s", tmp_path)


def test_a_converted_copy_agrees_and_the_xml_is_used(slide_xml):
    stem, folder, xml = slide_xml
    convert_annotations(xml, folder / f"{stem}.geojson")
    assert find_annotation(stem, folder) == xml


def test_an_xml_converted_from_geojson_with_a_hole_agrees(tmp_path):
    _geojson(tmp_path / "s.geojson", ("Tumor", [_square(0, 0, 1000), _square(200, 200, 100)[::-1]]))
    convert_annotations(tmp_path / "s.geojson", tmp_path / "s.xml")
    assert find_annotation("s", tmp_path) == tmp_path / "s.xml"
    assert read_annotations(tmp_path / "s.xml").region.area == pytest.approx(1000 ** 2 - 100 ** 2)


def test_a_different_file_of_another_letter_case_is_refused(slide_xml):
    stem, folder, xml = slide_xml
    other = _geojson(folder / f"{stem.upper()}.GeoJSON", ("Tumor", [_square(3000, 3000, 800)]))
    if (folder / f"{stem}.geojson").exists():
        pytest.skip("case-insensitive file system")
    with pytest.raises(AnnotationError, match=rf"{other.name}"):
        find_annotation(stem, folder)


def test_a_json_that_is_not_geojson_beside_the_xml_is_not_an_annotation_file(slide_xml):
    stem, folder, xml = slide_xml
    (folder / f"{stem}.json").write_text('{"scanner": "synthetic"}')
    assert find_annotation(stem, folder) == xml


def test_a_second_file_that_cannot_be_read_is_one_error_naming_both(slide_xml):
    stem, folder, xml = slide_xml
    bad = folder / f"{stem}.geojson"
    bad.write_text('{"type": "FeatureCollection", "features": [')
    with pytest.raises(AnnotationError, match=rf"^{stem}: two annotation files, {re.escape(str(xml))} and "
                                              rf"{re.escape(str(bad))}, and one cannot be read: .*Fix: remove or "
                                              r"rename the one that is out of date"):
        find_annotation(stem, folder)


def test_one_file_per_slide_is_not_parsed(slide_xml, monkeypatch):
    stem, folder, xml = slide_xml
    _geojson(folder / "other.geojson", ("Tumor", [_square(0, 0, 10)]))
    parsed = []
    real = annotations_io._read_raw
    monkeypatch.setattr(annotations_io, "_read_raw", lambda *a, **k: parsed.append(a) or real(*a, **k))
    assert find_annotation(stem, folder) == xml and find_annotation("other", folder) == folder / "other.geojson"
    assert parsed == []
    shutil.copy(xml, folder / f"{stem}.geojson.tmp")
    os.replace(folder / f"{stem}.geojson.tmp", folder / f"{stem.upper()}.xml")  # the same bytes: not parsed either
    assert find_annotation(stem, folder) == xml and parsed == []


def _circle(decimals, shift=0.0):
    """A 60-vertex lesion about 200 px across at level-0 coordinates near 50,000, rounded to ``decimals``;
    ``shift`` moves its first vertex outwards by that many pixels."""
    import math

    pts = [[50000.123456 + (100 + (shift if t == 0 else 0)) * math.cos(t * math.pi / 30),
            60000.654321 + (100 + (shift if t == 0 else 0)) * math.sin(t * math.pi / 30)] for t in range(60)]
    ring = [[round(x, decimals), round(y, decimals)] for x, y in pts]
    return ring + [ring[0]]


@pytest.mark.parametrize("decimals", [3, 2, 1])
def test_a_geojson_with_rounded_coordinates_agrees_with_its_xml(tmp_path, decimals):
    """QuPath and float32 round the coordinates: a copy written with 0.1 to 0.001 px precision is the same
    region (the 1e-6-of-the-area rule refused all of these: review AQ)."""
    _geojson(tmp_path / "s.geojson", ("Tumor", [_circle(6)]))
    convert_annotations(tmp_path / "s.geojson", tmp_path / "s.xml")
    _geojson(tmp_path / "s.geojson", ("Tumor", [_circle(decimals)]))
    assert annotations_io.annotation_difference(tmp_path / "s.xml", tmp_path / "s.geojson") is None
    assert find_annotation("s", tmp_path) == tmp_path / "s.xml"


@pytest.mark.parametrize("shift_px", [2.0, -2.0])
def test_a_vertex_moved_by_two_pixels_is_another_region(tmp_path, shift_px):
    _geojson(tmp_path / "s.geojson", ("Tumor", [_circle(6)]))
    convert_annotations(tmp_path / "s.geojson", tmp_path / "s.xml")
    _geojson(tmp_path / "s.geojson", ("Tumor", [_circle(3, shift=shift_px)]))
    assert annotations_io.annotation_difference(tmp_path / "s.xml", tmp_path / "s.geojson") == (
        "the polygons of group(s) Tumor cover different areas")
