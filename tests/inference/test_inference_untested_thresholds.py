"""Review EG (mutation test, round 2): the detections were never seen cut at ``detection_threshold`` rather than
``tumor_threshold`` (each detections file would lose its maxima between the two, shortening the FROC curve), and a
patch exactly at ``tumor_threshold`` was never seen classed tumour in the GeoJSON ("at or above")."""

from __future__ import annotations

import csv
import json

import numpy as np

from wsi_milssl.config import HeatmapConfig
from wsi_milssl.inference import make_heatmaps
from wsi_milssl.inference.exports import write_patches_geojson


def test_detections_are_cut_at_the_detection_threshold_not_the_tumour_threshold(tmp_path, slide_writer,
                                                                                  checkpoint_factory):
    slide = slide_writer(tmp_path / "a.tif", width=2048, height=2048, tissue_box=(256, 256, 1792, 1792),
                         tumour=lambda xs, ys: (xs // 300 + ys // 300) % 4 == 0)
    out = tmp_path / "hm"
    config = HeatmapConfig(thumbnail_px=128, batch_size=32, num_workers=0, tumor_threshold=0.99,
                           detection_threshold=0.0, nms_radius_um=10.0)
    assert make_heatmaps([slide], checkpoint_factory(), out, config).ok
    with open(out / "a_detections.csv", newline="") as fh:
        probs = [float(r[0]) for r in csv.reader(fh) if r and r[0][0].isdigit()]
    assert probs and min(probs) < 0.99  # maxima below the tumour threshold are detections too


def test_a_patch_at_the_tumour_threshold_is_classed_tumour(tmp_path):
    path = write_patches_geojson(tmp_path / "p.geojson", np.array([[0, 0], [64, 0]]), np.array([0.5, 0.4999]),
                                 patch_size_lv0=64, tumor_threshold=0.5)
    names = [f["properties"]["classification"]["name"] for f in json.loads(path.read_text())["features"]]
    assert names == ["Tumor", "Normal"]
