"""Slide labels from ``labels.csv``.

Accepted layouts:

- ``slide,label`` header (as ``wsi-milssl synth`` writes it), extra columns ignored;
- CAMELYON16 ``reference.csv`` without a header: ``Test_001,Tumor,Macro,...`` / ``Test_002,Normal,...``.

Labels: ``1``/``tumor``/``tumour``/``positive``/``true`` are tumour, ``0``/``normal``/``negative``/
``false`` are normal (case-insensitive). A slide name with a suffix (``tumor_001.tif``) is reduced to
its stem.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

from wsi_milssl.errors import AnnotationError

__all__ = ["read_slide_labels", "slide_stem_of"]

_WORDS = {
    "1": 1, "tumor": 1, "tumour": 1, "positive": 1, "true": 1,
    "0": 0, "normal": 0, "negative": 0, "false": 0,
}
_SLIDE_SUFFIXES = (".svs", ".ndpi", ".mrxs", ".tif", ".tiff", ".scn", ".vms", ".vmu", ".bif", ".svslide", ".h5", ".zarr")


def slide_stem_of(name: str) -> str:
    """``"tumor_001.tif"`` -> ``"tumor_001"``; a name without a slide suffix is returned stripped."""
    name = name.strip()
    lower = name.lower()
    for suffix in _SLIDE_SUFFIXES:
        if lower.endswith(suffix):
            return name[: -len(suffix)]
    return name


def read_slide_labels(path: str | os.PathLike) -> dict[str, int]:
    """Read slide labels into ``{slide stem: 0 or 1}``.

    Raises AnnotationError naming the file and line for a missing file, an unknown label, or a
    slide listed twice with different labels.
    """
    path = Path(path)
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            rows = list(csv.reader(fh))
    except FileNotFoundError:
        raise AnnotationError(f"{path}: slide labels file not found; check --labels.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise AnnotationError(f"{path}: cannot read the slide labels ({exc}).") from None
    rows = [(n, [c.strip() for c in r]) for n, r in enumerate(rows, start=1) if any(c.strip() for c in r)]
    if not rows:
        raise AnnotationError(f"{path}: no slide labels; write 'slide,label' and one slide per line.")
    slide_col, label_col = 0, 1
    first = [c.casefold() for c in rows[0][1]]
    if "slide" in first and "label" in first:
        slide_col, label_col = first.index("slide"), first.index("label")
        rows = rows[1:]
    elif len(first) > 1 and first[1] not in _WORDS:
        raise AnnotationError(
            f"{path}: line {rows[0][0]}: header {','.join(rows[0][1])!r} has no 'slide' and 'label' columns; "
            "write 'slide,label' (or no header, as CAMELYON16's reference.csv: name,Tumor|Normal,...)."
        )
    out: dict[str, int] = {}
    for line, row in rows:
        if len(row) <= max(slide_col, label_col):
            raise AnnotationError(f"{path}: line {line}: expected a slide name and a label; got {','.join(row)!r}.")
        stem = slide_stem_of(row[slide_col])
        value = _WORDS.get(row[label_col].casefold())
        if value is None:
            raise AnnotationError(
                f"{path}: line {line}: label {row[label_col]!r} of slide {stem!r} is not 0/1 or normal/tumor; "
                "use 1 (tumour) or 0 (normal)."
            )
        if stem in out and out[stem] != value:
            raise AnnotationError(f"{path}: line {line}: slide {stem!r} is listed twice with different labels.")
        out[stem] = value
    return out
