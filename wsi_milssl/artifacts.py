"""The contract of every output after the patch store: heatmap files, detections, scores, evaluation.

``docs/artifacts.md`` documents the same contract for people (as ``store/schema.py`` does for the
stores); the heatmap stage writes with these names and formats and the evaluation stage reads with
them, so change both here. Coordinates are level-0 pixels of the slide, x to the right, y down.

Heatmap folder (``wsi-milssl heatmap --out DIR``; ``OUT/heatmaps/test`` in a pipeline run), per slide
``<stem>`` (:func:`wsi_milssl.cohorts.slide_stem`):

======================  =====================================================================
file                    contents
======================  =====================================================================
``_probs.npy``          float32 (rows, cols) probability map on the patch grid, NaN = no patch
``_probs.json``         sidecar (:data:`SIDECAR_KEYS`): cell (r, c) is the patch with level-0
                        top-left ``(origin_x + c * stride_lv0, origin_y + r * stride_lv0)``
``_probs.tif``          the same map as one float32 page (resolution = one grid cell)
``_probs.ome.tif``      the map registered to the slide: tiled, pyramidal OME-TIFF, float32,
                        pixel (i, j) of level 0 covers level-0 ``[j d, (j+1) d) x [i d, (i+1) d)``
                        with ``d`` = ``ome_downsample`` in the sidecar; physical pixel size
                        ``mpp * d`` µm; NaN = no patch
``_patches.csv``        ``x_lv0,y_lv0,prob`` (:data:`PATCHES_COLUMNS`), one row per patch (top-left)
``_patches.geojson``    QuPath detections, one square per patch, measurement ``tumor_probability``,
                        classification Tumor (p >= the sidecar's ``tumor_threshold``) or Normal
``_lesions.geojson``    predicted lesions: contours of the map at ``tumor_threshold``, QuPath
                        annotations classified Tumor (holes kept)
``_lesions.xml``        the same polygons as ASAP XML (group ``Tumor``; holes as group ``_2``)
``_detections.csv``     CAMELYON16 detections: ``prob,x,y`` per line, no header, x and y integers
                        (the level-0 pixel holding the patch centre, :func:`detection_point_lv0`)
``_heatmap.png``        overlay on the slide thumbnail (PNG text chunk ``wsi-milssl``: geometry)
======================  =====================================================================

Per folder: :data:`SCORES_FILENAME` (``slide,score``), :data:`HEATMAP_STATUS_FILENAME`
(:data:`HEATMAP_STATUS_COLUMNS`) and :data:`HEATMAP_CONFIG_FILENAME` (settings, checkpoint, tiling).

Evaluation folder (``wsi-milssl evaluate --out DIR``; ``OUT/evaluation``): :data:`EVALUATION_FILES`.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from wsi_milssl.errors import EvaluationError
from wsi_milssl.paths import read_bounded

logger = logging.getLogger(__name__)

__all__ = [
    "SCHEMA_VERSION",
    "HEATMAP_FILES",
    "HEATMAP_CONFIG_FILENAME",
    "HEATMAP_STATUS_FILENAME",
    "HEATMAP_STATUS_COLUMNS",
    "HEATMAP_STATUSES",
    "SCORES_FILENAME",
    "SCORES_COLUMNS",
    "PATCHES_COLUMNS",
    "SIDECAR_KEYS",
    "MEASUREMENT_NAME",
    "TUMOR_CLASS",
    "NORMAL_CLASS",
    "LESION_GROUP",
    "EVALUATION_FILES",
    "PER_SLIDE_COLUMNS",
    "DETECTION_OUTCOME_COLUMNS",
    "FROC_CURVE_COLUMNS",
    "MAX_COORDINATE_LV0",
    "DETECTION_HEADER_NAMES",
    "Detections",
    "PredictionFiles",
    "heatmap_paths",
    "parse_heatmap_name",
    "detection_point_lv0",
    "format_detection",
    "read_text",
    "read_detections",
    "read_patch_probs",
    "read_probs_sidecar",
    "read_scores",
    "read_heatmap_config",
    "find_predictions",
]

#: Version of the layout below; recorded in every ``_probs.json`` sidecar.
SCHEMA_VERSION = 1

#: Per-slide files of a heatmap folder: kind -> suffix after the slide stem.
HEATMAP_FILES: dict[str, str] = {
    "probs_npy": "_probs.npy",
    "probs_json": "_probs.json",
    "probs_tif": "_probs.tif",
    "probs_ome_tif": "_probs.ome.tif",
    "patches_csv": "_patches.csv",
    "patches_geojson": "_patches.geojson",
    "lesions_geojson": "_lesions.geojson",
    "lesions_xml": "_lesions.xml",
    "detections_csv": "_detections.csv",
    "heatmap_png": "_heatmap.png",
}

HEATMAP_CONFIG_FILENAME = "heatmap_config.json"
HEATMAP_STATUS_FILENAME = "heatmap_status.csv"
HEATMAP_STATUS_COLUMNS = ("slide", "status", "n_patches", "score", "seconds", "error")
#: ``ok``: every file written; ``failed``: ``error`` says why; ``empty``: no patch, no files, no score
#: (in this order: the heatmap stage unpacks it into its OK, FAILED, EMPTY).
HEATMAP_STATUSES = ("ok", "failed", "empty")
SCORES_FILENAME = "scores.csv"
SCORES_COLUMNS = ("slide", "score")
PATCHES_COLUMNS = ("x_lv0", "y_lv0", "prob")
#: The largest heatmap table or detections file read (a slide of a million patches writes about 30 MB)
MAX_TABLE_BYTES = 256 << 20

#: Keys every ``_probs.json`` sidecar holds (more are kept: provenance, thresholds).
SIDECAR_KEYS = ("slide", "slide_path", "origin_lv0", "stride_lv0", "patch_size_lv0", "mpp", "shape")

#: QuPath measurement holding a patch's probability in ``_patches.geojson``.
MEASUREMENT_NAME = "tumor_probability"
#: QuPath classifications (name, RGB) of patch features; the lesion polygons are Tumor.
TUMOR_CLASS = ("Tumor", (200, 0, 0))
NORMAL_CLASS = ("Normal", (90, 160, 90))
#: Annotation group of predicted lesions in ``_lesions.xml`` / ``_lesions.geojson``.
LESION_GROUP = "Tumor"

#: Files of an evaluation folder: kind -> file name.
EVALUATION_FILES: dict[str, str] = {
    "metrics": "metrics.json",
    "per_slide": "per_slide.csv",
    "detection_outcomes": "detection_outcomes.csv",
    "froc_curve": "froc_curve.csv",
    "froc_png": "froc.png",
    "roc_instance_png": "roc_instance.png",
    "roc_bag_png": "roc_bag.png",
    "config": "config.json",
    "report": "report.html",
}

PER_SLIDE_COLUMNS = (
    "slide", "label", "n_detections", "n_fp", "n_lesions", "n_lesions_detected", "n_itc",
    "n_repeat_hits", "n_itc_hits", "max_prob", "score", "n_patches", "n_positive_patches",
    "instance_auc", "mpp", "lesion_excluded",
)
DETECTION_OUTCOME_COLUMNS = ("slide", "prob", "x_lv0", "y_lv0", "outcome", "region")
FROC_CURVE_COLUMNS = ("threshold", "fp_per_slide", "sensitivity")

#: Largest level-0 coordinate magnitude (px) read from a detections or patches file: beyond any slide, and
#: small enough that pixel arithmetic stays exact in float64 and int64 (``wsi_milssl.annotations`` uses the same
#: bound for polygons). A larger value is an EvaluationError naming the file and line, not an overflow.
MAX_COORDINATE_LV0 = float(1 << 31)


# ----------------------------------------------------------------------------------------------
# Names
# ----------------------------------------------------------------------------------------------

def heatmap_paths(out_dir: str | os.PathLike, stem: str) -> dict[str, Path]:
    """Every per-slide file of ``stem`` in the heatmap folder ``out_dir``, by kind."""
    d = Path(out_dir)
    return {kind: d / f"{stem}{suffix}" for kind, suffix in HEATMAP_FILES.items()}


# Longest suffix first, so that ``x_probs.ome.tif`` is never read as a ``_probs.tif`` of ``x_probs.ome``.
_BY_LENGTH = sorted(HEATMAP_FILES.items(), key=lambda item: -len(item[1]))


def parse_heatmap_name(name: str) -> tuple[str, str] | None:
    """``"Tumor_001_detections.csv"`` -> ``("Tumor_001", "detections_csv")``; None for other names."""
    for kind, suffix in _BY_LENGTH:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)], kind
    return None


# ----------------------------------------------------------------------------------------------
# Detections (CAMELYON16)
# ----------------------------------------------------------------------------------------------

def detection_point_lv0(top_left_lv0: np.ndarray | int, patch_size_lv0: int) -> np.ndarray:
    """int64: the level-0 pixel that holds the centre of a patch (``top_left + patch_size // 2``).

    For an odd side (2107 px at 10x/512 px on a 0.243 µm/px slide) the centre point
    ``top_left + side / 2`` lies inside pixel ``top_left + side // 2``; for an even side it lies on
    the corner shared by four pixels and the lower-right one is taken. Either way the challenge's
    reader (``int(x)``) parses it.
    """
    return np.asarray(top_left_lv0, dtype=np.int64) + int(patch_size_lv0) // 2


def format_detection(prob: float, x_lv0: int, y_lv0: int) -> str:
    """One detection line ``prob,x,y\\n``: probability with 6 decimals, integer level-0 pixels."""
    if not (isinstance(x_lv0, (int, np.integer)) and isinstance(y_lv0, (int, np.integer))):
        raise TypeError(f"detection coordinates must be integers (level-0 pixels); got {x_lv0!r}, {y_lv0!r}.")
    return f"{float(prob):.6f},{int(x_lv0)},{int(y_lv0)}\n"


@dataclass(frozen=True)
class Detections:
    """One slide's detections: float64 (D,) probability and level-0 (x, y) pixel position."""

    probs: np.ndarray
    x_lv0: np.ndarray
    y_lv0: np.ndarray

    def __len__(self) -> int:
        return int(self.probs.shape[0])


def read_text(path: str | os.PathLike, *, what: str, fix: str) -> str:
    """The whole of a UTF-8 text file (a leading byte-order mark dropped, as Excel writes it).

    EvaluationError naming ``path`` when the file cannot be read or is not UTF-8: ``what`` says what the
    file is (``"the slide scores"``), ``fix`` how to mend it (a sentence starting ``Fix:``).
    """
    path = Path(path)
    try:
        raw = read_bounded(path, MAX_TABLE_BYTES)
    except OSError as exc:
        raise EvaluationError(f"{path}: cannot read {what} ({exc.strerror or exc}).") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise EvaluationError(f"{path}: not UTF-8 text (byte {exc.start}); {what} must be UTF-8 (or ASCII) text. "
                              f"{fix}") from None


def _csv_rows(text: str, path: Path, fix: str) -> list[list[str]]:
    try:
        return list(csv.reader(io.StringIO(text, newline="")))
    except csv.Error as exc:
        raise EvaluationError(f"{path}: not a CSV file ({exc}). {fix}") from None


def _coordinate(text: str, path: Path, line: int, column: str) -> float:
    """A level-0 coordinate: a finite number within :data:`MAX_COORDINATE_LV0` (EvaluationError otherwise)."""
    value = _float(text, path, line, column)
    if abs(value) >= MAX_COORDINATE_LV0:
        raise EvaluationError(
            f"{path}: line {line}: {column} {text.strip()!r} lies beyond any slide (level-0 pixel coordinates are "
            f"below {MAX_COORDINATE_LV0:.0f} in magnitude). Fix: write level-0 pixel coordinates."
        )
    return value


def _float(text: str, path: Path, line: int, column: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise EvaluationError(
            f"{path}: line {line}: {column} {text.strip()!r} is not a number. Fix: write numbers only."
        ) from None
    if not math.isfinite(value):
        raise EvaluationError(f"{path}: line {line}: {column} is {text.strip()!r}; it must be a finite number.")
    return value


def is_number(text: str) -> bool:
    """Whether ``text`` reads as a number (``1``, ``-0.5``, ``1e2``, ``nan``): the header rule of CSV readers."""
    try:
        float(text)
    except ValueError:
        return False
    return True


#: Column names a detections header may use (case-insensitive; ``_`` and runs of spaces read as one space):
#: column -> accepted names. CAMELYON16's header is ``Confidence,X coordinate,Y coordinate``.
DETECTION_HEADER_NAMES: dict[str, tuple[str, ...]] = {
    "prob": ("prob", "probability", "confidence", "score", "p"),
    "x": ("x", "x coordinate", "x_lv0"),
    "y": ("y", "y coordinate", "y_lv0"),
}


def _header_name(text: str) -> str:
    return " ".join(text.replace("\ufeff", "").replace("_", " ").split()).lower()


def _detection_columns(row: list[str], path: Path, line: int) -> tuple[int, int, int]:
    """Indices of prob, x, y in a detections header ``row`` (EvaluationError for names not recognised)."""
    names = {_header_name(n): column for column, options in DETECTION_HEADER_NAMES.items() for n in options}
    found = [names.get(_header_name(c)) for c in row]
    if sorted(c for c in found if c is not None) != ["prob", "x", "y"] or None in found:
        accepted = "; ".join(f"{column}: {', '.join(options)}" for column, options in DETECTION_HEADER_NAMES.items())
        raise EvaluationError(
            f"{path}: line {line}: header {','.join(c.strip() for c in row)!r} does not name the columns prob, x and y "
            f"once each (accepted names, any letter case: {accepted}). Fix: name the columns so, e.g. 'prob,x,y' or "
            "CAMELYON16's 'Confidence,X coordinate,Y coordinate', or remove the header and write prob,x,y per line."
        )
    return found.index("prob"), found.index("x"), found.index("y")


def read_detections(path: str | os.PathLike) -> Detections:
    """Read a CAMELYON16 detection CSV: ``prob,x,y`` per line, level-0 pixels, no header.

    An empty file means no detections. A header (a first line of three fields and no number) is read for the
    order of the columns: it must name prob, x and y once each by a name of :data:`DETECTION_HEADER_NAMES`
    (any letter case, e.g. ``x,y,prob`` or CAMELYON16's ``Confidence,X coordinate,Y coordinate``); other
    names are an EvaluationError naming the file and header. Fractional coordinates (files of other tools)
    are tolerated; this package writes integers. The file must be UTF-8 (or ASCII) text, each prob a
    finite number (scores outside [0, 1], as other tools write, are read with a warning: :func:`_check_scores`),
    and x, y finite and below :data:`MAX_COORDINATE_LV0` in magnitude (EvaluationError naming the file and
    line).
    """
    path = Path(path)
    probs: list[float] = []
    xs: list[float] = []
    ys: list[float] = []
    try:
        rows = list(csv.reader(read_bounded(path, MAX_TABLE_BYTES).decode("utf-8-sig").splitlines()))
    except OSError as exc:
        raise EvaluationError(f"{path}: cannot read the detections file ({exc.strerror}).") from None
    except UnicodeDecodeError as exc:
        raise EvaluationError(
            f"{path}: not UTF-8 text (byte {exc.start}); a detections file is text lines 'prob,x,y'. Fix: save "
            "it as UTF-8 or ASCII text, or write it again with the heatmap stage."
        ) from None
    except csv.Error as exc:
        raise EvaluationError(f"{path}: not a CSV file of detections ({exc}). Fix: write one detection per line "
                              "as prob,x,y.") from None
    seen_row = header = False
    i_prob, i_x, i_y = 0, 1, 2
    for line_no, row in enumerate(rows, start=1):
        if not row or all(not c.strip() for c in row):
            continue
        if not seen_row:
            seen_row = True
            if len(row) == 3 and not any(is_number(c) for c in row):  # a header of the three columns
                i_prob, i_x, i_y = _detection_columns(row, path, line_no)
                header = True
                continue
        if len(row) != 3:
            raise EvaluationError(
                f"{path}: line {line_no}: expected 3 values 'prob,x,y' (CAMELYON16 detections, level-0 "
                f"pixels), got {len(row)}. Fix: write one detection per line as prob,x,y."
            )
        probs.append(_float(row[i_prob], path, line_no, "prob"))
        xs.append(_coordinate(row[i_x], path, line_no, "x"))
        ys.append(_coordinate(row[i_y], path, line_no, "y"))
    dets = Detections(np.asarray(probs, dtype=np.float64), np.asarray(xs, dtype=np.float64),
                      np.asarray(ys, dtype=np.float64))
    _check_scores(dets, path, header=header)
    return dets


def _check_scores(dets: Detections, path: Path, *, header: bool) -> None:
    """Scores outside [0, 1] (logits, percentages of other tools) are read as they are, with one warning: the
    FROC uses their order only. A file without a header whose every y lies in [0, 1] while its scores do not
    had its columns in another order (x,y,prob read as prob,x,y): an EvaluationError."""
    outside = (dets.probs < 0.0) | (dets.probs > 1.0)
    if not outside.any():
        return
    line = int(np.argmax(outside)) + 1 + int(header)  # (blank lines aside)
    if not header and bool(np.all((dets.y_lv0 >= 0.0) & (dets.y_lv0 <= 1.0))):
        raise EvaluationError(
            f"{path}: its scores reach {dets.probs[outside][0]:g} (about line {line}) while every y lies in [0, 1]: "
            "the columns seem to be in another order than prob,x,y. Fix: write prob,x,y per line, or a header "
            "naming the columns (e.g. 'x,y,prob').")
    logger.warning("%s: %d detection score(s) outside [0, 1] (from %g to %g), read as scores: the FROC uses their "
                   "order only, and its thresholds are these scores.", path, int(outside.sum()),
                   float(dets.probs.min()), float(dets.probs.max()))


# ----------------------------------------------------------------------------------------------
# Patch probabilities, sidecar, scores, heatmap config
# ----------------------------------------------------------------------------------------------

def read_patch_probs(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """Read ``<stem>_patches.csv`` (header ``x_lv0,y_lv0,prob``): int64 (N, 2) level-0 top-left
    coordinates and float64 (N,) probabilities. EvaluationError naming the file (and line) for a file
    that is not UTF-8 CSV, another header, or a value that is not a finite number (coordinates also
    below :data:`MAX_COORDINATE_LV0` in magnitude)."""
    path = Path(path)
    fix = ("Fix: write the heatmap stage's patch table again (one row per patch: level-0 top-left x_lv0, y_lv0, "
           "probability).")
    rows = _csv_rows(read_text(path, what="the patch probabilities", fix=fix), path, fix)
    header = [c.strip() for c in rows[0]] if rows else []
    if header != list(PATCHES_COLUMNS):
        raise EvaluationError(
            f"{path}: header is {','.join(header)!r}; expected {','.join(PATCHES_COLUMNS)!r}. Fix: write the "
            "heatmap stage's patch table (one row per patch, level-0 top-left, probability)."
        )
    coords: list[tuple[float, float]] = []
    probs: list[float] = []
    for line_no, row in enumerate(rows[1:], start=2):
        if not row:
            continue
        if len(row) != 3:
            raise EvaluationError(f"{path}: line {line_no}: expected 3 values x_lv0,y_lv0,prob; got {len(row)}.")
        coords.append((_coordinate(row[0], path, line_no, "x_lv0"), _coordinate(row[1], path, line_no, "y_lv0")))
        probs.append(_float(row[2], path, line_no, "prob"))
    xy = np.asarray(coords, dtype=np.float64).reshape(-1, 2)
    return np.round(xy).astype(np.int64), np.asarray(probs, dtype=np.float64)


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def read_probs_sidecar(path: str | os.PathLike) -> dict:
    """Read ``<stem>_probs.json``: a JSON object whose ``patch_size_lv0`` (the patch side, level-0 px) is a
    finite positive number, as is ``mpp`` (level-0 µm/px) when given (not null). EvaluationError naming the
    file otherwise, and for a file that is not UTF-8 JSON."""
    path = Path(path)
    fix = "Fix: run the heatmap stage again for this slide, or move the file away."
    try:
        data = json.loads(read_text(path, what="the probability-map sidecar", fix=fix))
    except json.JSONDecodeError as exc:
        raise EvaluationError(f"{path}: invalid JSON at line {exc.lineno} ({exc.msg}). {fix}") from None
    except (ValueError, RecursionError) as exc:  # e.g. an integer of more digits than Python converts
        raise EvaluationError(f"{path}: invalid JSON ({type(exc).__name__}: {exc}). {fix}") from None
    if not isinstance(data, dict):
        raise EvaluationError(f"{path}: expected a JSON object with patch_size_lv0, mpp, origin_lv0, ... {fix}")
    size = data.get("patch_size_lv0")
    if not _positive(size):
        raise EvaluationError(
            f"{path}: 'patch_size_lv0' is {size!r}; it must be the patch side in level-0 pixels (a finite number "
            f"> 0). {fix}"
        )
    mpp = data.get("mpp")
    if mpp is not None and not _positive(mpp):
        raise EvaluationError(
            f"{path}: 'mpp' is {mpp!r}; it must be the slide's level-0 µm per pixel (a finite number > 0). {fix}"
        )
    return data


def read_scores(path: str | os.PathLike) -> dict[str, float]:
    """Read ``scores.csv`` (header ``slide,score``; a leading byte-order mark is dropped) into {stem: score}.
    EvaluationError naming the file (and line) for a file that is not UTF-8 CSV, a header without those
    columns, a score that is not a finite number and a slide listed twice."""
    from wsi_milssl.cohorts import slide_stem

    path = Path(path)
    fix = "Fix: write it as UTF-8 text 'slide,score' with one slide per line, or run the heatmap stage again."
    rows = _csv_rows(read_text(path, what="the slide scores", fix=fix), path, fix)
    header = [c.strip() for c in rows[0]] if rows else None
    if header is None or not set(SCORES_COLUMNS) <= set(header):
        raise EvaluationError(f"{path}: header must contain 'slide,score'; got {header!r}. {fix}")
    slide_col, score_col = header.index("slide"), header.index("score")
    out: dict[str, float] = {}
    for line_no, row in enumerate(rows[1:], start=2):
        if not row:
            continue
        cells = row + [""] * (len(header) - len(row))
        stem = slide_stem(cells[slide_col].strip())
        if stem in out:
            raise EvaluationError(f"{path}: line {line_no}: slide {stem!r} is listed twice.")
        out[stem] = _float(cells[score_col], path, line_no, "score")
    return out


def read_heatmap_config(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The heatmap folder's ``heatmap_config.json`` as a dict, or None when absent or unreadable."""
    path = Path(directory) / HEATMAP_CONFIG_FILENAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# ----------------------------------------------------------------------------------------------
# A folder of predictions
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PredictionFiles:
    """The prediction files found for one slide stem (None where absent)."""

    stem: str
    detections: Path | None = None
    patches: Path | None = None
    sidecar: Path | None = None
    probs_npy: Path | None = None
    heatmap_png: Path | None = None


#: Heatmap file kinds the evaluation reads -> PredictionFiles field.
_EVALUATED_KINDS = {"detections_csv": "detections", "patches_csv": "patches", "probs_json": "sidecar",
                    "probs_npy": "probs_npy", "heatmap_png": "heatmap_png"}


def find_predictions(directory: str | os.PathLike, *, known_stems: Iterable[str] = (),
                     only: Iterable[str] | None = None,
                     passed_over: list[Path] | None = None) -> dict[str, PredictionFiles]:
    """Find prediction files per slide stem in ``directory`` (sorted by stem; hidden files, such as macOS's
    ``._<name>`` beside a copied file, left out as :func:`wsi_milssl.tiling.find_slides` leaves them out).

    ``<stem>_detections.csv`` files always count; a plain ``<stem>.csv`` (CAMELYON16 submission
    naming) counts as a detection file only when ``stem`` is in ``known_stems`` (the labelled
    slides; case-insensitive) and has no ``_detections.csv``. Stems match without case: two files of
    one kind for one slide (``a_detections.csv``, ``A_detections.csv``) are an EvaluationError.
    ``only``: the exact stems (in Unicode NFC) to look at; files of other stems are passed over, an old
    slide's files beside those of the slide renamed from it in letter case included.
    ``passed_over``: when given, the plain CSVs not counted are appended to it, sorted: those whose stem is
    not in ``known_stems`` (any CSV could be named so, so they are not refused, but a caller names them: they
    may be detections of a slide missing from the labels) and those beside their labelled slide's
    ``<stem>_detections.csv``, which counts instead; ``scores.csv``, ``heatmap_status.csv`` and the
    evaluation's own CSVs (:data:`EVALUATION_FILES`) are not.
    """
    import unicodedata

    from wsi_milssl.cohorts import stem_key

    wanted = None if only is None else {unicodedata.normalize("NFC", s) for s in only}

    directory = Path(directory)
    if not directory.is_dir():
        what = "is a file, not a folder" if directory.exists() else "does not exist"
        raise EvaluationError(
            f"{directory}: the predictions folder {what}. Fix: pass the heatmap output folder."
        )
    # one slide per case-folded stem: test_002_detections.csv and Test_002_detections.csv are one slide
    found: dict[str, dict[str, Path]] = {}
    names: dict[str, str] = {}  # key -> the stem as first written
    plain_csv: dict[str, Path] = {}
    for p in sorted(directory.iterdir()):
        if not p.is_file() or p.name.startswith("."):  # hidden: macOS's '._<name>' beside a copied file, ...
            continue
        parsed = parse_heatmap_name(p.name)
        named = parsed[0] if parsed is not None else p.stem
        if wanted is not None and unicodedata.normalize("NFC", named) not in wanted:
            continue
        if parsed is not None:
            stem, kind = parsed
            if kind in _EVALUATED_KINDS:
                key, field = stem_key(stem), _EVALUATED_KINDS[kind]
                other = found.get(key, {}).get(field)
                if other is not None:
                    raise EvaluationError(f"{directory}: {other.name} and {p.name} are files of one slide (names "
                                          "match without case). Fix: keep one of them.")
                names.setdefault(key, stem)
                found.setdefault(key, {})[field] = p
        elif p.suffix == ".csv" and p.name not in (SCORES_FILENAME, HEATMAP_STATUS_FILENAME):
            key = stem_key(p.stem)
            if key in plain_csv:
                raise EvaluationError(f"{directory}: {plain_csv[key].name} and {p.name} are detection files of one "
                                      "slide (names match without case). Fix: keep one of them.")
            plain_csv[key] = p
    known = {stem_key(s) for s in known_stems}
    ours = set(EVALUATION_FILES.values())
    for key, p in plain_csv.items():
        if key in known and "detections" not in found.get(key, {}):
            names.setdefault(key, p.stem)
            found.setdefault(key, {})["detections"] = p
        elif passed_over is not None and p.name not in ours:  # no labelled slide's, or beside its _detections.csv
            passed_over.append(p)
    return {names[key]: PredictionFiles(stem=names[key], **files)
            for key, files in sorted(found.items(), key=lambda kv: names[kv[0]])}
