"""PNG plots of the per-epoch training metrics (``RUN_DIR/metrics.png``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from wsi_milssl.atomic import atomic_open

__all__ = ["plot_training_metrics", "training_metrics_figure"]

#: why a panel's instance-label series are missing: the training data carry no instance labels (they are
#: evaluation only, from the annotations, and never used to train)
NO_INSTANCE_LABELS = "the patches have no instance labels\n(their stores were never labelled: `wsi-milssl label`)"


def _series(history: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for rec in history:
        value = rec.get(key)
        if value is not None:
            xs.append(int(rec["epoch"]))
            ys.append(float(value))
    return xs, ys


def _has(history: Sequence[dict[str, Any]], *keys: str) -> bool:
    return any(rec.get(key) is not None for rec in history for key in keys)


def training_metrics_figure(history: Sequence[dict[str, Any]]):
    """The matplotlib Figure of :func:`plot_training_metrics` (Agg canvas, no pyplot state).

    A panel whose series are all missing says why: the instance-label panels when the patches have no
    instance labels (no ``pseudo_*`` record in any epoch), validation when there is none; the validation
    panel names its instance AUC as not available when it alone is missing."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(10, 7), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    labelled = _has(history, "pseudo_precision", "pseudo_recall", "pseudo_accuracy")
    validated = _has(history, "val_instance_auc", "val_bag_auc", "val_bag_accuracy")
    panels = [
        (axes[0, 0], "training loss", [("loss", "soft cross-entropy (nats)")], "no epoch recorded"),
        (axes[0, 1], "pseudo labels of positive-bag instances",
         [("mu_t", "μ_t"), ("pseudo_label_mean", "mean pseudo label"),
          ("pseudo_positive_fraction", "fraction > 0.5")], "no epoch recorded"),
        (axes[1, 0], "pseudo labels vs instance labels (evaluation only)",
         [("pseudo_precision", "precision"), ("pseudo_recall", "recall"), ("pseudo_accuracy", "accuracy")],
         NO_INSTANCE_LABELS if history else "no epoch recorded"),
        (axes[1, 1], "validation", [("val_instance_auc", "instance AUC"), ("val_bag_auc", "bag AUC"),
                                    ("val_bag_accuracy", "bag accuracy")],
         "no validation slides" if history else "no epoch recorded"),
    ]
    if validated and not _has(history, "val_instance_auc"):  # bag metrics drawn, instance AUC missing
        why = ("the validation patches have no instance labels\n(their stores were never labelled: `wsi-milssl label`)"
               if not labelled else "the validation patches lack instance\nlabels of both classes (tumour and normal)")
        missing = {"val_instance_auc": f"instance AUC: not available,\n{why}"}
    else:
        missing = {}
    y_labels = ["loss", "μ and fraction of instances", "precision, recall, accuracy", "AUC, accuracy"]
    best = next((rec.get("best_epoch") for rec in reversed(history) if rec.get("best_epoch") is not None), None)
    for (ax, title, keys, why), y_label in zip(panels, y_labels):
        drawn = False
        # a marker and a line style per series besides its colour: told apart in grey and by colour-blind readers
        for (key, label), (marker, style) in zip(keys, (("o", "-"), ("s", "--"), ("^", ":"))):
            xs, ys = _series(history, key)
            if xs:
                ax.plot(xs, ys, marker=marker, markersize=4, linestyle=style, label=label)
                drawn = True
        if drawn and best is not None and title == "validation":  # the epoch best.pt holds
            ax.axvline(best, color="0.4", linewidth=1, linestyle="-.", label=f"best.pt (epoch {best})")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("epoch")
        if drawn:
            ax.set_ylabel(y_label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # epochs: whole numbers
        for key, _ in keys:
            if drawn and key in missing:  # a legend entry without a line says why (last: the colours stay)
                ax.plot([], [], linestyle="none", label=missing[key])
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.set_xticks([])
            ax.set_yticks([])
            ax.text(0.5, 0.5, f"not available:\n{why}", ha="center", va="center", transform=ax.transAxes,
                    color="gray", fontsize=9)
        ax.grid(alpha=0.3)
    return fig


def plot_training_metrics(history: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Draw loss, pseudo-label statistics (mean, μ_t, precision/recall/accuracy against instance labels)
    and validation AUCs per epoch into one PNG at ``path`` (written atomically)."""
    from wsi_milssl.figures import png_bytes

    path = Path(path)
    fig = training_metrics_figure(history)
    with atomic_open(path, "wb") as fh:
        fh.write(png_bytes(fig, dpi=100))
    return path
