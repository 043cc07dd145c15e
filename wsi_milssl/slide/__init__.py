"""Slide reading at a physical resolution (OpenSlide), and the µm/px <-> level arithmetic."""

from wsi_milssl.slide.reader import READERS, SlideReader, open_slide, register_reader
from wsi_milssl.slide.resolution import (
    DEFAULT_MPP_AT_40X,
    ReadPlan,
    magnification_to_mpp,
    mpp_to_magnification,
    plan_read,
)

__all__ = [
    "DEFAULT_MPP_AT_40X",
    "READERS",
    "ReadPlan",
    "SlideReader",
    "magnification_to_mpp",
    "mpp_to_magnification",
    "open_slide",
    "plan_read",
    "register_reader",
]
