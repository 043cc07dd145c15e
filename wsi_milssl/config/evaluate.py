"""Settings of the evaluation stage (``wsi-milssl evaluate``)."""

from __future__ import annotations

from dataclasses import dataclass

from wsi_milssl.config.base import check_range, check_type

__all__ = ["EvaluateConfig"]


@dataclass(frozen=True)
class EvaluateConfig:
    """Evaluation of heatmap predictions: instance AUC, bag AUC and the CAMELYON16 FROC.

    positive_fraction : a patch is a positive instance when the exact tumour-area fraction of its
        square is at least this (the paper's rule: 0.25).
    margin_um : evaluation regions take in every level-5 pixel closer than ``margin_um / 2`` µm to
        tumour (CAMELYON16: 75 µm, about five tumour cells).
    itc_major_axis_um : regions whose major axis is under this are isolated tumour cells, neither
        true nor false positives (CAMELYON16: 275 µm).
    mpp : level-0 µm per pixel used for every slide instead of the slide's own metadata; None uses
        each slide's MPP (then the ``mpp`` of its ``<stem>_probs.json``).
    thumbnail_px : longer side of the per-slide images in ``report.html``, in screen pixels.
    title : heading of ``report.html``.

    Changing ``margin_um`` or ``itc_major_axis_um`` departs from the CAMELYON16 protocol.
    """

    positive_fraction: float = 0.25
    margin_um: float = 75.0
    itc_major_axis_um: float = 275.0
    mpp: float | None = None
    thumbnail_px: int = 320
    title: str = "wsi-milssl evaluation"

    def __post_init__(self) -> None:
        name = type(self).__name__
        check_range(name, "positive_fraction", self.positive_fraction, low=0.0, high=1.0, low_inclusive=False)
        check_range(name, "margin_um", self.margin_um, low=0.0)
        check_range(name, "itc_major_axis_um", self.itc_major_axis_um, low=0.0)
        if self.mpp is not None:
            check_range(name, "mpp", self.mpp, low=0.0, high=100.0, low_inclusive=False)
        check_type(name, "thumbnail_px", self.thumbnail_px, int)
        check_range(name, "thumbnail_px", self.thumbnail_px, low=32, high=4096)
        check_type(name, "title", self.title, str)
