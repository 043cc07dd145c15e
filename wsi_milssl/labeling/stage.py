"""The label stage: annotations -> exact tumour fraction and instance label per patch, slide label,
tumour mask to view (not read by ``evaluate``).

For every patch store: tumour fraction = area((∪ tumour) − (∪ non-tumour) ∩ patch square) /
patch area, computed exactly (``wsi_milssl.annotations.tumor_fraction``); ``instance_label`` =
fraction >= ``positive_fraction`` (0.25, the paper's rule); ``slide_label`` from ``labels.csv``,
else 1 when the slide has a tumour polygon. Written into the store with ``write_arrays`` (all or
nothing) together with provenance attributes:

==========================  =====  ==========================================================
attribute                   type   meaning
==========================  =====  ==========================================================
``slide_label``             int    0 normal, 1 tumour
``slide_label_source``      str    ``labels.csv`` or ``annotations``
``label_status``            str    ``annotated`` (fractions from polygons), ``negative`` (normal
                                   slide without annotations: all 0) or ``unannotated`` (tumour
                                   slide without annotations: no per-patch labels written)
``positive_fraction``       float  the instance-label threshold used
``label_annotation``        str    annotation file used ('' when none)
``label_annotation_sha256`` str    its SHA-256 ('' when none)
``label_config_hash``       str    hash of positive_fraction and the group mapping
``n_positive_patches``      int    patches with instance_label 1
==========================  =====  ==========================================================

Instance labels are for evaluation only; training never reads them. Every input is read and
every number computed before anything is written, so a malformed or hostile annotation file
leaves the store untouched.

A batch (:func:`label_stores`) holds the lock of its output folder and of the folders of the stores it
rewrites (refused while ``tile`` or another ``label`` writes them; temporaries that a killed run left
there are removed; a stores folder that cannot be written is not locked, and its stores that must be
rewritten fail), and skips stores already labelled with the same settings, annotation file (name and
SHA-256, in whatever folder) and slide label whose mask is there (status ``skipped``). When only the mask
differs (``mask_downsample`` changed, ``write_masks`` turned on, the mask deleted) the mask alone is
written and the store is left untouched (status ``mask``): a rewritten store makes every heatmap predict
its slide again. Masks of earlier runs are left in place when ``write_masks`` is turned off. Shard I of N (``shard=(I, N)``:
``--shard I/N`` or a torchrun rank) labels its share of the stores
(:func:`wsi_milssl.distributed.shard_items`); the shards of one run may write one output folder at once,
and their ``label_status.csv`` rows merge, sorted by slide as one run writes them.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from wsi_milssl.annotations import find_annotation, list_annotation_files, rasterize_region, read_annotations
from wsi_milssl.annotations.geometry import tumor_fraction
from wsi_milssl.annotations.groups import groups_hiding_the_tumour
from wsi_milssl.atomic import merge_csv_rows
from wsi_milssl.cohorts import read_labels
from wsi_milssl.cohorts.names import name_key
from wsi_milssl.config.base import config_hash, config_to_dict, write_resolved_config
from wsi_milssl.config.label import LabelConfig
from wsi_milssl.distributed import Shard, is_main_rank, shard_items
from wsi_milssl.errors import AnnotationError, ConfigError, OutputError, StoreError, WsiMilsslError
from wsi_milssl.events import ProgressCallback, ProgressEvent, emit
from wsi_milssl.hashing import file_sha256
from wsi_milssl.labeling.masks import eval_mask_paths, write_eval_mask
from wsi_milssl.locks import folder_lock
from wsi_milssl.store import find_stores, open_store, schema, write_arrays

__all__ = [
    "LabelResult",
    "LabelReport",
    "patch_labels",
    "label_store",
    "label_stores",
    "label_config_hash",
    "STATUS_CSV",
    "CONFIG_JSON",
]

logger = logging.getLogger(__name__)

STATUS_CSV = "label_status.csv"
CONFIG_JSON = "label_config.json"
STATUS_COLUMNS = ("slide", "store", "status", "label_status", "n_patches", "n_positive", "slide_label",
                  "slide_label_source", "annotation", "mask", "error")


@dataclass(frozen=True)
class LabelResult:
    """What happened to one store. ``status`` is ``ok`` (labelled), ``skipped`` (already labelled with the
    same settings, annotation and slide label; nothing written), ``mask`` (already labelled so; only its mask
    written, the store untouched) or ``failed`` (then ``error`` says why)."""

    stem: str
    store_path: Path
    status: str
    label_status: str = ""
    n_patches: int = 0
    n_positive: int = 0
    slide_label: int | None = None
    slide_label_source: str = ""
    annotation_path: Path | None = None
    mask_path: Path | None = None
    error: str = ""


@dataclass(frozen=True)
class LabelReport:
    """Results of ``label_stores`` and the name mismatches found on the way.

    ``unmatched_annotations``: annotation files whose stem matches no store;
    ``stores_without_annotation``: stems of stores without an annotation file (normal slides are
    expected here); ``unannotated_tumor_slides``: tumour-labelled stores without annotations;
    ``stores_missing_from_labels``: stems absent from labels.csv (label taken from annotations).
    """

    results: list[LabelResult]
    unmatched_annotations: list[Path] = field(default_factory=list)
    stores_without_annotation: list[str] = field(default_factory=list)
    unannotated_tumor_slides: list[str] = field(default_factory=list)
    stores_missing_from_labels: list[str] = field(default_factory=list)
    status_csv: Path | None = None

    @property
    def n_failed(self) -> int:
        return sum(r.status == "failed" for r in self.results)


#: LabelConfig settings that shape the evaluation masks alone, not the stores' labels
_MASK_ONLY_FIELDS = ("mask_downsample", "write_masks")


def _check_shard_settings(out: Path, config: LabelConfig) -> None:
    """ConfigError when ``out``'s label_config.json, written by another shard of the run, records other settings
    than this shard's (review DA: shards given two --positive-fraction values labelled the stores of one training
    set two ways, and the record named one)."""
    from wsi_milssl.locks import folder_settings_record

    path = out / CONFIG_JSON
    recorded = folder_settings_record(path, error=ConfigError)
    if recorded is None:
        return
    ours = json.loads(json.dumps(config_to_dict(config)))
    diffs = [f"{k} {recorded.get(k)!r}, this shard's {v!r}" for k, v in sorted(ours.items())
             if recorded.get(k) != v
             and k not in _MASK_ONLY_FIELDS]  # masks of other settings label nothing otherwise (review DT)
    if diffs:
        raise ConfigError(f"{path}: another shard of this run labels with other settings ({'; '.join(diffs)}); the "
                          "shards of one run must use the same settings, or the stores would be labelled two ways. "
                          "Fix: give every shard the same settings (or, when no other shard is running, pass "
                          "--overwrite to label this shard's stores again).")


def label_config_hash(config: LabelConfig) -> str:
    """Hash of the settings that decide the stored per-patch labels (not the mask settings)."""
    return config_hash(config, exclude=_MASK_ONLY_FIELDS)


def patch_labels(
    region,
    coords_lv0: np.ndarray,
    patch_size_lv0: float,
    *,
    positive_fraction: float = 0.25,
) -> tuple[np.ndarray, np.ndarray]:
    """(tumor_fraction float32 (N,), instance_label uint8 (N,)) of square patches.

    ``region``: shapely geometry in level-0 px (tumour minus non-tumour); ``coords_lv0``: int (N, 2)
    top-left (x, y); a patch is positive when its float32 fraction >= ``positive_fraction``.
    """
    fraction = tumor_fraction(region, coords_lv0, patch_size_lv0)
    labels = (fraction >= np.float32(positive_fraction)).astype(np.uint8)
    return fraction, labels


def _dimensions(store, attrs: dict) -> tuple[int, int]:
    dims = attrs.get("dimensions_lv0")
    if isinstance(dims, (list, tuple)) and len(dims) == 2:
        return int(dims[0]), int(dims[1])
    try:
        from wsi_milssl.slide import open_slide

        with open_slide(store.slide_path) as slide:
            width, height = slide.dimensions
        return int(width), int(height)
    except WsiMilsslError as exc:
        raise StoreError(
            f"{store.path}: the store has no dimensions_lv0 attribute and its slide cannot be opened ({exc}); "
            "re-run `wsi-milssl tile` for this slide."
        ) from None


def _refuse_hidden_tumour(aset, annotation: Path, stem: str, config: LabelConfig) -> None:
    """Raise AnnotationError when a slide that is (or would be read as) tumour has no tumour polygon because its
    polygons are in groups that may be the tumour (:func:`~wsi_milssl.annotations.groups.groups_hiding_the_tumour`):
    labelling it would give a tumour slide no positive patch, or read it as normal."""
    why = groups_hiding_the_tumour((a.group for a in aset.polygons), aset.group_map)
    if why is None:
        return
    raise AnnotationError(
        f"{annotation}: no polygon of {stem} is in a tumour group ({', '.join(config.tumor_groups)}); {why}, so "
        "labelling would give this slide no tumour patch. Fix: name the tumour group(s) with --tumor-groups "
        "(and the others with --non-tumor-groups; in a pipeline, [label] tumor_groups / non_tumor_groups), or "
        "correct the annotation file.")


@dataclass(frozen=True)
class _SlideLabels:
    """What one store's labels are made from: read and checked before anything is written."""

    stem: str
    coords: np.ndarray
    patch_size_lv0: float
    dims: tuple[int, int]
    mpp: object
    region: object
    label: int
    source: str
    status: str
    annotation: Path | None


def _read_slide(store_path: Path, annotation: Path | None, slide_label: int | None,
                config: LabelConfig) -> _SlideLabels:
    """Read the store and the annotation file, and decide the slide label and label status (AnnotationError,
    StoreError for bad input)."""
    with open_store(store_path) as store:
        attrs = store.attrs
        stem = store.stem
        coords = store.coords
        patch_size_lv0 = store.patch_size_lv0
        dims = _dimensions(store, attrs)

    aset = None
    region = None
    if annotation is not None:
        aset = read_annotations(annotation, group_map=config.group_map(), dimensions_lv0=dims)
        region = aset.region  # parses geometry now: errors and warnings before anything is written
    has_tumor = aset is not None and aset.has_tumor

    if slide_label is None:
        label, source = int(has_tumor), "annotations"
    else:
        label, source = int(slide_label), "labels.csv"
    if aset is not None and not has_tumor and (label == 1 or source == "annotations"):
        _refuse_hidden_tumour(aset, annotation, stem, config)
    if aset is not None:
        status = "annotated"
        if label == 0 and has_tumor:
            logger.warning("%s: labels.csv says normal (0) but %s has tumour polygons; keeping slide label 0 and "
                           "the patch fractions from the polygons.", stem, annotation)
        elif label == 1 and not has_tumor:
            logger.warning("%s: tumour-labelled slide, but %s has no tumour polygon in groups %s; every patch "
                           "gets fraction 0.", stem, annotation, ", ".join(config.tumor_groups))
    elif label == 0:
        status = "negative"
    else:
        status = "unannotated"
        logger.warning("%s: tumour-labelled slide without annotations: slide label 1 written, but no per-patch "
                       "tumour fractions or instance labels (instance metrics will skip this slide). Add "
                       "%s.xml or %s.geojson to the annotation folder to label its patches.", stem, stem, stem)
    return _SlideLabels(stem=stem, coords=coords, patch_size_lv0=patch_size_lv0, dims=dims, mpp=attrs.get("mpp"),
                        region=region, label=label, source=source, status=status, annotation=annotation)


def _write_mask(slide: _SlideLabels, store_path: Path, config: LabelConfig, mask_dir: Path | None,
                annotation_sha256: str) -> Path | None:
    """Write the slide's tumour mask (to view and check the labels by) and its sidecar into ``mask_dir``;
    None (nothing written) without a ``mask_dir``, with ``write_masks`` off, or for an unannotated tumour
    slide."""
    if mask_dir is None or not config.write_masks or slide.status == "unannotated":
        return None
    mask = rasterize_region(slide.region, dimensions_lv0=slide.dims, downsample=config.mask_downsample)
    return write_eval_mask(
        mask, mask_dir, slide.stem, downsample=config.mask_downsample, dimensions_lv0=slide.dims,
        meta={
            "mpp": float(slide.mpp) if isinstance(slide.mpp, (int, float)) else None,
            "slide_label": slide.label,
            "annotation": str(slide.annotation) if slide.annotation is not None else None,
            "annotation_sha256": annotation_sha256 or None,
            "tumor_groups": list(config.tumor_groups),
            "non_tumor_groups": list(config.non_tumor_groups),
            "store": str(store_path),
        },
    )


def label_store(
    store_path: str | os.PathLike,
    *,
    annotation_path: str | os.PathLike | None,
    slide_label: int | None = None,
    config: LabelConfig = LabelConfig(),
    mask_dir: str | os.PathLike | None = None,
) -> LabelResult:
    """Label one store; see the module docstring. ``slide_label`` None takes it from the annotations.

    ``mask_dir``: folder for the tumour mask, to check the labels by (none written when None or
    ``config.write_masks`` is False). Raises AnnotationError/StoreError for bad input; the store is then unchanged.
    """
    store_path = Path(store_path)
    annotation = Path(annotation_path) if annotation_path is not None else None
    slide = _read_slide(store_path, annotation, slide_label, config)

    arrays: dict[str, np.ndarray] = {}
    n_positive = 0
    if slide.status != "unannotated":
        fraction, labels = patch_labels(slide.region, slide.coords, slide.patch_size_lv0,
                                        positive_fraction=config.positive_fraction)
        arrays = {schema.TUMOR_FRACTION: fraction, schema.INSTANCE_LABEL: labels}
        n_positive = int(labels.sum())

    sha = file_sha256(annotation) if annotation is not None else ""
    new_attrs = {
        "slide_label": slide.label,
        "slide_label_source": slide.source,
        "label_status": slide.status,
        "positive_fraction": float(config.positive_fraction),
        "label_annotation": str(annotation) if annotation is not None else "",
        "label_annotation_sha256": sha,
        "label_config_hash": label_config_hash(config),
        "n_positive_patches": n_positive,
    }
    mask_path = _write_mask(slide, store_path, config, Path(mask_dir) if mask_dir is not None else None, sha)

    write_arrays(store_path, arrays, attrs=new_attrs)
    logger.info("%s: %d/%d positive patches (slide label %d from %s)", slide.stem, n_positive, len(slide.coords),
                slide.label, slide.source)
    return LabelResult(
        stem=slide.stem, store_path=store_path, status="ok", label_status=slide.status,
        n_patches=len(slide.coords), n_positive=n_positive, slide_label=slide.label, slide_label_source=slide.source,
        annotation_path=annotation, mask_path=mask_path,
    )


def _write_mask_only(labelled: LabelResult, slide_label: int | None, config: LabelConfig,
                     mask_dir: Path) -> LabelResult:
    """The mask of a store whose labels are up to date, written without touching the store (status ``mask``):
    a rewritten store would make every heatmap predict its slide again for a setting of the masks alone."""
    slide = _read_slide(labelled.store_path, labelled.annotation_path, slide_label, config)
    sha = file_sha256(labelled.annotation_path) if labelled.annotation_path is not None else ""
    mask_path = _write_mask(slide, labelled.store_path, config, mask_dir, sha)
    logger.info("%s: labels up to date; only its mask written again (%s)", labelled.stem, mask_path)
    return replace(labelled, status="mask", mask_path=mask_path)


def _store_stem(path: Path) -> str:
    name = path.name.rstrip("/")
    fmt = schema.format_of(name)
    return name[: -len(schema.FORMAT_SUFFIXES[fmt])] if fmt else path.stem


def _check_one_store_per_slide(paths: list[Path]) -> None:
    """ConfigError when two of ``paths`` are stores of one slide (``X.h5`` and ``X.zarr`` after a
    re-tile in the other format; stems matched as every stage matches them): both would be labelled
    and one row of ``label_status.csv`` kept."""
    seen: dict[str, Path] = {}
    for path in paths:
        first = seen.setdefault(name_key(_store_stem(path)), path)
        if first != path:
            raise ConfigError(f"stores {first} and {path} are both for slide {_store_stem(first)!r}; pass one "
                              "(give its path, or move the other to another folder).")


def _store_folders(stores: list[str | os.PathLike]) -> list[Path]:
    """The folders whose stores a batch rewrites: every folder given, and the folder of every store given
    (those that exist, once each)."""
    folders: dict[str, Path] = {}
    for item in stores:
        path = Path(item)
        folder = path.parent if schema.format_of(path) else path
        if folder.is_dir():
            folders.setdefault(os.path.realpath(folder), folder)
    return [folders[key] for key in sorted(folders)]


def _status_row(r: LabelResult) -> dict[str, str]:
    values = (r.stem, r.store_path, r.status, r.label_status, r.n_patches, r.n_positive,
              "" if r.slide_label is None else r.slide_label, r.slide_label_source, r.annotation_path or "",
              r.mask_path or "", r.error)
    return dict(zip(STATUS_COLUMNS, (str(v) for v in values)))


def _merge_status_csv(results: Sequence[LabelResult], out_dir: Path) -> Path:
    """Add or replace the rows of ``results`` in ``label_status.csv``, keeping other stores' rows (other
    shards, earlier runs), sorted by slide."""
    return merge_csv_rows(out_dir / STATUS_CSV, [_status_row(r) for r in results], columns=STATUS_COLUMNS)


def _already_labelled(store_path: Path, stem: str, *, annotation: Path | None, slide_label: int | None,
                      config: LabelConfig, mask_dir: Path | None) -> tuple[LabelResult, bool] | None:
    """(the result of an earlier run that labelled this store exactly as this one would: same label
    settings, annotation file name and SHA-256 and slide label; whether its mask is up to date too: not
    wanted, or there with the same downsample and groups for this store), or None when the store must be
    labelled (again). Files are compared by name and content, not by folder, so a cohort moved as a whole
    (stores, annotations and masks together) is not labelled again: a rewritten store would make every
    heatmap predict again. So a mask that is missing or differs (``mask_downsample``, ``write_masks``
    turned on) is written alone, not the store."""
    try:
        with open_store(store_path) as store:
            attrs = store.attrs
            n = len(store)
            has_arrays = store.has(schema.TUMOR_FRACTION) and store.has(schema.INSTANCE_LABEL)
    except (WsiMilsslError, OSError):
        return None  # label_store reports it
    status = attrs.get("label_status")
    sha = file_sha256(annotation) if annotation is not None else ""
    expected_source = "annotations" if slide_label is None else "labels.csv"
    if (attrs.get("label_config_hash") != label_config_hash(config)
            or Path(attrs.get("label_annotation") or "").name != (annotation.name if annotation is not None else "")
            or attrs.get("label_annotation_sha256") != sha
            or attrs.get("slide_label_source") != expected_source
            or (slide_label is not None and attrs.get("slide_label") != int(slide_label))
            or status not in ("annotated", "negative", "unannotated")
            or (status != "unannotated" and not has_arrays)):
        return None
    result = LabelResult(
        stem=stem, store_path=store_path, status="skipped", label_status=status, n_patches=n,
        n_positive=int(attrs.get("n_positive_patches", 0)), slide_label=int(attrs["slide_label"]),
        slide_label_source=expected_source, annotation_path=annotation,
    )
    if mask_dir is None or not config.write_masks or status == "unannotated":
        return result, True
    png, sidecar = eval_mask_paths(mask_dir, stem)
    try:
        meta = json.loads(sidecar.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return result, False
    if (not png.is_file() or not isinstance(meta, dict) or meta.get("downsample") != config.mask_downsample
            or Path(meta.get("store") or "").name != store_path.name
            or (meta.get("annotation_sha256") or "") != sha
            or meta.get("slide_label") != attrs.get("slide_label")
            or meta.get("tumor_groups") != list(config.tumor_groups)
            or meta.get("non_tumor_groups") != list(config.non_tumor_groups)):
        return result, False
    return replace(result, mask_path=png), True


def _names(items: Sequence[str]) -> str:
    return ", ".join(items[:20]) + (f" and {len(items) - 20} more" if len(items) > 20 else "")


def label_stores(
    stores: str | os.PathLike | Iterable[str | os.PathLike],
    *,
    annotations_dir: str | os.PathLike,
    labels_csv: str | os.PathLike | None = None,
    config: LabelConfig = LabelConfig(),
    out_dir: str | os.PathLike | None = None,
    progress: ProgressCallback | None = None,
    shard: tuple[int, int] | Shard = (0, 1),
    overwrite: bool = False,
    other_stems: Iterable[str] = (),
) -> LabelReport:
    """Label every store in ``stores`` (store paths or folders of stores).

    Annotation files are matched by name: store ``DIR/<stem>.h5`` takes ``<stem>.xml``,
    ``<stem>.geojson`` or ``<stem>.json`` from ``annotations_dir``. ``out_dir`` (default: a
    ``labels`` folder beside the first store) receives the tumour masks (to view and check the labels by;
    ``evaluate`` does not read them), ``label_status.csv``
    (a row per store, added after each store, rows of other stores kept, sorted by slide) and
    ``label_config.json``. A store that fails (bad annotation file, unreadable store) is reported
    with status ``failed`` and left unchanged; the others go on. Two stores of one slide (``X.h5`` and
    ``X.zarr``) raise ConfigError naming both.

    Stores already labelled exactly as this run would label them are skipped (status ``skipped``)
    unless ``overwrite``; when only their mask is missing or was made with other mask settings, the mask
    alone is written (status ``mask``) and the store is not rewritten. ``shard`` = (I, N): label only shard I of N of the stores (by the hash of
    the slide's stem; a :class:`~wsi_milssl.distributed.Shard` with ``by='position'``, torchrun's
    ranks: every N-th store, sorted by path, from the I-th; see
    :func:`wsi_milssl.distributed.shard_items`); the locks of the output folder and of the stores'
    folders (FolderLockedError while another run writes one: a ``tile`` still writing the stores, another
    ``label`` of them) are held as that shard, so the N shards may write them at once. Taking the lock
    of a stores folder removes the temporaries killed runs left there (a killed ``label``'s copy of a store).
    A stores folder that cannot be written (read-only file system, no write permission) is not locked:
    nobody who cannot write there rewrites anything in it. Its stores already labelled are skipped; one
    that must be rewritten fails, naming the folder and the fix.

    ``other_stems``: the slides of another set that shares ``annotations_dir`` (a pipeline's one annotations
    folder for its train and test sets): their annotation files are not reported as matching no store.
    Returns a :class:`LabelReport` (one result per store, and the names that did not match).
    """
    stores = [stores] if isinstance(stores, (str, os.PathLike)) else list(stores)
    with ExitStack() as locks:
        # first: a tile still writing them is named, not half its stores
        unwritable = _lock_store_folders(locks, stores, shard)
        paths = find_stores(stores)
        if not paths:
            raise StoreError(f"no patch stores found in {', '.join(str(s) for s in stores)}; run `wsi-milssl tile` "
                             "first or check the paths.")
        _check_one_store_per_slide(paths)
        annotations_dir = Path(annotations_dir)
        labels = read_labels(labels_csv) if labels_csv is not None else None
        if annotations_dir.is_dir() and not os.access(annotations_dir, os.R_OK):  # mode 711 (review CB)
            logger.warning("%s: cannot list this folder (permission denied): each store's annotation file is opened "
                           "by its name (<stem>.xml, .geojson, .json), and files that match no store are not "
                           "reported.", annotations_dir)
            ann_files = []
        else:
            ann_files = list_annotation_files(annotations_dir)  # raises when the folder is missing
        out = Path(out_dir) if out_dir is not None else paths[0].parent / "labels"
        locks.enter_context(folder_lock(out, shard=shard))  # re-entrant when out is a stores folder
        return _label_stores_locked(paths, annotations_dir, labels, labels_csv, ann_files, config, out, progress,
                                    shard=shard, overwrite=overwrite, unwritable=unwritable,
                                    other_stems=other_stems)


#: why a folder cannot be written at all (not a full disk, which freeing space mends during the run)
_UNWRITABLE_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)


def _lock_store_folders(locks: ExitStack, stores: list[str | os.PathLike],
                        shard: tuple[int, int] | Shard) -> dict[str, int]:
    """Enter the lock of every folder whose stores the batch may rewrite into ``locks``; returns the folders
    that cannot be written (read-only file system, no permission), by real path, with the errno. Those are
    not locked: whoever cannot write there rewrites nothing, so the lock protects nothing (and label, run
    again on stores already labelled, reads them only)."""
    unwritable = {}
    for folder in _store_folders(stores):
        try:
            locks.enter_context(folder_lock(folder, shard=shard, named_by=None))
        except OutputError as exc:
            if exc.errno not in _UNWRITABLE_ERRNOS:
                raise
            logger.info("%s: this stores folder cannot be written (%s): not locked; stores that must be "
                        "rewritten fail", folder, os.strerror(exc.errno))
            unwritable[os.path.realpath(folder)] = exc.errno
    return unwritable


def _unwritable_store_error(path: Path, code: int) -> StoreError:
    folder = path.parent
    return StoreError(
        f"{path}: cannot label this store: label writes the labels into the store, and its folder {folder} cannot "
        f"be written ({os.strerror(code)}). Fix: make {folder} writable (remount it read-write, or get write "
        "permission), or copy the stores to a writable folder and label the copy.")


def _label_stores_locked(paths: list[Path], annotations_dir: Path, labels, labels_csv, ann_files: list[Path],
                         config: LabelConfig, out: Path, progress: ProgressCallback | None, *,
                         shard: tuple[int, int] | Shard, overwrite: bool, unwritable: dict[str, int],
                         other_stems: Iterable[str] = ()) -> LabelReport:
    sharded = (int(shard[0]), int(shard[1])) if int(shard[1]) > 1 and not overwrite else None
    write_resolved_config(config, out, name=CONFIG_JSON)
    stems = [_store_stem(p) for p in paths]
    stem_keys = {name_key(s) for s in stems}
    elsewhere = {name_key(s) for s in other_stems}  # another set's slides, in a shared annotations folder
    unmatched = [p for p in ann_files if name_key(p.stem) not in stem_keys | elsewhere]
    mine = shard_items(list(zip(paths, stems)), *shard, name=lambda path_stem: path_stem[1])
    without_ann: list[str] = []
    unannotated_tumor: list[str] = []
    missing_labels: list[str] = []
    results: list[LabelResult] = []
    emit(progress, ProgressEvent("label", 0, len(mine), unit="slide"))
    for k, (path, stem) in enumerate(mine):
        slide_label = None
        if labels is not None:
            slide_label = labels.get(stem)
            if slide_label is None:
                missing_labels.append(stem)
        ann = None
        try:
            # two annotation files of the slide that disagree fail this slide, not the batch
            ann = find_annotation(stem, annotations_dir)
            if ann is None:
                without_ann.append(stem)
                if slide_label == 1:
                    unannotated_tumor.append(stem)
            found = None if overwrite else _already_labelled(path, stem, annotation=ann, slide_label=slide_label,
                                                             config=config, mask_dir=out)
            if found is None and os.path.realpath(path.parent) in unwritable:
                raise _unwritable_store_error(path, unwritable[os.path.realpath(path.parent)])
            if found is None:
                result = label_store(path, annotation_path=ann, slide_label=slide_label, config=config,
                                     mask_dir=out)
            elif not found[1]:  # the store's labels are up to date: its mask alone is written
                result = _write_mask_only(found[0], slide_label, config, out)
            else:
                result = found[0]
                logger.info("%s: already labelled with these settings; skipped", stem)
        except (WsiMilsslError, OSError) as exc:
            error = str(exc)
            if isinstance(exc, PermissionError) and exc.filename:  # an annotation file others may not read (review CB)
                error = (f"{exc.filename}: cannot read this file (permission denied). Fix: ask its owner for read "
                         "access, or move it out of the annotations folder.")
            logger.error("%s: labelling failed: %s", stem, error)
            result = LabelResult(stem=stem, store_path=path, status="failed", annotation_path=ann, error=error)
        results.append(result)
        try:
            _merge_status_csv([result], out)
        except WsiMilsslError as exc:  # a full disk: the batch goes on; the final write reports it
            logger.warning("%s", exc)
        emit(progress, ProgressEvent("label", k + 1, len(mine), unit="slide", item=stem))

    if unmatched and is_main_rank():  # about the whole folder: torchrun's rank 0 alone says it (a --shard task, whose
        # log is its own, says it too)
        logger.warning("%d annotation file(s) in %s match no store (names must be <store stem>.xml/.geojson): %s",
                       len(unmatched), annotations_dir, _names([p.name for p in unmatched]))
    if missing_labels:
        logger.warning("%d store(s) are not listed in %s; their slide label comes from the annotations: %s",
                       len(missing_labels), labels_csv, _names(missing_labels))
    if without_ann:
        logger.info("%d store(s) have no annotation file in %s: %s", len(without_ann), annotations_dir,
                    _names(without_ann))
    status_csv = _merge_status_csv(results, out)
    if sharded is not None:  # the folder's lock keeps other runs out: a record of other settings written since this
        # shard's own is another shard's, started at the same moment (not checked at the start: a shard of this run
        # that has not written its record yet leaves an earlier run's there)
        _check_shard_settings(out, config)
    return LabelReport(
        results=results, unmatched_annotations=unmatched, stores_without_annotation=without_ann,
        unannotated_tumor_slides=unannotated_tumor, stores_missing_from_labels=missing_labels,
        status_csv=status_csv,
    )
