"""The paper's digit-bag benchmarks (its tables 1-4 and 8): MIL-SSL against ABMIL, gated ABMIL and
max-pooling MIL on the same bags, encoder and budget.

Protocols (bags from :mod:`wsi_milssl.benchmark.digits`):

- ``normal`` (tables 1-3): digit 9 positive, one setting per positive ratio; instance AUC and bag AUC
  on held-out bags.
- ``hard`` (table 4): digits 0 and 8 positive, trained at a 10 % ratio; instance and bag AUC on
  ``test-normal``, ``test-pos0`` and ``test-pos8``.
- ablation (table 8): MIL-SSL with soft labels, the constraints and adaptive μ switched on one after the
  other, on one normal-protocol setting (``ablation_ratio``).

Fairness and honesty. Every method of a seed sees the same train/test bags (the image split and the
bags depend only on the seed). All methods share the encoder (``encoder``), the optimizer, learning
rate, weight decay and number of epochs, and take about the same instances per step (MIL-SSL
``batch_size`` instances; a baseline ``round(batch_size / bag_size)`` bags). The model after the last
epoch is evaluated: no epoch, threshold or hyperparameter is chosen on test bags. μ is the training bags'
construction ratio a / bag_size (the paper's choice: "the ground truth μ on the synthetic datasets"),
known from how the training bags were built, unless ``mu`` is given; T defaults to half the epochs;
λ defaults to 1 (see :class:`BagBenchConfig`). Instance labels are used only to score.

Results are reproducible by seed (the same seeds, settings and ``threads`` give the same numbers).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import multiprocessing
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from wsi_milssl.config.base import check_choice, check_range, check_type, config_to_dict
from wsi_milssl.errors import ConfigError
from wsi_milssl.events import ProgressCallback, ProgressEvent, emit
from wsi_milssl.benchmark.baselines import BASELINES, ENCODERS, INSTANCE_SCORES, BaselineConfig, fit_baseline, predict_baseline
from wsi_milssl.mil.data import InstanceSet
from wsi_milssl.benchmark.digits import (
    NORMAL_RATIOS,
    DigitBags,
    DigitImages,
    hard_protocol,
    load_digit_images,
    normal_protocol,
    positives_per_bag,
)

__all__ = [
    "BagBenchConfig",
    "METHODS",
    "ABLATION_ROWS",
    "digit_instance_set",
    "mil_ssl_config",
    "run_methods",
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

    Data: ``mnist_dir`` (a folder of MNIST IDX files; None uses scikit-learn's 8x8 digits),
    ``bag_size`` (None: 20 for the 8x8 digits, 100 for MNIST as in the paper), ``ratios`` (normal
    protocol), ``hard_ratio`` (hard protocol), ``test_fraction`` (share of each digit's images held out
    for test bags), ``passes`` (training-bag constructions pooled; 1 = the paper's), ``seeds``.

    Methods: ``methods`` (subset of "mil-ssl", "abmil", "gated-abmil", "maxpool"), shared ``encoder``
    ("digit-cnn" or "mlp" with ``hidden_dims``), ``epochs``, ``batch_size`` (instances per step),
    ``optimizer``, ``lr``, ``weight_decay``.

    MIL-SSL: ``mu`` (None: the construction ratio a / bag_size of the training bags), ``mu_ramp_epochs``
    (T of eq. 10; None: epochs // 2), ``lams`` (λ of eq. 6, one MIL-SSL row each; the first is the
    main row). The default λ = 1 keeps the pseudo labels soft; the paper's λ = 25 makes them nearly
    binary, and a small digit encoder then memorises its first, mostly wrong, pseudo labels (measured
    on validation bags built from training images only: instance AUC about 0.80-0.94 at λ = 25 against
    0.96-0.99 at λ = 1). Pass ``lams=(1.0, 25.0)`` to show both. ``ablation_ratio``: the normal-protocol
    ratio of the table-8 ablation.

    Runtime: ``threads`` per training run (results are reproducible for a fixed value), ``workers``
    parallel processes over (seed, setting) jobs (0 = in this process).
    """

    mnist_dir: str | None = None
    bag_size: int | None = None
    ratios: tuple[float, ...] = NORMAL_RATIOS
    hard_ratio: float = 0.10
    test_fraction: float = 0.3
    passes: int = 1
    seeds: tuple[int, ...] = (0, 1, 2)
    methods: tuple[str, ...] = METHODS
    encoder: str = "digit-cnn"
    hidden_dims: tuple[int, ...] = (128, 64)
    epochs: int = 100
    batch_size: int = 64
    optimizer: str = "adam"
    lr: float = 1e-3
    weight_decay: float = 1e-4
    mu: float | None = None
    mu_ramp_epochs: int | None = None
    lams: tuple[float, ...] = (1.0,)
    ablation_ratio: float = 0.05
    threads: int = 1
    workers: int = 0

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.mnist_dir is not None:
            check_type(name, "mnist_dir", self.mnist_dir, str)
        if self.bag_size is not None:
            check_type(name, "bag_size", self.bag_size, int)
            check_range(name, "bag_size", self.bag_size, low=2)
        for f in ("ratios", "seeds", "methods", "hidden_dims", "lams"):
            check_type(name, f, getattr(self, f), tuple)
            if not getattr(self, f):
                raise ConfigError(f"{name}.{f} needs at least one value; got ().")
        for r in (*self.ratios, self.hard_ratio, self.ablation_ratio):
            check_range(name, "ratios", r, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
        check_range(name, "test_fraction", self.test_fraction, low=0.0, high=1.0, low_inclusive=False,
                    high_inclusive=False)
        for f in ("passes", "epochs", "batch_size"):
            check_type(name, f, getattr(self, f), int)
            check_range(name, f, getattr(self, f), low=1)
        for s in self.seeds:
            check_type(name, "seeds", s, int)
            check_range(name, "seeds", s, low=0)
        if len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"{name}.seeds must not repeat a seed; got {self.seeds}.")
        for m in self.methods:
            check_choice(name, "methods", m, METHODS)
        check_choice(name, "encoder", self.encoder, ENCODERS)
        for h in self.hidden_dims:
            check_type(name, "hidden_dims", h, int)
            check_range(name, "hidden_dims", h, low=1)
        check_choice(name, "optimizer", self.optimizer, ("sgd", "adam", "adamw"))
        check_range(name, "lr", self.lr, low=0.0, low_inclusive=False)
        check_range(name, "weight_decay", self.weight_decay, low=0.0)
        if self.mu is not None:
            check_range(name, "mu", self.mu, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
        if self.mu_ramp_epochs is not None:
            check_type(name, "mu_ramp_epochs", self.mu_ramp_epochs, int)
            check_range(name, "mu_ramp_epochs", self.mu_ramp_epochs, low=0)
        for lam in self.lams:
            check_range(name, "lams", lam, low=0.0, low_inclusive=False)
        check_type(name, "threads", self.threads, int)
        check_range(name, "threads", self.threads, low=0)
        check_type(name, "workers", self.workers, int)
        check_range(name, "workers", self.workers, low=0)

    def resolved_bag_size(self) -> int:
        """``bag_size``, or its default: 100 with MNIST (the paper's), 20 with the 8x8 digits."""
        if self.bag_size is not None:
            return self.bag_size
        return 100 if self.mnist_dir is not None else 20

    def ramp_epochs(self) -> int:
        return self.epochs // 2 if self.mu_ramp_epochs is None else self.mu_ramp_epochs


# ----------------------------------------------------------------------------------------------
# One training run per method
# ----------------------------------------------------------------------------------------------

def digit_instance_set(bags: DigitBags) -> InstanceSet:
    """The bags as a feature-mode :class:`~wsi_milssl.mil.data.InstanceSet` (features (N, H*W) float32)."""
    return InstanceSet(kind="features", bag_ids=bags.bag_ids,
                       bag_names=[f"{bags.name}-{i:04d}" for i in range(bags.n_bags)],
                       bag_labels=bags.bag_labels, instance_labels=bags.instance_labels,
                       features=bags.features, source=bags.name)


def mil_ssl_config(config: BagBenchConfig, train: DigitBags, *, seed: int, lam: float, **changes):
    """The :class:`~wsi_milssl.config.train.TrainConfig` of a MIL-SSL run on ``train`` (feature mode)."""
    from wsi_milssl.config.train import TrainConfig

    mu = config.mu if config.mu is not None else train.realised_ratio
    kwargs: dict[str, Any] = dict(
        mode="features", model=config.encoder, epochs=config.epochs, batch_size=config.batch_size,
        optimizer=config.optimizer, lr=config.lr, weight_decay=config.weight_decay, mu=float(mu),
        mu_ramp_epochs=config.ramp_epochs(), lam=float(lam), seed=int(seed), plots=False,
        threads=config.threads, device="cpu", num_workers=0,
    )
    if config.encoder == "mlp":
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


def _mil_ssl_label(lams: Sequence[float], lam: float) -> str:
    return "MIL-SSL" if len(lams) == 1 else f"MIL-SSL (λ = {lam:g})"


def _ablation_label(soft: bool, constrained: bool, adaptive: bool) -> str:
    yn = {True: "y", False: "n"}
    return f"soft={yn[soft]} constraint={yn[constrained]} adaptive_mu={yn[adaptive]}"


def run_methods(config: BagBenchConfig, train: DigitBags, tests: dict[str, DigitBags], *, seed: int,
                methods: Sequence[str] | None = None, mil_ssl_changes: dict[str, Any] | None = None,
                row_label: str | None = None) -> list[dict[str, Any]]:
    """Train each method once on ``train`` and score it on every test set.

    Returns rows ``{"seed", "test", "method", "scoring", "label", "bag_label", "instance_auc", "bag_auc",
    "seconds"}`` (one per method, instance scoring and test set). ``mil_ssl_changes`` overrides
    TrainConfig fields (the ablation); ``row_label`` replaces MIL-SSL's row label.
    """
    from wsi_milssl.mil.selftrain import evaluate, fit, resolve_runtime

    methods = tuple(methods or config.methods)
    train_set = digit_instance_set(train)
    test_sets = {name: digit_instance_set(b) for name, b in tests.items()}
    rows: list[dict[str, Any]] = []
    for method in methods:
        if method == "mil-ssl":
            for lam in config.lams:
                t0 = time.perf_counter()
                cfg = mil_ssl_config(config, train, seed=seed, lam=lam, **(mil_ssl_changes or {}))
                result = fit(train_set, config=cfg)
                seconds = time.perf_counter() - t0
                runtime = resolve_runtime(cfg)
                label = row_label or _mil_ssl_label(config.lams, lam)
                last = result.history[-1] if result.history else {}
                for name, ts in test_sets.items():
                    m = evaluate(result.model, ts, runtime=runtime, bag_pooling=cfg.bag_pooling)
                    rows.append({"seed": seed, "test": name, "method": "mil-ssl", "scoring": "probability",
                                 "label": label, "bag_label": label, "lam": float(lam),
                                 "instance_auc": m["instance_auc"], "bag_auc": m["bag_auc"],
                                 "pseudo_label_mean": last.get("pseudo_label_mean"),
                                 "pseudo_precision": last.get("pseudo_precision"),
                                 "seconds": seconds})
            continue
        t0 = time.perf_counter()
        bcfg = BaselineConfig(method=method, encoder=config.encoder, hidden_dims=tuple(config.hidden_dims),
                              epochs=config.epochs, bags_per_batch=max(1, round(config.batch_size / train.bag_size)),
                              optimizer=config.optimizer, lr=config.lr, weight_decay=config.weight_decay,
                              seed=seed, threads=config.threads)
        model = fit_baseline(train_set, config=bcfg)
        seconds = time.perf_counter() - t0
        for name, ts in test_sets.items():
            pred = predict_baseline(model, ts)
            bag_auc = _auc(ts.bag_labels, pred["bag_scores"])
            for scoring in INSTANCE_SCORES[method]:
                rows.append({"seed": seed, "test": name, "method": method, "scoring": scoring,
                             "label": _LABELS[(method, scoring)], "bag_label": _BAG_LABELS[method],
                             "instance_auc": _auc(ts.instance_labels, pred["instance_scores"][scoring]),
                             "bag_auc": bag_auc, "seconds": seconds})
    return rows


# ----------------------------------------------------------------------------------------------
# Jobs (one per seed and setting), optionally in worker processes
# ----------------------------------------------------------------------------------------------

_IMAGES: dict[str | None, DigitImages] = {}


def _images(config: BagBenchConfig) -> DigitImages:
    key = config.mnist_dir
    if key not in _IMAGES:
        _IMAGES[key] = load_digit_images(config.mnist_dir)
    return _IMAGES[key]


def _bag_counts(train: DigitBags, tests: dict[str, DigitBags]) -> dict[str, Any]:
    return {"train_bags": train.n_bags, "test_bags": {k: v.n_bags for k, v in tests.items()},
            "positives_per_bag": train.positives_per_bag, "bag_size": train.bag_size,
            "realised_ratio": train.realised_ratio, "train_instances": len(train)}


def _job(kind: str, config: BagBenchConfig, seed: int, setting: Any) -> dict[str, Any]:
    """Run one (protocol, seed, setting) job; returns {"rows": [...], "counts": {...}}."""
    images = _images(config)
    bag_size = config.resolved_bag_size()
    if kind == "normal":
        train, test = normal_protocol(images, ratio=float(setting), bag_size=bag_size, seed=seed,
                                      test_fraction=config.test_fraction, passes=config.passes)
        rows = run_methods(config, train, {"test": test}, seed=seed)
        for r in rows:
            r["ratio"] = float(setting)
        return {"rows": rows, "counts": _bag_counts(train, {"test": test})}
    if kind == "hard":
        train, tests = hard_protocol(images, bag_size=bag_size, seed=seed, ratio=config.hard_ratio,
                                     test_fraction=config.test_fraction, passes=config.passes)
        return {"rows": run_methods(config, train, tests, seed=seed), "counts": _bag_counts(train, tests)}
    if kind == "ablation":
        soft, constrained, adaptive = setting
        train, test = normal_protocol(images, ratio=config.ablation_ratio, bag_size=bag_size, seed=seed,
                                      test_fraction=config.test_fraction, passes=config.passes)
        changes = {"soft_labels": soft, "global_constraint": constrained, "local_constraint": constrained,
                   "fixed_mu": not adaptive}
        rows = run_methods(config, train, {"test": test}, seed=seed, methods=("mil-ssl",),
                           mil_ssl_changes=changes, row_label=_ablation_label(soft, constrained, adaptive))
        for r in rows:
            r.update({"soft": soft, "constraint": constrained, "adaptive_mu": adaptive,
                      "ratio": config.ablation_ratio})
        return {"rows": rows, "counts": _bag_counts(train, {"test": test})}
    raise ValueError(f"unknown job kind {kind!r}")


def _run_jobs(kind: str, config: BagBenchConfig, jobs: list[tuple[int, Any]],
              progress: ProgressCallback | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any] | None] = [None] * len(jobs)
    emit(progress, ProgressEvent(stage=f"bags-{kind}", done=0, total=len(jobs), unit="job"))
    if config.workers <= 0:
        for i, (seed, setting) in enumerate(jobs):
            out[i] = _job(kind, config, seed, setting)
            emit(progress, ProgressEvent(stage=f"bags-{kind}", done=i + 1, total=len(jobs), unit="job",
                                         item=f"seed {seed} {setting}"))
    else:
        ctx = multiprocessing.get_context("spawn")  # no OpenMP/torch state crosses a fork
        with concurrent.futures.ProcessPoolExecutor(max_workers=config.workers, mp_context=ctx) as pool:
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
    groups: dict[tuple[str, str], dict[str, list]] = {}
    for r in result["rows"]:
        col = r["test"] if kind == "hard" else f"{r['ratio']:g}"
        g = groups.setdefault((r["label"], col), {"instance_auc": [], "bag_auc": [], "bag_label": r["bag_label"]})
        g["instance_auc"].append(r["instance_auc"])
        g["bag_auc"].append(r["bag_auc"])
    return {key: {"instance_auc": _stats(g["instance_auc"]), "bag_auc": _stats(g["bag_auc"]),
                  "bag_label": g["bag_label"]} for key, g in groups.items()}


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

    normal: per ratio, MIL-SSL's instance AUC minus the best ABMIL instance AUC (either scoring) and
    whether MIL-SSL is higher. hard: the harder of test-pos0/test-pos8 for MIL-SSL, its instance AUC
    there and the margin over the best baseline row (every scoring) on that set (>= 0.2 required).
    """
    summary = summarise(result)
    kind = result["protocol"]
    main = _mil_ssl_label(result["config"]["lams"], result["config"]["lams"][0])
    if kind == "normal":
        out = {}
        for ratio in [f"{r:g}" for r in result["config"]["ratios"]]:
            ours = summary.get((main, ratio), {}).get("instance_auc", {}).get("mean")
            abmil = [summary[(lab, ratio)]["instance_auc"]["mean"] for lab in
                     (_LABELS[("abmil", "attention")], _LABELS[("abmil", "attention_logit")]) if (lab, ratio) in summary]
            if ours is None or not abmil:
                continue
            out[ratio] = {"mil_ssl": ours, "best_abmil": max(abmil), "margin": ours - max(abmil),
                          "met": bool(ours > max(abmil))}
        return {"normal": out, "met": all(v["met"] for v in out.values()) if out else None}
    if kind == "hard":
        ours = {t: summary.get((main, t), {}).get("instance_auc", {}).get("mean") for t in ("test-pos0", "test-pos8")}
        if any(v is None for v in ours.values()):
            return {"hard": None, "met": None}
        harder = min(ours, key=lambda t: ours[t])
        others = {lab: s["instance_auc"]["mean"] for (lab, col), s in summary.items()
                  if col == harder and not lab.startswith("MIL-SSL") and s["instance_auc"]["mean"] is not None}
        best_lab = max(others, key=others.get) if others else None
        margin = ours[harder] - others[best_lab] if best_lab else None
        return {"hard": {"harder_test": harder, "mil_ssl": ours[harder], "best_baseline": best_lab,
                         "best_baseline_auc": others.get(best_lab), "margin": margin},
                "met": None if margin is None else bool(margin >= 0.2)}
    if kind == "ablation":
        col = f"{result['config']['ablation_ratio']:g}"
        means = [summary.get((_ablation_label(*row), col), {}).get("instance_auc", {}).get("mean")
                 for row in ABLATION_ROWS]
        if any(m is None for m in means):
            return {"ablation": {"instance_auc_by_row": means}, "met": None}
        return {"ablation": {"instance_auc_by_row": means},
                "met": bool(means[0] == min(means) and means[-1] == max(means))}
    return {"met": None}


def format_markdown(result: dict[str, Any]) -> str:
    """Markdown tables shaped like the paper's: table 1 (bag counts) + 2 (instance AUC) + 3 (bag AUC) for
    the normal protocol, table 4 for the hard protocol, table 8 for the ablation; mean ± std over seeds,
    best mean in bold, followed by the acceptance check."""
    kind = result["protocol"]
    cfg = result["config"]
    summary = summarise(result)
    seeds = ", ".join(str(s) for s in cfg["seeds"])
    mu_text = "the construction ratio a/bag_size" if cfg["mu"] is None else f"{cfg['mu']:g}"
    ramp = cfg["epochs"] // 2 if cfg["mu_ramp_epochs"] is None else cfg["mu_ramp_epochs"]
    head = (f"Images: {result['source']}; bag size {result['bag_size']}; seeds {seeds} (mean ± std); "
            f"encoder {cfg['encoder']}; {cfg['epochs']} epochs, {cfg['optimizer']} lr {cfg['lr']:g}, "
            f"weight decay {cfg['weight_decay']:g}, {cfg['batch_size']} instances per step; MIL-SSL μ = {mu_text}, "
            f"T = {ramp}, λ = {', '.join(f'{x:g}' for x in cfg['lams'])}; last epoch evaluated "
            f"(nothing chosen on test bags); {result['seconds']:.0f} s.")
    parts = [head, ""]
    if kind == "normal":
        ratios = [f"{r:g}" for r in cfg["ratios"]]
        first_seed = {ratio: next(iter(result["counts"].get(ratio, {}).values()), None) for ratio in ratios}
        names = [f"{float(r) * 100:g}%" for r in ratios]
        count_rows = [
            ["positives per positive bag (realised ratio)"]
            + [f"{c['positives_per_bag']} ({c['realised_ratio'] * 100:g}%)" if c else "" for c in first_seed.values()],
            ["bags (train : test)"]
            + [f"{c['train_bags']} : {c['test_bags']['test']}" if c else "" for c in first_seed.values()],
        ]
        parts += ["Table 1 analog: bags per positive-instance ratio.", "",
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
                      f"{round(1 / low)} or more instances (MNIST with --mnist DIR and the paper's bag size 100).", ""]
        labels = _ordered([lab for (lab, _c) in summary])
        parts += ["Table 2 analog: instance-level AUC, normal bags.", "",
                  _table(["Method"] + names, _grid(summary, labels, ratios, "instance_auc")), ""]
        bag_rows = {}
        for (lab, c), s in summary.items():
            bag_rows.setdefault(s["bag_label"], {})[c] = s
        bag_summary = {(bl, c): s for bl, cs in bag_rows.items() for c, s in cs.items()}
        parts += ["Table 3 analog: bag-level AUC, normal bags.", "",
                  _table(["Method"] + names, _grid(bag_summary, _ordered(list(bag_rows)), ratios, "bag_auc")), ""]
        acc = acceptance(result)
        lines = [f"- {float(r) * 100:g}%: MIL-SSL {v['mil_ssl']:.4f} vs best ABMIL scoring {v['best_abmil']:.4f} "
                 f"({v['margin']:+.4f}) {'met' if v['met'] else 'NOT met'}" for r, v in acc["normal"].items()]
        parts += ["Acceptance (MIL-SSL instance AUC above both ABMIL scorings at every ratio): "
                  f"{'met' if acc['met'] else 'NOT met'}", *lines, ""]
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
        parts += [f"Table 4 analog: hard bags (digits 0 and 8 positive, {counts['positives_per_bag']} of "
                  f"{counts['bag_size']} per positive training bag; {counts['train_bags']} training bags, "
                  f"test bags {counts['test_bags']}).", "",
                  _table(["Method", "Test set", "Instance-level AUC", "Bag-level AUC"], rows), ""]
        acc = acceptance(result)["hard"]
        if acc:
            parts += [f"Acceptance (MIL-SSL >= 0.2 above every baseline on the harder of test-pos0/test-pos8): "
                      f"harder set {acc['harder_test']}: MIL-SSL {acc['mil_ssl']:.4f}, best baseline "
                      f"{acc['best_baseline']} {acc['best_baseline_auc']:.4f}, margin {acc['margin']:+.4f} -> "
                      f"{'met' if acc['margin'] >= 0.2 else 'NOT met'}", ""]
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
    return "\n".join(parts)
