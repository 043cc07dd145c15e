"""The report's per-slide images (review AP, findings 3 and 7), measured in headless Chromium: the heatmap
overlay is legible on a click, and the FROC view stands beside it with its legend above the gallery."""

from __future__ import annotations

import html
import io
import re
import shutil

import pytest
from PIL import Image

from report_probe import embedded_pngs, probe
from wsi_milssl.evaluation import evaluate_predictions
from wsi_milssl.evaluation.plots import MATCH_VIEW_LEGEND

OVERLAY_PX = 2048  # the heatmap stage's default overlay size (--thumbnail-px 2048)

CLICK_TWICE = """var zoom = document.querySelector('label.zoom'), img = zoom.querySelector('img');
out.shown = img.getBoundingClientRect().width;
zoom.click(); out.enlarged = img.getBoundingClientRect().width;
zoom.click(); out.again = img.getBoundingClientRect().width;"""

TUMOUR_CARD = """out.card = [].map.call(document.querySelector('.card').querySelectorAll('img'), function (i) {
  var r = i.getBoundingClientRect(); return {alt: i.alt, left: r.left, right: r.right, top: r.top}; });"""


@pytest.fixture(scope="module")
def full_size_run(synth_dir, annotations_dir, predictions, tmp_path_factory):
    """The evaluation of a predictions folder whose heatmap overlays are 2048 px, as the heatmap stage draws
    them by default (the fixture's 256-px overlays, enlarged), with the default --thumbnail-px 320."""
    pred_dir, info = predictions
    work = tmp_path_factory.mktemp("full_size")
    pred = work / "pred"
    shutil.copytree(pred_dir, pred)
    for png in pred.glob("*_heatmap.png"):
        with Image.open(png) as img:
            img.resize((OVERLAY_PX, OVERLAY_PX), Image.Resampling.NEAREST).save(png)
    out = work / "eval"
    evaluate_predictions(pred, labels_csv=synth_dir / "labels.csv", out_dir=out, annotations_dir=annotations_dir,
                         slides=synth_dir)
    return out / "report.html", info


def test_heatmaps_are_shown_at_the_thumbnail_size_and_open_larger_on_a_click(full_size_run, tmp_path):
    """Finding 3: the 2048-px overlay shrunk to 320 px made its colour-bar ticks, title and scale bar ~2 px
    tall. It is now embedded at 800 px (a 256-colour palette PNG), shown at 320 and opened at 800 by a click
    (a second click shrinks it); the page still has no script."""
    report, info = full_size_run
    page = report.read_text(encoding="utf-8")
    assert "<script" not in page
    images = embedded_pngs(page)
    for stem in (info["tumor"], info["normal"]):
        with Image.open(io.BytesIO(images[f"{stem} heatmap"])) as img:
            assert max(img.size) == 800 and img.mode == "P"
    shown = re.findall(r'<label class="zoom"[^>]*><input type="checkbox"><img [^>]*width="(\d+)" height="(\d+)"', page)
    assert shown == [("320", "320")] * 2
    assert page.count("heatmap (click to enlarge)") == 2
    measured = probe(report, tmp_path, CLICK_TWICE)
    assert (measured["shown"], measured["enlarged"], measured["again"]) == (320, 800, 320)


def test_the_froc_view_stands_beside_the_heatmap_with_its_legend_above_the_gallery(full_size_run, tmp_path):
    """Finding 7: the FROC view's caption was the whole 90-character legend, which pushed it below the
    heatmap; its caption is now "FROC view" and the legend one line above the gallery."""
    report, info = full_size_run
    page = report.read_text(encoding="utf-8")
    assert "<figcaption>FROC view</figcaption>" in page
    assert page.count(html.escape(MATCH_VIEW_LEGEND)) == 1
    legend_at = page.index(html.escape(MATCH_VIEW_LEGEND))
    assert page.index("<h2>Heatmaps</h2>") < legend_at < page.index('<div class="gallery">')
    assert "axes in level-0 pixels" in page[legend_at - 200:legend_at]
    heatmap, view = probe(report, tmp_path, TUMOUR_CARD)["card"]
    assert heatmap["alt"] == f"{info['tumor']} heatmap" and view["alt"] == f"{info['tumor']} FROC view"
    assert view["top"] == heatmap["top"] and view["left"] > heatmap["right"]  # beside it, on the same row
