"""PNG plots of the evaluation (FROC, ROC, per-slide views), drawn with matplotlib's Agg canvas.

Every function returns PNG bytes; nothing touches pyplot's global state, so plotting is safe in
threads and never opens a window.
"""

from __future__ import annotations

import io
from typing import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image

from wsi_milssl.evaluation.froc import FP_RATES, FrocCurve, SlideMatch
from wsi_milssl.evaluation.metrics import RocCurve

__all__ = ["MATCH_VIEW_LEGEND", "froc_png", "roc_png", "thumbnail_png", "probability_map_png", "match_view_png"]

# drawn in this order, so a lesion's TP marker sits on top of its repeat hits
_OUTCOME_STYLE = {
    "repeat": ("o", "#91bfdb", "repeat hit (neither TP nor FP)"),
    "itc": ("s", "#e6550d", "hit on ITC (neither TP nor FP)"),
    "fp": ("x", "#2b2bd9", "false positive"),
    "tp": ("o", "#1a9850", "true positive (best hit of a lesion)"),
}
MATCH_VIEW_LEGEND = ("regions: lesion pink, ITC orange; detections: TP green dot, repeat hit light-blue dot, "
                     "ITC hit orange square, FP blue cross")


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def froc_png(curve: FrocCurve, *, score: float | None, fp_rates: Sequence[float] = FP_RATES,
             sensitivities: Sequence[float] | None = None, protocol: str | None = None) -> bytes:
    """The FROC curve (sensitivity against mean false positives per slide, linear axes up to past the
    largest FP rate), with the operating points at ``fp_rates`` marked; ``protocol`` (its settings, or
    "CAMELYON16") goes under the title."""
    fig = Figure(figsize=(5.5, 4.2))
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
    title = "FROC" if score is None or not np.isfinite(score) else f"FROC score {score:.3f}"
    subtitle = "" if not protocol else f"\n{protocol}"
    ax.set_title(f"{title}  ({curve.n_lesions} lesions, {curve.n_slides} slides){subtitle}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return _png(fig)


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


def thumbnail_png(image: Image.Image | np.ndarray, *, max_size_px: int) -> bytes:
    """``image`` shrunk (never enlarged) so that its longer side is at most ``max_size_px``, as PNG."""
    img = image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image))
    if img.mode not in ("RGB", "RGBA", "L"):
        img = img.convert("RGBA")
    img = img.copy()
    img.thumbnail((max_size_px, max_size_px), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def probability_map_png(probs: np.ndarray, *, max_size_px: int) -> bytes:
    """A float (rows, cols) probability map (NaN where no patch) coloured with ``viridis`` on white."""
    from matplotlib import colormaps

    p = np.asarray(probs, dtype=np.float64)
    rgba = colormaps["viridis"](np.clip(np.nan_to_num(p, nan=0.0), 0.0, 1.0))
    rgb = (rgba[..., :3] * 255).round().astype(np.uint8)
    rgb[np.isnan(p)] = 255
    img = Image.fromarray(rgb)
    scale = max(1, int(max_size_px // max(img.size)))
    if scale > 1:  # a patch grid is small: enlarge it with crisp cells
        img = img.resize((img.width * scale, img.height * scale), Image.Resampling.NEAREST)
    return thumbnail_png(img, max_size_px=max_size_px)


def match_view_png(match: SlideMatch, *, max_size_px: int = 360) -> bytes:
    """The evaluation regions of a tumour slide (lesions red, ITCs orange) at level 5 with each
    detection marked by its outcome; axes in level-0 pixels."""
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
    aspect = h_lv0 / w_lv0
    width_in = max_size_px / 100
    fig = Figure(figsize=(width_in, max(1.5, width_in * aspect) + 0.5))
    ax = fig.add_subplot()
    span = step * ds  # level-0 pixels per view pixel (the last block may run past the slide edge)
    ax.imshow(rgb, extent=(0, view.shape[1] * span, view.shape[0] * span, 0), interpolation="nearest")
    for code, (marker, colour, label) in _OUTCOME_STYLE.items():
        sel = match.outcome == code
        if sel.any():
            ax.scatter(match.x_lv0[sel], match.y_lv0[sel], marker=marker, s=22, c=colour,
                       linewidths=1.0, label=label)
    ax.set_xlim(0, w_lv0)
    ax.set_ylim(h_lv0, 0)
    ax.tick_params(labelsize=6)
    ax.set_title(f"{match.n_detected}/{match.n_lesions} lesions, {match.n_fp} FP, {mask.n_itc} ITC", fontsize=8)
    fig.tight_layout()
    return _png(fig)
