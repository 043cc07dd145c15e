"""How much the classical MIL table moves with the seed: per data set and method, the bag accuracy (and AUC)
of several ``bench_mil_csv.py`` runs that differ only in ``--seed`` (the outer and inner folds and every
model's initialisation change with it), their mean, and each method's mean minus a reference method's.

    python benchmarks/bench_mil_csv.py --data mil_csv --datasets musk1 --seed 1 --methods mil-ssl-improved abmil \
        --out s1.md
    python benchmarks/mil_csv_seeds.py s0.json s1.json s2.json --reference abmil --out seeds.md

A run may hold several data sets and methods; a (data set, method, seed) given twice is an error, and so are
runs of another selection metric, or a data set whose runs differ in anything but the seed (its data file,
folds, inner folds or grids). A run that did not finish (its JSON records data sets requested and not done:
a killed bench_mil_csv.py run) is refused, naming it; JSON of earlier versions records no request and is read
as complete.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from wsi_milssl.atomic import atomic_write_text, check_writable
from wsi_milssl.benchmark.mil_csv import read_saved_runs, result_differences
from wsi_milssl.errors import ConfigError, WsiMilsslError


def refuse_unfinished(runs: list[dict], names: list[str]) -> None:
    """ConfigError naming the first run whose JSON requested data sets (``meta.datasets_requested``) that it
    does not hold: its table would pass a killed run off as a finished one."""
    for name, run in zip(names, runs):
        requested = run["meta"].get("datasets_requested") or []
        missing = [ds for ds in requested if ds not in run["datasets"]]
        if missing:
            done = [ds for ds in requested if ds in run["datasets"]]
            raise ConfigError(f"{name}: its run did not finish ({len(done)} of {len(requested)} data sets done; "
                              f"missing {', '.join(missing)}); run the missing ones (bench_mil_csv.py --datasets "
                              f"{' '.join(missing)} with the run's other options, its seed among them: its JSON's "
                              "meta; --out REST.md), merge them (--from-json {name} REST.json --out "
                              "ALL.md) and give ALL.json.")


def collect(runs: list[dict], names: list[str] | None = None) -> dict[tuple[str, str], dict[int, dict[str, float]]]:
    """{(data set, method): {seed: {"accuracy": mean over folds, "auc": ...}}}; ConfigError (naming the runs,
    ``names``) for a (data set, method, seed) in two runs, runs of another selection metric, or a data set
    whose runs differ in anything but the seed (:func:`wsi_milssl.benchmark.mil_csv.result_differences`)."""
    names = names or [f"run {i + 1}" for i in range(len(runs))]
    out: dict[tuple[str, str], dict[int, dict[str, float]]] = defaultdict(dict)
    seen: dict[str, list[tuple[str, dict]]] = defaultdict(list)  # data set -> (run name, its result) so far
    given: dict[tuple[str, str, int], str] = {}  # (data set, method, seed) -> the run that gave it
    select = next(((n, r["meta"]["select"]) for n, r in zip(names, runs) if "select" in r["meta"]), None)
    for name, run in zip(names, runs):
        if select and run["meta"].get("select", select[1]) != select[1]:
            raise ConfigError(f"{select[0]} and {name} differ in the selection metric ({select[1]} vs "
                              f"{run['meta']['select']}); compare runs of one --select.")
        seed = int(run["meta"]["seed"])
        for ds, res in run["datasets"].items():
            # every earlier run of the data set: a key a run lacks matches anything, so an earlier run without
            # a key must not let two later ones with different values through
            for earlier, result in seen[ds]:
                differences = result_differences(result, res, ignore=("seed",))
                if differences:
                    raise ConfigError(f"{earlier} and {name} differ in more than the seed: {ds} differs in "
                                      f"{', '.join(differences)}; compare runs of one data file and protocol.")
            seen[ds].append((name, res))
            for method, r in res["methods"].items():
                if seed in out[(ds, method)]:
                    raise ConfigError(f"{ds} / {method} / seed {seed} is in {given[(ds, method, seed)]} and {name}; "
                                      "give each once.")
                out[(ds, method)][seed] = {k: r["summary"][k]["mean"] for k in ("accuracy", "auc")}
                given[(ds, method, seed)] = name
    return dict(out)


def fold_counts(runs: list[dict]) -> dict[str, int]:
    """The outer folds of each data set's runs (alike in every run, :func:`collect` checks), where recorded."""
    return {ds: res["benchmark"]["folds"] for run in runs for ds, res in run["datasets"].items()
            if "folds" in (res.get("benchmark") or {})}


def render(table: dict[tuple[str, str], dict[int, dict[str, float]]], reference: str | None,
           folds: dict[str, int] | None = None, methods: list[str] | None = None) -> str:
    """The Markdown table of :func:`collect`'s ``table``: a row per (data set, method), or with ``methods``
    only those, in that order within each data set; the difference column subtracts ``reference``'s runs
    whether or not its row is shown."""
    ref_rows = table
    if methods:
        order = {m: i for i, m in enumerate(methods)}
        datasets = list(dict.fromkeys(ds for ds, _ in table))
        table = dict(sorted(((k, v) for k, v in table.items() if k[1] in order),
                            key=lambda kv: (datasets.index(kv[0][0]), order[kv[0][1]])))
    seeds = sorted({s for per in table.values() for s in per})
    datasets = list(dict.fromkeys(ds for ds, _ in table))
    counts = sorted({n for ds, n in (folds or {}).items() if ds in datasets})
    if len(counts) == 1 and set(folds) >= set(datasets):
        over = f"the {counts[0]} outer folds"
    elif counts:
        over = "the outer folds (" + ", ".join(f"{folds[ds]} for {ds}" for ds in datasets if ds in folds) + ")"
    else:
        over = "the outer folds"
    lines = ["# Classical MIL benchmark across seeds", "",
             f"Bag accuracy / AUC (each the mean over {over} of one nested run) per seed, their "
             "mean over the seeds" + (f", and the mean minus {reference}'s" if reference else "") + ".", "",
             "| data set | method | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |"
             + (f" mean − {reference} |" if reference else ""),
             "|---|---|" + "---|" * (len(seeds) + 1) + ("---|" if reference else "")]
    for ds in datasets:
        ref = ref_rows.get((ds, reference), {}) if reference else {}
        for (d, method), per in table.items():
            if d != ds:
                continue
            cells = [f"{per[s]['accuracy']:.3f} / {per[s]['auc']:.3f}" if s in per else "—" for s in seeds]
            acc = np.mean([v["accuracy"] for v in per.values()])
            auc = np.mean([v["auc"] for v in per.values()])
            row = f"| {ds} | {method} | " + " | ".join(cells) + f" | {acc:.3f} / {auc:.3f} |"
            if reference:
                common = sorted(set(per) & set(ref))
                if method == reference or not common:
                    row += " — |"
                else:
                    d_acc = np.mean([per[s]["accuracy"] - ref[s]["accuracy"] for s in common])
                    d_auc = np.mean([per[s]["auc"] - ref[s]["auc"] for s in common])
                    row += f" {d_acc:+.3f} / {d_auc:+.3f} ({len(common)} seeds) |"
            lines.append(row)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, nargs="+", help="JSON files written by bench_mil_csv.py")
    ap.add_argument("--reference", default=None,
                    help="method to subtract [abmil where the runs hold it]; '' for none")
    ap.add_argument("--methods", nargs="+", default=None, help="only these methods, in this order")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        text = _table(args)
    except WsiMilsslError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0


def _table(args: argparse.Namespace) -> str:
    from wsi_milssl.cli.benchmark import refuse_shared_paths

    refuse_shared_paths({f"run {p}": p for p in args.runs}, {"--out": args.out})
    check_writable(args.out)
    runs = read_saved_runs(args.runs)
    refuse_unfinished(runs, [str(p) for p in args.runs])
    table = collect(runs, [str(p) for p in args.runs])
    known = list(dict.fromkeys(m for _, m in table))
    reference = args.reference if args.reference is not None else ("abmil" if "abmil" in known else "")
    unknown = [m for m in [*(args.methods or []), reference or None] if m is not None and m not in known]
    if unknown:
        raise ConfigError(f"{', '.join(unknown)}: in none of the runs (their methods: {', '.join(known)}); give "
                          "--methods and --reference from those ('--reference \"\"' for no reference).")
    text = render(table, reference or None, fold_counts(runs), args.methods)
    if args.out:
        atomic_write_text(args.out, text)
    return text


if __name__ == "__main__":
    sys.exit(main())
