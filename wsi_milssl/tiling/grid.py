"""The patch grid of a slide at a physical resolution, in level-0 pixels.

A patch of ``patch_size_px`` target pixels covers ``patch_size_lv0 = round(patch_size_px * d)``
level-0 pixels, with ``d = target_mpp / slide_mpp`` (10x = 1.0 µm/px on a 0.25 µm/px slide: d = 4,
512 px -> 2048 level-0 px). Grid cell (r, c) has its top-left at level-0
(c * stride_lv0, r * stride_lv0); only cells wholly inside the slide are kept. Cells are listed
row-major (y, then x), which is the order of every per-patch array in a store.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from wsi_milssl.slide.resolution import ReadPlan, mpp_to_magnification

__all__ = ["TileGeometry", "grid_coords"]


def grid_coords(dimensions_lv0: tuple[int, int], *, patch_size_lv0: int, stride_lv0: int,
                origin_lv0: tuple[int, int] = (0, 0)) -> np.ndarray:
    """int64 (N, 2) level-0 top-left (x, y) of every grid cell wholly inside a slide of
    ``dimensions_lv0`` = (width, height), row-major."""
    if patch_size_lv0 < 1 or stride_lv0 < 1:
        raise ValueError(f"patch and stride must be >= 1 level-0 px; got {patch_size_lv0}, {stride_lv0}.")
    w, h = (int(v) for v in dimensions_lv0)
    ox, oy = (int(v) for v in origin_lv0)
    xs = np.arange(ox, w - patch_size_lv0 + 1, stride_lv0, dtype=np.int64)
    ys = np.arange(oy, h - patch_size_lv0 + 1, stride_lv0, dtype=np.int64)
    if len(xs) == 0 or len(ys) == 0:
        return np.zeros((0, 2), np.int64)
    yy, xx = np.meshgrid(ys, xs, indexing="ij")
    return np.stack([xx.ravel(), yy.ravel()], axis=1)


@dataclass(frozen=True)
class TileGeometry:
    """Where and how patches of one slide are read.

    Sizes: ``patch_size_px`` / ``stride_px`` at the target resolution, ``*_lv0`` in level-0 pixels,
    ``patch_size_level`` at the pyramid ``level`` read (downsample ``level_downsample``), which is
    then resized to ``patch_size_px`` when the two differ.
    """

    dimensions_lv0: tuple[int, int]
    slide_mpp: float
    target_mpp: float
    downsample: float
    level: int
    level_downsample: float
    level_dimensions: tuple[int, int]
    patch_size_px: int
    patch_size_lv0: int
    patch_size_level: int
    stride_px: int
    stride_lv0: int

    @classmethod
    def from_plan(cls, plan: ReadPlan, *, dimensions_lv0: tuple[int, int], level_dimensions: tuple[int, int],
                  patch_size_px: int, stride_px: int) -> "TileGeometry":
        return cls(
            dimensions_lv0=(int(dimensions_lv0[0]), int(dimensions_lv0[1])),
            slide_mpp=float(plan.slide_mpp),
            target_mpp=float(plan.target_mpp),
            downsample=float(plan.downsample),
            level=int(plan.level),
            level_downsample=float(plan.level_downsample),
            level_dimensions=(int(level_dimensions[0]), int(level_dimensions[1])),
            patch_size_px=int(patch_size_px),
            patch_size_lv0=plan.size_lv0(patch_size_px),
            patch_size_level=plan.size_at_level(patch_size_px),
            stride_px=int(stride_px),
            stride_lv0=max(1, int(round(stride_px * plan.downsample))),
        )

    @classmethod
    def from_slide(cls, slide, *, target_mpp: float, patch_size_px: int, stride_px: int,
                   allow_upsample: bool | None = None) -> "TileGeometry":
        """Geometry for a SlideReader ``slide``; ``allow_upsample``: serve a ``target_mpp`` finer than the
        slide's (None = the reader's own setting; see :meth:`SlideReader.plan`)."""
        plan = slide.plan(target_mpp=target_mpp, allow_upsample=allow_upsample)
        return cls.from_plan(plan, dimensions_lv0=slide.dimensions, level_dimensions=slide.level_dimensions[plan.level],
                             patch_size_px=patch_size_px, stride_px=stride_px)

    @property
    def target_magnification(self) -> float:
        return mpp_to_magnification(self.target_mpp)

    def grid(self) -> np.ndarray:
        """int64 (N, 2) level-0 top-left (x, y) of every cell wholly inside the slide, row-major."""
        return grid_coords(self.dimensions_lv0, patch_size_lv0=self.patch_size_lv0, stride_lv0=self.stride_lv0)

    def coords_attrs(self, *, name: str) -> dict:
        """The CLAM / TRIDENT attributes of a ``coords`` dataset of patches cut with this geometry
        (``docs/artifacts.md``): ``patch_size`` (side at the level read), ``patch_level``, ``downsample``,
        ``level_dim``, ``patch_size_level0``, ``target_magnification``, ``level0_magnification``,
        ``overlap`` (target px) and ``name`` (the slide stem)."""
        return {
            "patch_size": int(self.patch_size_level),
            "patch_level": int(self.level),
            "downsample": [float(self.level_downsample), float(self.level_downsample)],
            "level_dim": [int(v) for v in self.level_dimensions],
            "patch_size_level0": int(self.patch_size_lv0),
            "target_magnification": float(self.target_magnification),
            "level0_magnification": float(mpp_to_magnification(self.slide_mpp)),
            "overlap": max(0, int(self.patch_size_px) - int(self.stride_px)),
            "name": str(name),
        }

    def grid_shape(self) -> tuple[int, int]:
        """(rows, cols) of the grid."""
        w, h = self.dimensions_lv0
        cols = max(0, (w - self.patch_size_lv0) // self.stride_lv0 + 1) if w >= self.patch_size_lv0 else 0
        rows = max(0, (h - self.patch_size_lv0) // self.stride_lv0 + 1) if h >= self.patch_size_lv0 else 0
        return rows, cols
