"""Cut a slide by a :class:`~wsi_milssl.tiling.plan.TilingPlan`: the functions the tile stage and the
heatmap stage both call, so both keep exactly the same cells.

    with open_slide(path) as slide:
        cells = plan_slide(slide, plan)                  # grid -> tissue filter -> bands
        source = open_band_source(slide, cells.geometry, cells.bands, plan=plan)
        for band in cells.bands:
            cut = cut_band(slide, band, cells.geometry, plan=plan, source=source)
            cells.coords_lv0[cut.indices], cut.patches   # kept after the entropy filter

Selection: grid at the target resolution from level-0 (0, 0), cells wholly inside the slide
(row-major) -> tissue fraction on the mask >= ``min_tissue`` (every cell with ``tissue = 'none'``)
-> the candidates, grouped into bands of horizontal neighbours (one read each, at most
:data:`MAX_BAND_PX` wide at the read level) -> each patch read, kept when its entropy is at least
``entropy_threshold_bits``. Both stages use the same bands, so every patch is cut from the same
region read and the pixels (hence the entropies) are the same bit for bit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from wsi_milssl.slide.entropy import entropy_bits_batch
from wsi_milssl.slide.tissue import TissueMask, slide_tissue_mask
from wsi_milssl.tiling.grid import TileGeometry
from wsi_milssl.tiling.plan import TilingPlan
from wsi_milssl.tiling.reading import Band, plan_bands, read_band
from wsi_milssl.tiling.tiff_source import TiffLevelSource, direct_source

__all__ = ["MAX_BAND_PX", "BandCut", "SlideCells", "cut_band", "open_band_source", "plan_slide"]

logger = logging.getLogger(__name__)

#: Widest band read at once, in pixels of the read level.
MAX_BAND_PX = 4096


@dataclass(frozen=True)
class SlideCells:
    """The cells of one slide a plan reads (before the entropy filter).

    ``geometry``: where and at which level patches are read; ``tissue``: the mask (and its
    thumbnail); ``n_grid``: grid cells inside the slide; ``coords_lv0``: int64 (N, 2) level-0 top-left
    (x, y) of the candidate cells, row-major; ``tissue_fraction``: float32 (N,) their tissue fraction;
    ``bands``: the candidates grouped into reads (``Band.indices`` index ``coords_lv0``).
    """

    plan: TilingPlan
    geometry: TileGeometry
    tissue: TissueMask
    n_grid: int
    coords_lv0: np.ndarray
    tissue_fraction: np.ndarray
    bands: tuple[Band, ...]

    @property
    def n_candidates(self) -> int:
        return int(len(self.coords_lv0))


@dataclass(frozen=True)
class BandCut:
    """One band read and entropy-filtered.

    ``keep``: bool (B,) per patch of the band; ``entropy_bits``: float64 (B,) of every patch read;
    ``patches``: uint8 (K, P, P, 3) RGB of the kept patches (K = keep.sum(), P = patch_size_px).
    """

    band: Band
    keep: np.ndarray
    entropy_bits: np.ndarray
    patches: np.ndarray

    @property
    def indices(self) -> np.ndarray:
        """int64 (K,) positions of the kept patches in :attr:`SlideCells.coords_lv0`."""
        return self.band.indices[self.keep]

    @property
    def dropped_indices(self) -> np.ndarray:
        """int64 (B - K,) positions of the patches the entropy filter dropped."""
        return self.band.indices[~self.keep]

    @property
    def n_read(self) -> int:
        return int(len(self.keep))


def plan_slide(slide, plan: TilingPlan) -> SlideCells:
    """The candidate cells of an open SlideReader ``slide`` under ``plan`` (no patch pixels are read).

    Raises the reader's MissingResolutionError (naming the slide, a resolution tag it ignored such as
    72 pixels per inch, and ``--slide-mpp``) when the slide's scale is unknown, and ResolutionError when
    the plan's resolution is finer than the slide's and ``plan.allow_upsample`` is False.
    """
    geometry = TileGeometry.from_slide(slide, target_mpp=plan.target_mpp, patch_size_px=plan.patch_size_px,
                                       stride_px=plan.stride_px, allow_upsample=plan.allow_upsample)
    tissue = slide_tissue_mask(slide, method=plan.tissue, mask_mpp=plan.mask_mpp)
    grid = geometry.grid()
    if plan.tissue == "none":
        fraction = np.ones(len(grid), np.float32)
    else:
        fraction = tissue.fraction(grid, geometry.patch_size_lv0)
    candidate = fraction >= plan.min_tissue
    coords = grid[candidate]
    bands = tuple(plan_bands(coords, geometry, max_band_px=MAX_BAND_PX))
    return SlideCells(plan=plan, geometry=geometry, tissue=tissue, n_grid=int(len(grid)), coords_lv0=coords,
                      tissue_fraction=fraction[candidate], bands=bands)


def open_band_source(slide, geometry: TileGeometry, bands, *, plan: TilingPlan) -> TiffLevelSource | None:
    """The direct TIFF reader of the read level when ``plan.direct_tiff_read`` and the slide is a tiled
    JPEG TIFF whose direct pixels equal OpenSlide's on a probe (the first band of ``bands`` that starts
    on a whole level pixel); else None (read through OpenSlide). Close it when done."""
    if not plan.direct_tiff_read:
        return None
    return direct_source(slide, list(bands), geometry)


def cut_band(slide, band: Band, geometry: TileGeometry, *, plan: TilingPlan,
             source: TiffLevelSource | None = None) -> BandCut:
    """Read ``band``'s patches at the target resolution and apply ``plan``'s entropy filter."""
    patches = read_band(slide, band, geometry, source=source)
    entropy = entropy_bits_batch(patches)
    keep = entropy >= plan.entropy_threshold_bits
    return BandCut(band=band, keep=keep, entropy_bits=entropy, patches=patches[keep])
