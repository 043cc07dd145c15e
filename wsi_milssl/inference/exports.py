"""The heatmap stage's per-slide files, written with the cross-stage contract :mod:`wsi_milssl.artifacts`.

The names, columns, dtypes and coordinate frames of every file are defined there (and in
``docs/artifacts.md``); the evaluation stage reads them with the same module. This module holds the
writers and the non-maximum suppression that turns a probability map into CAMELYON16 detections.

Every file is written to a temporary name in the same folder, fsynced and renamed.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from wsi_milssl.artifacts import (
    MEASUREMENT_NAME,
    PATCHES_COLUMNS,
    SCORES_COLUMNS,
    SCORES_FILENAME,
    SIDECAR_KEYS,
    detection_point_lv0,
    format_detection,
    heatmap_paths,
)
from wsi_milssl.atomic import atomic_open
from wsi_milssl.errors import ConfigError

__all__ = [
    "SCORES_FILENAME",
    "MEASUREMENT_NAME",
    "output_paths",
    "nms_detections",
    "write_probs",
    "write_patches_csv",
    "write_patches_geojson",
    "write_detections_csv",
    "update_scores_csv",
]


def output_paths(out_dir: str | os.PathLike, stem: str) -> dict[str, Path]:
    """The per-slide output files of ``stem`` in ``out_dir`` by kind (:func:`wsi_milssl.artifacts.heatmap_paths`)."""
    return heatmap_paths(out_dir, stem)


# ----------------------------------------------------------------------------------------------
# Non-maximum suppression
# ----------------------------------------------------------------------------------------------

def nms_detections(grid: np.ndarray, *, origin_lv0: tuple[int, int], stride_lv0: int, patch_size_lv0: int,
                   mpp: float, threshold: float, radius_um: float
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Detections from a probability map by non-maximum suppression.

    Repeat until no unsuppressed cell with probability >= ``threshold`` is left: report the highest
    remaining cell at the level-0 pixel holding its patch centre (``origin + (c, r) * stride +
    patch // 2``, :func:`wsi_milssl.artifacts.detection_point_lv0`: integers, as the CAMELYON16
    reader needs, also for odd patch sides), then suppress every cell whose centre is within
    ``radius_um`` µm of it (centre-to-centre distance ``<= radius_um / mpp`` level-0 px). Ties are
    broken in row-major order.

    Returns (prob float64 (D,), x_lv0 int64 (D,), y_lv0 int64 (D,)), highest probability first.
    """
    grid = np.asarray(grid, dtype=np.float64)
    if mpp <= 0 or stride_lv0 <= 0:
        raise ValueError(f"mpp and stride_lv0 must be positive; got {mpp!r}, {stride_lv0!r}.")
    rows, cols = grid.shape
    values = np.where(np.isfinite(grid), grid, -np.inf)
    flat = values.ravel()
    cand = np.flatnonzero(flat >= threshold)
    if cand.size == 0:
        return np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64)
    order = cand[np.argsort(-flat[cand], kind="stable")]
    radius_cells = float(radius_um) / float(mpp) / float(stride_lv0)
    k = int(math.floor(radius_cells))
    dr, dc = np.mgrid[-k:k + 1, -k:k + 1]
    disc = (dr.astype(np.float64) ** 2 + dc.astype(np.float64) ** 2) <= radius_cells ** 2 + 1e-9
    dr, dc = dr[disc], dc[disc]
    suppressed = np.zeros(rows * cols, bool)
    picked: list[int] = []
    for cell in order:
        if suppressed[cell]:
            continue
        picked.append(int(cell))
        r, c = divmod(int(cell), cols)
        rr, cc = r + dr, c + dc
        ok = (rr >= 0) & (rr < rows) & (cc >= 0) & (cc < cols)
        suppressed[rr[ok] * cols + cc[ok]] = True
    picked_arr = np.asarray(picked, dtype=np.int64)
    r, c = np.divmod(picked_arr, cols)
    x = detection_point_lv0(int(origin_lv0[0]) + c * int(stride_lv0), patch_size_lv0)
    y = detection_point_lv0(int(origin_lv0[1]) + r * int(stride_lv0), patch_size_lv0)
    return flat[picked_arr].astype(np.float64), x, y


# ----------------------------------------------------------------------------------------------
# Writers
# ----------------------------------------------------------------------------------------------

def write_probs(out_dir: str | os.PathLike, stem: str, grid: np.ndarray, sidecar: Mapping[str, Any]) -> dict[str, Path]:
    """Write ``<stem>_probs.npy``, ``<stem>_probs.tif`` and ``<stem>_probs.json``.

    ``sidecar`` must hold the contract keys (slide, slide_path, origin_lv0, stride_lv0, patch_size_lv0,
    mpp, shape); more keys are kept.
    """
    import tifffile

    paths = output_paths(out_dir, stem)
    grid = np.ascontiguousarray(np.asarray(grid, dtype=np.float32))
    missing = [k for k in SIDECAR_KEYS if k not in sidecar]
    if missing:
        raise ValueError(f"probability-map sidecar lacks {', '.join(missing)}.")
    if list(sidecar["shape"]) != list(grid.shape):
        raise ValueError(f"sidecar shape {sidecar['shape']} differs from the map's {list(grid.shape)}.")
    with atomic_open(paths["probs_npy"]) as fh:
        np.save(fh, grid)
    text = json.dumps(dict(sidecar), indent=2, sort_keys=True) + "\n"
    cell_um = float(sidecar["stride_lv0"]) * float(sidecar["mpp"])
    with atomic_open(paths["probs_tif"]) as fh:
        px_per_cm = 1e4 / cell_um if cell_um > 0 else 1.0
        tifffile.imwrite(fh, grid, photometric="minisblack", description=text, metadata=None,
                         resolution=(px_per_cm, px_per_cm), resolutionunit="CENTIMETER")
    with atomic_open(paths["probs_json"], "w") as fh:
        fh.write(text)
    return {k: paths[k] for k in ("probs_npy", "probs_tif", "probs_json")}


def write_patches_csv(path: str | os.PathLike, coords_lv0: np.ndarray, probs: np.ndarray) -> Path:
    """``x_lv0,y_lv0,prob`` with one row per patch (level-0 top-left)."""
    coords = np.asarray(coords_lv0, dtype=np.int64).reshape(-1, 2)
    probs = np.asarray(probs, dtype=np.float64)
    with atomic_open(path, "w") as fh:
        fh.write(",".join(PATCHES_COLUMNS) + "\n")
        for start in range(0, len(coords), 65536):
            block = coords[start:start + 65536]
            p = probs[start:start + 65536]
            fh.write("".join(f"{x},{y},{v:.6f}\n" for (x, y), v in zip(block.tolist(), p.tolist())))
    return Path(path)


def write_patches_geojson(path: str | os.PathLike, coords_lv0: np.ndarray, probs: np.ndarray, *,
                          patch_size_lv0: int, slide: str = "") -> Path:
    """A QuPath-readable FeatureCollection: one ``detection`` Polygon per patch square (level-0 px,
    closed ring, clockwise in image coordinates) with ``measurements`` {``tumor_probability``: p}.
    Written feature by feature, so memory does not grow with the slide."""
    coords = np.asarray(coords_lv0, dtype=np.int64).reshape(-1, 2)
    probs = np.asarray(probs, dtype=np.float64)
    s = int(patch_size_lv0)
    with atomic_open(path, "w") as fh:
        fh.write('{"type": "FeatureCollection", ')
        if slide:
            fh.write(f'"name": {json.dumps(slide)}, ')
        fh.write('"features": [')
        for k, ((x, y), p) in enumerate(zip(coords.tolist(), probs.tolist())):
            ring = [[x, y], [x + s, y], [x + s, y + s], [x, y + s], [x, y]]
            feature = {
                "type": "Feature",
                "geometry": {"type": "Polygon", "coordinates": [ring]},
                "properties": {"objectType": "detection", "measurements": {MEASUREMENT_NAME: round(float(p), 6)}},
            }
            fh.write(("\n" if k == 0 else ",\n") + json.dumps(feature, separators=(",", ":")))
        fh.write("\n]}\n")
    return Path(path)


def write_detections_csv(path: str | os.PathLike, probs: np.ndarray, x_lv0: np.ndarray, y_lv0: np.ndarray) -> Path:
    """CAMELYON16 detections: ``prob,x,y`` per line, integer level-0 pixels, no header
    (:func:`wsi_milssl.artifacts.format_detection`).

    ``x_lv0`` / ``y_lv0`` must be whole numbers (ValueError otherwise): place a detection on a pixel
    with :func:`wsi_milssl.artifacts.detection_point_lv0`, as :func:`nms_detections` does.
    """
    probs = np.asarray(probs, dtype=np.float64).reshape(-1)
    xy = [np.asarray(v, dtype=np.float64).reshape(-1) for v in (x_lv0, y_lv0)]
    if not (len(probs) == len(xy[0]) == len(xy[1])):
        raise ValueError(f"detections: {len(probs)} probabilities but {len(xy[0])} x and {len(xy[1])} y values.")
    for name, values in zip(("x_lv0", "y_lv0"), xy):
        bad = ~np.isfinite(values) | (values != np.round(values))
        if bad.any():
            raise ValueError(f"detections: {name} {float(values[bad][0])!r} is not a whole level-0 pixel; the CAMELYON16 "
                             "reader parses coordinates with int(). Use wsi_milssl.artifacts.detection_point_lv0.")
    xs, ys = (v.astype(np.int64).tolist() for v in xy)
    with atomic_open(path, "w") as fh:
        fh.write("".join(format_detection(p, x, y) for p, x, y in zip(probs.tolist(), xs, ys)))
    return Path(path)


def _read_scores(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    try:
        with open(path, newline="") as fh:
            reader = csv.DictReader(fh)
            if reader.fieldnames is None or [f.strip() for f in reader.fieldnames][:2] != list(SCORES_COLUMNS):
                raise ConfigError(f"{path}: not a scores file (header must be 'slide,score'). Fix: move it away or "
                                  "write the heatmaps to another --out folder.")
            return {row["slide"].strip(): row["score"].strip() for row in reader if row.get("slide")}
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ConfigError(f"{path}: cannot read the existing scores ({exc}). Fix: delete it and re-run.") from None


def update_scores_csv(out_dir: str | os.PathLike, scores: Mapping[str, float]) -> Path:
    """Add or replace the rows of ``scores`` ({stem: score}) in ``out_dir/scores.csv`` (``slide,score``),
    keeping other slides' rows; rows sorted by slide."""
    import fcntl

    path = Path(out_dir) / SCORES_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    for stem, score in scores.items():
        if not math.isfinite(float(score)):
            raise ValueError(f"slide {stem!r}: score {score!r} is not a finite number.")
    # A lock file serialises concurrent runs writing into the same folder (read-modify-write).
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        rows = _read_scores(path)
        for stem, score in scores.items():
            rows[str(stem)] = f"{float(score):.6f}"
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(SCORES_COLUMNS)
        for stem in sorted(rows):
            writer.writerow([stem, rows[stem]])
        with atomic_open(path, "w") as fh:
            fh.write(buf.getvalue())
    return path
