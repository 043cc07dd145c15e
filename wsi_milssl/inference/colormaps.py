"""The registry of heatmap colour maps.

A colour map turns values in [0, 1] into RGB colours::

    @register_colormap("mine")
    def mine(values: np.ndarray) -> np.ndarray:   # float (...) in [0, 1] -> uint8 (..., 3)
        ...

Built in: the matplotlib maps ``jet``, ``turbo``, ``viridis``, ``inferno``, ``magma``, ``plasma``,
``hot`` and ``coolwarm`` (as 256-entry lookup tables, built on first use), and ``red`` (white to red).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import numpy as np

from wsi_milssl.registry import Registry

__all__ = ["COLORMAPS", "register_colormap", "apply_colormap", "colormap_lut"]

Colormap = Callable[[np.ndarray], np.ndarray]
COLORMAPS: Registry[Colormap] = Registry("colour map")

_LUT_SIZE = 256


def register_colormap(name: str):
    """Register ``fn(values float (...) in [0, 1]) -> uint8 (..., 3)`` under ``name`` (decorator; ValueError
    when the name is taken)."""
    return COLORMAPS.register(name)


@lru_cache(maxsize=None)
def _matplotlib_lut(name: str) -> np.ndarray:
    from matplotlib import colormaps

    rgba = colormaps[name](np.linspace(0.0, 1.0, _LUT_SIZE))
    return np.round(rgba[:, :3] * 255.0).astype(np.uint8)


def _lut_lookup(lut: np.ndarray, values: np.ndarray) -> np.ndarray:
    v = np.nan_to_num(np.asarray(values, dtype=np.float64), nan=0.0)
    idx = np.clip(np.round(v * (len(lut) - 1)), 0, len(lut) - 1).astype(np.intp)
    return lut[idx]


def _register_matplotlib(name: str) -> None:
    def fn(values: np.ndarray) -> np.ndarray:
        return _lut_lookup(_matplotlib_lut(name), values)

    fn.__name__ = f"colormap_{name}"
    fn.__doc__ = f"matplotlib's {name!r} colour map as a {_LUT_SIZE}-entry lookup table."
    register_colormap(name)(fn)


for _name in ("jet", "turbo", "viridis", "inferno", "magma", "plasma", "hot", "coolwarm"):
    _register_matplotlib(_name)


@register_colormap("red")
def red(values: np.ndarray) -> np.ndarray:
    """White (0) to pure red (1)."""
    v = np.clip(np.nan_to_num(np.asarray(values, dtype=np.float64), nan=0.0), 0.0, 1.0)
    gb = np.round(255.0 * (1.0 - v)).astype(np.uint8)
    return np.stack([np.full_like(gb, 255), gb, gb], axis=-1)


def apply_colormap(values: np.ndarray, name: str) -> np.ndarray:
    """uint8 (..., 3) colours of ``values`` float (...) in [0, 1] (clipped; NaN as 0) with map ``name``."""
    if name not in COLORMAPS:
        raise ValueError(f"unknown colour map {name!r}; registered colour maps: {', '.join(sorted(COLORMAPS))}.")
    v = np.clip(np.asarray(values, dtype=np.float64), 0.0, 1.0)
    out = np.asarray(COLORMAPS[name](v))
    if out.dtype != np.uint8 or out.shape != v.shape + (3,):
        raise ValueError(f"colour map {name!r} returned {out.dtype} {out.shape} for input of shape {v.shape}; "
                         "it must return uint8 (..., 3).")
    return out


def colormap_lut(name: str, n: int = _LUT_SIZE) -> np.ndarray:
    """uint8 (n, 3): the colours of ``n`` evenly spaced values from 0 to 1."""
    return apply_colormap(np.linspace(0.0, 1.0, n), name)
