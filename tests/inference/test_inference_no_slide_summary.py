"""Review AU, finding 4: heatmaps without slide files (feature files without slides, stores that record no
slide) warned once per slide that its overlay PNG was not drawn: 400 lines for 400 slides, burying real
warnings. A run that passes ``no_slide`` to :func:`write_slide_outputs` collects those slides (debug line per
slide) and says it once at the end (:func:`log_overlays_not_drawn`: how many, why, the fix); a slide file named
but not there is still warned about per slide."""

from __future__ import annotations

import logging

import pytest

from wsi_milssl.config import HeatmapConfig
from wsi_milssl.inference import load_inference_model, predict_slide, write_slide_outputs
from wsi_milssl.inference.stage import log_overlays_not_drawn

CONFIG = HeatmapConfig(thumbnail_px=128, batch_size=64, num_workers=0)


@pytest.fixture
def predicted(tumour_slide, checkpoint_factory):
    model = load_inference_model(checkpoint_factory(), config=CONFIG)
    return model, predict_slide(tumour_slide, model, config=CONFIG)


def _overlay_lines(caplog, level):
    return [r.getMessage() for r in caplog.records if r.levelno == level and "not drawn" in r.getMessage()]


def test_a_slide_without_a_slide_file_is_collected_for_one_summary(tmp_path, predicted, caplog):
    model, pred = predicted
    pred.slide_path = None
    no_slide: list[str] = []
    with caplog.at_level(logging.DEBUG, logger="wsi_milssl.inference.stage"):
        written = write_slide_outputs(pred, tmp_path / "hm", model=model, config=CONFIG, no_slide=no_slide)
    assert "heatmap_png" not in written and written["probs_npy"].is_file()
    assert no_slide == ["tumour"]
    assert not _overlay_lines(caplog, logging.WARNING)
    assert _overlay_lines(caplog, logging.DEBUG) == ["tumour: no slide file; tumour_heatmap.png not drawn."]


def test_without_no_slide_the_per_slide_warning_stays(tmp_path, predicted, caplog):
    model, pred = predicted
    pred.slide_path = None
    with caplog.at_level(logging.WARNING):
        write_slide_outputs(pred, tmp_path / "hm", model=model, config=CONFIG)
    assert _overlay_lines(caplog, logging.WARNING) == ["tumour: slide file not available; tumour_heatmap.png not drawn."]


def test_a_named_slide_file_that_is_not_there_is_warned_about_per_slide(tmp_path, predicted, caplog):
    model, pred = predicted
    pred.slide_path = tmp_path / "gone" / "tumour.tif"
    no_slide: list[str] = []
    with caplog.at_level(logging.WARNING):
        written = write_slide_outputs(pred, tmp_path / "hm", model=model, config=CONFIG, no_slide=no_slide)
    assert "heatmap_png" not in written and no_slide == []
    assert _overlay_lines(caplog, logging.WARNING) == [
        f"tumour: slide file {pred.slide_path} not found; tumour_heatmap.png not drawn. Fix: pass the slide file (a "
        "SLIDE argument of `wsi-milssl heatmap`) to draw it."]


def test_the_summary_is_one_line_with_the_count_the_reason_and_the_fix(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        log_overlays_not_drawn([], tmp_path)
        assert not caplog.records
        log_overlays_not_drawn([f"s{i}" for i in range(7, 0, -1)], tmp_path / "hm")
    assert len(caplog.records) == 1
    line = caplog.records[0].getMessage()
    assert line.startswith(f"7 slide(s) have no overlay PNG (<slide>_heatmap.png) in {tmp_path / 'hm'}: no slide file "
                           "was given or found for them (s1, s2, s3, s4, s5 and 2 more)")
    assert "Fix: to draw the overlays, pass the slide files" in line
