"""Read many patches fast: one OpenSlide read per run of neighbouring patches, on reader threads.

Patches of one grid row that sit next to each other are read as one band at the pyramid level of
the read plan and cut apart, instead of one ``read_region`` call each; each patch is then resized
by the plan's residual scale exactly as :meth:`SlideReader.read_region` does (area averaging when
shrinking). Bands are processed by a small thread pool (OpenSlide, Pillow and the JPEG codec release
the GIL) with a bounded look-ahead, and results come back in grid order, so memory is bounded by a
few bands however large the slide is.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

import numpy as np
from PIL import Image

from wsi_milssl.tiling.grid import TileGeometry

__all__ = ["Band", "band_origin_level", "ordered_map", "plan_bands", "read_band", "read_band_region"]

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Band:
    """A horizontal run of patches read with one call.

    ``indices``: int64 (B,) positions in the coordinate list; ``x_lv0``, ``y_lv0``: level-0 top-left of
    the band; ``offsets_level``: int64 (B,) x offset of each patch inside the band, in pixels at the
    read level; ``width_level``: band width at the read level.
    """

    indices: np.ndarray
    x_lv0: int
    y_lv0: int
    offsets_level: np.ndarray
    width_level: int


def plan_bands(coords_lv0: np.ndarray, geometry: TileGeometry, *, max_band_px: int = 4096) -> list[Band]:
    """Group row-major level-0 coordinates int (N, 2) into bands of horizontally adjacent patches.

    Patches join a band when they are one stride apart in the same row (and the stride is at most
    twice the patch, so little unused area is read); a band is at most ``max_band_px`` wide at the
    read level and at the target resolution.
    """
    coords = np.asarray(coords_lv0, dtype=np.int64).reshape(-1, 2)
    if len(coords) == 0:
        return []
    g = geometry
    p_level = g.patch_size_level
    stride_level = g.stride_lv0 / g.level_downsample
    mergeable = g.stride_lv0 <= 2 * g.patch_size_lv0
    # at most max_band_px wide at the read level and at the target resolution too: a level read upsampled holds
    # more patches per pixel of band, and the heatmap's reader slots hold a band of max_band_px target pixels
    # (review BO: a band of an upsampled slide overflowed its slot)
    per_px = max(1, int((max_band_px - g.patch_size_px) // max(g.stride_px, 1)) + 1)
    max_per_band = 1 if not mergeable else min(per_px, max(1, int((max_band_px - p_level) // max(stride_level, 1e-9)) + 1))
    bands: list[Band] = []
    start = 0
    n = len(coords)
    for i in range(1, n + 1):
        close_band = (
            i == n
            or coords[i, 1] != coords[start, 1]
            or coords[i, 0] - coords[i - 1, 0] != g.stride_lv0
            or not mergeable
            or i - start >= max_per_band
        )
        if close_band:
            idx = np.arange(start, i, dtype=np.int64)
            x0 = int(coords[start, 0])
            offsets = np.round((coords[start:i, 0] - x0) / g.level_downsample).astype(np.int64)
            width = int(offsets[-1]) + p_level
            bands.append(Band(idx, x0, int(coords[start, 1]), offsets, width))
            start = i
    return bands


def _resize(patch: np.ndarray, size_px: int) -> np.ndarray:
    h, w = patch.shape[:2]
    resample = Image.Resampling.BOX if w > size_px else Image.Resampling.BICUBIC
    return np.asarray(Image.fromarray(patch).resize((size_px, size_px), resample=resample))


def band_origin_level(band: Band, geometry: TileGeometry) -> tuple[int, int] | None:
    """The band's top-left in pixels of the read level when it falls on whole pixels, else None."""
    ds = geometry.level_downsample
    x, y = band.x_lv0 / ds, band.y_lv0 / ds
    if float(x).is_integer() and float(y).is_integer():
        return int(x), int(y)
    return None


def read_band_region(slide, band: Band, geometry: TileGeometry, *, source=None) -> np.ndarray:
    """uint8 (h, width_level, 3) RGB of the whole band at the read level.

    ``source``: an optional direct reader of the read level (see
    :class:`wsi_milssl.tiling.tiff_source.TiffLevelSource`), used when the band starts on a whole
    pixel of that level; otherwise OpenSlide reads it through ``slide.read_level``.
    """
    g = geometry
    size = (band.width_level, g.patch_size_level)
    origin = band_origin_level(band, g) if source is not None else None
    if origin is not None:
        return source.read(origin[0], origin[1], *size)
    return slide.read_level(band.x_lv0, band.y_lv0, g.level, size)


def read_band(slide, band: Band, geometry: TileGeometry, *, source=None) -> np.ndarray:
    """uint8 (B, P, P, 3) RGB patches of ``band`` at the target resolution (P = patch_size_px)."""
    g = geometry
    p_level = g.patch_size_level
    region = read_band_region(slide, band, g, source=source)
    out = np.empty((len(band.indices), g.patch_size_px, g.patch_size_px, 3), np.uint8)
    for k, off in enumerate(band.offsets_level):
        crop = region[:, int(off): int(off) + p_level]
        if p_level == g.patch_size_px:
            out[k] = crop
        else:
            out[k] = _resize(np.ascontiguousarray(crop), g.patch_size_px)
    return out


def ordered_map(fn: Callable[[T], R], items: list[T], *, threads: int, lookahead: int | None = None) -> Iterator[R]:
    """``map(fn, items)`` on ``threads`` threads, yielding in input order with at most ``lookahead``
    items in flight (default 2 x threads). ``threads == 1`` runs inline."""
    if threads <= 1:
        for item in items:
            yield fn(item)
        return
    lookahead = lookahead or 2 * threads
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="wsi-tile-read") as pool:
        pending: deque = deque()
        it = iter(items)
        try:
            for item in it:
                pending.append(pool.submit(fn, item))
                if len(pending) >= lookahead:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for fut in pending:
                fut.cancel()
