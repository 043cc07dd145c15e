"""Tumour masks to view and check the labels: one per slide at a stated downsample, with a JSON sidecar
(``evaluate`` does not read them: it rasterises the annotations itself for the FROC).

Files, in the label stage's output folder::

    <stem>_tumor_mask.png    8-bit greyscale PNG, (rows, cols) = (ceil(H / ds), ceil(W / ds));
                             255 = tumour, 0 = not tumour (holes carved)
    <stem>_tumor_mask.json   {"format": "wsi-milssl-eval-mask", "version": 1, "slide": stem,
                              "downsample": ds, "level": log2(ds) when a power of two, else null,
                              "dimensions_lv0": [W, H], "shape": [rows, cols], "mpp": level-0 µm/px
                              or null, "mask_mpp": µm per mask pixel or null, "pixel_rule": "...",
                              "annotation": path or null, "annotation_sha256": hex or null,
                              "tumor_groups": [...], "non_tumor_groups": [...], "slide_label": 0/1,
                              "tumor_pixels": count}

Pixel (i, j) covers level-0 [j*ds, (j+1)*ds) x [i*ds, (i+1)*ds) and is tumour when its centre lies
in (tumour minus non-tumour). CAMELYON16 evaluates at level 5, a 32x downsample (ds = 32). The PNG
is written first and the sidecar last, both atomically, so a sidecar means a complete mask.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from wsi_milssl.atomic import atomic_open, atomic_write_text
from wsi_milssl.errors import AnnotationError

__all__ = [
    "MASK_FORMAT",
    "MASK_SUFFIX",
    "MASK_META_SUFFIX",
    "PIXEL_RULE",
    "eval_mask_paths",
    "write_eval_mask",
    "read_eval_mask",
]

MASK_FORMAT = "wsi-milssl-eval-mask"
MASK_SUFFIX = "_tumor_mask.png"
MASK_META_SUFFIX = "_tumor_mask.json"
PIXEL_RULE = (
    "pixel (i, j) covers level-0 [j*ds, (j+1)*ds) x [i*ds, (i+1)*ds); 255 (True) when its centre "
    "((j+0.5)*ds, (i+0.5)*ds) lies in tumour minus non-tumour"
)


def eval_mask_paths(out_dir: str | os.PathLike, stem: str) -> tuple[Path, Path]:
    """(PNG path, JSON sidecar path) of slide ``stem``'s mask in ``out_dir``."""
    out = Path(out_dir)
    return out / f"{stem}{MASK_SUFFIX}", out / f"{stem}{MASK_META_SUFFIX}"


def write_eval_mask(
    mask: np.ndarray,
    out_dir: str | os.PathLike,
    stem: str,
    *,
    downsample: int,
    dimensions_lv0: tuple[int, int],
    meta: dict[str, Any] | None = None,
) -> Path:
    """Write bool ``mask`` (rows, cols) as ``<stem>_tumor_mask.png`` plus its JSON sidecar; return the PNG path.

    ``meta`` adds keys to the sidecar (annotation path, groups, mpp, slide label, ...).
    """
    mask = np.asarray(mask, dtype=bool)
    width, height = int(dimensions_lv0[0]), int(dimensions_lv0[1])
    expected = (math.ceil(height / downsample), math.ceil(width / downsample))
    if mask.shape != expected:
        raise ValueError(f"mask shape {mask.shape} does not match {width}x{height} px at downsample {downsample}: "
                         f"expected {expected}.")
    png_path, json_path = eval_mask_paths(out_dir, stem)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    downsample = int(downsample)
    level = downsample.bit_length() - 1 if downsample & (downsample - 1) == 0 else None
    mpp = (meta or {}).get("mpp")
    sidecar: dict[str, Any] = {
        "format": MASK_FORMAT,
        "version": 1,
        "slide": stem,
        "downsample": int(downsample),
        "level": level,
        "dimensions_lv0": [width, height],
        "shape": [int(mask.shape[0]), int(mask.shape[1])],
        "mpp": mpp,
        "mask_mpp": None if mpp is None else float(mpp) * downsample,
        "pixel_rule": PIXEL_RULE,
        "tumor_pixels": int(mask.sum()),
    }
    for key, value in (meta or {}).items():
        sidecar.setdefault(key, value)
    json_path.unlink(missing_ok=True)  # no sidecar while the PNG is being replaced
    with atomic_open(png_path, "wb") as fh:
        Image.fromarray(mask.astype(np.uint8) * np.uint8(255)).save(fh, format="PNG", optimize=True)
    atomic_write_text(json_path, json.dumps(sidecar, indent=2) + "\n")
    return png_path


def read_eval_mask(path: str | os.PathLike) -> tuple[np.ndarray, dict[str, Any]]:
    """Read a mask written by ``write_eval_mask``: (bool (rows, cols), sidecar dict).

    ``path`` is the PNG or the JSON sidecar. Raises AnnotationError when either file is missing or
    they disagree.
    """
    path = Path(path)
    name = path.name
    for suffix in (MASK_SUFFIX, MASK_META_SUFFIX):
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            break
    else:
        raise AnnotationError(f"{path}: not an evaluation mask; expected <stem>{MASK_SUFFIX} or <stem>{MASK_META_SUFFIX}.")
    png_path, json_path = eval_mask_paths(path.parent, stem)
    try:
        meta = json.loads(json_path.read_text())
    except FileNotFoundError:
        raise AnnotationError(f"{json_path}: mask sidecar not found (incomplete mask?); re-run `wsi-milssl label`.") from None
    except json.JSONDecodeError as exc:
        raise AnnotationError(f"{json_path}: invalid JSON at line {exc.lineno} ({exc.msg}); re-run `wsi-milssl label`.") from None
    if meta.get("format") != MASK_FORMAT:
        raise AnnotationError(f"{json_path}: not a {MASK_FORMAT} sidecar (format={meta.get('format')!r}).")
    rows, cols = (int(v) for v in meta["shape"])
    previous = Image.MAX_IMAGE_PIXELS
    try:
        Image.MAX_IMAGE_PIXELS = max(previous or 0, rows * cols + 1)  # the sidecar vouches for the size
        with Image.open(png_path) as img:
            if img.size != (cols, rows):
                raise AnnotationError(
                    f"{png_path}: image is {img.size[0]}x{img.size[1]} but its sidecar says {cols}x{rows}; "
                    "re-run `wsi-milssl label`."
                )
            mask = np.asarray(img.convert("L")) > 127
    except FileNotFoundError:
        raise AnnotationError(f"{png_path}: mask image not found; re-run `wsi-milssl label`.") from None
    finally:
        Image.MAX_IMAGE_PIXELS = previous
    return mask, meta
