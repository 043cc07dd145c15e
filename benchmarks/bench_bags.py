"""The paper's digit-bag tables on this machine: normal bags (tables 1-3), hard bags (table 4) and the
MIL-SSL ablation (table 8), written to ``benchmarks/results/bags.md`` (and ``bags.json``).

MIL-SSL runs with λ = 1 (the main row) and the paper's λ = 25 (shown for honesty); ABMIL's instance
scores are reported as the softmax attention and as the raw attention logit. Nothing is chosen on test
bags (see ``wsi_milssl.benchmark.bags``).

Run: ``python benchmarks/bench_bags.py [--seeds 0 1 2 3 4] [--workers 2] [--epochs 100] [--mnist DIR]
[--only normal hard ablation] [--out benchmarks/results/bags.md]``. With the defaults (scikit-learn's 8x8
digits, 5 seeds) it takes about 30 CPU-minutes per protocol-table set (measured: 70 minutes of wall time
on two shared CPU cores for all three). ``--from-json bags.json`` re-renders the markdown of a saved
run without training.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from wsi_milssl.events import ProgressEvent
from wsi_milssl.benchmark.bags import BagBenchConfig, acceptance, format_markdown, run_ablation, run_hard, run_normal


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


TITLES = {"normal": "Normal bags", "hard": "Hard bags", "ablation": "Ablation"}


def _render(results: dict) -> str:
    """The markdown file: a header, then each protocol's tables (:func:`format_markdown`)."""
    sections = ["# Digit-bag benchmarks (paper tables 1-4 and 8)", "",
                f"Produced by `python benchmarks/bench_bags.py` on {results.get('machine', 'this machine')}.", ""]
    for name, title in TITLES.items():
        if name in results:
            sections += [f"## {title}", "", format_markdown(results[name])]
    return "\n".join(sections)


def _progress(event: ProgressEvent) -> None:
    if event.total:
        print(f"  {event.stage}: {event.done}/{event.total} {event.item}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--workers", type=int, default=2, help="parallel processes (one torch thread each)")
    ap.add_argument("--mnist", default=None, metavar="DIR", help="MNIST IDX folder [scikit-learn 8x8 digits]")
    ap.add_argument("--bag-size", type=int, default=None)
    ap.add_argument("--lams", type=float, nargs="+", default=[1.0, 25.0])
    ap.add_argument("--only", nargs="+", choices=("normal", "hard", "ablation"), default=["normal", "hard", "ablation"])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "bags.md")
    ap.add_argument("--from-json", type=Path, default=None, metavar="PATH",
                    help="re-render the tables of a saved bags.json instead of training")
    args = ap.parse_args()
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        _write(args.out, _render(saved) + "\n")
        print(f"wrote {args.out}")
        return 0

    config = BagBenchConfig(seeds=tuple(args.seeds), epochs=args.epochs, workers=args.workers, threads=1,
                            mnist_dir=args.mnist, bag_size=args.bag_size, lams=tuple(args.lams))
    results: dict = {"machine": f"{os.cpu_count()} CPUs ({platform.machine()}, {platform.system()}), torch "
                                f"{torch.__version__}, {time.strftime('%Y-%m-%d')}"}
    runners = {"normal": run_normal, "hard": run_hard, "ablation": run_ablation}
    for name in args.only:
        runner = runners[name]
        print(f"{TITLES[name]} ...", flush=True)
        result = runner(config, progress=_progress)
        results[name] = result
        print(format_markdown(result), flush=True)
        print(json.dumps(acceptance(result), indent=1, default=str), flush=True)
    _write(args.out, _render(results) + "\n")
    _write(args.out.with_suffix(".json"), json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
