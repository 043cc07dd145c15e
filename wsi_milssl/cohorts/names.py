"""Slide names: the one list of slide suffixes and the one way to reduce a name to its stem.

A slide's outputs (stores, heatmaps, labels, annotations) are keyed by its *stem*: the file name
without its folder and without a whole-slide or store suffix (matched case-insensitively). Stems are
compared case-insensitively and in one Unicode normal form by every stage (:func:`stem_key`), so
``Tumor_001.tif``, ``tumor_001`` and ``TUMOR_001.h5`` name the same slide.
"""

from __future__ import annotations

import os
import unicodedata
from pathlib import Path

from wsi_milssl.atomic import NAME_MAX_BYTES

#: Annotation files matched to slides by ``<slide_stem><suffix>``, in order of preference (ASAP XML, GeoJSON): one
#: tuple for the label stage's search (:mod:`wsi_milssl.annotations.io`) and prepare's (:mod:`wsi_milssl.cohorts`)
ANNOTATION_SUFFIXES = (".xml", ".geojson", ".json")

__all__ = ["ANNOTATION_SUFFIXES", "SLIDE_SUFFIXES", "STORE_SUFFIXES", "NAME_SUFFIXES", "file_identity", "name_key",
           "slide_stem", "stem_key", "stem_too_long", "unsafe_stem"]

#: Suffixes of whole-slide image files (a folder of slides is searched for these).
SLIDE_SUFFIXES = (".svs", ".tif", ".tiff", ".ndpi", ".mrxs", ".scn", ".vms", ".vmu", ".bif", ".svslide",
                  ".czi", ".dcm")

#: Suffixes of per-slide outputs named after the slide (patch stores, feature files).
STORE_SUFFIXES = (".h5", ".hdf5", ".zarr")

#: Every suffix :func:`slide_stem` removes.
NAME_SUFFIXES = SLIDE_SUFFIXES + STORE_SUFFIXES


#: The longest ending a file named after a slide adds to its stem (the heatmap stage's ``<stem>_patches.geojson``,
#: the label stage's ``<stem>_tumor_mask.json``); file systems take names of at most NAME_MAX_BYTES.
LONGEST_OUTPUT_ENDING = "_patches.geojson"


def unsafe_stem(stem: str) -> str | None:
    """Why ``stem``, recorded inside a file (a store's or feature file's ``slide_stem``), cannot name output files
    (they are ``<folder>/<stem><suffix>``): a path separator, ``.`` or ``..``, a NUL, or nothing (review ES: ``../x``
    and absolute paths wrote outside ``--out``); None when it can."""
    if not stem.strip():
        return "it is empty"
    if "/" in stem or "\\" in stem or stem in (".", "..") or "\x00" in stem:
        return "it is a path, not a name (a '/' or '\\', '.' or '..', or a NUL)"
    return None


def stem_too_long(stem: str) -> str | None:
    """Why the files named after slide ``stem`` cannot be made (a name over 255 bytes), or None."""
    n_bytes = len(os.fsencode(stem))
    room = NAME_MAX_BYTES - len(LONGEST_OUTPUT_ENDING)
    if n_bytes <= room:
        return None
    return (f"the slide's name is {n_bytes} bytes long, too long for the files named after it "
            f"({stem[:12]}...{LONGEST_OUTPUT_ENDING} would pass the {NAME_MAX_BYTES} bytes a file name may have). "
            f"Fix: rename the slide (and its annotation file) to at most {room} bytes")


def slide_stem(name: str | os.PathLike) -> str:
    """``"slides/Tumor_001.TIF"`` -> ``"Tumor_001"``: the base name without a slide or store suffix.

    Folders are dropped (``/`` and ``\\`` both separate), surrounding blanks are stripped, and one
    suffix of :data:`NAME_SUFFIXES` is removed, matched case-insensitively; a name with another
    suffix is kept whole (``"case.01"`` stays ``"case.01"``).
    """
    text = os.fspath(name).strip().replace("\\", "/").rstrip("/")
    base = text.rsplit("/", 1)[-1].strip()
    lower = base.lower()
    for suffix in NAME_SUFFIXES:
        if lower.endswith(suffix) and len(base) > len(suffix):
            return base[: -len(suffix)]
    return base


def name_key(text: str) -> str:
    """The key names are matched by: case-folded and in Unicode NFC, so that a name decomposed by macOS
    (``café_3.tif`` as ``e`` + combining accent) matches the composed one."""
    return unicodedata.normalize("NFC", text.casefold())


def stem_key(name: str | os.PathLike) -> str:
    """The key stems are matched by: :func:`name_key` of :func:`slide_stem`."""
    return name_key(slide_stem(name))


def file_identity(path: str | os.PathLike) -> tuple[int, int] | str:
    """What identifies the file ``path`` names whatever its names (symbolic and hard links, another
    spelling): its device and inode when it exists, else its resolved path."""
    p = Path(path).expanduser()
    try:
        st = p.stat()
    except OSError:
        return os.path.realpath(p)
    return st.st_dev, st.st_ino
