"""Evaluation: instance and bag AUC (scikit-learn), the CAMELYON16 FROC, plots and an HTML report.

- :mod:`~wsi_milssl.evaluation.stage`: the stage (:func:`evaluate_predictions`).
- :mod:`~wsi_milssl.evaluation.froc`: the challenge's FROC (evaluation masks, matching, score).
- :mod:`~wsi_milssl.evaluation.protocol`: the challenge's constants and the FROC protocol in words (light).
- :mod:`~wsi_milssl.evaluation.metrics`, :mod:`~wsi_milssl.evaluation.report`, :mod:`~wsi_milssl.evaluation.inputs`.
"""

from wsi_milssl.lazy import lazy_exports

#: Public name -> the module that defines it. Imported on first use (PEP 562): `run` checks an evaluation
#: (:func:`outdated_metrics`) without importing scikit-learn, scikit-image and matplotlib.
_EXPORTS = {
    "CAMELYON16_DOWNSAMPLE": "wsi_milssl.evaluation.protocol",
    "CAMELYON16_MPP": "wsi_milssl.evaluation.protocol",
    "Detections": "wsi_milssl.evaluation.inputs",
    "EvaluationMask": "wsi_milssl.evaluation.froc",
    "EvaluationResult": "wsi_milssl.evaluation.stage",
    "FP_RATES": "wsi_milssl.evaluation.protocol",
    "FrocCurve": "wsi_milssl.evaluation.froc",
    "ITC_MAJOR_AXIS_UM": "wsi_milssl.evaluation.protocol",
    "MARGIN_UM": "wsi_milssl.evaluation.protocol",
    "Metric": "wsi_milssl.evaluation.metrics",
    "ReportData": "wsi_milssl.evaluation.report",
    "RocCurve": "wsi_milssl.evaluation.metrics",
    "SlideMatch": "wsi_milssl.evaluation.froc",
    "SlideResult": "wsi_milssl.evaluation.stage",
    "auc_metric": "wsi_milssl.evaluation.metrics",
    "evaluate_predictions": "wsi_milssl.evaluation.stage",
    "evaluation_mask": "wsi_milssl.evaluation.froc",
    "find_predictions": "wsi_milssl.evaluation.inputs",
    "froc_curve": "wsi_milssl.evaluation.froc",
    "froc_protocol_summary": "wsi_milssl.evaluation.protocol",
    "froc_score": "wsi_milssl.evaluation.froc",
    "interpolate_sensitivity": "wsi_milssl.evaluation.froc",
    "match_detections": "wsi_milssl.evaluation.froc",
    "outdated_metrics": "wsi_milssl.evaluation.protocol",
    "read_detections": "wsi_milssl.evaluation.inputs",
    "read_labels": "wsi_milssl.evaluation.inputs",
    "read_patch_probs": "wsi_milssl.evaluation.inputs",
    "read_scores": "wsi_milssl.evaluation.inputs",
    "render_report_html": "wsi_milssl.evaluation.report",
    "resolve_slides": "wsi_milssl.evaluation.inputs",
    "roc": "wsi_milssl.evaluation.metrics",
    "write_report": "wsi_milssl.evaluation.report",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


__all__ = sorted(_EXPORTS)
