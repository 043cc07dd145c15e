"""Instance and bag AUC with scikit-learn, and ROC curves.

A metric that cannot be computed (no scores, one class only) is returned as a :class:`Metric` whose
``value`` is None and whose ``reason`` says why, so that reports show the gap instead of crashing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sklearn.metrics import roc_auc_score, roc_curve

__all__ = ["Metric", "RocCurve", "auc_metric", "counted", "roc"]


@dataclass(frozen=True)
class Metric:
    """A metric value, or None with the reason it is unavailable; ``n`` items, ``n_positive`` of them
    positive."""

    value: float | None
    reason: str = ""
    n: int = 0
    n_positive: int = 0


@dataclass(frozen=True)
class RocCurve:
    """ROC curve: float64 (K,) false- and true-positive rates and the thresholds (first is +inf)."""

    fpr: np.ndarray
    tpr: np.ndarray
    thresholds: np.ndarray
    auc: float


def counted(n: int, singular: str, plural: str | None = None) -> str:
    """``n`` and the noun in its number: ``counted(1, "slide")`` -> "1 slide", ``counted(3, "slide")`` -> "3 slides";
    ``plural`` where it is not ``singular + "s"`` ("patch", "patches")."""
    return f"{n} {singular if n == 1 else (plural or singular + 's')}"


#: the singular of the item names that :func:`auc_metric` is given
_SINGULAR = {"patches": "patch", "slides": "slide", "items": "item", "instances": "instance", "bags": "bag"}


def _check(labels: np.ndarray, scores: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray, str]:
    y = np.asarray(labels).reshape(-1)
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if y.shape != s.shape:
        raise ValueError(f"{what}: labels and scores must have one length; got {y.shape} and {s.shape}.")
    if not np.isin(y, (0, 1)).all():
        raise ValueError(f"{what}: labels must be 0 or 1.")
    if not np.isfinite(s).all():
        raise ValueError(f"{what}: scores must be finite numbers (found NaN or inf).")
    y = y.astype(np.int64)
    reason = ""
    if y.shape[0] == 0:
        reason = f"no {what} to score"
    elif y.min() == y.max():
        kind = "positive" if y[0] == 1 else "negative"
        which = f"the one {_SINGULAR.get(what, what)} is" if y.shape[0] == 1 else f"all {y.shape[0]} {what} are"
        reason = f"{which} {kind}; AUC needs both classes"
    return y, s, reason


def auc_metric(labels: np.ndarray, scores: np.ndarray, *, what: str = "items") -> Metric:
    """ROC AUC of ``scores`` (float, (N,)) against 0/1 ``labels`` ((N,)), via scikit-learn.

    ``what`` names the items in the reason when the AUC is undefined (e.g. "patches", "slides").
    """
    y, s, reason = _check(labels, scores, what)
    n_pos = int(y.sum())
    if reason:
        return Metric(None, reason, n=int(y.shape[0]), n_positive=n_pos)
    return Metric(float(roc_auc_score(y, s)), n=int(y.shape[0]), n_positive=n_pos)


def roc(labels: np.ndarray, scores: np.ndarray, *, what: str = "items") -> RocCurve | None:
    """The ROC curve (scikit-learn ``roc_curve``; collinear points dropped), or None when one class only."""
    y, s, reason = _check(labels, scores, what)
    if reason:
        return None
    fpr, tpr, thr = roc_curve(y, s, drop_intermediate=True)
    return RocCurve(fpr=fpr, tpr=tpr, thresholds=thr, auc=float(roc_auc_score(y, s)))
