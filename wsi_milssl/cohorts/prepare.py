"""``wsi-milssl prepare``: a downloaded cohort -> slide lists, label files, annotations and a ready pipeline.

Two layouts:

- :func:`prepare_camelyon16`: the CAMELYON16 folder as downloaded, searched recursively:
  ``training/normal/Normal_001.tif``, ``training/tumor/Tumor_001.tif``, ``testing/images/Test_001.tif``
  (or all slides in one folder), ASAP XML annotations anywhere below it or below ``annotations_dir``
  (``lesion_annotations/``, also inside ``.zip`` archives as shipped), and the test set's ``reference.csv`` as
  shipped (no header: ``Test_001,Tumor,Macro,...``). Training labels come from the names (``Tumor_*`` 1,
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
tumour test slide without its annotation, two different slide files with one name, a name that is not
CAMELYON16's, a slide file that cannot be opened for reading, such as a link to a disk that is not mounted, or
that is empty or cut short, a training set without normal or without tumour slides, an ``--exclude`` name of no
slide) is reported in one error that lists the names, each kind with its fix; every annotation problem
(an archive that may hold annotations or a file that cannot be read, a file the annotation reader
refuses, two annotation files for one slide that describe different regions) in one error that names
each file where it was found (another ``.zip`` that cannot be read is a warning). Slide files that hold
the same bytes under other names are left out with a note, never refused (:func:`_same_content_slides`; a
MIRAX or Hamamatsu slide's data files are compared with its index file); under one name they are one slide, with
a note (:func:`_same_name_slides`).
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

import logging
import os
import re
import shlex
from pathlib import Path
from typing import Iterable, Mapping

from wsi_milssl.cohorts.checks import (_cut_short_slides, _exclude_keys, _linked_twice, _names, _raise_problems,
                                       _same_content_slides, _same_name_slides, _unknown_excluded, _unreadable_slides)
from wsi_milssl.cohorts.discover import (ANNOTATION_SUFFIXES, PARTIAL_DOWNLOAD_SUFFIXES, _annotation_sources,
                                         _is_partial_download, _is_slide, _match_annotations, _read_annotations, _real,
                                         _walk, find_slide_files)
from wsi_milssl.cohorts.labels import GROUP_COLUMNS, read_labels
from wsi_milssl.cohorts.names import SLIDE_SUFFIXES, file_identity, name_key, slide_stem, stem_key
from wsi_milssl.cohorts.split import label_groups_for, stratified_split
from wsi_milssl.cohorts.write import CohortSet, PreparedCohort, _command, _finish, _path, default_template
from wsi_milssl.errors import ConfigError, LabelsError

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

_CAMELYON16_ROLES = {"normal": ("train", 0), "tumor": ("train", 1), "test": ("test", None)}
#: A CAMELYON16 slide's name: Normal_NNN, Tumor_NNN, Test_NNN (any case).
_CAMELYON16_NAME = re.compile(r"^(normal|tumor|test)_\d+$", re.IGNORECASE)
#: The mask images shipped beside the slides (the AWS bucket's masks/<name>_mask.tif and
#: background_tissue/<name>_tissue.tif, GigaDB's Tumor_001_Mask.tif): not slides.
_CAMELYON16_MASK_NAME = re.compile(r"[_-](mask|tissue)$", re.IGNORECASE)
_CAMELYON16_MASK_DIRS = frozenset({"masks", "background_tissue"})
#: Slides the organisers removed from the release (its readme: "intentionally removed"), by name -> why: an
#: ``--exclude`` of one, or a reference.csv line of one, is no missing download.
CAMELYON16_REMOVED = {"Test_049": "a duplicate slide", "Normal_086": "renamed Tumor_111"}
#: :func:`prepare_folder`'s ``patient_column`` (``--patient-column``) that splits slide by slide (no patient column).
NO_PATIENT_COLUMN = "none"


# ------------------------------------------------------------------------------------------------
# CAMELYON16
# ------------------------------------------------------------------------------------------------

def _camelyon16_role(path: Path) -> tuple[str, int | None] | None:
    """("train", 0) for Normal_NNN, ("train", 1) for Tumor_NNN, ("test", None) for Test_NNN, else None."""
    m = _CAMELYON16_NAME.match(slide_stem(path))
    return _CAMELYON16_ROLES[m.group(1).lower()] if m else None


def _leftover(partial: Path) -> bool:
    """Whether the partial download ``partial`` (``X.tif.part``) is left over beside its finished slide: ``X.tif``
    in the same folder and not empty (review BL; a browser makes an empty ``X.tif`` while it downloads, review BM)."""
    done = partial.with_name(partial.name.rsplit(".", 1)[0])
    try:
        return done.is_file() and done.stat().st_size > 0
    except OSError:
        return False


def _one_class_problems(labels: Mapping[str, int], *, where: str, names: tuple[str, str], fixes: tuple[str, str]
                        ) -> list[tuple[str, str]]:
    """The problems (text, fix) of a training set ``labels`` {stem: 0/1} without normal or without tumour slides:
    MIL-SSL learns negatives from the normal slides and pseudo-labels the patches of the tumour slides, so it cannot
    train on one class. ``names``: what a (normal, tumour) slide is called; ``fixes``: how to add each."""
    counts = {0: sum(v == 0 for v in labels.values()), 1: sum(v == 1 for v in labels.values())}
    why = {0: "MIL-SSL learns negatives from normal slides (its negative bags)",
           1: "MIL-SSL learns tumour from the tumour slides (its positive bags)"}
    return [(f"no {names[label]} {where}: {why[label]}, and the {len(labels)} {where}(s) found are all "
             f"{'tumour' if label == 0 else 'normal'}", f"{fixes[label]}, then prepare again.")
            for label in (0, 1) if labels and not counts[label]]


#: Training slides the organisers renamed (old name -> new name; CAMELYON16_REMOVED says why).
_CAMELYON16_RENAMED = {"Normal_086": "Tumor_111"}


def _drop_old_name(train: dict[str, Path], labels: dict[str, int]) -> str | None:
    """Leave out (in place) a training slide found under its old name beside the same file under its new name
    (:data:`_CAMELYON16_RENAMED`: ``Normal_086`` is ``Tumor_111``, relabelled tumour), and say so; identical slides
    with different labels would otherwise all be left out (review EC C3)."""
    from wsi_milssl.cohorts.checks import same_content_groups

    by_key = {stem_key(s): s for s in train}
    dropped = []
    for old_name, new_name in _CAMELYON16_RENAMED.items():
        old, new = by_key.get(stem_key(old_name)), by_key.get(stem_key(new_name))
        if old is not None and new is not None and same_content_groups([train[old], train[new]]):
            del train[old], labels[old]
            dropped.append(f"{old} (the same file as {new})")
    if not dropped:
        return None
    return (f"{len(dropped)} training slide(s) are the same file under the name the organisers replaced, so the old "
            f"name is left out and the new one, with its label, kept: {_names(dropped)}")


def _is_partial_archive(path: Path) -> bool:
    """An archive whose download did not finish (``lesion_annotations.zip.part`` and the like)."""
    name = path.name.lower()
    return any(name.endswith(".zip" + s) for s in PARTIAL_DOWNLOAD_SUFFIXES)


def _shown(path: Path, root: Path) -> str:
    """``path`` relative to ``root`` when it is below it (as the notes name files), else as it is."""
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


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
                       annotations_dir: str | os.PathLike | None = None,
                       val_fraction: float | None = None, split_seed: int | None = None,
                       exclude: Iterable[str] = ()) -> PreparedCohort:
    """Prepare the CAMELYON16 folder ``root`` (as downloaded; see the module docstring) into ``out_dir``.

    ``reference``: the test set's label file (default: the one ``reference.csv`` found below
    ``root``, any case). ``annotations_dir``: a folder of lesion annotations searched too (annotations
    downloaded apart from the slides), as if it were below ``root``. ``template``: the pipeline whose stage
    settings to use (default: the
    packaged ``pipelines/camelyon16.toml``); ``val_fraction`` / ``split_seed`` override its
    ``[data]`` values. ``exclude``: slide names left out of every set (as ``Test_114``, which is not
    exhaustively annotated; matched as slide names are; one that names no slide is an error, except a slide the
    organisers removed from the release, :data:`CAMELYON16_REMOVED`: a note).
    Raises one LabelsError listing every problem found.
    """
    root = Path(root)
    out = Path(out_dir)
    if not root.is_dir():
        raise ConfigError(f"{root}: no such folder. Fix: give the CAMELYON16 folder that holds the slides.")
    if annotations_dir is not None and Path(annotations_dir).is_file():  # review EC C1: the zip itself given
        raise ConfigError(f"{annotations_dir}: is a file, not a folder (--annotations). Fix: give the folder that "
                          f"holds it: --annotations {shlex.quote(str(Path(annotations_dir).parent))}")
    if annotations_dir is not None and not Path(annotations_dir).is_dir():
        raise ConfigError(f"{annotations_dir}: no such folder (--annotations). Fix: give the folder that holds the "
                          "lesion annotations (Tumor_NNN.xml, Test_NNN.xml, or lesion_annotations.zip).")
    files = list(_walk(root, skip=[out]))
    images = [p for p in files if _is_slide(p)]
    partial = sorted((str(p.relative_to(root)) for p in files if _is_partial_download(p) and not _leftover(p)),
                     key=str.casefold)
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
    found_keys = {stem_key(p) for p in slides}
    removed = {stem_key(n): f"{n} ({why})" for n, why in CAMELYON16_REMOVED.items()}
    removed_excluded = [removed[k] for k in exclude_keys if k in removed and k not in found_keys]
    problems: list[str] = _unknown_excluded({k: n for k, n in exclude_keys.items() if k not in removed},
                                            [slide_stem(p) for p in slides], str(root))
    excluded = sorted({slide_stem(p) for p in slides if stem_key(p) in exclude_keys}, key=str.casefold)
    slides = [p for p in slides if stem_key(p) not in exclude_keys]
    slides, same_name, same_name_note = _same_name_slides(slides)
    problems += filter(None, [same_name, _linked_twice(slides), _unreadable_slides(slides), _cut_short_slides(slides)])
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
        found = [p for p in files if p.name.casefold() == "reference.csv"]
        if not found:
            problems.append(("the test set's reference.csv (Test_NNN,Tumor|Normal,...) is not below the folder",
                             "download testing/reference.csv (the AWS bucket's evaluation/reference.csv) into the "
                             "folder, or pass --reference FILE."))
        elif len(found) > 1:
            problems.append(("more than one reference.csv: " + _names([str(p) for p in found]),
                             "pass --reference FILE to say which one holds the test labels (or remove the others)."))
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
    renamed_note = _drop_old_name(train, train_labels)
    drop_train, drop_test, notes = _same_content_slides(train, train_labels, test, test_labels)
    notes = [*filter(None, [same_name_note, renamed_note]), *notes]
    train = {s: p for s, p in train.items() if s not in drop_train}
    train_labels = {s: v for s, v in train_labels.items() if s in train}
    test = {s: p for s, p in test.items() if s not in drop_test}
    test_labels = {s: v for s, v in test_labels.items() if s in test}
    if train:  # MIL-SSL cannot train on one class: say so now, not after hours of tiling (review EC B2)
        # review EH: slides found but left out by --exclude are brought back by preparing without it
        unexcluded = " (or, if --exclude left them out, drop them from --exclude)" if exclude_keys else ""
        problems += _one_class_problems(train_labels, where="training slide", names=("Normal_NNN", "Tumor_NNN"),
                                        fixes=("download training/normal/ (the AWS bucket's images/normal_NNN.tif)"
                                               + unexcluded,
                                               "download training/tumor/ and training/lesion_annotations/ (the AWS "
                                               "bucket's images/tumor_NNN.tif and annotations/)" + unexcluded))

    sources, unreadable = _annotation_sources([root], skip=[out])
    if annotations_dir is not None:
        more, more_unreadable = _annotation_sources([Path(annotations_dir)], skip=[out], given=True)
        sources, unreadable = sources + more, unreadable + more_unreadable
    # every annotation read and parsed now: a damaged archive or file stops here, before anything is written
    read = _read_annotations({"train": _match_annotations(sources, train), "test": _match_annotations(sources, test)},
                             unreadable)
    train_ann, test_ann = read["train"], read["test"]
    no_ann_test = sorted((s for s, v in test_labels.items() if v == 1 and s not in test_ann), key=str.casefold)
    if no_ann_test:
        # an annotation archive whose download did not finish (lesion_annotations.zip.part) is named in the fix
        searched = [*files, *(_walk(Path(annotations_dir), skip=[out]) if annotations_dir is not None else [])]
        partial_archives = sorted({str(p) for p in searched if _is_partial_archive(p)}, key=str.casefold)
        fix = ("download the lesion annotations (testing/lesion_annotations/ or lesion_annotations.zip; "
               "--annotations DIR when they are not below the folder; --exclude NAME leaves a slide out of every set, "
               "the slide-level AUC too).")
        if partial_archives:
            fix = (f"{_names(partial_archives)} {'is a download' if len(partial_archives) == 1 else 'are downloads'} "
                   "that did not finish: download it again, then prepare again; or " + fix)
        problems.append((f"{len(no_ann_test)} tumour test slide(s) have no annotation (<name>.xml, also inside .zip "
                         f"archives): {_names(no_ann_test)}; the FROC needs them", fix))
    _raise_problems(str(root), problems,
                    "keep the slides' CAMELYON16 names, download testing/reference.csv and the lesion annotations "
                    "(--annotations DIR when they are not below the folder; --exclude NAME leaves a slide out of "
                    "every set, the slide-level AUC too), or use `wsi-milssl prepare folder` for another layout "
                    "(it does not keep CAMELYON16's official test slides apart).")
    if removed_excluded:
        notes.append(f"--exclude names {len(removed_excluded)} slide(s) the organisers removed from the release, so "
                     f"there is nothing to leave out: {_names(removed_excluded)}")
    listed_removed = [removed[stem_key(s)] for s in not_here if stem_key(s) in removed]
    not_here = [s for s in not_here if stem_key(s) not in removed]
    if ref_path is not None and listed_removed:
        notes.append(f"{ref_path} lists {len(listed_removed)} slide(s) the organisers removed from the release, so "
                     f"the test set leaves them out: {_names(listed_removed)}")
    if ref_path is not None and not_here:
        notes.append(f"{len(not_here)} test slide(s) of {ref_path} are not below {root}, so the test set leaves them "
                     f"out: {_names(not_here, limit=10)} (not downloaded, or the download stopped: a partial file such "
                     "as Test_NNN.tif.part is no slide; download them and prepare again)")
    if partial:
        notes.append(f"{len(partial)} file(s) below {root} are downloads that did not finish, so they are no slides "
                     f"and in no set: {_names(partial, limit=10)} (download them again, then prepare again)")
    # an annotation is drawn on a tumour slide: one whose slide is not here names a slide not downloaded (or whose
    # download stopped under a name not known as partial), which nothing else would name for training (review EC B4)
    orphans: dict[str, str] = {}
    for stem, _, path, member in sources:
        if (_CAMELYON16_NAME.match(stem) and stem_key(stem) not in found_keys and stem_key(stem) not in removed
                and stem_key(stem) not in orphans):
            orphans[stem_key(stem)] = _shown(path, root) + (f":{member}" if member else "")
    if orphans:
        shown = sorted(orphans.values(), key=str.casefold)
        notes.append(f"{len(shown)} lesion annotation file(s) have no slide below {root}: {_names(shown, limit=10)} "
                     "(each annotates a tumour slide: not downloaded, or its download stopped; download the slide "
                     "and prepare again)")
    no_ann_train = sorted((s for s, v in train_labels.items() if v == 1 and s not in train_ann), key=str.casefold)
    if no_ann_train:
        notes.append(f"{len(no_ann_train)} tumour training slide(s) have no annotation: {_names(no_ann_train)} "
                     "(training does not need them; their patches get no instance labels for the metrics)")
    sets = {"train": (train, train_labels, train_ann), "test": (test, test_labels, test_ann)}
    facts = {"root": str(root.resolve()), "reference": str(_real(ref_path)) if ref_path else None,
             "annotations": str(_real(Path(annotations_dir))) if annotations_dir is not None else None,
             "mask_images_left_out": len(masks)}
    return _finish(out, name="camelyon16", template=template, sets=sets, val_fraction=val_fraction,
                   split_seed=split_seed,
                   command=_command("camelyon16", [root], {
                       "--out": out, "--reference": _path(reference), "--annotations": _path(annotations_dir),
                       "--template": _path(template),
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
    slides, same_name, same_name_note = _same_name_slides(slides)
    problems += filter(None, [same_name, _linked_twice(slides), _unreadable_slides(slides), _cut_short_slides(slides)])
    labels = read_labels(labels_csv)
    by_stem = {slide_stem(p): p for p in slides}
    missing = sorted((s for s in by_stem if s not in labels), key=str.casefold)
    if missing:
        kind = f"{what} slide(s)" if what else "slide(s)"
        problems.append(f"{len(missing)} {kind} have no label in {labels_csv}: {_names(missing)}")
    extra = [s for s in labels if stem_key(s) not in {stem_key(t) for t in by_stem} and stem_key(s) not in exclude_keys]
    notes = [f"{len(extra)} labelled slide(s) of {labels_csv} are not below {slides_dir}, so they are left out: "
             f"{_names(extra)} (check their file names, or remove their lines)"] if extra else []
    notes += [same_name_note] if same_name_note else []
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
        by_set = {"train": patients, "test": t_patients}  # per set: a name may be in both (two files)
        test_by_key = {stem_key(s): p for s, p in t_slides.items()}
        test_files = {file_identity(p) for p in t_slides.values()}
        # a name in both sets is one slide when it is one file (the same folder, a link); two files that only share
        # a name are two slides, as `run` counts them (review EK), and two copies of one slide are left out of
        # training by the same-bytes check below
        shared_names = sorted((s for s in slides if stem_key(s) in test_by_key), key=str.casefold)
        overlap = [s for s in shared_names if file_identity(slides[s]) == file_identity(test_by_key[stem_key(s)])]
        if overlap:
            problems.append((f"{len(overlap)} slide(s) are in both the training and the test set: {_names(overlap)}",
                             "keep each slide in one set: remove it from the other set's folder or labels file."))
        said = {stem_key(s) for s in shared_names}  # a name in both sets is said once, above (review EI)
        linked = sorted(str(p) for s, p in slides.items() if file_identity(p) in test_files and stem_key(s) not in said)
        if linked:
            problems.append((f"{len(linked)} slide file(s) are in both the training and the test set under other "
                             f"names (links): {_names(linked)}",
                             "keep each slide in one set: remove it from the other set's folder or labels file."))
        drop_train, drop_test, same = _same_content_slides(slides, labels, t_slides, t_labels)
        apart = [s for s in shared_names if s not in overlap and s not in drop_train]  # (copies: said in `same`)
        if apart:
            notes.append(f"{len(apart)} name(s) are used in both sets by different slide files: {_names(apart)} (two "
                         "slides each, kept apart: each set's outputs have their own folders)")
        notes += same
        problems += _one_class_problems({s: v for s, v in labels.items() if s not in drop_train},
                                        where="training slide", names=("normal (label 0)", "tumour (label 1)"),
                                        fixes=(f"add normal slides to {slides_dir} and label them 0 in {labels_csv}",
                                               f"add tumour slides to {slides_dir} and label them 1 in {labels_csv}"))
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
        by_set = {"train": patients, "test": patients}  # one labels file: its names are one slide each
        train = ({s: slides[s] for s in tr}, {s: labels[s] for s in tr})
        test = ({s: slides[s] for s in te}, {s: labels[s] for s in te})
        t_roots = ann_roots
        facts.update(test_fraction=test_fraction, seed=seed)
        if column is not None:
            facts.update(patient_column=column)
        notes += _split_change(out, te)
    for root in dict.fromkeys((*ann_roots, *t_roots)):  # each once (review EH: the same folder was named twice)
        if root.is_file():  # a file given for the folder (review EH, as prepare camelyon16 says it)
            problems.append((f"annotation folder {root} is a file, not a folder",
                             f"pass --annotations / --test-annotations with the folder that holds it "
                             f"({shlex.quote(str(root.parent))})."))
        elif not root.is_dir():
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
    matched = {"train": _match_annotations(train_sources, train[0]), "test": _match_annotations(test_sources, test[0])}
    # two slides of one name, one in each set, must not read one annotation file (review EN: the training slide's
    # outline was the test slide's, and the FROC scored it), whatever the folders' spellings (review EU: a relative
    # and an absolute path, or a link, to one folder)
    train_files = {stem_key(s): {(file_identity(p), m) for _, p, m in found} for s, found in matched["train"].items()}
    one_file = sorted((s for s, found in matched["test"].items()
                       if train_files.get(stem_key(s), set()) & {(file_identity(p), m) for _, p, m in found}),
                      key=str.casefold)
    _raise_problems(str(slides_dir), [f"{len(one_file)} slide name(s) of both sets would read one annotation file "
                                      f"for two different slides: {_names(one_file)}"] if one_file else [],
                    "give the test set its own annotations folder (--test-annotations), or rename the slide of one "
                    "set (and its annotation).")
    read = _read_annotations(matched, unreadable + t_unreadable)
    train_ann, test_ann = read["train"], read["test"]
    no_ann_test = sorted((s for s, v in test[1].items() if v == 1 and s not in test_ann), key=str.casefold)
    _raise_problems(str(slides_dir), [f"{len(no_ann_test)} tumour test slide(s) have no annotation "
                                      f"(<name>.xml or .geojson) below {', '.join(map(str, t_roots))}: "
                                      f"{_names(no_ann_test)}; the FROC needs them"] if no_ann_test else [],
                    "add their annotations, or pass --annotations / --test-annotations with the folder that holds them.")
    no_ann_train = sorted((s for s, v in train[1].items() if v == 1 and s not in train_ann), key=str.casefold)
    if no_ann_train:
        notes.append(f"{len(no_ann_train)} tumour training slide(s) have no annotation: {_names(no_ann_train)}")
    official_test = sorted((s for s in train[0] if (_camelyon16_role(Path(s)) or ("",))[0] == "test"),
                           key=str.casefold)
    camelyon16 = any((_camelyon16_role(Path(s)) or ("",))[0] == "train" for s in (*train[0], *test[0]))
    # review BH: prepare camelyon16's error sent such cohorts here, and they trained on the official test slides;
    # review BL: an in-house test_001 (in a cohort without Normal_NNN / Tumor_NNN) is no CAMELYON16 slide
    if official_test and camelyon16:
        notes.append(f"{len(official_test)} slide(s) in the training set are named as CAMELYON16's official test "
                     f"slides (Test_NNN): {_names(official_test)} (results would not compare with CAMELYON16's: "
                     "prepare the download with `wsi-milssl prepare camelyon16 ROOT`, which keeps them as the test "
                     "set, --annotations DIR for annotations kept elsewhere)")
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
                   split_seed=split_seed, command=command, facts=facts, notes=notes, patients=by_set,
                   excluded=excluded, split=split,
                   challenge_froc=template is not None)  # the packaged template's froc_mpp is CAMELYON16's
