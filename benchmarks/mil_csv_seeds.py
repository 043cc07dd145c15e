"""How much the classical MIL table moves with the seed: per data set and method, the bag accuracy (and AUC)
of several ``bench_mil_csv.py`` runs that differ only in ``--seed`` (the outer and inner folds and every
model's initialisation change with it), their mean, and each method's mean minus a reference method's.

    python benchmarks/bench_mil_csv.py --datasets musk1 --seed 1 --methods mil-ssl-improved abmil --out s1.md
    python benchmarks/mil_csv_seeds.py s0.json s1.json s2.json --reference abmil --out seeds.md

A run may hold several data sets and methods; a (data set, method, seed) given twice is an error.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np


def collect(runs: list[dict]) -> dict[tuple[str, str], dict[int, dict[str, float]]]:
    """{(data set, method): {seed: {"accuracy": mean over folds, "auc": ...}}}"""
    out: dict[tuple[str, str], dict[int, dict[str, float]]] = defaultdict(dict)
    for run in runs:
        seed = int(run["meta"]["seed"])
        for ds, res in run["datasets"].items():
            for method, r in res["methods"].items():
                if seed in out[(ds, method)]:
                    raise SystemExit(f"{ds} / {method} / seed {seed} is in two runs; give each once")
                out[(ds, method)][seed] = {k: r["summary"][k]["mean"] for k in ("accuracy", "auc")}
    return dict(out)


def render(table: dict[tuple[str, str], dict[int, dict[str, float]]], reference: str | None) -> str:
    seeds = sorted({s for per in table.values() for s in per})
    datasets = list(dict.fromkeys(ds for ds, _ in table))
    lines = ["# Classical MIL benchmark across seeds", "",
             "Bag accuracy / AUC (each the mean over the 10 outer folds of one nested run) per seed, their "
             "mean over the seeds" + (f", and the mean minus {reference}'s" if reference else "") + ".", "",
             "| data set | method | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |"
             + (f" mean − {reference} |" if reference else ""),
             "|---|---|" + "---|" * (len(seeds) + 1) + ("---|" if reference else "")]
    for ds in datasets:
        ref = table.get((ds, reference), {}) if reference else {}
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, nargs="+", help="JSON files written by bench_mil_csv.py")
    ap.add_argument("--reference", default="abmil", help="method to subtract ('' for none)")
    ap.add_argument("--methods", nargs="+", default=None, help="only these methods, in this order")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    table = collect([json.loads(p.read_text()) for p in args.runs])
    if args.methods:  # only these, in this order within each data set
        order = {m: i for i, m in enumerate(args.methods)}
        datasets = list(dict.fromkeys(ds for ds, _ in table))
        table = dict(sorted(((k, v) for k, v in table.items() if k[1] in order),
                            key=lambda kv: (datasets.index(kv[0][0]), order[kv[0][1]])))
    text = render(table, args.reference or None)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
