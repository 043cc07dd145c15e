"""PNG plots of the per-epoch training metrics (``RUN_DIR/metrics.png``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from wsi_milssl.atomic import atomic_open

__all__ = ["plot_training_metrics"]


def _series(history: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for rec in history:
        value = rec.get(key)
        if value is not None:
            xs.append(int(rec["epoch"]))
            ys.append(float(value))
    return xs, ys


def plot_training_metrics(history: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Draw loss, pseudo-label statistics (mean, μ_t, precision/recall/accuracy against instance labels)
    and validation AUCs per epoch into one PNG at ``path`` (written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
    panels = [
        (axes[0, 0], "training loss", [("loss", "soft cross-entropy")]),
        (axes[0, 1], "pseudo labels of positive-bag instances",
         [("mu_t", "μ_t"), ("pseudo_label_mean", "mean pseudo label"),
          ("pseudo_positive_fraction", "fraction > 0.5")]),
        (axes[1, 0], "pseudo labels vs instance labels (evaluation only)",
         [("pseudo_precision", "precision"), ("pseudo_recall", "recall"), ("pseudo_accuracy", "accuracy")]),
        (axes[1, 1], "validation", [("val_instance_auc", "instance AUC"), ("val_bag_auc", "bag AUC"),
                                    ("val_bag_accuracy", "bag accuracy")]),
    ]
    for ax, title, keys in panels:
        drawn = False
        for key, label in keys:
            xs, ys = _series(history, key)
            if xs:
                ax.plot(xs, ys, marker="o", markersize=3, label=label)
                drawn = True
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("epoch")
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not available", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.grid(alpha=0.3)
    try:
        with atomic_open(path, "wb") as fh:
            fig.savefig(fh, format="png", dpi=100)
    finally:
        plt.close(fig)
    return path
