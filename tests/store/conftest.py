"""Fixtures for the store tests: build a small store of known content in either format."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from wsi_milssl.store import create_writer, encode_jpeg

PATCH_PX = 32
CLAM_ATTRS = {"patch_size": PATCH_PX, "patch_level": 0, "downsample": [1.0, 1.0], "level_dim": [640, 480],
              "patch_size_level0": PATCH_PX}


def _attrs(pixels: str, n: int) -> dict:
    return {
        "slide_path": "/data/slides/s1.tif", "slide_stem": "s1", "dimensions_lv0": [640, 480], "mpp": 0.25,
        "mpp_source": "metadata", "target_mpp": 0.25, "target_magnification": 40.0, "patch_size_px": PATCH_PX,
        "patch_size_lv0": PATCH_PX, "patch_size_level": PATCH_PX, "stride_px": PATCH_PX, "stride_lv0": PATCH_PX,
        "grid_origin_lv0": [0, 0], "level": 0, "level_downsample": 1.0, "pixels": pixels, "jpeg_quality": 90,
        "entropy_threshold_bits": 5.0, "tissue_detector": "otsu", "min_tissue": 0.1, "mask_mpp": 8.0,
        "n_grid": n, "n_candidates": n, "settings": "{}", "config_hash": "abc", "package_version": "test",
    }


def build_store(path: Path, *, pixels: str = "jpeg", n: int = 37, batch: int = 10, seed: int = 0) -> dict:
    """Write a store of ``n`` random patches in batches; return what was written."""
    rng = np.random.default_rng(seed)
    patches = rng.integers(0, 256, (n, PATCH_PX, PATCH_PX, 3), dtype=np.uint8)
    coords = np.stack([np.arange(n) * PATCH_PX % 640, np.arange(n) * PATCH_PX // 640 * PATCH_PX], 1)
    entropy = rng.uniform(5, 8, n).astype(np.float32)
    tissue = rng.uniform(0, 1, n).astype(np.float32)
    jpeg = [encode_jpeg(p, quality=90) for p in patches]
    with create_writer(path, pixels=pixels, patch_size_px=PATCH_PX, coords_attrs=CLAM_ATTRS) as w:
        for s in range(0, n, batch):
            sl = slice(s, s + batch)
            payload = {"jpeg": jpeg[sl], "raw": patches[sl], "none": None}[pixels]
            w.append(coords=coords[sl], entropy_bits=entropy[sl], tissue_fraction=tissue[sl], patches=payload)
        w.finalize(_attrs(pixels, n))
    return {"patches": patches, "jpeg": jpeg, "coords": coords, "entropy": entropy, "tissue": tissue}


@pytest.fixture
def make_store():
    """Function (path, *, pixels='jpeg', n=37, batch=10, seed=0) -> dict of the written content."""
    return build_store
