"""MIL-SSL: multiple-instance learning as semi-supervised instance classification (the ``train`` stage).

- :func:`assign_pseudo_labels` — optimal-transport pseudo labels with the local constraint (eq. 4-8).
- :func:`fit` / :func:`train_one_epoch` / :func:`evaluate` — the self-training loop (eq. 9-11).
- :func:`load_model` — a trained model and its config from ``RUN_DIR/best.pt`` or ``last.pt``.
- :mod:`wsi_milssl.mil.models` — the model registry (``resnet18``, ``linear``, ``mlp``).
- :mod:`wsi_milssl.mil.data` — instance sets from patch stores, feature files and MIL CSVs; ``to_tensor``.

The formulas are in ``docs/method.md``.
"""

from wsi_milssl.mil.checkpoint import load_model, read_checkpoint
from wsi_milssl.mil.data import (
    InstanceSet,
    read_feature_files,
    read_labels_csv,
    read_mil_csv,
    read_patch_stores,
    to_tensor,
)
from wsi_milssl.mil.models import create_model, list_models, register_model
from wsi_milssl.mil.selftrain import FitResult, evaluate, fit, train_one_epoch
from wsi_milssl.mil.sinkhorn import adaptive_mu, assign_pseudo_labels

__all__ = [
    "assign_pseudo_labels",
    "adaptive_mu",
    "fit",
    "train_one_epoch",
    "evaluate",
    "FitResult",
    "load_model",
    "read_checkpoint",
    "InstanceSet",
    "read_feature_files",
    "read_labels_csv",
    "read_mil_csv",
    "read_patch_stores",
    "to_tensor",
    "create_model",
    "list_models",
    "register_model",
]
