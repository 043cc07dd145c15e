"""Readers for the evaluation's inputs: heatmap-stage predictions, slide labels and slide lists.

Prediction folder (the heatmap stage's contract; detection CSVs from other tools work too)::

    <stem>_detections.csv   prob,x,y per detection, level-0 px, no header (CAMELYON16 format);
                            <stem>.csv is accepted as well (CAMELYON16 submission naming)
    <stem>_patches.csv      x_lv0,y_lv0,prob, one row per patch (top-left, level-0 px)
    <stem>_probs.json       sidecar: slide, slide_path, origin_lv0, stride_lv0, patch_size_lv0, mpp, shape
    <stem>_probs.npy        float32 (rows, cols) probability map, NaN where no patch
    <stem>_heatmap.png      overlay
    scores.csv              slide,score
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from wsi_milssl.cohorts import SLIDE_SUFFIXES, read_labels, slide_stem, stem_key
from wsi_milssl.errors import EvaluationError

__all__ = [
    "SLIDE_SUFFIXES",
    "Detections",
    "PredictionFiles",
    "find_predictions",
    "read_detections",
    "read_labels",
    "read_patch_probs",
    "read_probs_sidecar",
    "read_scores",
    "resolve_slides",
    "slide_stem",
]

@dataclass(frozen=True)
class Detections:
    """One slide's detections: float64 (D,) probability and level-0 (x, y) pixel position."""

    probs: np.ndarray
    x_lv0: np.ndarray
    y_lv0: np.ndarray

    def __len__(self) -> int:
        return int(self.probs.shape[0])


@dataclass(frozen=True)
class PredictionFiles:
    """The prediction files found for one slide stem (None where absent)."""

    stem: str
    detections: Path | None = None
    patches: Path | None = None
    sidecar: Path | None = None
    probs_npy: Path | None = None
    heatmap_png: Path | None = None


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


def read_detections(path: str | os.PathLike) -> Detections:
    """Read a CAMELYON16 detection CSV: ``prob,x,y`` per line, level-0 pixels, no header.

    An empty file means no detections. A first line ``prob,x,y`` (a header) is tolerated.
    """
    path = Path(path)
    probs: list[float] = []
    xs: list[float] = []
    ys: list[float] = []
    try:
        fh = open(path, newline="")
    except OSError as exc:
        raise EvaluationError(f"{path}: cannot read the detections file ({exc.strerror}).") from None
    with fh:
        for line_no, row in enumerate(csv.reader(fh), start=1):
            if not row or all(not c.strip() for c in row):
                continue
            if line_no == 1 and [c.strip().lower() for c in row] == ["prob", "x", "y"]:
                continue
            if len(row) != 3:
                raise EvaluationError(
                    f"{path}: line {line_no}: expected 3 values 'prob,x,y' (CAMELYON16 detections, level-0 "
                    f"pixels), got {len(row)}. Fix: write one detection per line as prob,x,y."
                )
            probs.append(_float(row[0], path, line_no, "prob"))
            xs.append(_float(row[1], path, line_no, "x"))
            ys.append(_float(row[2], path, line_no, "y"))
    return Detections(np.asarray(probs, dtype=np.float64), np.asarray(xs, dtype=np.float64),
                      np.asarray(ys, dtype=np.float64))


def read_patch_probs(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """Read ``<stem>_patches.csv`` (header ``x_lv0,y_lv0,prob``): int64 (N, 2) level-0 top-left
    coordinates and float64 (N,) probabilities."""
    path = Path(path)
    try:
        fh = open(path, newline="")
    except OSError as exc:
        raise EvaluationError(f"{path}: cannot read the patch probabilities ({exc.strerror}).") from None
    coords: list[tuple[float, float]] = []
    probs: list[float] = []
    with fh:
        reader = csv.reader(fh)
        header = [c.strip() for c in next(reader, [])]
        if header != ["x_lv0", "y_lv0", "prob"]:
            raise EvaluationError(
                f"{path}: header is {','.join(header)!r}; expected 'x_lv0,y_lv0,prob'. Fix: write the "
                "heatmap stage's patch table (one row per patch, level-0 top-left, probability)."
            )
        for line_no, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != 3:
                raise EvaluationError(f"{path}: line {line_no}: expected 3 values x_lv0,y_lv0,prob; got {len(row)}.")
            coords.append((_float(row[0], path, line_no, "x_lv0"), _float(row[1], path, line_no, "y_lv0")))
            probs.append(_float(row[2], path, line_no, "prob"))
    xy = np.asarray(coords, dtype=np.float64).reshape(-1, 2)
    return np.round(xy).astype(np.int64), np.asarray(probs, dtype=np.float64)


def read_probs_sidecar(path: str | os.PathLike) -> dict:
    """Read ``<stem>_probs.json`` and check ``patch_size_lv0`` (a positive number) is present."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise EvaluationError(f"{path}: cannot read the probability-map sidecar ({exc.strerror}).") from None
    except json.JSONDecodeError as exc:
        raise EvaluationError(f"{path}: invalid JSON at line {exc.lineno} ({exc.msg}).") from None
    if not isinstance(data, dict):
        raise EvaluationError(f"{path}: expected a JSON object with patch_size_lv0, mpp, origin_lv0, ...")
    size = data.get("patch_size_lv0")
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
        raise EvaluationError(
            f"{path}: 'patch_size_lv0' is {size!r}; it must be the patch side in level-0 pixels (> 0)."
        )
    return data


def read_scores(path: str | os.PathLike) -> dict[str, float]:
    """Read ``scores.csv`` (header ``slide,score``) into {stem: score}."""
    path = Path(path)
    out: dict[str, float] = {}
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        if reader.fieldnames is None or not {"slide", "score"} <= {f.strip() for f in reader.fieldnames}:
            raise EvaluationError(
                f"{path}: header must contain 'slide,score'; got {reader.fieldnames!r}."
            )
        for line_no, row in enumerate(reader, start=2):
            row = {k.strip(): (v or "") for k, v in row.items() if k is not None}
            stem = slide_stem(row["slide"].strip())
            if stem in out:
                raise EvaluationError(f"{path}: line {line_no}: slide {stem!r} is listed twice.")
            out[stem] = _float(row["score"], path, line_no, "score")
    return out


def resolve_slides(source: str | os.PathLike | None) -> dict[str, Path]:
    """Map slide stem -> slide path from a folder of slides or a CSV listing them.

    A folder: every file with one of :data:`SLIDE_SUFFIXES`. A CSV: a ``path`` (or ``slide_path``)
    column, optional ``slide`` column for the stem; relative paths are taken from the CSV's folder.
    None gives an empty mapping.
    """
    if source is None:
        return {}
    source = Path(source)
    out: dict[str, Path] = {}
    if source.is_dir():
        for p in sorted(source.iterdir()):
            if p.is_file() and p.name.lower().endswith(SLIDE_SUFFIXES):
                out.setdefault(slide_stem(p.name), p)
        return out
    if not source.is_file():
        raise EvaluationError(f"{source}: --slides is neither a folder nor a CSV file. Fix: check the path.")
    with open(source, newline="") as fh:
        reader = csv.DictReader(fh)
        names = [f.strip() for f in (reader.fieldnames or [])]
        column = "path" if "path" in names else "slide_path" if "slide_path" in names else None
        if column is None:
            raise EvaluationError(
                f"{source}: a slide list needs a 'path' (or 'slide_path') column; got {','.join(names)!r}. "
                "Fix: write 'slide,path' with one slide per line, or pass the folder that holds the slides."
            )
        for row in reader:
            row = {k.strip(): (v or "").strip() for k, v in row.items() if k is not None}
            if not row.get(column):
                continue
            p = Path(row[column])
            if not p.is_absolute():
                p = source.parent / p
            out[row.get("slide") or slide_stem(p.name)] = p
    return out


def _stem_of(name: str, suffix: str) -> str | None:
    return name[: -len(suffix)] if name.endswith(suffix) and len(name) > len(suffix) else None


def find_predictions(directory: str | os.PathLike, *, known_stems: set[str] | frozenset[str] = frozenset()
                     ) -> dict[str, PredictionFiles]:
    """Find prediction files per slide stem in ``directory`` (sorted by stem).

    ``<stem>_detections.csv`` files always count; a plain ``<stem>.csv`` counts as a detection file
    only when ``stem`` is in ``known_stems`` (the labelled slides; case-insensitive) and has no ``_detections.csv``.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise EvaluationError(
            f"{directory}: the predictions folder does not exist. Fix: pass the heatmap output folder."
        )
    found: dict[str, dict[str, Path]] = {}
    plain_csv: dict[str, Path] = {}
    kinds = (("_detections.csv", "detections"), ("_patches.csv", "patches"), ("_probs.json", "sidecar"),
             ("_probs.npy", "probs_npy"), ("_heatmap.png", "heatmap_png"))
    for p in sorted(directory.iterdir()):
        if not p.is_file():
            continue
        for suffix, key in kinds:
            stem = _stem_of(p.name, suffix)
            if stem is not None:
                found.setdefault(stem, {})[key] = p
                break
        else:
            if p.suffix == ".csv" and p.name != "scores.csv":
                plain_csv[p.stem] = p
    known = {stem_key(s) for s in known_stems}
    for stem, p in plain_csv.items():
        if stem_key(stem) in known and "detections" not in found.get(stem, {}):
            found.setdefault(stem, {})["detections"] = p
    return {stem: PredictionFiles(stem=stem, **files) for stem, files in sorted(found.items())}
