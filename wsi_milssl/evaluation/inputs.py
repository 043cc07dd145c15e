"""Readers for the evaluation's inputs: heatmap-stage predictions, slide labels and slide lists.

The prediction files are read with the one contract module the heatmap stage writes with,
:mod:`wsi_milssl.artifacts` (names, columns, formats; ``docs/artifacts.md``): ``<stem>_detections.csv``
(CAMELYON16 ``prob,x,y``; a plain ``<stem>.csv`` of other tools works too), ``<stem>_patches.csv``,
``<stem>_probs.json``, ``<stem>_probs.npy``, ``<stem>_heatmap.png`` and ``scores.csv``. Labels come
from :func:`wsi_milssl.cohorts.read_labels`; slides and their suffixes from :mod:`wsi_milssl.cohorts`.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

from wsi_milssl.artifacts import (
    Detections,
    PredictionFiles,
    find_predictions,
    read_detections,
    read_patch_probs,
    read_probs_sidecar,
    read_scores,
    read_text,
)
from wsi_milssl.cohorts import SLIDE_SUFFIXES, read_labels, slide_stem
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


def resolve_slides(source: str | os.PathLike | None) -> dict[str, Path]:
    """Map slide stem -> slide path from a folder of slides or a CSV listing them.

    A folder: every file with one of :data:`SLIDE_SUFFIXES`. A CSV: a ``path`` (or ``slide_path``)
    column, optional ``slide`` column for the stem; relative paths are taken from the CSV's folder.
    None gives an empty mapping. The CSV must be UTF-8 text (a leading byte-order mark is dropped);
    EvaluationError naming it otherwise.
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
    fix = "Fix: write it as UTF-8 text 'slide,path' with one slide per line, or pass the folder that holds the slides."
    text = read_text(source, what="a slide list (--slides)", fix=fix)
    try:
        reader = csv.DictReader(io.StringIO(text, newline=""))
        rows = list(reader)
        names = [f.strip() for f in (reader.fieldnames or [])]
    except csv.Error as exc:
        raise EvaluationError(f"{source}: not a CSV file ({exc}). {fix}") from None
    column = "path" if "path" in names else "slide_path" if "slide_path" in names else None
    if column is None:
        raise EvaluationError(
            f"{source}: a slide list needs a 'path' (or 'slide_path') column; got {','.join(names)!r}. "
            "Fix: write 'slide,path' with one slide per line, or pass the folder that holds the slides."
        )
    for row in rows:
        row = {k.strip(): (v or "").strip() for k, v in row.items() if k is not None}
        if not row.get(column):
            continue
        p = Path(row[column])
        if not p.is_absolute():
            p = source.parent / p
        out[row.get("slide") or slide_stem(p.name)] = p
    return out
