"""The patch-store contract: dataset names, dtypes, attributes and the schema version (one place).

``docs/artifacts.md`` documents the same contract for people; keep both in step and bump
``SCHEMA_VERSION`` when a reader of the old layout would misread the new one.

One store per slide, ``DIR/<slide_stem>.h5`` (HDF5) or ``DIR/<slide_stem>.zarr`` (Zarr v3
directory). Per-patch arrays share the first axis N, in the same (row-major: y, then x) order:

====================  ==========  ===========  =============================================
name                  dtype       shape        meaning
====================  ==========  ===========  =============================================
``coords``            int64       (N, 2)       level-0 top-left (x, y) of each patch
``patches``           see below                pixels at the target resolution
``entropy_bits``      float32     (N,)         greyscale-histogram entropy, bits
``tissue_fraction``   float32     (N,)         fraction of the patch on the tissue mask
``tumor_fraction``    float32     (N,)         tumour area fraction (label stage)
``instance_label``    uint8       (N,)         1 = tumour patch (label stage, evaluation only)
====================  ==========  ===========  =============================================

``patches`` is absent with ``pixels = "none"``; with ``"raw"`` it is uint8 (N, H, W, 3); with
``"jpeg"`` it holds one JPEG byte string per patch: in HDF5 a variable-length uint8 dataset (N,),
in Zarr a group ``patches`` with ``data`` (uint8, all JPEG streams concatenated) and ``offsets``
(int64 (N + 1,); patch i is ``data[offsets[i]:offsets[i + 1]]``).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "SCHEMA_VERSION",
    "FORMATS",
    "FORMAT_SUFFIXES",
    "PIXEL_ENCODINGS",
    "COORDS",
    "PATCHES",
    "ENTROPY",
    "TISSUE_FRACTION",
    "TUMOR_FRACTION",
    "INSTANCE_LABEL",
    "PER_PATCH_DTYPES",
    "TILE_ARRAYS",
    "PROTECTED_ARRAYS",
    "ZARR_JPEG_DATA",
    "ZARR_JPEG_OFFSETS",
    "COORDS_ATTRS",
    "STORE_ATTRS",
    "RESERVED_ATTRS",
    "COMPLETE_ATTR",
    "PARTIAL_SUFFIX",
    "format_of",
    "store_path",
]

SCHEMA_VERSION = 1

# Store format -> path suffix.
FORMAT_SUFFIXES: dict[str, str] = {"h5": ".h5", "zarr": ".zarr"}
FORMATS: tuple[str, ...] = tuple(FORMAT_SUFFIXES)

# How patch pixels are kept: JPEG bytes, raw uint8 (N, H, W, 3), or not at all (coordinates only).
PIXEL_ENCODINGS: tuple[str, ...] = ("jpeg", "raw", "none")

COORDS = "coords"
PATCHES = "patches"
ENTROPY = "entropy_bits"
TISSUE_FRACTION = "tissue_fraction"
TUMOR_FRACTION = "tumor_fraction"
INSTANCE_LABEL = "instance_label"

# dtype and trailing shape of every known per-patch array (``patches`` is described above).
PER_PATCH_DTYPES: dict[str, tuple[np.dtype, tuple[int, ...]]] = {
    COORDS: (np.dtype(np.int64), (2,)),
    ENTROPY: (np.dtype(np.float32), ()),
    TISSUE_FRACTION: (np.dtype(np.float32), ()),
    TUMOR_FRACTION: (np.dtype(np.float32), ()),
    INSTANCE_LABEL: (np.dtype(np.uint8), ()),
}

# Written by the tile stage (besides ``patches``).
TILE_ARRAYS: tuple[str, ...] = (COORDS, ENTROPY, TISSUE_FRACTION)
# ``write_arrays`` may not replace these: they define the store.
PROTECTED_ARRAYS: tuple[str, ...] = (COORDS, PATCHES)

# Inside the Zarr ``patches`` group when pixels are JPEG.
ZARR_JPEG_DATA = "data"
ZARR_JPEG_OFFSETS = "offsets"

# CLAM / TRIDENT-compatible attributes of ``coords``: ``patch_size`` is the patch side in pixels
# at ``patch_level`` (the pyramid level read), ``downsample`` that level's (x, y) downsample,
# ``level_dim`` its (width, height), ``patch_size_level0`` the side in level-0 pixels.
COORDS_ATTRS: tuple[str, ...] = ("patch_size", "patch_level", "downsample", "level_dim", "patch_size_level0")

# Store (root) attributes written by the tile stage -> Python type.
STORE_ATTRS: dict[str, type | tuple[type, ...]] = {
    "schema_version": int,
    "package_version": str,
    "complete": bool,
    "slide_path": str,  # absolute, symlinks resolved
    # With slide_path, the slide file's fingerprint when it was tiled: its size in bytes and
    # modification time (st_mtime_ns). `tile` reuses a store only while the file still matches them.
    # Stores written before they existed lack both (`tile` then tiles the slide again).
    "slide_size_bytes": int,
    "slide_mtime_ns": int,
    "slide_stem": str,
    "dimensions_lv0": list,  # [width, height] level-0 pixels
    "mpp": float,  # level-0 µm/px actually used
    "mpp_source": str,  # override | metadata | objective-power
    "target_mpp": float,
    "target_magnification": float,  # equivalent objective (40x = 0.25 µm/px)
    "patch_size_px": int,  # at the target resolution
    "patch_size_lv0": int,
    "patch_size_level": int,  # at the pyramid level read
    "stride_px": int,
    "stride_lv0": int,
    "grid_origin_lv0": list,  # [x, y]; patch (r, c) of the grid starts at origin + (c, r) * stride_lv0
    "level": int,
    "level_downsample": float,
    "pixels": str,  # jpeg | raw | none
    "jpeg_quality": int,
    "entropy_threshold_bits": float,
    "tissue_detector": str,
    "min_tissue": float,
    "mask_mpp": float,
    "n_grid": int,  # grid cells inside the slide
    "n_candidates": int,  # cells passing the tissue filter (read)
    "n_patches": int,  # kept after the entropy filter (= N)
    "settings": str,  # JSON of the resolved settings the hash is taken over
    "config_hash": str,
    # JSON of the tile recipe (wsi_milssl.tiling.TilingPlan.to_json): target_mpp, patch_size_px,
    # stride_px, tissue, min_tissue, mask_mpp, entropy_threshold_bits, direct_tiff_read,
    # allow_upsample. Training copies it into the checkpoint; the heatmap stage cuts slides with it.
    # Stores written before it existed lack it (the separate attributes above say the same, less the
    # reader choice and allow_upsample).
    "tiling_plan": str,
}

# Attributes ``write_arrays`` may not change.
RESERVED_ATTRS: tuple[str, ...] = tuple(STORE_ATTRS)

COMPLETE_ATTR = "complete"
# A store being written lives at ``.<final name>.<pid>.<random><PARTIAL_SUFFIX>`` (unique per writer,
# see wsi_milssl.atomic.temp_path) until it is complete and renamed to its final name.
PARTIAL_SUFFIX = ".partial"


def format_of(path) -> str | None:
    """'h5' or 'zarr' from a store path's suffix, else None."""
    name = str(path).rstrip("/\\")
    for fmt, suffix in FORMAT_SUFFIXES.items():
        if name.endswith(suffix):
            return fmt
    return None


def store_path(out_dir, stem: str, fmt: str):
    """``out_dir / (stem + suffix)`` of a store in format ``fmt``."""
    from pathlib import Path

    if fmt not in FORMAT_SUFFIXES:
        raise ValueError(f"unknown store format {fmt!r}; use one of {', '.join(FORMATS)}.")
    return Path(out_dir) / f"{stem}{FORMAT_SUFFIXES[fmt]}"
