"""Shannon entropy of a patch's greyscale histogram, the background filter of the tile stage.

The greyscale image is the ITU-R 601-2 luma that Pillow's ``convert("L")`` computes
(``L = (299 R + 587 G + 114 B) / 1000``, rounded, uint8). The entropy is taken over its 256-bin
histogram in bits:

    H = -sum_k p_k log2 p_k,   p_k = count_k / (h * w),   over bins with count_k > 0,

which is what ``skimage.measure.shannon_entropy(grey, base=2)`` returns for a uint8 image (tests
check the agreement). A flat white background gives ~0-2 bits, stained tissue 5-7.5 bits; the
paper drops patches below 5 bits.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

__all__ = ["grey_uint8", "entropy_bits", "entropy_bits_batch", "histogram_entropy_bits"]


def grey_uint8(rgb: np.ndarray) -> np.ndarray:
    """uint8 (h, w) luma of an RGB uint8 (h, w, 3) image; a 2-D uint8 input is returned as is."""
    rgb = np.asarray(rgb)
    if rgb.dtype != np.uint8:
        raise TypeError(f"grey_uint8 expects uint8 pixels; got dtype {rgb.dtype}.")
    if rgb.ndim == 2:
        return rgb
    if rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"grey_uint8 expects an (h, w, 3) RGB array; got shape {rgb.shape}.")
    return np.asarray(Image.fromarray(np.ascontiguousarray(rgb)).convert("L"))


def histogram_entropy_bits(counts: np.ndarray) -> np.ndarray:
    """Entropy in bits of histograms ``counts`` (..., n_bins) -> float64 (...); empty histograms give 0."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(total > 0, counts / np.where(total > 0, total, 1.0), 0.0)
        terms = np.where(p > 0, p * np.log2(np.where(p > 0, p, 1.0)), 0.0)
    return -terms.sum(axis=-1)


def _grey_histogram(rgb: np.ndarray) -> list[int]:
    rgb = np.ascontiguousarray(rgb)
    img = Image.fromarray(rgb)
    if img.mode != "L":
        img = img.convert("L")
    return img.histogram()


def entropy_bits(rgb: np.ndarray) -> float:
    """Entropy in bits (0..8) of the 256-bin histogram of the greyscale of an RGB uint8 (h, w, 3) patch
    (or of a uint8 (h, w) greyscale patch)."""
    rgb = np.asarray(rgb)
    if rgb.dtype != np.uint8:
        raise TypeError(f"entropy_bits expects uint8 pixels; got dtype {rgb.dtype}.")
    if not (rgb.ndim == 2 or (rgb.ndim == 3 and rgb.shape[2] == 3)):
        raise ValueError(f"entropy_bits expects an (h, w, 3) or (h, w) array; got shape {rgb.shape}.")
    return float(histogram_entropy_bits(np.asarray(_grey_histogram(rgb))))


def entropy_bits_batch(patches: np.ndarray) -> np.ndarray:
    """float64 (B,) entropy in bits of each RGB uint8 patch in ``patches`` (B, h, w, 3)."""
    patches = np.asarray(patches)
    if patches.dtype != np.uint8 or patches.ndim != 4 or patches.shape[3] != 3:
        raise ValueError(
            f"entropy_bits_batch expects uint8 (B, h, w, 3) patches; got {patches.dtype} {patches.shape}."
        )
    if len(patches) == 0:
        return np.zeros(0, np.float64)
    counts = np.array([_grey_histogram(p) for p in patches], dtype=np.int64)
    return histogram_entropy_bits(counts)
