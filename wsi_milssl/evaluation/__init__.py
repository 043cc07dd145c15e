"""Evaluation: instance and bag AUC (scikit-learn), the CAMELYON16 FROC, plots and an HTML report."""

from wsi_milssl.evaluation.froc import (
    CAMELYON16_DOWNSAMPLE,
    CAMELYON16_MPP,
    FP_RATES,
    ITC_MAJOR_AXIS_UM,
    MARGIN_UM,
    EvaluationMask,
    FrocCurve,
    SlideMatch,
    evaluation_mask,
    froc_curve,
    froc_score,
    interpolate_sensitivity,
    match_detections,
)
from wsi_milssl.evaluation.inputs import (
    Detections,
    find_predictions,
    read_detections,
    read_labels,
    read_patch_probs,
    read_scores,
    resolve_slides,
)
from wsi_milssl.evaluation.metrics import Metric, RocCurve, auc_metric, roc
from wsi_milssl.evaluation.report import ReportData, render_report_html, write_report
from wsi_milssl.evaluation.stage import EvaluationResult, SlideResult, evaluate_predictions, outdated_metrics

__all__ = [
    "CAMELYON16_DOWNSAMPLE",
    "CAMELYON16_MPP",
    "FP_RATES",
    "ITC_MAJOR_AXIS_UM",
    "MARGIN_UM",
    "Detections",
    "EvaluationMask",
    "EvaluationResult",
    "FrocCurve",
    "Metric",
    "ReportData",
    "RocCurve",
    "SlideMatch",
    "SlideResult",
    "auc_metric",
    "evaluate_predictions",
    "evaluation_mask",
    "find_predictions",
    "froc_curve",
    "froc_score",
    "interpolate_sensitivity",
    "match_detections",
    "outdated_metrics",
    "read_detections",
    "read_labels",
    "read_patch_probs",
    "read_scores",
    "render_report_html",
    "resolve_slides",
    "roc",
    "write_report",
]
