"""Turn SLIDES arguments (files, folders, CSV lists) into slide paths: the one rule every stage finds slides
with (``tile``, ``heatmap``, ``features``, ``evaluate --slides``, ``run``, the slide lists ``prepare`` writes)."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Iterable

from wsi_milssl.cohorts import SLIDE_SUFFIXES, slide_stem, stem_key
from wsi_milssl.cohorts.names import name_key
from wsi_milssl.errors import ConfigError
from wsi_milssl.paths import read_bounded

# The one list of slide suffixes and the one stem rule live in wsi_milssl.cohorts (every stage uses them).
__all__ = ["SLIDE_SUFFIXES", "file_fingerprint", "find_slides", "read_slide_list", "slide_stem", "slides_in_folder"]

#: Columns of a slide list that hold slide paths, in order of preference (``slide`` may hold a path
#: or a bare name looked up beside the CSV).
PATH_COLUMNS = ("path", "slide_path", "slide")
#: The largest slide list read: millions of slides (a labels file has the same bound)
MAX_SLIDE_LIST_BYTES = 256 << 20


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


def read_slide_list(csv_path: str | os.PathLike, *, keep_missing: bool = False) -> list[tuple[Path, str | None]]:
    """The slides a slide-list CSV names, in its order: ``(path, name)`` per non-empty entry.

    The header row names the column of slide paths: the first of ``path``, ``slide_path`` and ``slide``
    (:data:`PATH_COLUMNS`). An entry is a path (``~`` expanded; relative to the CSV's folder) or, when no
    such file exists, a bare slide name looked up beside the CSV (``synth_000`` finds ``synth_000.tif``;
    case-insensitive). ``name`` is the ``slide`` column's value when another column holds the path (the
    ``slide,path`` lists ``prepare`` writes), else None. The file is UTF-8 text (a leading byte-order mark,
    as Excel writes it, is dropped). ConfigError naming the CSV: not readable or not UTF-8, no such
    column, or entries that name no slide file, unless ``keep_missing``: then their paths are returned
    too (a stage reports them as failed slides).
    """
    csv_path = Path(csv_path)
    fix = "Fix: save it as UTF-8 with a header row: a 'slide' column of slide paths or names, or 'slide,path'."
    try:
        text = read_bounded(csv_path, MAX_SLIDE_LIST_BYTES).decode("utf-8-sig")
    except OSError as exc:
        raise ConfigError(f"{csv_path}: cannot read the slide list ({exc.strerror or exc}).") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{csv_path}: not UTF-8 text (byte {exc.start}); a slide list must be UTF-8 (or ASCII) "
                          f"text. {fix}") from None
    try:
        reader = csv.DictReader(io.StringIO(text, newline=""))
        columns = [f.strip() for f in reader.fieldnames or []]
        column = next((c for c in PATH_COLUMNS if c in columns), None)
        if column is None:
            raise ConfigError(
                f"{csv_path}: no 'slide' or 'path' column (columns: {', '.join(columns) or 'none'}). "
                "Fix: add a header row with a 'slide' column of slide paths or names (or 'slide,path')."
            )
        path_key = reader.fieldnames[columns.index(column)]
        slide_key = reader.fieldnames[columns.index("slide")] if column != "slide" and "slide" in columns else None
        entries = [((row.get(path_key) or "").strip(), (row.get(slide_key) or "").strip() if slide_key else "")
                   for row in reader]
    except csv.Error as exc:
        raise ConfigError(f"{csv_path}: not a CSV file ({exc}). {fix}") from None
    out: list[tuple[Path, str | None]] = []
    missing: list[str] = []
    listings: dict[Path, list[Path]] = {}
    for entry, name in entries:
        if not entry:
            continue
        p = Path(entry).expanduser()
        if not p.is_absolute():
            p = csv_path.parent / p
        if not p.exists():
            hit = _slide_named(p, listings)  # a bare slide name (as in labels.csv)
            if hit is not None:
                p = hit
            elif not keep_missing:
                missing.append(entry)
                continue
        out.append((p, name or None))
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ConfigError(f"{csv_path}: {len(missing)} slide(s) not found: {shown}. Fix: {_missing_fix(csv_path)}")
    return out


def _missing_fix(csv_path: Path) -> str:
    """The fix for slides a list names that are gone: a list ``wsi-milssl prepare`` wrote (``prepare.json``
    beside it) is made again by prepare; another list is the user's to correct."""
    record = csv_path.parent / "prepare.json"
    if not record.is_file():
        return "give paths (absolute or relative to the CSV's folder) or names of slide files beside the CSV."
    try:
        command = json.loads(record.read_text(encoding="utf-8")).get("command")
    except (OSError, ValueError, AttributeError):
        command = None
    again = f": {command}" if isinstance(command, str) and command else ""
    return (f"this list was written by `wsi-milssl prepare` ({record}), and its slides were moved or deleted "
            f"since: put them back, or run prepare again{again}.")


def slides_in_folder(folder: str | os.PathLike) -> list[Path]:
    """The slide files directly inside ``folder`` (by suffix, :data:`SLIDE_SUFFIXES`; hidden files left out, links
    whose target is gone kept), sorted."""
    # a link whose target is gone (an archive on a mount that is down) is listed: its slide fails, named, not
    # left out without a word
    try:
        entries = list(Path(folder).iterdir())
    except PermissionError:  # mode 711, as archives are often shared (review CB: a traceback)
        from wsi_milssl.errors import ConfigError

        raise ConfigError(f"{folder}: cannot list this folder (permission denied), so its slides cannot be found. Fix: "
                          "give the slide files themselves, or a slide-list CSV naming them, or ask for permission "
                          "to list the folder.") from None
    return sorted(c for c in entries
                  if (c.is_file() or (c.is_symlink() and not c.exists())) and not c.name.startswith(".")
                  and c.suffix.lower() in SLIDE_SUFFIXES)


def find_slides(inputs: Iterable[str | os.PathLike], *, keep_missing: bool = False) -> list[Path]:
    """Slide paths from files, folders (slides directly inside, by suffix) and CSV files with a
    ``path`` or ``slide`` column (:func:`read_slide_list`; ``wsi-milssl prepare`` writes ``slide,path``), in the
    order given, without duplicates. Suffixes and stems follow :mod:`wsi_milssl.cohorts`.

    A folder whose name ends in a slide suffix (``x.svs/``) is returned as a slide, not searched:
    opening it fails for that slide alone. Raises ConfigError for an empty folder, a CSV without a
    ``slide`` column, two slides with the same file stem (their stores would collide), one file under two slide
    names (a link and its target: one name would be left out), and a path
    that does not exist (a file or a CSV entry) unless ``keep_missing``: then it is returned too, so
    that the stage reports it as one failed slide and tiles the others.
    """
    found: list[Path] = []
    seen: dict[str, Path] = {}
    linked: list[tuple[Path, Path]] = []  # one file under two slide names (a link and its target)

    def add(p: Path) -> None:
        key = os.path.realpath(p)  # not Path.resolve: it raises on a loop of links (that slide fails alone, named)
        if key not in seen:
            seen[key] = p
            found.append(p)
        elif stem_key(seen[key]) != stem_key(p):
            linked.append((seen[key], p))

    from wsi_milssl.paths import path_list

    for raw in path_list(inputs):
        p = Path(raw).expanduser()
        if not p.exists():
            if keep_missing:
                add(p)
                continue
            raise ConfigError(f"{p}: no such slide file or folder. Fix: check the path.")
        if p.is_dir() and p.suffix.lower() not in SLIDE_SUFFIXES:
            hits = slides_in_folder(p)
            if not hits:
                raise ConfigError(
                    f"{p}: no slide files in this folder (looked for {', '.join(SLIDE_SUFFIXES)}). "
                    "Fix: give the folder that holds the slides, or the slide files themselves."
                )
            for h in hits:
                add(h)
        elif p.suffix.lower() == ".csv":
            for h, _ in read_slide_list(p, keep_missing=keep_missing):
                add(h)
        else:
            add(p)
    if linked:
        raise ConfigError(
            f"{len(linked)} slide file(s) are listed under two names (links): "
            + "; ".join(f"{a} and {b}" for a, b in linked[:3]) + ("; ..." if len(linked) > 3 else "")
            + ": one would be tiled under the first name and the other left out (its label and annotations unused). "
            "Fix: keep one name per slide file (remove the link, or list one of the two).")
    stems: dict[str, Path] = {}
    for p in found:
        other = stems.setdefault(stem_key(p), p)  # stems that differ only in case name the same slide
        if other != p:
            raise ConfigError(
                f"slides {other} and {p} have the same name {slide_stem(p)!r}, so their stores would collide. "
                "Fix: rename one, or tile them into different --out folders."
            )
    return found
