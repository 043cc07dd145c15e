"""The heatmap stage: per-patch tumour probabilities of whole slides, maps, overlays and exports.

    from wsi_milssl.config import HeatmapConfig
    from wsi_milssl.inference import make_heatmaps

    run = make_heatmaps(["slides/a.tif"], "runs/r1/best.pt", "heatmaps/", HeatmapConfig())

- :mod:`~wsi_milssl.inference.model`: the checkpoint's model ready for inference (BatchNorm folded,
  CUDA autocast on GPU, bfloat16 + channels_last on CPU), the tile recipe it was trained on
  (:class:`~wsi_milssl.tiling.TilingPlan`) and the runtime.
- :mod:`~wsi_milssl.inference.sources`: DataLoader datasets of patches, cut from a slide with the
  tile stage's public functions (``wsi_milssl.tiling.plan_slide`` / ``cut_band``) or read from a store.
- :mod:`~wsi_milssl.inference.predict`: the prediction loop, slide or store -> per-patch probabilities
  (workers read and decode while the model runs).
- :mod:`~wsi_milssl.inference.heatmap`: the probability grid and its overlay on the thumbnail.
- :mod:`~wsi_milssl.inference.colormaps`: the colour-map registry.
- :mod:`~wsi_milssl.inference.exports`: ``_probs.npy/.tif/.json``, ``_patches.csv/.geojson``,
  ``_detections.csv`` (non-maximum suppression) and ``scores.csv``.
"""

from wsi_milssl.inference.colormaps import COLORMAPS, apply_colormap, register_colormap
from wsi_milssl.inference.exports import (
    MEASUREMENT_NAME,
    SCORES_FILENAME,
    nms_detections,
    output_paths,
    update_scores_csv,
    write_detections_csv,
    write_patches_csv,
    write_patches_geojson,
    write_probs,
)
from wsi_milssl.inference.heatmap import probability_grid, render_overlay, sample_grid, write_png
from wsi_milssl.inference.model import (
    InferenceModel,
    InferenceRuntime,
    Preprocess,
    TilingSettings,
    fuse_batchnorm,
    load_inference_model,
    plan_from_checkpoint_config,
    resolve_runtime,
)
from wsi_milssl.inference.predict import SlidePrediction, predict_slide, predict_store
from wsi_milssl.inference.stage import (
    CONFIG_FILENAME,
    STATUS_FILENAME,
    HeatmapInput,
    HeatmapResult,
    HeatmapRun,
    make_heatmaps,
    match_inputs,
    write_slide_outputs,
)

__all__ = [
    "COLORMAPS",
    "CONFIG_FILENAME",
    "MEASUREMENT_NAME",
    "SCORES_FILENAME",
    "STATUS_FILENAME",
    "HeatmapInput",
    "HeatmapResult",
    "HeatmapRun",
    "InferenceModel",
    "InferenceRuntime",
    "Preprocess",
    "SlidePrediction",
    "TilingSettings",
    "apply_colormap",
    "fuse_batchnorm",
    "load_inference_model",
    "make_heatmaps",
    "match_inputs",
    "nms_detections",
    "output_paths",
    "plan_from_checkpoint_config",
    "predict_slide",
    "predict_store",
    "probability_grid",
    "register_colormap",
    "render_overlay",
    "resolve_runtime",
    "sample_grid",
    "update_scores_csv",
    "write_detections_csv",
    "write_patches_csv",
    "write_patches_geojson",
    "write_png",
    "write_probs",
    "write_slide_outputs",
]
