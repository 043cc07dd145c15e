"""Instances for MIL training: image patches from patch stores, feature vectors, and MIL CSV files.

Everything the training loop needs is an :class:`InstanceSet`: one row per instance with its bag, the
bag labels, and either the feature matrix or where each patch lives (store path + index in the store).
Instance labels (``instance_label`` in stores) ride along for evaluation only; training never reads them.

Image preprocessing and the training augmentation live in :mod:`wsi_milssl.mil.pixels` (``to_tensor``
and ``NORMALISATION`` are re-exported here); batches for a whole run come from
:class:`wsi_milssl.mil.loader.BatchLoader`.
"""

from __future__ import annotations

import csv
import hashlib
import logging
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

from wsi_milssl.artifacts import is_number
from wsi_milssl.errors import ConfigError, StoreError
from wsi_milssl.mil.pixels import NORMALISATION, normalize, to_tensor, to_unit_float

__all__ = [
    "NORMALISATION",
    "InstanceSet",
    "PatchDataset",
    "to_tensor",
    "to_unit_float",
    "normalize",
    "read_labels_csv",
    "read_mil_csv",
    "is_csv_header",
    "read_feature_files",
    "feature_settings_clash",
    "held_out_bags",
    "csv_bag_source",
    "read_patch_stores",
    "iterate_batches",
    "STORE_SETTING_KEYS",
]

log = logging.getLogger(__name__)

#: Store attributes copied into a training checkpoint's config so that inference tiles the same way.
STORE_SETTING_KEYS = (
    "target_mpp", "target_magnification", "patch_size_px", "stride_px", "entropy_threshold_bits",
    "tissue_detector", "min_tissue", "mask_mpp", "pixels", "jpeg_quality", "schema_version",
)


# ----------------------------------------------------------------------------------------------
# The instance container
# ----------------------------------------------------------------------------------------------

@dataclass
class InstanceSet:
    """All instances of a set of bags, in one fixed order.

    Attributes
    ----------
    kind : "features" or "images".
    bag_ids : int64 (N,), index of each instance's bag into ``bag_names``.
    bag_names : list of n_bags names (slide stems, CSV bag ids).
    bag_labels : int64 (n_bags,), 0 (negative) or 1 (positive).
    instance_labels : uint8 (N,) or None; evaluation only (never used to train).
    features : float32 (N, D) (kind "features").
    store_paths : one patch-store path per bag (kind "images").
    bag_sources : the slide file each bag was cut from, as its store (kind "images") or its feature file
        (kind "features") records it, else the store or feature file itself: two stores of one slide are
        one bag's data, two slides of one name are not. For a MIL CSV ``<resolved file>#<bag id>``
        (:func:`csv_bag_source`: its bag ids are local to the file). None for HDF5 files of several bags.
    local_index : int64 (N,), index of each patch in its bag's store (kind "images").
    settings : store tiling attributes shared by all bags (kind "images"), see STORE_SETTING_KEYS; for
        kind "features" the encoder and ``feature_settings`` (what decides the features' values, see
        :data:`wsi_milssl.features.schema.FEATURE_SETTING_KEYS`), which a checkpoint keeps.
    source : where the instances came from (for messages).
    file_settings : kind "features": (file, its ``feature_settings``) of each file read, to compare a
        validation set's files with the training set's (:func:`feature_settings_clash`).
    """

    kind: str
    bag_ids: np.ndarray
    bag_names: list[str]
    bag_labels: np.ndarray
    instance_labels: np.ndarray | None = None
    features: np.ndarray | None = None
    store_paths: list[str] | None = None
    bag_sources: list[str] | None = None
    local_index: np.ndarray | None = None
    settings: dict = field(default_factory=dict)
    source: str = ""
    file_settings: list[tuple[str, dict]] | None = None

    def __len__(self) -> int:
        return int(self.bag_ids.shape[0])

    @property
    def n_bags(self) -> int:
        return len(self.bag_names)

    @property
    def instance_bag_labels(self) -> np.ndarray:
        """int64 (N,): the label of each instance's bag."""
        return self.bag_labels[self.bag_ids]

    @property
    def in_features(self) -> int | None:
        return None if self.features is None else int(self.features.shape[1])

    def subset_bags(self, bags: Sequence[int]) -> "InstanceSet":
        """A new InstanceSet with only the bags at indices ``bags`` (renumbered in that order)."""
        bags = np.asarray(bags, dtype=np.int64)
        remap = np.full(self.n_bags, -1, dtype=np.int64)
        remap[bags] = np.arange(bags.size)
        keep = np.flatnonzero(remap[self.bag_ids] >= 0)
        new_ids = remap[self.bag_ids[keep]]
        order = np.argsort(new_ids, kind="stable")
        keep = keep[order]
        return InstanceSet(
            kind=self.kind,
            bag_ids=remap[self.bag_ids[keep]],
            bag_names=[self.bag_names[i] for i in bags],
            bag_labels=self.bag_labels[bags].copy(),
            instance_labels=None if self.instance_labels is None else self.instance_labels[keep],
            features=None if self.features is None else self.features[keep],
            store_paths=None if self.store_paths is None else [self.store_paths[i] for i in bags],
            bag_sources=None if self.bag_sources is None else [self.bag_sources[i] for i in bags],
            local_index=None if self.local_index is None else self.local_index[keep],
            settings=dict(self.settings),
            source=self.source,
            file_settings=self.file_settings,
        )


# ----------------------------------------------------------------------------------------------
# Readers
# ----------------------------------------------------------------------------------------------

def read_labels_csv(path: str | os.PathLike) -> "SlideLabels":
    """Read slide (bag) labels: a thin delegate to :func:`wsi_milssl.cohorts.read_labels`, the one
    labels reader every stage uses (header or not, CAMELYON16 reference layout, BOM, CRLF).

    Returns ``{stem: 0 or 1}`` with case-insensitive lookups; raises LabelsError naming the file,
    the line and the fix.
    """
    from wsi_milssl.cohorts import read_labels

    return read_labels(path)


def _bag_labels_from_instances(labels: np.ndarray, bag_ids: np.ndarray, n_bags: int) -> np.ndarray:
    bag_labels = np.zeros(n_bags, dtype=np.int64)
    np.maximum.at(bag_labels, bag_ids, labels.astype(np.int64))
    return bag_labels


def is_csv_header(fields: Sequence[str]) -> bool:
    """Whether the first row of a numeric CSV is a header: its first field is not a number (``label``,
    ``pixel0``, ...), or its fields are the column numbers ``0,1,...,n-1`` (what pandas' ``to_csv`` writes
    for a frame without column names). A first field such as ``1e2`` or ``-0.5`` is a number: a data row."""
    cells = [f.strip().strip('"').strip() for f in fields]
    if not cells or not is_number(cells[0]):
        return True
    return cells == [str(i) for i in range(len(cells))]


def _separator_hint(row: list[str]) -> str:
    """A hint when a row's values look separated by tabs or semicolons (a European spreadsheet's CSV, whose decimal
    commas then split the numbers instead), or '' (review CF)."""
    sep = next((name for ch, name in (("\t", "tabs"), (";", "semicolons")) if ch in row[0]), None)
    return f" The values look separated by {sep}: write the file comma-separated, with decimal points." if sep else ""


def read_mil_csv(path: str | os.PathLike) -> InstanceSet:
    """Read a classical MIL CSV ``label,bag_id,f1,...,fn`` (one instance per row), as shipped for
    MUSK1/MUSK2/ELEPHANT. The first row is a header when :func:`is_csv_header` says so: its first field
    is not a number, or its fields are ``0,1,...,n-1`` (pandas' ``to_csv`` of an unnamed frame).

    A bag is positive when any of its instances is labelled 1. The label column is kept as instance
    labels only when it varies inside some positive bag (MUSK and ELEPHANT repeat the bag label on every
    instance, which says nothing about instances), and an INFO line names such bags. Features are parsed in
    float64 and kept in float32, with a warning for columns too far from 0 for their spread to keep their
    differences in float32 (:func:`_warn_float32_offsets`).
    """
    path = Path(path)
    fix = "pass a UTF-8 text CSV of label,bag_id,f1,...,fn rows"
    rows, lines = [], []  # the non-blank rows and their line numbers in the file (messages name those)
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            reader = csv.reader(fh)
            for r in reader:
                if r and any(c.strip() for c in r):
                    rows.append(r)
                    lines.append(reader.line_num)
    except FileNotFoundError:
        raise ConfigError(f"{path}: MIL CSV not found; check the path.") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a text CSV (byte {exc.start} is not UTF-8); {fix}.") from None
    except (csv.Error, OSError) as exc:
        raise ConfigError(f"{path}: cannot read the MIL CSV ({exc}); {fix}.") from None
    # not a header but the values of another separator (decimal commas split them into a few fields: review EH)
    if rows and _separator_hint(rows[0]) and len(rows[0]) < 3:
        raise ConfigError(f"{path}: rows need label,bag_id and at least one feature; got {len(rows[0])} columns "
                          f"(line {lines[0]}).{_separator_hint(rows[0])}")
    if rows and _separator_hint(rows[0]) and not is_number(rows[0][0].strip()):
        raise ConfigError(f"{path}: rows need label,bag_id and at least one feature, separated by commas; line "
                          f"{lines[0]} reads {','.join(rows[0])[:60]!r}.{_separator_hint(rows[0])}")
    if rows and is_csv_header(rows[0]):
        if is_number(rows[0][0]):  # could be data: label 0, bag 1, features 2, 3, ...
            log.warning("%s: the first row %s is read as pandas' column numbers (a header), not as an instance; "
                        "add a named header row if it is data.", path, ",".join(c.strip() for c in rows[0]))
        rows, lines = rows[1:], lines[1:]
    if rows and all(r and not r[-1].strip() for r in rows):  # review ED, EH: a trailing comma on every data row
        rows = [r[:-1] for r in rows]
    if not rows:
        raise ConfigError(f"{path}: no instances; expected rows of label,bag_id,f1,...,fn.")
    width = len(rows[0])
    if width < 3:
        raise ConfigError(f"{path}: rows need label,bag_id and at least one feature; got {width} columns "
                          f"(line {lines[0]}).{_separator_hint(rows[0])}")
    bad = next((i for i, r in enumerate(rows) if len(r) != width), None)
    if bad is not None:
        raise ConfigError(f"{path}: line {lines[bad]} has {len(rows[bad])} columns, expected {width} (as line "
                          f"{lines[0]}); fix the file.")
    labels = np.empty(len(rows))
    feats = np.empty((len(rows), width - 2), dtype=np.float64)  # float32 (what models read) after the checks
    with np.errstate(over="ignore"):
        for i, r in enumerate(rows):
            try:
                labels[i] = float(r[0])
                feats[i] = [float(v) for v in r[2:]]
            except ValueError as exc:
                raise ConfigError(f"{path}: non-numeric label or feature on line {lines[i]}: {exc}; labels are 0/1 "
                                  f"and features numbers.{_separator_hint(r)}") from None
    bad_label = np.flatnonzero(~np.isin(labels, (0.0, 1.0)))
    if bad_label.size:
        found = sorted(set(labels.tolist()))
        fixed = path.with_name(f"{path.stem}_01.csv")  # (review CD: the file's name alone, and '-1,' alone)
        hint = (" A -1/1 file (negative -1, as some MIL distributions write it) needs -1 mapped to 0 first, e.g. "
                f"""`sed -E 's/^[[:space:]]*"?-1(\\.0*)?"?[[:space:]]*,/0,/' {shlex.quote(str(path))} > """
                f"{shlex.quote(str(fixed))}`." if set(found) <= {-1.0, 1.0} else "")
        raise ConfigError(f"{path}: labels (first column) must be 0 or 1; found {found[:5]} (first on line "
                          f"{lines[int(bad_label[0])]}).{hint}")
    with np.errstate(over="ignore"):  # beyond float32's range becomes inf, refused below
        feats32 = feats.astype(np.float32)
    bad_rows = np.flatnonzero(~np.isfinite(feats32).all(axis=1))
    if bad_rows.size:
        raise ConfigError(f"{path}: {bad_rows.size} instance row(s) have a NaN or infinite feature (or one beyond "
                          f"float32's range), the first on line {lines[int(bad_rows[0])]}; fix or drop those rows.")
    _warn_float32_offsets(path, feats, feats32)
    feats = feats32
    raw_bags = [r[1].strip() for r in rows]
    names: list[str] = []
    index: dict[str, int] = {}
    for b in raw_bags:
        if b not in index:
            index[b] = len(names)
            names.append(b)
    bag_ids = np.array([index[b] for b in raw_bags], dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, bag_ids[1:] != bag_ids[:-1]])  # where each run of one bag's rows begins
    split = np.flatnonzero(np.bincount(bag_ids[starts], minlength=len(names)) > 1)
    if split.size:  # (review CD: ids reused for other bags further down merged them without a word)
        log.warning("%s: the rows of %d bag id(s) are not together (%s): rows with one id are one bag wherever they "
                    "are. If an id is used again for another bag, give each bag its own id.", path, split.size,
                    ", ".join(names[i] for i in split[:5]) + (" ..." if split.size > 5 else ""))
    labels_u8 = labels.astype(np.uint8)
    bag_labels = _bag_labels_from_instances(labels_u8, bag_ids, len(names))
    pos_inst = bag_labels[bag_ids] == 1
    informative = bool(np.any(labels_u8[pos_inst] == 0))
    if informative:  # review ED: said, since a file meant to hold bag labels reads so too
        mixed = np.unique(bag_ids[pos_inst & (labels_u8 == 0)])
        log.info("%s: %d bag(s) hold rows labelled 0 and rows labelled 1 (%s): the first column is read as instance "
                 "labels (kept for evaluation only), and each bag is positive when any of its rows is 1.", path,
                 mixed.size, ", ".join(names[i] for i in mixed[:5]) + (" ..." if mixed.size > 5 else ""))
        all_one = np.setdiff1d(np.unique(bag_ids[pos_inst]), mixed)
        all_one = all_one[np.bincount(bag_ids, minlength=len(names))[all_one] > 1]
        if all_one.size:  # review EH: bag labels repeated in some bags, instance labels in others
            log.warning("%s: %d positive bag(s) hold rows labelled 0 and %d positive bag(s) of several rows hold only "
                        "rows labelled 1 (%s): read as instance labels, every row of the latter counts as a positive "
                        "instance in the instance metrics (never in training). If the first column repeats the bag "
                        "label in some bags, give instance labels in every bag or in none.", path, mixed.size,
                        all_one.size, ", ".join(names[i] for i in all_one[:5]) + (" ..." if all_one.size > 5 else ""))
    return InstanceSet(kind="features", bag_ids=bag_ids, bag_names=names, bag_labels=bag_labels,
                       instance_labels=labels_u8 if informative else None, features=feats,
                       bag_sources=[csv_bag_source(path, b) for b in names], source=str(path))


def _warn_float32_offsets(path: Path, feats: np.ndarray, feats32: np.ndarray) -> None:
    """Warn when float32, which the models read, moves a feature column's values by more than 1 % of the column's
    spread: a column far from 0 for its spread (review ED: 1e9 added to every MUSK1 feature left about 6 distinct
    values per column of 73). Columns that float32 keeps to within that (review EH: 1e5 plus rare 0/1 values,
    exact; N(2e4, 1), within 0.1 %) and constant columns written with rounding noise are not named."""
    if not feats.size:
        return
    spread = feats.std(axis=0)
    moved = np.abs(feats32.astype(np.float64) - feats).max(axis=0)
    far = np.flatnonzero((spread > 1e-12 * np.abs(feats.mean(axis=0))) & (moved > 0.01 * spread))
    if far.size:
        k = int(far[0])
        log.warning("%s: float32, which the models read, moves the values of %d feature column(s) by more than 1 %% "
                    "of their spread, as they lie far from 0 for it (column %d: mean %.6g, standard deviation %.3g, "
                    "moved by up to %.3g). Fix: centre the features (subtract each column's mean) before writing "
                    "the CSV.", path, far.size, k + 1, float(feats[:, k].mean()), float(spread[k]), float(moved[k]))


def csv_bag_source(path: str | os.PathLike, bag: str) -> str:
    """``<resolved path>#<bag id>``: where bag ``bag`` of the MIL CSV ``path`` comes from (its
    :attr:`InstanceSet.bag_sources` entry). Bag ids are local to their file: bag 1 of two CSV files are two
    bags, bag 1 of one file reached by two paths (a link) one. ``/`` in the id is quoted, so that resolving
    the entry again (as :func:`held_out_bags` does) leaves it as it is."""
    return f"{os.path.realpath(path)}#{bag.replace('%', '%25').replace('/', '%2F')}"


def _label_for(name: str, labels: dict[str, int], source: str, labels_path: str | None) -> int:
    if name not in labels:
        where = labels_path or getattr(labels, "path", None) or "the labels"  # a SlideLabels knows its file
        raise ConfigError(f"{source}: bag {name!r} has no row in {where}; add '{name},<0|1>' or drop the file.")
    return labels[name]


def read_feature_files(paths: Iterable[str | os.PathLike], labels: dict[str, int], *,
                       labels_path: str | None = None, empty: list[str] | None = None) -> InstanceSet:
    """Read instance feature vectors from HDF5 feature files (:mod:`wsi_milssl.features.schema`).

    Each file holds ``features`` float (N, D): files of ``wsi-milssl features``, TRIDENT's
    ``extract_patch_features`` and CLAM's ``extract_features_fp.py`` are read as they are. A file with a
    ``bag_ids`` dataset (N,) (integers or strings) holds several bags named by those ids; otherwise the
    whole file is one bag named by its ``slide_stem`` attribute or file stem. A file without a row
    (TRIDENT's features of a slide without patches) is left out with a warning, its bag name appended to
    ``empty`` when given (an evaluation scores such a slide as one without patches). Bag labels come from
    ``labels`` (name -> 0/1); an optional ``instance_label`` dataset (N,) is kept for evaluation.

    Bags are in name order (:func:`_name_order`), whatever order ``paths`` come in. A folder among ``paths``
    stands for its feature files, and a file named twice is read once
    (:func:`wsi_milssl.features.schema.feature_files_of`).

    ``settings`` of the result record the encoder the files name (``feature_encoder``, with its weights'
    SHA-256) and ``feature_settings`` (what decides the features besides the patches: encoder settings,
    dtype, input size, precision, resolution and patch size, as far as the files record them), which a
    feature checkpoint keeps. Files naming different encoders, or recording different such settings
    (:func:`wsi_milssl.features.schema.settings_differences`: 20x and 10x features in one folder, say), are
    refused naming two of them; files that do not record a setting (TRIDENT's, CLAM's) are not compared on it.
    """
    from wsi_milssl.cohorts import stem_key
    from wsi_milssl.features.schema import encoder_label, feature_files_of, read_feature_file

    feats_all, bag_all, inst_all = [], [], []
    names: list[str] = []
    index: dict[str, int] = {}
    by_key: dict[str, tuple[str, Path]] = {}  # names as labels and evaluate match them (without case)
    bag_labels: list[int] = []
    sources: list[str] | None = []
    have_inst = True
    encoders: dict[tuple[str, str], Path] = {}
    file_settings: list[tuple[str, dict]] = []
    dims: dict[int, Path] = {}
    from wsi_milssl.paths import path_list

    paths = feature_files_of(path_list(paths))
    if not paths:
        raise ConfigError("no feature files given; pass one or more .h5 files holding a 'features' dataset.")
    used: list[Path] = []
    unreadable: list[str] = []
    for path in paths:
        try:
            ff = read_feature_file(path)
        except StoreError as exc:  # read on: every such file is named in one error
            unreadable.append(str(exc))
            continue
        if len(ff) == 0:
            if empty is not None:
                empty.append(ff.stem)
            else:
                log.warning("%s: no feature rows (a slide without patches); left out of the training set.", path)
            continue
        if ff.encoder is not None:
            encoders.setdefault((ff.encoder, str(ff.attrs.get("encoder_weights_sha256") or "")), path)
        file_settings.append((str(path), ff.feature_settings))
        feats = ff.features  # float16/float32 as stored (widened once, into the final array); wider: to float32 now
        feats = np.asarray(feats, dtype=np.float32) if feats.dtype.itemsize > 4 else np.asarray(feats)
        dims.setdefault(int(feats.shape[1]), path)
        file_bags = ff.bag_ids if ff.bag_ids is not None else [ff.stem] * feats.shape[0]
        if ff.instance_label is not None:
            inst_all.append(ff.instance_label)
        else:
            have_inst = False
        if ff.bag_ids is not None:
            sources = None
        elif sources is not None:
            sources.append(str(ff.attrs.get("slide_path") or "") or str(path.resolve()))
        for b in dict.fromkeys(file_bags):
            if b in index:
                named = ("its bag_ids" if ff.bag_ids is not None else
                         "the file's slide_stem attribute" if ff.attrs.get("slide_stem") else "the file's name")
                raise ConfigError(f"{path}: bag {b!r} (named by {named}) is also in {by_key[stem_key(b)][1]}; each "
                                  "bag must live in one file. Fix: remove the copy (two extractions of one slide?), "
                                  "or rename the bag of one of them (its slide_stem attribute, or the file when it "
                                  "has none).")
            other = by_key.setdefault(stem_key(b), (b, path))
            if other[0] != b:  # review BP: trained as two bags, refused by evaluate as one slide
                raise ConfigError(f"{path}: bag {b!r} and bag {other[0]!r} ({other[1]}) differ only in letter case, and "
                                  "labels and evaluate match names without case, so they name one slide. Fix: remove "
                                  "the copy, or rename one of them.")
            index[b] = len(names)
            names.append(b)
            bag_labels.append(_label_for(b, labels, str(path), labels_path))
        feats_all.append(feats)
        bag_all.append(np.array([index[b] for b in file_bags], dtype=np.int64))
        used.append(path)
    if unreadable:
        raise StoreError(_unreadable_message(unreadable, len(paths), "feature files"))
    if not feats_all:
        raise StoreError(f"{', '.join(str(p) for p in paths[:3])}: no feature rows in any file; extract features "
                         "of slides with patches.")
    if len(encoders) > 1:
        (e1, w1), (e2, w2) = list(encoders)[:2]
        raise ConfigError(
            f"{encoders[(e1, w1)]} and {encoders[(e2, w2)]} hold features of different encoders "
            f"({encoder_label(e1, w1 or None)} vs {encoder_label(e2, w2 or None)}); a head needs one encoder's "
            "features. Fix: extract every slide with the same encoder and weights.")
    clash = _settings_clash(file_settings)
    if clash is not None:
        first, second, diffs = clash
        raise ConfigError(
            f"{first} and {second} hold features made with different settings ({'; '.join(diffs)}); one training "
            "set needs features of one encoder setting, resolution and patch size. Fix: extract every slide with the "
            "same settings, each resolution or setting into its own folder (`wsi-milssl features ... --out`), and "
            "train on one of them.")
    if len(dims) > 1:
        (d1, p1), (d2, p2) = sorted(dims.items())[:2]
        raise StoreError(f"feature files disagree on the feature length ({sorted(dims)}): {p1} holds {d1}-d "
                         f"features, {p2} {d2}-d. Fix: use one extractor for all.")
    by_name, new_index = _name_order(names)  # bags in name order: the order inputs are given in does not matter
    bag_ids = new_index[np.concatenate(bag_all)]
    names, bag_labels = [names[i] for i in by_name], [bag_labels[i] for i in by_name]
    sources = None if sources is None else [sources[i] for i in by_name]
    order = np.argsort(bag_ids, kind="stable")
    features = _gather_rows(feats_all, order)
    inst = np.concatenate(inst_all)[order] if have_inst and inst_all else None
    settings: dict = {}
    if encoders:
        (encoder, sha), = encoders
        settings = {"feature_encoder": encoder, "feature_encoder_weights_sha256": sha or None}
    common = _common_settings(file_settings)
    if common:
        settings["feature_settings"] = common
    return InstanceSet(kind="features", bag_ids=bag_ids[order], bag_names=names,
                       bag_labels=np.asarray(bag_labels, dtype=np.int64), instance_labels=inst,
                       features=features, bag_sources=sources, settings=settings,
                       source=_several(used), file_settings=file_settings)


def _gather_rows(parts: list[np.ndarray], order: np.ndarray) -> np.ndarray:
    """``np.concatenate(parts).astype(float32)[order]``, built without the concatenation: the float32 result is
    allocated once and each part is copied into its rows, then dropped from ``parts`` (emptied), so loading
    a cohort holds the files' arrays and the result, not three copies of it."""
    n = int(order.shape[0])
    dim = int(parts[0].shape[1])
    out = np.empty((n, dim), dtype=np.float32)
    dest = np.empty(n, dtype=np.int64)  # where each row of the concatenation goes
    dest[order] = np.arange(n, dtype=np.int64)
    start = 0
    while parts:
        part = parts.pop(0)
        rows = dest[start:start + part.shape[0]]
        start += part.shape[0]
        if rows.size and rows[-1] - rows[0] == rows.size - 1 and bool(np.all(np.diff(rows) == 1)):
            out[rows[0]:rows[-1] + 1] = part  # the usual case: a file holds one bag, its rows stay together
        elif rows.size:
            out[rows] = part
        del part
    return out


def _name_order(names: Sequence[str]) -> tuple[list[int], np.ndarray]:
    """(the bag indices in name order, each bag's new index in that order). Training visits bags in this
    canonical order (bag names are unique within a set), so that a fixed seed gives the same weights whatever
    order inputs are listed in or whatever their folders are called."""
    by_name = sorted(range(len(names)), key=lambda i: names[i])
    new_index = np.empty(len(names), dtype=np.int64)
    new_index[by_name] = np.arange(len(names), dtype=np.int64)
    return by_name, new_index


def _common_settings(files: Sequence[tuple[str, dict]]) -> dict:
    """Each feature setting as the first file that records it has it (the files agree where both record one)."""
    out: dict = {}
    for _, here in files:
        for key, value in here.items():
            out.setdefault(key, value)
    return out


def _settings_clash(files: Sequence[tuple[str, dict]]) -> tuple[str, str, list[str]] | None:
    """The first two of ``files`` ((path, feature settings) in order) that record a setting with different
    values, and what differs (:func:`wsi_milssl.features.schema.settings_differences`); None when they agree."""
    from wsi_milssl.features.schema import settings_differences

    first_with: dict[str, int] = {}  # setting -> the first file recording it
    for i, (path, here) in enumerate(files):
        for key in here:
            j = first_with.get(key)
            if j is not None:
                diffs = settings_differences(files[j][1], here)
                if diffs:
                    return files[j][0], path, diffs
        for key in here:
            first_with.setdefault(key, i)
    return None


def feature_settings_clash(train: InstanceSet, val: InstanceSet) -> tuple[str, str, list[str]] | None:
    """(a training file, a validation file, what differs) when the feature files of ``val`` record other
    settings than those of ``train`` (encoder settings, dtype, input size, precision, resolution, patch
    size: :func:`wsi_milssl.features.schema.settings_differences`), else None. Settings a file does not
    record are not compared."""
    if not train.file_settings or not val.file_settings:
        return None
    return _settings_clash(list(train.file_settings) + list(val.file_settings))


def held_out_bags(train: InstanceSet, val: InstanceSet) -> list[str]:
    """The bags of ``val`` that are not training bags: not cut from a slide file of ``train`` where both
    sets record their slides (``bag_sources``, resolved: two folders may hold files of one name made from
    different slides; for MIL CSVs also no bag of the same id and the same instance rows, as in a copy of
    the training file; for feature files no bag with the feature rows of a training bag, as in a copy of a
    training file that records no slide_path, CLAM's or TRIDENT's), else not named as a training bag."""
    if train.bag_sources is not None and val.bag_sources is not None:
        seen = {os.path.realpath(p) for p in train.bag_sources}
        copied = _csv_bags_with_training_rows(train, val) | _feature_bags_of_training_rows(train, val)
        return [n for n, p in zip(val.bag_names, val.bag_sources) if os.path.realpath(p) not in seen and n not in copied]
    known = set(train.bag_names)
    return [n for n in val.bag_names if n not in known]


def _from_mil_csv(instances: InstanceSet) -> bool:
    source = getattr(instances, "source", None)
    return bool(source and instances.bag_sources and instances.bag_sources[0].startswith(os.path.realpath(source) + "#"))


def _csv_bags_with_training_rows(train: InstanceSet, val: InstanceSet) -> set[str]:
    """Bags of a validation MIL CSV that are bags of the training MIL CSV: the same id, every instance row
    among that training bag's rows, and at least one of those rows found once in the whole training file (a
    copy, hard link or part of the training file). Ids alone say nothing across files (two files may both
    number their bags from 1), and neither do rows that repeat (all-zero or one-hot rows of sparse data)."""
    if not (_from_mil_csv(train) and _from_mil_csv(val)) or train.features is None or val.features is None:
        return set()
    train_rows = [row.tobytes() for row in np.asarray(train.features, dtype=np.float32)]
    count: dict[bytes, int] = {}
    for row in train_rows:
        count[row] = count.get(row, 0) + 1
    by_bag: dict[int, set[bytes]] = {}
    for bag, row in zip(train.bag_ids.tolist(), train_rows):
        by_bag.setdefault(bag, set()).add(row)
    train_index = {name: k for k, name in enumerate(train.bag_names)}
    val_rows: dict[int, list[bytes]] = {}
    for bag, row in zip(val.bag_ids.tolist(), np.asarray(val.features, dtype=np.float32)):
        val_rows.setdefault(bag, []).append(row.tobytes())
    shared = set()
    for k, name in enumerate(val.bag_names):
        rows, t = val_rows.get(k, []), train_index.get(name)
        if t is not None and rows and all(r in by_bag[t] for r in rows) and any(count[r] == 1 for r in rows):
            shared.add(name)
    return shared


def _bag_rows(instances: InstanceSet, bags: set[int]) -> dict[int, np.ndarray]:
    """The feature rows (float32, in the set's order) of each bag index in ``bags``."""
    ids = np.asarray(instances.bag_ids)
    order = np.argsort(ids, kind="stable")
    starts = np.searchsorted(ids[order], np.arange(instances.n_bags + 1))
    feats = np.asarray(instances.features, dtype=np.float32)
    return {b: feats[order[starts[b]:starts[b + 1]]] for b in bags}


def _feature_bags_of_training_rows(train: InstanceSet, val: InstanceSet) -> set[str]:
    """Bags of validation feature files (not a MIL CSV) whose feature rows are those of a training bag, row for
    row (shape and bytes, whatever the bag's name): a copy of a training file. Files that record no
    ``slide_path`` (CLAM's, TRIDENT's) are told apart by their path only, so without this check a copied
    folder would validate on the training data. Only bags of a row count that both sets have are hashed."""
    if (any(getattr(s, "kind", None) != "features" or getattr(s, "features", None) is None for s in (train, val))
            or _from_mil_csv(train) or _from_mil_csv(val)):
        return set()
    train_counts = np.bincount(np.asarray(train.bag_ids), minlength=train.n_bags)
    val_counts = np.bincount(np.asarray(val.bag_ids), minlength=val.n_bags)
    common = set(train_counts[train_counts > 0].tolist()) & set(val_counts[val_counts > 0].tolist())
    if not common:
        return set()

    def digests(instances: InstanceSet, counts: np.ndarray) -> dict[int, str]:
        rows = _bag_rows(instances, {b for b, n in enumerate(counts.tolist()) if n in common})
        return {b: hashlib.sha256(repr(r.shape).encode() + np.ascontiguousarray(r).tobytes()).hexdigest()
                for b, r in rows.items()}

    trained = set(digests(train, train_counts).values())
    return {val.bag_names[b] for b, d in digests(val, val_counts).items() if d in trained}


def nested_feature_folders(paths) -> str:
    """"FOLDER/h5_files holds N feature file(s). Fix: pass that folder ..." for the given folders whose sub-folders,
    or theirs, hold files of patch features (CLAM writes h5_files/ and pt_files/, TRIDENT
    <mag>x_<size>px_<overlap>px_overlap/features_<encoder>/ in its job folder; review BP: the error only said to tile;
    review CW: TRIDENT's job folder is two levels up, and its patches/ and slide_features_*/ hold no patch features),
    or that hold CLAM's .pt files; "" when none does."""
    from wsi_milssl.features.schema import feature_files_in

    found, pt = [], []

    def visit(folder: Path, depth: int) -> None:
        try:
            subs = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")
                          and p.suffix.lower() != ".zarr")
        except OSError:
            return
        for sub in subs:
            try:
                files = feature_files_in(sub)
            except OSError:
                continue
            if files and _holds_patch_features(files[0]):
                found.append(f"{sub} holds {len(files)} feature file(s)")
            elif depth < 2:
                visit(sub, depth + 1)

    for path in paths if isinstance(paths, (list, tuple)) else [paths]:
        folder = Path(path)
        if not folder.is_dir():
            continue
        try:
            if any(q.suffix == ".pt" for q in folder.iterdir()):
                pt.append(str(folder))
        except OSError:
            continue
        visit(folder, 1)
    if found:
        return (f"{'; '.join(found[:3])}. Fix: pass that folder (CLAM's h5_files/, TRIDENT's features_<encoder>/; the "
                ".pt files of CLAM's pt_files/ are not read).")
    if pt:
        return (f"{', '.join(pt[:3])} holds .pt files (CLAM's pt_files/), which are not read. Fix: pass the h5_files/ "
                "folder beside it, whose .h5 files hold the same features and their coordinates.")
    return ""


def _holds_patch_features(path: Path) -> bool:
    """Whether ``path`` is a feature file of patches (``features`` of 2 or more dimensions, no ``patches``): not
    TRIDENT's coordinate files (patches/) or its slide embeddings (slide_features_*/, one vector)."""
    import h5py

    try:
        with h5py.File(path, "r") as fh:
            return "patches" not in fh and isinstance(fh.get("features"), h5py.Dataset) and fh["features"].ndim >= 2
    except (OSError, KeyError, TypeError):
        return False


def read_patch_stores(paths: Iterable[str | os.PathLike], labels: dict[str, int], *,
                      labels_path: str | None = None) -> InstanceSet:
    """Index the patches of patch stores (one store per slide = one bag) without reading pixels.

    Bag names are the stores' slide stems, labelled from ``labels``; bags are in name order
    (:func:`_name_order`), whatever order or folders the stores come in. A store without a patch (no tissue passed
    the filters) is left out with a warning, as :func:`read_feature_files` leaves out files without rows: it
    would count as a bag with nothing to learn from. Instance labels are taken from the
    stores' ``instance_label`` datasets when every store has one (evaluation only). All stores must share
    the target resolution and patch size. The stores' tile recipe (attribute ``tiling_plan``) goes into
    ``settings["tiling_plan"]`` as a dict (the first store's that has one; stores written before it
    existed have none), for training to copy into the checkpoint.
    Returns an :class:`InstanceSet` of kind ``images`` (patches are read when a batch needs them).
    """
    from wsi_milssl.errors import ConfigError
    from wsi_milssl.paths import path_list
    from wsi_milssl.store import find_stores, open_store
    from wsi_milssl.tiling.plan import PLAN_ATTR, TilingPlan

    store_paths = find_stores(path_list(paths))
    if not store_paths:
        nested = nested_feature_folders(paths)
        raise StoreError(f"no patch stores or feature files in the given paths, but {nested}" if nested else
                         "no patch stores found in the given paths; run `wsi-milssl tile` first.")
    names, sources, bag_labels, ids, local, inst, used = [], [], [], [], [], [], []
    have_inst = True
    settings: dict | None = None
    unreadable: list[str] = []
    labelled_by: dict[str, tuple[Path, Any]] = {}  # label_config_hash: the first store so labelled, its fraction
    for sp in store_paths:
        try:
            opened = open_store(sp)
        except StoreError as exc:  # read on: every such store is named in one error
            unreadable.append(str(exc))
            continue
        with opened as store:
            if not store.has("patches"):
                raise StoreError(f"{sp}: the store holds no patch pixels; re-tile with pixels stored "
                                 "(not 'none') to train on images.")
            n = len(store)
            if n == 0:  # a bag without instances: it would count as a (positive) bag with nothing to learn from
                log.warning("%s: no patches (none passed the tissue and entropy filters, or the slide is smaller than "
                            "one patch: tile's warning and qc/ image say which); left out of the set.", sp)
                continue
            attrs = dict(store.attrs)
            stem = str(getattr(store, "stem", None) or attrs.get("slide_stem") or Path(sp).stem)
            if store.has("instance_label"):
                inst.append(np.asarray(store.read_array("instance_label"), dtype=np.uint8))
                # an unannotated store's labels are all 0 under any setting (review DW: a false alarm)
                if attrs.get("label_config_hash") and _plain_attr(attrs.get("label_status")) == "annotated":
                    labelled_by.setdefault(str(_plain_attr(attrs["label_config_hash"])),
                                           (sp, _plain_attr(attrs.get("positive_fraction"))))
            else:
                have_inst = False
        here = {k: _plain_attr(attrs[k]) for k in STORE_SETTING_KEYS if k in attrs}
        if PLAN_ATTR in attrs:
            try:
                here[PLAN_ATTR] = TilingPlan.from_json(_plain_attr(attrs[PLAN_ATTR]),
                                                       source=f"{sp}: attribute {PLAN_ATTR!r}").to_dict()
            except ConfigError as exc:
                raise StoreError(str(exc)) from None
        if settings is None:
            settings = here
        else:
            for key in ("target_mpp", "patch_size_px"):
                if key in settings and key in here and not np.isclose(float(settings[key]), float(here[key])):
                    raise StoreError(
                        f"{sp}: {key} = {here[key]} differs from {store_paths[0]} ({settings[key]}); "
                        "tile every slide with the same settings."
                    )
            if PLAN_ATTR in here:
                first = settings.setdefault(PLAN_ATTR, here[PLAN_ATTR])
                differ = sorted(k for k, v in here[PLAN_ATTR].items() if k != "direct_tiff_read" and first.get(k) != v)
                if differ:
                    log.warning("%s: tiled with other settings (%s) than the first store; the checkpoint records "
                                "the first store's tiling plan, so heatmaps will cut slides that way.",
                                sp, ", ".join(f"{k} {first.get(k)!r} -> {here[PLAN_ATTR][k]!r}" for k in differ))
        if stem in names:
            raise StoreError(f"{sp}: slide {stem!r} appears twice; pass each store once.")
        names.append(stem)
        sources.append(str(_plain_attr(attrs["slide_path"])) if attrs.get("slide_path") else str(sp))
        bag_labels.append(_label_for(stem, labels, str(sp), labels_path))
        ids.append(np.full(n, len(used), dtype=np.int64))
        local.append(np.arange(n, dtype=np.int64))
        used.append(sp)
    if unreadable:
        raise StoreError(_unreadable_message(unreadable, len(store_paths), "stores"))
    if len(labelled_by) > 1:  # review DU: label shards re-run with another --positive-fraction, without a word
        (a, fa), (b, fb) = list(labelled_by.values())[:2]
        log.warning("%s and %s were labelled with different label settings (positive_fraction %s and %s, or the "
                    "annotation groups): their instance labels, which score the pseudo labels and evaluations (never "
                    "training), mean two things. Fix: label every store again with one setting (`wsi-milssl label "
                    "... --overwrite`).", a, b, fa, fb)
    if not used:
        raise StoreError(f"{', '.join(str(p) for p in store_paths[:3])}{' ...' if len(store_paths) > 3 else ''}: the "
                         "stores hold no patches. Fix: check the tiling settings against the slides (tile's "
                         "warnings and qc/ images: the patch size against the slides' size, the tissue and entropy "
                         "filters).")
    by_name, _ = _name_order(names)  # bags in name order, not in the order of the stores' paths
    names, sources, bag_labels, used = ([xs[i] for i in by_name] for xs in (names, sources, bag_labels, used))
    local = [local[i] for i in by_name]
    ids = [np.full(local[k].size, k, dtype=np.int64) for k in range(len(by_name))]
    if have_inst:
        inst = [inst[i] for i in by_name]
    return InstanceSet(kind="images", bag_ids=np.concatenate(ids), bag_names=names,
                       bag_labels=np.asarray(bag_labels, dtype=np.int64),
                       instance_labels=np.concatenate(inst) if have_inst else None,
                       store_paths=[str(p) for p in used], bag_sources=sources,
                       local_index=np.concatenate(local),
                       settings=settings or {}, source=_several(used))


def _several(paths: list) -> str:
    """An instance set's ``source`` (the start of its errors): its first three files, and how many more (review CS:
    an error about the whole set named one store as if it were the cause)."""
    shown = ", ".join(str(p) for p in paths[:3])
    return shown + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def _unreadable_message(errors: list[str], n: int, what: str) -> str:
    """One error naming every input that cannot be read (``errors``: each one's own message, which names it
    and its fix), so that a folder with several damaged files is mended in one go."""
    if len(errors) == 1:
        return errors[0]
    return (f"{len(errors)} of {n} {what} cannot be read; nothing was trained. Mend or remove each (its own fix "
            "follows):\n" + "\n".join(f"  - {e}" for e in errors))


def _plain_attr(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, bytes):
        return value.decode()
    return value


# ----------------------------------------------------------------------------------------------
# Batches
# ----------------------------------------------------------------------------------------------

#: The most patch stores a process keeps open while training (each holds a file handle and up to about 1 MB of
#: chunk cache). Training shuffles blocks of patches across every store, so with more stores than this open a
#: batch reopens stores (review BK: 3 opens per batch of 64 at 270 stores with 64 open, reads 3-4x slower); 512
#: holds CAMELYON16's 270 training slides.
MAX_OPEN_STORES = 512


def _open_file_limit() -> int | None:
    """The soft limit on open files (``ulimit -n``), None when unknown or unlimited."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY or soft <= 0 else int(soft)


def max_open_stores() -> int:
    """How many patch stores one reader process keeps open: :data:`MAX_OPEN_STORES`, or fewer when the
    soft limit on open files (``ulimit -n``) is low (a quarter of it, leaving the rest to the reader
    processes' pipes, torch and the slides), at least 4."""
    soft = _open_file_limit()
    return MAX_OPEN_STORES if soft is None else max(4, min(MAX_OPEN_STORES, soft // 4))


def reopened_stores_warning(n_stores: int) -> str | None:
    """Why reads will be slow when training reads ``n_stores`` patch stores but the open-file limit lets a reader
    keep fewer open (:func:`max_open_stores`), with the fix; None when they fit, or when the limit is not why."""
    cap, soft = max_open_stores(), _open_file_limit()
    if n_stores <= cap or soft is None or cap >= MAX_OPEN_STORES:
        return None
    return (f"training reads {n_stores} patch stores, but the open-file limit (`ulimit -n` {soft}) lets each reader "
            f"keep {cap} open, so batches that move between stores close and open them again (reads about 3x "
            f"slower). Fix: raise the limit before training, e.g. `ulimit -n {4 * min(n_stores, MAX_OPEN_STORES)}`.")


def _close_store(store) -> None:
    close = getattr(store, "close", None)
    if close is not None:
        close()


class PatchDataset(torch.utils.data.Dataset):
    """Patches of an image InstanceSet, fetched a whole batch at a time.

    ``dataset[batch]`` with ``batch`` a sequence of instance indices returns ``(indices int64 (B,),
    patches uint8 (B, H, W, 3))``. Stores open lazily in each process, so the dataset is safe in
    DataLoader worker processes (no handle crosses a fork); at most :func:`max_open_stores` stay open
    per process (the least recently used is closed), so a large cohort does not run out of file handles.
    """

    def __init__(self, instances: InstanceSet) -> None:
        if instances.kind != "images":
            raise ValueError("PatchDataset needs an image InstanceSet (from read_patch_stores).")
        self.store_paths = list(instances.store_paths or [])
        self.bag_ids = instances.bag_ids
        self.local_index = instances.local_index
        self._pid: int | None = None
        self._stores: dict[int, object] = {}  # open stores, least recently used first
        self.max_open: int | None = None  # at most this many stores open per process (None: max_open_stores())
        self._pixel_kinds: dict[int, object] = {}

    def __len__(self) -> int:
        return int(self.bag_ids.shape[0])

    def _store(self, bag: int):
        if self._pid != os.getpid():
            self._stores = {}  # the parent's handles: never closed here (they are the parent's)
            self._pid = os.getpid()
        store = self._stores.pop(bag, None)
        if store is None:
            from wsi_milssl.store import open_store

            cap = self.max_open if self.max_open is not None else max_open_stores()
            while len(self._stores) >= max(cap, 1):  # close the least recently used (a cohort of 1,000+ slides
                _close_store(self._stores.pop(next(iter(self._stores))))  # would exhaust `ulimit -n`)
            store = open_store(self.store_paths[bag])
            if hasattr(store, "__enter__"):
                store = store.__enter__()
        self._stores[bag] = store  # (re)inserted last: the dict's order is least to most recently used
        return store

    def _pixels(self, bag: int):
        """The pixel encoding of bag ``bag``'s store (remembered, so it is not reopened to ask)."""
        if bag not in self._pixel_kinds:
            self._pixel_kinds[bag] = getattr(self._store(bag), "pixels", None)
        return self._pixel_kinds[bag]

    def __getitem__(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fetch(batch)

    def fetch(self, batch, *, encoded: bool = False) -> tuple[torch.Tensor, torch.Tensor | list[torch.Tensor]]:
        """``(indices int64 (B,), patches uint8 (B, H, W, 3))`` for instance indices ``batch``; with
        ``encoded`` and JPEG stores, the patches as a list of uint8 (n_bytes,) JPEG tensors instead.

        Each store is read once per call, in ascending store order (runs of consecutive patches are
        single slice reads), and the result is put back in the order of ``batch``.
        """
        idx = np.asarray(batch, dtype=np.int64).reshape(-1)
        bags = self.bag_ids[idx]
        groups = []
        for bag in np.unique(bags):
            pos = np.flatnonzero(bags == bag)
            local = self.local_index[idx[pos]]
            order = np.argsort(local, kind="stable")
            groups.append((int(bag), pos[order], local[order]))
        # each store is fetched again right before its read: a batch may span more stores than stay open
        if encoded and groups and all(self._pixels(bag) == "jpeg" for bag, _, _ in groups):
            data: list = [None] * idx.size
            for bag, pos, local in groups:
                for p, b in zip(pos.tolist(), self._store(bag).read_jpeg(local)):
                    data[p] = torch.from_numpy(np.frombuffer(b, dtype=np.uint8).copy())
            return torch.from_numpy(idx), data
        out: np.ndarray | None = None
        for bag, pos, local in groups:
            pix = np.asarray(self._store(bag).read_patches(local))
            if out is None:
                out = np.empty((idx.size,) + pix.shape[1:], dtype=np.uint8)
            out[pos] = pix
        if out is None:  # an empty batch
            return torch.from_numpy(idx), torch.zeros((0, 1, 1, 3), dtype=torch.uint8)
        return torch.from_numpy(idx), torch.from_numpy(out)

    def close(self) -> None:
        for store in self._stores.values():
            _close_store(store)
        self._stores = {}

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_stores"] = {}
        state["_pid"] = None
        return state


def iterate_batches(instances: InstanceSet, order: torch.Tensor | np.ndarray, *, batch_size: int,
                    num_workers: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(indices int64 (B,), inputs)`` over ``order`` (instance indices) in batches, once.

    Inputs are float32 (B, D) features, or uint8 (B, H, W, 3) patches decoded (by ``num_workers``
    reader processes when > 0; in order, so the result does not depend on the worker count). A run with
    several passes uses one :class:`wsi_milssl.mil.loader.BatchLoader` instead (its readers live on).
    """
    from wsi_milssl.mil.loader import BatchLoader

    with BatchLoader([instances], num_workers=num_workers) as loader:
        yield from loader.batches(instances, order, batch_size=batch_size)
