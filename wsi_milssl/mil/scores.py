"""Bag scores from instance probabilities (paper eq. 11), the bag and instance metrics a run reports, and the
validation score that chooses ``best.pt`` (``select_metric``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from wsi_milssl.config.train import TrainConfig
from wsi_milssl.errors import ConfigError

if TYPE_CHECKING:
    from wsi_milssl.mil.data import InstanceSet

__all__ = ["bag_scores", "auc_or_none", "bag_metrics", "selection_problem", "selection_score"]


def bag_scores(probs: np.ndarray, bag_ids: np.ndarray, n_bags: int, *, pooling: str = "max") -> np.ndarray:
    """Bag scores (eq. 11): max (or mean) of the instance probabilities of each bag; float64 (n_bags,).

    A bag without instances scores NaN.
    """
    probs = np.asarray(probs, dtype=np.float64)
    if pooling == "max":
        out = np.full(n_bags, -np.inf)
        np.maximum.at(out, bag_ids, probs)
        out[np.isneginf(out)] = np.nan
        return out
    if pooling == "mean":
        sums = np.bincount(bag_ids, weights=probs, minlength=n_bags)
        counts = np.bincount(bag_ids, minlength=n_bags)
        with np.errstate(invalid="ignore", divide="ignore"):
            return sums / counts
    raise ConfigError(f"bag pooling must be 'max' or 'mean'; got {pooling!r}.")


def auc_or_none(y: np.ndarray, score: np.ndarray) -> float | None:
    """ROC AUC of ``score`` for the 0/1 labels ``y`` over the finite scores; None when one class is missing."""
    from sklearn.metrics import roc_auc_score

    ok = np.isfinite(score)
    y, score = y[ok], score[ok]
    if y.size == 0 or y.min() == y.max():
        return None
    return float(roc_auc_score(y, score))


def bag_metrics(scores: np.ndarray, labels: np.ndarray, *, threshold: float = 0.5) -> dict[str, float | None]:
    """``bag_auc``, ``bag_accuracy`` (score > ``threshold``) and ``bag_nll`` (mean binary cross-entropy, scores
    clipped to [1e-7, 1 - 1e-7]) of bag ``scores`` against 0/1 ``labels``; None where undefined."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels).astype(np.int64)
    clipped = np.clip(scores, 1e-7, 1 - 1e-7)
    nll = float(-np.mean(labels * np.log(clipped) + (1 - labels) * np.log1p(-clipped))) if scores.size else None
    return {
        "bag_auc": auc_or_none(labels, scores),
        "bag_accuracy": float(np.mean((scores > threshold) == (labels == 1))) if scores.size else None,
        "bag_nll": nll,
    }


def selection_problem(val: InstanceSet, select_metric: str) -> str | None:
    """Why ``select_metric`` can never be computed on ``val`` (so no epoch could be chosen for best.pt), or
    None: bag AUC needs bags of both labels, instance AUC instance labels of both classes. ``bag_nll`` is
    defined with one class."""
    def only(values: np.ndarray) -> str:
        return "normal (label 0)" if int(values.max(initial=0)) == 0 else "tumour (label 1)"

    if select_metric == "bag_auc" and np.unique(val.bag_labels).size < 2:
        which = ("the one validation slide (bag) is" if val.n_bags == 1
                 else f"the {val.n_bags} validation slides (bags) are all")
        return f"{which} {only(val.bag_labels)}: bag AUC cannot be computed"
    if select_metric == "instance_auc":
        if val.instance_labels is None:
            return ("the validation slides have no instance labels (annotations; `wsi-milssl label`): instance AUC "
                    "cannot be computed")
        if np.unique(val.instance_labels).size < 2:
            return (f"every instance (patch) of the validation slides is {only(val.instance_labels)}: instance AUC "
                    "cannot be computed")
    return None


def _check_selectable(val: InstanceSet, config: TrainConfig) -> None:
    """Refuse, before training, a validation set on which ``config.select_metric`` is never defined: the run
    would train to the end without choosing a best.pt."""
    problem = selection_problem(val, config.select_metric)
    if problem is None:
        return
    if config.select_metric == "instance_auc" and val.instance_labels is None:
        more = "label the validation slides (`wsi-milssl label STORES --annotations ...`) or choose another metric"
    else:
        more = ("validate on slides of both classes (more validation slides; in a pipeline more training slides of "
                "the missing class: its split holds out a slide of a class only from two training slides of it on, "
                "whatever [data].val_fraction)")
    names = ", ".join(val.bag_names[:5]) + (f" and {val.n_bags - 5} more" if val.n_bags > 5 else "")
    raise ConfigError(f"validation slides {names}: {problem}, so no epoch could be chosen for best.pt "
                      f"(select_metric {config.select_metric!r}). Fix: choose best.pt by the validation bag loss, "
                      "which is defined with one class (--select-metric bag_nll; select_metric = \"bag_nll\" in "
                      f"a pipeline's [train]), or {more}.")


def selection_score(metrics: dict[str, Any], select_metric: str) -> tuple[float, float] | None:
    """Higher is better; None when the metric is undefined (e.g. one class only)."""
    nll = metrics.get("bag_nll")
    tie = -nll if nll is not None else -math.inf
    if select_metric == "bag_nll":
        return None if nll is None else (-nll, 0.0)
    value = metrics.get(select_metric)
    if value is None:
        return None
    return (float(value), tie)
