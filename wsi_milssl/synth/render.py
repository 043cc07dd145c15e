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
from PIL import Image
from scipy import ndimage

from wsi_milssl.synth.layout import MAP_DOWNSAMPLE, SlideLayout

__all__ = ["Textures", "make_textures", "render_block"]

OD_HAEMATOXYLIN = np.array([0.650, 0.704, 0.286], np.float32)
OD_EOSIN = np.array([0.072, 0.990, 0.105], np.float32)
OD_BACKGROUND = np.array([0.025, 0.03, 0.02], np.float32)
BLOCK_MARGIN_PX = 40
TEXTURE_SIZE_PX = 512
# Pixels are rendered on a grid RENDER_DOWNSAMPLE times coarser than level 0 and interpolated up:
# 4x fewer pixels to compute, and level 0 keeps the slight softness of a real 40x scan.
RENDER_DOWNSAMPLE = 2
# Stain densities are quantised for a lookup table from (H, E) to RGB.
H_MAX, H_STEPS = 3.0, 1024
E_MAX, E_STEPS = 1.6, 512


@lru_cache(maxsize=1)
def _stain_lut() -> np.ndarray:
    """uint8 (H_STEPS * E_STEPS, 3): RGB of every quantised (H, E) pair over the background."""
    h = np.linspace(0, H_MAX, H_STEPS, dtype=np.float32)[:, None, None]
    e = np.linspace(0, E_MAX, E_STEPS, dtype=np.float32)[None, :, None]
    od = h * OD_HAEMATOXYLIN + e * OD_EOSIN + OD_BACKGROUND
    return np.round(255.0 * np.exp(-od)).astype(np.uint8).reshape(-1, 3)


class Textures:
    """Periodic stroma textures of one slide: ``fibre`` (oriented collagen) and ``grain`` (isotropic)."""

    def __init__(self, fibre: np.ndarray, grain: np.ndarray, noise: np.ndarray) -> None:
        self.fibre = fibre
        self.grain = grain
        self.noise = noise

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
    """Textures on the render grid (RENDER_DOWNSAMPLE level-0 pixels per texel)."""
    um = 1.0 / (layout.mpp * RENDER_DOWNSAMPLE)
    size = TEXTURE_SIZE_PX
    fibre = _periodic_noise(rng, size, 14 * um, 1.1 * um, layout.fibre_angle_rad)
    fibre = np.clip(0.5 + 0.45 * np.tanh(1.6 * fibre), 0, 1)
    grain = np.tanh(_periodic_noise(rng, size, 1.5 * um, 1.5 * um, 0.0))
    noise = rng.standard_normal((size, size)).astype(np.float32)
    return Textures(fibre=fibre.astype(np.float32), grain=grain.astype(np.float32), noise=noise)


def _map_image(layout: SlideLayout, name: str) -> Image.Image:
    """The coarse map ``name`` of ``layout`` as a float PIL image (cached on the layout)."""
    cache = layout.__dict__.setdefault("_pil_maps", {})
    if name not in cache:
        cache[name] = Image.fromarray(np.ascontiguousarray(getattr(layout, name), dtype=np.float32), mode="F")
    return cache[name]


def _upsample(layout: SlideLayout, name: str, rx0: int, ry0: int, rx1: int, ry1: int, r: int) -> np.ndarray:
    """Bilinear samples of a coarse map at the centres of render pixels [rx0, rx1) x [ry0, ry1)."""
    f = r / MAP_DOWNSAMPLE
    box = (rx0 * f, ry0 * f, rx1 * f, ry1 * f)
    img = _map_image(layout, name).resize((rx1 - rx0, ry1 - ry0), Image.Resampling.BILINEAR, box=box)
    return np.asarray(img)


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
    centre = 1.0 - 0.65 * vesicular
    profile = centre + (1.0 - centre) * np.clip((d - 0.5) / 0.35, 0.0, 1.0)
    return (edge * profile).astype(np.float32)


def _stamp_nuclei(h_map: np.ndarray, layout: SlideLayout, rx0: int, ry0: int, r: int) -> None:
    """Stamp the nuclei that reach render pixels [rx0, rx0 + w) x [ry0, ry0 + h) into ``h_map``."""
    nuc = layout.nuclei
    hh, ww = h_map.shape
    x0, y0, x1, y1 = rx0 * r, ry0 * r, (rx0 + ww) * r, (ry0 + hh) * r
    reach = float(nuc.semi_major_px.max()) + 2 * r if len(nuc) else 0.0
    sl = nuc.rows(y0 - reach, y1 + reach)
    xs = nuc.x_lv0[sl]
    sel = np.nonzero((xs >= x0 - reach) & (xs < x1 + reach))[0] + sl.start
    if len(sel) == 0:
        return
    a_q = np.maximum(np.round(nuc.semi_major_px[sel] * 2 / r), 2).astype(int)
    b_q = np.maximum(np.round(nuc.semi_minor_px[sel] * 2 / r), 2).astype(int)
    ang_q = (np.round(nuc.angle_rad[sel] / np.pi * 16).astype(int)) % 16
    ves_q = np.round(nuc.vesicular[sel] * 4).astype(int)
    # render pixel i is centred on level-0 (i + 0.5) * r
    cx = np.round(nuc.x_lv0[sel] / r - 0.5).astype(int) - rx0
    cy = np.round(nuc.y_lv0[sel] / r - 0.5).astype(int) - ry0
    inten = nuc.intensity[sel]
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
    """RGB uint8 pixels (y1 - y0, x1 - x0, 3) of the level-0 block [x0, x1) x [y0, y1).

    The block is rendered with a margin on the coarse render grid and interpolated to level 0, so
    neighbouring blocks join without seams.
    """
    r = RENDER_DOWNSAMPLE
    m = BLOCK_MARGIN_PX
    n_rx, n_ry = -(-layout.width_px // r), -(-layout.height_px // r)
    rx0, ry0 = max(0, (x0 - m) // r), max(0, (y0 - m) // r)
    rx1, ry1 = min(n_rx, -(-(x1 + m) // r)), min(n_ry, -(-(y1 + m) // r))

    def up(name: str) -> np.ndarray:
        return _upsample(layout, name, rx0, ry0, rx1, ry1, r)

    tissue, tumor, follicle = up("tissue"), up("tumor"), up("follicle")
    fibre = Textures.tile(textures.fibre, rx0, ry0, rx1, ry1)
    grain = Textures.tile(textures.grain, rx0, ry0, rx1, ry1)
    noise = Textures.tile(textures.noise, rx0 + noise_seed[-1] % 97, ry0 + noise_seed[-2] % 89,
                          rx1 + noise_seed[-1] % 97, ry1 + noise_seed[-2] % 89)

    # Eosin: fibrous collagen in normal stroma; tumour replaces it with evenly stained cytoplasm
    # (loss of the stromal pattern); follicles are packed cells with little stroma between.
    stroma_e = 0.20 + 0.36 * fibre
    tumour_e = 0.32 + 0.06 * grain
    eosin = tissue * (stroma_e + tumor * (tumour_e - stroma_e)) * (1.0 - 0.35 * follicle)
    haem = tissue * (0.045 + 0.05 * tumor + 0.015 * grain)
    nuclei = np.zeros_like(haem)
    _stamp_nuclei(nuclei, layout, rx0, ry0, r)
    np.maximum(haem, nuclei, out=haem)
    eosin += 0.02 * noise
    haem += 0.012 * noise
    np.maximum(eosin, 0.0, out=eosin)
    np.maximum(haem, 0.0, out=haem)

    scale = up("stain")
    if layout.fold.any():
        scale = scale * (1.0 + 0.9 * up("fold"))
    if layout.faint.any():
        scale = scale * (1.0 - 0.5 * up("faint"))
    haem *= scale
    eosin *= scale
    if layout.blur.any():
        blur = up("blur")
        if blur.max() > 0.01:
            sigma = 2.5 / (layout.mpp * r)
            haem += blur * (ndimage.gaussian_filter(haem, sigma, mode="nearest") - haem)
            eosin += blur * (ndimage.gaussian_filter(eosin, sigma, mode="nearest") - eosin)

    pen = up("pen") if layout.pen.any() else None
    if pen is not None and pen.max() > 0.0:
        od = haem[..., None] * OD_HAEMATOXYLIN + eosin[..., None] * OD_EOSIN + OD_BACKGROUND
        od += pen[..., None] * layout.pen_od
        rgb = np.clip(np.round(255.0 * np.exp(-od)), 0, 255).astype(np.uint8)
    else:
        hq = np.clip(haem * ((H_STEPS - 1) / H_MAX) + 0.5, 0, H_STEPS - 1).astype(np.int32)
        eq = np.clip(eosin * ((E_STEPS - 1) / E_MAX) + 0.5, 0, E_STEPS - 1).astype(np.int32)
        hq *= E_STEPS
        hq += eq
        rgb = _stain_lut()[hq]

    # Interpolate to level 0 and cut the block out of the margin.
    ox, oy = rx0 * r, ry0 * r
    big = Image.fromarray(rgb).resize(((rx1 - rx0) * r, (ry1 - ry0) * r), Image.Resampling.BILINEAR)
    return np.asarray(big)[y0 - oy : y1 - oy, x0 - ox : x1 - ox]
