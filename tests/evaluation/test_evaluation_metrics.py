"""Instance/bag AUC and ROC helpers, and the prediction-file readers."""

from __future__ import annotations

import numpy as np
import pytest

from wsi_milssl.errors import ConfigError, EvaluationError
from wsi_milssl.evaluation import (
    auc_metric,
    find_predictions,
    read_detections,
    read_patch_probs,
    read_scores,
    resolve_slides,
    roc,
)


def test_auc_by_hand():
    """Positives 0.8, 0.4; negatives 0.5, 0.1: of the 4 (pos, neg) pairs 3 are ordered right -> 0.75."""
    m = auc_metric(np.array([1, 1, 0, 0]), np.array([0.8, 0.4, 0.5, 0.1]), what="patches")
    assert m.value == 0.75 and m.n == 4 and m.n_positive == 2 and m.reason == ""
    tied = auc_metric(np.array([1, 0]), np.array([0.5, 0.5]))
    assert tied.value == 0.5  # a tie counts one half


def test_auc_unavailable_with_one_class():
    m = auc_metric(np.zeros(5, dtype=int), np.linspace(0, 1, 5), what="patches")
    assert m.value is None and m.reason == "all 5 patches are negative; AUC needs both classes"
    assert auc_metric(np.array([]), np.array([]), what="slides").reason == "no slides to score"
    assert roc(np.ones(3, dtype=int), np.ones(3)) is None


def test_auc_rejects_bad_input():
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        auc_metric(np.array([0, 2]), np.array([0.1, 0.2]))
    with pytest.raises(ValueError, match="finite"):
        auc_metric(np.array([0, 1]), np.array([0.1, np.nan]))


def test_roc_curve_by_hand():
    curve = roc(np.array([1, 1, 0, 0]), np.array([0.8, 0.4, 0.5, 0.1]))
    assert curve.auc == 0.75
    # thresholds 0.8 (TPR .5, FPR 0), 0.5 (.5, .5), 0.4 (1, .5), 0.1 (1, 1)
    pts = set(zip(curve.fpr.tolist(), curve.tpr.tolist()))
    assert {(0.0, 0.0), (0.0, 0.5), (0.5, 1.0), (1.0, 1.0)} <= pts


def test_read_detections(tmp_path):
    p = tmp_path / "a_detections.csv"
    p.write_text("0.9,100,200\n\n0.25,3.5,7\n")
    d = read_detections(p)
    np.testing.assert_array_equal(d.probs, [0.9, 0.25])
    np.testing.assert_array_equal(d.x_lv0, [100, 3.5])
    np.testing.assert_array_equal(d.y_lv0, [200, 7])
    p.write_text("")
    assert len(read_detections(p)) == 0
    p.write_text("0.5,1,inf\n")
    with pytest.raises(EvaluationError, match="line 1: y is 'inf'; it must be a finite number"):
        read_detections(p)
    with pytest.raises(EvaluationError, match="cannot read the detections file"):
        read_detections(tmp_path / "missing.csv")


def test_read_patch_probs_and_scores(tmp_path):
    p = tmp_path / "a_patches.csv"
    p.write_text("x_lv0,y_lv0,prob\n0,0,0.1\n256,0,0.9\n")
    coords, probs = read_patch_probs(p)
    assert coords.dtype == np.int64 and coords.tolist() == [[0, 0], [256, 0]]
    assert probs.tolist() == [0.1, 0.9]
    p.write_text("x,y,p\n0,0,0.1\n")
    with pytest.raises(EvaluationError, match="expected 'x_lv0,y_lv0,prob'"):
        read_patch_probs(p)
    s = tmp_path / "scores.csv"
    s.write_text("slide,score\na.svs,0.5\nb,0.25\n")
    assert read_scores(s) == {"a": 0.5, "b": 0.25}
    s.write_text("slide,score\na,0.5\na,0.3\n")
    with pytest.raises(EvaluationError, match="slide 'a' is listed twice"):
        read_scores(s)


def test_find_predictions_and_slides(tmp_path):
    pred = tmp_path / "pred"
    pred.mkdir()
    for name in ("s1_detections.csv", "s1_patches.csv", "s1_probs.json", "s1_heatmap.png", "s2.csv",
                 "other.csv", "scores.csv"):
        (pred / name).write_text("")
    found = find_predictions(pred, known_stems={"s1", "s2"})
    assert sorted(found) == ["s1", "s2"]  # other.csv is no labelled slide; scores.csv is not a slide
    assert found["s1"].patches.name == "s1_patches.csv" and found["s1"].heatmap_png.name == "s1_heatmap.png"
    assert found["s2"].detections.name == "s2.csv" and found["s2"].patches is None
    slides = tmp_path / "slides"
    slides.mkdir()
    for name in ("s1.tif", "s2.SVS", "notes.txt"):
        (slides / name).write_text("")
    assert resolve_slides(slides) == {"s1": slides / "s1.tif", "s2": slides / "s2.SVS"}
    listing = tmp_path / "list.csv"
    listing.write_text("slide,path\nx,slides/s1.tif\n")
    assert resolve_slides(listing) == {"s1": tmp_path / "slides" / "s1.tif", "x": tmp_path / "slides" / "s1.tif"}
    listing.write_text("name\nx\n")
    with pytest.raises(ConfigError, match="no 'slide' or 'path' column"):
        resolve_slides(listing)
