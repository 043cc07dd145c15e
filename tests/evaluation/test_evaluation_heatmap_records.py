"""``evaluate`` takes each slide's score and µm/px from its ``<stem>_probs.json``, the record the heatmap stage
writes after every other file of the slide (review findings: a ``heatmap --overwrite`` killed after a slide's
files left the previous model's ``scores.csv`` rows, and the bag AUC came from them while the FROC came from the
new files; slides cut with ``heatmap --slide-mpp 0.25`` were measured at the slide's metadata µm/px)."""

from __future__ import annotations

import csv
import json
import logging
import shutil
from pathlib import Path

import pytest

from wsi_milssl.config import EvaluateConfig
from wsi_milssl.errors import EvaluationError
from wsi_milssl.evaluation import evaluate_predictions


def _copy(predictions, tmp_path: Path, **per_slide: dict) -> Path:
    """A copy of the prediction folder whose sidecars get ``per_slide[which]`` ('tumor', 'normal') added."""
    pred_dir, info = predictions
    copy = tmp_path / "preds"
    shutil.copytree(pred_dir, copy)
    for which, change in per_slide.items():
        path = copy / f"{info[which]}_probs.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    return copy


def _evaluate(pred_dir: Path, synth_dir: Path, annotations_dir: Path, out: Path, **config):
    return evaluate_predictions(pred_dir, labels_csv=synth_dir / "labels.csv", out_dir=out,
                                annotations_dir=annotations_dir, slides=synth_dir, config=EvaluateConfig(**config))


def _per_slide(out: Path) -> dict[str, dict]:
    with open(out / "per_slide.csv", newline="") as fh:
        return {r["slide"]: r for r in csv.DictReader(fh)}


def test_scores_come_from_the_sidecars_not_stale_scores_csv_rows(synth_dir, annotations_dir, predictions, tmp_path,
                                                                  caplog):
    """scores.csv holds an earlier run's rows (tumour 0.9, normal 0.2: bag AUC 1); the sidecars, written with
    the evaluated files, record 0.3 and 0.6 (bag AUC 0). The FROC and the bag AUC are of the same files."""
    _, info = predictions
    run = {"fingerprint": "2222222222222222", "checkpoint_sha256": "b" * 64}
    copy = _copy(predictions, tmp_path, tumor={**run, "score": 0.3}, normal={**run, "score": 0.6})
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.evaluation.stage"):
        result = _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out")
    assert result.metrics["bag_auc"] == 0.0
    rows = _per_slide(tmp_path / "out")
    assert float(rows[info["tumor"]]["score"]) == 0.3 and float(rows[info["normal"]]["score"]) == 0.6
    assert result.metrics["froc"] == pytest.approx(5 / 6)  # the detections, as before
    stale = ", ".join(sorted([info["tumor"], info["normal"]]))
    assert f"its rows of slides {stale} are not the scores their <stem>_probs.json record" in caplog.text
    assert "Fix: run the heatmap stage again" in caplog.text
    html = (tmp_path / "out" / "report.html").read_text()
    assert f"scores.csv holds other scores than the sidecars of slides {stale}" in html


def test_sidecar_scores_need_no_scores_csv(synth_dir, annotations_dir, predictions, tmp_path):
    copy = _copy(predictions, tmp_path, tumor={"score": 0.8}, normal={"score": 0.1})
    (copy / "scores.csv").unlink()
    result = _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out")
    assert result.metrics["bag_auc"] == 1.0 and "bag_auc" not in result.metrics["reasons"]


def test_a_slide_whose_sidecar_records_no_score_takes_its_scores_csv_row(synth_dir, annotations_dir, predictions,
                                                                         tmp_path, caplog):
    """Sidecars of earlier versions and other tools' folders: scores.csv as before, and no warning when a
    sidecar's score agrees with its row (6 decimals)."""
    _, info = predictions
    copy = _copy(predictions, tmp_path, normal={"score": 0.2000004})
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.evaluation.stage"):
        result = _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out")
    assert result.metrics["bag_auc"] == 1.0
    assert float(_per_slide(tmp_path / "out")[info["tumor"]]["score"]) == 0.9
    assert "not the scores" not in caplog.text


def test_a_sidecar_score_that_is_no_number_is_refused(synth_dir, annotations_dir, predictions, tmp_path):
    _, info = predictions
    copy = _copy(predictions, tmp_path, tumor={"score": "high"})
    with pytest.raises(EvaluationError, match=rf"{info['tumor']}_probs.json: 'score' is 'high'; .* Fix: run the "
                                              "heatmap stage again for this slide"):
        _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out")


def test_slides_are_measured_at_the_mpp_their_heatmaps_were_made_with(synth_dir, annotations_dir, predictions,
                                                                      tmp_path):
    """`heatmap --slide-mpp 1.0` on slides whose metadata says 0.25: the sidecars record mpp 1.0, and the
    tumour slide's ITC disc (280 px: 280 µm at 1.0, 70 µm at 0.25) is a second lesion (see
    test_evaluation_stage.test_slides_given_as_csv_and_mpp_override); every slide's per_slide.csv mpp is 1.0."""
    _, info = predictions
    at_1 = {"mpp": 1.0, "slide_mpp": 1.0}
    copy = _copy(predictions, tmp_path, tumor=at_1, normal=at_1)
    result = _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out")
    assert result.metrics["n_lesions"] == 2 and result.metrics["n_itc"] == 0
    assert result.metrics["froc"] == pytest.approx(11 / 12, abs=1e-12)
    assert {s: float(r["mpp"]) for s, r in _per_slide(tmp_path / "out").items()} == {info["tumor"]: 1.0,
                                                                                     info["normal"]: 1.0}
    # --slide-mpp that agrees with the sidecars (within 0.1 %) changes nothing
    same = _evaluate(copy, synth_dir, annotations_dir, tmp_path / "same", mpp=1.0004)
    assert same.metrics["n_lesions"] == 2 and same.metrics["froc"] == result.metrics["froc"]


def test_an_mpp_that_contradicts_the_sidecars_is_refused(synth_dir, annotations_dir, predictions, tmp_path):
    """The heatmaps were made at 0.25 µm/px (the fixture's sidecars): --slide-mpp 1.0 would measure the
    lesions at another scale than the detections."""
    pred_dir, info = predictions
    with pytest.raises(EvaluationError) as exc:
        _evaluate(pred_dir, synth_dir, annotations_dir, tmp_path / "out", mpp=1.0)
    message = str(exc.value)
    slides = ", ".join(f"{s} (0.25)" for s in sorted([info["tumor"], info["normal"]]))
    assert f"--slide-mpp 1 (in a pipeline, [evaluate] mpp) is not the µm/px the heatmaps of slides {slides} were " \
           "made with" in message
    assert "Fix: drop --slide-mpp (evaluate uses the µm/px each heatmap was made with), or run the heatmap stage " \
           "again with --slide-mpp 1 --overwrite." in message
    assert not (tmp_path / "out" / "metrics.json").exists()


def test_detection_csvs_without_sidecars_take_the_given_mpp(synth_dir, known_annotation, annotations_dir, tmp_path):
    """Other tools' folders (no sidecar) are measured at --slide-mpp as before."""
    from evaluation_fixtures import write_predictions

    pred = tmp_path / "pred"
    write_predictions(synth_dir, known_annotation, pred, with_patches=False)
    result = _evaluate(pred, synth_dir, annotations_dir, tmp_path / "out", mpp=1.0)
    assert result.metrics["n_lesions"] == 2 and all(s.mpp == 1.0 for s in result.slides if s.label == 1)
