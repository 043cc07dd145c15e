"""PNG plots of the evaluation (FROC, ROC, per-slide views), drawn with matplotlib's Agg canvas.

Every ``*_png`` function returns PNG bytes and every ``*_figure`` function the matplotlib Figure it draws;
nothing touches pyplot's global state, so plotting is safe in threads and never opens a window.

The per-slide views (:func:`match_view_png`, :func:`probability_map_png`) are ``max_size_px`` pixels on their
longer side and keep the slide's aspect: from :data:`VIEW_MIN_TEXT_PX` on they carry their text (title, axes,
colour-bar labels) inside the image, at least 6 px tall (8 px from 320 px on); smaller views are the picture alone.
"""

from __future__ import annotations

import io
import textwrap
from typing import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator
from PIL import Image

from wsi_milssl.evaluation.froc import FP_RATES, FrocCurve, SlideMatch
from wsi_milssl.evaluation.metrics import RocCurve, counted
from wsi_milssl.figures import png_bytes

__all__ = ["MATCH_VIEW_LEGEND", "VIEW_MIN_TEXT_PX", "froc_figure", "froc_png", "roc_png", "thumbnail_png",
           "probability_map_figure", "probability_map_png", "match_view_figure", "match_view_png"]

# drawn in this order, so a lesion's TP marker sits on top of its repeat hits
_OUTCOME_STYLE = {
    "repeat": ("o", "#91bfdb", "repeat hit (neither TP nor FP)"),
    "itc": ("s", "#e6550d", "hit on ITC (neither TP nor FP)"),
    "fp": ("x", "#2b2bd9", "false positive"),
    "tp": ("o", "#1a9850", "true positive (best hit of a lesion)"),
}
MATCH_VIEW_LEGEND = ("regions: lesion pink, ITC orange; detections: TP green dot, repeat hit light-blue dot, "
                     "ITC hit orange square, FP blue cross")

#: the longer side (px) from which a per-slide view carries text (at least 6 px tall; smaller below it)
VIEW_MIN_TEXT_PX = 240
#: dots per inch of a per-slide view of 320 px or more (7.5-pt text is then about 8 px tall); smaller views with
#: text keep the layout of a 320-px one (4 inches on the longer side) at fewer dots per inch
_VIEW_DPI = 80.0
_VIEW_MIN_LONG_IN = 4.0


def _png(fig: Figure, *, dpi: float = 100) -> bytes:
    return png_bytes(fig, dpi=dpi)


def _wrap(text: str, *, width_in: float, fontsize_pt: float) -> str:
    """``text`` broken into lines that fit ``width_in`` inches at ``fontsize_pt`` (an average glyph of DejaVu
    Sans is about 0.6 em wide; each line of ``text`` is wrapped on its own)."""
    chars = max(8, int(width_in * 72 / (0.62 * fontsize_pt)))
    return "\n".join(textwrap.fill(line, chars, break_on_hyphens=False) if line else line
                     for line in text.split("\n"))


def froc_figure(curve: FrocCurve, *, score: float | None, fp_rates: Sequence[float] = FP_RATES,
                sensitivities: Sequence[float] | None = None, protocol: str | None = None) -> Figure:
    """The matplotlib Figure of :func:`froc_png`."""
    width_in = 5.5
    title = "FROC" if score is None or not np.isfinite(score) else f"FROC score {score:.3f}"
    title = f"{title}  ({counted(curve.n_lesions, 'lesion')}, {counted(curve.n_slides, 'slide')})"
    subtitle = _wrap(protocol, width_in=width_in - 0.3, fontsize_pt=10) if protocol else ""
    # a protocol of more than one line (a long one names its annotation groups) makes the figure taller
    fig = Figure(figsize=(width_in, 4.2 + 0.17 * subtitle.count("\n")))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    x_max = max(max(fp_rates) * 1.06, 1.0)
    fp = np.append(curve.fp_per_slide, max(x_max, float(curve.fp_per_slide[-1])))
    sens = np.append(curve.sensitivity, curve.sensitivity[-1])
    ax.plot(fp, sens, color="#d62728", lw=1.8, label="FROC curve")
    if sensitivities is not None:
        ax.plot(list(fp_rates), list(sensitivities), "o", color="black", ms=4,
                label="sensitivity at 1/4 .. 8 FP/slide")
    ax.set_xlim(0, x_max)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("mean false positives per slide")
    ax.set_ylabel("sensitivity (lesions detected)")
    ax.set_title(f"{title}\n{subtitle}" if subtitle else title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def froc_png(curve: FrocCurve, *, score: float | None, fp_rates: Sequence[float] = FP_RATES,
             sensitivities: Sequence[float] | None = None, protocol: str | None = None) -> bytes:
    """The FROC curve (sensitivity against mean false positives per slide, linear axes up to past the
    largest FP rate), with the operating points at ``fp_rates`` marked; ``protocol`` (its settings, or
    "CAMELYON16") goes under the title, wrapped to the figure's width."""
    return _png(froc_figure(curve, score=score, fp_rates=fp_rates, sensitivities=sensitivities, protocol=protocol))


def roc_png(curve: RocCurve, *, title: str) -> bytes:
    """A ROC curve with its AUC in the title and the chance diagonal."""
    fig = Figure(figsize=(4.6, 4.2))
    ax = fig.add_subplot()
    ax.plot(curve.fpr, curve.tpr, color="#1f77b4", lw=1.8)
    ax.plot([0, 1], [0, 1], ls="--", color="grey", lw=0.8)
    ax.set_xlim(-0.01, 1.01)
    ax.set_ylim(-0.01, 1.01)
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.set_title(f"{title}: AUC {curve.auc:.3f}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def thumbnail_png(image: Image.Image | np.ndarray, *, max_size_px: int, colours: int | None = None) -> bytes:
    """``image`` shrunk (never enlarged) so that its longer side is at most ``max_size_px``, as PNG;
    ``colours`` (2-256) stores it as a palette PNG of that many colours (about half the bytes of a
    stained-tissue overlay at 256)."""
    img = image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image))
    if img.mode not in ("RGB", "RGBA", "L"):
        img = img.convert("RGBA")
    img = img.copy()
    img.thumbnail((max_size_px, max_size_px), Image.Resampling.LANCZOS)
    if colours is not None and img.mode != "L":
        img = img.quantize(colours, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def _view_figure(aspect_hw: float, max_size_px: int, *, text: bool, margins_in: tuple[float, float, float, float],
                 min_size_in: tuple[float, float] = (0.0, 0.0)) -> tuple[Figure, tuple[float, ...], float]:
    """A per-slide view's figure, ``max_size_px`` on its longer side at the dpi returned, and the box of its
    picture (left, bottom, width, height as fractions of the figure) with ``aspect_hw`` = height / width.

    ``margins_in`` = (left, right, bottom, top) inches around the picture for its text (ignored without
    ``text``); ``min_size_in`` = (width, height) the least figure size that holds the text; the picture is
    centred in any room left over."""
    aspect = float(np.clip(aspect_hw, 1 / 50, 50))
    left, right, bottom, top = margins_in if text else (0.0, 0.0, 0.0, 0.0)
    min_w, min_h = min_size_in if text else (0.0, 0.0)
    long_in = max(max_size_px / _VIEW_DPI, _VIEW_MIN_LONG_IN) if text else max_size_px / _VIEW_DPI
    pic_h = long_in - bottom - top  # as tall as the figure allows, unless the picture is then too wide
    pic_w = pic_h / aspect
    if pic_w + left + right > long_in:
        pic_w = long_in - left - right
        pic_h = pic_w * aspect
    width_in = max(pic_w + left + right, min_w)
    height_in = max(pic_h + bottom + top, min_h)
    x0 = left + (width_in - pic_w - left - right) / 2
    y0 = bottom + (height_in - pic_h - bottom - top) / 2
    fig = Figure(figsize=(width_in, height_in))
    FigureCanvasAgg(fig)
    box = (x0 / width_in, y0 / height_in, pic_w / width_in, pic_h / height_in)
    return fig, box, max_size_px / max(width_in, height_in)


def _k(value: float, _pos=None) -> str:
    """A level-0 pixel tick: 8000 -> '8k', 500 -> '500'."""
    return f"{value / 1000:g}k" if abs(value) >= 1000 else f"{value:g}"


def probability_map_figure(probs: np.ndarray, *, max_size_px: int) -> tuple[Figure, float]:
    """The Figure of :func:`probability_map_png` and the dpi that makes it ``max_size_px`` on its longer side."""
    from matplotlib import colormaps

    p = np.ma.masked_invalid(np.asarray(probs, dtype=np.float64))
    if p.ndim != 2 or p.size == 0:
        raise ValueError(f"a probability map must be a non-empty 2-D (rows, cols) array; got shape {p.shape}.")
    text = max_size_px >= VIEW_MIN_TEXT_PX
    aspect = p.shape[0] / p.shape[1]
    if text:  # right of the map: the colour bar (0.14 in), its tick labels and 'P(tumour)'
        fig, box, dpi = _view_figure(aspect, max_size_px, text=True, margins_in=(0.1, 0.8, 0.1, 0.1),
                                     min_size_in=(0.0, 1.6))
        width_in, height_in = fig.get_size_inches()
        bar_box = (box[0] + box[2] + 0.1 / width_in, 0.1 / height_in, 0.14 / width_in, 1 - 0.2 / height_in)
    else:  # the colour bar alone, unlabelled, in a strip an eighth of the map's width
        fig, box, dpi = _view_figure(aspect / 1.125, max_size_px, text=False, margins_in=(0, 0, 0, 0))
        map_w = box[2] / 1.125
        bar_box = (box[0] + map_w * 1.04, box[1], map_w * 0.07, box[3])
        box = (box[0], box[1], map_w, box[3])
    ax = fig.add_axes(box)
    cmap = colormaps["viridis"].with_extremes(bad="white")
    image = ax.imshow(p, cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest", aspect="auto")
    ax.set_axis_off()
    cax = fig.add_axes(bar_box, label="colour bar")
    bar = fig.colorbar(image, cax=cax, ticks=[0.0, 0.25, 0.5, 0.75, 1.0])
    if text:
        bar.ax.tick_params(labelsize=7.5)
        bar.set_label("P(tumour)", fontsize=8)
    else:
        bar.ax.set_yticks([])
    return fig, dpi


def probability_map_png(probs: np.ndarray, *, max_size_px: int) -> bytes:
    """A float (rows, cols) probability map (NaN where no patch: white) coloured with ``viridis`` from 0 to 1,
    with its colour bar labelled P(tumour) (unlabelled under :data:`VIEW_MIN_TEXT_PX`), ``max_size_px`` on
    its longer side."""
    fig, dpi = probability_map_figure(probs, max_size_px=max_size_px)
    return _png(fig, dpi=dpi)


def match_view_figure(match: SlideMatch, *, max_size_px: int = 360) -> tuple[Figure, float]:
    """The Figure of :func:`match_view_png` and the dpi that makes it ``max_size_px`` on its longer side."""
    mask = match.mask
    if mask is None:
        raise ValueError("match_view_png needs a tumour slide's match (with its evaluation mask).")
    labels = mask.full_labels()
    step = max(1, int(np.ceil(max(labels.shape) / 720)))
    if step > 1:  # keep small regions visible: any labelled pixel in the block
        from skimage.measure import block_reduce

        view = block_reduce(labels, (step, step), np.max)
    else:
        view = labels
    rgb = np.full(view.shape + (3,), 255, dtype=np.uint8)
    is_itc = np.isin(view, list(mask.itc_labels)) if mask.itc_labels else np.zeros(view.shape, bool)
    rgb[(view > 0) & ~is_itc] = (240, 150, 150)
    rgb[is_itc] = (253, 205, 140)
    ds = mask.downsample
    h_lv0, w_lv0 = labels.shape[0] * ds, labels.shape[1] * ds
    text = max_size_px >= VIEW_MIN_TEXT_PX
    # left: y tick labels ('100k') and the axis label; bottom: x ticks and label; top: the title
    fig, box, dpi = _view_figure(h_lv0 / w_lv0, max_size_px, text=text, margins_in=(0.62, 0.15, 0.48, 0.3),
                                 min_size_in=(2.3, 1.4))
    ax = fig.add_axes(box)
    span = step * ds  # level-0 pixels per view pixel (the last block may run past the slide edge)
    ax.imshow(rgb, extent=(0, view.shape[1] * span, view.shape[0] * span, 0), interpolation="nearest",
              aspect="auto")
    marker_pt2 = 22 if text else max(4.0, 22 * max_size_px / 320)
    for code, (marker, colour, label) in _OUTCOME_STYLE.items():
        sel = match.outcome == code
        if sel.any():
            ax.scatter(match.x_lv0[sel], match.y_lv0[sel], marker=marker, s=marker_pt2, c=colour,
                       linewidths=1.0, label=label)
    ax.set_xlim(0, w_lv0)
    ax.set_ylim(h_lv0, 0)
    if text:
        width_in, height_in = fig.get_size_inches()
        # at most 4 intervals, and none shorter than a tick label needs ('12.5k' is about 0.3 in wide)
        for axis, length_in, per_label_in in ((ax.xaxis, box[2] * width_in, 0.55), (ax.yaxis, box[3] * height_in, 0.3)):
            axis.set_major_locator(MaxNLocator(nbins=int(np.clip(length_in // per_label_in, 1, 4)), integer=True))
            axis.set_major_formatter(FuncFormatter(_k))
        ax.tick_params(labelsize=7.5)
        ax.set_xlabel("x (level-0 px)", fontsize=7.5, labelpad=2)
        ax.set_ylabel("y (level-0 px)", fontsize=7.5, labelpad=2)
        title = f"{match.n_detected}/{match.n_lesions} lesions, {match.n_fp} FP, {mask.n_itc} ITC"
        ax.set_title(title, fontsize=8, pad=4)
    else:
        ax.set_xticks([])
        ax.set_yticks([])
    return fig, dpi


def match_view_png(match: SlideMatch, *, max_size_px: int = 360) -> bytes:
    """The evaluation regions of a tumour slide (lesions pink, ITCs orange) with each detection marked by
    its outcome (:data:`MATCH_VIEW_LEGEND`), ``max_size_px`` on its longer side in the slide's aspect; axes in
    level-0 pixels (drawn from :data:`VIEW_MIN_TEXT_PX` on)."""
    fig, dpi = match_view_figure(match, max_size_px=max_size_px)
    return _png(fig, dpi=dpi)
