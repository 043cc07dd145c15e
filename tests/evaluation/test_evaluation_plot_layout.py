"""What the evaluation's images show and where their text lands (review AP, findings 1, 2, 4): measured on the
matplotlib figures (every drawn text inside the figure, axis labels, colour-bar range) and on the PNGs
(size), not on pixel snapshots."""

from __future__ import annotations

import io
import json
import warnings

import numpy as np
import pytest
from PIL import Image

from figure_text import drawn_texts, texts_outside
from wsi_milssl.evaluation import evaluate_predictions, evaluation_mask, match_detections
from wsi_milssl.evaluation.plots import (
    VIEW_MIN_TEXT_PX,
    froc_figure,
    froc_png,
    match_view_figure,
    match_view_png,
    probability_map_figure,
    probability_map_png,
)

SIZES_PX = (32, 64, 128, 200, VIEW_MIN_TEXT_PX, 320, 640)


def _png_size(png: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(png)) as img:
        return img.size


def _no_warnings(draw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = draw()
    assert [str(w.message) for w in caught] == []
    return out


@pytest.fixture(scope="module")
def groups_run(synth_dir, annotations_dir, predictions, tmp_path_factory):
    """An evaluation with annotation groups that are not the challenge's (QuPath-style names beside the
    known annotation's _0): its FROC protocol names them, 150 characters."""
    from wsi_milssl.config import EvaluateConfig

    pred_dir, _ = predictions
    out = tmp_path_factory.mktemp("groups")
    config = EvaluateConfig(tumor_groups=("_0", "Tumor", "Metastasis", "Carcinoma in situ"),
                            non_tumor_groups=("Exclusion", "Necrosis", "Other"))
    return evaluate_predictions(pred_dir, labels_csv=synth_dir / "labels.csv", out_dir=out,
                                annotations_dir=annotations_dir, slides=synth_dir, config=config), out


def test_froc_protocol_subtitle_is_wrapped_inside_the_figure(groups_run):
    """Finding 1: the protocol under the title was one line, cut at both sides once it named the groups."""
    result, out = groups_run
    protocol = json.loads((out / "metrics.json").read_text())["froc_protocol"]
    assert len(protocol) > 100 and "tumour groups _0, Tumor" in protocol
    m = result.metrics
    fig = _no_warnings(lambda: froc_figure(result.curve, score=m["froc"], sensitivities=m["froc_sensitivities"],
                                           protocol=protocol))
    assert texts_outside(fig) == []
    title = fig.axes[0].title.get_text()
    assert " ".join(title.split("\n")[1:]) == protocol  # the whole protocol, in lines
    assert len(title.split("\n")) >= 3
    # the PNG the stage wrote is that figure
    assert _png_size((out / "froc.png").read_bytes()) == _png_size(froc_png(
        result.curve, score=m["froc"], sensitivities=m["froc_sensitivities"], protocol=protocol))
    # the challenge's protocol stays one line, and the figure its size
    short = froc_figure(result.curve, score=m["froc"], protocol="CAMELYON16")
    assert short.axes[0].title.get_text().count("\n") == 1 and tuple(short.get_size_inches()) == (5.5, 4.2)
    assert texts_outside(short) == []


def test_froc_title_counts_in_the_singular(evaluated):
    """Finding 9: "(1 lesions, 1 slides)"."""
    from dataclasses import replace

    def title(n_slides, n_lesions):
        curve = replace(evaluated[0].curve, n_slides=n_slides, n_lesions=n_lesions)
        return froc_figure(curve, score=0.5).axes[0].get_title()

    assert "(1 lesion, 1 slide)" in title(1, 1) and "(2 lesions, 3 slides)" in title(3, 2)


def _tumour_match(evaluated):
    result, _, _ = evaluated
    (match,) = [r.match for r in result.slides if r.match.mask is not None]
    return match


@pytest.mark.parametrize("size_px", SIZES_PX)
def test_match_view_follows_the_thumbnail_size_with_its_text_inside(evaluated, size_px):
    """Finding 2: the view was max_size_px wide but 200-690 px tall whatever the slide, its text cut at 64-128 px
    and 'Tight layout not applied' at 32; its axes did not say they are level-0 pixels."""
    match = _tumour_match(evaluated)
    png = _no_warnings(lambda: match_view_png(match, max_size_px=size_px))
    width, height = _png_size(png)
    assert max(width, height) == size_px and min(width, height) >= 0.9 * size_px  # a square slide
    fig, dpi = match_view_figure(match, max_size_px=size_px)
    assert texts_outside(fig, dpi=dpi) == []
    ax = fig.axes[0]
    if size_px >= VIEW_MIN_TEXT_PX:
        assert "level-0 px" in ax.get_xlabel() and "level-0 px" in ax.get_ylabel()
        assert "lesion" in ax.get_title()
        heights = [ext.height for _, _, ext in drawn_texts(fig, dpi=dpi)]
        assert min(heights) >= 6  # legible: at least 6 px tall
    else:  # too small for legible text: the regions and detections alone
        assert drawn_texts(fig, dpi=dpi) == []


def _shaped_match(rows: int, cols: int):
    """A slide of rows x cols level-5 pixels (0.25 µm/px, so 8 µm each) with a lesion near the top left and a
    detection on it, one false positive and one ITC."""
    tumour = np.zeros((rows, cols), bool)
    tumour[20:50, 20:50] = True
    tumour[rows - 20:rows - 14, cols - 20:cols - 14] = True  # 48 µm across: an ITC
    mask = evaluation_mask(tumour, mpp=0.25)
    return match_detections(np.array([0.9, 0.7, 0.2]), np.array([35 * 32.0, (cols - 17) * 32.0, 5 * 32.0]),
                            np.array([35 * 32.0, (rows - 17) * 32.0, (rows - 5) * 32.0]), mask=mask)


@pytest.mark.parametrize(("rows", "cols"), [(400, 90), (90, 400), (600, 600)])
def test_match_view_keeps_the_slides_aspect_and_fills_its_longer_side(rows, cols):
    """A tall slide's view was max_size_px wide and about 4.5 times as tall, mostly white; now the picture of
    the slide runs along the view's longer side (at least 75 % of it), the view is max_size_px on that side,
    and its tick labels stay apart."""
    match = _shaped_match(rows, cols)
    fig, dpi = match_view_figure(match, max_size_px=320)
    width, height = _png_size(match_view_png(match, max_size_px=320))
    assert max(width, height) == 320
    assert (height >= width) == (rows >= cols)
    box = fig.axes[0].get_position()  # fractions of the figure
    assert (box.height if rows >= cols else box.width) >= 0.75
    assert box.height / box.width * height / width == pytest.approx(rows / cols, rel=0.03)  # the slide's aspect
    assert texts_outside(fig, dpi=dpi) == []
    texts = drawn_texts(fig, dpi=dpi)
    for axis in (fig.axes[0].xaxis, fig.axes[0].yaxis):
        labels = [ext for _, t, ext in texts if t in [tick.label1 for tick in axis.get_major_ticks()]]
        assert len(labels) >= 2
        assert not any(a.overlaps(b) for i, a in enumerate(labels) for b in labels[i + 1:])


@pytest.mark.parametrize("size_px", SIZES_PX)
def test_probability_map_has_a_colour_bar_from_0_to_1(predictions, size_px):
    """Finding 4: the map drawn when a predictions folder has <stem>_probs.npy but no _heatmap.png had no
    colour scale."""
    pred_dir, _ = predictions
    (probs_path,) = sorted(pred_dir.glob("*_probs.npy"))[:1]
    probs = np.load(probs_path).astype(np.float64)
    probs[0, 0] = np.nan  # no patch there: white
    png = _no_warnings(lambda: probability_map_png(probs, max_size_px=size_px))
    assert max(_png_size(png)) == size_px
    fig, dpi = probability_map_figure(probs, max_size_px=size_px)
    assert texts_outside(fig, dpi=dpi) == []
    bars = [ax for ax in fig.axes if ax.get_label() == "colour bar"]
    assert len(bars) == 1
    assert bars[0].get_ylim() == pytest.approx((0.0, 1.0))
    if size_px >= VIEW_MIN_TEXT_PX:
        assert bars[0].get_ylabel() == "P(tumour)"
        bar_labels = [label for tick in bars[0].yaxis.get_major_ticks() for label in (tick.label1, tick.label2)]
        ticks = {text for text, t, _ in drawn_texts(fig, dpi=dpi) if any(t is label for label in bar_labels)}
        assert {"0.00", "1.00"} <= ticks
