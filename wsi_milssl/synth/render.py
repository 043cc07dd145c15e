"""Render pixels of a synthetic slide, one block at a time, from its :class:`SlideLayout`.

Colour follows the Beer-Lambert stain model used for H&E colour deconvolution: each pixel's optical
density is ``H * OD_haematoxylin + E * OD_eosin`` (Ruifrok & Johnston stain vectors), optionally
thickened by a fold, thinned in a faint region, inked by a pen stroke and blurred, and
``RGB = 255 * exp(-OD)``. Any block can be rendered independently (with a margin so that nuclei and
blur cross block borders seamlessly), so memory does not grow with slide size.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from scipy import ndimage

from wsi_milssl.synth.layout import MAP_DOWNSAMPLE, SlideLayout

__all__ = ["Textures", "make_textures", "render_block"]

OD_HAEMATOXYLIN = np.array([0.650, 0.704, 0.286], np.float32)
OD_EOSIN = np.array([0.072, 0.990, 0.105], np.float32)
OD_BACKGROUND = np.array([0.025, 0.03, 0.02], np.float32)
BLOCK_MARGIN_PX = 40
TEXTURE_SIZE_PX = 512


class Textures:
    """Periodic stroma textures of one slide: ``fibre`` (oriented collagen) and ``grain`` (isotropic)."""

    def __init__(self, fibre: np.ndarray, grain: np.ndarray) -> None:
        self.fibre = fibre
        self.grain = grain

    @staticmethod
    def tile(texture: np.ndarray, x0: int, y0: int, x1: int, y1: int) -> np.ndarray:
        t = texture.shape[0]
        rows = texture[np.arange(y0, y1) % t]
        reps = -(-(x1 - x0 + (x0 % t)) // t)
        return np.tile(rows, (1, reps))[:, x0 % t : x0 % t + (x1 - x0)]


def _periodic_noise(rng, size: int, sigma_along_px: float, sigma_across_px: float, angle: float) -> np.ndarray:
    k = np.fft.fftfreq(size).astype(np.float32)
    ky, kx = np.meshgrid(k, k, indexing="ij")
    c, s = np.cos(angle), np.sin(angle)
    k_along = kx * c + ky * s
    k_across = -kx * s + ky * c
    gain = np.exp(-2 * np.pi**2 * ((sigma_along_px * k_along) ** 2 + (sigma_across_px * k_across) ** 2))
    noise = np.fft.ifft2(np.fft.fft2(rng.standard_normal((size, size))) * gain).real.astype(np.float32)
    return (noise - noise.mean()) / (noise.std() + 1e-8)


def make_textures(rng: np.random.Generator, layout: SlideLayout) -> Textures:
    um = 1.0 / layout.mpp
    size = TEXTURE_SIZE_PX
    fibre = _periodic_noise(rng, size, 14 * um, 1.1 * um, layout.fibre_angle_rad)
    fibre = np.clip(0.5 + 0.45 * np.tanh(1.6 * fibre), 0, 1)
    grain = np.tanh(_periodic_noise(rng, size, 1.5 * um, 1.5 * um, 0.0))
    return Textures(fibre=fibre.astype(np.float32), grain=grain.astype(np.float32))


def _interp_axis(n_map: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Indices and weights that interpolate map cells linearly at level-0 pixel centres [start, stop)."""
    pos = (np.arange(start, stop, dtype=np.float32) + 0.5) / MAP_DOWNSAMPLE - 0.5
    pos = np.clip(pos, 0, n_map - 1)
    i0 = np.floor(pos).astype(np.int64)
    i1 = np.minimum(i0 + 1, n_map - 1)
    return i0, i1, (pos - i0).astype(np.float32)


def _upsample(map_: np.ndarray, ys, xs) -> np.ndarray:
    y0, y1, wy = ys
    x0, x1, wx = xs
    rows = map_[y0] * (1 - wy)[:, None] + map_[y1] * wy[:, None]
    return rows[:, x0] * (1 - wx) + rows[:, x1] * wx


@lru_cache(maxsize=4096)
def _kernel(a_q: int, b_q: int, angle_q: int, ves_q: int) -> np.ndarray:
    """A nucleus footprint: semi-axes a_q/2, b_q/2 px, angle angle_q*pi/16, vesicular ves_q/4.

    Values are the haematoxylin density relative to the nucleus' intensity, with a one-pixel
    antialiased edge; vesicular nuclei are paler inside with a darker rim.
    """
    a, b = a_q / 2.0, b_q / 2.0
    angle = angle_q * np.pi / 16
    vesicular = ves_q / 4.0
    half = int(np.ceil(a)) + 1
    yy, xx = np.mgrid[-half : half + 1, -half : half + 1].astype(np.float32)
    c, s = np.cos(angle), np.sin(angle)
    u = (xx * c + yy * s) / a
    v = (-xx * s + yy * c) / b
    d = np.sqrt(u * u + v * v)
    edge = np.clip((1.0 - d) * b + 0.5, 0.0, 1.0)
    centre = 1.0 - 0.55 * vesicular
    profile = centre + (1.0 - centre) * np.clip((d - 0.5) / 0.35, 0.0, 1.0)
    return (edge * profile).astype(np.float32)


def _stamp_nuclei(h_map: np.ndarray, layout: SlideLayout, x0: int, y0: int, x1: int, y1: int) -> None:
    nuc = layout.nuclei
    reach = float(nuc.semi_major_px.max()) + 2 if len(nuc) else 0.0
    sl = nuc.rows(y0 - reach, y1 + reach)
    xs = nuc.x_lv0[sl]
    sel = np.nonzero((xs >= x0 - reach) & (xs < x1 + reach))[0] + sl.start
    if len(sel) == 0:
        return
    a_q = np.maximum(np.round(nuc.semi_major_px[sel] * 2), 2).astype(int)
    b_q = np.maximum(np.round(nuc.semi_minor_px[sel] * 2), 2).astype(int)
    ang_q = (np.round(nuc.angle_rad[sel] / np.pi * 16).astype(int)) % 16
    ves_q = np.round(nuc.vesicular[sel] * 4).astype(int)
    cx = np.round(nuc.x_lv0[sel]).astype(int) - x0
    cy = np.round(nuc.y_lv0[sel]).astype(int) - y0
    inten = nuc.intensity[sel]
    hh, ww = h_map.shape
    for i in range(len(sel)):
        k = _kernel(int(a_q[i]), int(b_q[i]), int(ang_q[i]), int(ves_q[i]))
        half = k.shape[0] // 2
        ya, yb = cy[i] - half, cy[i] + half + 1
        xa, xb = cx[i] - half, cx[i] + half + 1
        ka, kb, kc, kd = max(0, -ya), k.shape[0] - max(0, yb - hh), max(0, -xa), k.shape[1] - max(0, xb - ww)
        if ka >= kb or kc >= kd:
            continue
        region = h_map[max(ya, 0) : min(yb, hh), max(xa, 0) : min(xb, ww)]
        np.maximum(region, k[ka:kb, kc:kd] * inten[i], out=region)


def render_block(
    layout: SlideLayout, textures: Textures, x0: int, y0: int, x1: int, y1: int, *, noise_seed: tuple[int, ...]
) -> np.ndarray:
    """RGB uint8 pixels (y1 - y0, x1 - x0, 3) of the level-0 block [x0, x1) x [y0, y1)."""
    m = BLOCK_MARGIN_PX
    xa, ya = max(0, x0 - m), max(0, y0 - m)
    xb, yb = min(layout.width_px, x1 + m), min(layout.height_px, y1 + m)
    ys = _interp_axis(layout.tissue.shape[0], ya, yb)
    xs = _interp_axis(layout.tissue.shape[1], xa, xb)

    tissue = _upsample(layout.tissue, ys, xs)
    tumor = _upsample(layout.tumor, ys, xs)
    follicle = _upsample(layout.follicle, ys, xs)
    fibre = Textures.tile(textures.fibre, xa, ya, xb, yb)
    grain = Textures.tile(textures.grain, xa, ya, xb, yb)

    # Eosin: fibrous collagen in normal stroma; tumour replaces it with evenly stained cytoplasm
    # (loss of the stromal pattern); follicles are packed cells with little stroma between.
    stroma_e = 0.20 + 0.36 * fibre
    tumour_e = 0.36 + 0.06 * grain
    eosin = tissue * (stroma_e + tumor * (tumour_e - stroma_e)) * (1.0 - 0.35 * follicle)
    haem = tissue * (0.04 + 0.03 * grain * 0.5 + 0.05 * tumor)
    nuclei = np.zeros_like(haem)
    _stamp_nuclei(nuclei, layout, xa, ya, xb, yb)
    haem = np.maximum(haem, nuclei)

    od = haem[..., None] * OD_HAEMATOXYLIN + eosin[..., None] * OD_EOSIN + OD_BACKGROUND
    if layout.fold.any():
        od *= (1.0 + 0.9 * _upsample(layout.fold, ys, xs))[..., None]
    if layout.faint.any():
        od *= (1.0 - 0.5 * _upsample(layout.faint, ys, xs))[..., None]
    if layout.pen.any():
        od += _upsample(layout.pen, ys, xs)[..., None] * layout.pen_od
    if layout.blur.any():
        blur = _upsample(layout.blur, ys, xs)
        if blur.max() > 0.01:
            sigma = 2.5 / layout.mpp
            blurred = ndimage.gaussian_filter(od, (sigma, sigma, 0), mode="nearest")
            od += blur[..., None] * (blurred - od)

    rng = np.random.default_rng(noise_seed)
    out = 255.0 * np.exp(-od[y0 - ya : y1 - ya, x0 - xa : x1 - xa])
    out += rng.normal(0.0, 1.5, out.shape).astype(np.float32)
    return np.clip(np.round(out), 0, 255).astype(np.uint8)
