"""Slide labels: the one reader every stage uses (``label``, ``train``, ``evaluate``, ``run``).

Accepted files (UTF-8 with or without a byte-order mark, or UTF-16 with one; LF or CRLF line ends):

- a header with a name column and a ``label`` column, other columns ignored. The name column is the
  first of :data:`NAME_COLUMNS` present (``slide``, ``bag``, ``bag_id``, ``stem``, ``slide_id``,
  ``name``, ``case_id``); header names are matched case-insensitively;
- no header: ``name,label[,...]`` per line, which includes CAMELYON16's ``reference.csv`` as shipped
  (``Test_001,Tumor,Macro,...`` / ``Test_002,Normal,,...``).

Labels (any case): ``1``, ``tumor``, ``tumour``, ``positive``, ``true`` are tumour; ``0``, ``normal``,
``negative``, ``false`` are normal. Names are reduced to slide stems (folder and slide/store suffix
removed, see :func:`wsi_milssl.cohorts.slide_stem`) and matched case-insensitively.

A slide listed twice with the same label is accepted (the first line's spelling of the name is
kept); listed twice with different labels it is an error naming both lines. Blank lines and lines
with an empty name are skipped.

A header may also name each slide's patient: the first of :data:`GROUP_COLUMNS` (``patient``,
``patient_id``, ``case_id``, ``case_submitter_id``, any case) that is not the name column, or a column named by
the caller; :func:`read_label_groups` reads it (``prepare folder`` keeps a patient's slides in one set). A
column named ``case`` is not taken for one: datasets use it for other things (tumour/normal, a case series).
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import Iterable, Iterator, Mapping

from wsi_milssl.cohorts.names import name_key, slide_stem, stem_key
from wsi_milssl.errors import LabelsError
from wsi_milssl.paths import FileTooLarge, read_bounded

__all__ = ["GROUP_COLUMNS", "LABEL_WORDS", "NAME_COLUMNS", "SlideLabels", "read_label_groups", "read_labels",
           "labels_for"]

#: Label words (case-insensitive) -> 0 (normal) or 1 (tumour); CLAM's example task writes tumor_tissue and
#: normal_tissue (review BP).
LABEL_WORDS = {
    "1": 1, "tumor": 1, "tumour": 1, "positive": 1, "true": 1, "tumor_tissue": 1, "tumour_tissue": 1,
    "0": 0, "normal": 0, "negative": 0, "false": 0, "normal_tissue": 0,
}

#: Header names accepted for the slide-name column, in order of preference.
NAME_COLUMNS = ("slide", "bag", "bag_id", "stem", "slide_id", "name", "case_id", "wsi")  # wsi: TRIDENT's lists

#: Header names (any case) of a column naming each slide's patient, in order of preference (one that is the
#: slide-name column does not count): ``prepare folder`` keeps a patient's slides in one set. Only names that say
#: patient: ``case_id`` and ``case_submitter_id`` are TCGA's (GDC's) patient columns; a bare ``case`` is not one
#: (datasets use it for tumour/normal and the like).
GROUP_COLUMNS = ("patient", "patient_id", "case_id", "case_submitter_id")

_FIX_LAYOUT = ("Fix: write a header 'slide,label' and one 'name,label' line per slide (label 1/tumor or "
               "0/normal), or CAMELYON16's header-less reference.csv layout 'Test_001,Tumor,...'.")
_MAX_FILE_BYTES = 256 << 20  # 256 MiB: millions of slides; anything larger is not a labels file


class SlideLabels(Mapping[str, int]):
    """Slide labels read from one file: ``{stem: 0 or 1}`` with case-insensitive lookups.

    Iteration yields the stems as first written in the file; ``labels["TEST_001"]``,
    ``"test_001.tif" in labels`` and ``labels.get("Test_001")`` all find ``Test_001`` (keys are
    reduced with :func:`slide_stem` and case-folded before lookup). ``path`` is the file read;
    ``line(name)`` the line that gave a slide its label.
    """

    def __init__(self, items: Iterable[tuple[str, int, int]] = (), *, path: str | os.PathLike | None = None) -> None:
        self.path = None if path is None else Path(path)
        self._by_key: dict[str, tuple[str, int, int]] = {}
        for stem, label, line in items:
            self._by_key.setdefault(name_key(stem), (stem, int(label), int(line)))

    def _find(self, name: object) -> tuple[str, int, int] | None:
        if not isinstance(name, (str, os.PathLike)):
            return None
        text = os.fspath(name)
        # a stem as stored ("x.h5" from "x.h5.tif") first, then the name reduced to its stem
        return self._by_key.get(name_key(text.strip())) or self._by_key.get(stem_key(text))

    def __getitem__(self, name: str) -> int:
        hit = self._find(name)
        if hit is None:
            raise KeyError(name)
        return hit[1]

    def __contains__(self, name: object) -> bool:
        return self._find(name) is not None

    def __iter__(self) -> Iterator[str]:
        return (stem for stem, _, _ in self._by_key.values())

    def __len__(self) -> int:
        return len(self._by_key)

    def line(self, name: str) -> int:
        """Line number (1-based) of ``name``'s label in the file."""
        hit = self._find(name)
        if hit is None:
            raise KeyError(name)
        return hit[2]

    def __repr__(self) -> str:
        return f"SlideLabels({dict(self)!r}, path={str(self.path) if self.path else None!r})"


def _decode(path: Path, raw: bytes) -> str:
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        encoding = "utf-16"
    else:
        encoding = "utf-8-sig"
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as exc:
        raise LabelsError(
            f"{path}: not {'UTF-16' if encoding == 'utf-16' else 'UTF-8'} text (undecodable byte at offset "
            f"{exc.start}). Fix: save the labels as UTF-8 CSV (in Excel: 'CSV UTF-8')."
        ) from None


def _rows(path: Path, text: str) -> list[tuple[int, list[str]]]:
    """(line number, stripped cells) of every non-blank row."""
    if "\x00" in text:
        raise LabelsError(f"{path}: contains NUL bytes, so it is not a text CSV file. {_FIX_LAYOUT}")
    reader = csv.reader(io.StringIO(text, newline=""))
    out: list[tuple[int, list[str]]] = []
    try:
        for row in reader:
            cells = [c.strip() for c in row]
            if any(cells):
                out.append((reader.line_num, cells))
    except csv.Error as exc:
        raise LabelsError(f"{path}: line {reader.line_num}: not valid CSV ({exc}). {_FIX_LAYOUT}") from None
    return out


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _file_rows(path: Path) -> list[tuple[int, list[str]]]:
    """(line number, stripped cells) of every non-blank row of the labels file ``path``; LabelsError naming the
    file and the fix for a missing, unreadable, too large, undecodable or empty file."""
    try:
        size = path.stat().st_size
        if path.is_dir():
            raise IsADirectoryError(21, "is a folder")
        if size > _MAX_FILE_BYTES:
            raise LabelsError(f"{path}: {size} bytes is far too large for a slide-labels CSV. {_FIX_LAYOUT}")
        try:  # bounded: a device or pipe reports size 0 (review ES: /dev/zero)
            raw = read_bounded(path, _MAX_FILE_BYTES)
        except FileTooLarge:
            raise LabelsError(f"{path}: more than {_MAX_FILE_BYTES} bytes, far too large for a slide-labels CSV. "
                              f"{_FIX_LAYOUT}") from None
    except FileNotFoundError:
        raise LabelsError(f"{path}: slide-labels file not found. Fix: check the path (given with --labels, or as a "
                          "[data] *_labels path in a pipeline file).") from None
    except OSError as exc:
        raise LabelsError(
            f"{path}: cannot read the slide labels ({exc.strerror or exc}). Fix: give a readable CSV file."
        ) from None
    rows = _rows(path, _decode(path, raw))
    if not rows:
        raise LabelsError(f"{path}: no slide labels in the file. {_FIX_LAYOUT}")
    return rows


def _columns(path: Path, rows: list[tuple[int, list[str]]]) -> tuple[list[str] | None, int, int]:
    """(the header's case-folded names or None when there is no header, name column, label column) of the
    rows of ``path``; LabelsError when the first row is neither a header nor a 'name,label' row."""
    first_line, first = rows[0]
    lowered = [c.casefold() for c in first]
    named = [c for c in NAME_COLUMNS if c in lowered]
    if named and "label" in lowered:
        return lowered, lowered.index(named[0]), lowered.index("label")
    if len(first) < 2 or first[1].casefold() not in LABEL_WORDS:
        raise LabelsError(
            f"{path}: line {first_line}: {_short(','.join(first))!r} is neither a header with a name column "
            f"({', '.join(NAME_COLUMNS)}) and a 'label' column nor a 'name,label' row. {_FIX_LAYOUT}"
        )
    return None, 0, 1


def read_labels(path: str | os.PathLike) -> SlideLabels:
    """Read a slide-labels CSV (layouts in the module docstring) into a :class:`SlideLabels`.

    Raises LabelsError naming the file, the line and the fix for a missing or unreadable file, a
    header without name and label columns, an unknown label, a slide listed twice with different
    labels, or a file without any labelled slide.
    """
    path = Path(path)
    rows = _file_rows(path)
    header, name_col, label_col = _columns(path, rows)
    if header is not None:
        rows = rows[1:]

    items: list[tuple[str, int, int]] = []
    seen: dict[str, tuple[int, int]] = {}
    for line, cells in rows:
        name = cells[name_col] if name_col < len(cells) else ""
        if not name:
            continue
        stem = slide_stem(name)
        if not stem:
            raise LabelsError(f"{path}: line {line}: {_short(name)!r} is not a slide name. {_FIX_LAYOUT}")
        if label_col >= len(cells) or not cells[label_col]:
            raise LabelsError(
                f"{path}: line {line}: slide {_short(stem)!r} has no label. Fix: add 1 (tumour) or 0 (normal) "
                "in its label column."
            )
        word = cells[label_col]
        value = LABEL_WORDS.get(word.casefold())
        if value is None:
            raise LabelsError(
                f"{path}: line {line}: label {_short(word)!r} of slide {_short(stem)!r} is not 0/1 or "
                "normal/tumor. Fix: use 1 (or tumor) for tumour slides and 0 (or normal) for normal slides."
            )
        key = name_key(stem)
        if key in seen:
            other_line, other_value = seen[key]
            if other_value != value:
                raise LabelsError(
                    f"{path}: lines {other_line} and {line} give slide {_short(stem)!r} different labels "
                    f"({other_value} and {value}); a slide's label must not be guessed. Fix: keep one line "
                    "per slide, with its true label."
                )
            continue  # the same label again: harmless
        seen[key] = (line, value)
        items.append((stem, value, line))
    if not items:
        raise LabelsError(f"{path}: no labelled slides (only a header or empty names). {_FIX_LAYOUT}")
    return SlideLabels(items, path=path)


def _names(items: list[str], limit: int = 20) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def labels_for(labels: Mapping[str, int], names: Iterable[str], *, what: str = "slide",
               source: str | os.PathLike | None = None) -> dict[str, int]:
    """``{name: label}`` for every name in ``names``, matched as :class:`SlideLabels` matches them.

    Raises one LabelsError listing every name without a label (``what`` names the kind of item, e.g.
    "predicted slide"; ``source`` the labels file, default ``labels.path``).
    """
    names = list(names)
    table = labels if isinstance(labels, SlideLabels) else SlideLabels(
        ((k, v, 0) for k, v in labels.items()), path=None)
    missing = [n for n in names if n not in table]
    if missing:
        where = source if source is not None else (table.path or "the slide labels")
        raise LabelsError(
            f"{where}: no label for {len(missing)} {what}(s): {_names(missing)} (names are matched without "
            f"folder, slide suffix and case). Fix: add a 'slide,label' line for each (1 tumour, 0 normal), or "
            f"leave those {what}s out."
        )
    return {n: table[n] for n in names}


def read_label_groups(path: str | os.PathLike, *, column: str | None = None) -> tuple[str, dict[str, str]] | None:
    """(the column's name as written, ``{stem: group}``) from the patient column of the labels file ``path``: the
    first of :data:`GROUP_COLUMNS` (any case) in its header that is not its slide-name column (``slide,patient,
    label``: the patient of each slide), or the header column ``column`` (any case) when given; None when the
    file has no header or no such column of :data:`GROUP_COLUMNS`. Stems are spelled as :func:`read_labels` gives
    them (a slide listed twice: its first line); a slide with an empty cell is in no group (its own). Raises
    LabelsError as :func:`read_labels` does for a file it cannot read, and naming the file, its columns and the
    fix when ``column`` is not a column of its header other than the slide names."""
    path = Path(path)
    rows = _file_rows(path)
    header, name_col, _ = _columns(path, rows)
    if column is not None:
        wanted = column.strip().casefold()
        if header is None or wanted not in header or header.index(wanted) == name_col:
            columns = ", ".join(repr(c) for c in rows[0][1]) if header is not None else "none: it has no header"
            raise LabelsError(
                f"{path}: no patient column {column!r} (its columns: {columns}; the slide-name column does not "
                "count). Fix: name the header column that names each slide's patient (--patient-column COLUMN, any "
                f"case), or leave --patient-column out to use the first of {', '.join(GROUP_COLUMNS)} the header has.")
        found = [header.index(wanted)]
    else:
        if header is None:
            return None
        found = [header.index(c) for c in GROUP_COLUMNS if c in header and header.index(c) != name_col]
    if not found:
        return None
    col = found[0]
    groups: dict[str, str] = {}
    seen: set[str] = set()
    for _, cells in rows[1:]:
        name = cells[name_col] if name_col < len(cells) else ""
        stem = slide_stem(name) if name else ""
        if not stem or name_key(stem) in seen:
            continue
        seen.add(name_key(stem))
        group = cells[col] if col < len(cells) else ""
        if group:
            groups[stem] = group
    return rows[0][1][col], groups
