"""The classical MIL benchmark protocol with honest nested cross-validation.

Outer loop: stratified k-fold over bags. Inside each outer training split only, an inner stratified
k-fold grid search picks μ, T (the adaptive-μ ramp) and the number of epochs, and calibrates the bag
threshold on the inner out-of-fold bag scores. The chosen setting is retrained on the whole outer
training split and scored once on the outer test fold, which nothing else ever sees.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from typing import Any

import numpy as np

from wsi_milssl.config.train import BenchmarkConfig, TrainConfig
from wsi_milssl.errors import ConfigError
from wsi_milssl.events import ProgressCallback, ProgressEvent, emit
from wsi_milssl.mil.data import InstanceSet
from wsi_milssl.mil.selftrain import _auc, fit

__all__ = ["nested_cross_validation", "best_threshold", "summarise"]

log = logging.getLogger(__name__)


def best_threshold(scores: np.ndarray, labels: np.ndarray) -> float:
    """The bag-score threshold with the highest accuracy on (scores, labels): the midpoint between two
    consecutive distinct scores (ties broken toward the threshold closest to 0.5)."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels).astype(bool)
    ok = np.isfinite(scores)
    scores, labels = scores[ok], labels[ok]
    if scores.size == 0:
        return 0.5
    uniq = np.unique(scores)
    cands = np.concatenate([[uniq[0] - 1e-9], (uniq[1:] + uniq[:-1]) / 2.0, [uniq[-1] + 1e-9], [0.5]])
    acc = np.array([np.mean((scores > t) == labels) for t in cands])
    best = np.flatnonzero(acc == acc.max())
    return float(cands[best[np.argmin(np.abs(cands[best] - 0.5))]])


def _metric(scores: np.ndarray, labels: np.ndarray, name: str) -> float:
    if name == "auc":
        value = _auc(labels.astype(np.int64), scores)
        return -math.inf if value is None else value
    return float(np.mean((scores > 0.5) == (labels == 1)))


def _stratified(labels: np.ndarray, n_splits: int, seed: int):
    from sklearn.model_selection import StratifiedKFold

    counts = np.bincount(labels.astype(np.int64), minlength=2)
    if counts.min() < n_splits:
        raise ConfigError(f"only {counts.min()} bags of the rarer class for {n_splits} folds; use fewer folds.")
    return StratifiedKFold(n_splits=n_splits, shuffle=True, random_state=seed).split(np.zeros(labels.size), labels)


def nested_cross_validation(instances: InstanceSet, *, train_config: TrainConfig, bench: BenchmarkConfig,
                            progress: ProgressCallback | None = None) -> dict[str, Any]:
    """Run the nested cross-validation of MIL-SSL on a feature InstanceSet.

    Returns a JSON-ready dict: ``folds`` (per outer fold: chosen mu/T/epochs, threshold, test bag accuracy
    at 0.5 and at the calibrated threshold, test AUC), ``summary`` (mean and std of each), the settings
    and the runtime.
    """
    if instances.kind != "features":
        raise ConfigError("the MIL benchmark needs feature instances (a MIL CSV or feature files).")
    labels = instances.bag_labels
    grid = list(itertools.product(bench.mu_grid, bench.ramp_grid))
    max_epochs = max(bench.epoch_grid)
    folds_out: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    total_fits = bench.repeats * bench.folds * (len(grid) * bench.inner_folds + 1)
    fits_done = 0
    for repeat in range(bench.repeats):
        outer_seed = bench.seed + 1000 * repeat
        for fold, (train_bags, test_bags) in enumerate(_stratified(labels, bench.folds, outer_seed)):
            train_set = instances.subset_bags(train_bags)
            test_set = instances.subset_bags(test_bags)
            tr_labels = train_set.bag_labels
            # Inner grid search: out-of-fold bag scores of every (mu, T, epochs) on the training bags.
            oof = {(mu, t, e): np.full(train_set.n_bags, np.nan) for mu, t in grid for e in bench.epoch_grid}
            inner = list(_stratified(tr_labels, bench.inner_folds, outer_seed + 1 + fold))
            for mu, t in grid:
                for k, (in_tr, in_va) in enumerate(inner):
                    cfg = dataclasses.replace(train_config, mu=float(mu), mu_ramp_epochs=int(t),
                                              epochs=max_epochs, seed=train_config.seed + k, plots=False)
                    res = fit(train_set.subset_bags(in_tr), config=cfg, val=train_set.subset_bags(in_va),
                              eval_at=bench.epoch_grid, keep_val_scores=True)
                    for e in bench.epoch_grid:
                        oof[(mu, t, e)][in_va] = res.val_bag_scores[e]
                    fits_done += 1
                    emit(progress, ProgressEvent(stage="benchmark", done=fits_done, total=total_fits, unit="fit",
                                                 item=f"fold {fold + 1}/{bench.folds}"))
            inner_scores = {key: _metric(s, tr_labels, bench.select_metric) for key, s in oof.items()}
            tie = {key: _metric(s, tr_labels, "auc" if bench.select_metric == "accuracy" else "accuracy")
                   for key, s in oof.items()}
            best_key = max(oof, key=lambda key: (inner_scores[key], tie[key]))
            mu, t, e = best_key
            threshold = best_threshold(oof[best_key], tr_labels)
            cfg = dataclasses.replace(train_config, mu=float(mu), mu_ramp_epochs=int(t), epochs=int(e),
                                      plots=False)
            res = fit(train_set, config=cfg, val=test_set, eval_at=[int(e)], keep_val_scores=True)
            fits_done += 1
            scores = res.val_bag_scores[int(e)]
            y = test_set.bag_labels
            row = {
                "repeat": repeat, "fold": fold, "n_train_bags": int(train_set.n_bags),
                "n_test_bags": int(test_set.n_bags), "mu": float(mu), "ramp_epochs": int(t), "epochs": int(e),
                "inner_" + bench.select_metric: float(inner_scores[best_key]),
                "threshold": threshold,
                "accuracy": float(np.mean((scores > threshold) == (y == 1))),
                "accuracy_at_0_5": float(np.mean((scores > 0.5) == (y == 1))),
                "auc": _auc(y.astype(np.int64), scores),
            }
            folds_out.append(row)
            log.info("fold %d: mu %.2f T %d epochs %d -> accuracy %.3f (at 0.5: %.3f) auc %s", fold + 1, mu, t, e,
                     row["accuracy"], row["accuracy_at_0_5"], row["auc"])
            emit(progress, ProgressEvent(stage="benchmark", done=fits_done, total=total_fits, unit="fit",
                                         item=f"fold {fold + 1}/{bench.folds}",
                                         message=f"acc {row['accuracy']:.3f}"))
    return {
        "source": instances.source,
        "n_bags": int(instances.n_bags),
        "n_positive_bags": int((labels == 1).sum()),
        "n_instances": int(len(instances)),
        "benchmark": dataclasses.asdict(bench),
        "train_config": dataclasses.asdict(train_config),
        "folds": folds_out,
        "summary": summarise(folds_out),
        "seconds": time.perf_counter() - t_start,
    }


def summarise(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean and (population) standard deviation over folds of accuracy, accuracy_at_0_5 and auc."""
    out = {}
    for key in ("accuracy", "accuracy_at_0_5", "auc"):
        values = np.array([r[key] for r in rows if r.get(key) is not None], dtype=np.float64)
        out[key] = {"mean": float(values.mean()) if values.size else None,
                    "std": float(values.std()) if values.size else None, "n": int(values.size)}
    return out
