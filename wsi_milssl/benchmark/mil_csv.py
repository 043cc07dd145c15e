"""The classical MIL benchmark protocol: every method under the same honest nested cross-validation.

Outer loop: stratified k-fold over bags (``BenchmarkConfig.folds``; the same split for every method).
Inside each outer training split only, the same stratified inner folds serve every method: each grid
point of a method is trained on every inner training part and scored on the inner held-out bags, and the
out-of-fold (OOF) bag scores of the whole training split pick the grid point and the number of epochs
(by ``select_metric``, ties by the other of AUC/accuracy) and calibrate the bag threshold. The chosen
setting, trained on the whole outer training split, is scored once on the outer test fold; with the
``ensemble`` option the test score is the mean of that model and the chosen setting's inner-fold models.
Nothing is ever chosen on an outer test fold.

Speed: the grid points x (inner folds + the whole split) of one outer fold are one stack of models
trained at once (:mod:`wsi_milssl.benchmark.stacked`), evaluated at every epoch of the epoch grid.

Methods (:data:`METHODS`) are named :class:`MethodSpec` s: a kind (``mil-ssl``, ``abmil``,
``gated-abmil``, ``maxpool``), fixed settings, a hyperparameter grid and an epoch grid of comparable
size. ``mil-ssl-paper`` is the paper's method and grids; ``mil-ssl-improved`` the improved MIL-SSL;
``mil-ssl`` is whichever :data:`DEFAULT_PRESET` names. The ``mil-ssl-improved-no-*`` methods are the
ablation rows (the improved method with one change undone).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from wsi_milssl.config.train import BenchmarkConfig
from wsi_milssl.errors import ConfigError
from wsi_milssl.events import ProgressCallback, ProgressEvent, emit
from wsi_milssl.mil.data import InstanceSet
from wsi_milssl.mil.scores import auc_or_none
from wsi_milssl.runtime import restores_torch_settings

__all__ = ["MethodSpec", "METHODS", "PRESETS", "DEFAULT_PRESET", "resolve_methods", "nested_cross_validation",
           "best_threshold", "logistic_threshold", "platt_fit", "calibrated_ensemble", "summarise", "format_table",
           "format_markdown", "DATA_KEYS", "PROTOCOL_KEYS", "result_differences", "read_saved_runs"]

log = logging.getLogger(__name__)

KINDS = ("mil-ssl", "abmil", "gated-abmil", "maxpool")
#: how the bag threshold is set: accuracy-best on the inner OOF scores, a logistic fit on them, 0.5, or
#: "calibrated": every model's scores Platt-scaled on its own inner held-out bags, the ensemble the mean of
#: the calibrated log-odds, threshold 1/2 (:func:`calibrated_ensemble`)
THRESHOLDS = ("inner", "logistic", "0.5", "calibrated")
#: grid keys each kind searches or fixes (anything else is a ConfigError)
GRID_KEYS = {
    "mil-ssl": ("mu", "ramp_epochs", "lr", "weight_decay", "dropout", "pooling", "bag_balanced"),
    "abmil": ("lr", "weight_decay", "attention_dim", "dropout"),
    "gated-abmil": ("lr", "weight_decay", "attention_dim", "dropout"),
    "maxpool": ("lr", "weight_decay", "dropout"),
}
FIXED_KEYS = {
    "mil-ssl": ("hidden_dims", "batch_size", "lam", "fixed_mu", "soft_labels", "local_constraint",
                "global_constraint", "class_balanced", "warmup_epochs", "pseudo_negative_weight", "bag_loss_weight",
                "target_momentum", "bag_context", "neighbours", "input_noise", "weight_average_epochs", "mixup",
                "cross_fit", "per_bag_mu", "rff_dim", "confidence_power", "rank_gauss_inputs"),
    "abmil": ("hidden_dims", "bags_per_batch"),
    "gated-abmil": ("hidden_dims", "bags_per_batch"),
    "maxpool": ("hidden_dims", "bags_per_batch"),
}
DEFAULTS = {
    "mil-ssl": {"mu": 0.15, "ramp_epochs": 10, "lr": 1e-3, "weight_decay": 1e-4, "dropout": 0.5, "pooling": "max",
                "hidden_dims": (256,), "batch_size": 512, "lam": 25.0, "fixed_mu": False, "soft_labels": True,
                "local_constraint": True, "global_constraint": True, "class_balanced": False, "warmup_epochs": 0,
                "bag_balanced": False, "pseudo_negative_weight": 1.0, "bag_loss_weight": 0.0, "target_momentum": 0.0,
                "bag_context": False, "neighbours": 0, "input_noise": 0.0, "weight_average_epochs": 0.0, "mixup": 0.0,
                "cross_fit": False, "per_bag_mu": False, "rff_dim": 0,
                "confidence_power": 0.0, "rank_gauss_inputs": False},
    "abmil": {"lr": 1e-3, "weight_decay": 1e-4, "attention_dim": 64, "dropout": 0.0, "hidden_dims": (128, 64),
              "bags_per_batch": 8},
}
DEFAULTS["gated-abmil"] = dict(DEFAULTS["abmil"])
DEFAULTS["maxpool"] = {k: v for k, v in DEFAULTS["abmil"].items() if k != "attention_dim"}


@dataclass(frozen=True)
class MethodSpec:
    """One benchmark row: ``kind`` trained with ``fixed`` settings, ``grid`` searched on inner folds
    (every combination) at every epoch count of ``epoch_grid``; ``ensemble``: test score = mean of the
    chosen setting's model on the whole split and its inner-fold models; ``threshold``: "inner" (the
    accuracy-best threshold on the OOF scores), "logistic" (where a logistic fit on them crosses 1/2),
    "0.5", or "calibrated" (each model Platt-scaled on its own held-out bags before the ensemble mean,
    :func:`calibrated_ensemble`); ``whole_seeds``: how many models (seeds) of the
    chosen setting are trained on the whole split (their mean is its test score); 0 with ``ensemble``:
    none, the test score is the mean of the inner-fold models alone (the models whose out-of-fold scores
    chose the setting and calibrated the threshold, so test and calibration scores share one scale)."""

    name: str
    kind: str
    grid: tuple[tuple[str, tuple], ...] = ()
    fixed: tuple[tuple[str, Any], ...] = ()
    epoch_grid: tuple[int, ...] = (50, 100)
    ensemble: bool = False
    threshold: str = "inner"
    whole_seeds: int = 1
    description: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"method {self.name!r}: kind must be one of {', '.join(KINDS)}; got {self.kind!r}.")
        for key, values in self.grid:
            if key not in GRID_KEYS[self.kind]:
                raise ConfigError(f"method {self.name!r}: {self.kind} cannot search {key!r}; its grid keys are "
                                  f"{', '.join(GRID_KEYS[self.kind])}.")
            if not values:
                raise ConfigError(f"method {self.name!r}: the grid of {key!r} is empty; give at least one value.")
        for key, _ in self.fixed:
            if key not in GRID_KEYS[self.kind] + FIXED_KEYS[self.kind]:
                raise ConfigError(f"method {self.name!r}: unknown setting {key!r} for {self.kind}; known: "
                                  f"{', '.join(GRID_KEYS[self.kind] + FIXED_KEYS[self.kind])}.")
        if not self.epoch_grid or any((not isinstance(e, int)) or e < 1 for e in self.epoch_grid):
            raise ConfigError(f"method {self.name!r}: epoch_grid needs positive integers; got {self.epoch_grid!r}.")
        if not isinstance(self.whole_seeds, int) or self.whole_seeds < 0:
            raise ConfigError(f"method {self.name!r}: whole_seeds must be an integer >= 0; got {self.whole_seeds!r}.")
        if self.whole_seeds == 0 and not self.ensemble:
            raise ConfigError(f"method {self.name!r}: whole_seeds = 0 (no model on the whole split) needs "
                              f"ensemble = True (the test score is then the mean of the inner-fold models).")
        if self.threshold not in THRESHOLDS:
            raise ConfigError(f"method {self.name!r}: threshold must be one of {', '.join(THRESHOLDS)}; "
                              f"got {self.threshold!r}.")

    def settings(self) -> dict[str, Any]:
        """Defaults of the kind, then ``fixed``."""
        out = dict(DEFAULTS[self.kind])
        out.update(dict(self.fixed))
        return out

    def points(self) -> list[dict[str, Any]]:
        """Every grid combination (training settings; ``pooling`` is applied after training)."""
        keys = [k for k, _ in self.grid]
        return [dict(zip(keys, combo)) for combo in itertools.product(*[v for _, v in self.grid])]

    def grid_size(self) -> int:
        return len(self.points()) * len(self.epoch_grid)

    def with_overrides(self, overrides: dict[str, tuple], epoch_grid: tuple[int, ...] | None) -> "MethodSpec":
        """This spec with the grids in ``overrides`` replaced where this spec searches that key (a key it
        does not search is left alone: the paper preset keeps its learning rate, the improved one its
        fixed μ)."""
        grid = dict(self.grid)
        fixed = dict(self.fixed)
        for key, values in overrides.items():
            if key in grid:
                grid[key] = tuple(values)
        return dataclasses.replace(self, grid=tuple(grid.items()), fixed=tuple(fixed.items()),
                                   epoch_grid=tuple(epoch_grid) if epoch_grid else self.epoch_grid)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "grid": {k: list(v) for k, v in self.grid},
                "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.settings().items()},
                "epoch_grid": list(self.epoch_grid), "ensemble": self.ensemble, "threshold": self.threshold,
                "whole_seeds": self.whole_seeds,
                "grid_size": self.grid_size(), "description": self.description}


_BASELINE_GRID = (("lr", (3e-4, 1e-3)), ("weight_decay", (1e-4, 1e-2)))
_PAPER = MethodSpec(
    name="mil-ssl-paper", kind="mil-ssl",
    grid=(("mu", (0.1, 0.15, 0.2, 0.25)), ("ramp_epochs", (5, 10, 20, 40))),
    epoch_grid=(50, 100),
    description="the paper's method: μ, T grids of the paper, λ = 25, max pooling, one model",
)
_IMPROVED = MethodSpec(
    name="mil-ssl-improved", kind="mil-ssl",
    grid=(("mu", (0.5, 0.9)), ("lr", (1e-3, 3e-3)), ("pooling", ("mean", "top-half"))),
    fixed=(("fixed_mu", True), ("warmup_epochs", 5), ("bag_balanced", True), ("batch_size", 64),
           ("dropout", 0.0)),
    epoch_grid=(25, 50, 100),
    ensemble=True,
    threshold="calibrated",
    description="μ ∈ {0.5, 0.9} (fixed), 5 warm-up epochs, every bag one share of the loss, 64 instances "
                "per step, no dropout, Adam at two rates, bag pooling chosen on the inner folds (mean, mean of "
                "the top half), ensemble of the inner-fold models, each model Platt-scaled on its own held-out inner "
                "bags before the ensemble mean (threshold 1/2); 24 candidates like the baselines",
)


def _ablation(name: str, spec: MethodSpec, description: str, **changes) -> MethodSpec:
    grid = dict(spec.grid)
    fixed = dict(spec.fixed)
    for key, value in changes.get("grid", {}).items():
        grid[key] = value
    for key, value in changes.get("fixed", {}).items():
        grid.pop(key, None)
        fixed[key] = value
    return dataclasses.replace(spec, name=name, grid=tuple(grid.items()), fixed=tuple(fixed.items()),
                               ensemble=changes.get("ensemble", spec.ensemble),
                               threshold=changes.get("threshold", spec.threshold), description=description)


#: presets of MIL-SSL: ``--preset`` picks which one ``mil-ssl`` means
PRESETS: dict[str, MethodSpec] = {"paper": _PAPER, "improved": _IMPROVED}
DEFAULT_PRESET = "improved"

METHODS: dict[str, MethodSpec] = {
    "mil-ssl-paper": _PAPER,
    "mil-ssl-improved": _IMPROVED,
    "abmil": MethodSpec(name="abmil", kind="abmil", grid=_BASELINE_GRID + (("attention_dim", (64, 128)),),
                        epoch_grid=(25, 50, 100), description="attention MIL (Ilse et al. 2018)"),
    "gated-abmil": MethodSpec(name="gated-abmil", kind="gated-abmil",
                              grid=_BASELINE_GRID + (("attention_dim", (64, 128)),),
                              epoch_grid=(25, 50, 100), description="gated attention MIL"),
    "maxpool": MethodSpec(name="maxpool", kind="maxpool", grid=_BASELINE_GRID + (("dropout", (0.0, 0.25)),),
                          epoch_grid=(25, 50, 100), description="instance-level max-pooling MIL (mi-Net style)"),
    # the baseline with the improved MIL-SSL's protocol options (a fairness check, not a preset)
    "abmil-ensemble-calibrated": MethodSpec(name="abmil-ensemble-calibrated", kind="abmil",
                                            grid=_BASELINE_GRID + (("attention_dim", (64, 128)),),
                                            epoch_grid=(25, 50, 100), ensemble=True, threshold="calibrated",
                                            description="ABMIL with the improved MIL-SSL's ensemble of the "
                                                        "inner-fold models, each calibrated on its held-out bags"),
    # ablation rows: the improved method with one change undone
    "mil-ssl-improved-no-ensemble": _ablation("mil-ssl-improved-no-ensemble", _IMPROVED,
                                              "improved, one model (no inner-fold ensemble)", ensemble=False),
    "mil-ssl-improved-max-pooling": _ablation("mil-ssl-improved-max-pooling", _IMPROVED,
                                              "improved, max pooling only (eq. 11)", fixed={"pooling": "max"}),
    "mil-ssl-improved-no-bag-balance": _ablation("mil-ssl-improved-no-bag-balance", _IMPROVED,
                                                 "improved, every instance one share of the loss (large bags "
                                                 "dominate)", fixed={"bag_balanced": False}),
    "mil-ssl-improved-batch-512": _ablation("mil-ssl-improved-batch-512", _IMPROVED,
                                            "improved, 512 instances per step (the paper's feature batch)",
                                            fixed={"batch_size": 512}),
    "mil-ssl-improved-batch-32": _ablation("mil-ssl-improved-batch-32", _IMPROVED,
                                           "improved, 32 instances per step", fixed={"batch_size": 32}),
    "mil-ssl-improved-top2": _ablation("mil-ssl-improved-top2", _IMPROVED,
                                       "improved with the mean of the top two instead of the top half",
                                       grid={"pooling": ("mean", "top2")}),
    "mil-ssl-improved-no-warmup": _ablation("mil-ssl-improved-no-warmup", _IMPROVED,
                                            "improved, first refresh before any training", fixed={"warmup_epochs": 0}),
    "mil-ssl-improved-paper-mu": _ablation("mil-ssl-improved-paper-mu", _IMPROVED,
                                           "improved with the paper's μ grid and ramp",
                                           grid={"mu": (0.1, 0.15, 0.2, 0.25)}, fixed={"fixed_mu": False,
                                                                                        "ramp_epochs": 10}),
    "mil-ssl-improved-class-balanced": _ablation("mil-ssl-improved-class-balanced", _IMPROVED,
                                                 "improved plus a class-balanced loss (not adopted)",
                                                 fixed={"class_balanced": True}),
    "mil-ssl-improved-accuracy-threshold": _ablation("mil-ssl-improved-accuracy-threshold", _IMPROVED,
                                                     "improved, bag threshold at the accuracy-best cut of the "
                                                     "inner out-of-fold scores", threshold="inner"),
    "mil-ssl-improved-pu": _ablation("mil-ssl-improved-pu", _IMPROVED,
                                     "improved, positive bags teach positives only (pseudo_negative_weight 0; "
                                     "tried on the development sets, not adopted)",
                                     fixed={"pseudo_negative_weight": 0.0}),
    "mil-ssl-improved-logistic-threshold": _ablation("mil-ssl-improved-logistic-threshold", _IMPROVED,
                                                     "improved, raw ensemble mean with the threshold where a "
                                                     "logistic fit on the inner out-of-fold scores crosses 1/2 "
                                                     "(the threshold of an earlier preset)", threshold="logistic"),
    "mil-ssl-improved-bag-loss": _ablation("mil-ssl-improved-bag-loss", _IMPROVED,
                                           "improved plus a max-pooled bag cross-entropy term (bag_loss_weight "
                                           "1; tried on the development sets, not adopted)",
                                           fixed={"bag_loss_weight": 1.0}),
    "mil-ssl-improved-dropout-0.5": _ablation("mil-ssl-improved-dropout-0.5", _IMPROVED,
                                              "improved with dropout 0.5 in the instance classifier (the "
                                              "previous preset)", fixed={"dropout": 0.5}),
    "mil-ssl-improved-target-momentum": _ablation("mil-ssl-improved-target-momentum", _IMPROVED,
                                                  "improved, pseudo labels averaged over refreshes (target_momentum "
                                                  "0.7; tried on the development sets, not adopted)",
                                                  fixed={"target_momentum": 0.7}),
    "mil-ssl-improved-bag-context": _ablation("mil-ssl-improved-bag-context", _IMPROVED,
                                              "improved, every instance also sees its bag's mean features "
                                              "(bag_context; tried on the development sets, not adopted)",
                                              fixed={"bag_context": True}),
    "mil-ssl-improved-neighbours": _ablation("mil-ssl-improved-neighbours", _IMPROVED,
                                             "improved, before every refresh P averaged over each instance and "
                                             "its 5 nearest positive-bag instances of the model's own training "
                                             "bags (neighbours; tried on the development sets, not adopted)",
                                             fixed={"neighbours": 5}),
    "mil-ssl-improved-input-noise": _ablation("mil-ssl-improved-input-noise", _IMPROVED,
                                              "improved, N(0, 0.3²) added to every standardised feature of "
                                              "every training step (input_noise; tried on the development sets, "
                                              "not adopted)", fixed={"input_noise": 0.3}),
    "mil-ssl-improved-weight-average": _ablation("mil-ssl-improved-weight-average", _IMPROVED,
                                                 "improved, refreshes and scores from a moving average of the "
                                                 "weights over about 3 epochs of steps (weight_average_epochs; "
                                                 "tried on the development sets, not adopted)",
                                                 fixed={"weight_average_epochs": 3.0}),
    "mil-ssl-improved-hidden-64": _ablation("mil-ssl-improved-hidden-64", _IMPROVED,
                                            "improved with a narrower instance classifier: one hidden layer of "
                                            "64 units instead of 256 (tried on the development sets, not "
                                            "adopted)", fixed={"hidden_dims": (64,)}),
    "mil-ssl-improved-hidden-512": _ablation("mil-ssl-improved-hidden-512", _IMPROVED,
                                             "improved with a wider instance classifier: one hidden layer of 512 "
                                             "units instead of 256 (tried on the development sets, not "
                                             "adopted)", fixed={"hidden_dims": (512,)}),
    "mil-ssl-improved-hidden-128-64": _ablation("mil-ssl-improved-hidden-128-64", _IMPROVED,
                                                "improved with the baselines' encoder as the instance classifier: "
                                                "hidden layers of 128 and 64 units instead of one of 256, no "
                                                "dropout (tried on the development sets)",
                                                fixed={"hidden_dims": (128, 64)}),
    "mil-ssl-improved-lam-5": _ablation("mil-ssl-improved-lam-5", _IMPROVED,
                                        "improved with softer pseudo labels: Sinkhorn sharpness λ = 5 instead of "
                                        "25 (tried on the development sets, not adopted)", fixed={"lam": 5.0}),
    "mil-ssl-improved-lam-2": _ablation("mil-ssl-improved-lam-2", _IMPROVED,
                                        "improved with much softer pseudo labels: λ = 2 instead of 25 (tried on "
                                        "the development sets, not adopted)", fixed={"lam": 2.0}),
    "mil-ssl-improved-mu-0.95": _ablation("mil-ssl-improved-mu-0.95", _IMPROVED,
                                          "improved with μ ∈ {0.5, 0.95} instead of {0.5, 0.9} (the inner folds "
                                          "chose the upper end on most development sets; tried there, not "
                                          "adopted)", grid={"mu": (0.5, 0.95)}),
    "mil-ssl-improved-mixup": _ablation("mil-ssl-improved-mixup", _IMPROVED,
                                        "improved, every step on mixed pairs of instances (mixup α = 0.4: "
                                        "features and targets mixed with weight l ~ Beta(α, α); tried on the development "
                                        "sets, not adopted)",
                                        fixed={"mixup": 0.4}),
    "mil-ssl-improved-cross-fit": _ablation("mil-ssl-improved-cross-fit", _IMPROVED,
                                            "improved, every refresh's P out of sample: two helper models on "
                                            "halves of the model's training bags, each positive-bag instance "
                                            "scored by the one that never trained on its bag (cross_fit; tried on "
                                            "the development sets, not adopted)",
                                            fixed={"cross_fit": True}),
    "mil-ssl-improved-per-bag-mu": _ablation("mil-ssl-improved-per-bag-mu", _IMPROVED,
                                             "improved, the fraction μ of positive pseudo labels in every "
                                             "positive bag instead of over all positive-bag instances "
                                             "together (per_bag_mu; tried on the development sets, not adopted)",
                                             fixed={"per_bag_mu": True}),
    "mil-ssl-improved-rff": _ablation("mil-ssl-improved-rff", _IMPROVED,
                                      "improved, the classifier on 512 random Fourier features of a Gaussian "
                                      "kernel on the standardised features (rff_dim; tried on the development "
                                      "sets, not adopted)", fixed={"rff_dim": 512}),
    "mil-ssl-improved-confidence": _ablation("mil-ssl-improved-confidence", _IMPROVED,
                                             "improved, every positive-bag instance's loss weighed by its pseudo "
                                             "label's confidence |2q - 1| (confidence_power 1: self-paced)",
                                             fixed={"confidence_power": 1.0}),
    "mil-ssl-improved-rank-gauss": _ablation("mil-ssl-improved-rank-gauss", _IMPROVED,
                                             "improved, every feature standardised by its rank among the "
                                             "model's training instances (a quantile transform to normal "
                                             "scores, rank_gauss_inputs) instead of its mean and std",
                                             fixed={"rank_gauss_inputs": True}),
    "mil-ssl-improved-threshold-0.5": _ablation("mil-ssl-improved-threshold-0.5", _IMPROVED,
                                                "improved, bag threshold 0.5 (not calibrated)", threshold="0.5"),
}


def resolve_methods(names: Sequence[str], *, preset: str = DEFAULT_PRESET) -> list[MethodSpec]:
    """The specs of ``names``; ``mil-ssl`` is the ``preset`` (named ``mil-ssl (<preset>)``)."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown MIL-SSL preset {preset!r}; choose one of {', '.join(PRESETS)}.")
    out = []
    for name in names:
        if name == "mil-ssl":
            out.append(dataclasses.replace(PRESETS[preset], name=f"mil-ssl ({preset})"))
        elif name in METHODS:
            out.append(METHODS[name])
        else:
            raise ConfigError(f"unknown benchmark method {name!r}; choose from mil-ssl, {', '.join(METHODS)}.")
    if len({m.name for m in out}) != len(out):
        raise ConfigError(f"a method is listed twice in {list(names)}; list each once.")
    if "mil-ssl" in names and PRESETS[preset].name in names:  # the same method and seeds: trained twice alike
        raise ConfigError(f"'mil-ssl' is {PRESETS[preset].name!r} (the {preset} preset), and both are listed in "
                          f"{list(names)}; list one of them.")
    return out


# ----------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------

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


def logistic_threshold(scores: np.ndarray, labels: np.ndarray) -> float:
    """The bag score at which a logistic fit of the labels on logit(score) crosses 1/2 (Platt scaling on
    the out-of-fold scores): it uses every score, not only the few near the accuracy-best cut, so it moves
    less with single bags. Falls back to :func:`best_threshold` when the fit does not rise with the score."""
    fit = platt_fit(scores, labels, c=1e6)
    if fit is None:
        return best_threshold(scores, labels)
    a, b = fit
    return float(1.0 / (1.0 + np.exp(b / a)))


def _logit(scores: np.ndarray) -> np.ndarray:
    s = np.clip(np.asarray(scores, dtype=np.float64), 1e-6, 1 - 1e-6)
    return np.log(s) - np.log1p(-s)


def platt_fit(scores: np.ndarray, labels: np.ndarray, *, c: float = 1.0) -> tuple[float, float] | None:
    """(a, b) of a logistic fit P(y = 1) = sigmoid(a logit(score) + b) (inverse regularisation ``c``), or
    None when the scores hold fewer than two finite values, one class, or the fit does not rise (a <= 0)."""
    from sklearn.linear_model import LogisticRegression

    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels).astype(np.int64)
    ok = np.isfinite(scores)
    if ok.sum() < 2 or len(np.unique(labels[ok])) < 2:
        return None
    fit = LogisticRegression(C=c).fit(_logit(scores[ok])[:, None], labels[ok])
    a, b = float(fit.coef_[0, 0]), float(fit.intercept_[0])
    return (a, b) if a > 0 else None


def calibrated_ensemble(test_scores: np.ndarray, train_scores: np.ndarray, inner: list[tuple[np.ndarray, np.ndarray]],
                        labels: np.ndarray, *, models: Sequence[int]) -> np.ndarray:
    """Test bag probabilities of an ensemble whose members are calibrated one by one.

    ``test_scores`` (F, B_test) and ``train_scores`` (F, B_train) are the bag scores of the F models of
    one setting (the inner-fold models first, then the models trained on the whole split). Inner model k
    is Platt-scaled (:func:`platt_fit`, C = 1) on the bags it was held out from; a model without its own
    held-out bags (trained on the whole split), or whose fit fails, takes the mean (a, b) of the inner
    fits. The ensemble of ``models`` is sigmoid(mean_k (a_k logit(s_k) + b_k)), so its 1/2 is the
    threshold, and models of different score scales (trained on less or more data) meet on one scale
    before they are averaged (the mean of raw scores, thresholded where the inner models' scores were
    calibrated, mixes scales). Without any inner fit every model's log-odds are only shifted, so that
    the logistic threshold of the out-of-fold scores (:func:`logistic_threshold`) sits at 1/2.
    """
    fits = [platt_fit(train_scores[k, va], labels[va]) for k, (_, va) in enumerate(inner)]
    good = [f for f in fits if f is not None]
    if good:
        mean_fit = (float(np.mean([f[0] for f in good])), float(np.mean([f[1] for f in good])))
    else:  # no inner fit: shift the raw scores so the OOF logistic threshold sits at 1/2
        oof = np.full(labels.size, np.nan)
        for k, (_, va) in enumerate(inner):
            oof[va] = train_scores[k, va]
        mean_fit = (1.0, -float(_logit(np.array([logistic_threshold(oof, labels)]))[0]))
    z = _logit(test_scores)
    cal = [(fits[k] if k < len(fits) and fits[k] is not None else mean_fit) for k in range(z.shape[0])]
    logodds = np.stack([cal[k][0] * z[k] + cal[k][1] for k in models]).mean(axis=0)
    return 1.0 / (1.0 + np.exp(-logodds))


def _metric(scores: np.ndarray, labels: np.ndarray, name: str) -> float:
    if name == "auc":
        value = auc_or_none(labels.astype(np.int64), scores)
        return -math.inf if value is None else value
    return float(np.mean((scores > best_threshold(scores, labels)) == (labels == 1)))


def _check_fold_counts(labels: np.ndarray, folds: int, inner_folds: int, *, source: str | None = None) -> None:
    """Refuse (ConfigError, naming ``source`` when given) bag labels that cannot fill ``folds`` stratified
    outer folds and, inside every training split, ``inner_folds`` inner folds: before any training.

    Every fold needs a bag of each class, and a training split keeps ``n - ceil(n / folds)`` bags of a
    class of ``n`` bags (stratified folds differ by at most one bag per class)."""
    where = f"{source}: " if source else ""
    counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=2)
    cls = ("negative", "positive")[int(np.argmin(counts))]
    rare = int(counts.min())
    if rare == 0:
        raise ConfigError(f"{where}all {labels.size} bags are {('negative', 'positive')[int(np.argmax(counts))]}; "
                          "the benchmark needs bags of both classes: fix the labels (first column) or the file.")
    if rare < 3:
        raise ConfigError(f"{where}only {rare} {cls} bag(s); nested cross-validation needs at least 3 bags of "
                          "each class: use a file with more bags.")
    if rare < folds:
        raise ConfigError(f"{where}only {rare} {cls} bags for {folds} outer folds (each fold needs one); use "
                          f"--folds {rare} or fewer.")
    train_rare = rare - -(-rare // folds)
    if train_rare < inner_folds:
        fix = (f"use --inner-folds {train_rare} or fewer" if train_rare >= 2 else
               f"use more outer folds (--folds {rare} leaves {rare - 1} to train on) or fewer inner folds")
        raise ConfigError(f"{where}a training split of {folds} outer folds keeps as few as {train_rare} of the "
                          f"{rare} {cls} bags, too few for {inner_folds} inner folds; {fix}.")


def _stratified(labels: np.ndarray, n_splits: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    from sklearn.model_selection import StratifiedKFold

    return list(StratifiedKFold(n_splits=n_splits, shuffle=True, random_state=seed).split(np.zeros(labels.size),
                                                                                          labels))


def with_bag_context(instances: InstanceSet) -> InstanceSet:
    """``instances`` with every instance's features followed by the mean features of its own bag
    (D -> 2D columns): the instance classifier sees each instance in the context of its bag. It uses the
    bag's own instances alone (no label, nothing of another bag), so a test bag gets it like a training bag."""
    x = np.asarray(instances.features, dtype=np.float64)
    sums = np.zeros((instances.n_bags, x.shape[1]))
    np.add.at(sums, instances.bag_ids, x)
    counts = np.bincount(instances.bag_ids, minlength=instances.n_bags)
    means = sums / np.maximum(counts, 1)[:, None]
    return dataclasses.replace(instances, features=np.concatenate([x, means[instances.bag_ids]], axis=1)
                               .astype(np.float32))


# ----------------------------------------------------------------------------------------------
# One method on one outer fold
# ----------------------------------------------------------------------------------------------

def _fit_fold(spec: MethodSpec, train_set: InstanceSet, test_set: InstanceSet, inner: list[tuple[np.ndarray, np.ndarray]],
              *, seed: int) -> tuple[list[dict[str, Any]], dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Train every grid point on every inner training part and on the whole split, as one stack.

    Returns (points, train_scores, test_scores): ``points`` the grid points (with ``pooling`` for
    MIL-SSL), ``train_scores[e]`` float64 (P, F, B_train) bag scores of the training split and
    ``test_scores[e]`` (P, F, B_test), F = inner folds + ``spec.whole_seeds`` (the last are
    the models trained on the whole split).
    """
    from wsi_milssl.benchmark.stacked import StackedData, fit_stacked_baseline, fit_stacked_milssl, pool_bags

    settings = spec.settings()
    if spec.kind == "mil-ssl" and settings["bag_context"]:
        train_set, test_set = with_bag_context(train_set), with_bag_context(test_set)
    train_points = spec.points()
    poolings = [settings["pooling"]] if spec.kind == "mil-ssl" else [None]
    if spec.kind == "mil-ssl":
        pool_grid = dict(spec.grid).get("pooling")
        if pool_grid:
            poolings = list(pool_grid)
            train_points = [p for p in train_points if p.get("pooling", poolings[0]) == poolings[0]]
            for p in train_points:
                p.pop("pooling", None)
    n_folds = len(inner) + spec.whole_seeds
    weights = []
    for _p in train_points:
        for in_tr, _ in inner:
            w = np.zeros(train_set.n_bags, dtype=np.float32)
            w[in_tr] = 1.0
            weights.append(w)
        weights += [np.ones(train_set.n_bags, dtype=np.float32)] * spec.whole_seeds
    data = StackedData.from_instances(train_set, np.stack(weights))
    per_model = [{**settings, **p} for p in train_points for _ in range(n_folds)]
    seeds = [int(np.random.SeedSequence([seed, g, f]).generate_state(1)[0] >> 1)
             for g in range(len(train_points)) for f in range(n_folds)]
    col = lambda key: [s[key] for s in per_model]  # noqa: E731
    if spec.kind == "mil-ssl":
        raw = fit_stacked_milssl(
            data, lr=col("lr"), weight_decay=col("weight_decay"), dropout=col("dropout"), mu=col("mu"),
            ramp_epochs=col("ramp_epochs"), hidden_dims=settings["hidden_dims"], batch_size=settings["batch_size"],
            lam=settings["lam"], fixed_mu=settings["fixed_mu"], soft_labels=settings["soft_labels"],
            local_constraint=settings["local_constraint"], global_constraint=settings["global_constraint"],
            class_balanced=settings["class_balanced"], warmup_epochs=settings["warmup_epochs"],
            bag_balanced=col("bag_balanced"), pseudo_negative_weight=settings["pseudo_negative_weight"],
            bag_loss_weight=settings["bag_loss_weight"], target_momentum=settings["target_momentum"],
            neighbours=settings["neighbours"], input_noise=settings["input_noise"], mixup=settings["mixup"], cross_fit=settings["cross_fit"],
            per_bag_mu=settings["per_bag_mu"], rff_dim=settings["rff_dim"], confidence_power=settings["confidence_power"],
            rank_gauss_inputs=settings["rank_gauss_inputs"],
            weight_average_epochs=settings["weight_average_epochs"],
            eval_at=spec.epoch_grid, eval_sets={"test": test_set}, seeds=seeds, seed=seed)
        for name, part, where in (("train", train_set, "training-split"), ("test", test_set, "test-fold")):
            for e in spec.epoch_grid:  # before pooling, which may leave a NaN instance out (top-half)
                _refuse_non_finite(raw[name][e], f"{where} instance", lambda i, e=e, part=part: (
                    f"{_model_name(i[0] % n_folds, len(inner), spec.whole_seeds)} of setting "
                    f"{_setting(train_points[i[0] // n_folds])} after {e} epochs, instance {i[1]} of bag "
                    f"{part.bag_names[int(part.bag_ids[i[1]])]}"))
        points, train_scores, test_scores = [], {}, {}
        for e in spec.epoch_grid:
            tr, te = [], []
            for pooling in poolings:
                tr.append(pool_bags(raw["train"][e], train_set.bag_ids, train_set.n_bags, pooling))
                te.append(pool_bags(raw["test"][e], test_set.bag_ids, test_set.n_bags, pooling))
            train_scores[e] = np.concatenate(tr).reshape(len(poolings) * len(train_points), n_folds, -1)
            test_scores[e] = np.concatenate(te).reshape(len(poolings) * len(train_points), n_folds, -1)
        points = [{**p, "pooling": pooling} for pooling in poolings for p in train_points]
        return points, train_scores, test_scores
    raw = fit_stacked_baseline(
        data, method=spec.kind, lr=col("lr"), weight_decay=col("weight_decay"),
        attention_dim=[s.get("attention_dim", 1) for s in per_model], dropout=col("dropout"),
        hidden_dims=settings["hidden_dims"], bags_per_batch=settings["bags_per_batch"], eval_at=spec.epoch_grid,
        eval_sets={"test": test_set}, seeds=seeds, seed=seed)
    shape = lambda a: a.reshape(len(train_points), n_folds, -1)  # noqa: E731
    return (train_points, {e: shape(raw["train"][e]) for e in spec.epoch_grid},
            {e: shape(raw["test"][e]) for e in spec.epoch_grid})


#: The fix a NaN or infinite score of the nested cross-validation names.
NON_FINITE_FIX = ("Fix: lower the learning rate (--lr-grid, for the methods that search it) or check the data "
                  "set's features for extreme values (standardise or clip them); a metric of the finite scores "
                  "alone would be biased, so none is reported.")


def _model_name(k: int, n_inner: int, whole_seeds: int) -> str:
    """Model ``k`` of a setting's stack: an inner-fold model (``k < n_inner``), else a whole-split one."""
    if k < n_inner:
        return f"the inner fold {k + 1}/{n_inner} model"
    seed = f" (seed {k - n_inner + 1} of {whole_seeds})" if whole_seeds > 1 else ""
    return f"the model trained on the whole training split{seed}"


def _setting(point: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in point.items()) or "(no grid)"


def _refuse_non_finite(scores: np.ndarray, what: str, first: Any, *, where: str = "") -> None:
    """ConfigError "<where>: N of M <what> scores are NaN or infinite (first: <first(index)>). Fix: ..." when
    ``scores`` hold one; ``first`` describes the index tuple of the first such score."""
    bad = ~np.isfinite(scores)
    if bad.any():
        index = tuple(int(i[0]) for i in np.nonzero(bad))
        raise ConfigError(f"{where + ': ' if where else ''}{int(bad.sum())} of {bad.size} {what} scores are NaN or "
                          f"infinite (first: {first(index)}). {NON_FINITE_FIX}")


def _check_fold_scores(spec: MethodSpec, points: list[dict[str, Any]], train_scores: dict[int, np.ndarray],
                       test_scores: dict[int, np.ndarray], inner: list[tuple[np.ndarray, np.ndarray]],
                       train_set: InstanceSet, test_set: InstanceSet) -> None:
    """Refuse (:func:`_refuse_non_finite`) a NaN or infinite bag score of any model of one outer fold: on the
    training split (the inner held-out scores choose the setting and threshold) or on the test fold."""
    for e in spec.epoch_grid:
        for scores, part, where in ((train_scores[e], train_set, "training-split"),
                                    (test_scores[e], test_set, "test-fold")):
            def first(i: tuple[int, ...], part=part, where=where, e=e) -> str:
                g, k, b = i
                held = (where == "training-split" and k < len(inner) and b in set(inner[k][1].tolist()))
                return (f"{_model_name(k, len(inner), spec.whole_seeds)} of setting {_setting(points[g])} after {e} "
                        f"epochs, bag {part.bag_names[b]}{' (held out from it: an inner-fold score)' if held else ''}")

            _refuse_non_finite(scores, f"{where} bag", first)


def _select(spec: MethodSpec, points: list[dict[str, Any]], train_scores: dict[int, np.ndarray],
            inner: list[tuple[np.ndarray, np.ndarray]], labels: np.ndarray, select_metric: str
            ) -> tuple[int, int, np.ndarray, float, float]:
    """(point index, epochs, OOF scores, inner metric, threshold) of the best setting on the OOF scores
    of the training split alone."""
    other = "accuracy" if select_metric == "auc" else "auc"
    best = None
    for e in spec.epoch_grid:
        for g in range(len(points)):
            oof = np.full(labels.size, np.nan)
            for k, (_, in_va) in enumerate(inner):
                oof[in_va] = train_scores[e][g, k, in_va]
            key = (_metric(oof, labels, select_metric), _metric(oof, labels, other))
            if best is None or key > best[0]:
                best = (key, g, e, oof)
    key, g, e, oof = best
    if spec.threshold == "inner":
        threshold = best_threshold(oof, labels)
    elif spec.threshold == "logistic":
        threshold = logistic_threshold(oof, labels)
    else:  # "0.5", or "calibrated" (the calibrated ensemble's scores are probabilities)
        threshold = 0.5
    return g, e, oof, key[0], threshold


@restores_torch_settings
def nested_cross_validation(instances: InstanceSet, *, bench: BenchmarkConfig,
                            methods: Sequence[MethodSpec] | None = None,
                            progress: ProgressCallback | None = None) -> dict[str, Any]:
    """Run every method of ``methods`` (default: ``bench.methods`` resolved with ``bench.preset``) under
    the same nested cross-validation of ``instances`` (feature bags).

    Returns a JSON-ready dict: per method its spec, per outer fold the chosen setting, inner metric,
    threshold and the test bag accuracy (calibrated threshold and 0.5) and AUC, the summary (mean and
    std over folds) and the seconds it took; plus the data set, the protocol and the total runtime.

    A NaN or infinite score of any model (an instance or a bag; the training split, whose inner held-out
    scores choose the setting, or the test fold; the final ensemble) raises ConfigError naming the data set,
    the method, the fold and the fix (:data:`NON_FINITE_FIX`): no metric is computed on the finite rest.
    """
    if instances.kind != "features":
        raise ConfigError("the MIL benchmark needs feature instances (a MIL CSV or feature files).")
    if methods is None:
        methods = resolve_methods(bench.methods, preset=bench.preset)
    methods = [m.with_overrides(bench.grid_overrides(), bench.epoch_grid) for m in methods]
    if bench.threads > 0:
        torch.set_num_threads(bench.threads)
    labels = instances.bag_labels
    _check_fold_counts(labels, bench.folds, bench.inner_folds, source=instances.source)
    t_start = time.perf_counter()
    results = {m.name: {"spec": m.to_dict(), "folds": [], "seconds": 0.0, "cpu_seconds": 0.0} for m in methods}
    total = bench.repeats * bench.folds * len(methods)
    done = 0
    for repeat in range(bench.repeats):
        outer_seed = bench.seed + 1000 * repeat
        for fold, (train_bags, test_bags) in enumerate(_stratified(labels, bench.folds, outer_seed)):
            train_set = instances.subset_bags(train_bags)
            test_set = instances.subset_bags(test_bags)
            tr_labels = train_set.bag_labels
            y = test_set.bag_labels
            inner = _stratified(tr_labels, bench.inner_folds, outer_seed + 1 + fold)
            for spec in methods:
                t0, c0 = time.perf_counter(), time.process_time()
                fold_seed = int(np.random.SeedSequence([bench.seed, repeat, fold]).generate_state(1)[0] >> 1)
                of_repeat = f"repeat {repeat + 1}/{bench.repeats} " if bench.repeats > 1 else ""
                where = f"{instances.source}: method {spec.name}, {of_repeat}outer fold {fold + 1}/{bench.folds}"
                try:  # a model that diverged: the stacked trainers' check, or a non-finite score
                    points, train_scores, test_scores = _fit_fold(spec, train_set, test_set, inner, seed=fold_seed)
                    _check_fold_scores(spec, points, train_scores, test_scores, inner, train_set, test_set)
                except ConfigError as exc:
                    raise ConfigError(f"{where}: {exc}") from None
                g, e, _oof, inner_value, threshold = _select(spec, points, train_scores, inner, tr_labels,
                                                              bench.select_metric)
                members = range(0 if spec.ensemble else len(inner), test_scores[e].shape[1])
                if spec.threshold == "calibrated":
                    scores = calibrated_ensemble(test_scores[e][g], train_scores[e][g], inner, tr_labels,
                                                 models=members)
                else:  # the mean of the whole-split models (and, with ensemble, the inner-fold models)
                    scores = test_scores[e][g, list(members)].mean(axis=0)
                _refuse_non_finite(scores, "test-fold bag", lambda i: (
                    f"bag {test_set.bag_names[i[0]]}, the chosen setting {_setting(points[g])} after {e} epochs"),
                    where=where)
                row = {
                    "repeat": repeat, "fold": fold, "n_train_bags": int(train_set.n_bags),
                    "n_test_bags": int(test_set.n_bags), "setting": {**points[g]}, "epochs": int(e),
                    "inner_" + bench.select_metric: float(inner_value), "threshold": float(threshold),
                    "accuracy": float(np.mean((scores > threshold) == (y == 1))),
                    "accuracy_at_0_5": float(np.mean((scores > 0.5) == (y == 1))),
                    "auc": auc_or_none(y.astype(np.int64), scores),
                }
                res = results[spec.name]
                res["folds"].append(row)
                res["seconds"] += time.perf_counter() - t0
                res["cpu_seconds"] += time.process_time() - c0
                done += 1
                log.info("%s repeat %d fold %d: %s epochs %d -> accuracy %.3f auc %s", spec.name, repeat + 1,
                         fold + 1, points[g], e, row["accuracy"], row["auc"])
                emit(progress, ProgressEvent(stage="benchmark", done=done, total=total, unit="fit",
                                             item=f"{of_repeat}fold {fold + 1}/{bench.folds} {spec.name}",
                                             message=f"acc {row['accuracy']:.3f}"))
    for res in results.values():
        res["summary"] = summarise(res["folds"])
    return {
        "source": instances.source,
        "n_bags": int(instances.n_bags),
        "n_positive_bags": int((labels == 1).sum()),
        "n_instances": int(len(instances)),
        "n_features": int(instances.in_features or 0),
        "benchmark": bench.to_dict(),
        "methods": results,
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


def _pm(stat: dict[str, Any]) -> str:
    return "—" if stat.get("mean") is None else f"{stat['mean']:.3f} ± {stat['std']:.3f}"


def format_table(result: dict[str, Any]) -> str:
    """A plain-text table: one row per method, bag accuracy (calibrated and at 0.5) and AUC."""
    rows = [("method", "grid", "bag accuracy", "accuracy at 0.5", "bag AUC", "seconds")]
    for name, res in result["methods"].items():
        s = res["summary"]
        rows.append((name, str(res["spec"]["grid_size"]), _pm(s["accuracy"]), _pm(s["accuracy_at_0_5"]),
                     _pm(s["auc"]), f"{res['seconds']:.0f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def format_markdown(result: dict[str, Any]) -> str:
    """The same table in markdown, with the data set and protocol above it."""
    b = result["benchmark"]
    lines = [f"{result['source']}: {result['n_bags']} bags ({result['n_positive_bags']} positive), "
             f"{result['n_instances']} instances; {b['folds']}-fold x {b['repeats']}, inner {b['inner_folds']}-fold, "
             f"seed {b['seed']}, selected by inner {b['select_metric']}", "",
             "| method | grid | bag accuracy | accuracy at 0.5 | bag AUC | seconds |",
             "|---|---|---|---|---|---|"]
    for name, res in result["methods"].items():
        s = res["summary"]
        lines.append(f"| {name} | {res['spec']['grid_size']} | {_pm(s['accuracy'])} | {_pm(s['accuracy_at_0_5'])} | "
                     f"{_pm(s['auc'])} | {res['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# Saved runs of benchmarks/bench_mil_csv.py (merged into one table, or compared across seeds)
# ----------------------------------------------------------------------------------------------

#: what a result records of its data set: the source file's name, size and SHA-256 (``source_bytes`` and
#: ``source_sha256``, recorded by benchmarks/bench_mil_csv.py) and the counts of :func:`nested_cross_validation`
DATA_KEYS = ("source_name", "source_bytes", "source_sha256", "n_bags", "n_positive_bags", "n_instances", "n_features")
#: the settings of a result's ``benchmark`` (:class:`BenchmarkConfig`) that are its protocol
PROTOCOL_KEYS = ("folds", "inner_folds", "repeats", "seed", "select_metric", "mu_grid", "ramp_grid", "lr_grid",
                 "epoch_grid")
#: a grid override -> the method grid key it replaces (BenchmarkConfig.grid_overrides): it counts only where a
#: method of either result searches that key (``--ramp-grid`` changes the paper preset alone)
_OVERRIDDEN = {"mu_grid": "mu", "ramp_grid": "ramp_epochs", "lr_grid": "lr"}


def result_differences(a: dict[str, Any], b: dict[str, Any], *, ignore: Sequence[str] = ()) -> list[str]:
    """What differs between two results of :func:`nested_cross_validation` of one data set, as
    ``"key (a's value vs b's)"`` texts: the data (:data:`DATA_KEYS`) and the protocol (:data:`PROTOCOL_KEYS`)
    except the keys in ``ignore``. A key that either result lacks (a file of an earlier version) matches
    anything, so a result is to be compared with every earlier one, not only the first (which may lack a
    key two later ones differ in); a grid override of None (none given) differs from a given grid. Empty:
    the two are rows of one table."""
    searched = {key for r in (a, b) for m in (r.get("methods") or {}).values()
                for key in ((m.get("spec") or {}).get("grid") or {})}

    def recorded(r: dict[str, Any]) -> dict[str, Any]:
        out = {k: r[k] for k in DATA_KEYS if k in r}
        if r.get("source"):
            out["source_name"] = Path(str(r["source"])).name
        bench = r.get("benchmark") or {}
        out.update({k: bench[k] for k in PROTOCOL_KEYS if k in bench
                    and (k not in _OVERRIDDEN or _OVERRIDDEN[k] in searched)})
        return out

    mine, theirs = recorded(a), recorded(b)
    short = lambda k, v: f"{v[:12]}..." if k == "source_sha256" else v  # noqa: E731
    return [f"{k} ({short(k, mine[k])} vs {short(k, theirs[k])})" for k in (*DATA_KEYS, *PROTOCOL_KEYS)
            if k not in ignore and k in mine and k in theirs and mine[k] != theirs[k]]


def read_saved_runs(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """The JSON files benchmarks/bench_mil_csv.py writes beside its table (``{"meta": ..., "datasets": ...}``),
    read; ConfigError naming the file for one that is missing, not complete JSON, or of another layout
    (the ``wsi-milssl benchmark mil-csv --json`` result of one data set, say)."""
    from wsi_milssl.benchmark.results import read_result_json

    fix = "give the .json that benchmarks/bench_mil_csv.py wrote beside its --out table"
    runs = []
    for path in map(Path, paths):
        run = read_result_json(path, fix=fix)
        if isinstance(run, dict) and "methods" in run and "benchmark" in run and "meta" not in run:
            raise ConfigError(f"{path}: a result of `wsi-milssl benchmark mil-csv --json` (one data set), not of "
                              f"benchmarks/bench_mil_csv.py (its 'meta' and 'datasets'); run the script for a "
                              f"file to merge or compare, or read this one as it is.")
        if (not isinstance(run, dict) or not isinstance(run.get("meta"), dict)
                or not isinstance(run.get("datasets"), dict)
                or not all(isinstance(r, dict) and isinstance(r.get("methods"), dict)
                           for r in run["datasets"].values())):
            raise ConfigError(f"{path}: not a saved run of benchmarks/bench_mil_csv.py (a 'meta' object and "
                              f"'datasets' of results with their 'methods'); {fix}.")
        runs.append(run)
    return runs
