"""``wsi-milssl prepare``: a downloaded cohort -> slide lists, label files, annotations and a ready pipeline.

Two layouts:

- :func:`prepare_camelyon16`: the CAMELYON16 folder as downloaded, searched recursively:
  ``training/normal/Normal_001.tif``, ``training/tumor/Tumor_001.tif``, ``testing/images/Test_001.tif``
  (or all slides in one folder), ASAP XML annotations anywhere below it (``lesion_annotations/``,
  also inside ``.zip`` archives as shipped), and the test set's ``reference.csv`` as shipped (no
  header: ``Test_001,Tumor,Macro,...``). Training labels come from the names (``Tumor_*`` 1,
  ``Normal_*`` 0), test labels from ``reference.csv``. The AWS bucket's mask images (``masks/``,
  ``background_tissue/``, ``*_mask.tif``, ``*_tissue.tif``) are left out and counted; every other
  slide must be named ``Normal_NNN``, ``Tumor_NNN`` or ``Test_NNN``.
- :func:`prepare_folder`: any cohort: a folder of slides (searched recursively), a labels file in
  any layout :func:`wsi_milssl.cohorts.read_labels` reads, optional annotations, and either a
  separate test set or a stratified, seeded share of the slides held out as the test set (whole
  patients when the labels file has a patient column: :func:`wsi_milssl.cohorts.read_label_groups`, or the
  column ``patient_column`` names; ``PreparedCohort.split`` says which column kept patients whole).

Names are matched case-insensitively (``tumor_001.tif``, ``Tumor_001.xml`` and a label row
``TUMOR_001`` are one slide). Folders are searched through links (each folder once: a link back to
an ancestor ends there); earlier prepare outputs below them (folders holding ``cohort/prepare.json``)
and run outputs (folders holding a run's ``resolved_pipeline.toml``) are left out, and so are the
folder's own ``cohort/`` and ``run/`` when it is one (``--out`` the folder itself). Slides named by
``exclude`` (``--exclude``) are left out of every set. Every problem found (a slide without a label, a
tumour test slide without its annotation, two slides with one name, a name that is not CAMELYON16's, a
slide file that cannot be opened for reading, such as a link to a disk that is not mounted, an
``--exclude`` name of no slide) is reported in one error that lists the names; every annotation problem
(an archive that may hold annotations or a file that cannot be read, a file the annotation reader
refuses, two annotation files for one slide that describe different regions) in one error that names
each file where it was found (another ``.zip`` that cannot be read is a warning). Slide files that hold
the same bytes under other names are left out with a note, never refused (:func:`_same_content_slides`; a
MIRAX or Hamamatsu slide's data files are compared with its index file).
Written into ``out_dir``::

    pipeline.toml                      the template's stage settings, [data] pointing at the files below,
                                       [pipeline].out_dir = out_dir/run (a pipeline.toml edited since prepare
                                       wrote it, or not written by prepare, is kept: the new one is then
                                       pipeline.new.toml, with a note)
    cohort/train_slides.csv            slide,path (absolute paths; a symlinked slide keeps its link's name)
    cohort/train_labels.csv            slide,label (1 tumour, 0 normal) [,patient]
    cohort/test_slides.csv, cohort/test_labels.csv
    cohort/annotations/train/, test/   one <stem>.xml (or .geojson) per annotated slide, named as the slide
    cohort/prepare.json                what was found: counts, sources, names skipped and excluded, absolute
                                       paths (folders' links resolved), the SHA-256 of the pipeline.toml written

Everything is found, checked and read (annotations included, also from ``.zip`` archives, and parsed
by :func:`wsi_milssl.annotations.read_annotations` as the label stage reads them, their groups checked
against the written pipeline's [label] groups) before anything is written, so a problem leaves
``out_dir`` as it was; ``pipeline.toml`` is written last.

The validation slides that choose ``best.pt`` (and the grid point) are held out from the training
set by ``run`` itself (``[data].val_fraction``), never from the test set.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import lzma
import os
import re
import shlex
import zipfile
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Mapping, NamedTuple

from wsi_milssl.atomic import atomic_open, atomic_write_bytes, atomic_write_text
from wsi_milssl.cohorts.labels import GROUP_COLUMNS, read_labels
from wsi_milssl.cohorts.names import SLIDE_SUFFIXES, file_identity, name_key, slide_stem, stem_key
from wsi_milssl.cohorts.split import label_groups_for, stratified_split
from wsi_milssl.errors import ConfigError, LabelsError
from wsi_milssl.hashing import file_sha256

__all__ = [
    "ANNOTATION_SUFFIXES",
    "NO_PATIENT_COLUMN",
    "PreparedCohort",
    "CohortSet",
    "find_slide_files",
    "prepare_camelyon16",
    "prepare_folder",
    "default_template",
]

logger = logging.getLogger(__name__)

#: Annotation files matched to slides by stem (ASAP XML, GeoJSON).
ANNOTATION_SUFFIXES = (".xml", ".geojson", ".json")
_MAX_ANNOTATION_BYTES = 256 << 20
_CAMELYON16_ROLES = {"normal": ("train", 0), "tumor": ("train", 1), "test": ("test", None)}
#: A CAMELYON16 slide's name: Normal_NNN, Tumor_NNN, Test_NNN (any case).
_CAMELYON16_NAME = re.compile(r"^(normal|tumor|test)_\d+$", re.IGNORECASE)
#: The mask images shipped beside the slides (the AWS bucket's masks/<name>_mask.tif and
#: background_tissue/<name>_tissue.tif, GigaDB's Tumor_001_Mask.tif): not slides.
_CAMELYON16_MASK_NAME = re.compile(r"[_-](mask|tissue)$", re.IGNORECASE)
_CAMELYON16_MASK_DIRS = frozenset({"masks", "background_tissue"})
#: What a damaged archive member or an unreadable file raises while it is read.
_READ_ERRORS = (zipfile.BadZipFile, zlib.error, lzma.LZMAError, OSError, EOFError, NotImplementedError,
                RuntimeError)
#: :func:`prepare_folder`'s ``patient_column`` (``--patient-column``) that splits slide by slide (no patient column).
NO_PATIENT_COLUMN = "none"


@dataclass(frozen=True)
class CohortSet:
    """One set of a prepared cohort: ``slides`` {stem: path}, ``labels`` {stem: 0/1},
    ``annotations`` {stem: source file (or ``archive.zip:member``)}; the files written for it."""

    name: str
    slides: dict[str, Path]
    labels: dict[str, int]
    annotations: dict[str, str]
    slides_csv: Path
    labels_csv: Path
    annotations_dir: Path

    @property
    def n_tumor(self) -> int:
        return sum(self.labels.values())


@dataclass(frozen=True)
class PreparedCohort:
    """What :func:`prepare_camelyon16` / :func:`prepare_folder` wrote (``pipeline_toml`` is ready to run);
    ``split``: how :func:`prepare_folder` split the slides (which column kept patients whole, or slide by slide)."""

    out_dir: Path
    pipeline_toml: Path
    sets: dict[str, CohortSet]
    summary_json: Path
    notes: tuple[str, ...] = field(default_factory=tuple)
    excluded: tuple[str, ...] = field(default_factory=tuple)
    split: str = ""


# ------------------------------------------------------------------------------------------------
# Finding files
# ------------------------------------------------------------------------------------------------

def _walk(root: Path, *, skip: Iterable[Path] = ()) -> Iterable[Path]:
    """Every non-hidden file below ``root``, sorted, not descending into ``skip`` folders, hidden ones,
    earlier prepare outputs (:func:`_is_prepare_output`) or run outputs (:func:`_is_run_output`). When
    ``root`` itself is a prepare output (``prepare ROOT --out ROOT`` run before), its own ``cohort/`` and
    ``run/`` are left out and the rest is searched.

    Links to folders are followed (a download spread over disks links its folders together); a folder
    reached a second time (a link back to an ancestor, two links to one folder) is searched once only."""
    skip_resolved = {p.resolve() for p in skip}
    if _is_prepare_output(root):
        skip_resolved |= {(root / "cohort").resolve(), (root / "run").resolve()}
    seen = {_folder_identity(root)}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        here = Path(dirpath)
        keep = []
        for d in sorted(dirnames):
            if (d.startswith(".") or (here / d).resolve() in skip_resolved or _is_prepare_output(here / d)
                    or _is_run_output(here / d)):
                continue
            identity = _folder_identity(here / d)
            if identity not in seen:
                seen.add(identity)
                keep.append(d)
        dirnames[:] = keep
        # a folder named like a slide (.mrxs data folders are named without the suffix) is not searched as one
        for name in sorted(filenames):
            if not name.startswith("."):
                yield here / name


def _folder_identity(folder: Path) -> tuple[int, int] | Path:
    """(device, inode) of ``folder``, links followed; its path when it cannot be read (os.walk skips it)."""
    try:
        st = folder.stat()
    except OSError:
        return folder
    return st.st_dev, st.st_ino


def _is_prepare_output(folder: Path) -> bool:
    """An earlier prepare's ``--out`` (it holds ``cohort/prepare.json``): its annotations are copies that may
    be stale, and its ``run/`` holds heatmap TIFFs, not slides."""
    return (folder / "cohort" / "prepare.json").is_file()


def _is_run_output(folder: Path) -> bool:
    """A `wsi-milssl run` output folder (it holds the run's ``resolved_pipeline.toml``, as ``run --out ROOT/x``
    below a download leaves): its ``heatmaps/*_probs.tif`` are not slides."""
    from wsi_milssl.pipeline.spec import RESOLVED_FILENAME

    return (folder / RESOLVED_FILENAME).is_file()


def _is_slide(path: Path) -> bool:
    return path.name.lower().endswith(SLIDE_SUFFIXES)


def _is_mask(path: Path) -> bool:
    """CAMELYON16 ships tumour masks as TIFFs (``Tumor_001_Mask.tif``): not slides."""
    return bool(re.search(r"[_-]mask$", slide_stem(path).casefold()))


def find_slide_files(root: str | os.PathLike, *, skip: Iterable[str | os.PathLike] = ()) -> list[Path]:
    """Slide files (by :data:`wsi_milssl.cohorts.SLIDE_SUFFIXES`, any case) anywhere below ``root``,
    sorted; hidden files and folders, ``skip`` folders and mask images (``*_mask.tif``) left out."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"{root}: no such folder. Fix: give the folder that holds the slides.")
    return [p for p in _walk(root, skip=[Path(s) for s in skip]) if _is_slide(p) and not _is_mask(p)]


#: An archive whose name or folder (below the folder searched) says so may hold annotations.
_ANNOTATION_WORDS = re.compile(r"annotation|lesion", re.IGNORECASE)


def _annotation_sources(roots: Iterable[Path], *, skip: Iterable[Path] = (), given: bool = False
                        ) -> tuple[list[tuple[str, str, Path, str | None]], list[str]]:
    """(sources, problems): (stem, suffix, file, zip member or None) for every annotation file below
    ``roots``, loose files first, then members of ``.zip`` archives (CAMELYON16 ships
    ``lesion_annotations.zip``); and one problem (naming it and the fix) per archive that cannot be read
    (damaged, or partly downloaded) and may hold annotations, which would be missing without a word: its
    name or a folder below the root mentions annotation(s) or lesion, it sits beside loose annotation
    files (.xml, .geojson), or ``roots`` were given as annotation folders (``given``). Any other archive
    that cannot be read (an unrelated download) is a warning naming it."""
    loose, zipped, problems = [], [], []
    for root in roots:
        unread: list[tuple[Path, BaseException]] = []
        for p in _walk(root, skip=skip):
            suffix = p.suffix.lower()
            if suffix in ANNOTATION_SUFFIXES:
                loose.append((slide_stem(p.name[: -len(suffix)]), suffix, p, None))
            elif suffix == ".zip":
                try:
                    with zipfile.ZipFile(p) as archive:
                        for info in archive.infolist():
                            name = info.filename.rsplit("/", 1)[-1]
                            msuffix = Path(name).suffix.lower()
                            if info.is_dir() or name.startswith(".") or msuffix not in ANNOTATION_SUFFIXES:
                                continue
                            zipped.append((name[: -len(msuffix)], msuffix, p, info.filename))
                except _READ_ERRORS as exc:
                    unread.append((p, exc))
        beside = {p.parent for _, suffix, p, _ in loose if suffix in (".xml", ".geojson")}
        for p, exc in unread:
            if given or p.parent in beside or _ANNOTATION_WORDS.search(p.relative_to(root).as_posix()):
                problems.append(f"{p}: cannot be read ({_cause(exc)}). Fix: download {p.name} again (the "
                                "archive is damaged or incomplete), or remove it.")
            else:
                logger.warning("%s: not read (%s); it is not searched for annotations (it is not named as an "
                               "annotation archive nor beside annotation files)", p, _cause(exc))
    return loose + zipped, problems


def _match_annotations(sources, stems: Iterable[str]) -> dict[str, list[tuple[str, Path, str | None]]]:
    """{slide stem: [(suffix, file, member), ...]} for the slides with an annotation, every source of each
    (:func:`_read_annotations` refuses two that differ)."""
    by_key = {stem_key(s): s for s in stems}
    out: dict[str, list[tuple[str, Path, str | None]]] = {}
    for stem, suffix, path, member in sources:
        target = by_key.get(stem_key(stem))
        if target is None:
            continue
        if suffix == ".json" and member is None and not _looks_like_geojson(path):
            continue
        out.setdefault(target, []).append((suffix, path, member))
    return out


def _looks_like_geojson(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            head = fh.read(65536)
    except OSError:
        return False
    return b'"Feature' in head or b'"Polygon"' in head or b'"MultiPolygon"' in head


def _cause(exc: BaseException) -> str:
    kind = type(exc).__name__
    if type(exc).__module__ != "builtins":  # zlib.error, zipfile.BadZipFile
        kind = f"{type(exc).__module__}.{kind}"
    return f"{kind}: {exc}"


def _read_source(path: Path, member: str | None) -> bytes:
    """The bytes of an annotation file or of ``member`` of the ``.zip`` archive ``path``; a file or
    member that cannot be read (damaged, truncated, gone) raises a ConfigError naming it and the fix."""
    where = str(path) if member is None else f"{path}:{member}"
    try:
        if member is None:
            if path.stat().st_size > _MAX_ANNOTATION_BYTES:
                raise ConfigError(f"{path}: larger than {_MAX_ANNOTATION_BYTES >> 20} MiB; not an annotation "
                                  "file. Fix: remove it, or rename it so that it is not <slide name>.xml.")
            return path.read_bytes()
        with zipfile.ZipFile(path) as archive:
            info = archive.getinfo(member)
            if info.file_size > _MAX_ANNOTATION_BYTES:
                raise ConfigError(f"{where}: larger than {_MAX_ANNOTATION_BYTES >> 20} MiB; not an annotation "
                                  f"file. Fix: download {path.name} again.")
            return archive.read(info)
    except ConfigError:
        raise
    except (*_READ_ERRORS, KeyError) as exc:
        if member is None:
            fix = "check the file (copy or download it again), or remove it"
        else:
            fix = f"download {path.name} again (the archive is damaged or incomplete) and re-run prepare"
        raise ConfigError(f"{where}: cannot be read ({_cause(exc)}). Fix: {fix}.") from None


class _Annotation(NamedTuple):
    """One slide's annotation as read by prepare: ``data`` its bytes (written as ``<stem><suffix>``), ``where``
    the file as found (``archive.zip:member`` inside an archive; for messages), ``source`` the same made
    absolute (recorded in prepare.json), ``groups`` the group names of its annotations and ``area_groups``
    those of its annotations that enclose an area (polygons, rectangles), as the label stage reads them."""

    suffix: str
    data: bytes
    where: str
    source: str
    groups: frozenset
    area_groups: frozenset


def _parse(copy: Path, where: str) -> tuple[str | None, frozenset, frozenset]:
    """(problem, groups, area groups) of the annotation file ``copy`` (a copy of ``where``): problem is None when
    the project's reader (:func:`wsi_milssl.annotations.read_annotations`, as the label stage reads it) accepts
    it, else its error, naming ``where``."""
    from wsi_milssl.annotations import read_annotations
    from wsi_milssl.annotations.asap import AREA_TYPES
    from wsi_milssl.errors import AnnotationError

    try:
        aset = read_annotations(copy, skipped=[])  # what it leaves out the label stage warns about
    except AnnotationError as exc:
        return str(exc).replace(str(copy), where), frozenset(), frozenset()
    return (None, frozenset(a.group for a in aset.polygons),
            frozenset(a.group for a in aset.polygons if a.type in AREA_TYPES))


def _real(path: Path) -> Path:
    """``path`` absolute, with the links among its folders resolved and its own name kept (a linked slide or
    annotation keeps its link's name; a prepare folder reached through a link is named where it lies)."""
    path = Path(path)
    return Path(os.path.realpath(path.parent)) / path.name


def _read_annotations(sets: Mapping[str, Mapping[str, list[tuple[str, Path, str | None]]]],
                      problems: Iterable[str] = ()) -> dict[str, dict[str, _Annotation]]:
    """{set: {stem: annotation}}: every matched annotation of every set read and parsed now, before anything is
    written. One ConfigError lists ``problems`` (archives that cannot be read) and every source that cannot be
    read or parsed, and every slide with two annotation files that describe different regions or groups (the
    rule :func:`wsi_milssl.annotations.io.annotation_difference` the other stages accept two files by: the same
    file twice, e.g. extracted beside its archive, or an XML and the GeoJSON converted from it, are one; the
    XML is then used, as the label stage would)."""
    import tempfile

    from wsi_milssl.annotations.io import annotation_difference
    from wsi_milssl.errors import AnnotationError

    problems = list(problems)
    out: dict[str, dict[str, _Annotation]] = {}
    with tempfile.TemporaryDirectory(prefix="wsi-milssl-prepare-") as scratch:
        n_copies = 0
        for set_name, annotations in sets.items():
            out[set_name] = {}
            for stem, candidates in annotations.items():
                distinct: dict[bytes, tuple[_Annotation, Path] | None] = {}
                for suffix, path, member in candidates:
                    where = str(path) if member is None else f"{path}:{member}"
                    try:
                        data = _read_source(path, member)
                    except ConfigError as exc:
                        problems.append(str(exc))
                        continue
                    if data in distinct:
                        continue
                    n_copies += 1  # each copy in its own folder, under the file's own name (for the messages)
                    copy = Path(scratch) / str(n_copies) / (path.name if member is None else member.rsplit("/", 1)[-1])
                    copy.parent.mkdir()
                    copy.write_bytes(data)
                    problem, groups, area_groups = _parse(copy, where)
                    if problem:
                        problems.append(problem)
                        distinct[data] = None
                        continue
                    source = str(_real(path)) if member is None else f"{_real(path)}:{member}"
                    distinct[data] = (_Annotation(suffix, data, where, source, groups, area_groups), copy)
                usable = [v for v in distinct.values() if v is not None]
                if not usable or len(usable) < len(distinct):
                    continue  # a file that cannot be parsed is a problem already
                usable.sort(key=lambda v: ANNOTATION_SUFFIXES.index(v[0].suffix))  # the XML first, as label reads
                (chosen, chosen_copy), differ = usable[0], []
                for other, other_copy in usable[1:]:
                    try:
                        why = annotation_difference(chosen_copy, other_copy)
                    except (AnnotationError, OSError) as exc:
                        why = f"one cannot be compared: {exc}"
                    if why is not None:
                        differ.append(f"{chosen.where} and {other.where} ({why})")
                if differ:
                    problems.append(f"{stem}: annotation files that describe different regions: {'; '.join(differ)}. "
                                    "Fix: keep one (remove or rename the one that is out of date).")
                else:
                    out[set_name][stem] = chosen
    problems = list(dict.fromkeys(problems))  # an archive below two of the folders searched: once
    if len(problems) == 1:
        raise ConfigError(f"{problems[0]} Nothing was written.")
    if problems:
        raise ConfigError(f"{len(problems)} annotation files cannot be used, so nothing was written. Fix: replace "
                          "or correct each file named below, then run prepare again: "
                          + " ".join(f"({k}) {p}" for k, p in enumerate(problems, 1)))
    return out


# ------------------------------------------------------------------------------------------------
# Checks
# ------------------------------------------------------------------------------------------------

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
            bad.append(f"{p} (a link to {os.readlink(p)}, which does not exist)")
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


def _same_content(paths: Iterable[Path]) -> list[list[Path]]:
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
    for group in _same_content(owner):
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


# ------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------

def _csv_text(header: tuple[str, ...], rows: Iterable[tuple]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return buf.getvalue()


def _write_set(out: Path, name: str, slides: Mapping[str, Path], labels: Mapping[str, int],
               annotations: Mapping[str, _Annotation], patients: Mapping[str, str] | None = None) -> CohortSet:
    """Write one set; ``annotations`` already read (:func:`_read_annotations`); ``patients`` {stem: patient}
    (from the labels file's patient column) adds a ``patient`` column to the labels file."""
    slides_path, labels_path, ann_dir = _set_paths(out, name)
    ann_dir.mkdir(parents=True, exist_ok=True)
    stems = sorted(slides, key=str.casefold)
    slides_csv = atomic_write_text(slides_path,
                                   _csv_text(("slide", "path"), ((s, str(slides[s].absolute())) for s in stems)))
    if patients:
        labels_text = _csv_text(("slide", "label", "patient"),
                                ((s, int(labels[s]), patients.get(s, "")) for s in stems))
    else:
        labels_text = _csv_text(("slide", "label"), ((s, int(labels[s])) for s in stems))
    labels_csv = atomic_write_text(labels_path, labels_text)
    keep = set()
    sources = {}
    for stem in stems:
        if stem not in annotations:
            continue
        annotation = annotations[stem]
        target = ann_dir / f"{stem}{annotation.suffix}"
        if not (target.is_file() and target.read_bytes() == annotation.data):
            atomic_write_bytes(target, annotation.data)
        keep.add(target.name)
        sources[stem] = annotation.source
    for old in ann_dir.iterdir():  # the folder is ours: files of slides no longer in the set go
        if old.is_file() and old.name not in keep and old.suffix.lower() in ANNOTATION_SUFFIXES:
            old.unlink()
    return CohortSet(name, {s: slides[s] for s in stems}, {s: int(labels[s]) for s in stems}, sources,
                     slides_csv, labels_csv, ann_dir)


def default_template() -> Path:
    """``pipelines/camelyon16.toml`` as shipped in the package (the paper's settings)."""
    from importlib.resources import files

    path = Path(str(files("wsi_milssl") / "pipelines" / "camelyon16.toml"))
    if not path.is_file():
        raise ConfigError(f"{path}: the packaged pipeline template is missing. Fix: pass --template PIPELINE.toml.")
    return path


_TABLE = re.compile(r"^\s*\[([^\[\]]+)\]\s*(#.*)?$")


def _template_body(template: Path, *, challenge_froc: bool = True) -> str:
    """The template's text without its leading comments and without its [pipeline], [data] and [synth.*]
    tables (the cohort's slides are real, not generated; every other table, with its comments, is kept
    as written). Without ``challenge_froc`` (another cohort than CAMELYON16 on the packaged template) the
    [evaluate] table's ``froc_mpp`` line is commented out: CAMELYON16's 0.243 µm/px is no other cohort's, whose
    FROC is measured at each slide's own µm/px."""
    lines = template.read_text(encoding="utf-8").splitlines()
    out: list[str] = []
    skipping = True  # the preamble before the first table describes the template, not this cohort
    table = ""
    for line in lines:
        m = _TABLE.match(line)
        if m:
            table = m.group(1).strip()
            skipping = table in ("pipeline", "data", "synth") or table.startswith(("pipeline.", "data.", "synth."))
        if not challenge_froc and table == "evaluate" and re.match(r"^\s*froc_mpp\s*=", line):
            line = f"# {line.strip()}    # CAMELYON16's: left out by `prepare folder` (each slide's own µm/px)"
        if not skipping:
            out.append(line)
    while out and not out[-1].strip():
        out.pop()
    return "\n".join(out) + "\n"


def _toml_str(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)


def _set_paths(out: Path, name: str) -> tuple[Path, Path, Path]:
    """(slides CSV, labels CSV, annotations folder) of the set ``name`` under ``out``."""
    cohort = out / "cohort"
    return cohort / f"{name}_slides.csv", cohort / f"{name}_labels.csv", cohort / "annotations" / name


def _pipeline_text(out: Path, *, name: str, template: Path, set_names: Iterable[str],
                   val_fraction: float | None, split_seed: int | None, command: str,
                   file_name: str = "pipeline.toml", challenge_froc: bool = True) -> str:
    from wsi_milssl.config import load_toml

    raw = load_toml(template)  # a template that is not TOML fails here, naming the file
    data = raw.get("data", {}) if isinstance(raw.get("data"), dict) else {}
    val = float(data.get("val_fraction", 0.2)) if val_fraction is None else float(val_fraction)
    seed = int(data.get("split_seed", 0)) if split_seed is None else int(split_seed)
    rel = lambda p: os.path.relpath(p, out)  # noqa: E731 - data paths are resolved against this file's folder
    lines = [
        f"# Written by `{command}` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC.",
        f"# Stage settings from {template}; [data] points at the slide lists, labels and annotations",
        "# found by prepare (cohort/). Run it as it is:  wsi-milssl run " + shlex.quote(str(out / file_name)),
        "",
        "[pipeline]",
        f"name = {_toml_str(name)}",
        f"out_dir = {_toml_str(str((out / 'run').resolve()))}",
        "",
        "[data]",
    ]
    for set_name in set_names:
        slides_csv, labels_csv, ann_dir = _set_paths(out, set_name)
        lines += [f"{set_name}_slides = {_toml_str(rel(slides_csv))}",
                  f"{set_name}_labels = {_toml_str(rel(labels_csv))}",
                  f"{set_name}_annotations = {_toml_str(rel(ann_dir))}"]
    lines += [f"val_fraction = {val!r}      # training slides held out to choose best.pt (never the test set)",
              f"split_seed = {seed}", "", ""]
    return "\n".join(lines) + _template_body(template, challenge_froc=challenge_froc)


def _command(layout: str, positional: Iterable[str | os.PathLike], options: Mapping[str, object]) -> str:
    """The command line that prepares this cohort again, from any folder: ``wsi-milssl prepare LAYOUT`` with
    ``positional`` and every option given (``options`` {flag: value}, None left out), paths made absolute,
    quoted for a POSIX shell (prepare.json and pipeline.toml quote it; tile names it as the fix for slides
    gone from a list prepare wrote)."""
    def text(value: object) -> str:
        return str(Path(value).absolute()) if isinstance(value, os.PathLike) else str(value)

    words = ["wsi-milssl", "prepare", layout, *(text(p) for p in positional)]
    for flag, value in options.items():
        if isinstance(value, (list, tuple)):  # --exclude A B: one flag, every value
            if value:
                words += [flag, *(text(v) for v in value)]
        elif value is not None:
            words += [flag, text(value)]
    return shlex.join(words)


def _path(value: str | os.PathLike | None) -> Path | None:
    return None if value is None else Path(value)


#: What prepare writes beside a pipeline.toml it keeps (one edited since prepare wrote it, or not prepare's).
NEW_PIPELINE_NAME = "pipeline.new.toml"


def _earlier_record(out: Path) -> dict:
    """The prepare.json of an earlier prepare into ``out`` ({} when there is none or it cannot be read)."""
    try:
        record = json.loads((out / "cohort" / "prepare.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _file_sha256(path: Path) -> str | None:
    """The SHA-256 of the file ``path``; None when there is no file (a folder there counts as a file: kept)."""
    if not path.exists() and not path.is_symlink():
        return None
    try:
        return file_sha256(path)
    except OSError:
        return "unreadable"


def _group_check(sets: Mapping[str, tuple[Mapping[str, Path], Mapping[str, int], Mapping[str, _Annotation]]],
                 spec, toml: Path) -> list[str]:
    """Notes for annotation groups the pipeline ``spec``'s label stage ignores (neither its tumour nor its
    non-tumour groups: it warns and leaves their polygons out); ConfigError, as the label stage would stop
    there, for a tumour slide whose annotation has no polygon in a tumour group and some in such groups."""
    from wsi_milssl.annotations.groups import UNCLASSIFIED
    from wsi_milssl.pipeline.spec import stage_config

    gmap = stage_config(spec, "label").group_map()

    def unknown(groups) -> list[str]:
        return sorted({UNCLASSIFIED if g is None else str(g) for g in groups if gmap.role(g) is None},
                      key=str.casefold)

    stop, ignored, new_groups, stop_groups = [], [], [], []
    for _, (_, labels, annotations) in sets.items():
        for stem, ann in sorted(annotations.items(), key=lambda kv: kv[0].casefold()):
            tumour = any(gmap.role(g) == "tumor" for g in ann.area_groups)
            if labels.get(stem) == 1 and not tumour and unknown(ann.groups):
                stop.append(f"{ann.where} ({', '.join(map(repr, unknown(ann.groups)))})")
                new_groups += unknown(ann.groups)
                stop_groups += unknown(ann.groups)
            elif unknown(ann.area_groups):
                ignored.append(f"{ann.where} ({', '.join(map(repr, unknown(ann.area_groups)))})")
                new_groups += unknown(ann.area_groups)
    groups, non_tumour = ", ".join(gmap.tumor), ", ".join(gmap.non_tumor)
    example = json.dumps([*gmap.tumor, *dict.fromkeys(new_groups)], ensure_ascii=False)
    if stop:
        raise ConfigError(
            f"{len(stop)} annotation file(s) of tumour slides have no area in a tumour group of the pipeline's "
            f"[label] stage ({groups}) but polygons in groups it does not know, so that stage would stop at them: "
            f"{_names(stop)}. Nothing was written. Fix: add {', '.join(map(repr, dict.fromkeys(stop_groups)))} to "
            f"[label] tumor_groups (or to non_tumor_groups, now {non_tumour}, for regions that are not tumour) and "
            "prepare again with --template PIPELINE.toml, a copy of the template whose [label] table has "
            f"tumor_groups = {example}"
            + (f", or after adding that line to {toml} (prepare keeps an edited pipeline.toml)" if toml.is_file()
               else "")
            + "; or correct the annotation files.")
    if not ignored:
        return []
    return [f"{len(ignored)} annotation file(s) have polygons in groups that the pipeline's [label] stage ignores "
            f"(neither tumour: {groups}; nor non-tumour: {non_tumour}): {_names(ignored)} (to use those polygons, add "
            f"the groups to [label] tumor_groups or non_tumor_groups in {toml}, or run with --set "
            f"{shlex.quote('label.tumor_groups=' + example)})"]


def _finish(out: Path, *, name: str, template: Path | None,
            sets: dict[str, tuple[Mapping[str, Path], Mapping[str, int], Mapping[str, _Annotation]]],
            val_fraction: float | None, split_seed: int | None, command: str, facts: dict,
            notes: list[str], patients: Mapping[str, str] | None = None, challenge_froc: bool = True,
            excluded: Iterable[str] = (), split: str = "") -> PreparedCohort:
    """Write everything: ``sets`` {name: (slides, labels, annotations read)}, all checked and read.

    The pipeline is made and validated first (in a temporary file beside ``pipeline.toml``), so a
    template that gives no valid pipeline leaves ``out`` as it was; ``pipeline.toml`` gets its name last.
    prepare.json records the SHA-256 of the pipeline.toml prepare wrote: a ``pipeline.toml`` that differs (edited
    since, or not written by prepare) is kept, and the new pipeline is written beside it as
    :data:`NEW_PIPELINE_NAME`, with a note naming both. The annotations' groups are checked against the label
    stage of the pipeline the result names to run (:func:`_group_check`).
    """
    from wsi_milssl.pipeline.runner import refuse_unusable_split
    from wsi_milssl.pipeline.spec import load_pipeline

    template = Path(template) if template is not None else default_template()
    toml = out / "pipeline.toml"
    new_toml = out / NEW_PIPELINE_NAME
    earlier = _earlier_record(out)
    ours = {earlier.get("pipeline_sha256"), earlier.get("pipeline_new_sha256")} - {None}
    current = _file_sha256(toml)
    keep = current is not None and current not in ours
    edited = keep and earlier.get("pipeline_sha256") is not None  # prepare wrote it, and it was changed since
    target = new_toml if keep else toml
    text = _pipeline_text(out, name=name, template=template, set_names=("train", "test"),
                          val_fraction=val_fraction, split_seed=split_seed, command=command, file_name=target.name,
                          challenge_froc=challenge_froc)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    run_toml = toml if edited else target  # the pipeline `next:` names
    notes = list(notes)
    if keep:
        take = f"mv {shlex.quote(str(new_toml))} {shlex.quote(str(toml))}"
        if edited:
            notes.append(f"{toml} was edited since prepare wrote it, so it is kept as it is (it reads the slide lists "
                         f"and labels written now); the pipeline prepare wrote now is {new_toml}. To take it instead: "
                         f"{take} (to see what differs: diff {shlex.quote(str(toml))} {shlex.quote(str(new_toml))})")
        else:
            notes.append(f"{toml} was not written by prepare (or by a version that recorded no digest of it), so it "
                         f"is kept as it is; the pipeline of this cohort is {new_toml}. Run that one, or take it as "
                         f"pipeline.toml: {take}")
    created = not out.exists()
    try:
        with atomic_open(target, "w") as fh:
            fh.write(text)
            fh.flush()
            try:
                spec = load_pipeline(fh.name)  # the file must be one `run` accepts
            except ConfigError as exc:
                raise ConfigError(f"{str(exc).replace(str(fh.name), str(target))} (in the pipeline written from "
                                  f"{template}; nothing was written)") from None
            if run_toml != target:
                try:
                    spec = load_pipeline(run_toml)  # the kept pipeline.toml is the one run will read
                except ConfigError:
                    pass
            # the split run will make of these slides (a grid needs validation slides of both classes): the
            # cohort is written, with a note, as the pipeline is there to be edited (drop the grid, another metric)
            train_labels = dict(sets["train"][1])
            try:
                refuse_unusable_split(spec, read_lists=False, train_lists=(
                    train_labels, {k: v for k, v in (patients or {}).items() if k in train_labels}))
            except ConfigError as exc:
                notes.append("`wsi-milssl run` will refuse this pipeline until it is edited: "
                             + str(exc).replace(str(fh.name), str(run_toml)))
            try:
                notes += _group_check(sets, spec, run_toml)
            except ConfigError as exc:
                raise ConfigError(str(exc).replace(str(fh.name), str(target))) from None
            written = {k: _write_set(out, k, *v, patients=patients) for k, v in sets.items()}
            real_out = Path(os.path.realpath(out))
            summary = {
                "command": command,
                "template": str(_real(template)),
                "pipeline": str(real_out / toml.name),
                "pipeline_sha256": earlier.get("pipeline_sha256") if keep else digest,
                **({"pipeline_new": str(real_out / new_toml.name), "pipeline_new_sha256": digest} if keep else {}),
                "sets": {k: {"slides": len(s.slides), "tumor": s.n_tumor, "normal": len(s.slides) - s.n_tumor,
                             "annotated": len(s.annotations), "slides_csv": str(_real(s.slides_csv)),
                             "labels_csv": str(_real(s.labels_csv)), "annotations": str(_real(s.annotations_dir)),
                             "annotation_sources": s.annotations} for k, s in written.items()},
                **facts,
                "excluded": list(excluded),
                "notes": notes,
            }
            summary_json = atomic_write_text(out / "cohort" / "prepare.json", json.dumps(summary, indent=2) + "\n")
    except BaseException:
        if created:
            try:
                out.rmdir()  # only when nothing is in it
            except OSError:
                pass
        raise
    if not keep and earlier.get("pipeline_new_sha256") and _file_sha256(new_toml) == earlier["pipeline_new_sha256"]:
        new_toml.unlink()  # prepare's own earlier pipeline.new.toml, unchanged: pipeline.toml is prepare's again
    for note in notes:
        logger.warning("%s", note)
    if split:
        logger.info("%s", split)
    return PreparedCohort(out, run_toml, written, summary_json, tuple(notes), tuple(excluded), split)


# ------------------------------------------------------------------------------------------------
# CAMELYON16
# ------------------------------------------------------------------------------------------------

def _camelyon16_role(path: Path) -> tuple[str, int | None] | None:
    """("train", 0) for Normal_NNN, ("train", 1) for Tumor_NNN, ("test", None) for Test_NNN, else None."""
    m = _CAMELYON16_NAME.match(slide_stem(path))
    return _CAMELYON16_ROLES[m.group(1).lower()] if m else None


def _camelyon16_mask(path: Path, root: Path) -> bool:
    """A mask image shipped with CAMELYON16, not a slide: ``*_mask`` / ``*_tissue`` by name (the AWS
    bucket's ``masks/tumor_001_mask.tif``, ``background_tissue/normal_001_tissue.tif``, GigaDB's
    ``Tumor_001_Mask.tif``), or any image below a ``masks/`` or ``background_tissue/`` folder."""
    if _CAMELYON16_MASK_NAME.search(slide_stem(path)):
        return True
    try:
        folders = path.relative_to(root).parts[:-1]
    except ValueError:
        folders = ()
    return any(f.casefold() in _CAMELYON16_MASK_DIRS for f in folders)


def prepare_camelyon16(root: str | os.PathLike, out_dir: str | os.PathLike, *,
                       template: str | os.PathLike | None = None, reference: str | os.PathLike | None = None,
                       val_fraction: float | None = None, split_seed: int | None = None,
                       exclude: Iterable[str] = ()) -> PreparedCohort:
    """Prepare the CAMELYON16 folder ``root`` (as downloaded; see the module docstring) into ``out_dir``.

    ``reference``: the test set's label file (default: the one ``reference.csv`` found below
    ``root``, any case). ``template``: the pipeline whose stage settings to use (default: the
    packaged ``pipelines/camelyon16.toml``); ``val_fraction`` / ``split_seed`` override its
    ``[data]`` values. ``exclude``: slide names left out of every set (as ``Test_114``, which is not
    exhaustively annotated; matched as slide names are; one that names no slide is an error).
    Raises one LabelsError listing every problem found.
    """
    root = Path(root)
    out = Path(out_dir)
    if not root.is_dir():
        raise ConfigError(f"{root}: no such folder. Fix: give the CAMELYON16 folder that holds the slides.")
    images = [p for p in _walk(root, skip=[out]) if _is_slide(p)]
    masks = [p for p in images if _camelyon16_mask(p, root)]
    slides = [p for p in images if not _camelyon16_mask(p, root)]
    if masks:
        logger.info("%d mask image(s) left out (masks/, background_tissue/, *_mask, *_tissue): not slides",
                    len(masks))
    if not slides:
        raise ConfigError(f"{root}: no slide files below this folder (looked for {', '.join(SLIDE_SUFFIXES)}"
                          + (f"; {len(masks)} mask image(s) left out" if masks else "")
                          + "). Fix: give the CAMELYON16 folder that holds training/ and testing/ (GigaDB) "
                          "or images/ (AWS).")
    exclude_keys = _exclude_keys(exclude)
    problems: list[str] = _unknown_excluded(exclude_keys, [slide_stem(p) for p in slides], str(root))
    excluded = sorted({slide_stem(p) for p in slides if stem_key(p) in exclude_keys}, key=str.casefold)
    slides = [p for p in slides if stem_key(p) not in exclude_keys]
    dup = _duplicates(slides)
    if dup:
        problems.append(f"{len(dup)} name(s) used by more than one slide: "
                        + _names([" and ".join(str(p) for p in v) for v in dup.values()]))
    problems += filter(None, [_linked_twice(slides), _unreadable_slides(slides)])
    unknown = [str(p.relative_to(root)) for p in slides if _camelyon16_role(p) is None]
    if unknown:
        problems.append(f"{len(unknown)} slide(s) not named as in CAMELYON16 (Normal_NNN, Tumor_NNN, Test_NNN): "
                        + _names(unknown))
    train = {slide_stem(p): p for p in slides if (_camelyon16_role(p) or ("",))[0] == "train"}
    test = {slide_stem(p): p for p in slides if (_camelyon16_role(p) or ("",))[0] == "test"}
    train_labels = {s: _camelyon16_role(p)[1] for s, p in train.items()}
    if not train:
        problems.append("no training slide (Normal_NNN / Tumor_NNN) found")
    if not test:
        problems.append("no test slide (Test_NNN) found")

    ref_path: Path | None = Path(reference) if reference is not None else None
    test_labels: dict[str, int] = {}
    not_here: list[str] = []
    if ref_path is None and test:
        found = [p for p in _walk(root, skip=[out]) if p.name.casefold() == "reference.csv"]
        if not found:
            problems.append("the test set's reference.csv (Test_NNN,Tumor|Normal,...) is not below the folder")
        elif len(found) > 1:
            problems.append("more than one reference.csv: " + _names([str(p) for p in found]) + " (pass --reference)")
        else:
            ref_path = found[0]
    if ref_path is not None and test:
        reference_labels = read_labels(ref_path)
        missing = sorted((s for s in test if s not in reference_labels), key=str.casefold)
        if missing:
            problems.append(f"{len(missing)} test slide(s) have no line in {ref_path}: {_names(missing)}")
        test_labels = {s: reference_labels[s] for s in test if s in reference_labels}
        not_here = [s for s in reference_labels
                    if stem_key(s) not in {stem_key(t) for t in test} and stem_key(s) not in exclude_keys]

    # slide files that hold the same bytes (a test slide that is a copy of a training slide, a slide re-released
    # under another name): left out as _same_content_slides says, with a note
    drop_train, drop_test, notes = _same_content_slides(train, train_labels, test, test_labels)
    train = {s: p for s, p in train.items() if s not in drop_train}
    train_labels = {s: v for s, v in train_labels.items() if s in train}
    test = {s: p for s, p in test.items() if s not in drop_test}
    test_labels = {s: v for s, v in test_labels.items() if s in test}

    sources, unreadable = _annotation_sources([root], skip=[out])
    # every annotation read and parsed now: a damaged archive or file stops here, before anything is written
    read = _read_annotations({"train": _match_annotations(sources, train), "test": _match_annotations(sources, test)},
                             unreadable)
    train_ann, test_ann = read["train"], read["test"]
    no_ann_test = sorted((s for s, v in test_labels.items() if v == 1 and s not in test_ann), key=str.casefold)
    if no_ann_test:
        problems.append(f"{len(no_ann_test)} tumour test slide(s) have no annotation (<name>.xml, also inside .zip "
                        f"archives): {_names(no_ann_test)}; the FROC needs them")
    _raise_problems(str(root), problems,
                    "keep the slides' CAMELYON16 names, download testing/reference.csv and the lesion annotations, "
                    "or use `wsi-milssl prepare folder` for another layout.")
    if ref_path is not None and not_here:
        notes.append(f"{len(not_here)} test slide(s) of {ref_path} are not below {root}, so the test set leaves them "
                     f"out: {_names(not_here, limit=10)} (not downloaded, or the download stopped: a partial file such "
                     "as Test_NNN.tif.part is no slide; download them and prepare again)")
    no_ann_train = sorted((s for s, v in train_labels.items() if v == 1 and s not in train_ann), key=str.casefold)
    if no_ann_train:
        notes.append(f"{len(no_ann_train)} tumour training slide(s) have no annotation: {_names(no_ann_train)} "
                     "(training does not need them; their patches get no instance labels for the metrics)")
    sets = {"train": (train, train_labels, train_ann), "test": (test, test_labels, test_ann)}
    facts = {"root": str(root.resolve()), "reference": str(_real(ref_path)) if ref_path else None,
             "mask_images_left_out": len(masks)}
    return _finish(out, name="camelyon16", template=template, sets=sets, val_fraction=val_fraction,
                   split_seed=split_seed,
                   command=_command("camelyon16", [root], {
                       "--out": out, "--reference": _path(reference), "--template": _path(template),
                       "--val-fraction": val_fraction, "--exclude": list(exclude)}),
                   facts=facts, notes=notes, excluded=excluded)


# ------------------------------------------------------------------------------------------------
# Any folder
# ------------------------------------------------------------------------------------------------

def _labelled_set(slides_dir: Path, labels_csv: Path, skip: list[Path], what: str,
                  exclude_keys: Mapping[str, str] | None = None
                  ) -> tuple[dict[str, Path], dict[str, int], list[str], list[str], list[str]]:
    """(slides by stem, their labels, problems, notes, stems excluded): a labelled slide that is not below
    ``slides_dir`` is left out with a note (it is in no set); a slide whose name is in ``exclude_keys``
    (:func:`_exclude_keys`) is left out without one."""
    slides = find_slide_files(slides_dir, skip=skip)
    exclude_keys = exclude_keys or {}
    problems = []
    if not slides:
        problems.append(f"no slide files below {slides_dir} (looked for {', '.join(SLIDE_SUFFIXES)})")
    excluded = sorted({slide_stem(p) for p in slides if stem_key(p) in exclude_keys}, key=str.casefold)
    slides = [p for p in slides if stem_key(p) not in exclude_keys]
    dup = _duplicates(slides)
    if dup:
        problems.append(f"{len(dup)} name(s) used by more than one slide: "
                        + _names([" and ".join(str(p) for p in v) for v in dup.values()]))
    problems += filter(None, [_linked_twice(slides), _unreadable_slides(slides)])
    labels = read_labels(labels_csv)
    by_stem = {slide_stem(p): p for p in slides}
    missing = sorted((s for s in by_stem if s not in labels), key=str.casefold)
    if missing:
        kind = f"{what} slide(s)" if what else "slide(s)"
        problems.append(f"{len(missing)} {kind} have no label in {labels_csv}: {_names(missing)}")
    extra = [s for s in labels if stem_key(s) not in {stem_key(t) for t in by_stem} and stem_key(s) not in exclude_keys]
    notes = [f"{len(extra)} labelled slide(s) of {labels_csv} are not below {slides_dir}, so they are left out: "
             f"{_names(extra)} (check their file names, or remove their lines)"] if extra else []
    return by_stem, {s: labels[s] for s in by_stem if s in labels}, problems, notes, excluded


def _split_change(out: Path, test: list[str]) -> list[str]:
    """A note when ``out`` holds an earlier prepare whose test set differs (slides added or removed move
    others across the seeded split): a model trained there saw slides that are now test slides."""
    try:
        earlier = read_labels(out / "cohort" / "test_labels.csv")
    except LabelsError:
        return []
    old, new = {stem_key(s) for s in earlier}, {stem_key(s) for s in test}
    if old == new:
        return []
    into = sorted((s for s in test if stem_key(s) not in old), key=str.casefold)
    out_of = sorted((s for s in earlier if stem_key(s) not in new), key=str.casefold)
    return [f"the test set differs from the earlier prepare in {out}: now in it {_names(into) or 'none'}; no longer in "
            f"it {_names(out_of) or 'none'}. A model trained on the earlier split has seen test slides: run the "
            "pipeline into a new output folder (or pass --test-slides/--test-labels to fix the test set)"]


def _patient_groups(labels_csv: Path, names: Iterable[str], patient_column: str | None, *, required: bool = True
                    ) -> tuple[str | None, dict[str, str]]:
    """(column as written, {name: patient}) of ``names`` from ``labels_csv`` (:func:`label_groups_for`): by the column
    ``patient_column`` (any case), the first of :data:`GROUP_COLUMNS` when None, none with
    :data:`NO_PATIENT_COLUMN`. A ``patient_column`` the file lacks is a LabelsError naming it, unless not
    ``required`` (a test labels file read for the shared-patients note only): then (None, {})."""
    if patient_column is not None and patient_column.strip().casefold() == NO_PATIENT_COLUMN:
        return None, {}
    try:
        return label_groups_for(labels_csv, names, column=patient_column)
    except LabelsError:
        if required or patient_column is None:
            raise
        return None, {}


def _n_patients(labels: Mapping[str, int], patients: Mapping[str, str]) -> tuple[int, int]:
    """(patients with a tumour slide, patients with normal slides only) among the slides of ``labels``; a slide
    without a patient counts as a patient of its own."""
    highest: dict[str, int] = {}
    for s, v in labels.items():
        unit = f"patient:{name_key(patients[s])}" if patients.get(s) else f"slide:{name_key(s)}"
        highest[unit] = max(highest.get(unit, 0), int(v))
    n_tumour = sum(highest.values())
    return n_tumour, len(highest) - n_tumour


def _split_line(labels_csv: Path, column: str | None, labels: Mapping[str, int], patients: Mapping[str, str],
                patient_column: str | None, *, held_out: bool) -> str:
    """How the slides of ``labels_csv`` were split: by which column patients were kept whole, or slide by slide."""
    if column is None:
        if patient_column is not None:  # NO_PATIENT_COLUMN
            return (f"split slide by slide (--patient-column {NO_PATIENT_COLUMN}: no patient column of {labels_csv} "
                    "is read)")
        return (f"split slide by slide: {labels_csv} has no patient column ({', '.join(GROUP_COLUMNS)}, any case; "
                "--patient-column COLUMN names another)")
    n_tumour, n_normal = _n_patients(labels, patients)
    where = ("in the test split and in run's validation split" if held_out
             else "in run's validation split of the training slides")
    return (f"kept patients whole by column {column!r} of {labels_csv}: {n_tumour + n_normal} patient(s) "
            f"({n_tumour} with tumour slides) of {len(labels)} slides, each patient's slides on one side {where} "
            f"(--patient-column {NO_PATIENT_COLUMN} splits slide by slide)")


def prepare_folder(slides_dir: str | os.PathLike, labels_csv: str | os.PathLike, out_dir: str | os.PathLike, *,
                   annotations_dir: str | os.PathLike | None = None,
                   test_slides_dir: str | os.PathLike | None = None, test_labels_csv: str | os.PathLike | None = None,
                   test_annotations_dir: str | os.PathLike | None = None, test_fraction: float = 0.25,
                   seed: int = 0, template: str | os.PathLike | None = None, name: str | None = None,
                   val_fraction: float | None = None, split_seed: int | None = None,
                   exclude: Iterable[str] = (), patient_column: str | None = None) -> PreparedCohort:
    """Prepare any cohort (see the module docstring) into ``out_dir``.

    Without ``test_slides_dir``, a stratified, seeded ``test_fraction`` of the slides becomes the
    test set (the rest trains; ``run`` then holds validation slides out of those); when the labels file
    has a patient column (:data:`wsi_milssl.cohorts.GROUP_COLUMNS`: ``patient``, ``patient_id``, ``case_id``,
    ``case_submitter_id``, any case; or the header column ``patient_column`` names, any case) whole patients are
    held out, so that no patient has slides in both sets, and the labels files written get a ``patient``
    column; ``patient_column`` :data:`NO_PATIENT_COLUMN` (``"none"``) splits slide by slide. The result's
    ``split`` says which column kept patients whole. A split that cannot keep patients whole and have both
    classes on both sides is one LabelsError naming the labels file, the column and the ways on. Annotations
    are looked up by slide name below ``annotations_dir`` (default: the slides folder), recursively, ``.zip``
    archives included. Tumour test
    slides need one (the FROC does). ``exclude``: slide names left out of every set (one that names no
    slide is an error). Raises one LabelsError listing every problem found.
    """
    slides_dir, labels_csv, out = Path(slides_dir), Path(labels_csv), Path(out_dir)
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test_fraction must satisfy 0 < value < 1; got {test_fraction!r}.")
    if (test_slides_dir is None) != (test_labels_csv is None):
        raise ConfigError("--test-slides and --test-labels go together; give both, or neither to hold out "
                          "--test-fraction of the slides.")
    exclude_keys = _exclude_keys(exclude)
    split_problem = ""
    slides, labels, problems, notes, excluded = _labelled_set(slides_dir, labels_csv, [out],
                                                              "training" if test_slides_dir else "", exclude_keys)
    column, patients = _patient_groups(labels_csv, slides, patient_column)
    ann_roots = [Path(annotations_dir)] if annotations_dir is not None else [slides_dir]
    facts = {"slides": str(slides_dir.resolve()), "labels": str(labels_csv.resolve())}
    if test_slides_dir is not None:
        t_slides, t_labels, t_problems, t_notes, t_excluded = _labelled_set(
            Path(test_slides_dir), Path(test_labels_csv), [out], "test", exclude_keys)
        problems += t_problems
        notes += t_notes
        excluded = sorted({*excluded, *t_excluded}, key=str.casefold)
        problems += _unknown_excluded(exclude_keys, [*slides, *t_slides, *excluded],
                                      f"{slides_dir} or {test_slides_dir}")
        t_column, t_patients = _patient_groups(Path(test_labels_csv), t_slides, patient_column, required=False)
        both = sorted({name_key(g) for g in patients.values()} & {name_key(g) for g in t_patients.values()})
        if both:
            shown = sorted({g for g in t_patients.values() if name_key(g) in both}, key=str.casefold)
            notes.append(f"{len(shown)} patient(s) have slides in both the training and the test set ({column} of "
                         f"{labels_csv}, {t_column} of {test_labels_csv}): {_names(shown)} (a model may learn a "
                         "patient it is tested on: move each patient's slides into one set)")
        split = _split_line(labels_csv, column, labels, patients, patient_column, held_out=False)
        patients = {**patients, **t_patients}
        overlap = sorted({stem_key(s) for s in slides} & {stem_key(s) for s in t_slides})
        if overlap:
            problems.append((f"{len(overlap)} slide(s) are in both the training and the test set: {_names(overlap)}",
                             "keep each slide in one set: remove it from the other set's folder or labels file."))
        test_files = {file_identity(p) for p in t_slides.values()}
        linked = sorted(str(p) for p in slides.values() if file_identity(p) in test_files)
        if linked:
            problems.append((f"{len(linked)} slide file(s) are in both the training and the test set under other "
                             f"names (links): {_names(linked)}",
                             "keep each slide in one set: remove it from the other set's folder or labels file."))
        drop_train, drop_test, same = _same_content_slides(slides, labels, t_slides, t_labels)
        notes += same
        t_roots = [Path(test_annotations_dir)] if test_annotations_dir is not None else [Path(test_slides_dir)]
        train = ({s: p for s, p in slides.items() if s not in drop_train},
                 {s: v for s, v in labels.items() if s not in drop_train})
        test = ({s: p for s, p in t_slides.items() if s not in drop_test},
                {s: v for s, v in t_labels.items() if s not in drop_test})
        facts.update(test_slides=str(Path(test_slides_dir).resolve()), test_labels=str(Path(test_labels_csv).resolve()))
    else:
        problems += _unknown_excluded(exclude_keys, [*slides, *excluded], str(slides_dir))
        # identical slide files before the split: a copy must not land in the other set
        drop, _, same = _same_content_slides(slides, labels)
        notes += same
        slides = {s: p for s, p in slides.items() if s not in drop}
        labels = {s: v for s, v in labels.items() if s not in drop}
        too_few = [word for label, word in ((0, "normal"), (1, "tumour"))
                   if sum(v == label for v in labels.values()) < 2 and labels]
        problems += [(f"fewer than two {word} slides: cannot hold any out for the test set",
                      "label more slides, or give the test set yourself (--test-slides and --test-labels).")
                     for word in too_few]
        tr, te = stratified_split(labels, fraction=test_fraction, seed=seed, groups=patients, key=str.casefold)
        one_sided = [word for label, word in ((1, "tumour"), (0, "normal"))
                     if not (any(labels[s] == label for s in tr) and any(labels[s] == label for s in te))]
        if patients and not too_few and one_sided:
            n_tumour, n_normal = _n_patients(labels, patients)
            split_problem = (
                f"{labels_csv}: cannot keep each patient's slides in one set and have {' and '.join(one_sided)} "
                f"slides in both the training and the test set: its column {column!r}, read as the patient of each "
                f"slide, puts the {len(labels)} slides into {n_tumour + n_normal} patient(s), {n_tumour} with tumour "
                f"slides and {n_normal} with normal slides only (a patient with a tumour slide counts as tumour; each "
                "side needs one of each). Nothing was written. Fix: if that column does not name patients, rename "
                f"it in {labels_csv.name} or prepare with --patient-column {NO_PATIENT_COLUMN} (split slide by "
                "slide); if it does, add slides of more patients, or give a test set with --test-slides and "
                "--test-labels.")
        split = _split_line(labels_csv, column, labels, patients, patient_column, held_out=True)
        train = ({s: slides[s] for s in tr}, {s: labels[s] for s in tr})
        test = ({s: slides[s] for s in te}, {s: labels[s] for s in te})
        t_roots = ann_roots
        facts.update(test_fraction=test_fraction, seed=seed)
        if column is not None:
            facts.update(patient_column=column)
        notes += _split_change(out, te)
    for root in (*ann_roots, *t_roots):
        if not root.is_dir():
            problems.append((f"annotation folder {root} does not exist",
                             "pass --annotations / --test-annotations with the folder that holds the annotations."))
    _raise_problems(str(slides_dir), problems,
                    "add a 'slide,label' line for every slide (1 tumour, 0 normal), keep one file per slide name, "
                    "and add the tumour test slides' annotations (<name>.xml or .geojson).")
    if split_problem:
        raise LabelsError(split_problem)
    train_sources, unreadable = _annotation_sources(ann_roots, skip=[out], given=annotations_dir is not None)
    test_sources, t_unreadable = ((train_sources, []) if t_roots == ann_roots
                                  else _annotation_sources(t_roots, skip=[out],
                                                           given=test_annotations_dir is not None))
    read = _read_annotations({"train": _match_annotations(train_sources, train[0]),
                              "test": _match_annotations(test_sources, test[0])}, unreadable + t_unreadable)
    train_ann, test_ann = read["train"], read["test"]
    no_ann_test = sorted((s for s, v in test[1].items() if v == 1 and s not in test_ann), key=str.casefold)
    _raise_problems(str(slides_dir), [f"{len(no_ann_test)} tumour test slide(s) have no annotation "
                                      f"(<name>.xml or .geojson) below {', '.join(map(str, t_roots))}: "
                                      f"{_names(no_ann_test)}; the FROC needs them"] if no_ann_test else [],
                    "add their annotations, or pass --annotations / --test-annotations with the folder that holds them.")
    no_ann_train = sorted((s for s, v in train[1].items() if v == 1 and s not in train_ann), key=str.casefold)
    if no_ann_train:
        notes.append(f"{len(no_ann_train)} tumour training slide(s) have no annotation: {_names(no_ann_train)}")
    sets = {"train": (*train, train_ann), "test": (*test, test_ann)}
    held_out = test_slides_dir is None  # --test-fraction and --seed split the slides
    command = _command("folder", [], {
        "--slides": slides_dir, "--labels": labels_csv, "--annotations": _path(annotations_dir),
        "--test-slides": _path(test_slides_dir), "--test-labels": _path(test_labels_csv),
        "--test-annotations": _path(test_annotations_dir), "--test-fraction": test_fraction if held_out else None,
        "--seed": seed if held_out else None, "--name": name, "--template": _path(template),
        "--val-fraction": val_fraction, "--exclude": list(exclude), "--patient-column": patient_column,
        "--out": out})
    return _finish(out, name=name or out.resolve().name, template=template, sets=sets, val_fraction=val_fraction,
                   split_seed=split_seed, command=command, facts=facts, notes=notes, patients=patients,
                   excluded=excluded, split=split,
                   challenge_froc=template is not None)  # the packaged template's froc_mpp is CAMELYON16's
