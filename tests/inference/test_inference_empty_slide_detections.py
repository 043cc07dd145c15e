"""Review AN, finding 6: a slide without a single tissue patch wrote no <stem>_detections.csv, while evaluate
counts it (a per_slide.csv row, score 0), so copying *_detections.csv for the official CAMELYON16 script (the
README's recipe) left it out, and that script divides the false positives by another slide count. Now such a
slide (status 'empty', no score) gets an empty (0-byte) detections CSV, so the folder has one per slide, and
evaluate takes that file as the latest run's (any other file of the slide is still an earlier run's)."""

from __future__ import annotations

import numpy as np

from wsi_milssl.config import HeatmapConfig
from wsi_milssl.evaluation import evaluate_predictions
from wsi_milssl.inference import make_heatmaps

FAST = dict(thumbnail_px=256, batch_size=64, num_workers=0)


def test_an_empty_slide_has_an_empty_detections_csv_and_is_evaluated(tmp_path, checkpoint_factory, slide_writer):
    glass = slide_writer(tmp_path / "glass.tif", width=2048, height=2048, tissue_box=(0, 0, 0, 0),
                         tumour=lambda xs, ys: np.zeros(xs.shape, bool))
    tissue = slide_writer(tmp_path / "tissue.tif", width=2048, height=2048, tissue_box=(256, 256, 1792, 1792),
                          tumour=lambda xs, ys: np.zeros(xs.shape, bool))
    hm = tmp_path / "hm"
    run = make_heatmaps([glass, tissue], checkpoint_factory(), hm, HeatmapConfig(**FAST))
    empty, ok = run.results
    assert empty.status == "empty" and empty.score is None and ok.status == "ok"
    assert sorted(p.name for p in hm.glob("*_detections.csv")) == ["glass_detections.csv", "tissue_detections.csv"]
    assert (hm / "glass_detections.csv").read_bytes() == b""
    assert [p.name for p in hm.glob("glass*")] == ["glass_detections.csv"]  # no map, no probabilities
    assert empty.outputs == {"detections_csv": str(hm / "glass_detections.csv")}
    assert "glass" not in (hm / "scores.csv").read_text()
    # evaluate counts both slides, the empty one with no detection
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\nglass,0\ntissue,0\n")
    evaluate_predictions(hm, labels_csv=labels, slides=tmp_path, out_dir=tmp_path / "ev")
    rows = [line.split(",")[:2] for line in (tmp_path / "ev" / "per_slide.csv").read_text().splitlines()[1:]]
    assert sorted(rows) == [["glass", "0"], ["tissue", "0"]]
