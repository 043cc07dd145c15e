"""``wsi-milssl benchmark mil-csv FILE --methods mil-ssl abmil gated-abmil maxpool``: MIL-SSL and the MIL
baselines under one honest nested cross-validation on a classical MIL dataset (MUSK1, MUSK2, ELEPHANT,
UCSB breast cancer, ... as ``label,bag_id,f1,...,fn`` CSV); ``benchmark bags``: the digit-bag protocols."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from wsi_milssl.atomic import atomic_write_bytes, atomic_write_text, check_writable

__all__ = ["SUMMARY", "benchmark_config", "refuse_shared_paths", "register", "run", "run_mil_csv"]

#: one line for ``wsi-milssl --help``
SUMMARY = "accuracy benchmarks (classical MIL datasets, digit bags)"


def _register_mil_csv(sub) -> None:
    from wsi_milssl.cli import HelpFormatter
    from wsi_milssl.config.train import BenchmarkConfig
    from wsi_milssl.benchmark.mil_csv import METHODS, PRESETS

    d = BenchmarkConfig()
    p = sub.add_parser(
        "mil-csv",
        help="nested k-fold cross-validation of MIL-SSL and the MIL baselines on a MIL CSV",
        description=(
            "Every method runs in the same stratified outer folds over bags and, inside each training\n"
            "split only, the same inner folds: each method's own grid (MIL-SSL: μ, T, learning rate;\n"
            "baselines: learning rate, weight decay, attention size or dropout) and its number of epochs\n"
            "are chosen on the inner out-of-fold bag scores, which also calibrate the bag threshold. The\n"
            "chosen setting is trained on the whole split and scored once on the held-out fold. Prints one\n"
            "table (bag accuracy and AUC, mean ± std over folds) and writes every fold to JSON and the\n"
            "table to markdown.\n\n"
            f"methods: mil-ssl (the --preset), {', '.join(METHODS)}\n\n"
            "example:\n  wsi-milssl benchmark mil-csv musk1.csv --methods mil-ssl abmil gated-abmil maxpool \\\n"
            "      --folds 10 --seed 0 --json musk1.json --markdown musk1.md --plot musk1.png"
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("file", type=Path, metavar="FILE",
                   help="MIL CSV: label,bag_id,f1,...,fn; the first row is a header when its first field is not a "
                        "number or its fields are 0,1,...,n-1 (pandas' to_csv of an unnamed frame)")
    p.add_argument("--methods", nargs="+", default=list(d.methods), metavar="METHOD",
                   help=f"methods to compare, one table row each [{' '.join(d.methods)}]")
    p.add_argument("--preset", choices=tuple(PRESETS), default=d.preset,
                   help=f"what 'mil-ssl' means: the paper's method and grids, or the improved one [{d.preset}]")
    p.add_argument("--folds", type=int, default=d.folds, help="outer cross-validation folds")
    p.add_argument("--inner-folds", type=int, default=d.inner_folds, help="inner folds of the grid search")
    p.add_argument("--repeats", type=int, default=d.repeats, help="repeat the outer split with other seeds")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the folds and of every model")
    p.add_argument("--select", choices=("accuracy", "auc"), default=d.select_metric,
                   help="inner out-of-fold metric that picks each method's setting")
    p.add_argument("--mu-grid", type=float, nargs="+", default=None,
                   help="replace the μ grid of every method that searches μ")
    p.add_argument("--ramp-grid", type=int, nargs="+", default=None,
                   help="replace the T grid (eq. 10) of every method that searches T")
    p.add_argument("--lr-grid", type=float, nargs="+", default=None,
                   help="replace the learning-rate grid of every method that searches one")
    p.add_argument("--epoch-grid", type=int, nargs="+", default=None, help="replace every method's epoch grid")
    p.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads (0 = torch default)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="result file [benchmark_<FILE stem>.json in the current folder]")
    p.add_argument("--markdown", type=Path, default=None, metavar="PATH", help="also write the table as markdown")
    p.add_argument("--plot", type=Path, default=None, metavar="PATH",
                   help="also draw every outer fold's bag accuracy and AUC per method as a PNG")
    p.set_defaults(run=run_mil_csv)


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


def refuse_shared_paths(inputs: dict[str, str | os.PathLike | None],
                        outputs: dict[str, str | os.PathLike | None]) -> None:
    """Refuse (ConfigError), before any work, an output naming the same file as an input or as another
    output (keys: the option names; None is skipped): writing it would replace the input, or the output
    written first, without a word."""
    from wsi_milssl.cohorts.names import file_identity
    from wsi_milssl.errors import ConfigError

    seen: dict[object, str] = {}
    for name, p in inputs.items():
        if p is not None:  # a folder of inputs (MNIST IDX files) stands for each file in it too
            files = sorted(Path(p).iterdir()) if Path(p).is_dir() else []
            seen.update({file_identity(f): f"the input {f} ({name})" for f in files if f.is_file()})
            seen[file_identity(p)] = f"the input {name}"
    for name, path in outputs.items():
        if path is None:
            continue
        key = file_identity(path)
        if key in seen:
            raise ConfigError(f"{path}: {name} names the same file as {seen[key]}; give {name} a path of its own "
                              "(nothing was run or written).")
        seen[key] = name


#: the options that set BenchmarkConfig's fields (``mil-csv`` and benchmarks/bench_mil_csv.py), for its messages
OPTIONS = {"folds": "--folds", "inner_folds": "--inner-folds", "repeats": "--repeats", "seed": "--seed",
           "methods": "--methods", "preset": "--preset", "mu_grid": "--mu-grid", "ramp_grid": "--ramp-grid",
           "lr_grid": "--lr-grid", "epoch_grid": "--epoch-grid", "select_metric": "--select", "threads": "--threads"}


def benchmark_config(**fields):
    """``BenchmarkConfig(**fields)`` (list values as tuples); a value it refuses is named by its option
    (``--folds must satisfy 2 <= value; got 1.``), not by the field."""
    from wsi_milssl.config.train import BenchmarkConfig
    from wsi_milssl.errors import ConfigError

    try:
        return BenchmarkConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    except ConfigError as exc:
        raise named_by_options(exc, "BenchmarkConfig", OPTIONS) from None


def named_by_options(exc: Exception, config_name: str, options: dict[str, str]):
    """``exc`` (a config's ConfigError) as an OptionError (a usage error, exit code 2) naming each field by the
    option that sets it."""
    from wsi_milssl.errors import OptionError

    text = str(exc)
    for field, option in options.items():
        text = text.replace(f"{config_name}.{field} ", f"{option} ")
    return OptionError(text)


def run(args: argparse.Namespace) -> int:  # pragma: no cover - argparse dispatches to a subcommand
    return int(args.run(args))


def run_mil_csv(args: argparse.Namespace) -> int:
    from wsi_milssl.cli.progress import TqdmProgress
    from wsi_milssl.benchmark.mil_csv import format_markdown, format_table, nested_cross_validation
    from wsi_milssl.mil.data import read_mil_csv

    def once(values):  # a value given twice is one candidate (review CD: counted twice in the grid column)
        return None if values is None else list(dict.fromkeys(values))

    bench = benchmark_config(folds=args.folds, inner_folds=args.inner_folds, seed=args.seed, repeats=args.repeats,
                             methods=once(args.methods), preset=args.preset, mu_grid=once(args.mu_grid),
                             ramp_grid=once(args.ramp_grid), lr_grid=once(args.lr_grid),
                             epoch_grid=once(args.epoch_grid), select_metric=args.select, threads=args.threads)
    out = args.json or Path(f"benchmark_{args.file.stem}.json")
    refuse_shared_paths({"FILE": args.file}, {"--json": out, "--markdown": args.markdown, "--plot": args.plot})
    check_writable(out, args.markdown, args.plot)  # before the run, not after it
    instances = read_mil_csv(args.file)
    print(f"{args.file}: {instances.n_bags} bags ({int(instances.bag_labels.sum())} positive), "
          f"{len(instances)} instances, {instances.in_features} features; {bench.folds}-fold x {bench.repeats}, "
          f"inner {bench.inner_folds}-fold; methods {' '.join(bench.methods)}")
    with TqdmProgress() as progress:
        result = nested_cross_validation(instances, bench=bench, progress=progress)
    for name, res in result["methods"].items():
        for row in res["folds"]:
            setting = " ".join(f"{k} {v}" for k, v in row["setting"].items())
            repeat = f"repeat {row['repeat'] + 1} " if bench.repeats > 1 else ""
            print(f"  {name} {repeat}fold {row['fold'] + 1:2d}: {setting} epochs {row['epochs']} threshold "
                  f"{row['threshold']:.3f} -> accuracy {row['accuracy']:.3f} (at 0.5: {row['accuracy_at_0_5']:.3f}) "
                  f"auc {row['auc'] if row['auc'] is None else round(row['auc'], 3)}")
    print(format_table(result))
    print(f"[{result['seconds']:.0f} s]")
    atomic_write_text(out, json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    if args.markdown is not None:
        atomic_write_text(args.markdown, format_markdown(result))
        print(f"wrote {args.markdown}")
    if args.plot is not None:
        from wsi_milssl.benchmark.plots import fold_scores_png

        atomic_write_bytes(args.plot, fold_scores_png({args.file.stem: result}))
        print(f"wrote {args.plot}")
    return 0
