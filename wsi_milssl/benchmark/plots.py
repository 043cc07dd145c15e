"""A PNG of the classical MIL benchmark: every outer fold's bag accuracy and AUC, per method and data set.

Drawn with matplotlib's Agg canvas (no pyplot state, never opens a window). The input is what
:func:`wsi_milssl.benchmark.mil_csv.nested_cross_validation` returns, one per data set, so the figure
and the tables come from the same fold rows.
"""

from __future__ import annotations

import io
from typing import Any, Mapping, Sequence

import numpy as np

from wsi_milssl.errors import ConfigError

__all__ = ["fold_scores_png"]

#: (fold row key, axis label)
METRICS = (("accuracy", "bag accuracy"), ("auc", "bag AUC"))


def fold_scores_png(runs: Mapping[str, Mapping[str, Any]], *, methods: Sequence[str] | None = None,
                    labels: Mapping[str, str] | None = None) -> bytes:
    """One column per data set (``runs``: title -> nested-CV result), one row per metric; each method a
    column of dots (its outer folds, spread sideways so equal values stay visible) with its mean as a bar
    and ± one standard deviation as a line (cut at 1.03). ``methods`` picks and orders the methods (default: every
    method of the first run, in its order; a method a data set lacks leaves its place empty);
    ``labels`` renames them on the axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not runs:
        raise ConfigError("nothing to plot: no benchmark run given.")
    titles = list(runs)
    if methods is None:
        methods = list(next(iter(runs.values()))["methods"])
    methods = [m for m in methods if any(m in run["methods"] for run in runs.values())]
    if not methods:
        raise ConfigError("nothing to plot: none of the methods is in the runs.")
    labels = dict(labels or {})
    fig = Figure(figsize=(1.2 + 0.75 * len(methods) * len(titles), 6.4), constrained_layout=True)
    axes = fig.subplots(len(METRICS), len(titles), squeeze=False, sharey="row")
    rng = np.random.default_rng(0)  # the sideways spread only
    colours = [f"C{i % 10}" for i in range(len(methods))]
    lowest = [1.0] * len(METRICS)  # per row, the lowest dot or std line: the shared y axis starts below it
    for col, title in enumerate(titles):
        run = runs[title]
        for row, (key, axis_label) in enumerate(METRICS):
            ax = axes[row, col]
            for i, name in enumerate(methods):
                folds = run["methods"].get(name, {}).get("folds", [])
                values = np.array([f[key] for f in folds if f.get(key) is not None], dtype=float)
                if values.size == 0:
                    continue
                ax.scatter(i + rng.uniform(-0.18, 0.18, values.size), values, s=12, color=colours[i], alpha=0.55,
                           linewidths=0)
                mean, std = float(values.mean()), float(values.std())
                lowest[row] = min(lowest[row], float(values.min()), mean - std)
                ax.hlines(mean, i - 0.3, i + 0.3, color=colours[i], linewidth=2.5)
                ax.vlines(i, mean - std, mean + std, color=colours[i], linewidth=1)
                ax.annotate(f"{mean:.3f}", (i, mean), xytext=(0, 4), textcoords="offset points", ha="center",
                            fontsize=7)
            ax.set_xticks(range(len(methods)))
            ax.set_xticklabels([labels.get(m, m) for m in methods] if row == len(METRICS) - 1 else [],
                               rotation=40, ha="right", fontsize=8)
            ax.set_xlim(-0.6, len(methods) - 0.4)
            ax.grid(axis="y", alpha=0.3)
            if row == 0:
                ax.set_title(title, fontsize=10)
            if col == 0:
                ax.set_ylabel(axis_label)
    for row in range(len(METRICS)):  # both metrics end at 1; a std line past it is cut
        axes[row, 0].set_ylim(max(0.0, lowest[row] - 0.03), 1.03)
    fig.suptitle("outer folds (dots), mean (bar, value) and ± 1 std (line)", fontsize=9)
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()
