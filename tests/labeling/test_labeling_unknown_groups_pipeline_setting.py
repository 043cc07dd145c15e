"""A tumour slide whose polygons are all in groups that are neither tumour nor non-tumour is refused by label
with a fix naming the groups' settings. Under `wsi-milssl run` there is no --tumor-groups option: the fix named
only that flag (review AO, finding 2). It now names the pipeline's settings too, as evaluate's refusal of the
same slide does: "--tumor-groups (and the others with --non-tumor-groups; in a pipeline, [label] tumor_groups /
non_tumor_groups)"."""

from __future__ import annotations

import csv

import numpy as np

from wsi_milssl.annotations import PolygonAnnotation, write_asap_xml
from wsi_milssl.labeling import STATUS_CSV, label_stores
from wsi_milssl.store import create_writer

SLIDE_PX = 2048
PATCH_LV0 = 256
FIX = ("Fix: name the tumour group(s) with --tumor-groups (and the others with --non-tumor-groups; in a pipeline, "
       "[label] tumor_groups / non_tumor_groups), or correct the annotation file.")


def _store(path, stem):
    xs, ys = np.meshgrid(np.arange(0, SLIDE_PX, PATCH_LV0), np.arange(0, SLIDE_PX, PATCH_LV0))
    coords = np.c_[xs.ravel(), ys.ravel()].astype(np.int64)
    with create_writer(path, pixels="none", patch_size_px=PATCH_LV0 // 2) as writer:
        writer.append(coords=coords, entropy_bits=np.full(len(coords), 5.0), tissue_fraction=np.ones(len(coords)))
        writer.finalize({
            "slide_path": f"/nonexistent/{stem}.tif", "slide_stem": stem, "dimensions_lv0": [SLIDE_PX, SLIDE_PX],
            "mpp": 0.25, "target_mpp": 0.5, "patch_size_px": PATCH_LV0 // 2, "patch_size_lv0": PATCH_LV0,
            "stride_px": PATCH_LV0 // 2, "stride_lv0": PATCH_LV0, "pixels": "none", "config_hash": "test",
        })
    return path


def test_the_unknown_groups_fix_names_the_pipeline_settings(tmp_path):
    store = _store(tmp_path / "stores" / "test_001.h5", "test_001")
    (tmp_path / "ann").mkdir()
    write_asap_xml([PolygonAnnotation(name="Annotation 0", group="metastases",
                                      coords_lv0=np.asarray([(100, 100), (900, 100), (900, 900)], float))],
                   tmp_path / "ann" / "test_001.xml", groups=["metastases"])
    (tmp_path / "labels.csv").write_text("slide,label\ntest_001,1\n")
    report = label_stores([store], annotations_dir=tmp_path / "ann", labels_csv=tmp_path / "labels.csv",
                          out_dir=tmp_path / "out")
    assert report.n_failed == 1
    with open(tmp_path / "out" / STATUS_CSV, newline="") as fh:
        error = next(csv.DictReader(fh))["error"]
    assert "group(s) 'metastases', which are neither tumour nor non-tumour" in error
    assert error.endswith(FIX)
