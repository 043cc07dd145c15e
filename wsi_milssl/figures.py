"""A matplotlib figure as PNG bytes, the same whatever the user's matplotlibrc says of saving figures."""

from __future__ import annotations

import io

__all__ = ["png_bytes"]

#: the save settings the images' sizes depend on, at matplotlib's defaults: a user's ``savefig.bbox: tight`` (a
#: common matplotlibrc line) cropped every figure, so a ``--thumbnail-px 320`` view came out 311 px wide (review DC)
_SAVE_SETTINGS = {"savefig.bbox": "standard", "savefig.pad_inches": 0.1, "savefig.transparent": False,
                  "savefig.facecolor": "auto", "savefig.edgecolor": "auto", "savefig.orientation": "portrait"}


def png_bytes(fig, *, dpi: float = 100) -> bytes:
    """``fig`` drawn by the Agg canvas (no display needed) and saved as PNG at ``dpi``, its size in pixels
    ``fig.get_size_inches() * dpi``."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    with matplotlib.rc_context(_SAVE_SETTINGS):
        fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
