"""Readers for the evaluation's inputs: heatmap-stage predictions, slide labels and slide lists.

The prediction files are read with the one contract module the heatmap stage writes with,
:mod:`wsi_milssl.artifacts` (names, columns, formats; ``docs/artifacts.md``): ``<stem>_detections.csv``
(CAMELYON16 ``prob,x,y``; a plain ``<stem>.csv`` of other tools works too), ``<stem>_patches.csv``,
``<stem>_probs.json``, ``<stem>_probs.npy``, ``<stem>_heatmap.png`` and ``scores.csv``. Labels come
from :func:`wsi_milssl.cohorts.read_labels`; slides and their suffixes from :mod:`wsi_milssl.cohorts`, slide
folders and lists by the rule of :mod:`wsi_milssl.tiling.inputs` (the one every stage finds slides with).
"""

from __future__ import annotations

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
)
from wsi_milssl.cohorts import SLIDE_SUFFIXES, read_labels, slide_stem
from wsi_milssl.errors import EvaluationError
from wsi_milssl.tiling.inputs import find_slides, read_slide_list, slides_in_folder

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
    """Map slide stem -> slide path from a folder of slides, a slide file or a CSV listing them.

    The slides are found by the rule every stage uses (:func:`wsi_milssl.tiling.inputs.find_slides` and
    :func:`~wsi_milssl.tiling.inputs.read_slide_list`): a CSV with a ``slide`` column of paths or bare names
    (looked up beside it), or ``slide,path`` (``path``/``slide_path``); ``~`` expanded, relative paths from the
    CSV's folder, UTF-8 with or without a byte-order mark. Each slide is keyed by its file's stem, and also by
    its ``slide`` name when another column holds the path. A listed file that does not exist is kept (it is
    needed, and named, only when its slide is a tumour slide); a folder without slides gives an empty mapping
    (normal slides need no file). None gives an empty mapping. ConfigError naming the CSV for a list that
    cannot be read; EvaluationError for a path that does not exist.
    """
    if source is None:
        return {}
    source = Path(source).expanduser()
    if not source.exists():
        raise EvaluationError(f"{source}: --slides is no folder, slide file or CSV file. Fix: check the path.")
    if source.is_file() and source.suffix.lower() == ".csv":
        listed = read_slide_list(source, keep_missing=True)
    elif source.is_dir() and not slides_in_folder(source) and source.suffix.lower() not in SLIDE_SUFFIXES:
        return {}
    else:
        listed = [(p, None) for p in find_slides([source])]
    out: dict[str, Path] = {}
    for path, _ in listed:
        out.setdefault(slide_stem(path), path)
    for path, name in listed:
        if name:
            out.setdefault(name, path)
    return out
