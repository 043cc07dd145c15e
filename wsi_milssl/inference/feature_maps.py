"""Heatmaps of feature runs: a feature-head checkpoint over feature files -> the heatmap stage's files.

    from wsi_milssl.inference.feature_maps import make_feature_heatmaps

    run = make_feature_heatmaps(["features/"], "runs/f1/best.pt", "heatmaps/", HeatmapConfig())

The head's instance probabilities (``softmax(head(features))[:, 1]``) are placed on the coordinates of
each feature file, on the grid its attributes describe (:meth:`wsi_milssl.features.schema.FeatureFile.grid_layout`:
this project's files record it; TRIDENT's and CLAM's are read from their ``coords`` attributes or
inferred), and written through the heatmap stage's own per-slide writer
(:func:`wsi_milssl.inference.stage.write_slide_outputs`): probability maps, overlays (when the slide
is found), QuPath GeoJSON, CAMELYON16 detections, ``scores.csv``, ``heatmap_status.csv`` and
``heatmap_config.json``. So ``wsi-milssl evaluate`` (FROC, instance and bag AUC) works on feature runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from wsi_milssl import __version__
from wsi_milssl import runtime as runtime_rules
from wsi_milssl.atomic import atomic_write_json
from wsi_milssl.config.base import config_to_dict
from wsi_milssl.config.heatmap import HeatmapConfig
from wsi_milssl.errors import CheckpointError, ConfigError, StoreError, WsiMilsslError
from wsi_milssl.events import ProgressCallback, ProgressEvent, emit
from wsi_milssl.artifacts import HEATMAP_CONFIG_FILENAME, HEATMAP_STATUS_FILENAME, SCORES_FILENAME
from wsi_milssl.inference.exports import remove_slide_outputs, update_scores_csv, write_empty_slide_outputs
from wsi_milssl.inference.predict import SlidePrediction
from wsi_milssl.locks import folder_lock
from wsi_milssl.paths import path_list
from wsi_milssl.inference.stage import (
    HeatmapResult,
    HeatmapRun,
    _fingerprint_settings,
    _merge_status,
    checkpoint_sha256,
    log_overlays_not_drawn,
    non_finite_error,
    resolved_precision,
    write_slide_outputs,
)

__all__ = ["FeatureHead", "load_feature_head", "find_feature_files", "feature_slide_mismatch", "make_feature_heatmaps"]

logger = logging.getLogger(__name__)


@dataclass
class FeatureHead:
    """A trained feature head (``train`` in feature mode) ready for inference: ``model`` in eval mode on
    ``device``; ``pooling`` ('max' or 'mean'), ``config`` (the checkpoint's config dict) and
    ``checkpoint_path``, as :func:`~wsi_milssl.inference.stage.write_slide_outputs` records them."""

    model: torch.nn.Module
    device: torch.device
    pooling: str
    config: dict[str, Any] = field(default_factory=dict)
    checkpoint_path: Path | None = None
    amp_dtype: torch.dtype | None = None

    @property
    def in_features(self) -> int | None:
        value = self.config.get("in_features") or (self.config.get("model_kwargs") or {}).get("in_features")
        return None if value is None else int(value)

    @property
    def encoder(self) -> str | None:
        """The encoder of the features the head was trained on, when the files named it."""
        return (self.config.get("store_settings") or {}).get("feature_encoder")

    @property
    def encoder_weights_sha256(self) -> str | None:
        """The SHA-256 of the encoder weights of the features the head was trained on, when recorded."""
        return (self.config.get("store_settings") or {}).get("feature_encoder_weights_sha256") or None

    @property
    def feature_settings(self) -> dict[str, Any]:
        """What decided the training features besides the patches (encoder settings, dtype, input size,
        precision, resolution, patch size; :attr:`wsi_milssl.features.schema.FeatureFile.feature_settings`),
        as far as the training files recorded it ({} for heads of earlier versions)."""
        value = (self.config.get("store_settings") or {}).get("feature_settings")
        return dict(value) if isinstance(value, dict) else {}

    def probabilities(self, features: np.ndarray, *, batch_size: int = 8192) -> np.ndarray:
        """float32 (N,) positive-class probabilities of float (N, D) features."""
        out = np.zeros(len(features), np.float32)
        with torch.inference_mode():
            for start in range(0, len(features), batch_size):
                x = torch.from_numpy(np.asarray(features[start:start + batch_size], dtype=np.float32))
                with runtime_rules.autocast(self.device, self.amp_dtype):
                    logits = self.model(x.to(self.device))
                out[start:start + len(x)] = torch.softmax(logits.float(), dim=1)[:, 1].cpu().numpy()
        return out


def load_feature_head(checkpoint: str | os.PathLike, *, config: HeatmapConfig | None = None) -> FeatureHead:
    """The feature head of ``checkpoint`` (RUN_DIR/best.pt, last.pt or RUN_DIR) on ``config``'s device
    (float32 on the CPU, autocast as asked on CUDA). Raises CheckpointError for a model over image patches;
    the checkpoint of a run that a live ``train`` still writes is refused, one of a run stopped early warned
    about (:func:`~wsi_milssl.inference.model.check_run_finished`)."""
    from wsi_milssl.inference.model import check_run_finished
    from wsi_milssl.mil import load_model
    from wsi_milssl.mil.checkpoint import resolve_checkpoint_path
    from wsi_milssl.mil.models import is_image_model

    config = config or HeatmapConfig()
    device = runtime_rules.pick_device(config.device, owner="HeatmapConfig")
    path = check_run_finished(resolve_checkpoint_path(checkpoint))
    model, cfg = load_model(path, device=device)
    name = str(cfg.get("model_name"))
    if is_image_model(name):
        raise CheckpointError(f"{path}: model {name!r} classifies image patches, not feature vectors. Fix: drop "
                              "--features and pass slides (or --store) to make its heatmaps.")
    pooling = str(cfg.get("bag_pooling") or "max")
    from wsi_milssl.config.train import BAG_POOLINGS

    if pooling not in BAG_POOLINGS:
        raise CheckpointError(f"{path}: bag pooling {pooling!r} is not one of {', '.join(BAG_POOLINGS)}.")
    amp = runtime_rules.pick_amp_dtype(config.amp, device, cpu_auto="off")
    return FeatureHead(model=model.eval(), device=device, pooling=pooling, config=cfg, checkpoint_path=path,
                       amp_dtype=amp)


def find_feature_files(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """Feature files from files and folders (:func:`wsi_milssl.features.schema.feature_files_in`), sorted per
    folder, each once. Raises ConfigError for a missing path or no file at all."""
    from wsi_milssl.features.schema import feature_files_of

    given = [Path(raw).expanduser() for raw in path_list(paths)]
    for p in given:
        if not p.exists():
            raise ConfigError(f"{p}: no such feature file or folder. Fix: check the path.")
    out = feature_files_of(given)
    if not out:
        from wsi_milssl.mil.data import nested_feature_folders

        nested = nested_feature_folders([Path(raw).expanduser() for raw in path_list(paths)])
        raise ConfigError(f"no feature files (.h5) in {', '.join(str(p) for p in paths)}"
                          + (f", but {nested}" if nested else ". Fix: run `wsi-milssl features` first, or pass "
                             "TRIDENT/CLAM feature files."))
    return out


def _slide_facts(path: Path | None, slide_mpp: float | None) -> tuple[float | None, tuple[int, int] | None]:
    if path is None or not path.exists():
        return slide_mpp, None
    from wsi_milssl.slide.reader import open_slide

    try:
        with open_slide(path, mpp_override=slide_mpp) as slide:
            return float(slide.mpp), (int(slide.dimensions[0]), int(slide.dimensions[1]))
    except WsiMilsslError as exc:
        logger.warning("%s: slide not read (%s); using the feature file's own facts", path, exc)
        return slide_mpp, None


def feature_slide_mismatch(ff, slide: Path, *, dimensions: tuple[int, int] | None) -> StoreError | None:
    """StoreError when the feature file ``ff`` was not made from ``slide`` (level-0 ``dimensions``, None
    when the slide cannot be read), else None: the level-0 size the file records (``dimensions_lv0``,
    else TRIDENT's ``level0_width`` / ``level0_height``) must be the slide's; where they agree (or are not
    recorded), a file made from another slide file that is still there and differs in size in bytes from
    ``slide`` is another slide of the same name too. The same slide reached by another path (a copy, a link, a
    moved folder) is used with a note in the log; files that record neither (CLAM) are not checked."""
    a, c = ff.attrs, ff.coords_attrs
    recorded_dims = None
    if a.get("dimensions_lv0") is not None:
        recorded_dims = tuple(int(v) for v in a["dimensions_lv0"])
    elif c.get("level0_width") is not None and c.get("level0_height") is not None:
        recorded_dims = (int(c["level0_width"]), int(c["level0_height"]))
    made_from = Path(str(a["slide_path"])) if a.get("slide_path") not in (None, "", "None") else None
    same_path = made_from is not None and made_from.resolve() == slide.resolve()

    def error(why: str) -> StoreError:
        return StoreError(
            f"{slide}: the feature file {ff.path} was made from another slide of the same name ({why}), so its "
            "probabilities do not belong to this slide. Fix: pass the feature files of this slide (`wsi-milssl "
            "features` of it, into its own folder), or drop the slide to draw the file over the slide it records.")

    if recorded_dims is not None and dimensions is not None and tuple(dimensions) != recorded_dims:
        return error(f"{made_from or 'slide not recorded'}, {recorded_dims[0]} x {recorded_dims[1]} px; this slide: "
                     f"{dimensions[0]} x {dimensions[1]} px")
    if made_from is None or same_path:
        return None
    try:
        other_size, size = made_from.stat().st_size, slide.stat().st_size
    except OSError:
        other_size = size = None
    if other_size is not None and other_size != size:
        return error(f"{made_from}, {other_size} bytes; this slide: {size} bytes")
    logger.info("%s: made from %s, drawn over %s (the same level-0 size%s)", ff.path, made_from, slide,
                " and file size" if other_size is not None else "")
    return None


def _trained_on(head: FeatureHead | None) -> tuple[float, int] | None:
    """(target µm/px, patch side in px) of the patches the head was trained on, when its files recorded both."""
    fs = head.feature_settings if head is not None else {}
    if fs.get("target_mpp") is None or fs.get("patch_size_px") is None:
        return None
    return float(fs["target_mpp"]), int(fs["patch_size_px"])


def _check_patch_size(ff, layout, head: FeatureHead | None) -> None:
    """StoreError when a file that records no resolution of its own (CLAM's) holds patches of another
    physical size (level-0 size x µm/px) than those the head was trained on (what it records of them), by
    more than scanners' nominal magnifications differ (:data:`~wsi_milssl.features.schema.NOMINAL_SIZE_RATIO`:
    "20x" patches of 512 level-0 px are 116 µm at 0.226 µm/px and 124 µm at 0.243)."""
    from wsi_milssl.features.schema import NOMINAL_SIZE_RATIO, same_physical_size

    trained, fs = _trained_on(head), ff.feature_settings
    if trained is None or (fs.get("target_mpp") is not None and fs.get("patch_size_px") is not None):
        return  # the recorded settings were compared (_check_fit)
    um, trained_um = layout.patch_size_lv0 * layout.mpp, trained[0] * trained[1]
    if not same_physical_size(um, trained_um):
        raise StoreError(
            f"{ff.path}: patches of {um:g} µm ({layout.patch_size_lv0} level-0 px at {layout.mpp:g} µm/px), but the "
            f"head {head.checkpoint_path} was trained on patches of {trained_um:g} µm ({trained[1]} px at "
            f"{trained[0]:g} µm/px): {max(um, trained_um) / min(um, trained_um):.3g}x apart, more than the "
            f"{NOMINAL_SIZE_RATIO:g}x by which scanners' nominal magnifications differ. Fix: pass feature files of "
            "patches of the training size (coords in level-0 pixels, CLAM's patch_size at its patch_level).")


def _prediction(ff, probs: np.ndarray, *, slide_path: Path | None, config: HeatmapConfig, seconds: float,
                facts: tuple[float | None, tuple[int, int] | None] | None = None,
                head: FeatureHead | None = None) -> SlidePrediction:
    mpp, dims = facts if facts is not None else _slide_facts(slide_path, config.slide_mpp)
    layout = ff.grid_layout(slide_mpp=mpp, slide_dimensions=dims, trained_on=_trained_on(head))
    _check_patch_size(ff, layout, head)
    for note in layout.notes:
        logger.info("%s: %s", ff.path, note)
    attrs = ff.attrs
    tissue = str(config.tissue or attrs.get("tissue_detector") or "otsu")
    mask_mpp = float(config.mask_mpp or attrs.get("mask_mpp") or 16.0)
    return SlidePrediction(
        stem=ff.stem, slide_path=slide_path, source="features", coords_lv0=ff.coords, outputs=probs,
        origin_lv0=layout.origin_lv0, stride_lv0=layout.stride_lv0, patch_size_lv0=layout.patch_size_lv0,
        patch_size_px=layout.patch_size_px, target_mpp=layout.target_mpp, mpp=layout.mpp,
        dimensions_lv0=layout.dimensions_lv0, grid_shape=layout.grid_shape, n_candidates=len(ff),
        tissue_detector=tissue, mask_mpp=mask_mpp, seconds=seconds, extra={"features_path": str(ff.path)})


def make_feature_heatmaps(features: Sequence[str | os.PathLike], checkpoint: str | os.PathLike | FeatureHead,
                          out_dir: str | os.PathLike, config: HeatmapConfig | None = None, *,
                          slides: Sequence[str | os.PathLike] = (), annotations_dir: str | os.PathLike | None = None,
                          progress: ProgressCallback | None = None) -> HeatmapRun:
    """Heatmap files of every feature file (or folder of them) in ``features`` with the feature head of
    ``checkpoint``, into ``out_dir`` (the files :func:`~wsi_milssl.inference.stage.make_heatmaps` writes).

    ``slides``: slide files of the same stems, for the overlay PNG and for the slide's µm/px and size
    where a file does not record them (TRIDENT, CLAM); without one, the slide recorded in the file is
    used when it exists, else the PNG is skipped. A slide given whose level-0 size differs from the one
    the file records, or (same size) another slide file than the one recorded when that one is there and
    of another size in bytes, is not the file's slide: that file fails (:func:`feature_slide_mismatch`).
    ``config``: the overlay, detection and device settings (its tiling and reader settings do not apply).
    A file whose features do not fit the head (another width, another encoder or encoder weights, or
    other recorded feature settings such as the resolution than the head was trained on) fails alone, as
    does one that cannot be placed on a grid; the others go on. Raises CheckpointError for an image-model checkpoint.

    Each slide's ``_probs.json`` records the run that made it as the image heatmaps do: a ``fingerprint``
    (:func:`_feature_fingerprint`: the head's bytes and the settings) and ``checkpoint_sha256`` (the head's
    bytes), so ``evaluate`` tells two heads saved at one path apart and takes one head named by two paths as
    one. ``heatmap_status.csv`` keeps the rows of slides this call does not take (an earlier call's 'failed'
    row stays until that slide is made again), as the image stage's does.

    The lock of ``out_dir`` is held for the run, as the image stage holds it
    (:func:`wsi_milssl.locks.folder_lock`): another run into the folder is refused with FolderLockedError,
    and ``evaluate`` refuses the folder while this run writes it.
    """
    config = config or HeatmapConfig()
    files = find_feature_files(features)
    head = checkpoint if isinstance(checkpoint, FeatureHead) else load_feature_head(checkpoint, config=config)
    with folder_lock(out_dir):
        return _make_feature_heatmaps(files, head, Path(out_dir), config, slides=path_list(slides),
                                      annotations_dir=annotations_dir, progress=progress)


def _make_feature_heatmaps(files: list[Path], head: FeatureHead, out_dir: Path, config: HeatmapConfig, *,
                           slides: Sequence[str | os.PathLike], annotations_dir: str | os.PathLike | None,
                           progress: ProgressCallback | None) -> HeatmapRun:
    from wsi_milssl.tiling import slide_stem

    by_stem = {slide_stem(Path(s)): Path(s) for s in slides}
    out_dir.mkdir(parents=True, exist_ok=True)
    sha256 = checkpoint_sha256(head)
    fingerprint = _feature_fingerprint(config, head, sha256)
    config_json = atomic_write_json(out_dir / HEATMAP_CONFIG_FILENAME, {
        "heatmap": config_to_dict(config), "source": "features",
        "checkpoint": None if head.checkpoint_path is None else os.path.abspath(head.checkpoint_path),
        "fingerprint": fingerprint, "checkpoint_sha256": sha256,
        "features": [str(p) for p in files], "model_name": head.config.get("model_name"), "bag_pooling": head.pooling,
        "feature_encoder": head.encoder, "feature_encoder_weights_sha256": head.encoder_weights_sha256,
        "package_version": __version__}, sort_keys=True)
    status_csv = out_dir / HEATMAP_STATUS_FILENAME
    results: list[HeatmapResult] = []
    emit(progress, ProgressEvent("heatmap", 0, len(files), unit="slide"))
    t_start = time.perf_counter()
    seen: dict[str, Path] = {}
    no_slide: list[str] = []  # slides drawn without a slide file: one warning at the end, not one each
    for path in files:
        t0 = time.perf_counter()
        stem, slide_path = path.stem, None
        try:
            from wsi_milssl.features.schema import read_feature_file

            ff = read_feature_file(path, instance_labels=False)  # the maps never read them
            stem = ff.stem
            if stem in seen:
                raise ConfigError(f"{path}: slide {stem!r} is also in {seen[stem]}; their outputs would collide. Fix: "
                                  "pass one of them.")
            seen[stem] = path
            slide_path = by_stem.get(stem)
            facts = None
            if slide_path is not None:
                facts = _slide_facts(slide_path, config.slide_mpp)
                mismatch = feature_slide_mismatch(ff, slide_path, dimensions=facts[1])
                if mismatch is not None:
                    raise mismatch
            elif ff.attrs.get("slide_path") and Path(str(ff.attrs["slide_path"])).exists():
                slide_path = Path(str(ff.attrs["slide_path"]))
            _check_fit(ff, head)
            if len(ff) == 0:  # an earlier version's predictions go; an empty detections CSV is the slide's
                written = write_empty_slide_outputs(out_dir, stem)
                results.append(HeatmapResult(stem, str(slide_path or ""), "empty", 0, None, 0.0,
                                             f"{path}: no patch, so the slide has no score.", written))
            else:
                probs = head.probabilities(ff.features, batch_size=max(1024, config.batch_size))
                pred = _prediction(ff, probs, slide_path=slide_path, config=config, seconds=time.perf_counter() - t0,
                                   facts=facts, head=head)
                bad = non_finite_error(pred, head)  # a diverged head: fail this slide before writing anything
                if isinstance(bad, StoreError):  # the inputs: name the feature file to check
                    raise StoreError(f"{path}: {bad}")
                if bad is not None:
                    raise bad
                written = write_slide_outputs(pred, out_dir, model=head, config=config, annotations_dir=annotations_dir,
                                              fingerprint=fingerprint, checkpoint_sha256=sha256, no_slide=no_slide)
                score = pred.score(head.pooling)
                update_scores_csv(out_dir, {stem: score})
                results.append(HeatmapResult(stem, str(slide_path or ""), "ok", len(pred), score,
                                             time.perf_counter() - t0, "", {k: str(v) for k, v in written.items()}))
                logger.info("%s: %d patches, score %.4f (%s pooling)", stem, len(pred), score, head.pooling)
        except WsiMilsslError as exc:
            logger.error("%s: failed: %s", stem, exc)
            try:  # an earlier run's files (another head), or this run's half-written ones, must not stay
                remove_slide_outputs(out_dir, stem)
            except OSError as rm_exc:  # the slide is recorded as failed either way
                logger.warning("%s: cannot remove its earlier files from %s (%s); its status row says failed",
                               stem, out_dir, rm_exc)
            results.append(HeatmapResult(stem, str(slide_path or ""), "failed", 0, None, time.perf_counter() - t0,
                                         str(exc)))
        _merge_status(status_csv, results[-1:])  # other slides' rows (earlier calls) stay
        emit(progress, ProgressEvent("heatmap", len(results), len(files), unit="slide", item=stem,
                                     message=results[-1].status))
    drawn_ok = {r.slide for r in results if r.status == "ok"}  # a slide that failed after its maps is a failure
    named = set(seen) | {r.slide for r in results}  # (a file that failed to read still names its slide: review EN)
    _log_unmatched_slides([p for s, p in by_stem.items() if s not in named])
    log_overlays_not_drawn([s for s in no_slide if s in drawn_ok], out_dir)
    return HeatmapRun(tuple(results), out_dir, status_csv, config_json, out_dir / SCORES_FILENAME,
                      seconds=time.perf_counter() - t_start)


def _log_unmatched_slides(slides: Sequence[Path]) -> None:
    """One warning for the slide files given that no feature file names (review EL: they were passed over without
    a word, and the errors of their feature files said to pass the slide the user had passed)."""
    if not slides:
        return
    names = sorted(str(p) for p in slides)
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    logger.warning("%d slide file(s) given match no feature file, so they were not used: %s. A slide is matched to "
                   "its feature file by name (SLIDE.svs to SLIDE.h5, or to the file's slide_stem attribute). Fix: "
                   "name each feature file after its slide, or pass the slides of these feature files.",
                   len(names), shown)


def _check_fit(ff, head: FeatureHead) -> None:
    width = int(ff.features.shape[1]) if ff.features.ndim == 2 else 0
    if len(ff) and head.in_features is not None and width != head.in_features:
        raise StoreError(f"{ff.path}: features of width {width}, but the head was trained on {head.in_features}. Fix: "
                         "pass feature files made with the encoder the head was trained on.")
    from wsi_milssl.features.schema import encoder_label, encoders_differ

    made, trained = (ff.encoder, ff.encoder_weights_sha256), (head.encoder, head.encoder_weights_sha256)
    if encoders_differ(made, trained):
        raise StoreError(f"{ff.path}: features of {encoder_label(*made)}, but the head {head.checkpoint_path} was "
                         f"trained on features of {encoder_label(*trained)}. Fix: pass feature files made with the "
                         "training encoder and weights (`wsi-milssl features --encoder ... --weights ...`).")
    from wsi_milssl.features.schema import settings_differences

    diffs = settings_differences(ff.feature_settings, head.feature_settings)
    if diffs:
        raise StoreError(f"{ff.path}: features made with other settings than those the head {head.checkpoint_path} "
                         f"was trained on ({'; '.join(diffs)}; this file first). Fix: pass feature files made with the "
                         "training settings (the same encoder, weights, encoder options, resolution and patch size).")
    if ff.bag_ids is not None:
        raise StoreError(f"{ff.path}: a file of several bags ('bag_ids') has no slide to draw. Fix: pass one feature "
                         "file per slide.")


def _feature_fingerprint(config: HeatmapConfig, head: FeatureHead, sha256: str | None) -> str | None:
    """What made a feature run's files: the head's bytes (``sha256``), its pooling, the settings (runtime ones
    aside) and the precision predicted at (:func:`~wsi_milssl.inference.stage.resolved_precision`), marked as a feature run so it never equals an image run's fingerprint. None when
    the head has no file on disk (nothing to tell it from another)."""
    if sha256 is None:
        return None
    blob = json.dumps({"checkpoint_sha256": sha256, "heatmap": _fingerprint_settings(config),
                       "pooling": head.pooling, **resolved_precision(head, cpu_auto="off"), "source": "features"},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
