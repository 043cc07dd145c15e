"""Feature mode's evaluation (``wsi-milssl run`` with ``[data] mode = "features"``: feature files without slides):
a trained head's bag AUC, accuracy and loss (and instance AUC where the files carry instance labels) on the test
set's feature files, written to ``metrics.json`` and ``scores.csv`` (``slide,score,label``); no FROC, which needs
slides and annotations (:mod:`wsi_milssl.evaluation.stage`)."""

from __future__ import annotations

import csv
import logging
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from wsi_milssl.atomic import atomic_open, atomic_write_json
from wsi_milssl.errors import ConfigError
from wsi_milssl.evaluation.metrics import auc_metric

__all__ = ["BAG_SCORES_COLUMNS", "check_test_features", "evaluate_feature_bags"]

#: the columns of feature mode's ``scores.csv``: a bag's score (its pooled instance probabilities) and label
BAG_SCORES_COLUMNS = ("slide", "score", "label")

log = logging.getLogger(__name__)


def check_test_features(test, saved: dict, checkpoint: str | os.PathLike) -> None:
    """Refuse test features the head was not trained on: another width, another encoder or weights, or other
    feature settings (resolution, encoder options) where both record them (the rule of ``heatmap --features``
    and ``train --val``). ``test``: the test set's :class:`wsi_milssl.mil.data.InstanceSet`; ``saved``: the
    checkpoint's config."""
    from wsi_milssl.features.schema import encoder_label, encoders_differ, settings_differences

    width = int(test.features.shape[1]) if test.features is not None and test.features.ndim == 2 else None
    trained_width = saved.get("in_features") or (saved.get("model_kwargs") or {}).get("in_features")
    if width is not None and len(test) and trained_width is not None and width != int(trained_width):
        raise ConfigError(f"the test features ({test.source}) have {width} values per patch, but the head "
                          f"{checkpoint} was trained on {int(trained_width)}. Fix: point [data].test_features at "
                          "features made with the training encoder.")
    keys = ("feature_encoder", "feature_encoder_weights_sha256")
    made = tuple(test.settings.get(k) for k in keys)
    trained = tuple((saved.get("store_settings") or {}).get(k) for k in keys)
    if encoders_differ(made, trained):
        raise ConfigError(f"the test features ({test.source}) are of {encoder_label(*made)}, but the head {checkpoint} "
                          f"was trained on features of {encoder_label(*trained)}. Fix: point [data].test_features at "
                          "features made with the training encoder and weights.")
    diffs = settings_differences(test.settings.get("feature_settings") or {},
                                 (saved.get("store_settings") or {}).get("feature_settings") or {})
    if diffs:
        raise ConfigError(f"the test features ({test.source}) were made with other settings than the features the "
                          f"head {checkpoint} was trained on ({'; '.join(diffs)}). Fix: point [data].test_features at "
                          "features made with the training encoder options, resolution and patch size.")


def evaluate_feature_bags(checkpoint: str | os.PathLike, feature_files: Sequence[str | os.PathLike],
                          labels_csv: str | os.PathLike, out_dir: str | os.PathLike) -> dict[str, Any]:
    """Evaluate the head ``checkpoint`` on the bags of ``feature_files`` (labels from ``labels_csv``) into
    ``out_dir``; returns what ``metrics.json`` holds: ``instance_auc``, ``bag_auc``, ``bag_accuracy`` (a bag score above
    ``bag_accuracy_threshold``, 0.5, counts as tumour), ``bag_nll``, ``n_bags``, ``n_instances``, ``checkpoint``,
    ``empty_bags``, ``not_evaluated`` (labelled slides without a bag in ``feature_files``: a labels file of both sets,
    or a test feature file that is missing) and ``reasons`` (why a metric is null).

    A labelled slide whose feature file has no row (TRIDENT writes one for a slide without patches) is a test
    bag with score 0, as image mode scores a slide without patches: left out, a missed tumour slide would
    vanish from the bag metrics (``empty_bags`` names them, and a warning)."""
    from wsi_milssl.config import TrainConfig, config_from_mapping
    from wsi_milssl.mil.checkpoint import load_model
    from wsi_milssl.mil.data import read_feature_files, read_labels_csv
    from wsi_milssl.mil.scores import bag_metrics
    from wsi_milssl.mil.selftrain import evaluate, resolve_runtime

    model, saved = load_model(checkpoint)
    fields = set(TrainConfig.__dataclass_fields__)
    # the one way a saved config is read, naming the checkpoint in its errors (review BQ)
    config = config_from_mapping(TrainConfig, {k: v for k, v in saved.items() if k in fields}, source=str(checkpoint))
    labels = read_labels_csv(labels_csv)
    empty: list[str] = []
    test = read_feature_files(feature_files, labels, empty=empty)
    check_test_features(test, saved, checkpoint)
    metrics = evaluate(model, test, runtime=resolve_runtime(config), bag_pooling=config.bag_pooling)
    read = set(test.bag_names)
    empty = sorted(n for n in dict.fromkeys(empty) if n in labels and n not in read)
    if empty:
        log.warning("%d test slide(s) have feature files without a row (no patches): %s; each counts as a bag "
                    "with score 0 (as a slide without patches in image mode).", len(empty), ", ".join(empty))
    names = [*test.bag_names, *empty]
    # labelled slides without a bag in the files (no feature file): not evaluated, as image mode leaves out a
    # labelled slide without predictions; named, since a lost test file would otherwise only shrink n_bags
    scored = {n.casefold() for n in names}
    missing = sorted((n for n in labels if n.casefold() not in scored), key=str.casefold)
    if missing:
        log.info("%d labelled slide(s) have no bag in the test feature files and are not evaluated (listed in "
                 "metrics.json under not_evaluated): %s%s", len(missing), ", ".join(missing[:20]),
                 " ..." if len(missing) > 20 else "")
    scores = np.concatenate([metrics["bag_scores"], np.zeros(len(empty))])
    bag_labels = np.concatenate([test.bag_labels, [labels[n] for n in empty]]).astype(np.int64)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"instance_auc": metrics["instance_auc"], **bag_metrics(scores, bag_labels)}
    reasons = {}
    if summary["instance_auc"] is None:  # review BS: null without a word
        reasons["instance_auc"] = ("the test feature files hold no instance labels (an instance_label dataset)"
                                   if test.instance_labels is None else "the instance labels are of one class only")
    if summary["bag_auc"] is None:  # review DX: null without a word, where image mode says why
        reasons["bag_auc"] = (auc_metric(bag_labels, scores, what="bags").reason if np.isfinite(scores).all()
                              else "some bag scores are not finite")
    summary.update(n_bags=len(names), n_instances=int(len(test)), checkpoint=str(checkpoint), empty_bags=empty,
                   not_evaluated=missing, bag_accuracy_threshold=0.5, reasons=reasons)
    # metrics.json last, an earlier one removed first: a run stopped between the two never leaves an earlier run's
    # scores beside this run's metrics (review EV; image mode does the same)
    (out / "metrics.json").unlink(missing_ok=True)
    with atomic_open(out / "scores.csv", "w") as fh:
        writer = csv.writer(fh)
        writer.writerow(BAG_SCORES_COLUMNS)
        for name, score, label in zip(names, scores, bag_labels):
            writer.writerow([name, f"{score:.6f}", int(label)])
    atomic_write_json(out / "metrics.json", summary)
    return summary
