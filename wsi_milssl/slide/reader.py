"""Read whole-slide images through OpenSlide at a physical resolution.

Coordinates are level-0 pixels everywhere. A patch at ``target_mpp`` is read from the pyramid level
with the largest downsample not exceeding the one needed and resized by the remainder with area
averaging (antialiased), so a 10x read of a 0.25 µm/px slide comes from the 4x level, not level 0.
Reads finer than the slide's own resolution are refused unless ``allow_upsample`` is given.

An MPP from the slide's metadata is used only when a microscope could have made it
(:data:`PLAUSIBLE_MPP`, 0.05-20 µm/px): a TIFF resolution tag written by an image editor (72 dpi
is 352.78 µm/px) is ignored with a warning that names ``--slide-mpp``.
"""

from __future__ import annotations

import logging
import math
import os
import struct
from pathlib import Path
from typing import Callable

import numpy as np
import openslide
from PIL import Image

from wsi_milssl.errors import MissingResolutionError, SlideReadError
from wsi_milssl.paths import link_loops
from wsi_milssl.registry import Registry
from wsi_milssl.slide.resolution import (
    DEFAULT_MPP_AT_40X,
    ReadPlan,
    check_positive,
    magnification_to_mpp,
    plan_read,
)

__all__ = ["SlideReader", "open_slide", "register_reader", "incomplete_file", "READERS", "PLAUSIBLE_MPP"]

logger = logging.getLogger(__name__)

#: Level-0 resolutions (µm/px) a slide scanner or microscope camera produces; metadata outside this
#: range (screen or print dpi tags, zero-ish values) is not a microscope's and is ignored.
PLAUSIBLE_MPP = (0.05, 20.0)
#: the relative difference of a slide's x and y µm/px above which its metadata resolution is not used (pixels are
#: square; scanners' two values agree to far better than this)
NON_SQUARE_MPP = 0.05
#: the most pixels of the level a thumbnail is read from (OpenSlide reads the level whole: 1 GiB of RGBA)
MAX_THUMBNAIL_SOURCE_PX = 1 << 28

READERS: Registry[Callable[..., "SlideReader"]] = Registry("slide reader")


def register_reader(name: str):
    """Register a slide-reader factory under ``name`` (decorator; ValueError when the name is taken)."""
    return READERS.register(name)


#: the first bytes of a TIFF or BigTIFF file, little- or big-endian
_TIFF_MAGIC = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")


def incomplete_file(path: str | os.PathLike) -> str | None:
    """Why ``path`` looks like a copy or download that stopped early, or None: it is empty; it is a TIFF
    that ends inside its header; or a TIFF whose tiles, strips or next directory lie past its end. Reads
    the TIFF directories only, with tifffile (a file that is no TIFF at all gets None)."""
    import re

    import tifffile

    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        return "this file is empty (0 bytes)"
    with open(path, "rb") as fh:
        is_tiff = fh.read(4) in _TIFF_MAGIC
    offsets: list[int] = []

    def past_end(record: logging.LogRecord) -> bool:  # tifffile's "invalid page offset N": a directory past the end
        found = re.search(r"invalid page offset (\d+)", record.getMessage())
        if found:
            offsets.append(int(found.group(1)))
        return False  # this check's own reading: not shown

    tiff_log = logging.getLogger("tifffile")
    tiff_log.addFilter(past_end)
    try:
        with tifffile.TiffFile(path) as tif:
            n_pages = 0
            for page in tif.pages:
                n_pages += 1
                offsets.extend(o + c for o, c in zip(page.dataoffsets, page.databytecounts))
    except Exception:  # noqa: BLE001 - a TIFF header that cannot be parsed: cut inside it, or no TIFF
        n_pages = 0
    finally:
        tiff_log.removeFilter(past_end)
    if n_pages == 0:  # no directory could be read: a TIFF cut inside its header (a small file), or no TIFF
        if not is_tiff:
            return None
        if size < 65536:
            return f"this TIFF file ends inside its header, after {size:,} bytes"
        first, end = _first_directory_span(path)
        if first is not None and end > size:  # review EH, EI: writers that put the directory after the tiles
            return (f"this TIFF file is incomplete: its first directory is at byte {first:,}, but the file ends "
                    f"after {size:,} bytes")
        return None
    end = max(offsets, default=0)
    if end > size:
        return f"this TIFF file is incomplete: its directories point to byte {end:,}, but the file ends after {size:,} bytes"
    return None


def _first_directory_span(path: Path) -> tuple[int | None, int]:
    """(the byte offset of a TIFF's or BigTIFF's first directory, the byte its entries end at), from the header and
    the directory's entry count where the file holds it; (None, 0) when the header is cut short. Writers such as
    libtiff and ASAP's write each directory after the image data it describes, so a download stopped early leaves a
    header that points past the file's end, or a directory cut inside."""
    with open(path, "rb") as fh:
        header = fh.read(16)
        order = "<" if header[:2] == b"II" else ">"
        big = header[2:4] in (b"+\x00", b"\x00+")
        if len(header) < (16 if big else 8):
            return None, 0
        first = int(struct.unpack(order + ("Q" if big else "I"), header[8:16] if big else header[4:8])[0])
        count_size, entry_size, next_size = (8, 20, 8) if big else (2, 12, 4)
        fh.seek(first)
        count = fh.read(count_size)
    if len(count) < count_size:
        return first, first + count_size
    n = int(struct.unpack(order + ("Q" if big else "H"), count)[0])
    return first, first + count_size + entry_size * n + next_size


def _float_property(props, key: str) -> float | None:
    value = props.get(key)
    if value in (None, ""):
        return None
    try:
        value = float(value)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


class SlideReader:
    """A whole-slide image opened with OpenSlide, served at physical resolutions.

    Parameters
    ----------
    path : slide file (.svs, .ndpi, .mrxs, pyramidal .tif, ...).
    mpp_override : level-0 µm/px to use instead of the slide's own metadata (``--slide-mpp``).
    mpp_at_40x : µm/px of a 40x objective, used to turn magnifications into resolutions.
    allow_upsample : let :meth:`plan` serve resolutions finer than the slide's (``--allow-upsample``);
        by default such a plan raises ResolutionError.

    Raises ConfigError when ``mpp_override`` or ``mpp_at_40x`` is not a finite number above 0,
    SlideReadError when OpenSlide cannot open the file, and MissingResolutionError (on
    first use of ``mpp``) when the slide has neither a plausible MPP nor an objective power and no
    override is given. A metadata MPP outside :data:`PLAUSIBLE_MPP` is ignored with a warning
    (``ignored_metadata_mpp`` keeps it).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        mpp_override: float | None = None,
        mpp_at_40x: float = DEFAULT_MPP_AT_40X,
        allow_upsample: bool = False,
    ) -> None:
        self.path = Path(path)
        self.mpp_at_40x = check_positive("mpp_at_40x", mpp_at_40x, where=self.path)
        self.allow_upsample = bool(allow_upsample)
        self._mpp_override = None if mpp_override is None else check_positive(
            "the level-0 µm per pixel given (--slide-mpp)", mpp_override, where=self.path)
        if self.path.is_symlink() and not self.path.exists():
            if link_loops(self.path):
                raise SlideReadError(f"{self.path}: a link to {os.readlink(self.path)} in a loop of links that never "
                                     "reaches a file. Fix: point the link at the slide file, or remove it.")
            raise SlideReadError(f"{self.path}: a link to {os.readlink(self.path)}, which does not exist. Fix: mount "
                                 "or restore the file it points to, or remove the link.")
        if not self.path.exists():
            raise SlideReadError(f"{self.path}: slide file not found. Fix: check the path, or leave it out of "
                                 "the list of slides.")
        if self.path.is_dir():
            raise SlideReadError(f"{self.path}: this is a folder, not a slide file. Fix: give the slide files in "
                                 "it (the command line, and `wsi_milssl.tiling.find_slides` from Python, list a "
                                 "folder's slides; a folder named like a slide, x.svs/, is not searched).")
        try:  # (review EY: a name in another encoding failed as the stores and reports wrote it, with a traceback;
            str(self.path).encode("utf-8")  # review FA: a link's target is recorded too)
            os.path.realpath(self.path).encode("utf-8")
        except UnicodeEncodeError:
            raise SlideReadError(f"{self.path}: the path (or the file a link names) is not UTF-8 (a name in another "
                                 "encoding), and the stores and reports record it as text. Fix: rename the file in "
                                 "UTF-8 (e.g. `convmv -f latin1 -t utf8 --notest FILE`), or copy it under a plain "
                                 "name.") from None
        if not os.access(self.path, os.R_OK):  # (review CB: a PermissionError traceback, or a line without a fix)
            raise SlideReadError(f"{self.path}: cannot read this slide file (permission denied). Fix: ask its owner "
                                 "for read access, or leave it out of the slides.")
        try:
            self._slide = openslide.OpenSlide(str(self.path))
        except openslide.OpenSlideUnsupportedFormatError:
            why = incomplete_file(self.path)
            if why is not None:
                raise SlideReadError(f"{self.path}: {why} (a copy or download that stopped early). Fix: copy or "
                                     "download the slide again.") from None
            raise SlideReadError(
                f"{self.path}: OpenSlide does not recognise this file as a whole-slide image. "
                "Fix: give a pyramidal slide OpenSlide supports (.svs, .ndpi, .mrxs, tiled pyramidal .tif)."
            ) from None
        except (openslide.OpenSlideError, OSError) as exc:
            raise SlideReadError(
                f"{self.path}: OpenSlide cannot open this slide ({exc}). "
                "Fix: check the file is complete and not corrupt (re-copy or re-export it)."
            ) from None
        props = self._slide.properties
        self.vendor: str = props.get(openslide.PROPERTY_NAME_VENDOR, "unknown") or "unknown"
        self.objective_power: float | None = _float_property(props, openslide.PROPERTY_NAME_OBJECTIVE_POWER)
        mpp_x = _float_property(props, openslide.PROPERTY_NAME_MPP_X)
        mpp_y = _float_property(props, openslide.PROPERTY_NAME_MPP_Y)
        self.metadata_mpp: float | None = None
        if mpp_x and mpp_y:
            self.metadata_mpp = (mpp_x + mpp_y) / 2
        elif mpp_x or mpp_y:
            self.metadata_mpp = mpp_x or mpp_y
        self.ignored_metadata_mpp: float | None = None
        self._ignored_why = ""  # why, for the error of a slide left without a scale
        if mpp_x and mpp_y and abs(mpp_x - mpp_y) > NON_SQUARE_MPP * max(mpp_x, mpp_y):
            # square pixels are assumed everywhere; their mean would scale the slide wrongly (review ES)
            self.ignored_metadata_mpp, self.metadata_mpp = self.metadata_mpp, None
            self._ignored_why = (f"its metadata's x and y µm/px differ ({mpp_x:g} and {mpp_y:g}), where a "
                                 "microscope's pixels are square")
            if self._mpp_override is None:
                logger.warning("%s: ignoring the resolution in its metadata: its x and y µm/px differ (%g and %g), "
                               "where a microscope's pixels are square. Pass the level-0 resolution with "
                               "--slide-mpp (µm per pixel).", self.path, mpp_x, mpp_y)
        if self.metadata_mpp is not None and not PLAUSIBLE_MPP[0] <= self.metadata_mpp <= PLAUSIBLE_MPP[1]:
            self.ignored_metadata_mpp, self.metadata_mpp = self.metadata_mpp, None
            self._ignored_why = f"its metadata says {self._ignored_mpp_text()}, which is not a microscope's resolution"
            if self._mpp_override is None:
                logger.warning("%s: ignoring the resolution in its metadata (%s): not a microscope's (those are "
                               "%g-%g µm/px). Pass the level-0 resolution with --slide-mpp (µm per pixel).",
                               self.path, self._ignored_mpp_text(), *PLAUSIBLE_MPP)

    # -- metadata -----------------------------------------------------------------------------
    @property
    def dimensions(self) -> tuple[int, int]:
        """Level-0 (width, height) in pixels."""
        return tuple(self._slide.dimensions)

    @property
    def level_count(self) -> int:
        return self._slide.level_count

    @property
    def level_dimensions(self) -> tuple[tuple[int, int], ...]:
        return tuple(tuple(d) for d in self._slide.level_dimensions)

    @property
    def level_downsamples(self) -> tuple[float, ...]:
        return tuple(float(d) for d in self._slide.level_downsamples)

    def _ignored_mpp_text(self) -> str:
        props = self._slide.properties
        unit, res = props.get("tiff.ResolutionUnit"), props.get("tiff.XResolution")
        tag = f"{res} pixels per {unit} = " if unit in ("inch", "centimeter") and res else ""
        return f"{tag}{self.ignored_metadata_mpp:.6g} µm/px"

    @property
    def mpp_source(self) -> str:
        """Where ``mpp`` comes from: 'override', 'metadata', 'objective-power' or 'none'."""
        if self._mpp_override is not None:
            return "override"
        if self.metadata_mpp is not None:
            return "metadata"
        if self.objective_power is not None:
            return "objective-power"
        return "none"

    @property
    def mpp(self) -> float:
        """Level-0 resolution in µm per pixel (override, else metadata, else objective power)."""
        source = self.mpp_source
        if source == "override":
            return self._mpp_override
        if source == "metadata":
            return self.metadata_mpp
        if source == "objective-power":
            derived = magnification_to_mpp(self.objective_power, mpp_at_40x=self.mpp_at_40x)
            if PLAUSIBLE_MPP[0] <= derived <= PLAUSIBLE_MPP[1]:
                return derived
            # (review ES: an objective power of 4e8 gave 0.0000 µm/px and a petabyte allocation)
            ignored = (f" (its objective power {self.objective_power:g}x gives {derived:.6g} µm/px, which is not a "
                       f"microscope's resolution: those are {PLAUSIBLE_MPP[0]:g}-{PLAUSIBLE_MPP[1]:g} µm/px)")
            raise MissingResolutionError(
                f"{self.path}: the slide has no usable MPP{ignored}, so its physical scale is unknown. Fix: pass the "
                "level-0 resolution with --slide-mpp (µm per pixel, e.g. --slide-mpp 0.25; in a pipeline, [tile] "
                "slide_mpp).")
        ignored = f" ({self._ignored_why})" if self._ignored_why else ""
        raise MissingResolutionError(
            f"{self.path}: the slide has no MPP{ignored} and no objective power, so its physical scale is "
            "unknown. Fix: pass the level-0 resolution with --slide-mpp (µm per pixel, e.g. --slide-mpp 0.25; in a "
            "pipeline, [tile] slide_mpp)."
        )

    @property
    def properties(self) -> dict[str, str]:
        return dict(self._slide.properties)

    def plan(self, *, target_mpp: float, allow_upsample: bool | None = None) -> ReadPlan:
        """The pyramid level and residual scale that serve ``target_mpp``.

        Raises ResolutionError (naming the slide, both resolutions and ``--allow-upsample``) when
        ``target_mpp`` is finer than the slide's resolution, unless ``allow_upsample`` (default: the
        reader's own setting) is True.
        """
        allow = self.allow_upsample if allow_upsample is None else bool(allow_upsample)
        return plan_read(self.mpp, self.level_downsamples, target_mpp=target_mpp, allow_upsample=allow,
                         source=self.path)

    def check_pixels(self, *, size_px: int = 256) -> None:
        """Decode a ``size_px`` square at the centre of the highest- and the lowest-resolution level.

        Opening a slide reads only its header; a slide whose tile data is corrupt (OpenSlide's
        ``unreadable.svs``: "Bogus marker length") fails only here. Raises SlideReadError.
        """
        for level in sorted({0, self.level_count - 1}):
            w, h = self.level_dimensions[level]
            ds = self.level_downsamples[level]
            rw, rh = min(size_px, w), min(size_px, h)
            x_lv0 = int(((w - rw) // 2) * ds)
            y_lv0 = int(((h - rh) // 2) * ds)
            try:
                self._slide.read_region((x_lv0, y_lv0), level, (rw, rh))
            except (openslide.OpenSlideError, OSError) as exc:
                raise SlideReadError(
                    f"{self.path}: OpenSlide opens the slide but cannot decode its pixels at level {level} "
                    f"({exc}). Fix: the file is corrupt or truncated; re-copy or re-export it."
                ) from None

    # -- pixels -------------------------------------------------------------------------------
    def read_level(self, x_lv0: int, y_lv0: int, level: int, size: tuple[int, int]) -> np.ndarray:
        """RGB uint8 array (h, w, 3) of ``size`` = (w, h) pixels at ``level``, composited on white."""
        try:
            rgba = self._slide.read_region((int(x_lv0), int(y_lv0)), int(level), (int(size[0]), int(size[1])))
        except (openslide.OpenSlideError, OSError) as exc:
            raise SlideReadError(
                f"{self.path}: cannot read region at level-0 ({x_lv0}, {y_lv0}), level {level}, "
                f"size {size} ({exc}). Fix: the file is probably truncated or corrupt; re-copy it."
            ) from None
        if rgba.getchannel("A").getextrema()[0] == 255:
            return np.asarray(rgba.convert("RGB"))
        # Outside the scanned area OpenSlide returns transparent pixels: composite them on white.
        arr = np.asarray(rgba)
        a = arr[..., 3:4].astype(np.float32) / 255.0
        rgb = arr[..., :3].astype(np.float32) * a + 255.0 * (1.0 - a)
        return np.round(rgb).astype(np.uint8)

    def read_region(
        self, x_lv0: int, y_lv0: int, size_px: int | tuple[int, int], *, target_mpp: float,
        plan: ReadPlan | None = None,
    ) -> np.ndarray:
        """A patch of ``size_px`` target pixels whose top-left is (x_lv0, y_lv0) in level-0 pixels.

        Returns an RGB uint8 array of shape (h, w, 3) at ``target_mpp`` µm/px. The region is read
        from the plan's level and resized with area averaging (or bicubic when upsampling).
        """
        w, h = (size_px, size_px) if isinstance(size_px, int) else size_px
        plan = plan or self.plan(target_mpp=target_mpp)
        scale = plan.residual_scale
        w_lv = max(1, int(round(w * scale)))
        h_lv = max(1, int(round(h * scale)))
        region = self.read_level(x_lv0, y_lv0, plan.level, (w_lv, h_lv))
        if (w_lv, h_lv) == (w, h):
            return region
        resample = Image.Resampling.BOX if scale > 1 else Image.Resampling.BICUBIC
        return np.asarray(Image.fromarray(region).resize((w, h), resample=resample))

    def thumbnail(self, *, max_size_px: int = 1024) -> tuple[np.ndarray, float]:
        """An RGB thumbnail whose longer side is at most ``max_size_px``, and its downsample from level 0. OpenSlide
        reads it from the level nearest its size, whole; from a coarser one when that level is over
        :data:`MAX_THUMBNAIL_SOURCE_PX`, and SlideReadError when every level is (a huge slide without a pyramid
        asked for terabytes: review ES)."""
        w0, h0 = self.dimensions
        ds = max(w0, h0) / max_size_px
        size = (max(1, int(round(w0 / ds))), max(1, int(round(h0 / ds))))
        level = best = self._slide.get_best_level_for_downsample(ds)
        dims = self._slide.level_dimensions
        while dims[level][0] * dims[level][1] > MAX_THUMBNAIL_SOURCE_PX and level + 1 < len(dims):
            level += 1  # a coarser level, resized up (review ET: an SVS's 4x steps put 8192 px on a 1-Gpx level)
        lw, lh = dims[level]
        if lw * lh > MAX_THUMBNAIL_SOURCE_PX:
            raise SlideReadError(
                f"{self.path}: no pyramid level small enough to draw a thumbnail from: the smallest is level "
                f"{level}, {lw} x {lh} px, which would be read whole. Fix: give a pyramidal slide (e.g. `vips "
                "tiffsave IN OUT.tif --tile --pyramid --compression jpeg`).")
        try:
            if level == best:
                img = self._slide.get_thumbnail(size).convert("RGB")
            else:
                region = self._slide.read_region((0, 0), level, (lw, lh))  # as get_thumbnail composes it
                background = "#" + self._slide.properties.get(openslide.PROPERTY_NAME_BACKGROUND_COLOR, "ffffff")
                img = Image.new("RGB", region.size, background)
                img.paste(region, None, region)
                img = img.resize(size, Image.Resampling.BILINEAR)
        except (openslide.OpenSlideError, OSError) as exc:
            raise SlideReadError(
                f"{self.path}: cannot read a thumbnail ({exc}). Fix: the file is probably truncated "
                "or corrupt; re-copy it."
            ) from None
        if img.size != size:
            img = img.resize(size, Image.Resampling.BOX)
        return np.asarray(img), w0 / size[0]

    def close(self) -> None:
        self._slide.close()

    def __enter__(self) -> "SlideReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SlideReader({str(self.path)!r}, dims={self.dimensions}, levels={self.level_count})"


@register_reader("openslide")
def _openslide_reader(path, **kwargs) -> SlideReader:
    return SlideReader(path, **kwargs)


def open_slide(path: str | os.PathLike, *, reader: str = "openslide", **kwargs) -> SlideReader:
    """Open a slide with a registered reader (default: OpenSlide)."""
    if reader not in READERS:
        raise ValueError(f"unknown slide reader {reader!r}; registered readers: {', '.join(sorted(READERS))}.")
    return READERS[reader](path, **kwargs)
