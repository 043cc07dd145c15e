"""Slide reading at a physical resolution (OpenSlide), the µm/px <-> level arithmetic, the tissue
mask and the entropy filter."""

from wsi_milssl.slide.entropy import entropy_bits, entropy_bits_batch, grey_uint8
from wsi_milssl.slide.reader import READERS, SlideReader, open_slide, register_reader
from wsi_milssl.slide.resolution import (
    DEFAULT_MPP_AT_40X,
    ReadPlan,
    magnification_to_mpp,
    mpp_to_magnification,
    plan_read,
)
from wsi_milssl.slide.tissue import detect_tissue, register_tissue_detector, slide_tissue_mask

__all__ = [
    "DEFAULT_MPP_AT_40X",
    "READERS",
    "ReadPlan",
    "SlideReader",
    "detect_tissue",
    "entropy_bits",
    "entropy_bits_batch",
    "grey_uint8",
    "magnification_to_mpp",
    "mpp_to_magnification",
    "open_slide",
    "plan_read",
    "register_reader",
    "register_tissue_detector",
    "slide_tissue_mask",
]
