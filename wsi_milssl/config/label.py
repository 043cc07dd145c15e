"""Settings of the label stage (``wsi-milssl label``)."""

from __future__ import annotations

from dataclasses import dataclass

from wsi_milssl.config.base import (DEFAULT_NON_TUMOR_GROUPS, DEFAULT_TUMOR_GROUPS, coerce_float_fields,
                                     check_groups, check_range,
                                     check_type)

__all__ = ["LabelConfig"]


@dataclass(frozen=True)
class LabelConfig:
    """Patch labels from annotations: exact tumour fractions, instance labels, tumour masks to check the
    labels by (``evaluate`` does not read the masks).

    positive_fraction : a patch is a positive instance (``instance_label`` 1) when the tumour area
        fraction of its square is at least this (the paper's rule: 0.25). In (0, 1].
    tumor_groups : annotation groups (ASAP ``PartOfGroup``, QuPath classification) that are tumour;
        CAMELYON16: ``_0``, ``_1``, ``Tumor``. Matched case-insensitively.
    non_tumor_groups : groups carved out of tumour; CAMELYON16: ``_2``, ``Exclusion``, ``None``.
    mask_downsample : level-0 pixels per tumour-mask pixel; 32 is CAMELYON16's level 5.
    write_masks : write a tumour mask per slide, to view and check the labels (``evaluate``
        does not read it).

    Instance labels are for evaluation only: training never reads them.
    """

    positive_fraction: float = 0.25
    tumor_groups: tuple[str, ...] = DEFAULT_TUMOR_GROUPS
    non_tumor_groups: tuple[str, ...] = DEFAULT_NON_TUMOR_GROUPS
    mask_downsample: int = 32
    write_masks: bool = True

    def __post_init__(self) -> None:
        name = type(self).__name__
        coerce_float_fields(self)  # 10 and 10.0: the same config, the same digests
        check_range(name, "positive_fraction", self.positive_fraction, low=0.0, high=1.0, low_inclusive=False)
        check_groups(self)
        check_type(name, "mask_downsample", self.mask_downsample, int)
        check_range(name, "mask_downsample", self.mask_downsample, low=1, high=1024)
        check_type(name, "write_masks", self.write_masks, bool)

    def group_map(self):
        """The annotations' GroupMap for these groups."""
        from wsi_milssl.annotations.groups import GroupMap

        return GroupMap(tumor=self.tumor_groups, non_tumor=self.non_tumor_groups)
