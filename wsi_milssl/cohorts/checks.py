"""The checks ``prepare`` makes before it writes anything: two slides with one name or one file, slides that cannot
be read, ``--exclude`` names of no slide, files that hold the same slide under other names; every problem is
collected into one error."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterable, Mapping

from wsi_milssl.cohorts.names import file_identity, name_key, slide_stem, stem_key
from wsi_milssl.errors import LabelsError
from wsi_milssl.hashing import file_sha256
from wsi_milssl.paths import link_loops

logger = logging.getLogger(__name__)


def _names(items: list[str], limit: int = 20) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def _duplicates(paths: Iterable[Path], key=stem_key) -> dict[str, list[Path]]:
    """Paths grouped by ``key`` (the slide name; ``file_identity``: the file, whatever its names), groups
    of two or more only."""
    by_key: dict[str, list[Path]] = {}
    for p in paths:
        by_key.setdefault(key(p), []).append(p)
    return {k: v for k, v in by_key.items() if len(v) > 1}


def _same_name_slides(paths: Iterable[Path]) -> tuple[list[Path], tuple[str, str] | None, str | None]:
    """(the slides to keep, the problem, a note) of slide files that share a name (``tumor_001.tif`` below ``images/``
    and ``Tumor_001.tif`` below ``training/tumor/``, as downloading from GigaDB and from the AWS bucket leaves):
    files that hold the same bytes (:func:`same_content_groups`) are one slide, the first by path kept, with a note;
    different files under one name are the problem (text, fix), as prepare cannot tell which is the slide."""
    paths = list(paths)
    dup = _duplicates(paths)
    drop: set[Path] = set()
    same, differ = [], []
    for group in dup.values():
        group = sorted(group, key=lambda p: str(p).casefold())
        # one name per file: a file's other names are _linked_twice's (review EH, EI: a link beside its target and a
        # copy were called files of different bytes, whose fix could delete the link's target)
        group = list({file_identity(p): p for p in reversed(group)}.values())[::-1]
        if len(group) < 2:
            continue
        identical = same_content_groups(group)
        if len(identical) == 1 and len(identical[0]) == len(group):
            drop.update(group[1:])
            same.append(f"{group[0]} (kept; the same bytes as {' and '.join(map(str, group[1:]))})")
        else:
            differ.append(" and ".join(map(str, group)))
    problem = None
    if differ:
        problem = (f"{len(differ)} name(s) used by more than one slide file, with different bytes: {_names(differ)}",
                   "keep one of the two files (remove the other, or move it out of the folder), then prepare again.")
    note = (f"{len(same)} slide name(s) are used by more than one file that holds the same bytes (one slide "
            f"downloaded twice), so each is one slide: {_names(same)}") if same else None
    return [p for p in paths if p not in drop], problem, note


def _linked_twice(paths: Iterable[Path]) -> str | None:
    """The problem of one slide file reached under two names (a link and its target, two links): it would
    count as two slides, and could be in both the training and the test set."""
    same = _duplicates(paths, key=file_identity)
    if not same:
        return None
    return (f"{len(same)} slide file(s) are reached under more than one name (links): "
            + _names([" and ".join(str(p) for p in v) for v in same.values()])
            + " (keep one name per slide file)")


def _unreadable_slides(paths: Iterable[Path]) -> str | None:
    """The problem of slide files that do not exist (a link to a disk that is not mounted, or to a file moved
    or deleted) or cannot be opened for reading: each would fail only when run reaches it."""
    bad = []
    for p in paths:
        if p.is_symlink() and not p.exists():
            bad.append(f"{p} (a link to {os.readlink(p)}, " + ("in a loop of links that never reaches a file)"
                                                               if link_loops(p) else "which does not exist)"))
            continue
        try:
            with open(p, "rb"):
                pass
        except OSError as exc:
            bad.append(f"{p} ({exc.strerror or exc})")
    if not bad:
        return None
    return (f"{len(bad)} slide file(s) cannot be opened for reading: {_names(bad)} (mount the disk or restore the "
            "file a link points to, make the file readable, or remove the link or file)")


def _cut_short_slides(paths: Iterable[Path]) -> tuple[str, str] | None:
    """The problem (text, fix) of slide files that are empty (0 bytes) or cut short
    (:func:`wsi_milssl.slide.reader.incomplete_file`: a TIFF whose tiles or directories lie past its end), as a
    download or copy that stopped leaves them under their final name (``curl -C -``, ``wget -c``, a browser's empty
    ``X.tif`` beside ``X.tif.part``): tile would fail on each only when it reached it (review EC B3). A file that
    cannot be read is :func:`_unreadable_slides`'s problem."""
    from wsi_milssl.cohorts.discover import PARTIAL_DOWNLOAD_SUFFIXES
    from wsi_milssl.slide.reader import incomplete_file

    bad, stems = [], []
    for p in paths:
        try:
            why = incomplete_file(p)
        except OSError:
            continue
        if why is None:
            continue
        beside = [p.name + s for s in PARTIAL_DOWNLOAD_SUFFIXES if p.with_name(p.name + s).exists()]
        bad.append(f"{p} ({why}" + (f"; {beside[0]} beside it is a download that did not finish" if beside else "")
                   + ")")
        stems.append(slide_stem(p))
    if not bad:
        return None
    return (f"{len(bad)} slide file(s) are empty or cut short, as a download or copy that stopped leaves them: "
            f"{_names(bad)}",
            f"download {'it' if len(bad) == 1 else 'them'} again, or prepare again with --exclude "
            f"{' '.join(stems)} to leave {'it' if len(bad) == 1 else 'them'} out of every set.")


def _exclude_keys(exclude: Iterable[str]) -> dict[str, str]:
    """{key: name as given} of the ``--exclude`` names (slide names: folder, slide suffix and case ignored)."""
    return {stem_key(n): n for n in exclude if slide_stem(n)}


def _unknown_excluded(keys: Mapping[str, str], found: Iterable[str], where: str) -> list[str]:
    """The problem of ``--exclude`` names that name no slide found (``found``: their stems)."""
    unknown = sorted((n for k, n in keys.items() if k not in {stem_key(s) for s in found}), key=str.casefold)
    if not unknown:
        return []
    return [(f"--exclude names {len(unknown)} slide(s) that are not below {where}: {_names(unknown)} (slide names "
             "are matched without folder, slide suffix and case)",
             "check the names given to --exclude against the slide files.")]


#: Bytes of two same-size slide files compared before the whole files are (distinct slides differ there).
_HEAD_BYTES = 1 << 20


#: Multi-file slide formats: the slide file is a small index, the image is in companion files (:func:`_slide_parts`).
_MIRAX_SUFFIX = ".mrxs"
_HAMAMATSU_INDEX_SUFFIXES = (".vms", ".vmu")


def _slide_parts(path: Path) -> list[tuple[str, Path]] | None:
    """The files the slide ``path`` is made of, as (the part's name within the slide, file), the slide file
    itself first (named ``""``). A MIRAX ``.mrxs`` is a small index (often the same bytes for every slide of a
    scanner) beside its data folder (named as the slide without the suffix: ``Slidedat.ini``, ``Index.dat``,
    ``Data*.dat``), whose files follow, named by their paths in it. A Hamamatsu ``.vms``/``.vmu`` names its image
    files (``ImageFile``, ``MapFile``, ``OptimisationFile``, ...) in the same folder: each file it names follows,
    named by its key. None for such a slide whose companion files are not found (what it holds cannot be
    compared); every other format is one file."""
    lower_name = path.name.lower()
    if lower_name.endswith(_MIRAX_SUFFIX):
        data = path.parent / path.name[: -len(_MIRAX_SUFFIX)]
        if not data.is_dir():
            return None
        files = sorted((f.relative_to(data).as_posix(), f) for f in data.rglob("*") if f.is_file())
    elif lower_name.endswith(_HAMAMATSU_INDEX_SUFFIXES):
        try:
            with open(path, "rb") as fh:
                text = fh.read(_HEAD_BYTES).decode("utf-8", errors="replace")  # an index is a few hundred bytes
        except OSError:
            return None
        files = []
        for line in text.splitlines():
            key, sep, value = line.partition("=")
            value = value.strip()
            companion = path.parent / value
            if sep and value and companion != path and companion.is_file():
                files.append((key.strip().casefold(), companion))
        files.sort()
    else:
        return [("", path)]
    return [("", path), *files] if files else None


def same_content_groups(paths: Iterable[Path]) -> list[list[Path]]:
    """Groups (two or more) of the slides among ``paths`` that hold the same bytes as separate files (one file
    under two names is :func:`_linked_twice`'s), every file of a multi-file slide compared (:func:`_slide_parts`:
    two MIRAX slides with the same ``.mrxs`` index are copies only when their data folders hold the same files
    with the same bytes too). Sizes are compared first, and only slides whose files have the same sizes are read
    (the first MiB of each file, then the whole files where that agrees), so a cohort of slides of distinct
    sizes reads nothing but the index of a ``.vms``/``.vmu``. Empty slide files (no slide), files that cannot be
    read and multi-file slides whose companion files are not found are left out."""
    by_sizes: dict[tuple[tuple[str, int], ...], dict[object, tuple[Path, list[tuple[str, Path]]]]] = {}
    for p in paths:
        parts = _slide_parts(p)
        if parts is None:
            continue
        try:
            sizes = tuple((name, f.stat().st_size) for name, f in parts)
        except OSError:
            continue
        if sizes[0][1]:
            by_sizes.setdefault(sizes, {}).setdefault(file_identity(p), (p, parts))
    groups: list[list[Path]] = []
    for sizes, slides in sorted(by_sizes.items()):
        candidates = [list(slides.values())] if len(slides) > 1 else []
        for limit in (_HEAD_BYTES, None):
            if limit is None and max(size for _, size in sizes) <= _HEAD_BYTES:
                break
            narrowed = []
            for candidate in candidates:
                by_digest: dict[tuple[str, ...], list[tuple[Path, list[tuple[str, Path]]]]] = {}
                for p, parts in candidate:
                    try:
                        digests = tuple(file_sha256(f, limit_bytes=limit) for _, f in parts)
                        by_digest.setdefault(digests, []).append((p, parts))
                    except OSError:
                        continue
                narrowed += [v for v in by_digest.values() if len(v) > 1]
            candidates = narrowed
        groups += [[p for p, _ in candidate] for candidate in candidates]
    return groups


def _same_content_slides(train: Mapping[str, Path], train_labels: Mapping[str, int],
                         test: Mapping[str, Path] | None = None, test_labels: Mapping[str, int] | None = None
                         ) -> tuple[set[str], set[str], list[str]]:
    """(training stems to leave out, test stems to leave out, notes) for slide files that hold the same bytes
    under different names (a slide downloaded twice, renamed, or re-released under a new name):

    - a training slide identical to a test slide is left out of training (a test slide must not be trained on);
    - identical slides of one set with different labels are all left out of it (which label is right is not
      for prepare to guess);
    - identical slides of one set with the same label: the first by name is kept, the others left out.

    A slide without a label is not decided here (it is refused as such)."""
    test = test or {}
    test_labels = test_labels or {}
    owner = {p: ("train", s) for s, p in train.items()}
    owner.update({p: ("test", s) for s, p in test.items()})
    drop: dict[str, set[str]] = {"train": set(), "test": set()}
    found: dict[str, list[str]] = {"test": [], "conflict": [], "repeat": []}
    for group in same_content_groups(owner):
        members = sorted((owner[p] for p in group), key=lambda m: name_key(m[1]))
        tr = [s for k, s in members if k == "train"]
        te = [s for k, s in members if k == "test"]
        if tr and te:
            drop["train"].update(tr)
            found["test"].append(f"{', '.join(tr)} (the same file as test slide {', '.join(te)})")
            tr = []
        for set_name, stems, labels in (("train", tr, train_labels), ("test", te, test_labels)):
            values = {labels.get(s) for s in stems}
            if len(stems) < 2 or None in values:
                continue
            if len(values) > 1:
                drop[set_name].update(stems)
                found["conflict"].append(f"{set_name}: " + ", ".join(f"{s} ({labels[s]})" for s in stems))
            else:
                drop[set_name].update(stems[1:])
                found["repeat"].append(f"{set_name}: {', '.join(stems[1:])} (the same file as {stems[0]}, kept)")
    notes = []
    if found["test"]:
        notes.append(f"{len(found['test'])} training slide file(s) hold the same bytes as a test slide, so they are "
                     f"left out of training (a test slide must not be trained on): {_names(found['test'])}")
    if found["conflict"]:
        notes.append(f"{len(found['conflict'])} set(s) of slide files hold the same bytes under names with different "
                     f"labels, so all of them are left out: {_names(found['conflict'])} (find out which label is "
                     "right, keep that file alone and prepare again)")
    if found["repeat"]:
        notes.append(f"slide files that hold the same bytes as another slide of the same label are left out (one "
                     f"file is one slide): {_names(found['repeat'])}")
    return drop["train"], drop["test"], notes


def _raise_problems(where: str, problems: list[str | tuple[str, str]], fix: str) -> None:
    """One error for every problem found; a problem is its text, or (text, its own fix); the fix of the error
    names the fixes of its problems (``fix`` for those without one) once each, in their order."""
    if problems:
        body = "; ".join(p if isinstance(p, str) else p[0] for p in problems)
        fixes = list(dict.fromkeys(fix if isinstance(p, str) else p[1] for p in problems))
        raise LabelsError(f"{where}: cannot prepare the cohort: {body}. Fix: {' '.join(fixes)}")
