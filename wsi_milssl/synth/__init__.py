"""Synthetic slides and annotations: the embedded data for the demo and every test."""

from wsi_milssl.synth.generate import SynthSlide, generate_slides, lesion_annotations, write_slide
from wsi_milssl.synth.layout import Lesion, SlideLayout, make_layout

__all__ = ["Lesion", "SlideLayout", "SynthSlide", "generate_slides", "lesion_annotations", "make_layout", "write_slide"]
