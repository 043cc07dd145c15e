"""QuPath 0.2 exports: the object type is the feature's ``id`` ("PathCellObject"), not ``properties.objectType``."""

from __future__ import annotations

import json
import logging

import pytest

from wsi_milssl.annotations import convert_annotations, read_annotations, read_geojson
from wsi_milssl.errors import AnnotationError


def _feature(fid, name=None, x0=0):
    props = {"classification": {"name": "Tumor", "colorRGB": -3670016}, "isLocked": False, "measurements": []}
    if name is not None:
        props["name"] = name
    ring = [[x0, 0], [x0 + 100, 0], [x0 + 100, 100], [x0, 100], [x0, 0]]
    return {"type": "Feature", "id": fid, "geometry": {"type": "Polygon", "coordinates": [ring]}, "properties": props}


def test_qupath_02_cells_and_detections_are_not_tumour_annotations(tmp_path):
    src = tmp_path / "q02.json"
    src.write_text(json.dumps([_feature("PathCellObject"), _feature("PathDetectionObject", x0=200)]))
    with pytest.raises(AnnotationError, match=r"no annotation to convert: skipped 2 object\(s\) that are not "
                                              r"annotations \(cell: 1, detection: 1\)"):
        convert_annotations(src, tmp_path / "q02.xml")
    assert not (tmp_path / "q02.xml").exists()
    skipped: list[str] = []
    assert read_geojson(src, skipped=skipped)[0] == []
    assert skipped and "cell: 1, detection: 1" in skipped[0]


def test_qupath_02_annotations_are_kept_and_their_id_is_not_a_name(tmp_path, caplog):
    src = tmp_path / "q02.json"
    src.write_text(json.dumps([_feature("PathAnnotationObject"), _feature("PathAnnotationObject", "lesion", 200),
                               _feature("PathTileObject", x0=400), _feature("PathTMACoreObject", x0=600)]))
    with caplog.at_level(logging.WARNING):
        aset = read_annotations(src)
    assert [a.name for a in aset.polygons] == ["Annotation 0", "lesion"]
    assert aset.region.area == 20_000
    assert "2 object(s) that are not annotations (tile: 1, tma_core: 1)" in caplog.text


def test_an_objecttype_wins_over_the_id_and_other_ids_stay_names(tmp_path):
    a = _feature("PathDetectionObject")
    a["properties"]["objectType"] = "annotation"
    b = _feature("3f1c-uuid", x0=200)
    b["properties"]["objectType"] = "annotation"
    src = tmp_path / "q04.geojson"
    src.write_text(json.dumps({"type": "FeatureCollection", "features": [a, b]}))
    assert [p.name for p in read_geojson(src)[0]] == ["Annotation 0", "3f1c-uuid"]
