"""Tissue detection on a low-resolution thumbnail, with a registry of detectors.

The default detector ``"otsu"`` thresholds the HSV saturation of the thumbnail: stained tissue is
coloured, glass is grey-white. Steps: saturation ``S = 255 (max - min) / max`` (uint8) -> median
blur over ``median_um`` -> Otsu threshold (never below ``min_saturation``) -> objects smaller than
``min_object_um2`` removed and holes smaller than ``min_hole_um2`` filled. ``"none"`` marks every
pixel as tissue (``--tissue none``). Add a detector with::

    @register_tissue_detector("mine")
    def mine(rgb: np.ndarray, *, mpp: float) -> np.ndarray:  # uint8 (h, w, 3) -> bool (h, w)
        ...

A mask pixel (i, j) of a mask with downsample (dx, dy) covers level-0 pixels
[j dx, (j+1) dx) x [i dy, (i+1) dy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from PIL import Image
from skimage import filters, morphology
from skimage.filters import rank

from wsi_milssl.registry import Registry

__all__ = [
    "TISSUE_DETECTORS",
    "TissueMask",
    "detect_tissue",
    "otsu_saturation_mask",
    "register_tissue_detector",
    "saturation_uint8",
    "slide_tissue_mask",
]

TissueDetector = Callable[..., np.ndarray]
TISSUE_DETECTORS: Registry[TissueDetector] = Registry("tissue detector")


def register_tissue_detector(name: str):
    """Register ``fn(rgb uint8 (h, w, 3), *, mpp: float) -> bool (h, w)`` under ``name`` (decorator; ValueError
    when the name is taken)."""
    return TISSUE_DETECTORS.register(name)


def saturation_uint8(rgb: np.ndarray) -> np.ndarray:
    """HSV saturation ``floor(255 (max - min) / max)`` of an RGB uint8 (h, w, 3) image as uint8 (h, w),
    0 = grey, 255 = pure colour."""
    rgb = np.asarray(rgb)
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected an RGB uint8 (h, w, 3) image; got {rgb.dtype} {rgb.shape}.")
    # Pillow's HSV conversion (C): S = floor(255 (max - min) / max), 0 where max = 0.
    return np.asarray(Image.fromarray(np.ascontiguousarray(rgb)).convert("HSV"))[..., 1].copy()


def _remove_small_objects(mask: np.ndarray, max_px: int) -> np.ndarray:
    if max_px < 1:
        return mask
    try:  # scikit-image >= 0.26: objects with size <= max_size are removed
        return morphology.remove_small_objects(mask, max_size=max_px)
    except TypeError:  # older releases: objects smaller than min_size are removed
        return morphology.remove_small_objects(mask, min_size=max_px + 1)


def _remove_small_holes(mask: np.ndarray, max_px: int) -> np.ndarray:
    if max_px < 1:
        return mask
    try:
        return morphology.remove_small_holes(mask, max_size=max_px)
    except TypeError:
        return morphology.remove_small_holes(mask, area_threshold=max_px + 1)


@register_tissue_detector("otsu")
def otsu_saturation_mask(
    rgb: np.ndarray,
    *,
    mpp: float,
    median_um: float = 64.0,
    min_saturation: float = 0.05,
    min_object_um2: float = 10_000.0,
    min_hole_um2: float = 10_000.0,
) -> np.ndarray:
    """bool (h, w) tissue mask of an RGB uint8 thumbnail whose pixels are ``mpp`` µm wide.

    ``median_um``: side of the median-blur window in µm (at least 3 px); ``min_saturation``: lowest
    threshold allowed, as a fraction of full saturation (keeps a blank slide blank when Otsu would
    split sensor noise); ``min_object_um2`` / ``min_hole_um2``: tissue islands / holes up to this
    area in µm² are removed / filled.
    """
    if mpp <= 0:
        raise ValueError(f"mpp must be positive; got {mpp!r}.")
    sat = saturation_uint8(rgb)
    k = max(3, int(round(median_um / mpp)))
    k += 1 - k % 2  # odd window
    blurred = rank.median(sat, footprint=np.ones((k, k), bool))  # histogram-based, fast on uint8
    floor = float(min_saturation) * 255.0
    if blurred.size == 0:
        return np.zeros(blurred.shape, bool)
    threshold = floor if blurred.min() == blurred.max() else max(float(filters.threshold_otsu(blurred)), floor)
    mask = blurred > threshold
    px_area_um2 = mpp * mpp
    mask = _remove_small_objects(mask, int(min_object_um2 / px_area_um2))
    mask = _remove_small_holes(mask, int(min_hole_um2 / px_area_um2))
    return mask


@register_tissue_detector("none")
def no_tissue_detection(rgb: np.ndarray, *, mpp: float) -> np.ndarray:
    """Every pixel is tissue: bool (h, w) of True."""
    return np.ones(np.asarray(rgb).shape[:2], bool)


def detect_tissue(rgb: np.ndarray, *, method: str = "otsu", mpp: float) -> np.ndarray:
    """bool (h, w) tissue mask of an RGB uint8 (h, w, 3) thumbnail at ``mpp`` µm/px with a registered detector."""
    if method not in TISSUE_DETECTORS:
        raise ValueError(
            f"unknown tissue detector {method!r}; registered detectors: {', '.join(sorted(TISSUE_DETECTORS))}."
        )
    mask = np.asarray(TISSUE_DETECTORS[method](rgb, mpp=mpp), dtype=bool)
    if mask.shape != np.asarray(rgb).shape[:2]:
        raise ValueError(f"tissue detector {method!r} returned shape {mask.shape} for a {rgb.shape[:2]} thumbnail.")
    return mask


@dataclass(frozen=True)
class TissueMask:
    """A tissue mask over a whole slide.

    ``mask``: bool (h, w); ``thumbnail``: the RGB uint8 (h, w, 3) it was computed from;
    ``downsample_xy``: level-0 pixels per mask pixel along x and y.
    """

    mask: np.ndarray
    thumbnail: np.ndarray
    downsample_xy: tuple[float, float]

    def fraction(self, coords_lv0: np.ndarray, size_lv0: int) -> np.ndarray:
        """float32 (N,) fraction of mask pixels that are tissue in each level-0 square
        [x, x + size_lv0) x [y, y + size_lv0) with top-left ``coords_lv0`` int (N, 2).

        Each square is mapped to the mask pixels it overlaps (at least one) and averaged with a
        summed-area table, so this is O(N) after an O(h w) table.
        """
        coords = np.asarray(coords_lv0, dtype=np.float64).reshape(-1, 2)
        h, w = self.mask.shape
        if len(coords) == 0 or h == 0 or w == 0:
            return np.zeros(len(coords), np.float32)
        sat = np.zeros((h + 1, w + 1), np.int64)
        sat[1:, 1:] = np.cumsum(np.cumsum(self.mask, axis=0, dtype=np.int64), axis=1)
        dx, dy = self.downsample_xy
        x0 = np.clip(np.floor(coords[:, 0] / dx + 1e-9), 0, w - 1).astype(np.int64)
        y0 = np.clip(np.floor(coords[:, 1] / dy + 1e-9), 0, h - 1).astype(np.int64)
        x1 = np.clip(np.ceil((coords[:, 0] + size_lv0) / dx - 1e-9), 1, w).astype(np.int64)
        y1 = np.clip(np.ceil((coords[:, 1] + size_lv0) / dy - 1e-9), 1, h).astype(np.int64)
        x1 = np.maximum(x1, x0 + 1)
        y1 = np.maximum(y1, y0 + 1)
        inside = sat[y1, x1] - sat[y0, x1] - sat[y1, x0] + sat[y0, x0]
        area = (x1 - x0) * (y1 - y0)
        return (inside / area).astype(np.float32)


def slide_tissue_mask(slide, *, method: str = "otsu", mask_mpp: float = 16.0,
                      min_size_px: int = 256, max_size_px: int = 8192) -> TissueMask:
    """Tissue mask of a SlideReader ``slide`` computed on a thumbnail of about ``mask_mpp`` µm/px.

    The thumbnail's longer side is clamped to [min_size_px, max_size_px] pixels.
    """
    w0, h0 = slide.dimensions
    long_side = max(w0, h0) * slide.mpp / mask_mpp
    size = int(min(max(round(long_side), min_size_px), max_size_px))
    size = min(size, max(w0, h0))
    thumb, _ = slide.thumbnail(max_size_px=size)
    th, tw = thumb.shape[:2]
    ds_xy = (w0 / tw, h0 / th)
    mask = detect_tissue(thumb, method=method, mpp=slide.mpp * (ds_xy[0] + ds_xy[1]) / 2)
    return TissueMask(mask=mask, thumbnail=thumb, downsample_xy=ds_xy)
