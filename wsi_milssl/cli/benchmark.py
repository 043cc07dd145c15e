"""``wsi-milssl benchmark mil-csv FILE --folds 10 --seed S``: honest nested cross-validation of MIL-SSL
on a classical MIL dataset (MUSK1, MUSK2, ELEPHANT, ... as ``label,bag_id,f1,...,fn`` CSV)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from wsi_milssl.atomic import atomic_write_text

__all__ = ["SUMMARY", "register", "run", "run_mil_csv"]

#: one line for ``wsi-milssl --help``
SUMMARY = "accuracy benchmarks (classical MIL datasets, digit bags)"


def _register_mil_csv(sub) -> None:
    from wsi_milssl.cli import HelpFormatter
    from wsi_milssl.cli.train import add_train_options
    from wsi_milssl.config.train import BenchmarkConfig

    d = BenchmarkConfig()
    p = sub.add_parser(
        "mil-csv",
        help="nested k-fold cross-validation of feature-mode MIL-SSL on a MIL CSV",
        description=(
            "Stratified k-fold over bags. Inside each training split only, an inner k-fold grid search\n"
            "picks μ, T and the number of epochs and calibrates the bag threshold on out-of-fold scores;\n"
            "the chosen setting is retrained on the split and scored once on the held-out fold. Prints\n"
            "bag accuracy and AUC as mean ± std over folds and writes every fold to JSON.\n\n"
            "example:\n  wsi-milssl benchmark mil-csv musk1.csv --folds 10 --seed 0 --json musk1.json"
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("file", type=Path, metavar="FILE", help="MIL CSV: label,bag_id,f1,...,fn (no header)")
    p.add_argument("--folds", type=int, default=d.folds, help="outer cross-validation folds")
    p.add_argument("--inner-folds", type=int, default=d.inner_folds, help="inner folds of the grid search")
    p.add_argument("--repeats", type=int, default=d.repeats, help="repeat the outer split with other seeds")
    p.add_argument("--mu-grid", type=float, nargs="+", default=list(d.mu_grid), help="μ values searched")
    p.add_argument("--ramp-grid", type=int, nargs="+", default=list(d.ramp_grid), help="T values searched (eq. 10)")
    p.add_argument("--epoch-grid", type=int, nargs="+", default=list(d.epoch_grid), help="epoch counts searched")
    p.add_argument("--select", choices=("accuracy", "auc"), default=d.select_metric,
                   help="inner-fold metric that picks the setting")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="result file [benchmark_<FILE stem>.json in the current folder]")
    add_train_options(p)
    p.set_defaults(run=run_mil_csv)
    # --seed from the train options seeds both the folds and the training.


def register(subparsers) -> None:
    from wsi_milssl.cli import HelpFormatter

    p = subparsers.add_parser(
        "benchmark",
        help=SUMMARY,
        description="Accuracy benchmarks with an honest protocol: nothing is selected on test folds.",
        formatter_class=HelpFormatter,
    )
    sub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    _register_mil_csv(sub)
    from wsi_milssl.cli.benchmark_bags import register_bags

    register_bags(sub)  # digit-bag benchmarks (issue 8)


def run(args: argparse.Namespace) -> int:  # pragma: no cover - argparse dispatches to a subcommand
    return int(args.run(args))


def run_mil_csv(args: argparse.Namespace) -> int:
    from wsi_milssl.cli.progress import TqdmProgress
    from wsi_milssl.cli.train import train_config_from_args
    from wsi_milssl.config.train import BenchmarkConfig
    from wsi_milssl.benchmark.mil_csv import nested_cross_validation
    from wsi_milssl.mil.data import read_mil_csv

    seed = args.seed if args.seed is not None else 0
    bench = BenchmarkConfig(folds=args.folds, inner_folds=args.inner_folds, seed=seed, repeats=args.repeats,
                            mu_grid=tuple(args.mu_grid), ramp_grid=tuple(args.ramp_grid),
                            epoch_grid=tuple(args.epoch_grid), select_metric=args.select)
    args.no_plots = True
    config = train_config_from_args(args, mode="features")
    instances = read_mil_csv(args.file)
    print(f"{args.file}: {instances.n_bags} bags ({int(instances.bag_labels.sum())} positive), "
          f"{len(instances)} instances, {instances.in_features} features; {bench.folds}-fold x {bench.repeats}, "
          f"inner {bench.inner_folds}-fold grid of {len(bench.mu_grid) * len(bench.ramp_grid) * len(bench.epoch_grid)}")
    with TqdmProgress() as progress:
        result = nested_cross_validation(instances, train_config=config, bench=bench, progress=progress)
    s = result["summary"]
    for row in result["folds"]:
        print(f"  fold {row['fold'] + 1:2d}: mu {row['mu']:.2f} T {row['ramp_epochs']:2d} epochs {row['epochs']:3d} "
              f"threshold {row['threshold']:.3f} -> accuracy {row['accuracy']:.3f} "
              f"(at 0.5: {row['accuracy_at_0_5']:.3f}) auc {row['auc'] if row['auc'] is None else round(row['auc'], 3)}")
    print(f"bag accuracy {s['accuracy']['mean']:.3f} ± {s['accuracy']['std']:.3f} "
          f"(threshold 0.5: {s['accuracy_at_0_5']['mean']:.3f} ± {s['accuracy_at_0_5']['std']:.3f}); "
          f"bag AUC {s['auc']['mean']:.3f} ± {s['auc']['std']:.3f}  [{result['seconds']:.0f} s]")
    out = args.json or Path(f"benchmark_{args.file.stem}.json")
    atomic_write_text(out, json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0
