"""Measurable checks of matplotlib figures for the plot tests: the text each figure draws, where it lands,
and whether it overlaps the data; no pixel snapshots."""

from __future__ import annotations

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text


def _in_view(axis, loc: float) -> bool:
    lo, hi = sorted(axis.get_view_interval())
    return lo - 1e-9 * max(1.0, abs(hi - lo)) <= loc <= hi + 1e-9 * max(1.0, abs(hi - lo))


def drawn_texts(fig: Figure, *, dpi: float | None = None) -> list[tuple[str, Text, object]]:
    """(text, artist, window extent in display pixels) of every non-empty text the figure draws: figure
    texts, and per axes its titles, axis labels, tick labels of the ticks in view, texts and legend texts.
    The figure is drawn first (at ``dpi`` when given)."""
    if dpi is not None:
        fig.set_dpi(dpi)
    if not isinstance(fig.canvas, FigureCanvasAgg):
        FigureCanvasAgg(fig)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts: list[Text] = list(fig.texts)
    if getattr(fig, "_suptitle", None) is not None:
        texts.append(fig._suptitle)
    for ax in fig.axes:
        texts += [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        for axis in (ax.xaxis, ax.yaxis):
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if tick.get_visible() and _in_view(axis, tick.get_loc()):
                    texts += [t for t in (tick.label1, tick.label2) if t.get_visible()]
        legend = ax.get_legend()
        if legend is not None:
            texts += list(legend.get_texts())
    out = []
    for t in texts:
        if t.get_visible() and t.get_text().strip():
            out.append((t.get_text(), t, t.get_window_extent(renderer)))
    return out


def texts_outside(fig: Figure, *, dpi: float | None = None, tolerance_px: float = 0.5) -> list[str]:
    """The drawn texts whose extent reaches past the figure's edge (empty when all are inside)."""
    texts = drawn_texts(fig, dpi=dpi)
    box = fig.bbox
    return [f"{text!r} at {ext.x0:.1f}..{ext.x1:.1f} x {ext.y0:.1f}..{ext.y1:.1f} in 0..{box.width:.1f} x "
            f"0..{box.height:.1f}" for text, _, ext in texts
            if ext.x0 < -tolerance_px or ext.y0 < -tolerance_px or ext.x1 > box.width + tolerance_px
            or ext.y1 > box.height + tolerance_px]


def visible_ticks(axis) -> list[float]:
    """The tick positions of ``axis`` (an Axis) that lie inside its view, after a draw."""
    return [float(loc) for loc in axis.get_majorticklocs() if _in_view(axis, loc)]
