"""The heatmap stage's per-slide files, written with the cross-stage contract :mod:`wsi_milssl.artifacts`.

The names, columns, dtypes and coordinate frames of every file are defined there (and in
``docs/artifacts.md``); the evaluation stage reads them with the same module. This module holds the
writers and the non-maximum suppression that turns a probability map into CAMELYON16 detections.

Every file is written to a temporary name in the same folder, fsynced and renamed.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
import uuid
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from wsi_milssl.artifacts import (
    LESION_GROUP,
    MEASUREMENT_NAME,
    NORMAL_CLASS,
    PATCHES_COLUMNS,
    SCORES_COLUMNS,
    SCORES_FILENAME,
    SIDECAR_KEYS,
    TUMOR_CLASS,
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
    "remove_slide_outputs",
    "write_empty_slide_outputs",
    "nms_detections",
    "write_probs",
    "ome_downsample",
    "write_probs_ome_tiff",
    "lesion_polygons",
    "write_lesions",
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

def write_probs(out_dir: str | os.PathLike, stem: str, grid: np.ndarray, sidecar: Mapping[str, Any], *,
                write_json: bool = True) -> dict[str, Path]:
    """Write ``<stem>_probs.npy``, ``<stem>_probs.tif`` (``sidecar`` as its description) and, with
    ``write_json``, ``<stem>_probs.json``.

    ``sidecar`` must hold the contract keys (slide, slide_path, origin_lv0, stride_lv0, patch_size_lv0,
    mpp, shape); more keys are kept. ``write_json=False``: the caller writes the JSON itself once the
    slide's other files are there (the heatmap stage: the JSON marks a slide's files complete).
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
    if write_json:
        with atomic_open(paths["probs_json"], "w") as fh:
            fh.write(text)
    return {k: paths[k] for k in ("probs_npy", "probs_tif", "probs_json")}


#: Pixels of one OME-TIFF tile side; a pyramid level is added while the last is larger than a tile.
OME_TILE_PX = 256
#: Automatic OME-TIFF downsample: at least this many OME pixels per grid stride.
OME_PX_PER_STRIDE = 8
#: Largest OME-TIFF level 0 (pixels), so that a tiny ``ome_downsample`` on a large slide is refused.
OME_MAX_PIXELS = 1 << 28


def ome_downsample(stride_lv0: int, requested: int = 0) -> int:
    """Level-0 pixels per OME-TIFF pixel: ``requested`` when > 0, else the largest power of two that
    leaves at least :data:`OME_PX_PER_STRIDE` pixels per grid stride (1 for strides below 16 px)."""
    if requested > 0:
        return int(requested)
    d = 1
    while stride_lv0 / (2 * d) >= OME_PX_PER_STRIDE:
        d *= 2
    return d


def _halve_max(level: np.ndarray) -> np.ndarray:
    """Next pyramid level: the maximum of each 2 x 2 block, ignoring NaN (all NaN stays NaN), so a
    small positive region stays visible when zoomed out."""
    h, w = level.shape
    padded = np.full((h + h % 2, w + w % 2), np.nan, np.float32)
    padded[:h, :w] = level
    blocks = padded.reshape(padded.shape[0] // 2, 2, padded.shape[1] // 2, 2)
    finite = np.isfinite(blocks)
    out = np.where(finite, blocks, -np.inf).max(axis=(1, 3))
    return np.where(finite.any(axis=(1, 3)), out, np.nan).astype(np.float32)


def write_probs_ome_tiff(path: str | os.PathLike, grid: np.ndarray, *, origin_lv0: tuple[int, int], stride_lv0: int,
                         patch_size_lv0: int, mpp: float, dimensions_lv0: tuple[int, int], downsample: int,
                         name: str = "", description: Mapping[str, Any] | None = None) -> Path:
    """The probability map as a tiled, pyramidal OME-TIFF registered to the slide.

    Level 0 spans the slide: pixel (i, j) covers level-0 ``[j d, (j+1) d) x [i d, (i+1) d)`` (``d`` =
    ``downsample``; ``ceil(W0 / d) x ceil(H0 / d)`` pixels) and holds the probability of the patch
    centred nearest to the pixel centre when that centre lies inside the patch (the overlay PNG's
    rule, :func:`wsi_milssl.inference.heatmap.sample_grid`), NaN elsewhere; float32. The physical
    pixel size (OME ``PhysicalSizeX/Y`` and the TIFF resolution tags) is ``mpp * d`` µm, so a viewer
    that scales images by pixel size (QuPath's image overlay and alignment) puts it on the slide.
    Reduced levels halve the previous one (2 x 2 maximum, see :func:`_halve_max`) in SubIFDs, as the
    OME-TIFF pyramid layout has it, down to one tile; tiles of 256 x 256, zlib-compressed.
    ``description``: JSON-ready facts stored in the OME ``Image`` description.
    """
    import tifffile

    from wsi_milssl.inference.heatmap import sample_grid

    d = int(downsample)
    if d < 1:
        raise ValueError(f"downsample must be a positive integer; got {downsample!r}.")
    w0, h0 = (int(v) for v in dimensions_lv0)
    width, height = -(-w0 // d), -(-h0 // d)
    if width * height > OME_MAX_PIXELS:
        raise ConfigError(f"{path}: an OME-TIFF of {width} x {height} pixels (downsample {d} on a {w0} x {h0} px "
                          f"slide) is too large. Fix: raise ome_downsample (0 = automatic).")
    level = sample_grid(grid, (height, width), (float(d), float(d)), origin_lv0=origin_lv0, stride_lv0=stride_lv0,
                        patch_size_lv0=patch_size_lv0)
    levels = [np.ascontiguousarray(level, dtype=np.float32)]
    while max(levels[-1].shape) > OME_TILE_PX:
        levels.append(_halve_max(levels[-1]))
    px_um = float(mpp) * d
    options = dict(photometric="minisblack", tile=(OME_TILE_PX, OME_TILE_PX), compression="zlib",
                   resolutionunit="CENTIMETER")
    metadata = {"axes": "YX", "Name": name or Path(path).name, "PhysicalSizeX": px_um, "PhysicalSizeXUnit": "µm",
                "PhysicalSizeY": px_um, "PhysicalSizeYUnit": "µm"}
    if description:
        metadata["Description"] = json.dumps(dict(description), sort_keys=True)
    # The same map gives the same file, byte for byte (tifffile would draw a random UUID).
    digest = hashlib.sha256(levels[0].tobytes() + json.dumps(metadata, sort_keys=True).encode()).hexdigest()
    metadata["UUID"] = f"urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, 'wsi-milssl:' + digest)}"
    bigtiff = sum(a.nbytes for a in levels) > (1 << 31)
    with atomic_open(path) as fh:
        with tifffile.TiffWriter(fh, bigtiff=bigtiff, ome=True) as tif:
            for k, data in enumerate(levels):
                scale = px_um * (2 ** k)
                extra = {"subifds": len(levels) - 1, "metadata": metadata} if k == 0 else {"subfiletype": 1}
                tif.write(data, resolution=(1e4 / scale, 1e4 / scale), **options, **extra)
    return Path(path)


def lesion_polygons(grid: np.ndarray, *, origin_lv0: tuple[int, int], stride_lv0: int, patch_size_lv0: int,
                    threshold: float):
    """Predicted lesions: the contours of the probability map at ``threshold``, in level-0 px.

    The map's cell (r, c) sits at its patch centre ``origin + (c, r) * stride + patch / 2``; no patch
    (NaN) counts as 0. ``skimage.measure.find_contours`` traces the iso-line at ``threshold``
    (linear interpolation between cell centres, so a lone positive cell becomes a diamond reaching
    half a stride from its centre); nested rings become holes (even-odd rule). Returns a list of
    shapely Polygons (valid, largest first; empty when no cell reaches ``threshold``), each with its
    exterior ring counter-clockwise and its holes clockwise by the signed area of the coordinate values
    (RFC 7946 3.1.6 for the GeoJSON; on screen, with y down, the exterior runs clockwise).
    """
    import shapely
    from skimage.measure import find_contours

    values = np.nan_to_num(np.asarray(grid, dtype=np.float64), nan=0.0)
    if values.size == 0 or not (values >= threshold).any():
        return []
    # the cells beyond the map count as 0, as cells without a patch do (below any threshold > 0): a lesion at the
    # map's edge reaches half a stride beyond its last cells there too (review BO: a stride / 6 short)
    padded = np.pad(values, 1, constant_values=0.0 if threshold > 0 else float(threshold) - 1.0)
    rings = []
    half = patch_size_lv0 / 2.0
    for contour in find_contours(padded, float(threshold), fully_connected="high"):
        rc = contour - 1.0  # undo the padding: (row, col) in cells
        xy = np.stack([origin_lv0[0] + half + rc[:, 1] * stride_lv0,
                       origin_lv0[1] + half + rc[:, 0] * stride_lv0], axis=1)
        if len(xy) >= 4:
            ring = shapely.Polygon(xy)
            if ring.area > 0:
                rings.append(shapely.make_valid(ring))
    region = _even_odd(rings)
    polys = [g for g in shapely.get_parts(region) if g.geom_type == "Polygon" and g.area > 0]
    polys += [p for g in shapely.get_parts(region) if g.geom_type == "MultiPolygon" for p in g.geoms]
    oriented = (shapely.orient_polygons(shapely.normalize(p), exterior_cw=False) for p in polys)
    return sorted(oriented, key=lambda g: -g.area)


def _even_odd(rings: list):
    """The region the even-odd rule gives ``rings`` (shapely polygons): a ring inside another is a hole, one inside
    that an island, ... as the symmetric difference of them all, taken in pairs, then pairs of pairs (the same
    region as one after the other, which rebuilt the whole region for each ring: minutes for the thousands of
    contours of a noisy 20,000-patch map)."""
    import shapely

    level = np.array(rings, dtype=object)
    if level.size == 0:
        return shapely.GeometryCollection()
    while level.size > 1:
        paired = 2 * (level.size // 2)
        level = np.concatenate([shapely.symmetric_difference(level[0:paired:2], level[1:paired:2]), level[paired:]])
    return level[0]


def write_lesions(geojson_path: str | os.PathLike, xml_path: str | os.PathLike, polygons, *, grid: np.ndarray,
                  origin_lv0: tuple[int, int], stride_lv0: int, patch_size_lv0: int, mpp: float) -> dict[str, Path]:
    """Write predicted lesion ``polygons`` (shapely, level-0 px) as QuPath GeoJSON annotations and ASAP
    XML with the project's annotation writers: group/classification ``Tumor`` (red), holes kept
    (ASAP: holes as polygons of group ``_2``; a hole around another lesion as the hole minus that
    lesion, in pieces without holes, so the XML read back covers every lesion). Each is named ``Lesion k (max p P, A mm2)`` with the
    highest map value of the cells inside and its area."""
    import shapely

    from wsi_milssl.annotations import PolygonAnnotation, write_annotations

    grid = np.asarray(grid, dtype=np.float64)
    rows, cols = grid.shape
    anns = []
    for k, poly in enumerate(polygons, start=1):
        x0, y0, x1, y1 = poly.bounds
        c0 = max(0, int(np.floor((x0 - origin_lv0[0]) / stride_lv0)) - 1)
        r0 = max(0, int(np.floor((y0 - origin_lv0[1]) / stride_lv0)) - 1)
        c1 = min(cols, int(np.ceil((x1 - origin_lv0[0]) / stride_lv0)) + 1)
        r1 = min(rows, int(np.ceil((y1 - origin_lv0[1]) / stride_lv0)) + 1)
        rr, cc = np.mgrid[r0:r1, c0:c1]
        half = patch_size_lv0 / 2.0
        centres = (origin_lv0[0] + cc * stride_lv0 + half, origin_lv0[1] + rr * stride_lv0 + half)
        inside = shapely.contains_xy(poly, *centres) if rr.size else np.zeros(0, bool)
        values = grid[rr[inside], cc[inside]] if rr.size else np.zeros(0)
        peak = float(np.nanmax(values)) if np.isfinite(values).any() else float("nan")
        area_mm2 = poly.area * float(mpp) ** 2 / 1e6
        name = f"Lesion {k} (max p {peak:.3f}, {area_mm2:.3f} mm2)"
        shell = np.asarray(poly.exterior.coords, dtype=np.float64)[:-1]
        holes = tuple(np.asarray(r.coords, dtype=np.float64)[:-1] for r in poly.interiors)
        anns.append(PolygonAnnotation(name, LESION_GROUP, shell, "#C80000", "Polygon", holes))
    groups = {LESION_GROUP: "#C80000"}
    return {"lesions_geojson": write_annotations(anns, geojson_path, format="geojson", groups=groups),
            "lesions_xml": write_annotations(anns, xml_path, format="asap", groups=groups)}


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


def _qupath_class(item: tuple[str, tuple[int, int, int]]) -> dict[str, Any]:
    """A QuPath ``classification`` member: QuPath 0.4+ reads ``{"name", "color": [r, g, b]}`` (both keys)."""
    name, rgb = item
    return {"name": name, "color": [int(v) for v in rgb]}


def write_patches_geojson(path: str | os.PathLike, coords_lv0: np.ndarray, probs: np.ndarray, *,
                          patch_size_lv0: int, slide: str = "", tumor_threshold: float | None = 0.5) -> Path:
    """A QuPath-readable FeatureCollection: one ``detection`` Polygon per patch square (level-0 px,
    closed ring, clockwise in image coordinates) with ``measurements`` {``tumor_probability``: p} and
    a ``classification``: Tumor (red) when ``p >= tumor_threshold``, else Normal (green), so QuPath
    colours the patches as it opens them (None: no classification). Written feature by feature, so
    memory does not grow with the slide."""
    coords = np.asarray(coords_lv0, dtype=np.int64).reshape(-1, 2)
    probs = np.asarray(probs, dtype=np.float64)
    s = int(patch_size_lv0)
    classes = (_qupath_class(NORMAL_CLASS), _qupath_class(TUMOR_CLASS))
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
            if tumor_threshold is not None:
                feature["properties"]["classification"] = classes[int(p >= tumor_threshold)]
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
        with open(path, newline="", encoding="utf-8-sig") as fh:
            reader = csv.DictReader(fh)
            if reader.fieldnames is None or [f.strip() for f in reader.fieldnames][:2] != list(SCORES_COLUMNS):
                raise ConfigError(f"{path}: not a scores file (header must be 'slide,score'). Fix: move it away or "
                                  "write the heatmaps to another --out folder.")
            return {row["slide"].strip(): row["score"].strip() for row in reader if row.get("slide")}
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ConfigError(f"{path}: cannot read the existing scores ({exc}). Fix: delete it and re-run.") from None


def remove_slide_outputs(out_dir: str | os.PathLike, stem: str) -> None:
    """Delete the per-slide files and ``scores.csv`` rows of ``stem`` in ``out_dir``, under any spelling of
    the name that matches it without case (evaluate takes those for one slide): a slide found empty (no
    tissue patch) on a later run must not be evaluated on the predictions of an earlier version of it."""
    from wsi_milssl.artifacts import parse_heatmap_name
    from wsi_milssl.atomic import remove_quietly
    from wsi_milssl.cohorts import stem_key

    key = stem_key(stem)
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return
    for path in out_dir.iterdir():
        parsed = parse_heatmap_name(path.name)
        if parsed is not None and stem_key(parsed[0]) == key and path.is_file():
            remove_quietly(path)
    scores = out_dir / SCORES_FILENAME
    if scores.is_file():
        stale = [name for name in _read_scores(scores) if stem_key(name) == key]
        if stale:
            update_scores_csv(out_dir, {}, drop=stale)


def write_empty_slide_outputs(out_dir: str | os.PathLike, stem: str) -> dict[str, str]:
    """The files of a slide without a single kept patch (status 'empty', no score): its earlier outputs
    removed (:func:`remove_slide_outputs`), and an empty (0-byte) ``<stem>_detections.csv``, so that the
    folder holds a detections file for every slide evaluated: the CAMELYON16 FROC script counts the slides
    by those files, and divides the false positives by that count. Returns {"detections_csv": path}."""
    remove_slide_outputs(out_dir, stem)
    path = write_detections_csv(output_paths(out_dir, stem)["detections_csv"], np.empty(0), np.empty(0), np.empty(0))
    return {"detections_csv": str(path)}


def update_scores_csv(out_dir: str | os.PathLike, scores: Mapping[str, float], *, keep_others: bool = True,
                      drop: Iterable[str] = ()) -> Path:
    """Add or replace the rows of ``scores`` ({stem: score}) in ``out_dir/scores.csv`` (``slide,score``),
    keeping other slides' rows but those of ``drop`` (``keep_others=False``: dropping them all, so the file
    lists exactly the slides of ``scores``); rows sorted by slide. Safe while other runs (shards) update the
    file (:func:`wsi_milssl.locks.folder_mutex`; no lock file is left behind)."""
    from wsi_milssl.locks import folder_mutex

    path = Path(out_dir) / SCORES_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    for stem, score in scores.items():
        if not math.isfinite(float(score)):
            raise ValueError(f"slide {stem!r}: score {score!r} is not a finite number.")
    with folder_mutex(path.parent):
        rows = _read_scores(path) if keep_others else {}
        for stem in drop:
            rows.pop(str(stem), None)
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
