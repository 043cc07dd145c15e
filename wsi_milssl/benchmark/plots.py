"""PNG figures of the benchmarks, drawn from the same result dicts as their tables.

- :func:`fold_scores_png`: the classical MIL benchmark, every outer fold's bag accuracy and AUC per
  method and data set (input: :func:`wsi_milssl.benchmark.mil_csv.nested_cross_validation` results).
- :func:`digit_bags_png`: the digit-bag benchmark, instance and bag AUC per setting (positive ratio of
  the normal protocol, test set of the hard one), mean ± std over seeds (input: a result of
  :func:`wsi_milssl.benchmark.bags.run_normal` or ``run_hard``).

Drawn with matplotlib's Agg canvas (no pyplot state, never opens a window).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from wsi_milssl.errors import ConfigError

__all__ = ["fold_scores_png", "fold_scores_figure", "digit_bags_png", "digit_bags_figure"]

#: (fold row key, axis label)
METRICS = (("accuracy", "bag accuracy"), ("auc", "bag AUC"))
#: the narrowest fold-score figure, inches: its title fits
MIN_WIDTH = 4.0


def fold_scores_png(runs: Mapping[str, Mapping[str, Any]], *, methods: Sequence[str] | None = None,
                    labels: Mapping[str, str] | None = None, colours: Mapping[str, str] | None = None) -> bytes:
    """One column per data set (``runs``: title -> nested-CV result), one row per metric; each method a
    column of dots (its outer folds, spread sideways so equal values stay visible) with its mean as a bar
    and ± one standard deviation as a line (cut at 1.03). ``methods`` picks and orders the methods
    (default: every method of the first run, in its order; a method a data set lacks, or whose values
    are all missing, leaves its place empty); ``labels`` renames them on the axis; ``colours`` fixes a
    method's colour (default: matplotlib's cycle in the order of ``methods``)."""
    return _png(fold_scores_figure(runs, methods=methods, labels=labels, colours=colours))


def fold_scores_figure(runs: Mapping[str, Mapping[str, Any]], *, methods: Sequence[str] | None = None,
                       labels: Mapping[str, str] | None = None, colours: Mapping[str, str] | None = None):
    """The matplotlib Figure of :func:`fold_scores_png`."""
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
    # at least as wide as the title above the panels (one method of one data set was cut to 195 px)
    fig = Figure(figsize=(max(MIN_WIDTH, 1.2 + 0.75 * len(methods) * len(titles)), 6.4), constrained_layout=True)
    axes = fig.subplots(len(METRICS), len(titles), squeeze=False, sharey="row")
    rng = np.random.default_rng(0)  # the sideways spread only
    colour = {m: (colours or {}).get(m, f"C{i % 10}") for i, m in enumerate(methods)}
    lowest = [1.0] * len(METRICS)  # per row, the lowest dot or std line: the shared y axis starts below it
    for col, title in enumerate(titles):
        run = runs[title]
        for row, (key, axis_label) in enumerate(METRICS):
            ax = axes[row, col]
            for i, name in enumerate(methods):
                folds = run["methods"].get(name, {}).get("folds", [])
                values = np.array([f[key] for f in folds if f.get(key) is not None], dtype=float)
                values = values[np.isfinite(values)]
                if values.size == 0:
                    continue
                ax.scatter(i + rng.uniform(-0.18, 0.18, values.size), values, s=12, color=colour[name], alpha=0.55,
                           linewidths=0)
                mean, std = float(values.mean()), float(values.std())
                lowest[row] = min(lowest[row], float(values.min()), mean - std)
                ax.hlines(mean, i - 0.3, i + 0.3, color=colour[name], linewidth=2.5)
                ax.vlines(i, mean - std, mean + std, color=colour[name], linewidth=1)
                ax.annotate(f"{mean:.3f}", (i, mean), xytext=(3, 3), textcoords="offset points", ha="left",
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
    return fig


def digit_bags_png(result: Mapping[str, Any]) -> bytes:
    """The PNG of :func:`digit_bags_figure`."""
    return _png(digit_bags_figure(result))


def digit_bags_figure(result: Mapping[str, Any]):
    """Instance AUC (a series per method and instance scoring) and bag AUC (a series per method) per
    setting: the positive ratio for the normal protocol (lines through the seed means), the test set for
    the hard one (points); error bars ± one standard deviation over the seeds. A method keeps its colour
    in both panels; its series differ in marker (ABMIL's two scorings, MIL-SSL's λ rows of an untuned
    run), a secondary scoring (ABMIL's softmax attention) is dashed with open markers. Each panel's legend
    stands below it, off the data."""
    from matplotlib.figure import Figure

    rows = result.get("rows") or []
    if not rows:
        raise ConfigError("nothing to plot: the digit-bag result has no rows.")
    if result.get("protocol") not in ("normal", "hard"):
        raise ConfigError(f"a digit-bag figure draws the normal or hard protocol; got {result.get('protocol')!r} "
                          f"(the ablation is one table).")
    normal = result["protocol"] == "normal"
    setting = (lambda r: float(r["ratio"])) if normal else (lambda r: str(r["test"]))  # noqa: E731
    settings = sorted({setting(r) for r in rows}) if normal else list(dict.fromkeys(setting(r) for r in rows))
    names = [f"{100 * x:g}%" for x in settings] if normal else settings
    fig = Figure(figsize=(11, 5.2), constrained_layout=True)  # the legends below the panels take an inch
    axes = fig.subplots(1, 2, sharey=True)
    panels = ((axes[0], "instance_auc", "label", lambda r: True, "instance AUC"),
              (axes[1], "bag_auc", "bag_label", lambda r: r.get("primary", True), "bag AUC"))
    colour = {m: f"C{i % 10}" for i, m in enumerate(dict.fromkeys(r["method"] for r in rows))}
    lowest = 0.5  # the shared y axis shows chance level and every error bar; an AUC ends at 1 (a bar past it is cut)
    for ax, key, label_key, keep, title in panels:
        series = list(dict.fromkeys((r["method"], r[label_key], bool(r.get("primary", True))) for r in rows
                                    if keep(r)))
        markers = "osD^v"
        for i, (method, label, primary) in enumerate(series):
            nth = [m for m, _, _ in series[:i]].count(method)  # the method's how-many-th series
            means, stds = [], []
            for x in settings:
                values = [r[key] for r in rows if keep(r) and r[label_key] == label and setting(r) == x
                          and r.get(key) is not None and np.isfinite(r[key])]
                means.append(float(np.mean(values)) if values else np.nan)
                stds.append(float(np.std(values)) if values else np.nan)
            lowest = np.nanmin([lowest, *(np.array(means) - np.array(stds))])
            dodge = (i - (len(series) - 1) / 2) * (0.05 if normal else 0.08)  # error bars side by side
            ax.errorbar(np.arange(len(settings)) + dodge, means, yerr=stds, color=colour[method],
                        marker=markers[nth % len(markers)], markersize=4,
                        markerfacecolor=colour[method] if primary else "white", capsize=2, elinewidth=1,
                        linewidth=1.2 if normal else 0, linestyle="-" if primary else "--",
                        label=label)
        ax.set_xticks(range(len(settings)))
        ax.set_xticklabels(names)
        ax.set_xlabel("positive instances per positive bag" if normal else "test set")
        ax.set_title(title, fontsize=10)
        ax.axhline(0.5, color="gray", linewidth=0.8, linestyle=":")
        ax.grid(alpha=0.3)
    axes[0].set_ylim(max(0.0, lowest - 0.03), 1.03)
    axes[0].set_ylabel("AUC (mean ± std over seeds)")
    for ax in axes:  # below the panel, clear of its data and of its x label
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, frameon=False)
    seeds = sorted({r["seed"] for r in rows})
    fig.suptitle(f"digit bags, {result.get('protocol', '?')} protocol, seeds {', '.join(map(str, seeds))}",
                 fontsize=9)
    return fig


def _png(fig) -> bytes:
    from wsi_milssl.figures import png_bytes

    return png_bytes(fig, dpi=100)
