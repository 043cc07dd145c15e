"""The layout of one synthetic slide: tissue, confounders, lesions and nuclei, decided before any pixel.

Everything here is a deterministic function of a seeded ``numpy.random.Generator``. Region fields
live on a coarse *map* grid (``MAP_DOWNSAMPLE`` level-0 pixels per map pixel); lesions are exact
polygons in level-0 pixels (they become the ASAP XML annotation); nuclei are points with a kind and a
shape, placed by thinning Poisson candidates with the region fields.

The biology is a fair exam rather than a colour test: tumour and normal tissue share one stain
palette and differ in structure (nuclear size, density, pleomorphism, vesicular chromatin, loss of
the fibrous stroma), while every slide may carry tumour-like confounders: lymphocyte-dense follicles
(darker than tumour), tissue folds, pen strokes, blurred and faint regions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from matplotlib.path import Path as MplPath
from scipy import ndimage

__all__ = ["MAP_DOWNSAMPLE", "Lesion", "Nuclei", "SlideLayout", "make_layout", "NUCLEUS_KINDS"]

MAP_DOWNSAMPLE = 16
NUCLEUS_KINDS = ("fibroblast", "lymphocyte", "tumor")

# Nuclear densities in nuclei per µm² of tissue.
STROMA_DENSITY = 1 / 300.0
FOLLICLE_DENSITY = 1 / 38.0
TUMOR_DENSITY_SUBTLE = 1 / 260.0
TUMOR_DENSITY_OBVIOUS = 1 / 80.0


@dataclass(frozen=True)
class Lesion:
    """A tumour region: exterior polygon and optional non-tumour holes, in level-0 pixels.

    ``kind`` is 'macro' (large, obvious), 'micro' (small, subtle) or 'itc' (isolated-cell scale);
    ``subtlety`` in (0, 1] scales how far its cells depart from normal (1 = obvious).
    """

    kind: str
    exterior_lv0: np.ndarray
    holes_lv0: tuple[np.ndarray, ...]
    subtlety: float


@dataclass
class Nuclei:
    """Nuclei of a slide, sorted by ``y_lv0``. Sizes are semi-axes in level-0 pixels."""

    x_lv0: np.ndarray  # float32 (M,)
    y_lv0: np.ndarray  # float32 (M,)
    kind: np.ndarray  # uint8 (M,), index into NUCLEUS_KINDS
    semi_major_px: np.ndarray  # float32 (M,)
    semi_minor_px: np.ndarray  # float32 (M,)
    angle_rad: np.ndarray  # float32 (M,)
    intensity: np.ndarray  # float32 (M,), haematoxylin optical-density scale
    vesicular: np.ndarray  # float32 (M,), 0 = solid chromatin, 1 = pale centre with dark rim

    def __len__(self) -> int:
        return len(self.x_lv0)

    def rows(self, y0: float, y1: float) -> slice:
        """Slice of nuclei whose centre lies in [y0, y1)."""
        return slice(int(np.searchsorted(self.y_lv0, y0)), int(np.searchsorted(self.y_lv0, y1)))


@dataclass
class SlideLayout:
    """All decisions about one slide. Maps are float32 on the coarse grid, values in [0, 1]."""

    width_px: int
    height_px: int
    mpp: float
    is_tumor: bool
    tissue: np.ndarray
    follicle: np.ndarray
    fold: np.ndarray
    pen: np.ndarray
    blur: np.ndarray
    faint: np.ndarray
    tumor: np.ndarray  # per-map-pixel subtlety of the lesion covering it (0 outside lesions)
    stain: np.ndarray  # slow variation of staining strength across the slide (about 0.75-1.25)
    pen_od: np.ndarray  # (3,) optical density of the pen ink
    fibre_angle_rad: float
    lesions: list[Lesion] = field(default_factory=list)
    nuclei: Nuclei | None = None


# ------------------------------------------------------------------------------------------------
def _smooth_noise(rng: np.random.Generator, shape: tuple[int, int], sigma: float) -> np.ndarray:
    field_ = ndimage.gaussian_filter(rng.standard_normal(shape).astype(np.float32), sigma, mode="wrap")
    std = float(field_.std()) or 1.0
    return (field_ - field_.mean()) / std


def _grid(shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Level-0 pixel coordinates of the map pixel centres (x, y), each of ``shape``."""
    ys = (np.arange(shape[0], dtype=np.float32) + 0.5) * MAP_DOWNSAMPLE
    xs = (np.arange(shape[1], dtype=np.float32) + 0.5) * MAP_DOWNSAMPLE
    return np.meshgrid(xs, ys)


def _blob(x, y, cx, cy, rx, ry, angle) -> np.ndarray:
    """1 - normalised elliptical distance: positive inside the ellipse."""
    c, s = np.cos(angle), np.sin(angle)
    u = ((x - cx) * c + (y - cy) * s) / rx
    v = (-(x - cx) * s + (y - cy) * c) / ry
    return 1.0 - np.sqrt(u * u + v * v)


def _band(x, y, cx, cy, angle, length, width, wiggle, phase) -> np.ndarray:
    """Soft 0..1 band of ``width`` along a wiggly line of ``length`` centred at (cx, cy)."""
    c, s = np.cos(angle), np.sin(angle)
    u = (x - cx) * c + (y - cy) * s
    v = -(x - cx) * s + (y - cy) * c
    v = v - wiggle * np.sin(2 * np.pi * u / max(length, 1.0) * 1.5 + phase)
    inside = (np.abs(v) < width / 2) & (np.abs(u) < length / 2)
    return inside.astype(np.float32)


def _star_polygon(rng: np.random.Generator, cx: float, cy: float, radius: float) -> np.ndarray:
    """An irregular closed-curve polygon (K, 2) around (cx, cy) with mean radius ``radius``."""
    n = int(rng.integers(40, 90))
    theta = np.sort((np.arange(n) + rng.uniform(-0.3, 0.3, n)) / n * 2 * np.pi)
    r = np.ones(n)
    for k in range(2, 6):
        r += rng.uniform(0.05, 0.22) / k * 2 * np.cos(k * theta + rng.uniform(0, 2 * np.pi))
    r = np.clip(r, 0.45, None) * radius
    pts = np.stack([cx + r * np.cos(theta), cy + r * np.sin(theta)], axis=1)
    return np.round(pts, 2)


def _place(rng, free_dist_map_px: np.ndarray, radius_map_px: float) -> tuple[float, float] | None:
    """A random map pixel whose distance to the outside of ``free`` exceeds ``radius_map_px``."""
    ys, xs = np.nonzero(free_dist_map_px > radius_map_px)
    if len(ys) == 0:
        return None
    i = int(rng.integers(len(ys)))
    return (xs[i] + 0.5) * MAP_DOWNSAMPLE, (ys[i] + 0.5) * MAP_DOWNSAMPLE


# ------------------------------------------------------------------------------------------------
def make_layout(
    rng: np.random.Generator, *, width_px: int, height_px: int, mpp: float, is_tumor: bool
) -> SlideLayout:
    """Decide tissue, confounders, lesions and nuclei of one slide."""
    shape = (-(-height_px // MAP_DOWNSAMPLE), -(-width_px // MAP_DOWNSAMPLE))
    x, y = _grid(shape)
    um = 1.0 / mpp  # level-0 pixels per µm

    # Tissue: 1-3 elliptical islands distorted by low-frequency noise, with a few fat holes, and a
    # background margin along the border so that every slide has background-only areas.
    n_islands = int(rng.integers(1, 4))
    field_ = np.full(shape, -1.0, np.float32)
    for _ in range(n_islands):
        cx, cy = rng.uniform(0.3, 0.7) * width_px, rng.uniform(0.3, 0.7) * height_px
        rx, ry = rng.uniform(0.16, 0.32) * width_px, rng.uniform(0.16, 0.32) * height_px
        field_ = np.maximum(field_, _blob(x, y, cx, cy, rx, ry, rng.uniform(0, np.pi)))
    field_ += 0.25 * _smooth_noise(rng, shape, sigma=max(shape) / 14)
    tissue = field_ > 0
    holes = _smooth_noise(rng, shape, sigma=max(2.0, 60 * um / MAP_DOWNSAMPLE)) > 2.2
    tissue &= ~holes
    margin = int(0.04 * max(shape))
    tissue[:margin] = tissue[-margin:] = False
    tissue[:, :margin] = tissue[:, -margin:] = False
    tissue = ndimage.binary_opening(tissue, iterations=1)
    tissue_soft = ndimage.gaussian_filter(tissue.astype(np.float32), 0.8)

    def blobs(count: int, r_um: tuple[float, float]) -> np.ndarray:
        out = np.zeros(shape, np.float32)
        for _ in range(count):
            pos = _place(rng, ndimage.distance_transform_edt(tissue), 2)
            if pos is None:
                break
            r = rng.uniform(*r_um) * um
            b = _blob(x, y, pos[0], pos[1], r * rng.uniform(0.7, 1.3), r, rng.uniform(0, np.pi))
            out = np.maximum(out, np.clip(b * 4, 0, 1))
        return out * tissue_soft

    follicle = blobs(int(rng.integers(2, 6)), (90, 260))
    blur = blobs(1, (150, 400)) if rng.random() < 0.4 else np.zeros(shape, np.float32)
    faint = blobs(1, (200, 500)) if rng.random() < 0.4 else np.zeros(shape, np.float32)

    fold = np.zeros(shape, np.float32)
    if rng.random() < 0.5:
        pos = _place(rng, ndimage.distance_transform_edt(tissue), 2) or (width_px / 2, height_px / 2)
        fold = _band(x, y, *pos, rng.uniform(0, np.pi), rng.uniform(0.2, 0.5) * width_px,
                     rng.uniform(25, 70) * um, rng.uniform(10, 60) * um, rng.uniform(0, 6.3))
        fold = ndimage.gaussian_filter(fold, 0.7) * tissue_soft
    pen = np.zeros(shape, np.float32)
    if rng.random() < 0.4:
        cx, cy = rng.uniform(0.2, 0.8) * width_px, rng.uniform(0.2, 0.8) * height_px
        pen = _band(x, y, cx, cy, rng.uniform(0, np.pi), rng.uniform(0.2, 0.6) * width_px,
                    rng.uniform(40, 110) * um, rng.uniform(20, 120) * um, rng.uniform(0, 6.3))
        pen = ndimage.gaussian_filter(pen, 0.6)
    pen_od = np.array([0.85, 0.15, 0.65] if rng.random() < 0.5 else [0.9, 0.55, 0.1], np.float32)

    layout = SlideLayout(
        width_px=width_px, height_px=height_px, mpp=mpp, is_tumor=is_tumor,
        tissue=tissue_soft, follicle=follicle, fold=fold, pen=pen, blur=blur, faint=faint,
        tumor=np.zeros(shape, np.float32),
        stain=np.clip(1.0 + 0.12 * _smooth_noise(rng, shape, sigma=max(2.0, 150 * um / MAP_DOWNSAMPLE)), 0.7, 1.3),
        pen_od=pen_od, fibre_angle_rad=float(rng.uniform(0, np.pi)),
    )
    if is_tumor:
        layout.lesions = _make_lesions(rng, layout, tissue, um)
        _rasterise_lesions(layout)
    layout.nuclei = _make_nuclei(rng, layout, um)
    return layout


def _make_lesions(rng, layout: SlideLayout, tissue: np.ndarray, um: float) -> list[Lesion]:
    """One large obvious lesion, 1-3 small subtle ones and 0-2 isolated-cell clusters."""
    free = tissue.copy()
    # Radii in µm. The large lesion's area spans two decades (log-uniform radius), so the
    # positive-patch ratio of tumour slides varies widely and is mostly low; micro lesions are
    # mostly above the 275 µm ITC limit of the CAMELYON16 evaluation, ITC clusters below it.
    specs = [("macro", float(np.exp(rng.uniform(np.log(80), np.log(420)))), 1.0)]
    specs += [("micro", rng.uniform(70, 180), rng.uniform(0.35, 0.6)) for _ in range(int(rng.integers(1, 4)))]
    specs += [("itc", rng.uniform(14, 40), rng.uniform(0.6, 0.9)) for _ in range(int(rng.integers(0, 3)))]
    lesions = []
    for kind, r_um, subtlety in specs:
        r_px = r_um * um
        dist = ndimage.distance_transform_edt(free)
        pos = None
        for _ in range(8):
            pos = _place(rng, dist, 1.35 * r_px / MAP_DOWNSAMPLE + 1)
            if pos is not None:
                break
            r_px *= 0.8
        if pos is None:
            continue
        exterior = _star_polygon(rng, pos[0], pos[1], r_px)
        holes: tuple[np.ndarray, ...] = ()
        if kind == "macro" and rng.random() < 0.6:
            off = rng.uniform(0, 0.35) * r_px
            ang = rng.uniform(0, 2 * np.pi)
            holes = (_star_polygon(rng, pos[0] + off * np.cos(ang), pos[1] + off * np.sin(ang),
                                   rng.uniform(0.18, 0.3) * r_px),)
        lesions.append(Lesion(kind=kind, exterior_lv0=exterior, holes_lv0=holes, subtlety=float(subtlety)))
        # keep later lesions apart from this one
        yy, xx = np.ogrid[: free.shape[0], : free.shape[1]]
        cx, cy = pos[0] / MAP_DOWNSAMPLE - 0.5, pos[1] / MAP_DOWNSAMPLE - 0.5
        free &= (xx - cx) ** 2 + (yy - cy) ** 2 > (1.6 * r_px / MAP_DOWNSAMPLE + 2) ** 2
    return lesions


def _inside(points_xy: np.ndarray, lesion: Lesion) -> np.ndarray:
    inside = MplPath(lesion.exterior_lv0).contains_points(points_xy)
    for hole in lesion.holes_lv0:
        inside &= ~MplPath(hole).contains_points(points_xy)
    return inside


def _rasterise_lesions(layout: SlideLayout) -> None:
    """Fill ``layout.tumor`` with each lesion's subtlety on the map grid (4x supersampled)."""
    sub = 4
    for lesion in layout.lesions:
        x0, y0 = np.floor(lesion.exterior_lv0.min(0) / MAP_DOWNSAMPLE).astype(int)
        x1, y1 = np.ceil(lesion.exterior_lv0.max(0) / MAP_DOWNSAMPLE).astype(int) + 1
        x1, y1 = min(x1, layout.tumor.shape[1]), min(y1, layout.tumor.shape[0])
        xs = (np.arange(x0 * sub, x1 * sub) + 0.5) * MAP_DOWNSAMPLE / sub
        ys = (np.arange(y0 * sub, y1 * sub) + 0.5) * MAP_DOWNSAMPLE / sub
        gx, gy = np.meshgrid(xs, ys)
        inside = _inside(np.stack([gx.ravel(), gy.ravel()], 1), lesion).reshape(gx.shape)
        cover = inside.reshape(y1 - y0, sub, x1 - x0, sub).mean(axis=(1, 3)).astype(np.float32)
        region = layout.tumor[y0:y1, x0:x1]
        np.maximum(region, cover * lesion.subtlety, out=region)


def _lookup(map_: np.ndarray, x_lv0: np.ndarray, y_lv0: np.ndarray) -> np.ndarray:
    ix = np.clip((x_lv0 / MAP_DOWNSAMPLE).astype(int), 0, map_.shape[1] - 1)
    iy = np.clip((y_lv0 / MAP_DOWNSAMPLE).astype(int), 0, map_.shape[0] - 1)
    return map_[iy, ix]


def _poisson(rng, density_per_px2: float, x0, y0, x1, y1) -> tuple[np.ndarray, np.ndarray]:
    n = int(rng.poisson(density_per_px2 * max(x1 - x0, 0) * max(y1 - y0, 0)))
    return rng.uniform(x0, x1, n).astype(np.float32), rng.uniform(y0, y1, n).astype(np.float32)


def _make_nuclei(rng, layout: SlideLayout, um: float) -> Nuclei:
    w, h = layout.width_px, layout.height_px
    um2 = um * um  # level-0 px² per µm²
    parts: list[dict[str, np.ndarray]] = []

    def in_any_lesion(px, py) -> np.ndarray:
        hit = np.zeros(len(px), bool)
        pts = np.stack([px, py], 1)
        for lesion in layout.lesions:
            (bx0, by0), (bx1, by1) = lesion.exterior_lv0.min(0), lesion.exterior_lv0.max(0)
            near = (px >= bx0) & (px <= bx1) & (py >= by0) & (py <= by1)
            if near.any():
                hit[near] |= _inside(pts[near], lesion)
        return hit

    def add(px, py, kind, a_um, b_um, angle, intensity, vesicular):
        n = len(px)
        parts.append(dict(
            x=px, y=py, kind=np.full(n, kind, np.uint8),
            a=(np.broadcast_to(a_um, n) * um).astype(np.float32),
            b=(np.broadcast_to(b_um, n) * um).astype(np.float32),
            angle=np.broadcast_to(angle, n).astype(np.float32),
            intensity=np.broadcast_to(intensity, n).astype(np.float32),
            vesicular=np.broadcast_to(vesicular, n).astype(np.float32),
        ))

    # Normal stroma: fibroblasts along the fibres and scattered lymphocytes.
    px, py = _poisson(rng, STROMA_DENSITY / um2, 0, 0, w, h)
    keep = rng.random(len(px)) < _lookup(layout.tissue, px, py)
    px, py = px[keep], py[keep]
    outside = ~in_any_lesion(px, py)
    px, py = px[outside], py[outside]
    n = len(px)
    is_lymph = rng.random(n) < 0.45
    fx, fy = px[~is_lymph], py[~is_lymph]
    m = len(fx)
    add(fx, fy, 0, rng.uniform(4.0, 6.5, m), rng.uniform(1.1, 1.8, m),
        layout.fibre_angle_rad + rng.normal(0, 0.25, m), rng.uniform(0.75, 1.05, m), 0.0)
    lx, ly = px[is_lymph], py[is_lymph]
    m = len(lx)
    r = rng.uniform(2.7, 3.8, m)
    add(lx, ly, 1, r, r * rng.uniform(0.85, 1.0, m), rng.uniform(0, np.pi, m), rng.uniform(1.0, 1.3, m), 0.0)

    # Lymphoid follicles: densely packed small dark round nuclei (the darkest tissue on the slide).
    px, py = _poisson(rng, FOLLICLE_DENSITY / um2, 0, 0, w, h)
    keep = rng.random(len(px)) < _lookup(layout.follicle, px, py)
    px, py = px[keep], py[keep]
    outside = ~in_any_lesion(px, py)
    px, py = px[outside], py[outside]
    m = len(px)
    r = rng.uniform(2.6, 3.6, m)
    add(px, py, 1, r, r * rng.uniform(0.85, 1.0, m), rng.uniform(0, np.pi, m), rng.uniform(1.0, 1.35, m), 0.0)

    # Tumour: crowded, larger, pleomorphic nuclei with vesicular chromatin; subtle lesions sit
    # between normal and obvious on every axis.
    for lesion in layout.lesions:
        s = lesion.subtlety
        density = TUMOR_DENSITY_SUBTLE + (TUMOR_DENSITY_OBVIOUS - TUMOR_DENSITY_SUBTLE) * s
        (bx0, by0), (bx1, by1) = lesion.exterior_lv0.min(0), lesion.exterior_lv0.max(0)
        px, py = _poisson(rng, density / um2, bx0, by0, bx1, by1)
        inside = _inside(np.stack([px, py], 1), lesion) if len(px) else np.zeros(0, bool)
        px, py = px[inside], py[inside]
        m = len(px)
        r = (3.4 + 3.0 * s) * np.exp(rng.normal(0, 0.12 + 0.12 * s, m))
        add(px, py, 2, r, r * rng.uniform(0.65, 1.0, m), rng.uniform(0, np.pi, m),
            rng.uniform(0.7, 0.95, m), s * rng.uniform(0.7, 1.0, m))

    cat = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    order = np.argsort(cat["y"], kind="stable")
    return Nuclei(
        x_lv0=cat["x"][order], y_lv0=cat["y"][order], kind=cat["kind"][order],
        semi_major_px=cat["a"][order], semi_minor_px=cat["b"][order], angle_rad=cat["angle"][order],
        intensity=cat["intensity"][order], vesicular=cat["vesicular"][order],
    )
