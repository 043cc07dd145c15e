"""Detection files: a header row is skipped, a file that is not UTF-8 is one clear error, and
detections off a tumour slide are reported as those off a normal slide are (review findings)."""

from __future__ import annotations

import logging
import re
import shutil

import numpy as np
import pytest

from wsi_milssl.cli import main
from wsi_milssl.errors import EvaluationError
from wsi_milssl.evaluation import read_detections
from wsi_milssl.evaluation.froc import evaluation_mask, match_detections


@pytest.mark.parametrize("header", ["prob,x,y", "Confidence,X coordinate,Y coordinate", "\ufeffprob, x, y"])
def test_a_header_row_is_skipped(tmp_path, header):
    p = tmp_path / "s_detections.csv"
    p.write_text(f"\n{header}\n0.9,100,200\n0.25,3.5,7\n", encoding="utf-8")
    d = read_detections(p)
    assert d.probs.tolist() == [0.9, 0.25] and d.x_lv0.tolist() == [100, 3.5] and d.y_lv0.tolist() == [200, 7]


def test_a_word_after_the_first_row_is_still_an_error(tmp_path):
    p = tmp_path / "s_detections.csv"
    p.write_text("0.9,100,200\nprob,x,y\n")
    with pytest.raises(EvaluationError, match=r"line 2: prob 'prob' is not a number"):
        read_detections(p)
    p.write_text("0.9,abc,200\n")  # a first row with a number is data, not a header
    with pytest.raises(EvaluationError, match=r"line 1: x 'abc' is not a number"):
        read_detections(p)


def test_a_file_that_is_not_utf8_is_one_error_naming_it(tmp_path):
    p = tmp_path / "s_detections.csv"
    p.write_bytes(b"0.9,100,200\n0.5,\xff\xfe,3\n")
    with pytest.raises(EvaluationError, match=rf"^{re.escape(str(p))}: not UTF-8 text \(byte 16\); a detections "
                                              r"file is text lines 'prob,x,y'\. Fix: save it as UTF-8"):
        read_detections(p)


def test_evaluate_cli_reports_a_non_utf8_detections_file_in_one_line(tmp_path, capsys):
    preds = tmp_path / "preds"
    preds.mkdir()
    (preds / "n1_detections.csv").write_bytes(b"\x80\x81\x82,1,2\n")
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\nn1,0\n")
    (tmp_path / "annotations").mkdir()
    (tmp_path / "slides").mkdir()
    code = main(["evaluate", "--predictions", str(preds), "--labels", str(labels), "--out", str(tmp_path / "out"),
                 "--annotations", str(tmp_path / "annotations"), "--slides", str(tmp_path / "slides")])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err and err.count("error: ") == 1, err
    assert "n1_detections.csv: not UTF-8 text (byte 0)" in err


def test_detections_off_a_tumour_slide_that_the_mask_still_covers_are_reported(caplog):
    """A 2040 x 2040 px slide has a 64 x 64 level-5 mask reaching 2048 px: a detection at x = 2044 lay
    inside the mask, silently scored (here as a hit on the lesion there)."""
    mask = evaluation_mask(np.ones((64, 64), dtype=bool), mpp=0.25)
    probs, xs, ys = np.array([0.9, 0.5]), np.array([2044.0, 100.0]), np.array([10.0, 100.0])
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.evaluation.froc"):
        m = match_detections(probs, xs, ys, mask=mask, stem="T1", dimensions_lv0=(2040, 2040))
    assert list(m.outcome) == ["fp", "tp"] and m.n_outside_mask == 1 and m.hit_label[0] == 0
    assert ("T1: 1 detection(s) lie outside the slide (2040 x 2040 level-0 px); counted as false positives. Check "
            "that the x, y of the detections are level-0 pixels.") in caplog.text


def test_evaluate_reports_detections_off_a_tumour_slide(synth_dir, annotations_dir, predictions, tmp_path, caplog):
    from wsi_milssl.evaluation import evaluate_predictions

    pred_dir, info = predictions
    copy = tmp_path / "preds"
    shutil.copytree(pred_dir, copy)
    with open(copy / f"{info['tumor']}_detections.csv", "a") as fh:
        fh.write("0.99,5000,10\n")
    with caplog.at_level("WARNING", logger="wsi_milssl.evaluation.froc"):
        evaluate_predictions(copy, labels_csv=synth_dir / "labels.csv", out_dir=tmp_path / "out",
                             annotations_dir=annotations_dir, slides=synth_dir)
    assert any(f"{info['tumor']}: 1 detection(s) lie outside the slide (4096 x 4096 level-0 px)" in r.getMessage()
               for r in caplog.records), caplog.text


def test_plain_csvs_of_unlabelled_slides_are_named_not_dropped_silently(synth_dir, annotations_dir, known_annotation,
                                                                         tmp_path, caplog, capsys):
    """A plain <stem>.csv counts as detections only for a labelled slide (any CSV could be named so);
    one of an unlabelled slide changed the FROC without a word (its false positives and its slide left
    out of the FP-per-slide divisor). It is still not evaluated, but a warning, metrics.json
    (``not_evaluated_files``), the report and the command's summary name it."""
    import json

    from evaluation_fixtures import write_predictions

    pred = tmp_path / "pred"
    info = write_predictions(synth_dir, known_annotation, pred, with_patches=False, with_scores=False)
    for stem in (info["tumor"], info["normal"]):
        (pred / f"{stem}_detections.csv").rename(pred / f"{stem}.csv")
    (pred / "synth_009.csv").write_text("0.99,100,100\n0.98,200,200\n")
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING):
        rc = main(["evaluate", "--predictions", str(pred), "--annotations", str(annotations_dir), "--slides",
                   str(synth_dir), "--labels", str(synth_dir / "labels.csv"), "--out", str(out)])
    assert rc == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["n_slides"] == 2 and metrics["not_evaluated_files"] == ["synth_009.csv"]
    assert "synth_009.csv" in caplog.text and "labels CSV" in caplog.text
    assert "synth_009.csv" in (out / "report.html").read_text()
    assert "synth_009.csv" in capsys.readouterr().out


def test_a_plain_csv_beside_its_slide_s_detections_file_is_named(synth_dir, annotations_dir, known_annotation,
                                                                  tmp_path, caplog, capsys):
    """A labelled slide's plain <stem>.csv beside its <stem>_detections.csv was left out without a word (not in
    the warning, not_evaluated_files or the report, review AJ): they now name it and the file used instead."""
    import json

    from evaluation_fixtures import write_predictions

    pred = tmp_path / "pred"
    info = write_predictions(synth_dir, known_annotation, pred, with_patches=False, with_scores=False)
    tumour = info["tumor"]
    (pred / f"{tumour}.csv").write_text("0.99,100,100\n")
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING):
        rc = main(["evaluate", "--predictions", str(pred), "--annotations", str(annotations_dir), "--slides",
                   str(synth_dir), "--labels", str(synth_dir / "labels.csv"), "--out", str(out)])
    assert rc == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["n_slides"] == 2 and metrics["not_evaluated_files"] == [f"{tumour}.csv"]
    assert f"{tumour}.csv ({tumour}_detections.csv is evaluated instead)" in caplog.text
    report = (out / "report.html").read_text()
    assert f"{tumour}.csv ({tumour}_detections.csv is evaluated instead)" in report
    assert "match no labelled slide" not in report
    printed = capsys.readouterr().out
    assert f"1 CSV files (of no labelled slide, or beside a slide's _detections.csv): {tumour}.csv" in printed


def test_hidden_files_in_the_predictions_folder_are_not_slides(synth_dir, annotations_dir, known_annotation,
                                                               predictions, tmp_path):
    """A folder copied from a Mac holds '._<name>' files: '._X_detections.csv' stopped the evaluation ('no label
    for 1 predicted slide(s): ._X'), '._X_probs.json' / '._X_patches.csv' refused it, hidden plain CSVs were
    listed as not-evaluated files (review AJ). They are left out: the evaluation is the folder's without them."""
    from wsi_milssl.evaluation import evaluate_predictions

    pred_dir, info = predictions
    copy = tmp_path / "pred"
    shutil.copytree(pred_dir, copy)
    for p in sorted(copy.iterdir()):
        (copy / f"._{p.name}").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    (copy / f"._{info['tumor']}.csv").write_text("0.99,100,100\n")
    (copy / ".hidden.csv").write_text("0.99,100,100\n")
    result = evaluate_predictions(copy, labels_csv=synth_dir / "labels.csv", out_dir=tmp_path / "out",
                                  annotations_dir=annotations_dir, slides=synth_dir)
    plain = evaluate_predictions(pred_dir, labels_csv=synth_dir / "labels.csv", out_dir=tmp_path / "plain",
                                 annotations_dir=annotations_dir, slides=synth_dir)
    assert result.metrics["not_evaluated_files"] == []
    assert {k: v for k, v in result.metrics.items() if k != "not_evaluated_files"} == {
        k: v for k, v in plain.metrics.items() if k != "not_evaluated_files"}
