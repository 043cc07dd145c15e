"""Review AM, finding 3 (label): under torchrun every rank warned that annotation files "match no store", a
message about the whole folder, so 3 ranks printed it 3 times. Now torchrun's rank 0 alone says it; a
--shard I/N process (its own command, its own log) still does."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from wsi_milssl.distributed import Shard
from wsi_milssl.labeling import label_stores
from wsi_milssl.store import create_writer

SLIDE_PX, PATCH_LV0 = 2048, 256


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


@pytest.mark.parametrize("rank, warned", [(0, True), (1, False)])
def test_unmatched_annotations_are_warned_about_by_rank_0_alone(tmp_path, monkeypatch, caplog, rank, warned):
    stores = tmp_path / "stores"
    for stem in ("a", "b"):
        _make_store(stores / f"{stem}.h5", stem)
    ann = tmp_path / "ann"
    ann.mkdir()
    (ann / "orphan.xml").write_text("<ASAP_Annotations><Annotations/><AnnotationGroups/></ASAP_Annotations>")
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\na,0\nb,0\n")
    monkeypatch.setenv("RANK", str(rank))  # torchrun's environment of rank `rank` of 2
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    with caplog.at_level(logging.WARNING):
        report = label_stores(stores, annotations_dir=ann, labels_csv=labels, out_dir=tmp_path / "labels",
                              shard=Shard(rank, 2, "position"))
    assert report.n_failed == 0
    assert ("match no store" in caplog.text) is warned, caplog.text


def test_a_shard_process_warns_itself(tmp_path, caplog):
    stores = tmp_path / "stores"
    _make_store(stores / "a.h5", "a")
    ann = tmp_path / "ann"
    ann.mkdir()
    (ann / "orphan.xml").write_text("<ASAP_Annotations><Annotations/><AnnotationGroups/></ASAP_Annotations>")
    with caplog.at_level(logging.WARNING):
        label_stores(stores, annotations_dir=ann, out_dir=tmp_path / "labels", shard=(1, 2))
    assert "match no store" in caplog.text
