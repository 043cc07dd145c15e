"""Turn the SLIDES arguments of ``wsi-milssl tile`` (files, folders, CSV lists) into slide paths."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Iterable

from wsi_milssl.cohorts import SLIDE_SUFFIXES, slide_stem, stem_key
from wsi_milssl.cohorts.names import name_key
from wsi_milssl.errors import ConfigError

# The one list of slide suffixes and the one stem rule live in wsi_milssl.cohorts (every stage uses them).
__all__ = ["SLIDE_SUFFIXES", "file_fingerprint", "find_slides", "slide_stem"]

#: Columns of a slide list that hold slide paths, in order of preference (``slide`` may hold a path
#: or a bare name looked up beside the CSV).
PATH_COLUMNS = ("path", "slide_path", "slide")


def file_fingerprint(path: str | os.PathLike) -> dict[str, str | int] | None:
    """What identifies one version of a file: ``{"path": absolute path (symlinks resolved),
    "size_bytes": int, "mtime_ns": int}`` (a folder, such as a Zarr store: the folder entry's own), or
    None when ``path`` does not exist or cannot be read. A file rewritten in place (a slide generated
    or exported again under the same name) gets a new ``mtime_ns`` and usually a new size."""
    try:
        resolved = Path(path).resolve()
        st = resolved.stat()
    except (OSError, RuntimeError):  # missing, permission denied, a symlink loop
        return None
    return {"path": str(resolved), "size_bytes": int(st.st_size), "mtime_ns": int(st.st_mtime_ns)}


def _slide_named(p: Path, listings: dict[Path, list[Path]]) -> Path | None:
    """The slide file in ``p``'s folder whose stem is ``p.name`` (a bare slide name of a CSV list), or
    None: suffix and stem matched case-insensitively as :mod:`wsi_milssl.cohorts.names` does (``UPPER``
    finds ``UPPER.TIF``); of several, the first by :data:`SLIDE_SUFFIXES`. ``listings``: the slide
    files of each folder, listed once per CSV."""
    if p.parent not in listings:
        try:
            listings[p.parent] = sorted(c for c in p.parent.iterdir()
                                        if c.suffix.lower() in SLIDE_SUFFIXES and not c.name.startswith("."))
        except OSError:  # no such folder
            listings[p.parent] = []
    key = name_key(p.name)
    hits = [c for c in listings[p.parent] if stem_key(c) == key]
    return min(hits, key=lambda c: SLIDE_SUFFIXES.index(c.suffix.lower()), default=None)


def _from_csv(csv_path: Path, *, keep_missing: bool) -> list[Path]:
    try:
        with open(csv_path, newline="") as fh:
            reader = csv.DictReader(fh)
            names = [f.strip() for f in reader.fieldnames or []]
            column = next((c for c in PATH_COLUMNS if c in names), None)
            if column is None:
                raise ConfigError(
                    f"{csv_path}: no 'slide' or 'path' column (columns: {', '.join(names) or 'none'}). "
                    "Fix: add a header row with a 'slide' column of slide paths or names (or 'slide,path')."
                )
            key = reader.fieldnames[names.index(column)]
            entries = [(row.get(key) or "").strip() for row in reader]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ConfigError(f"{csv_path}: cannot read the slide list ({exc}). Fix: give a UTF-8 CSV file.") from None
    out: list[Path] = []
    missing: list[str] = []
    listings: dict[Path, list[Path]] = {}
    for entry in entries:
        if not entry:
            continue
        p = Path(entry).expanduser()
        if not p.is_absolute():
            p = csv_path.parent / p
        if p.exists():
            out.append(p)
            continue
        hit = _slide_named(p, listings)  # a bare slide name (as in labels.csv)
        if hit is not None:
            out.append(hit)
        elif keep_missing:
            out.append(p)
        else:
            missing.append(entry)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ConfigError(
            f"{csv_path}: {len(missing)} slide(s) not found: {shown}. Fix: give paths (absolute or relative "
            "to the CSV's folder) or names of slide files beside the CSV."
        )
    return out


def find_slides(inputs: Iterable[str | os.PathLike], *, keep_missing: bool = False) -> list[Path]:
    """Slide paths from files, folders (slides directly inside, by suffix) and CSV files with a
    ``path`` or ``slide`` column (``wsi-milssl prepare`` writes ``slide,path``), in the order given,
    without duplicates. Suffixes and stems follow :mod:`wsi_milssl.cohorts`.

    A folder whose name ends in a slide suffix (``x.svs/``) is returned as a slide, not searched:
    opening it fails for that slide alone. Raises ConfigError for an empty folder, a CSV without a
    ``slide`` column, two slides with the same file stem (their stores would collide), and a path
    that does not exist (a file or a CSV entry) unless ``keep_missing``: then it is returned too, so
    that the stage reports it as one failed slide and tiles the others.
    """
    found: list[Path] = []
    seen: set[str] = set()

    def add(p: Path) -> None:
        key = str(p.resolve())
        if key not in seen:
            seen.add(key)
            found.append(p)

    for raw in inputs:
        p = Path(raw).expanduser()
        if not p.exists():
            if keep_missing:
                add(p)
                continue
            raise ConfigError(f"{p}: no such slide file or folder. Fix: check the path.")
        if p.is_dir() and p.suffix.lower() not in SLIDE_SUFFIXES:
            hits = sorted(c for c in p.iterdir()
                          if c.is_file() and not c.name.startswith(".") and c.suffix.lower() in SLIDE_SUFFIXES)
            if not hits:
                raise ConfigError(
                    f"{p}: no slide files in this folder (looked for {', '.join(SLIDE_SUFFIXES)}). "
                    "Fix: give the folder that holds the slides, or the slide files themselves."
                )
            for h in hits:
                add(h)
        elif p.suffix.lower() == ".csv":
            for h in _from_csv(p, keep_missing=keep_missing):
                add(h)
        else:
            add(p)
    stems: dict[str, Path] = {}
    for p in found:
        other = stems.setdefault(stem_key(p), p)  # stems that differ only in case name the same slide
        if other != p:
            raise ConfigError(
                f"slides {other} and {p} have the same name {slide_stem(p)!r}, so their stores would collide. "
                "Fix: rename one, or tile them into different --out folders."
            )
    return found
