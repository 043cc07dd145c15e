"""The one place that converts between magnification, µm/px and pyramid level.

Magnification and resolution are tied by ``mpp = mpp_at_40x * 40 / magnification``; with the
default ``mpp_at_40x = 0.25`` that gives 40x = 0.25, 20x = 0.5 and 10x = 1.0 µm/px.

Reading at a finer resolution than the slide was scanned at (upsampling) invents detail the scan
does not have, so :func:`plan_read` refuses it unless ``allow_upsample`` is given; a target within
:data:`UPSAMPLE_TOLERANCE` of the slide's resolution counts as the slide's own (a 0.2525 µm/px
slide serves 40x = 0.25 µm/px).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

from wsi_milssl.errors import ConfigError, ResolutionError

__all__ = [
    "DEFAULT_MPP_AT_40X",
    "LEVEL_TOLERANCE",
    "UPSAMPLE_TOLERANCE",
    "ReadPlan",
    "check_positive",
    "magnification_to_mpp",
    "mpp_to_magnification",
    "plan_read",
]

DEFAULT_MPP_AT_40X = 0.25
# Pyramids whose level-0 size is not divisible by the level factor report downsamples such as
# 4.0002; a level counts as "not exceeding" the needed downsample within this relative tolerance.
LEVEL_TOLERANCE = 1e-3
# A target at most this much finer than level 0 (relative) is read as level 0, not refused.
UPSAMPLE_TOLERANCE = 0.01


def check_positive(name: str, value: float, *, where: str | os.PathLike = "") -> float:
    """``value`` as a float; ConfigError (``where: name must be ...``) unless it is a finite number above 0:
    NaN, infinity, 0 and below are no scale or resolution."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{f'{where}: ' if where else ''}{name} must be a finite number above 0; got {value!r}.")
    return float(value)


def magnification_to_mpp(magnification: float, *, mpp_at_40x: float = DEFAULT_MPP_AT_40X) -> float:
    """µm per pixel of an objective magnification (10 -> 1.0 with the default scale)."""
    return check_positive("mpp_at_40x", mpp_at_40x) * 40.0 / check_positive("magnification", magnification)


def mpp_to_magnification(mpp: float, *, mpp_at_40x: float = DEFAULT_MPP_AT_40X) -> float:
    """Objective magnification equivalent of a resolution in µm per pixel (1.0 -> 10)."""
    return check_positive("mpp_at_40x", mpp_at_40x) * 40.0 / check_positive("mpp", mpp)


@dataclass(frozen=True)
class ReadPlan:
    """How a patch at ``target_mpp`` is served from the pyramid.

    ``downsample`` is target_mpp / slide_mpp (level-0 pixels per target pixel). The region is read
    at ``level`` (downsample ``level_downsample``) and resized by ``residual_scale`` =
    downsample / level_downsample (> 1 shrinks, antialiased; < 1 only when the target is finer than
    level 0).
    """

    target_mpp: float
    slide_mpp: float
    downsample: float
    level: int
    level_downsample: float

    @property
    def residual_scale(self) -> float:
        return self.downsample / self.level_downsample

    def size_lv0(self, size_px: int) -> int:
        """Level-0 extent in pixels of a patch of ``size_px`` target pixels."""
        return int(round(size_px * self.downsample))

    def size_at_level(self, size_px: int) -> int:
        """Extent in pixels, at the read level, of a patch of ``size_px`` target pixels."""
        return max(1, int(round(size_px * self.residual_scale)))


def plan_read(
    slide_mpp: float, level_downsamples: Sequence[float], *, target_mpp: float, allow_upsample: bool = False,
    source: str | os.PathLike | None = None,
) -> ReadPlan:
    """Pick the level with the largest downsample not exceeding target_mpp / slide_mpp.

    Raises ResolutionError when ``target_mpp`` is finer than ``slide_mpp`` by more than
    :data:`UPSAMPLE_TOLERANCE` and ``allow_upsample`` is False; ``source`` (the slide) names it.
    """
    check_positive("target_mpp", target_mpp, where=source or "")
    check_positive("slide_mpp", slide_mpp, where=source or "")
    downsample = target_mpp / slide_mpp
    if downsample < 1.0 - UPSAMPLE_TOLERANCE and not allow_upsample:
        raise ResolutionError(
            f"{source if source is not None else 'slide'}: reading at {target_mpp:.4g} µm/px would upsample this "
            f"slide, which is scanned at {slide_mpp:.4g} µm/px ({1.0 / downsample:.2f}x enlarged pixels add no "
            f"detail). Fix: read at {slide_mpp:.4g} µm/px or coarser (tile and features: --mpp or a lower "
            "--magnification; a pipeline: [tile] target_mpp or magnification; heatmap reads at its model's), or "
            "enlarge it anyway (tile --allow-upsample; allow_upsample = true in [tile] or in a features "
            "--tile-config); a wrong µm/px in the slide's metadata is mended with --slide-mpp."
        )
    level = 0
    for i, ds in enumerate(level_downsamples):
        if ds <= downsample * (1 + LEVEL_TOLERANCE) and ds >= level_downsamples[level]:
            level = i
    return ReadPlan(
        target_mpp=float(target_mpp),
        slide_mpp=float(slide_mpp),
        downsample=float(downsample),
        level=level,
        level_downsample=float(level_downsamples[level]),
    )
