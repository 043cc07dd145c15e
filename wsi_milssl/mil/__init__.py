"""MIL-SSL: multiple-instance learning as semi-supervised instance classification (the ``train`` stage).

- :func:`assign_pseudo_labels` — optimal-transport pseudo labels with the local constraint (eq. 4-8).
- :func:`fit` / :func:`train_one_epoch` / :func:`evaluate` — the self-training loop (eq. 9-11).
- :func:`load_model` — a trained model and its config from ``RUN_DIR/best.pt`` or ``last.pt``.
- :mod:`wsi_milssl.mil.models` — the model registry (``resnet18``, ``linear``, ``mlp``).
- :mod:`wsi_milssl.mil.data` — instance sets from patch stores, feature files and MIL CSVs; ``to_tensor``.

The formulas are in ``docs/method.md``.
"""

from wsi_milssl.lazy import lazy_exports

#: Public name -> the module that defines it. Imported on first use (PEP 562): a torch-free module of the package
#: (scores, the settings' checks) does not import torch.
_EXPORTS = {
    "FitResult": "wsi_milssl.mil.selftrain",
    "InstanceSet": "wsi_milssl.mil.data",
    "adaptive_mu": "wsi_milssl.mil.sinkhorn",
    "assign_pseudo_labels": "wsi_milssl.mil.sinkhorn",
    "create_model": "wsi_milssl.mil.models",
    "evaluate": "wsi_milssl.mil.selftrain",
    "fit": "wsi_milssl.mil.selftrain",
    "list_models": "wsi_milssl.mil.models",
    "load_model": "wsi_milssl.mil.checkpoint",
    "read_checkpoint": "wsi_milssl.mil.checkpoint",
    "read_feature_files": "wsi_milssl.mil.data",
    "read_labels_csv": "wsi_milssl.mil.data",
    "read_mil_csv": "wsi_milssl.mil.data",
    "read_patch_stores": "wsi_milssl.mil.data",
    "register_model": "wsi_milssl.mil.models",
    "to_tensor": "wsi_milssl.mil.data",
    "train_one_epoch": "wsi_milssl.mil.selftrain",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


__all__ = sorted(_EXPORTS)
