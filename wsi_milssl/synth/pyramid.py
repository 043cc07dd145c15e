"""Write a pyramidal, tiled, JPEG-compressed TIFF that OpenSlide opens as a generic TIFF.

OpenSlide's generic-TIFF reader needs every level as its own top-level IFD (no SubIFDs), reduced
levels marked ``subfiletype=1``, square power-of-two tiles, and the resolution in centimetre units
(it then reports ``openslide.mpp-x``). Level 0 is streamed block by block from a render function;
each reduced level is a 2x2 (or 4x4) area average of the one above, kept in a temporary
memory-mapped file, so memory stays bounded for slides of any size. The scratch files get their disk
space when they are made (:func:`~wsi_milssl.atomic.preallocate`): a full disk is then an OutputError,
not a SIGBUS when a map's page is first written. The file is written under a temporary name and
renamed when complete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import tifffile
from PIL import Image

from wsi_milssl.atomic import find_write_error, output_error, preallocate, temp_path

__all__ = ["write_pyramidal_tiff", "level_sizes"]

RenderFn = Callable[[int, int, int, int], np.ndarray]  # (x0, y0, x1, y1) -> (h, w, 3) uint8


def level_sizes(width: int, height: int, *, factor: int, min_size_px: int) -> list[tuple[int, int]]:
    """(width, height) of each level: divide by ``factor`` while the shorter side stays >= min_size_px."""
    sizes = [(width, height)]
    while min(sizes[-1]) // factor >= min_size_px:
        w, h = sizes[-1]
        sizes.append((w // factor, h // factor))
    return sizes


def _reduce(block: np.ndarray, factor: int) -> np.ndarray:
    """Area average over factor x factor pixel groups (trailing partial groups dropped)."""
    h, w = block.shape[0] // factor * factor, block.shape[1] // factor * factor
    return np.asarray(Image.fromarray(np.ascontiguousarray(block[:h, :w])).reduce(factor))


def write_pyramidal_tiff(
    path: str | os.PathLike,
    render: RenderFn,
    *,
    width: int,
    height: int,
    mpp: float | None,
    tile_px: int = 256,
    jpeg_quality: int = 90,
    level_factor: int = 2,
    min_level_size_px: int = 512,
    strip_tiles: int = 4,
    block_px: int = 1024,
    on_rows: Callable[[int], None] | None = None,
) -> Path:
    """Render and write the slide; ``mpp=None`` writes no resolution (a slide without MPP).

    ``on_rows(n)`` is called after each strip of level 0 with the number of rows written.
    """
    path = Path(path)
    sizes = level_sizes(width, height, factor=level_factor, min_size_px=min_level_size_px)
    strip_h = tile_px * strip_tiles  # a multiple of the tile and of the level factor
    tmp_path = temp_path(path, kind="partial")  # unique per writer: two runs never share it
    scratch_dir = temp_path(path, kind="scratch")
    try:
        scratch_dir.mkdir()
        scratch = str(scratch_dir)
        reduced: list[np.ndarray] = []
        for level, (w, h) in enumerate(sizes[1:], start=1):
            level_path = os.path.join(scratch, f"level{level}.npy")
            reduced.append(np.lib.format.open_memmap(level_path, mode="w+", dtype=np.uint8, shape=(h, w, 3)))
            with open(level_path, "rb+") as fh:  # disk space now: a full disk is ENOSPC here, not a SIGBUS
                preallocate(fh.fileno(), os.fstat(fh.fileno()).st_size)

        def level0_tiles() -> Iterator[np.ndarray]:
            for y0 in range(0, height, strip_h):
                y1 = min(height, y0 + strip_h)
                strip = np.full((strip_h, -(-width // tile_px) * tile_px, 3), 255, np.uint8)
                for x0 in range(0, width, block_px):
                    x1 = min(width, x0 + block_px)
                    strip[: y1 - y0, x0:x1] = render(x0, y0, x1, y1)
                if reduced:
                    small = _reduce(strip[: y1 - y0, :width], level_factor)
                    w1, h1 = sizes[1]
                    r0 = y0 // level_factor
                    rows = min(small.shape[0], h1 - r0)
                    if rows > 0:
                        reduced[0][r0 : r0 + rows] = small[:rows, :w1]
                for ty in range(0, y1 - y0, tile_px):
                    for tx in range(0, width, tile_px):
                        yield strip[ty : ty + tile_px, tx : tx + tile_px]
                if on_rows is not None:
                    on_rows(y1 - y0)

        def options(level: int) -> dict:
            ds = level_factor**level
            opts = dict(
                tile=(tile_px, tile_px), compression="jpeg", compressionargs={"level": jpeg_quality},
                photometric="rgb", subfiletype=0 if level == 0 else 1, metadata=None,
            )
            if mpp is not None:
                px_per_cm = 1e4 / (mpp * ds)
                opts.update(resolution=(px_per_cm, px_per_cm), resolutionunit="CENTIMETER")
            else:
                opts.update(resolutionunit="NONE")
            return opts

        with tifffile.TiffWriter(tmp_path, bigtiff=width * height * 3 > 2**31) as tif:
            tif.write(level0_tiles(), shape=(height, width, 3), dtype=np.uint8, **options(0))
            for i in range(1, len(reduced)):
                prev, cur = reduced[i - 1], reduced[i]
                step = 4096
                for r0 in range(0, cur.shape[0], step):
                    r1 = min(cur.shape[0], r0 + step)
                    src = prev[r0 * level_factor : r1 * level_factor, : cur.shape[1] * level_factor]
                    cur[r0:r1] = _reduce(np.asarray(src), level_factor)
            for i, arr in enumerate(reduced, start=1):
                tif.write(arr, **options(i))
            del reduced
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_path, path)
    except Exception as exc:
        cause = find_write_error(exc, access=True)
        if cause is None:
            raise
        raise output_error(path, cause, what="cannot write this slide") from None
    finally:
        shutil.rmtree(scratch_dir, ignore_errors=True)
        try:
            tmp_path.unlink(missing_ok=True)
        except OSError:
            pass
    return path
