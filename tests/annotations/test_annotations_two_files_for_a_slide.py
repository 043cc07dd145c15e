"""Two annotation files for one slide (review AN, finding 2): with <stem>.xml beside a different
<stem>.geojson, label / evaluate / heatmap silently used the XML. find_annotation now refuses two files
that describe different regions or groups (naming both and the fix) and takes the XML when they agree
(a converted copy); a folder of one file per slide is not parsed."""

from __future__ import annotations

import json
import os
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
    with pytest.raises(AnnotationError, match=rf"^{stem}: two annotation files describe different regions: {xml} "
                                              rf"and {other} \(groups with polygons only in .*\)\. Fix: remove or "
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
    with pytest.raises(AnnotationError, match=rf"^{stem}: two annotation files, {xml} and {bad}, and one cannot be "
                                              r"read: .*Fix: remove or rename the one that is out of date"):
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
