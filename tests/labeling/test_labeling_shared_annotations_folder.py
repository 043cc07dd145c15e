"""Review AU, finding 5 (label): one annotations folder for both sets ([data] train_annotations =
test_annotations, as the README allows) made each set's label step warn that the other set's annotation files
"match no store". ``label_stores(other_stems=...)`` leaves the other set's files out of that warning; a file of
no slide of either set is still reported, and a hand run without ``other_stems`` warns as before."""

from __future__ import annotations

import logging

import numpy as np

from wsi_milssl.labeling import label_stores
from wsi_milssl.store import create_writer

SLIDE_PX, PATCH_LV0 = 2048, 256
EMPTY_XML = "<ASAP_Annotations><Annotations/><AnnotationGroups/></ASAP_Annotations>"


def _make_store(path, stem):
    xs, ys = np.meshgrid(np.arange(0, SLIDE_PX, PATCH_LV0), np.arange(0, SLIDE_PX, PATCH_LV0))
    coords = np.c_[xs.ravel(), ys.ravel()].astype(np.int64)
    with create_writer(path, pixels="none", patch_size_px=PATCH_LV0 // 2) as writer:
        writer.append(coords=coords, entropy_bits=np.full(len(coords), 5.0), tissue_fraction=np.ones(len(coords)))
        writer.finalize({
            "slide_path": f"/nonexistent/{stem}.tif", "slide_stem": stem, "dimensions_lv0": [SLIDE_PX, SLIDE_PX],
            "mpp": 0.25, "target_mpp": 0.5, "patch_size_px": PATCH_LV0 // 2, "patch_size_lv0": PATCH_LV0,
            "stride_px": PATCH_LV0 // 2, "stride_lv0": PATCH_LV0, "pixels": "none", "config_hash": "test",
        })


def _setup(tmp_path):
    stores = tmp_path / "stores"
    _make_store(stores / "a.h5", "a")
    ann = tmp_path / "ann"
    ann.mkdir()
    for stem in ("a", "Other_Set", "orphan"):  # a: this set's; Other_Set: the other set's; orphan: no set's
        (ann / f"{stem}.xml").write_text(EMPTY_XML)
    return stores, ann


def test_the_other_sets_annotation_files_are_not_unmatched(tmp_path, caplog):
    stores, ann = _setup(tmp_path)
    with caplog.at_level(logging.WARNING):
        report = label_stores(stores, annotations_dir=ann, out_dir=tmp_path / "labels", other_stems=["other_set"])
    assert report.n_failed == 0
    assert [p.name for p in report.unmatched_annotations] == ["orphan.xml"]
    warned = [r.getMessage() for r in caplog.records if "match no store" in r.getMessage()]
    assert len(warned) == 1 and "1 annotation file(s)" in warned[0] and "orphan.xml" in warned[0], warned
    assert "Other_Set" not in warned[0]


def test_a_hand_run_without_other_stems_warns_as_before(tmp_path, caplog):
    stores, ann = _setup(tmp_path)
    with caplog.at_level(logging.WARNING):
        report = label_stores(stores, annotations_dir=ann, out_dir=tmp_path / "labels")
    assert sorted(p.name for p in report.unmatched_annotations) == ["Other_Set.xml", "orphan.xml"]
    assert "2 annotation file(s)" in caplog.text and "Other_Set.xml" in caplog.text
