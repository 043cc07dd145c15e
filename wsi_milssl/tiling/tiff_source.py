"""Direct reads of one pyramid level of a tiled JPEG TIFF (generic TIFF, SVS), bypassing OpenSlide.

OpenSlide spends most of a ``read_region`` call outside JPEG decoding (compositing, pixel-format
conversion); decoding the TIFF tiles with tifffile/imagecodecs and copying them into place is
several times faster. The pixels are the same decoded tiles, and the tile stage checks that on
every slide: its first band is read both ways and the direct path is only used when the two are
identical (otherwise, and for anything that is not a plain tiled 8-bit RGB/YCbCr JPEG TIFF level,
everything is read through OpenSlide).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from wsi_milssl.errors import SlideReadError
from wsi_milssl.tiling.grid import TileGeometry
from wsi_milssl.tiling.reading import Band, band_origin_level, read_band_region

__all__ = ["TiffLevelSource", "direct_source"]

logger = logging.getLogger(__name__)

_JPEG = 7  # TIFF compression tag value


#: most decoded tiles kept per source (256 x 256 RGB tiles: about 50 MB)
MAX_CACHED_TILES = 256


class TiffLevelSource:
    """RGB uint8 regions of one pyramid level, decoded straight from the TIFF tiles.

    Use :meth:`open` (returns None when the level is not a plain tiled JPEG TIFF page). Thread-safe:
    tiles are read with ``os.pread`` and decoded by imagecodecs, which releases the GIL.

    The most recently decoded tiles are kept (two rows of tiles across the level plus a few, at most
    :data:`MAX_CACHED_TILES`): patch rows rarely line up with tile rows, so the next row of patches
    starts in the tiles the previous one ended in, and each tile is then decoded about once instead
    of up to twice.
    """

    def __init__(self, tif, page, path: Path) -> None:
        self._tif = tif
        self._page = page
        self._decode = page.decode
        self._tables = page.jpegtables
        self.path = Path(path)
        self._fd = os.open(path, os.O_RDONLY)
        self.width = int(page.imagewidth)
        self.height = int(page.imagelength)
        self.tile_w = int(page.tilewidth)
        self.tile_h = int(page.tilelength)
        self._across = -(-self.width // self.tile_w)
        self._offsets = np.asarray(page.dataoffsets, dtype=np.int64)
        self._counts = np.asarray(page.databytecounts, dtype=np.int64)
        self.cache_tiles = min(MAX_CACHED_TILES, 2 * self._across + 4)
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        #: tiles decoded and tiles served from the cache (for benchmarks)
        self.n_decoded = 0
        self.n_cached = 0

    @classmethod
    def open(cls, path: str | os.PathLike, *, level_size: tuple[int, int]) -> "TiffLevelSource | None":
        """The source for the TIFF page of size ``level_size`` = (width, height), or None."""
        path = Path(path)
        try:
            import tifffile

            tif = tifffile.TiffFile(path)
        except Exception:  # noqa: BLE001 - not a TIFF (or unreadable): use OpenSlide
            return None
        try:
            for page in tif.pages:
                if (
                    getattr(page, "is_tiled", False)
                    and int(page.compression) == _JPEG
                    and page.samplesperpixel == 3
                    and page.bitspersample == 8
                    and int(page.planarconfig) == 1
                    and (int(page.imagewidth), int(page.imagelength)) == tuple(level_size)
                    and getattr(page, "imagedepth", 1) == 1
                ):
                    return cls(tif, page, path)
        except Exception as exc:  # noqa: BLE001
            logger.debug("%s: no direct TIFF reads (%s)", path, exc)
        tif.close()
        return None

    def _tile(self, index: int) -> np.ndarray:
        """The decoded (tile_h, tile_w, >=3) tile ``index`` (row-major), from the cache when there."""
        with self._lock:
            tile = self._cache.get(index)
            if tile is not None:
                self._cache.move_to_end(index)
                self.n_cached += 1
                return tile
        try:
            data = os.pread(self._fd, int(self._counts[index]), int(self._offsets[index]))
            tile = self._decode(data, index, jpegtables=self._tables)[0]
            # a JPEG stream cut short decodes without an error, its missing rows grey (review ES), where OpenSlide
            # refuses it: its end-of-image marker must follow its scan header (the marker cannot occur inside the
            # scan's data, where every 0xFF byte is stuffed; bytes after it are allowed, as libjpeg allows them)
            scan = data.find(b"\xff\xda")  # (the marker searched from the end: the scan's bytes are not read twice)
            if len(data) < int(self._counts[index]) or scan < 0 or data.rfind(b"\xff\xd9", scan) < 0:
                raise ValueError(f"its JPEG data ({len(data)} of {int(self._counts[index])} bytes) has no "
                                 "end-of-image marker after its scan: cut short")
            tile = tile.reshape(tile.shape[-3:])
        except Exception as exc:  # noqa: BLE001 - a codec's own error type (Jpeg8Error, ...) or OSError
            raise self._read_error(index, exc) from exc
        with self._lock:
            self.n_decoded += 1
            self._cache[index] = tile
            while len(self._cache) > self.cache_tiles:
                self._cache.popitem(last=False)
        return tile

    def _read_error(self, index: int, exc: BaseException) -> SlideReadError:
        """SlideReadError naming the slide, the tile and the fix, for a tile that cannot be read or decoded."""
        row, col = divmod(index, self._across)
        return SlideReadError(
            f"{self.path}: the slide's tile data is corrupt: tile {index} (row {row}, column {col}) of the "
            f"{self.width} x {self.height} px level cannot be decoded ({type(exc).__name__}: {exc}). "
            "Fix: re-export the slide from the scanner software (or re-scan it), or re-copy it if the copy "
            "was truncated (`wsi-milssl info` decodes only a small square at the centre of the first and the "
            "last level, so it may pass this slide)."
        )

    def read(self, x: int, y: int, w: int, h: int) -> np.ndarray:
        """uint8 (h, w, 3) RGB of the region with top-left (x, y) in this level's pixels; white outside."""
        x0, y0 = max(0, x), max(0, y)
        x1, y1 = min(self.width, x + w), min(self.height, y + h)
        inside = (x0, y0, x1, y1) == (x, y, x + w, y + h)
        out = np.empty((h, w, 3), np.uint8) if inside else np.full((h, w, 3), 255, np.uint8)
        if x0 >= x1 or y0 >= y1:
            return out
        tw, th = self.tile_w, self.tile_h
        for ty in range(y0 // th, (y1 - 1) // th + 1):
            for tx in range(x0 // tw, (x1 - 1) // tw + 1):
                tile = self._tile(ty * self._across + tx)
                ax0, ay0 = max(x0, tx * tw), max(y0, ty * th)
                ax1, ay1 = min(x1, (tx + 1) * tw), min(y1, (ty + 1) * th)
                out[ay0 - y: ay1 - y, ax0 - x: ax1 - x] = tile[ay0 - ty * th: ay1 - ty * th,
                                                              ax0 - tx * tw: ax1 - tx * tw, :3]
        return out

    def close(self) -> None:
        self._cache.clear()
        try:
            os.close(self._fd)
        except OSError:
            pass
        self._tif.close()

    def __enter__(self) -> "TiffLevelSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def direct_source(slide, bands: list[Band], geometry: TileGeometry) -> "TiffLevelSource | None":
    """A direct TIFF reader of the read level, when the slide is a tiled JPEG TIFF and the reader
    gives exactly OpenSlide's pixels on the first band that starts on a whole level pixel."""
    probe = next((b for b in bands if band_origin_level(b, geometry) is not None), None)
    if probe is None:
        return None
    source = TiffLevelSource.open(slide.path, level_size=geometry.level_dimensions)
    if source is None:
        return None
    # one patch-sized square at the probe band's origin, read both ways
    square = Band(probe.indices[:1], probe.x_lv0, probe.y_lv0, probe.offsets_level[:1], geometry.patch_size_level)
    try:
        same = np.array_equal(read_band_region(slide, square, geometry, source=source),
                              read_band_region(slide, square, geometry))
    except Exception as exc:  # noqa: BLE001 - any trouble: stay with OpenSlide
        logger.debug("%s: direct TIFF reads disabled (%s)", slide.path, exc)
        same = False
    if not same:
        logger.info("%s: direct TIFF tile reads not used (they differ from OpenSlide's or failed on the first "
                    "patch; -vv says which); reading through OpenSlide", slide.path)
        source.close()
        return None
    return source
