"""Review BG: ``evaluate`` checked once, at its start, that no heatmap run was writing the predictions folder; a
``heatmap --overwrite`` started after that rewrote slides while they were read, and the report mixed two models'
predictions while it named the first (exit 0). Files that change while they are read now stop the evaluation
before it writes anything."""

from __future__ import annotations

import re
import shutil

import pytest

from wsi_milssl.config import EvaluateConfig
from wsi_milssl.errors import EvaluationError
from wsi_milssl.evaluation import evaluate_predictions


def test_predictions_rewritten_during_evaluate_stop_it_before_any_output(predictions, synth_dir, annotations_dir,
                                                                          tmp_path):
    folder = shutil.copytree(predictions[0], tmp_path / "predictions")
    detections = sorted(folder.glob("*_detections.csv"))
    assert len(detections) == 2

    def heatmap_run_meanwhile(event):  # after the first slide: another run rewrites the files
        if event.stage == "evaluate" and event.done == 1:
            for path in detections:
                lines = path.read_text().splitlines()
                path.write_text("\n".join([*lines, lines[-1]]) + "\n")

    with pytest.raises(EvaluationError, match=(
            rf"^{re.escape(str(folder))}: 2 of its files changed while evaluate read them \(.*_detections\.csv, "
            r".*_detections\.csv\), so the evaluation would mix the predictions of two heatmap runs\. Nothing was "
            r"written\. Fix: wait")):
        evaluate_predictions(folder, labels_csv=synth_dir / "labels.csv", out_dir=tmp_path / "out",
                             annotations_dir=annotations_dir, slides=synth_dir,
                             config=EvaluateConfig(thumbnail_px=64), progress=heatmap_run_meanwhile)
    assert not (tmp_path / "out" / "metrics.json").exists()
    result = evaluate_predictions(folder, labels_csv=synth_dir / "labels.csv", out_dir=tmp_path / "out",
                                  annotations_dir=annotations_dir, slides=synth_dir,
                                  config=EvaluateConfig(thumbnail_px=64))  # the folder as it is now
    assert result.metrics["n_slides"] == 2 and (tmp_path / "out" / "metrics.json").is_file()


def test_heatmaps_rewritten_while_the_report_reads_them_stop_it(predictions, synth_dir, annotations_dir, tmp_path,
                                                                monkeypatch):
    """Review BI: the report's heatmap overlays were read after the check, so a heatmap run in that window (the
    longest one at CAMELYON16 scale) put another model's maps beside these metrics (exit 0)."""
    from PIL import Image

    import wsi_milssl.evaluation.stage as stage

    folder = shutil.copytree(predictions[0], tmp_path / "predictions")
    overlays = sorted(folder.glob("*_heatmap.png"))
    assert overlays
    read = stage._thumbnails

    def other_model_meanwhile(r, *, max_px):
        for png in overlays:
            Image.new("RGB", (64, 64), (0, 255, 0)).save(png)
        return read(r, max_px=max_px)

    monkeypatch.setattr(stage, "_thumbnails", other_model_meanwhile)
    with pytest.raises(EvaluationError, match=rf"^{re.escape(str(folder))}: {len(overlays)} of its files changed "
                                              r"while evaluate read"):
        evaluate_predictions(folder, labels_csv=synth_dir / "labels.csv", out_dir=tmp_path / "out",
                             annotations_dir=annotations_dir, slides=synth_dir, config=EvaluateConfig(thumbnail_px=64))
    assert not (tmp_path / "out" / "metrics.json").exists()
