"""Issue 14 rows 6, 7 and 10: a bad annotation file or a protected store fails alone, recorded in
label_status.csv, and the batch goes on."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import stat

import numpy as np
import pytest

from wsi_milssl.annotations import PolygonAnnotation, read_annotations, write_asap_xml
from wsi_milssl.cli import main
from wsi_milssl.errors import AnnotationError, StoreError
from wsi_milssl.labeling import STATUS_CSV, label_stores
from wsi_milssl.store import create_writer, open_store, write_arrays

SLIDE_PX = 4096
PATCH_LV0 = 256


def _make_store(path, stem):
    xs, ys = np.meshgrid(np.arange(0, SLIDE_PX - PATCH_LV0 + 1, PATCH_LV0), np.arange(0, SLIDE_PX - PATCH_LV0 + 1, PATCH_LV0))
    coords = np.c_[xs.ravel(), ys.ravel()].astype(np.int64)
    with create_writer(path, pixels="none", patch_size_px=PATCH_LV0 // 2) as writer:
        writer.append(coords=coords, entropy_bits=np.full(len(coords), 5.0), tissue_fraction=np.ones(len(coords)))
        writer.finalize({
            "slide_path": f"/nonexistent/{stem}.tif", "slide_stem": stem, "dimensions_lv0": [SLIDE_PX, SLIDE_PX],
            "mpp": 0.25, "target_mpp": 0.5, "patch_size_px": PATCH_LV0 // 2, "patch_size_lv0": PATCH_LV0,
            "stride_px": PATCH_LV0 // 2, "stride_lv0": PATCH_LV0, "pixels": "none", "config_hash": "test",
        })
    return path


@pytest.fixture(params=["h5", "zarr"])
def batch(request, tmp_path):
    """Stores ``bad`` and ``good`` (a normal slide), an annotations folder and a labels.csv."""
    fmt = request.param
    stores = tmp_path / "stores"
    paths = {stem: _make_store(stores / f"{stem}.{fmt}", stem) for stem in ("bad", "good")}
    ann = tmp_path / "ann"
    ann.mkdir()
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\nbad,1\ngood,0\n")
    return paths, ann, labels


def _digest(path):
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()


def _status(out):
    with open(out / STATUS_CSV, newline="") as fh:
        return {row["slide"]: row for row in csv.DictReader(fh)}


@pytest.mark.parametrize("depth", [3_000, 200_000])
def test_deeply_nested_geojson_fails_alone(batch, tmp_path, depth):
    """Row 6: a RecursionError traceback used to stop the batch before any status CSV was written."""
    paths, ann, labels = batch
    (ann / "bad.geojson").write_text("[" * depth + "]" * depth)
    before = _digest(paths["bad"])
    report = label_stores(list(paths.values()), annotations_dir=ann, labels_csv=labels, out_dir=tmp_path / "out")
    rows = _status(tmp_path / "out")
    assert rows["good"]["status"] == "ok" and rows["bad"]["status"] == "failed"
    assert "bad.geojson: JSON nested too deeply to parse" in rows["bad"]["error"]
    assert "Fix: re-export the annotations" in rows["bad"]["error"]
    assert report.n_failed == 1 and _digest(paths["bad"]) == before


@pytest.mark.parametrize("depth, match", [
    (3_000, r"deep\.geojson: JSON nested too deeply to parse .* Fix: re-export"),
    (200_000, r"deep\.geojson: JSON nested too deeply to parse"),
    (100, r"deep\.geojson: JSON nested 100 levels deep; GeoJSON annotations are at most 64 levels deep"),
])
def test_deep_geojson_is_an_annotation_error(tmp_path, depth, match):
    path = tmp_path / "deep.geojson"
    path.write_text("[" * depth + "]" * depth)
    with pytest.raises(AnnotationError, match=match):
        read_annotations(path)


def test_deep_geometry_collection_is_an_annotation_error(tmp_path):
    geometry = '{"type": "Polygon", "coordinates": [[[0, 0], [9, 0], [9, 9]]]}'
    for _ in range(200):
        geometry = '{"type": "GeometryCollection", "geometries": [' + geometry + "]}"
    path = tmp_path / "nested.geojson"
    path.write_text(geometry)
    with pytest.raises(AnnotationError, match=r"nested\.geojson: JSON nested 40[0-9] levels deep"):
        read_annotations(path)


def _tumour_xml(path, polygons):
    anns = [PolygonAnnotation(name=f"Annotation {k}", group="_0", coords_lv0=np.asarray(xy, float))
            for k, xy in enumerate(polygons)]
    write_asap_xml(anns, path)


@pytest.mark.parametrize("polygons, why", [
    ([[(10, 10), (20, 20), (30, 30)], [(5, 5), (5, 5), (5, 5), (6, 6)]], "2 without area"),  # collinear, repeated
    ([[(9000, 9000), (9500, 9000), (9500, 9500)]], "1 outside the slide"),
    ([[(1, 1), (2, 2), (3, 3)], [(-900, -900), (-100, -900), (-100, -100)]], "1 outside the slide, 1 without area"),
])
def test_tumour_annotation_without_usable_polygon_fails_alone(batch, tmp_path, polygons, why):
    """Row 7: used to be a warning only, and the tumour slide got label 0 and no positive patch."""
    paths, ann, labels = batch
    _tumour_xml(ann / "bad.xml", polygons)
    before = _digest(paths["bad"])
    report = label_stores(list(paths.values()), annotations_dir=ann, labels_csv=None, out_dir=tmp_path / "out")
    rows = _status(tmp_path / "out")
    assert rows["good"]["status"] == "ok" and rows["bad"]["status"] == "failed"
    assert f"bad.xml: none of its {len(polygons)} tumour polygon(s)" in rows["bad"]["error"]
    assert f"encloses an area on the slide ({SLIDE_PX} x {SLIDE_PX} px at level 0): {why}." in rows["bad"]["error"]
    assert "Fix: check that the file belongs to this slide" in rows["bad"]["error"]
    assert report.n_failed == 1 and _digest(paths["bad"]) == before
    with open_store(paths["bad"]) as store:
        assert "slide_label" not in store.attrs


def test_two_annotation_files_that_disagree_fail_their_slide_alone(batch, tmp_path):
    """Review BG: find_annotation's refusal of two different files of one slide was raised outside the slide's
    try: one error stopped the batch, and the slides after it (here the good one) were never labelled."""
    paths, ann, labels = batch
    _tumour_xml(ann / "bad.xml", [[(100, 100), (300, 100), (300, 300), (100, 300)]])
    (ann / "bad.geojson").write_text(json.dumps({"type": "FeatureCollection", "features": [{
        "type": "Feature", "properties": {"classification": {"name": "Tumor"}},
        "geometry": {"type": "Polygon", "coordinates": [[[900, 900], [1500, 900], [1500, 1500], [900, 900]]]}}]}))
    report = label_stores(list(paths.values()), annotations_dir=ann, labels_csv=labels, out_dir=tmp_path / "out")
    rows = _status(tmp_path / "out")
    assert rows["good"]["status"] == "ok" and rows["bad"]["status"] == "failed"
    assert "bad: two annotation files describe different regions" in rows["bad"]["error"]
    assert report.n_failed == 1


def test_one_usable_tumour_polygon_is_enough(tmp_path):
    path = tmp_path / "ok.xml"
    _tumour_xml(path, [[(1, 1), (2, 2), (3, 3)], [(100, 100), (300, 100), (300, 300), (100, 300)]])
    aset = read_annotations(path, dimensions_lv0=(SLIDE_PX, SLIDE_PX))
    assert aset.has_tumor and aset.region.area == pytest.approx(200 * 200)


def _protect(path):
    """chmod a-w on the store (recursively for a Zarr folder); returns a restore function."""
    targets = [path] if path.is_file() else [path, *path.rglob("*")]
    modes = {t: stat.S_IMODE(t.stat().st_mode) for t in targets}
    for t in sorted(targets, key=lambda t: -len(t.parts)):
        os.chmod(t, modes[t] & ~0o222)
    return lambda: [os.chmod(t, m) for t, m in sorted(modes.items(), key=lambda kv: len(kv[0].parts))]


def test_read_only_store_is_refused_and_kept(batch, tmp_path):
    """Row 10: `label` used to replace a chmod-444 store (new inode, mode reset to 0644)."""
    paths, ann, labels = batch
    _tumour_xml(ann / "bad.xml", [[(100, 100), (900, 100), (900, 900), (100, 900)]])
    restore = _protect(paths["bad"])
    try:
        before = (os.stat(paths["bad"]).st_ino, stat.S_IMODE(os.stat(paths["bad"]).st_mode), _digest(paths["bad"]))
        code = main(["label", str(paths["bad"]), str(paths["good"]), "--annotations", str(ann),
                     "--labels", str(labels), "--out", str(tmp_path / "out")])
        after = (os.stat(paths["bad"]).st_ino, stat.S_IMODE(os.stat(paths["bad"]).st_mode), _digest(paths["bad"]))
    finally:
        restore()
    assert code == 1 and after == before
    rows = _status(tmp_path / "out")
    assert rows["good"]["status"] == "ok" and rows["bad"]["status"] == "failed"
    assert "the store is read-only" in rows["bad"]["error"] and "Fix: make it writable" in rows["bad"]["error"]


def test_write_arrays_refuses_read_only_and_keeps_mode(tmp_path):
    path = _make_store(tmp_path / "s.h5", "s")
    os.chmod(path, 0o444)
    try:
        with pytest.raises(StoreError, match=r"s\.h5: the store is read-only \(s\.h5 has mode 0444\).*Fix: make it "
                                             r"writable \(chmod -R u\+w"):
            write_arrays(path, {"score": np.zeros(256, np.float32)})
    finally:
        os.chmod(path, 0o640)
    write_arrays(path, {"score": np.zeros(256, np.float32)})
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640  # a writable store keeps its mode when rebuilt


@pytest.mark.parametrize("labels_csv", [True, False])
def test_a_tumour_annotation_in_unknown_groups_only_fails_alone(batch, tmp_path, labels_csv):
    """Every polygon in a group that is neither tumour nor non-tumour ("Metastasis"): used to be labelled
    'ok' with 0 positive patches (labels.csv says tumour) or read as a normal slide (no labels.csv)."""
    paths, ann, labels = batch
    write_asap_xml([PolygonAnnotation(name="Annotation 0", group="Metastasis",
                                      coords_lv0=np.asarray([(100, 100), (900, 100), (900, 900)], float))],
                   ann / "bad.xml", groups=["Metastasis"])
    before = _digest(paths["bad"])
    report = label_stores(list(paths.values()), annotations_dir=ann, labels_csv=labels if labels_csv else None,
                          out_dir=tmp_path / "out")
    rows = _status(tmp_path / "out")
    assert rows["good"]["status"] == "ok" and rows["bad"]["status"] == "failed"
    assert "bad.xml: no polygon of bad is in a tumour group (_0, _1, Tumor)" in rows["bad"]["error"]
    assert "group(s) 'Metastasis', which are neither tumour nor non-tumour" in rows["bad"]["error"]
    assert "Fix: name the tumour group(s) with --tumor-groups" in rows["bad"]["error"]
    assert report.n_failed == 1 and _digest(paths["bad"]) == before
