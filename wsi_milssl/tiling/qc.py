"""QC thumbnail of a tiled slide: the tissue-mask outline and the kept patch grid drawn on a thumbnail."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from skimage.segmentation import find_boundaries

from wsi_milssl.atomic import atomic_open

__all__ = ["render_qc", "write_qc_png"]

MASK_COLOUR = (0, 170, 0)  # tissue outline
KEPT_COLOUR = (20, 60, 255)  # kept patches
DROPPED_COLOUR = (255, 140, 0)  # read but dropped by the entropy filter


def render_qc(thumbnail: np.ndarray, *, downsample_xy: tuple[float, float], mask: np.ndarray | None,
              kept_lv0: np.ndarray, dropped_lv0: np.ndarray, patch_size_lv0: int) -> np.ndarray:
    """uint8 (h, w, 3) RGB QC image.

    ``thumbnail``: RGB uint8 (h, w, 3) with level-0 pixels per thumbnail pixel ``downsample_xy``;
    ``mask``: bool tissue mask of any size covering the whole slide (drawn as an outline), or None;
    ``kept_lv0`` / ``dropped_lv0``: int (N, 2) level-0 top-left of kept / entropy-dropped patches.
    """
    img = Image.fromarray(np.ascontiguousarray(thumbnail)).convert("RGB")
    w, h = img.size
    if mask is not None and mask.size and not mask.all():
        m = Image.fromarray(mask.astype(np.uint8) * 255).resize((w, h), Image.Resampling.NEAREST)
        edge = find_boundaries(np.asarray(m) > 127, mode="thick")
        arr = np.asarray(img).copy()
        arr[edge] = MASK_COLOUR
        img = Image.fromarray(arr)
    draw = ImageDraw.Draw(img)
    dx, dy = downsample_xy
    for coords, colour in ((dropped_lv0, DROPPED_COLOUR), (kept_lv0, KEPT_COLOUR)):
        for x, y in np.asarray(coords).reshape(-1, 2):
            x0, y0 = x / dx, y / dy
            x1, y1 = (x + patch_size_lv0) / dx - 1, (y + patch_size_lv0) / dy - 1
            draw.rectangle([x0, y0, max(x0, x1), max(y0, y1)], outline=colour)
    return np.asarray(img)


def write_qc_png(image: np.ndarray, path: str | os.PathLike) -> Path:
    """Write an RGB uint8 image as PNG atomically (temporary name, fsync, rename)."""
    with atomic_open(path, "wb") as fh:
        Image.fromarray(image).save(fh, format="PNG", compress_level=1)
    return Path(path)
