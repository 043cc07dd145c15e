"""The label stage: exact per-patch tumour fractions, instance labels, slide labels, tumour masks to view.

- ``label_stores(stores, *, annotations_dir, labels_csv=None, config=LabelConfig(), out_dir=None)``
  labels every store and returns a LabelReport (``wsi-milssl label``).
- ``label_store(store_path, *, annotation_path, slide_label=None, config, mask_dir=None)`` one store.
- ``patch_labels(region, coords_lv0, patch_size_lv0, *, positive_fraction=0.25)`` the pure function.
- ``write_eval_mask`` / ``read_eval_mask``: ``<stem>_tumor_mask.png`` + ``.json`` sidecar.
- ``read_slide_labels(labels.csv)`` -> {stem: 0/1}.
"""

from wsi_milssl.labeling.masks import (
    MASK_META_SUFFIX,
    MASK_SUFFIX,
    eval_mask_paths,
    read_eval_mask,
    write_eval_mask,
)
from wsi_milssl.labeling.slide_labels import read_slide_labels
from wsi_milssl.labeling.stage import (
    CONFIG_JSON,
    STATUS_CSV,
    LabelReport,
    LabelResult,
    label_config_hash,
    label_store,
    label_stores,
    patch_labels,
)

__all__ = [
    "CONFIG_JSON",
    "LabelReport",
    "LabelResult",
    "MASK_META_SUFFIX",
    "MASK_SUFFIX",
    "STATUS_CSV",
    "eval_mask_paths",
    "label_config_hash",
    "label_store",
    "label_stores",
    "patch_labels",
    "read_eval_mask",
    "read_slide_labels",
    "write_eval_mask",
]
