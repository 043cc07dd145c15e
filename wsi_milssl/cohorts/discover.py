"""Finding a cohort's files for ``prepare``: slides below a folder (through links, each folder once, earlier
prepare and run outputs left out) and their annotation files (also inside ``.zip`` archives), read and parsed as the
label stage reads them."""

from __future__ import annotations

import logging
import lzma
import os
import re
import zipfile
import zlib
from pathlib import Path
from typing import Iterable, Mapping, NamedTuple

from wsi_milssl.cohorts.names import ANNOTATION_SUFFIXES, SLIDE_SUFFIXES, slide_stem, stem_key
from wsi_milssl.errors import ConfigError

logger = logging.getLogger(__name__)

_MAX_ANNOTATION_BYTES = 256 << 20
#: What a damaged archive member or an unreadable file raises while it is read.
_READ_ERRORS = (zipfile.BadZipFile, zlib.error, lzma.LZMAError, OSError, EOFError, NotImplementedError,
                RuntimeError)


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
    unlisted: list[str] = []

    def cannot_list(exc: OSError) -> None:  # os.walk skips such a folder without a word (review CB)
        if isinstance(exc, PermissionError):
            unlisted.append(str(exc.filename))

    for dirpath, dirnames, filenames in os.walk(root, followlinks=True, onerror=cannot_list):
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
    if unlisted:
        logger.warning(
            "%d folder(s) below %s cannot be listed (permission denied), so their files were not searched: %s. "
            "Fix: ask for permission to list them, or copy the files to a folder you can.", len(unlisted), root,
            ", ".join(unlisted[:5]) + (" ..." if len(unlisted) > 5 else ""))


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
    return os.path.isfile(folder / "cohort" / "prepare.json")  # (False in a folder that cannot be entered: review ES)


def _is_run_output(folder: Path) -> bool:
    """A `wsi-milssl run` output folder (it holds the run's ``resolved_pipeline.toml``, as ``run --out ROOT/x``
    below a download leaves): its ``heatmaps/*_probs.tif`` are not slides."""
    from wsi_milssl.pipeline.spec import RESOLVED_FILENAME

    return os.path.isfile(folder / RESOLVED_FILENAME)


def _is_slide(path: Path) -> bool:
    return path.name.lower().endswith(SLIDE_SUFFIXES)


#: what browsers and download tools add to a file still being downloaded (Tumor_004.tif.part)
PARTIAL_DOWNLOAD_SUFFIXES = (".part", ".partial", ".crdownload", ".download", ".tmp")


#: what an interrupted ``aws s3 sync`` / ``aws s3 cp`` leaves: s3transfer downloads to ``<name>.<8 random
#: characters>`` (``filename + os.extsep + random_file_extension()``) and renames the file when it is done
#: (review EC B4: ``tumor_002.tif.8aF3c9B1``)
S3_TEMPORARY_SUFFIX = re.compile(r"\.[A-Za-z0-9]{8}$")


def _is_partial_download(path: Path) -> bool:
    """A slide file still being downloaded, or whose download stopped: ``<slide>.tif.part`` and the like, and
    ``<slide>.tif.<8 characters>`` (:data:`S3_TEMPORARY_SUFFIX`)."""
    name = path.name.lower()
    if any(name.endswith(s) and _is_slide(Path(name[: -len(s)])) for s in PARTIAL_DOWNLOAD_SUFFIXES):
        return True
    s3 = S3_TEMPORARY_SUFFIX.search(name)
    return s3 is not None and _is_slide(Path(name[: s3.start()]))


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
    from wsi_milssl.annotations.io import looks_like_geojson

    by_key = {stem_key(s): s for s in stems}
    out: dict[str, list[tuple[str, Path, str | None]]] = {}
    for stem, suffix, path, member in sources:
        target = by_key.get(stem_key(stem))
        if target is None:
            continue
        if suffix == ".json" and member is None and not looks_like_geojson(path):
            continue
        out.setdefault(target, []).append((suffix, path, member))
    return out


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
    absolute (recorded in prepare.json), ``groups`` the group name of each of its annotations and ``area_groups``
    those of its annotations that enclose an area (polygons, rectangles), as the label stage reads them."""

    suffix: str
    data: bytes
    where: str
    source: str
    groups: tuple
    area_groups: frozenset


def _parse(copy: Path, where: str) -> tuple[str | None, tuple, frozenset]:
    """(problem, groups, area groups) of the annotation file ``copy`` (a copy of ``where``): problem is None when
    the project's reader (:func:`wsi_milssl.annotations.read_annotations`, as the label stage reads it) accepts
    it, else its error, naming ``where``."""
    from wsi_milssl.annotations import read_annotations
    from wsi_milssl.annotations.asap import AREA_TYPES
    from wsi_milssl.errors import AnnotationError

    try:
        aset = read_annotations(copy, skipped=[])  # what it leaves out the label stage warns about
    except AnnotationError as exc:
        return str(exc).replace(str(copy), where), (), frozenset()
    return (None, tuple(a.group for a in aset.polygons),
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
        for set_name, set_annotations in sets.items():
            out[set_name] = {}
            for stem, candidates in set_annotations.items():
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
