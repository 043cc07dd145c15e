"""The probability map on the patch grid, and its overlay on the slide thumbnail.

Geometry (level-0 pixels): grid cell (r, c) is the patch with top-left
``(origin_x + c * stride_lv0, origin_y + r * stride_lv0)`` and side ``patch_size_lv0``; its
centre is that corner plus ``patch_size_lv0 / 2``. A thumbnail pixel (i, j) with downsample
(dx, dy) covers level-0 ``[j dx, (j+1) dx) x [i dy, (i+1) dy)`` and takes the value of the cell
whose centre is nearest to the pixel centre ``((j + 0.5) dx, (i + 0.5) dy)`` when that centre lies
inside the cell's patch square, else none. With stride = patch size this is simply the patch that
contains the pixel centre; with overlapping patches each pixel shows the patch centred nearest to it.

The overlay PNG is the thumbnail (top-left, same pixels and downsample as the thumbnail) with the
colour blended in where the probability reaches the threshold (the H&E stays visible elsewhere and,
at ``alpha`` < 1, beneath), an optional footer band below it (title, scale bar) and an optional
colour bar panel on the right; the PNG's ``wsi-milssl`` text chunk records the downsample and grid
geometry as JSON.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from wsi_milssl.atomic import atomic_open
from wsi_milssl.inference.colormaps import COLORMAPS, apply_colormap, colormap_lut, register_colormap

__all__ = [
    "COLORMAPS",
    "register_colormap",
    "probability_grid",
    "grid_indices",
    "pixel_cells",
    "sample_grid",
    "smooth_grid",
    "render_overlay",
    "draw_outlines",
    "colorbar_panel",
    "footer_panel",
    "scale_bar_length_um",
    "write_png",
    "PNG_TEXT_KEY",
]

PNG_TEXT_KEY = "wsi-milssl"


def grid_indices(coords_lv0: np.ndarray, *, origin_lv0: tuple[int, int], stride_lv0: int) -> np.ndarray:
    """int64 (N, 2) grid (row, col) of level-0 top-left patch coordinates int (N, 2).

    Raises ValueError when a coordinate is not on the grid (offset from the origin not a multiple of
    the stride).
    """
    coords = np.asarray(coords_lv0, dtype=np.int64).reshape(-1, 2)
    off = coords - np.asarray(origin_lv0, dtype=np.int64)
    if len(coords) and ((off % stride_lv0) != 0).any():
        bad = coords[((off % stride_lv0) != 0).any(axis=1)][0]
        raise ValueError(f"patch at level-0 {bad.tolist()} is not on the grid of stride {stride_lv0} "
                         f"from origin {list(origin_lv0)}.")
    cr = off // stride_lv0
    return np.stack([cr[:, 1], cr[:, 0]], axis=1)


def probability_grid(coords_lv0: np.ndarray, probs: np.ndarray, *, origin_lv0: tuple[int, int], stride_lv0: int,
                     shape: tuple[int, int]) -> np.ndarray:
    """float32 (rows, cols) map with ``probs[k]`` at the cell of ``coords_lv0[k]``; NaN where no patch."""
    rows, cols = int(shape[0]), int(shape[1])
    out = np.full((rows, cols), np.nan, np.float32)
    rc = grid_indices(coords_lv0, origin_lv0=origin_lv0, stride_lv0=stride_lv0)
    if len(rc) == 0:
        return out
    if rc.min() < 0 or rc[:, 0].max() >= rows or rc[:, 1].max() >= cols:
        raise ValueError(f"patch coordinates fall outside the {rows} x {cols} grid.")
    out[rc[:, 0], rc[:, 1]] = np.asarray(probs, dtype=np.float32)
    return out


def _axis_cells(n_px: int, ds: float, *, origin: int, stride: int, patch: int, n_cells: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per pixel along one axis: nearest cell index (clipped), whether the pixel centre is inside that
    cell's patch, and the continuous cell coordinate (0 at the centre of cell 0)."""
    centre = (np.arange(n_px, dtype=np.float64) + 0.5) * ds
    u = (centre - origin - patch / 2.0) / stride
    cell = np.clip(np.floor(u + 0.5), 0, max(n_cells - 1, 0)).astype(np.int64)
    start = origin + cell * stride
    inside = (centre >= start) & (centre < start + patch) & (n_cells > 0)
    return cell, inside, u


def pixel_cells(image_hw: tuple[int, int], downsample_xy: tuple[float, float], *, origin_lv0: tuple[int, int],
                stride_lv0: int, patch_size_lv0: int, grid_shape: tuple[int, int]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For an image of ``image_hw`` = (h, w) pixels at ``downsample_xy`` level-0 px per pixel:
    (row int64 (h,), row_inside bool (h,), col int64 (w,), col_inside bool (w,)) — the grid cell of
    each pixel row/column (see the module docstring) and whether the pixel centre is in its patch."""
    h, w = image_hw
    rows, cols = grid_shape
    c, cin, _ = _axis_cells(w, downsample_xy[0], origin=origin_lv0[0], stride=stride_lv0, patch=patch_size_lv0,
                            n_cells=cols)
    r, rin, _ = _axis_cells(h, downsample_xy[1], origin=origin_lv0[1], stride=stride_lv0, patch=patch_size_lv0,
                            n_cells=rows)
    return r, rin, c, cin


def smooth_grid(grid: np.ndarray, sigma_cells: float) -> tuple[np.ndarray, np.ndarray]:
    """Normalised Gaussian smoothing of a map with NaN holes: (sum of w * p, sum of w) over patches,
    each float64 (rows, cols); their ratio is the smoothed map (holes do not pull it towards 0)."""
    from scipy.ndimage import gaussian_filter

    valid = np.isfinite(grid)
    num = gaussian_filter(np.where(valid, grid, 0.0).astype(np.float64), sigma_cells, mode="constant")
    den = gaussian_filter(valid.astype(np.float64), sigma_cells, mode="constant")
    return num, den


def sample_grid(grid: np.ndarray, image_hw: tuple[int, int], downsample_xy: tuple[float, float], *,
                origin_lv0: tuple[int, int], stride_lv0: int, patch_size_lv0: int,
                smooth_sigma_cells: float = 0.0) -> np.ndarray:
    """float32 (h, w): the map's value at every pixel centre of an image over the slide; NaN where no patch.

    Without smoothing each pixel takes its cell's value (nearest-centre rule). With
    ``smooth_sigma_cells`` > 0 the map is Gaussian-smoothed (over patches only) and interpolated
    bilinearly between cell centres, still NaN where the pixel's own cell has no patch.
    """
    grid = np.asarray(grid, dtype=np.float32)
    h, w = image_hw
    rows, cols = grid.shape
    r, rin, c, cin = pixel_cells(image_hw, downsample_xy, origin_lv0=origin_lv0, stride_lv0=stride_lv0,
                                 patch_size_lv0=patch_size_lv0, grid_shape=grid.shape)
    if rows == 0 or cols == 0:
        return np.full((h, w), np.nan, np.float32)
    values = grid[r[:, None], c[None, :]]
    values = np.where(rin[:, None] & cin[None, :], values, np.nan).astype(np.float32)
    if smooth_sigma_cells > 0:
        from scipy.ndimage import map_coordinates

        num, den = smooth_grid(grid, smooth_sigma_cells)
        _, _, u = _axis_cells(w, downsample_xy[0], origin=origin_lv0[0], stride=stride_lv0, patch=patch_size_lv0,
                              n_cells=cols)
        _, _, v = _axis_cells(h, downsample_xy[1], origin=origin_lv0[1], stride=stride_lv0, patch=patch_size_lv0,
                              n_cells=rows)
        smooth = np.empty((h, w), np.float32)
        step = max(1, (1 << 22) // max(w, 1))  # rows per block: bounded memory for large thumbnails
        for i0 in range(0, h, step):
            vv, uu = np.meshgrid(v[i0:i0 + step], u, indexing="ij")
            at = np.stack([vv.ravel(), uu.ravel()])
            n = map_coordinates(num, at, order=1, mode="nearest").reshape(vv.shape)
            d = map_coordinates(den, at, order=1, mode="nearest").reshape(vv.shape)
            with np.errstate(invalid="ignore", divide="ignore"):
                smooth[i0:i0 + step] = np.where(d > 1e-12, n / np.maximum(d, 1e-12), np.nan)
        values = np.where(np.isfinite(values), smooth, np.nan).astype(np.float32)
    return values


def _mask_at_pixels(mask: np.ndarray, mask_downsample_xy: tuple[float, float], image_hw: tuple[int, int],
                    downsample_xy: tuple[float, float]) -> np.ndarray:
    """bool (h, w): a level-0-registered mask sampled at the pixel centres of another image."""
    h, w = image_hw
    mh, mw = mask.shape
    xs = np.clip(np.floor((np.arange(w) + 0.5) * downsample_xy[0] / mask_downsample_xy[0]), 0, mw - 1).astype(np.intp)
    ys = np.clip(np.floor((np.arange(h) + 0.5) * downsample_xy[1] / mask_downsample_xy[1]), 0, mh - 1).astype(np.intp)
    return np.asarray(mask, dtype=bool)[ys[:, None], xs[None, :]]


def _hex_rgb(color: str) -> tuple[int, int, int]:
    text = color.lstrip("#")
    return int(text[0:2], 16), int(text[2:4], 16), int(text[4:6], 16)


def draw_outlines(image: np.ndarray, geometry, downsample_xy: tuple[float, float], *, color: str = "#000000",
                  width_px: int = 3) -> np.ndarray:
    """Draw the exterior and hole rings of a shapely (multi)polygon in level-0 pixels onto an RGB
    uint8 image at ``downsample_xy``; returns a new image."""
    import shapely

    if geometry is None or geometry.is_empty:
        return image
    img = Image.fromarray(np.ascontiguousarray(image))
    draw = ImageDraw.Draw(img)
    rgb = _hex_rgb(color)
    dx, dy = downsample_xy
    for poly in shapely.get_parts(geometry):
        if poly.geom_type != "Polygon" or poly.is_empty:
            continue
        for ring in (poly.exterior, *poly.interiors):
            xy = np.asarray(ring.coords, dtype=np.float64)
            pts = [(float(x) / dx - 0.5, float(y) / dy - 0.5) for x, y in xy]
            if len(pts) >= 2:
                draw.line(pts, fill=rgb, width=int(width_px), joint="curve")
    return np.asarray(img)


@functools.lru_cache(maxsize=1)
def _font_file() -> str | None:
    """matplotlib's DejaVu Sans (``mpl-data/fonts/ttf/DejaVuSans.ttf``), which draws ``µ`` and the accented
    letters of slide names; None when it is not there. (Pillow's built-in font has ASCII only: other
    characters come out as boxes.)"""
    try:
        import matplotlib
    except ImportError:
        return None
    path = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"
    return str(path) if path.is_file() else None


def _font(size: int):
    """The labels' font at ``size`` px: DejaVu Sans (:func:`_font_file`), else Pillow's built-in font."""
    path = _font_file()
    if path is not None:
        try:
            return ImageFont.truetype(path, size)
        except (OSError, ImportError):  # unreadable, or Pillow without FreeType
            pass
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1
        return ImageFont.load_default()


def _draws_unicode(font) -> bool:
    """Whether ``font`` is DejaVu Sans (draws ``µ``), not Pillow's ASCII-only built-in font."""
    return _font_file() is not None and getattr(font, "path", None) == _font_file()


def _text(draw: ImageDraw.ImageDraw, xy: tuple[float, float], text: str, *, font, anchor: str) -> None:
    try:
        draw.text(xy, text, fill=(0, 0, 0), font=font, anchor=anchor)
    except (ValueError, TypeError):  # bitmap fonts of old Pillow releases take no anchor
        draw.text(xy, text, fill=(0, 0, 0), font=font)


def colorbar_panel(height_px: int, *, colormap: str, vmin: float = 0.0, vmax: float = 1.0,
                   label: str = "P(tumour)", threshold: float | None = None) -> np.ndarray:
    """RGB uint8 (height_px, W, 3) white panel with a vertical colour bar (vmax at the top) and ticks. With
    ``threshold`` (the overlay's: lower values are not painted) the bar is white below it, with a tick there."""
    height_px = int(height_px)
    font_px = int(np.clip(round(height_px / 40), 9, 28))
    width = int(font_px * 5.5)
    panel = Image.new("RGB", (width, height_px), (255, 255, 255))
    draw = ImageDraw.Draw(panel)
    font = _font(font_px)
    top = font_px * 2
    bottom = height_px - font_px
    bar_x0, bar_x1 = font_px // 2, font_px // 2 + max(6, font_px)
    n = max(bottom - top, 2)
    if bottom > top:
        lut = colormap_lut(colormap, n)[::-1].copy()  # vmax at the top
        if threshold is not None and vmin < threshold:
            row_values = vmax - (vmax - vmin) * np.arange(n) / max(n - 1, 1)
            lut[row_values < threshold] = 255  # as the overlay leaves them: unpainted
        bar = np.repeat(lut[:, None, :], bar_x1 - bar_x0, axis=1)
        panel.paste(Image.fromarray(bar), (bar_x0, top))
        draw.rectangle((bar_x0, top, bar_x1 - 1, top + n - 1), outline=(0, 0, 0))
        fracs = [0.0, 0.25, 0.5, 0.75, 1.0]
        if threshold is not None and vmin < threshold < vmax:
            cut = (threshold - vmin) / (vmax - vmin)
            fracs = sorted({f for f in fracs if abs(f - cut) >= 0.1} | {cut})
        for frac in fracs:
            y = top + (n - 1) * (1.0 - frac)
            value = vmin + frac * (vmax - vmin)
            draw.line((bar_x1, y, bar_x1 + font_px // 2, y), fill=(0, 0, 0))
            _text(draw, (bar_x1 + font_px // 2 + 2, y), f"{value:.2f}", font=font, anchor="lm")
    _text(draw, (2, font_px // 2), label, font=_font(max(8, int(font_px * 0.8))), anchor="lt")
    return np.asarray(panel)


#: Scale-bar lengths to choose from (µm).
_SCALE_BAR_UM = (10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


def scale_bar_length_um(width_px: int, um_per_px: float, *, fraction: float = 0.2) -> float:
    """The round length (µm, from 10 µm to 5 cm) closest to ``fraction`` of an image ``width_px`` wide,
    no longer than half the width."""
    target = width_px * um_per_px * fraction
    fits = [v for v in _SCALE_BAR_UM if v / um_per_px <= width_px / 2] or [_SCALE_BAR_UM[0]]
    return float(min(fits, key=lambda v: abs(np.log(v / target))))


def _um_text(um: float, font) -> str:
    """The scale bar's label in ``font``: ``100 µm``, ``2 mm``; ``100 um`` in a font without ``µ``."""
    if um >= 1000:
        return f"{um / 1000:g} mm"
    return f"{um:g} {'µm' if _draws_unicode(font) else 'um'}"


def footer_panel(width_px: int, *, title: str | None = None, um_per_px: float | None = None) -> np.ndarray:
    """RGB uint8 (h, width_px, 3) white band: ``title`` on the left, and with ``um_per_px`` (µm per
    pixel of the image above) a scale bar of :func:`scale_bar_length_um` on the right, labelled."""
    font_px = int(np.clip(round(width_px / 60), 10, 28))
    height = font_px * 2 + 4
    panel = Image.new("RGB", (int(width_px), height), (255, 255, 255))
    draw = ImageDraw.Draw(panel)
    font = _font(font_px)
    right = int(width_px) - font_px // 2
    if um_per_px is not None and um_per_px > 0:
        length_um = scale_bar_length_um(width_px, um_per_px)
        bar_px = max(1, int(round(length_um / um_per_px)))
        x1 = right
        x0 = x1 - bar_px
        y = height - font_px // 2 - 2
        draw.rectangle((x0, y - max(2, font_px // 5), x1, y), fill=(0, 0, 0))
        label = _um_text(length_um, font)
        half_text = draw.textlength(label, font=font) / 2  # centred on the bar, but inside the image
        centre = min(max((x0 + x1) / 2, half_text + 1), int(width_px) - half_text - 1)
        _text(draw, (centre, y - max(2, font_px // 5) - 2), label, font=font, anchor="mb")
        right = min(x0, centre - half_text) - font_px
    if title:
        text = title
        while len(text) > 4 and draw.textlength(text, font=font) > max(right - font_px // 2, 8):
            text = text[:-4] + "..."
        _text(draw, (font_px // 2, height // 2), text, font=font, anchor="lm")
    return np.asarray(panel)


def render_overlay(
    grid: np.ndarray,
    thumbnail: np.ndarray,
    *,
    downsample_xy: tuple[float, float],
    origin_lv0: tuple[int, int],
    stride_lv0: int,
    patch_size_lv0: int,
    colormap: str = "viridis",
    alpha: float = 0.5,
    vmin: float = 0.0,
    vmax: float = 1.0,
    threshold: float = 0.0,
    smooth_sigma_cells: float = 0.0,
    tissue_mask: np.ndarray | None = None,
    tissue_downsample_xy: tuple[float, float] | None = None,
    outlines=None,
    outline_color: str = "#000000",
    outline_width_px: int = 3,
    colorbar: bool = True,
    title: str | None = None,
    scale_bar_um_per_px: float | None = None,
) -> np.ndarray:
    """RGB uint8 (h, w [+ bar], 3): ``thumbnail`` (h, w, 3) with the probability map blended in.

    ``grid`` float (rows, cols) probabilities (NaN = no patch) on the grid given by ``origin_lv0``,
    ``stride_lv0`` and ``patch_size_lv0`` (level-0 px); ``downsample_xy`` level-0 px per thumbnail
    pixel. A pixel is coloured when its value is finite, at least ``threshold`` and (with a
    ``tissue_mask`` bool (mh, mw) at ``tissue_downsample_xy``) on tissue: colour =
    colormap((p - vmin) / (vmax - vmin)), blended with weight ``alpha``. ``outlines``: a shapely
    geometry in level-0 px drawn on top. With ``title`` or ``scale_bar_um_per_px`` (µm per thumbnail
    pixel) a footer band (:func:`footer_panel`) is appended below the thumbnail, so nothing covers the
    tissue; the colour bar panel is appended on the right. The thumbnail keeps its place at (0, 0).
    """
    thumb = np.asarray(thumbnail)
    if thumb.dtype != np.uint8 or thumb.ndim != 3 or thumb.shape[2] != 3:
        raise ValueError(f"thumbnail must be RGB uint8 (h, w, 3); got {thumb.dtype} {thumb.shape}.")
    if colormap not in COLORMAPS:
        raise ValueError(f"unknown colour map {colormap!r}; registered: {', '.join(sorted(COLORMAPS))}.")
    h, w = thumb.shape[:2]
    values = sample_grid(grid, (h, w), downsample_xy, origin_lv0=origin_lv0, stride_lv0=stride_lv0,
                         patch_size_lv0=patch_size_lv0, smooth_sigma_cells=smooth_sigma_cells)
    paint = np.isfinite(values)
    paint &= np.where(paint, values, -np.inf) >= threshold
    if tissue_mask is not None:
        if tissue_downsample_xy is None:
            raise ValueError("tissue_downsample_xy is required with tissue_mask.")
        paint &= _mask_at_pixels(tissue_mask, tissue_downsample_xy, (h, w), downsample_xy)
    out = thumb.copy()
    if paint.any():
        norm = (values[paint].astype(np.float64) - vmin) / (vmax - vmin)
        colors = apply_colormap(norm, colormap).astype(np.float32)
        blended = thumb[paint].astype(np.float32) * (1.0 - alpha) + colors * alpha
        out[paint] = np.clip(np.round(blended), 0, 255).astype(np.uint8)
    if outlines is not None:
        out = draw_outlines(out, outlines, downsample_xy, color=outline_color, width_px=outline_width_px)
    if title or scale_bar_um_per_px:
        out = np.concatenate([out, footer_panel(w, title=title, um_per_px=scale_bar_um_per_px)], axis=0)
    if colorbar:
        bar = colorbar_panel(h, colormap=colormap, vmin=vmin, vmax=vmax, threshold=threshold)
        if out.shape[0] > h:
            bar = np.concatenate([bar, np.full((out.shape[0] - h, bar.shape[1], 3), 255, np.uint8)], axis=0)
        out = np.concatenate([out, bar], axis=1)
    return out


def write_png(image: np.ndarray, path: str | os.PathLike, *, metadata: Mapping[str, Any] | None = None) -> Path:
    """Write an RGB uint8 image as PNG atomically, with ``metadata`` as JSON in the ``wsi-milssl`` text chunk."""
    from PIL.PngImagePlugin import PngInfo

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    info = PngInfo()
    if metadata:
        info.add_text(PNG_TEXT_KEY, json.dumps(dict(metadata), sort_keys=True))
    with atomic_open(path, "wb") as fh:
        Image.fromarray(np.ascontiguousarray(image)).save(fh, format="PNG", pnginfo=info, compress_level=3)
    return path
