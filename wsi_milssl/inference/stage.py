"""The heatmap stage: slides (or their stores) + a trained checkpoint -> maps, overlays and exports.

    from wsi_milssl.config import HeatmapConfig
    from wsi_milssl.inference import make_heatmaps

    run = make_heatmaps(["slides/a.tif"], "runs/r1/best.pt", "heatmaps/", HeatmapConfig())
    run.ok, run.scores_csv      # heatmaps/scores.csv: slide,score

Besides the per-slide files (see :mod:`wsi_milssl.inference.exports`) the folder gets
``heatmap_config.json`` (resolved settings, checkpoint, tiling plan and normalisation, runtime) and
``heatmap_status.csv`` (slide,status,n_patches,score,seconds,error). A slide that fails is recorded
as failed while the others go on; a slide without a single patch is 'empty' and gets no score. Both
lose the files and ``scores.csv`` row an earlier run left for them (they are not this run's). A slide
finished in the folder is skipped when run again with the same checkpoint and settings, and drawn again from
its saved probabilities, without the model, when only drawing settings changed (:data:`DRAWING_FIELDS`) or a
file it writes (the overlay, a viewer file, the detections) was deleted. Slides
are predicted several at a time (:func:`wsi_milssl.inference.predict.predict_many`) and their files are
written by threads while the model goes on; the thread that writes a slide's files writes its ``scores.csv``
and status rows right after them.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import hashlib
import json
import logging
import os
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from wsi_milssl import __version__
from wsi_milssl.artifacts import (HEATMAP_CONFIG_FILENAME, HEATMAP_STATUS_COLUMNS, HEATMAP_STATUS_FILENAME,
                                  HEATMAP_STATUSES, HEATMAP_FILES)
from wsi_milssl.artifacts import SCHEMA_VERSION as ARTIFACTS_SCHEMA_VERSION
from wsi_milssl.atomic import atomic_open, merge_csv_rows
from wsi_milssl.cohorts.names import stem_key
from wsi_milssl.config.base import config_to_dict
from wsi_milssl.config.heatmap import HEATMAP_RUNTIME_ONLY_FIELDS, HeatmapConfig
from wsi_milssl.distributed import Shard, shard_items
from wsi_milssl.errors import CheckpointError, ConfigError, OutputError, StoreError, WsiMilsslError
from wsi_milssl.events import ProgressCallback, ProgressEvent, emit
from wsi_milssl.inference.exports import (
    SCORES_FILENAME,
    lesion_polygons,
    nms_detections,
    ome_downsample,
    output_paths,
    remove_slide_outputs,
    update_scores_csv,
    write_detections_csv,
    write_empty_slide_outputs,
    write_lesions,
    write_patches_csv,
    write_patches_geojson,
    write_probs,
    write_probs_ome_tiff,
)
from wsi_milssl.inference.heatmap import render_overlay, write_png
from wsi_milssl.inference.model import InferenceModel, load_inference_model
from wsi_milssl.inference.predict import SlideInput, SlidePrediction, predict_many, prestart_readers
from wsi_milssl.locks import folder_lock
from wsi_milssl.paths import path_list
from wsi_milssl.runtime import restores_torch_settings
from wsi_milssl.slide.tissue import slide_tissue_mask
from wsi_milssl.tiling import file_fingerprint, slide_stem

__all__ = [
    "CONFIG_FILENAME",
    "STATUS_FILENAME",
    "HeatmapInput",
    "HeatmapResult",
    "HeatmapRun",
    "match_inputs",
    "store_mismatch",
    "checkpoint_sha256",
    "resolved_precision",
    "write_slide_outputs",
    "log_overlays_not_drawn",
    "make_heatmaps",
]

logger = logging.getLogger(__name__)

# The folder's files, as the cross-stage contract (wsi_milssl.artifacts) names them.
CONFIG_FILENAME = HEATMAP_CONFIG_FILENAME
STATUS_FILENAME = HEATMAP_STATUS_FILENAME
STATUS_COLUMNS = HEATMAP_STATUS_COLUMNS
#: the status of a slide's row (:data:`wsi_milssl.artifacts.HEATMAP_STATUSES`)
OK, FAILED, EMPTY = HEATMAP_STATUSES


#: One slide to process (stem, slide file or None, store or None); see :class:`SlideInput`.
HeatmapInput = SlideInput


@dataclass(frozen=True)
class HeatmapResult:
    """Outcome of one slide: ``status`` 'ok', 'failed' (``error`` says why) or 'empty' (no patch passed the
    tissue and entropy filters: no score, and of the files an empty detections CSV alone); ``outputs`` maps
    kind -> written file."""

    slide: str
    slide_path: str
    status: str
    n_patches: int
    score: float | None
    seconds: float
    error: str = ""
    outputs: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class HeatmapRun:
    """Outcome of :func:`make_heatmaps`: per-slide results (input order), the folder's files,
    ``seconds`` from the first slide opened to the last file written, ``skipped``: the slides already
    done with this checkpoint and settings (their results read from the folder, not predicted again), and
    ``redrawn``: those predicted with this checkpoint and settings but drawn with other
    :data:`DRAWING_FIELDS` (or another annotation file to outline, or with some of their files deleted), drawn
    again from their saved probabilities (the model did not run on them)."""

    results: tuple[HeatmapResult, ...]
    out_dir: Path
    status_csv: Path
    config_json: Path
    scores_csv: Path
    seconds: float = 0.0
    skipped: tuple[str, ...] = ()
    redrawn: tuple[str, ...] = ()

    @property
    def n_failed(self) -> int:
        return sum(r.status == FAILED for r in self.results)

    @property
    def n_empty(self) -> int:
        """Slides without a single kept patch (status 'empty', no score)."""
        return sum(r.status == EMPTY for r in self.results)

    @property
    def ok(self) -> bool:
        return all(r.status == OK for r in self.results)


def match_inputs(slides: Sequence[str | os.PathLike], stores: Sequence[str | os.PathLike] | None = None
                 ) -> list[HeatmapInput]:
    """Pair slides with their stores.

    Without ``stores`` every slide is tiled on the fly. With ``stores`` (store paths or folders of
    stores), each slide uses the store of the same stem; without slides, every store is used with the
    slide recorded in it. A store that cannot be opened keeps its file name as the stem and fails its
    slide when it is read (see :func:`store_mismatch`), not the batch. Raises ConfigError for a slide
    without a store, duplicate stems or no input.
    """
    slides = [Path(s) for s in slides]
    if stores is None:
        if not slides:
            raise ConfigError("no slides given; pass slide files or folders (or --store with stores).")
        out = [HeatmapInput(slide_stem(s), s, None) for s in slides]
    else:
        from wsi_milssl.store import find_stores, open_store

        by_stem: dict[str, tuple[Path, Path | None]] = {}
        for sp in find_stores(list(stores)):
            try:
                with open_store(sp) as store:
                    stem = store.stem
                    recorded = Path(store.attrs["slide_path"]) if store.attrs.get("slide_path") else None
            except WsiMilsslError:  # a damaged store fails its slide when it is read, not the batch
                stem, recorded = sp.stem, None
            if stem in by_stem:
                raise ConfigError(f"stores {by_stem[stem][0]} and {sp} are both for slide {stem!r}; pass one.")
            by_stem[stem] = (sp, recorded)
        if not by_stem:
            raise StoreError(f"no patch stores found in {', '.join(str(s) for s in stores)}; run `wsi-milssl tile` "
                             "first or drop --store to tile the slides on the fly.")
        if slides:
            out = [HeatmapInput(slide_stem(s), s, _store_for(s, by_stem, stores)) for s in slides]
        else:
            out = []
            for stem, (sp, recorded) in sorted(by_stem.items()):
                # a recorded slide that is not there is said once, when its PNG is not drawn (write_slide_outputs)
                slide = recorded if recorded is not None and recorded.exists() else None
                out.append(HeatmapInput(stem, slide, sp))
    seen: dict[str, HeatmapInput] = {}
    for item in out:
        if item.stem in seen:
            raise ConfigError(f"slides {seen[item.stem].slide_path} and {item.slide_path} share the name "
                              f"{item.stem!r}, so their outputs would collide. Fix: rename one.")
        seen[item.stem] = item
    return out


def _store_for(slide: Path, by_stem: dict[str, tuple[Path, Path | None]], stores) -> Path:
    """The store of ``slide`` among ``by_stem``: the one of its exact name, else the one whose name matches
    by :func:`~wsi_milssl.cohorts.names.stem_key` (case and Unicode form aside), as every stage matches."""
    stem = slide_stem(slide)
    if stem in by_stem:
        return by_stem[stem][0]
    near = [name for name in by_stem if stem_key(name) == stem_key(stem)]
    if len(near) > 1:
        raise ConfigError(f"{slide}: the stores {', '.join(str(by_stem[n][0]) for n in near)} all match slide "
                          f"{stem!r} (their names differ only in case or Unicode form). Fix: pass the one of this "
                          "slide with --store.")
    if not near:
        names = sorted(by_stem)
        raise ConfigError(
            f"{slide}: no store for slide {stem!r} in {', '.join(str(p) for p in stores)} (stores found: "
            f"{', '.join(names[:5])}{' ...' if len(names) > 5 else ''}). Fix: tile it, or drop --store to tile "
            "slides on the fly.")
    return by_stem[near[0]][0]


def store_mismatch(item: SlideInput, *, slide_mpp: float | None = None) -> WsiMilsslError | None:
    """StoreError when ``item``'s store was not cut from ``item``'s slide (a store of another slide of the
    same name, or of this file before it changed), else None: the slide size in bytes and level-0
    dimensions the store records must match the slide's; where only the size differs and the store was cut
    from this very file (a tool rewrote its metadata, say), the store is used with a warning. A store of an
    earlier version without the size is compared by dimensions; without either, accepted. The error of a store that cannot be opened is returned as it is."""
    if item.store_path is None or item.slide_path is None:
        return None
    from wsi_milssl.slide.reader import open_slide
    from wsi_milssl.store import open_store

    try:
        with open_store(item.store_path) as store:
            attrs = dict(store.attrs)
    except WsiMilsslError as exc:
        return exc
    size, dims = attrs.get("slide_size_bytes"), attrs.get("dimensions_lv0")
    recorded = (None if size is None else int(size), None if dims is None else tuple(int(v) for v in dims))
    fp = file_fingerprint(item.slide_path)
    now_size = None if fp is None else int(fp["size_bytes"])
    now_dims = None
    if recorded[1] is not None:  # the store's µm/px where none is given: a slide without one was tiled with it
        store_mpp = attrs.get("mpp") if isinstance(attrs.get("mpp"), (int, float)) and attrs.get("mpp") > 0 else None
        with open_slide(item.slide_path, mpp_override=slide_mpp if slide_mpp is not None else store_mpp) as slide:
            now_dims = tuple(int(v) for v in slide.dimensions)
    same_size = recorded[0] is None or recorded[0] == now_size
    same_dims = recorded[1] is None or recorded[1] == now_dims
    source = str(attrs.get("slide_path") or "")
    same_file = bool(source) and Path(source).resolve() == Path(item.slide_path).resolve()
    if same_size and same_dims:
        return None
    if same_dims and recorded[1] is not None and same_file:  # this very file, rewritten with its level-0 size
        logger.warning("%s: the file's size changed since %s was tiled (%s -> %s bytes), its level-0 size did "
                       "not; the store is used.", item.slide_path, item.store_path, recorded[0], now_size)
        return None

    def describe(size, dims) -> str:
        parts = [f"{size} bytes" if size is not None else "", f"{dims[0]} x {dims[1]} px" if dims else ""]
        return ", ".join(p for p in parts if p)

    what = ("was cut from this slide before it changed" if same_file else
            f"was cut from another slide of the same name ({source or 'not recorded'})")
    return StoreError(
        f"{item.slide_path}: the store {item.store_path} {what} (then: {describe(*recorded)}; now: "
        f"{describe(now_size, now_dims)}), so its predictions do not belong to this slide. Fix: tile this slide "
        "again (`wsi-milssl tile`), or pass the store tiled from it with --store."
    )


def _read_outlines(stem: str, annotations_dir: Path | None, dims: tuple[int, int], config: HeatmapConfig):
    """The tumour region of the slide's annotation file (with ``config``'s groups), or None."""
    if annotations_dir is None:
        return None
    from wsi_milssl.annotations import find_annotation, read_annotations
    from wsi_milssl.annotations.groups import GroupMap

    path = find_annotation(stem, annotations_dir)
    if path is None:
        return None
    groups = GroupMap(tumor=config.tumor_groups, non_tumor=config.non_tumor_groups)
    try:
        region = read_annotations(path, group_map=groups).with_dimensions(dims).region
    except WsiMilsslError as exc:
        logger.warning("%s: annotations not drawn: %s", stem, exc)
        return None
    return region


def _outline_file(stem: str, slide_path: Any, annotations_dir: str | os.PathLike | None) -> dict | None:
    """The :func:`wsi_milssl.annotations.annotation_version` of the annotation file a slide's overlay outlines
    (None without one, or without the slide file, when no overlay is drawn): recorded in the sidecar, so that an
    annotation file added, edited or removed draws the overlay again."""
    if annotations_dir is None or slide_path is None or not Path(slide_path).exists():
        return None
    from wsi_milssl.annotations import annotation_version, find_annotation

    try:
        path = find_annotation(stem, annotations_dir)
    except WsiMilsslError:
        return None
    return None if path is None else annotation_version(path)


def _given_mpp(pred: SlidePrediction, config: HeatmapConfig) -> float | None:
    """The ``slide_mpp`` that changed how the slide was cut: None without one or when it is the slide's own
    µm/px (within 0.1 %); the value when it differs or the slide records none."""
    if config.slide_mpp is None:
        return None
    from wsi_milssl.slide.reader import open_slide

    try:
        with open_slide(pred.slide_path) as slide:
            native = float(slide.mpp)
    except (WsiMilsslError, OSError, TypeError):
        return float(config.slide_mpp)
    return None if abs(native - config.slide_mpp) <= 1e-3 * native else float(config.slide_mpp)


def write_slide_outputs(pred: SlidePrediction, out_dir: str | os.PathLike, *, model: InferenceModel,
                        config: HeatmapConfig, annotations_dir: str | os.PathLike | None = None,
                        input_files: dict | None = None, fingerprint: str | None = None,
                        checkpoint_sha256: str | None = None, prediction_fingerprint: str | None = None,
                        no_slide: list[str] | None = None) -> dict[str, Path]:
    """Write every per-slide file of ``pred`` into ``out_dir``; returns kind -> path.

    The files are those of :data:`wsi_milssl.artifacts.HEATMAP_FILES`: the map (``.npy``, ``.json``,
    ``.tif`` and the pyramidal OME-TIFF registered to the slide), the patch table and QuPath GeoJSON
    (classified Tumor/Normal at ``config.tumor_threshold``), the predicted lesions (contours of the map
    at the same threshold) as QuPath GeoJSON and ASAP XML, the CAMELYON16 detections and the overlay.
    The overlay needs the slide (``pred.slide_path``); without it the PNG is skipped with a warning. With
    ``no_slide`` (a list the caller says once for its run, :func:`log_overlays_not_drawn`) a slide without a
    slide file (``pred.slide_path`` None: none given or found, as feature files without slides) is appended
    to it, logged at debug level only; a slide file named but not there is warned about in every case.
    ``input_files``: the fingerprints of the slide and store files read (see ``_input_files``), kept in
    the sidecar so that a later run can tell whether the same files are asked for again.
    ``fingerprint``: what made the files (the checkpoint's bytes and the settings, as the folder's
    ``heatmap_config.json`` names it), kept in the sidecar so that a later run reuses the slide only when
    it has the same fingerprint (None: never reused). ``checkpoint_sha256``: the SHA-256 of the checkpoint
    file's bytes (:func:`checkpoint_sha256`), kept in the sidecar with the settings that shape the files
    (``model_name``, ``bag_pooling``, the detection settings, ``target_mpp``, ``patch_size_px`` and the
    model's ``tiling_plan``), so that ``evaluate`` can tell slides of one model and settings from others
    whatever the checkpoint's path or the overlay settings. ``prediction_fingerprint``: what made the
    probabilities alone (the fingerprint without the :data:`DRAWING_FIELDS`), kept in the sidecar with the
    drawing settings (``drawing_settings``) and the tissue mask the overlay is clipped to, so that a later run
    with other drawing settings only draws the slide again from its saved map (None: never drawn again).

    The old ``<stem>_probs.json`` is removed first and the sidecar is written only after every other
    file (the ``.tif`` description holds it without the fingerprint and ``checkpoint_sha256``): a slide
    whose files were only partly rewritten (a killed run) has no sidecar, so a later run predicts it
    again and ``evaluate`` refuses it, instead of taking an earlier run's files for finished outputs.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = output_paths(out_dir, pred.stem)
    paths["probs_json"].unlink(missing_ok=True)
    grid = pred.grid()
    score = pred.score(model.pooling)
    sidecar = {
        "slide": pred.stem,
        "slide_path": None if pred.slide_path is None else str(Path(pred.slide_path).resolve()),
        "origin_lv0": [int(pred.origin_lv0[0]), int(pred.origin_lv0[1])],
        "stride_lv0": int(pred.stride_lv0),
        "patch_size_lv0": int(pred.patch_size_lv0),
        "mpp": float(pred.mpp),
        "shape": [int(grid.shape[0]), int(grid.shape[1])],
        "cell_rule": ("cell (r, c) is the patch with level-0 top-left "
                      "(origin_x + c*stride_lv0, origin_y + r*stride_lv0)"),
        "dimensions_lv0": [int(pred.dimensions_lv0[0]), int(pred.dimensions_lv0[1])],
        "target_mpp": float(pred.target_mpp),
        "patch_size_px": int(pred.patch_size_px),
        "n_patches": len(pred),
        "source": pred.source,
        "store_path": None if pred.store_path is None else str(pred.store_path),
        "input_files": input_files,
        "fingerprint": fingerprint,
        "prediction_fingerprint": prediction_fingerprint,
        "checkpoint_sha256": checkpoint_sha256,
        # absolute (review CN: a relative one, as typed, lost the report's training section when evaluate ran
        # from another folder)
        "checkpoint": None if model.checkpoint_path is None else os.path.abspath(model.checkpoint_path),
        "model_name": model.config.get("model_name"),
        "bag_pooling": model.pooling,
        "score": score,
        "detection_threshold": float(config.detection_threshold),
        "nms_radius_um": float(config.nms_radius_um),
        "tumor_threshold": float(config.tumor_threshold),
        "drawing_settings": _drawing_settings(config),
        "outline_file": _outline_file(pred.stem, pred.slide_path, annotations_dir),
        # the tissue mask the overlay is clipped to (computed again when the slide is drawn again)
        "tissue_detector": str(pred.tissue_detector),
        "mask_mpp": float(pred.mask_mpp),
        # the µm/px given in place of the slide's own, for slides cut on the fly (a store brings its own)
        **({"slide_mpp": _given_mpp(pred, config)} if pred.source == "slide" else {}),
        "ome_downsample": ome_downsample(int(pred.stride_lv0), config.ome_downsample),
        # the tile recipe the patches were chosen with: the model's (with --tissue/--min-tissue/--mask-mpp), or a
        # store's own where it chose them otherwise; None for feature heads
        "tiling_plan": _tiling_plan_used(model, pred),
        "schema_version": ARTIFACTS_SCHEMA_VERSION,
        "package_version": __version__,
    }
    # the .tif's description without the run's identity; the sidecar itself only at the end, after every
    # other file (a run killed among them leaves no sidecar, so the slide counts as unfinished)
    written = dict(write_probs(out_dir, pred.stem, grid, {k: v for k, v in sidecar.items()
                                                         if k not in _RUN_IDENTITY},
                               write_json=False))
    geometry = dict(origin_lv0=pred.origin_lv0, stride_lv0=int(pred.stride_lv0),
                    patch_size_lv0=int(pred.patch_size_lv0))
    written["probs_ome_tif"] = write_probs_ome_tiff(
        paths["probs_ome_tif"], grid, **geometry, mpp=float(pred.mpp), dimensions_lv0=tuple(pred.dimensions_lv0),
        downsample=sidecar["ome_downsample"], name=pred.stem,
        description={k: sidecar[k] for k in ("slide", "origin_lv0", "stride_lv0", "patch_size_lv0", "mpp",
                                             "ome_downsample", "score")})
    written["patches_csv"] = write_patches_csv(paths["patches_csv"], pred.coords_lv0, pred.probs)
    written["patches_geojson"] = write_patches_geojson(paths["patches_geojson"], pred.coords_lv0, pred.probs,
                                                       patch_size_lv0=pred.patch_size_lv0, slide=pred.stem,
                                                       tumor_threshold=config.tumor_threshold)
    lesions = lesion_polygons(grid, **geometry, threshold=config.tumor_threshold)
    written.update(write_lesions(paths["lesions_geojson"], paths["lesions_xml"], lesions, grid=grid, **geometry,
                                 mpp=float(pred.mpp)))
    dp, dx, dy = nms_detections(grid, origin_lv0=pred.origin_lv0, stride_lv0=pred.stride_lv0,
                                patch_size_lv0=pred.patch_size_lv0, mpp=pred.mpp,
                                threshold=config.detection_threshold, radius_um=config.nms_radius_um)
    written["detections_csv"] = write_detections_csv(paths["detections_csv"], dp, dx, dy)
    if pred.slide_path is not None and Path(pred.slide_path).exists():
        ann_dir = None if annotations_dir is None else Path(annotations_dir)
        title = f"{pred.stem}: slide score {score:.3f} ({model.pooling} pooling), {len(pred)} patches"
        written["heatmap_png"] = _write_overlay(pred, grid, paths["heatmap_png"], config=config, annotations_dir=ann_dir,
                                                title=title)
    else:  # an earlier run's overlay (another model, other settings) must not stay beside these files
        paths["heatmap_png"].unlink(missing_ok=True)
        if pred.slide_path is None and no_slide is not None:  # expected (no slides given): one line for the run
            no_slide.append(pred.stem)
            logger.debug("%s: no slide file; %s not drawn.", pred.stem, paths["heatmap_png"].name)
        elif pred.slide_path is None:
            logger.warning("%s: slide file not available; %s not drawn.", pred.stem, paths["heatmap_png"].name)
        else:
            logger.warning("%s: slide file %s not found; %s not drawn. Fix: pass the slide file (a SLIDE argument of "
                           "`wsi-milssl heatmap`) to draw it.", pred.stem, pred.slide_path, paths["heatmap_png"].name)
    with atomic_open(paths["probs_json"], "w") as fh:  # last: the slide's files are complete
        fh.write(json.dumps(sidecar, indent=2, sort_keys=True) + "\n")
    return written


def log_overlays_not_drawn(stems: Sequence[str], out_dir: str | os.PathLike) -> None:
    """One warning for a run's slides without a slide file (``no_slide`` of :func:`write_slide_outputs`):
    how many have no overlay PNG, and how to get them."""
    if not stems:
        return
    names = sorted(stems)
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    logger.warning("%d slide(s) have no overlay PNG (<slide>%s) in %s: no slide file was given or found for them "
                   "(%s); their other heatmap files are written. Fix: to draw the overlays, pass the slide files "
                   "(SLIDE arguments of `wsi-milssl heatmap`, matched to the feature files or stores by name, or "
                   "the set's slides in a pipeline).", len(names),
                   HEATMAP_FILES["heatmap_png"], out_dir, shown)


#: The sidecar keys that identify the run that made a slide, kept out of the ``.tif`` description.
_RUN_IDENTITY = ("fingerprint", "prediction_fingerprint", "checkpoint_sha256")


def _write_overlay(pred: SlidePrediction, grid: np.ndarray, path: Path, *, config: HeatmapConfig,
                   annotations_dir: Path | None, title: str | None = None) -> Path:
    from wsi_milssl.slide.reader import open_slide

    # the µm/px the patches were cut at (a store's, of a slide without one in its metadata: review BO)
    with open_slide(pred.slide_path, mpp_override=config.slide_mpp if config.slide_mpp is not None else pred.mpp) as slide:
        thumb, _ = slide.thumbnail(max_size_px=min(config.thumbnail_px, max(slide.dimensions)))
        w0, h0 = slide.dimensions
        tissue = pred.tissue
        if config.clip_to_tissue and tissue is None and pred.tissue_detector != "none":
            tissue = slide_tissue_mask(slide, method=pred.tissue_detector, mask_mpp=pred.mask_mpp)
    ds_xy = (w0 / thumb.shape[1], h0 / thumb.shape[0])
    use_tissue = config.clip_to_tissue and tissue is not None and pred.tissue_detector != "none"
    sigma_cells = config.smooth_um / (pred.stride_lv0 * pred.mpp) if config.smooth_um > 0 else 0.0
    outlines = _read_outlines(pred.stem, annotations_dir, (w0, h0), config)
    image = render_overlay(
        grid, thumb, downsample_xy=ds_xy, origin_lv0=pred.origin_lv0, stride_lv0=pred.stride_lv0,
        patch_size_lv0=pred.patch_size_lv0, colormap=config.colormap, alpha=config.alpha, vmin=config.vmin,
        vmax=config.vmax, threshold=config.overlay_threshold, smooth_sigma_cells=sigma_cells,
        tissue_mask=tissue.mask if use_tissue else None,
        tissue_downsample_xy=tissue.downsample_xy if use_tissue else None,
        outlines=outlines, outline_color=config.annotation_color, outline_width_px=config.annotation_width_px,
        colorbar=config.colorbar, title=title if config.title else None,
        scale_bar_um_per_px=ds_xy[0] * float(pred.mpp) if config.scale_bar else None,
    )
    meta = {
        "slide": pred.stem, "downsample_xy": [ds_xy[0], ds_xy[1]], "thumbnail_hw": [thumb.shape[0], thumb.shape[1]],
        "origin_lv0": list(pred.origin_lv0), "stride_lv0": pred.stride_lv0, "patch_size_lv0": pred.patch_size_lv0,
        "colormap": config.colormap, "alpha": config.alpha, "vmin": config.vmin, "vmax": config.vmax,
        "annotations": outlines is not None, "overlay_threshold": config.overlay_threshold,
    }
    return write_png(image, path, metadata=meta)


#: HeatmapConfig fields left out of a slide's fingerprint: a folder made with other values is reused
#: (:data:`wsi_milssl.config.heatmap.HEATMAP_RUNTIME_ONLY_FIELDS`), and ``amp``, which counts by the precision it
#: resolves to on this device (:func:`resolved_precision`, part of every fingerprint): 'auto' and 'bf16' on the CPU
#: are the same, 'off' (float32) is not (maps ~1e-2 apart).
_RUNTIME_FIELDS = HEATMAP_RUNTIME_ONLY_FIELDS + ("amp",)


def resolved_precision(model: Any, *, cpu_auto: str = "bf16") -> dict[str, str]:
    """The precision ``model`` (an InferenceModel, or a feature head with ``cpu_auto="off"``) predicts at, for a
    fingerprint: {"precision": 'bfloat16' / 'float16' / 'float32'} when it is not the one ``amp = "auto"`` gives
    on its device, {} when it is (so the files of earlier versions, whose fingerprints left the precision out and
    were made at that default, keep their fingerprints)."""
    from wsi_milssl import runtime as runtime_rules

    runtime = getattr(model, "runtime", model)
    dtype = getattr(runtime, "amp_dtype", None)
    if dtype == runtime_rules.pick_amp_dtype("auto", runtime.device, cpu_auto=cpu_auto):
        return {}
    return {"precision": "float32" if dtype is None else str(dtype).replace("torch.", "")}


#: HeatmapConfig fields that change only what is drawn and exported from the probabilities, not the
#: probabilities: the overlay PNG, the patch classes and lesion contours of the viewer files, the OME-TIFF's
#: resolution and the detections. A slide finished with other values of these alone is drawn again from its
#: saved ``<stem>_probs.npy``, without the model. Every other field but the runtime ones (``tissue``,
#: ``min_tissue``, ``mask_mpp``, ``slide_mpp``: how a slide is cut on the fly) changes the probabilities, as do
#: the checkpoint and its tiling, and predicts the slide again; so does a field added later until it is listed.
DRAWING_FIELDS = ("colormap", "alpha", "vmin", "vmax", "overlay_threshold", "smooth_um", "clip_to_tissue",
                  "thumbnail_px", "colorbar", "title", "scale_bar", "annotation_color", "annotation_width_px",
                  "tumor_groups", "non_tumor_groups", "tumor_threshold", "ome_downsample", "detection_threshold",
                  "nms_radius_um")


def _fingerprint(config: HeatmapConfig, model: InferenceModel, *, drawing: bool = True) -> str:
    """What decides a folder's files: the checkpoint's bytes, the settings that shape outputs, the tiling and
    the precision predicted at (:func:`resolved_precision`); the other runtime settings (workers, device,
    memory layout, batch) are left out. ``drawing=False``: what
    decides the probabilities alone (the :data:`DRAWING_FIELDS` left out too), a slide's
    ``prediction_fingerprint``."""
    settings = _fingerprint_settings(config)
    if not drawing:
        settings = {k: v for k, v in settings.items() if k not in DRAWING_FIELDS}
    h = hashlib.sha256()
    if model.checkpoint_path is not None and Path(model.checkpoint_path).is_file():
        with open(model.checkpoint_path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    h.update(json.dumps({"heatmap": settings, "tiling": model.tiling.to_dict(), "pooling": model.pooling,
                         **resolved_precision(model)}, sort_keys=True).encode())
    return h.hexdigest()[:16]


def _drawing_settings(config: HeatmapConfig) -> dict[str, Any]:
    """The :data:`DRAWING_FIELDS` of ``config`` as a slide's sidecar records them (JSON values)."""
    values = config_to_dict(config)
    return json.loads(json.dumps({k: values[k] for k in DRAWING_FIELDS}))


def _fingerprint_settings(config: HeatmapConfig) -> dict[str, Any]:
    """The HeatmapConfig settings a fingerprint covers: all but the runtime ones; the annotation groups count
    where they are not the defaults (folders of earlier versions, which had no such setting, keep their
    fingerprint)."""
    default = HeatmapConfig()
    return {k: v for k, v in config_to_dict(config).items() if k not in _RUNTIME_FIELDS
            and not (k in ("tumor_groups", "non_tumor_groups") and getattr(config, k) == getattr(default, k))}


def _plan_dict(model: Any) -> dict[str, Any] | None:
    """The tile recipe an InferenceModel cuts slides with, as a dict; None for a feature head (no tiling)."""
    plan = getattr(model, "plan", None)
    to_dict = getattr(plan, "to_dict", None)
    return to_dict() if callable(to_dict) else None


#: the settings of a tiling plan that choose which patches a slide has (the µm/px and patch size a store must share
#: with the model, or it is refused)
_PATCH_CHOICE = ("stride_px", "tissue", "min_tissue", "mask_mpp", "entropy_threshold_bits")


def _tiling_plan_used(model: Any, pred: SlidePrediction) -> dict[str, Any] | None:
    """The tile recipe a slide's patches were chosen with, as its sidecar records it: the model's (:func:`_plan_dict`),
    or, for a slide read from a store that chose its patches with other settings (another min_tissue, tissue
    detector, ...), the model's with the store's values of :data:`_PATCH_CHOICE` (review CN: such a slide was
    recorded with the model's recipe and evaluated with the others as one run)."""
    plan = _plan_dict(model)
    if plan is None or pred.source != "store" or pred.store_path is None:
        return plan
    from wsi_milssl.store import open_store
    from wsi_milssl.tiling import TilingPlan

    try:
        with open_store(pred.store_path) as store:
            text = store.attrs.get("tiling_plan")
        stored = TilingPlan.from_json(text).to_dict() if text else None
    except (WsiMilsslError, OSError):
        return plan
    if stored is None or all(stored.get(k) == plan.get(k) for k in _PATCH_CHOICE):
        return plan
    return {**plan, **{k: stored.get(k) for k in _PATCH_CHOICE}}


def checkpoint_sha256(model: Any) -> str | None:
    """The SHA-256 (hex) of the bytes of ``model``'s checkpoint file (an InferenceModel or a FeatureHead), or
    None when it has none on disk. Recorded in each slide's sidecar: two slides with the same value were
    made by the same weights, whatever path named the file."""
    path = getattr(model, "checkpoint_path", None)
    if path is None or not Path(path).is_file():
        return None
    from wsi_milssl.hashing import cached_file_sha256

    return cached_file_sha256(Path(path))


def _read_status(path: Path) -> dict[str, dict[str, str]]:
    if not path.is_file():
        return {}
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            return {row["slide"]: row for row in csv.DictReader(fh) if row.get("slide")}
    except (OSError, ValueError, KeyError, csv.Error):
        logger.warning("%s: unreadable; its slides are predicted again", path)
        return {}


def _status_row(r: HeatmapResult) -> dict[str, str]:
    return {"slide": r.slide, "status": r.status, "n_patches": str(r.n_patches),
            "score": "" if r.score is None else f"{r.score:.6f}", "seconds": f"{r.seconds:.2f}",
            "error": " ".join(r.error.split())}


def _merge_status(path: Path, results: Iterable[HeatmapResult]) -> Path:
    """Add or replace the rows of ``results`` in the status CSV, keeping other slides' rows (other
    shards, earlier runs); rows sorted by slide (:func:`~wsi_milssl.atomic.merge_csv_rows`, as tile, label and
    features merge theirs)."""
    return merge_csv_rows(path, [_status_row(r) for r in results], columns=STATUS_COLUMNS)


def _input_files(item: SlideInput) -> dict[str, dict | None]:
    """``{"slide": ..., "store": ...}``: :func:`wsi_milssl.tiling.file_fingerprint` (resolved path, size
    in bytes, modification time in ns) of the slide file and of the store a slide is predicted from
    (None for an input not given or not there); the store's also holds its ``tiling``
    (:func:`_store_tiling`) where it records one."""
    store = None if item.store_path is None else file_fingerprint(item.store_path)
    if store is not None:
        tiling = _store_tiling(item.store_path)
        if tiling is not None:
            store = {**store, "tiling": tiling}
    return {"slide": None if item.slide_path is None else file_fingerprint(item.slide_path), "store": store}


def _store_tiling(path: str | os.PathLike) -> str | None:
    """What a store was tiled from and with, as a digest: the root attributes the tile stage writes and no
    later stage may change (:data:`wsi_milssl.store.schema.STORE_ATTRS`: the slide file's path, size and
    modification time, every setting and their hash, the package version, ...) and its patch count. ``label``
    rewrites the store file (new size and modification time) with new instance labels, not new patches, so
    this stays; a store tiled again from a changed slide or with other settings gets another. None for a store
    that cannot be read or records no ``config_hash`` (not written by ``tile``)."""
    from wsi_milssl.store import open_store
    from wsi_milssl.store.schema import STORE_ATTRS

    try:
        with open_store(path) as store:
            attrs, n_patches = store.attrs, len(store)
    except WsiMilsslError:
        return None
    if not attrs.get("config_hash"):
        return None
    tiled = {k: attrs[k] for k in STORE_ATTRS if k in attrs}
    text = json.dumps({"attrs": tiled, "n_patches": int(n_patches)}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _same_input_files(recorded: Any, now: dict[str, dict | None]) -> bool:
    """Whether a sidecar's ``input_files`` name the files of ``now`` (:func:`_input_files`): the same slide and
    store, each by file name, size and modification time, so that an output folder moved or copied together
    with its slides and stores (``mv``, ``cp -a``: the times are kept) still holds their predictions; a file
    written again gets a new modification time. A store recorded with its ``tiling`` is the same where its
    name and tiling are (a store labelled again holds the same patches); a sidecar of an earlier version,
    which records none, is compared by size and modification time (its slide is predicted once more)."""
    if not isinstance(recorded, dict) or set(recorded) != set(now):
        return False
    return all(_same_file(recorded[k], now[k]) for k in now)


def _same_file(recorded: Any, now: dict | None) -> bool:
    """Whether two :func:`wsi_milssl.tiling.file_fingerprint` records (or None) name the same file version: the
    same file name, size and modification time (not the folder: a folder moved with its files keeps them); of
    two records of a store's ``tiling`` (:func:`_input_files`), the same file name and tiling."""
    tiled = all(isinstance(fp, dict) and fp.get("tiling") for fp in (recorded, now))

    def identity(fp: Any) -> Any:
        if not isinstance(fp, dict):
            return fp
        name = Path(str(fp.get("path"))).name
        return (name, fp["tiling"]) if tiled else (name, fp.get("size_bytes"), fp.get("mtime_ns"))

    return identity(recorded) == identity(now)


def _read_sidecar(path: Path) -> dict:
    """A slide's ``_probs.json`` as a dict ({} when missing or unreadable)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _same_prediction(row: dict[str, str], sidecar: dict) -> bool:
    """Whether the status row describes the prediction the sidecar records (score and patch count): a
    run killed after a slide's files but before its status row leaves the previous run's row."""
    try:
        score = sidecar.get("score")
        return (row.get("score") or "") == ("" if score is None else f"{float(score):.6f}") and \
            int(row.get("n_patches") or 0) == int(sidecar.get("n_patches"))
    except (TypeError, ValueError):
        return False


#: The per-slide files the pipeline's heatmap stage records in its stamp (:mod:`wsi_milssl.pipeline.runner`).
COMPLETE_SLIDE_FILES = ("probs_npy", "probs_json", "detections_csv", "patches_csv")

#: The per-slide files a slide's prediction is kept in: a later run reuses the slide (skips it, or draws its
#: other files again from them: :func:`_missing_files`) only with them.
PREDICTION_FILES = ("probs_npy", "probs_json", "patches_csv")


def _missing_files(out_dir: Path, item: SlideInput, sidecar: dict) -> list[str]:
    """The names of the per-slide files of ``item`` missing in ``out_dir`` among those a run writes for it
    (:func:`write_slide_outputs`: every kind of :data:`wsi_milssl.artifacts.HEATMAP_FILES`, the overlay PNG
    only where the slide file is there: the one given, else the one the sidecar records)."""
    slide = item.slide_path if item.slide_path is not None else sidecar.get("slide_path")
    overlay = slide is not None and Path(slide).exists()
    return [p.name for kind, p in output_paths(out_dir, item.stem).items()
            if (kind != "heatmap_png" or overlay) and not p.is_file()]


def _finished(out_dir: Path, fingerprint: str, prediction_fingerprint: str, inputs: Sequence[SlideInput],
              annotations_dir: str | os.PathLike | None = None) -> tuple[dict[str, HeatmapResult], dict[str, dict]]:
    """Slides of ``inputs`` already predicted in ``out_dir`` by a run with the same checkpoint and settings:
    (done, redraw). ``done``: those whose ``_probs.json`` records this ``fingerprint`` (checkpoint and every
    setting; the folder's ``heatmap_config.json`` names the latest run's, not what made each slide);
    ``redraw`` (stem -> sidecar): those that record this ``prediction_fingerprint`` only (the same
    probabilities, other :data:`DRAWING_FIELDS` or another annotation file to outline, :func:`_outline_file`,
    or a file of theirs deleted: :func:`_missing_files`), to draw again from their saved map (which needs the
    :data:`PREDICTION_FILES`). Either way the status
    is ok with every file there, the slide and store files are the same (name, size and modification time,
    in ``input_files``: :func:`_same_input_files`), and the status row agrees with the sidecar's score and
    patch count. A slide made by another checkpoint or settings (a run resumed with a new checkpoint), from
    other or changed files, without these records (an older folder), or that was 'empty' (no files record
    it) is predicted again. Only ``inputs`` are checked: shards writing one folder each check their own slides."""
    from wsi_milssl.annotations import same_annotation_version

    rows = _read_status(out_dir / STATUS_FILENAME)
    done, redraw = {}, {}
    for item in inputs:
        row = rows.get(item.stem)
        if row is None or row.get("status") != OK:
            continue
        paths = output_paths(out_dir, item.stem)
        if not all(paths[k].is_file() for k in PREDICTION_FILES):
            continue
        sidecar = _read_sidecar(paths["probs_json"])
        same = sidecar.get("fingerprint") == fingerprint
        if not same and sidecar.get("prediction_fingerprint") != prediction_fingerprint:
            logger.info("%s: its outputs in %s were made with another checkpoint or settings (or record none); "
                        "predicting it again", item.stem, out_dir)
            continue
        if not _same_input_files(sidecar.get("input_files"), _input_files(item)):
            logger.info("%s: the slide or store file differs from the one its outputs in %s were made from; "
                        "predicting it again", item.stem, out_dir)
            continue
        if not _same_prediction(row, sidecar):
            logger.info("%s: its status row in %s is not that of its files (an interrupted run); predicting it "
                        "again", item.stem, out_dir)
            continue
        if not same or _missing_files(out_dir, item, sidecar) or not same_annotation_version(
                sidecar.get("outline_file"), _outline_file(item.stem, item.slide_path, annotations_dir)):
            redraw[item.stem] = sidecar
            continue
        try:
            score = float(row["score"]) if row.get("score") else None
            done[item.stem] = HeatmapResult(item.stem, "", row["status"], int(row.get("n_patches") or 0), score,
                                            float(row.get("seconds") or 0.0), row.get("error") or "",
                                            {k: str(p) for k, p in paths.items() if p.is_file()})
        except (KeyError, ValueError):
            continue
    return done, redraw


def _changed_drawing(sidecar: dict, config: HeatmapConfig) -> str:
    """The drawing settings ``config`` changes against those a slide's sidecar records, as ``name old -> new``."""
    before, now = sidecar.get("drawing_settings") or {}, _drawing_settings(config)
    return ", ".join(f"{k} {before.get(k)!r} -> {now[k]!r}" for k in DRAWING_FIELDS if before.get(k) != now[k])


def _saved_prediction(out_dir: Path, item: SlideInput, sidecar: dict) -> SlidePrediction:
    """The prediction a slide's files in ``out_dir`` hold, to draw them again without the model: the
    probabilities of its ``_probs.npy`` at the patches of its ``_patches.csv`` (in that order, so the score
    and every file come out as the run that predicted them wrote them), on the grid and with the tissue mask
    settings its sidecar records. ValueError (or OSError, KeyError, EvaluationError) when the files cannot be
    read or do not agree with each other."""
    from wsi_milssl.artifacts import read_patch_probs

    paths = output_paths(out_dir, item.stem)
    grid = np.load(paths["probs_npy"], allow_pickle=False)
    coords, table_probs = read_patch_probs(paths["patches_csv"])
    origin = (int(sidecar["origin_lv0"][0]), int(sidecar["origin_lv0"][1]))
    stride = int(sidecar["stride_lv0"])
    shape = (int(sidecar["shape"][0]), int(sidecar["shape"][1]))
    cols, col_rest = np.divmod(coords[:, 0] - origin[0], stride)
    rows, row_rest = np.divmod(coords[:, 1] - origin[1], stride)
    if (grid.ndim != 2 or tuple(grid.shape) != shape or len(coords) != int(sidecar["n_patches"])
            or col_rest.any() or row_rest.any() or not (0 <= rows).all() or not (rows < shape[0]).all()
            or not (0 <= cols).all() or not (cols < shape[1]).all()):
        raise ValueError("the map, the patch table and the sidecar do not agree")
    probs = np.asarray(grid[rows, cols], dtype=np.float32)
    if not np.isfinite(probs).all() or np.abs(probs - table_probs).max(initial=0.0) > 1e-6:
        raise ValueError("the map and the patch table hold other probabilities")
    recorded = sidecar.get("slide_path")
    slide_path = item.slide_path if item.slide_path is not None else (Path(recorded) if recorded else None)
    return SlidePrediction(
        stem=item.stem, slide_path=slide_path, source=str(sidecar["source"]), coords_lv0=coords, outputs=probs,
        origin_lv0=origin, stride_lv0=stride, patch_size_lv0=int(sidecar["patch_size_lv0"]),
        patch_size_px=int(sidecar["patch_size_px"]), target_mpp=float(sidecar["target_mpp"]),
        mpp=float(sidecar["mpp"]), dimensions_lv0=(int(sidecar["dimensions_lv0"][0]),
                                                   int(sidecar["dimensions_lv0"][1])),
        grid_shape=shape, n_candidates=len(coords), store_path=item.store_path,
        tissue_detector=str(sidecar["tissue_detector"]), mask_mpp=float(sidecar["mask_mpp"]))


def _check_shard_settings(out_dir: Path, fingerprint: str, model: InferenceModel) -> None:
    """ConfigError when ``out_dir``'s heatmap_config.json (written by another shard of the run, or an earlier run)
    records maps of another checkpoint or other settings than this shard's (review DA: shards given two checkpoints
    filled one folder, and scores.csv, with maps of two models, and the record named one of them)."""
    from wsi_milssl.locks import folder_settings_record

    path = out_dir / CONFIG_FILENAME
    recorded = folder_settings_record(path, error=ConfigError)
    if recorded is None or recorded.get("fingerprint") in (None, fingerprint):
        return
    theirs = recorded.get("checkpoint")
    ours = None if model.checkpoint_path is None else os.path.abspath(model.checkpoint_path)
    what = (f"the checkpoint {theirs}, not this shard's {ours}" if theirs != ours or
            recorded.get("checkpoint_sha256") != checkpoint_sha256(model) else "other settings than this shard's")
    raise ConfigError(f"{path}: this folder holds maps made with {what}; the shards of one run must use the same "
                      "checkpoint and settings, or the folder's maps and scores.csv would mix two models. Fix: give "
                      "this shard the other shards' checkpoint and settings, or write to a new folder with --out (or, "
                      "when no other shard is running, pass --overwrite to predict this shard's slides again).")


def _write_config(out_dir: Path, config: HeatmapConfig, model: InferenceModel, fingerprint: str,
                  sha256: str | None) -> Path:
    data = {
        "heatmap": config_to_dict(config),
        "checkpoint": None if model.checkpoint_path is None else os.path.abspath(model.checkpoint_path),
        "fingerprint": fingerprint,
        "checkpoint_sha256": sha256,
        "model_name": model.config.get("model_name"),
        "bag_pooling": model.pooling,
        "tiling": model.tiling.to_dict(),
        "runtime": model.runtime.describe(),
        "package_version": __version__,
    }
    path = out_dir / CONFIG_FILENAME
    with atomic_open(path, "w") as fh:
        fh.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


#: Threads that write per-slide files while the model runs (the overlay's thumbnail read, resize and PNG
#: encoding release the GIL, so they scale with the cores: about 0.8 s of CPU per slide; PNG encoding
#: ran 1.9x faster in 2 threads on 2 cores), and the predictions that may wait for them (memory stays
#: bounded). All but two cores: with 6 writers on 16 cores (an H100 machine, 2026-11-27) the 14 slides'
#: files took 1.25-1.6 s each and the model waited 2.9 s for them at the end.
_WRITER_THREADS = max(2, min(12, (os.cpu_count() or 2) - 2))
_PENDING_WRITES = _WRITER_THREADS + 2


def _empty_result(item: SlideInput, pred: SlidePrediction, model: InferenceModel,
                  outputs: dict[str, str]) -> HeatmapResult:
    """A slide without a single kept patch: status 'empty' and no score (never a confident 0); ``outputs``:
    its files (an empty detections CSV, :func:`~wsi_milssl.inference.exports.write_empty_slide_outputs`)."""
    plan = model.plan
    where = "in the store" if pred.source == "store" else (
        f"of {pred.n_candidates} candidate cells passed the entropy filter ({plan.entropy_threshold_bits:g} bits)"
        if pred.n_candidates else f"has tissue >= {plan.min_tissue:g} on the mask")
    fix = ("check the slide against the tiling that cut its store (tile's qc/ PNG and warning: a slide smaller than "
           "one patch, or no tissue on its mask); tile's settings change it ([tile] in a pipeline)"
           if pred.source == "store" else
           "check the slide and its tissue mask; --tissue/--min-tissue/--mask-mpp change the mask")
    message = f"{item.slide_path or item.store_path}: no patch {where}, so the slide has no score. Fix: {fix}."
    logger.warning("%s: empty: %s", item.stem, message)
    return HeatmapResult(item.stem, str(item.slide_path or ""), EMPTY, 0, None, pred.seconds, message, outputs)


def non_finite_error(pred: SlidePrediction, model: Any) -> WsiMilsslError | None:
    """The error (naming the checkpoint, the slide and the fix) when some of ``pred``'s probabilities are NaN
    or infinite, else None. ``model``: an InferenceModel or a FeatureHead (the image and the feature heatmaps
    both call it; its ``checkpoint_path``, network ``model`` and mixed precision are read). Weights that hold
    NaN or infinity are a diverged run (CheckpointError: retrain with a lower learning rate). A finite head is
    overflowed by the features it was given (StoreError naming the first such row: check those features, or
    the mixed precision); a finite image model, whose pixels are bounded, by extreme weights or the mixed
    precision (CheckpointError naming the first such patch)."""
    import torch

    from wsi_milssl.mil.selftrain import weights_finite

    bad = np.flatnonzero(~np.isfinite(pred.probs))
    if bad.size == 0:
        return None
    head = (f"{model.checkpoint_path or 'the model'}: the model gives non-finite probabilities (NaN or infinity) for "
            f"{bad.size} of {len(pred)} patches of slide {pred.stem!r}, so no map or score was written for it")
    net = getattr(model, "model", None)
    if not isinstance(net, torch.nn.Module) or not weights_finite(net):
        return CheckpointError(
            f"{head}; the checkpoint is likely from a diverged run (its weights hold NaN or infinity). Fix: retrain "
            "with a lower learning rate (--lr), and check that the losses in the run's metrics.jsonl stay finite.")
    amp = getattr(model, "amp_dtype", None) or getattr(getattr(model, "runtime", None), "amp_dtype", None)
    x, y = (int(v) for v in pred.coords_lv0[bad[0]])
    first = f"(first: row {int(bad[0])}, level-0 ({x}, {y}))"
    under = f" under mixed precision ({amp})" if amp is not None else ""
    no_amp = "predict without mixed precision (--amp off)"
    if not hasattr(model, "tiling"):  # a FeatureHead: the features were given
        return StoreError(
            f"{head}; its weights are finite, so the inputs of those patches are the cause {first}: feature values "
            f"extreme enough to overflow the head (far beyond those it was trained on){under}. Fix: check those rows "
            "of the slide's features for extreme values and extract them again"
            f"{f', or {no_amp}' if amp is not None else ''}.")
    return CheckpointError(  # pixels are bounded: extreme (finite) weights or the precision overflow
        f"{head}; its weights are finite, so its computation overflows on those patches {first}{under}: the pixels "
        "are bounded, so weights that are extreme though finite"
        f"{', or the narrower precision,' if amp is not None else ''} are the cause. Fix: "
        f"{f'{no_amp}; if that does not help, ' if amp is not None else ''}retrain with a lower learning rate (--lr).")


@restores_torch_settings
def make_heatmaps(slides: Sequence[str | os.PathLike], checkpoint: str | os.PathLike | InferenceModel,
                  out_dir: str | os.PathLike, config: HeatmapConfig | None = None, *,
                  stores: Sequence[str | os.PathLike] | None = None,
                  annotations_dir: str | os.PathLike | None = None,
                  progress: ProgressCallback | None = None, shard: tuple[int, int] | Shard = (0, 1),
                  overwrite: bool = False) -> HeatmapRun:
    """Predict every slide with the model of ``checkpoint`` and write its files into ``out_dir``.

    ``slides``: slide files (tiled on the fly with the checkpoint's settings), or with ``stores``
    the slides whose stores to read (an empty list = every store). ``annotations_dir``: folder of
    ``<stem>.xml``/``.geojson`` annotations, outlined on the overlays. Raises CheckpointError /
    ConfigError before any slide for a bad checkpoint or bad inputs; per-slide errors are recorded in
    ``heatmap_status.csv`` and the run goes on.

    Resume: slides a run with the same checkpoint and settings already finished in ``out_dir`` from
    the same slide and store files (name, size, modification time) are skipped (``overwrite`` predicts
    them again); each slide's ``_probs.json`` records the fingerprint of the checkpoint and settings that
    made it, so a folder resumed with another checkpoint predicts again every slide the old one made. A
    slide made with the same checkpoint and prediction settings but other drawing settings
    (:data:`DRAWING_FIELDS`: the overlay, the viewer files' classes and lesions, the OME-TIFF's resolution,
    the detections) is drawn again from its saved ``<stem>_probs.npy`` without the model
    (``HeatmapRun.redrawn``); one whose saved probabilities cannot be read is predicted again. A
    store cut from another slide than the one given, or one that cannot be opened, fails its slide
    (:func:`store_mismatch`). A model that gives NaN or infinite probabilities fails each slide
    (CheckpointError in the status CSV) before any of its files is written. ``shard`` = (I, N): this
    call takes shard I of N of the slides (:func:`wsi_milssl.distributed.shard_items`: by the hash of the
    slide's stem; a :class:`~wsi_milssl.distributed.Shard` with ``by='position'``, torchrun's ranks:
    every N-th slide from the I-th); shards may
    run at once into one folder, and their status and score rows merge (sorted by slide), so N shards leave the files of one run.
    The lock of ``out_dir`` is held for the run (:func:`wsi_milssl.locks.folder_lock`, as shard I of
    N): another run into the folder, or a second copy of the shard, is refused with FolderLockedError.
    Returns a :class:`HeatmapRun` (one result per slide of this shard, ``skipped``, ``redrawn``).
    """
    from wsi_milssl.tiling.status import marking_unfinished

    every = match_inputs(path_list(slides), None if stores is None else path_list(stores))
    mine = shard_items(every, *shard, name=lambda i: i.stem)
    with folder_lock(out_dir, shard=shard), contextlib.ExitStack() as stack:
        # marked unfinished (once the checkpoint loaded and the folder is made) until this run's last slide is
        # done: `evaluate` refuses a folder of a run that stopped before predicting labelled slides (review BN: it
        # scored the slides done so far, exit 0)
        def mark() -> None:
            stack.enter_context(marking_unfinished(out_dir, "heatmap", [i.stem for i in mine],
                                                   shard=(int(shard[0]), int(shard[1])) if shard[1] > 1 else None,
                                                   finished=lambda: _read_status(Path(out_dir) / STATUS_FILENAME)))

        return _make_heatmaps(mine, checkpoint, out_dir, config, annotations_dir=annotations_dir,
                              progress=progress, overwrite=overwrite, mark=mark,
                              shard=(int(shard[0]), int(shard[1])) if int(shard[1]) > 1 and not overwrite else None)


def _make_heatmaps(inputs: list[HeatmapInput], checkpoint: str | os.PathLike | InferenceModel,
                   out_dir: str | os.PathLike, config: HeatmapConfig | None, *,
                   annotations_dir: str | os.PathLike | None, progress: ProgressCallback | None,
                   overwrite: bool, mark: Callable[[], None] | None = None,
                   shard: tuple[int, int] | None = None) -> HeatmapRun:
    """``shard`` (I, N) of a run without --overwrite: refused at its end when another shard writing the folder at the
    same time uses another checkpoint or other settings (:func:`_check_shard_settings`). A shard run after the
    others with a new checkpoint is not: it predicts its own slides again, and evaluate refuses the folder until
    every shard has. (Not checked at the start: a shard of the same run that has not written its record yet leaves
    an earlier run's there.)"""
    config = config or HeatmapConfig()
    out_dir = Path(out_dir)
    if inputs and config.num_workers != 0:
        prestart_readers()  # the readers' fork server starts while the checkpoint loads
    model = checkpoint if isinstance(checkpoint, InferenceModel) else load_inference_model(checkpoint, config=config)
    if config.threads > 0:  # also for a model loaded before the call (given back at the end)
        torch.set_num_threads(config.threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    if mark is not None:
        mark()
    fingerprint = _fingerprint(config, model)
    prediction_fingerprint = _fingerprint(config, model, drawing=False)
    sha256 = checkpoint_sha256(model)
    finished, to_redraw = ({}, {}) if overwrite else _finished(out_dir, fingerprint, prediction_fingerprint, inputs,
                                                                      annotations_dir)
    config_json = _write_config(out_dir, config, model, fingerprint, sha256)
    status_csv = out_dir / STATUS_FILENAME
    results: dict[int, HeatmapResult] = {}
    writes: dict = {}  # future -> (position, prediction)

    unwritten_rows: list[str] = []
    no_slide: list[str] = []  # slides without a slide file: one warning at the end

    def record(i: int, result: HeatmapResult, *, merge: bool = True, shown: str | None = None) -> None:
        results[i] = result
        if merge:
            try:
                _merge_status(status_csv, [result])
            except OutputError as exc:  # a full disk: a writer thread may be filling it with another slide
                unwritten_rows.append(result.slide)
                logger.warning("%s: this slide's row is written with the others at the end (%s)", result.slide,
                               str(exc).split(" Fix:")[0])
        emit(progress, ProgressEvent("heatmap", len(results), len(inputs), unit="slide", item=result.slide,
                                     message=shown or result.status))

    def failed(i: int, exc: BaseException, seconds: float) -> HeatmapResult:
        item = inputs[i]
        if not isinstance(exc, WsiMilsslError):
            logger.debug("unexpected error on %s:\n%s", item.stem,
                         "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        message = str(exc) if isinstance(exc, WsiMilsslError) else f"{type(exc).__name__}: {exc}"
        logger.error("%s: failed: %s", item.stem, message)
        try:  # an earlier run's files (another checkpoint), or this run's half-written ones, must not stay
            remove_slide_outputs(out_dir, item.stem)
        except Exception as rm_exc:  # noqa: BLE001 - the slide is recorded as failed either way
            logger.warning("%s: cannot remove its earlier files from %s (%s); its status row says failed",
                           item.stem, out_dir, rm_exc)
        return HeatmapResult(item.stem, str(item.slide_path or ""), FAILED, 0, None, seconds, message)

    def collect(block: bool) -> None:
        """Record the slides whose files are written (wait for one at least with ``block``)."""
        done, _ = wait(list(writes), timeout=None if block else 0, return_when=FIRST_COMPLETED)
        for fut in done:
            i, pred = writes.pop(fut)
            try:
                result, write_s = fut.result()
            except Exception as exc:  # noqa: BLE001 - one slide's files or score must not stop the others
                record(i, failed(i, exc, pred.seconds))
                continue
            record(i, result, merge=False)  # its status row is written (by write)
            logger.info("%s: %d patches, score %.4f (%s pooling), %.1f s (patches %.2f s, files %.2f s)", result.slide,
                        len(pred), result.score, model.pooling, result.seconds, pred.seconds, write_s)

    def write(i: int, pred: SlidePrediction, files: dict) -> tuple[HeatmapResult, float]:
        """Write the slide's files, then its scores.csv and status rows at once (not when the main thread
        collects it: a run killed in between left the slide's new files beside an earlier run's rows)."""
        t0 = time.perf_counter()
        written = write_slide_outputs(pred, out_dir, model=model, config=config, annotations_dir=annotations_dir,
                                      input_files=files, fingerprint=fingerprint, checkpoint_sha256=sha256,
                                      prediction_fingerprint=prediction_fingerprint, no_slide=no_slide)
        write_s = time.perf_counter() - t0
        score = pred.score(model.pooling)
        update_scores_csv(out_dir, {pred.stem: score})  # the CSVs' updates take the folder's mutex
        item = inputs[i]
        result = HeatmapResult(item.stem, str(item.slide_path or ""), OK, len(pred), score, pred.seconds + write_s,
                               "", {k: str(v) for k, v in written.items()})
        _merge_status(status_csv, [result])
        return result, write_s

    emit(progress, ProgressEvent("heatmap", 0, len(inputs), unit="slide"))
    todo, skipped, redraw = [], [], []
    for i, item in enumerate(inputs):
        try:
            mismatch = store_mismatch(item, slide_mpp=config.slide_mpp)
        except Exception as exc:  # noqa: BLE001 - an unreadable slide fails only itself
            mismatch = exc
        if mismatch is not None:
            record(i, failed(i, mismatch, 0.0))
        elif item.stem in finished:
            record(i, dataclasses.replace(finished[item.stem], slide_path=str(item.slide_path or "")), merge=False,
                   shown="skipped")  # (review EW: "(ok)", where tile, label and features say "(skipped)")
            skipped.append(item.stem)
        elif item.stem in to_redraw:
            redraw.append(i)
        else:
            todo.append(i)
    if skipped:
        logger.info("%s: %d of %d slides already done with this checkpoint and settings; skipped", out_dir,
                    len(skipped), len(inputs))
    # taken before the files are read: a file rewritten while it is predicted is predicted again next time
    files_of = {i: _input_files(inputs[i]) for i in todo + redraw}
    redrawn = []
    t_start = time.perf_counter()
    # Files are written by threads while the model goes on with the next slides; at most
    # _PENDING_WRITES predictions wait for them, so memory stays bounded.
    with ThreadPoolExecutor(max_workers=_WRITER_THREADS, thread_name_prefix="wsi-heatmap-write") as writers:
        for i in redraw:  # the same probabilities, other drawing settings: drawn again without the model
            item, sidecar = inputs[i], to_redraw[inputs[i].stem]
            try:
                pred = _saved_prediction(out_dir, item, sidecar)
            except (OSError, ValueError, KeyError, TypeError, IndexError, WsiMilsslError) as exc:
                logger.info("%s: its saved probabilities in %s cannot be read (%s); predicting it again", item.stem,
                            out_dir, exc)
                todo.append(i)
                continue
            changed, missing = _changed_drawing(sidecar, config), _missing_files(out_dir, item, sidecar)
            why = [f"drawn with other drawing settings ({changed})"] if changed else []
            if missing:
                why.append(f"its file(s) {', '.join(missing)} missing")
            logger.info("%s: predicted with this checkpoint and settings, %s; drawing it again from its saved "
                        "probabilities", item.stem, "; ".join(why) or
                        "drawn with another annotation file to outline (added, edited or removed)")
            redrawn.append(item.stem)
            writes[writers.submit(write, i, pred, files_of[i])] = (i, pred)
            while len(writes) >= _PENDING_WRITES:
                collect(block=True)
        todo.sort()
        for j, outcome in predict_many([inputs[i] for i in todo], model, config=config, progress=progress):
            i = todo[j]
            if isinstance(outcome, Exception):
                record(i, failed(i, outcome, 0.0))
                continue
            pred = outcome
            if inputs[i].slide_path is not None:
                pred.slide_path = inputs[i].slide_path
            if len(pred) == 0:
                try:  # an earlier version's predictions must go; an empty detections CSV is the slide's
                    written = write_empty_slide_outputs(out_dir, inputs[i].stem)
                except Exception as exc:  # noqa: BLE001 - one slide's files must not stop the others
                    record(i, failed(i, exc, pred.seconds))
                    continue
                record(i, _empty_result(inputs[i], pred, model, written))
                continue
            bad = non_finite_error(pred, model)
            if bad is not None:  # before any file is written: a failed slide leaves no new files
                record(i, failed(i, bad, pred.seconds))
                continue
            writes[writers.submit(write, i, pred, files_of[i])] = (i, pred)
            collect(block=False)
            while len(writes) >= _PENDING_WRITES:
                collect(block=True)
        while writes:
            collect(block=True)
    log_overlays_not_drawn(no_slide, out_dir)
    results_list = [results[k] for k in range(len(inputs))]
    if unwritten_rows or not status_csv.exists():
        _merge_status(status_csv, results_list)
    if shard is not None:  # the folder's lock keeps every other run out: a record of other settings written since
        # this shard's own is another shard's, started at the same moment
        _check_shard_settings(out_dir, fingerprint, model)
    return HeatmapRun(tuple(results_list), out_dir, status_csv, config_json, out_dir / SCORES_FILENAME,
                      seconds=time.perf_counter() - t_start, skipped=tuple(skipped), redrawn=tuple(redrawn))
