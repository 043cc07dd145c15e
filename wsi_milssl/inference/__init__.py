"""The heatmap stage: per-patch tumour probabilities of whole slides, maps, overlays and exports.

    from wsi_milssl.config import HeatmapConfig
    from wsi_milssl.inference import make_heatmaps

    run = make_heatmaps(["slides/a.tif"], "runs/r1/best.pt", "heatmaps/", HeatmapConfig())

- :mod:`~wsi_milssl.inference.model`: the checkpoint's model ready for inference (BatchNorm folded,
  CUDA autocast on GPU, bfloat16 + channels_last on CPU), the tile recipe it was trained on
  (:class:`~wsi_milssl.tiling.TilingPlan`) and the runtime.
- :mod:`~wsi_milssl.inference.sources`: the reader processes (no torch): slides cut with the
  tile stage's public functions (``wsi_milssl.tiling.plan_slide`` / ``cut_band``) or read from a store.
- :mod:`~wsi_milssl.inference.predict`: the prediction loop, slides or stores -> per-patch
  probabilities, several slides in flight from one pool of readers (:func:`predict_many`).
- :mod:`~wsi_milssl.inference.heatmap`: the probability grid and its overlay on the thumbnail.
- :mod:`~wsi_milssl.inference.colormaps`: the colour-map registry.
- :mod:`~wsi_milssl.inference.feature_maps`: the same files for a feature head over feature files
  (``heatmap --features``).
- :mod:`~wsi_milssl.inference.exports`: ``_probs.npy/.tif/.json``, ``_patches.csv/.geojson``,
  ``_detections.csv`` (non-maximum suppression) and ``scores.csv``.
"""

from wsi_milssl.lazy import lazy_exports

#: Public name -> the module that defines it. Imported on first use (PEP 562), so importing a
#: submodule (the torch-free reader processes import ``inference.sources``) does not import torch.
_EXPORTS = {
    "COLORMAPS": "wsi_milssl.inference.colormaps",
    "CONFIG_FILENAME": "wsi_milssl.inference.stage",
    "HeatmapInput": "wsi_milssl.inference.stage",
    "HeatmapResult": "wsi_milssl.inference.stage",
    "HeatmapRun": "wsi_milssl.inference.stage",
    "InferenceModel": "wsi_milssl.inference.model",
    "InferenceRuntime": "wsi_milssl.inference.model",
    "MEASUREMENT_NAME": "wsi_milssl.inference.exports",
    "Preprocess": "wsi_milssl.inference.model",
    "SCORES_FILENAME": "wsi_milssl.inference.exports",
    "STATUS_FILENAME": "wsi_milssl.inference.stage",
    "SlideInput": "wsi_milssl.inference.predict",
    "SlidePrediction": "wsi_milssl.inference.predict",
    "TilingSettings": "wsi_milssl.inference.model",
    "apply_colormap": "wsi_milssl.inference.colormaps",
    "fuse_batchnorm": "wsi_milssl.inference.model",
    "load_inference_model": "wsi_milssl.inference.model",
    "make_feature_heatmaps": "wsi_milssl.inference.feature_maps",
    "make_heatmaps": "wsi_milssl.inference.stage",
    "match_inputs": "wsi_milssl.inference.stage",
    "nms_detections": "wsi_milssl.inference.exports",
    "output_paths": "wsi_milssl.inference.exports",
    "plan_from_checkpoint_config": "wsi_milssl.inference.model",
    "predict_many": "wsi_milssl.inference.predict",
    "predict_slide": "wsi_milssl.inference.predict",
    "predict_store": "wsi_milssl.inference.predict",
    "run_slides": "wsi_milssl.inference.predict",
    "SlideOutputs": "wsi_milssl.inference.predict",
    "PatchModel": "wsi_milssl.inference.model",
    "probability_grid": "wsi_milssl.inference.heatmap",
    "register_colormap": "wsi_milssl.inference.colormaps",
    "render_overlay": "wsi_milssl.inference.heatmap",
    "resolve_runtime": "wsi_milssl.inference.model",
    "sample_grid": "wsi_milssl.inference.heatmap",
    "update_scores_csv": "wsi_milssl.inference.exports",
    "write_detections_csv": "wsi_milssl.inference.exports",
    "write_patches_csv": "wsi_milssl.inference.exports",
    "write_patches_geojson": "wsi_milssl.inference.exports",
    "write_png": "wsi_milssl.inference.heatmap",
    "write_probs": "wsi_milssl.inference.exports",
    "write_slide_outputs": "wsi_milssl.inference.stage",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


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
    "PatchModel",
    "SlideInput",
    "SlideOutputs",
    "SlidePrediction",
    "TilingSettings",
    "apply_colormap",
    "fuse_batchnorm",
    "load_inference_model",
    "make_feature_heatmaps",
    "make_heatmaps",
    "match_inputs",
    "nms_detections",
    "output_paths",
    "plan_from_checkpoint_config",
    "predict_many",
    "predict_slide",
    "predict_store",
    "run_slides",
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
