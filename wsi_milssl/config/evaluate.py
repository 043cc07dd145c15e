"""Settings of the evaluation stage (``wsi-milssl evaluate``)."""

from __future__ import annotations

from dataclasses import dataclass

from wsi_milssl.config.base import (DEFAULT_NON_TUMOR_GROUPS, DEFAULT_TUMOR_GROUPS, check_groups, check_range,
                                     check_slide_mpp, check_type, coerce_float_fields)
from wsi_milssl.errors import ConfigError

__all__ = ["EvaluateConfig", "MAX_DISTANCE_UM"]

#: The largest ``margin_um`` / ``itc_major_axis_um`` accepted: 100 mm, longer than a glass slide (75 mm).
MAX_DISTANCE_UM = 100_000.0


@dataclass(frozen=True)
class EvaluateConfig:
    """Evaluation of heatmap predictions: instance AUC, bag AUC and the CAMELYON16 FROC.

    positive_fraction : a patch is a positive instance when the exact tumour-area fraction of its
        square is at least this (the paper's rule: 0.25). ``run`` takes ``[label] positive_fraction``
        unless ``[evaluate]`` sets it.
    tumor_groups : annotation groups (ASAP ``PartOfGroup``, QuPath classification) that are tumour;
        CAMELYON16: ``_0``, ``_1``, ``Tumor``. Matched case-insensitively. As ``LabelConfig.tumor_groups``
        (``run`` takes ``[label]``'s unless ``[evaluate]`` sets them).
    non_tumor_groups : groups carved out of tumour; CAMELYON16: ``_2``, ``Exclusion``, ``None``.
    margin_um : evaluation regions take in every level-5 pixel closer than ``margin_um / 2`` µm to
        tumour (CAMELYON16: 75 µm, about five tumour cells); 0 takes the tumour alone, undilated. At most
        :data:`MAX_DISTANCE_UM`.
    itc_major_axis_um : regions whose major axis is under this are isolated tumour cells, neither
        true nor false positives (CAMELYON16: 275 µm). At most :data:`MAX_DISTANCE_UM`.
    mpp : level-0 µm per pixel for every slide, in [0.01, 100] as every stage's ``slide_mpp``; None
        uses the ``mpp`` each slide's ``<stem>_probs.json`` records (what its heatmap was made at), and
        the slide's own metadata where there is no sidecar. A value that contradicts the sidecars is
        refused.
    froc_mpp : the µm per pixel at which ``margin_um`` and ``itc_major_axis_um`` are converted to pixels of
        the FROC's level-5 mask, in [0.01, 100]; None (the default) converts them at each slide's own µm/px
        (``mpp`` above), physically right. The CAMELYON16 script converts them at 0.243 for every slide
        (its ``L0_RESOLUTION``, :data:`wsi_milssl.evaluation.froc.CAMELYON16_MPP`), also for its Utrecht slides at about 0.226 µm/px: 0.243 gives the
        challenge's (leaderboard) numbers. Detections and annotations stay in level-0 pixels either way.
    lesion_exclude : slides left out of the lesion-level metrics, the FROC and the instance AUC (which read the
        annotations), and kept in the slide-level bag AUC; matched by name without case. CAMELYON16's organisers
        left ``Test_114`` (not exhaustively annotated) out of the lesion task so. A name of no evaluated slide is
        a warning.
    thumbnail_px : longer side of the per-slide images in ``report.html``, in screen pixels.
    title : heading of ``report.html``.

    Changing ``margin_um`` or ``itc_major_axis_um`` departs from the CAMELYON16 protocol.
    """

    positive_fraction: float = 0.25
    margin_um: float = 75.0
    itc_major_axis_um: float = 275.0
    mpp: float | None = None
    froc_mpp: float | None = None
    thumbnail_px: int = 320
    title: str = "wsi-milssl evaluation"
    tumor_groups: tuple[str, ...] = DEFAULT_TUMOR_GROUPS
    non_tumor_groups: tuple[str, ...] = DEFAULT_NON_TUMOR_GROUPS
    lesion_exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        name = type(self).__name__
        coerce_float_fields(self)  # 10 and 10.0: the same config, the same digests
        check_range(name, "positive_fraction", self.positive_fraction, low=0.0, high=1.0, low_inclusive=False)
        for field in ("margin_um", "itc_major_axis_um"):  # finite: infinity overflowed the mask arithmetic
            check_range(name, field, getattr(self, field), low=0.0, high=MAX_DISTANCE_UM)
        if self.mpp is not None:
            check_slide_mpp(name, "mpp", self.mpp)
        if self.froc_mpp is not None:
            check_slide_mpp(name, "froc_mpp", self.froc_mpp)
        check_type(name, "thumbnail_px", self.thumbnail_px, int)
        check_range(name, "thumbnail_px", self.thumbnail_px, low=32, high=4096)
        check_type(name, "title", self.title, str)
        check_groups(self)
        if isinstance(self.lesion_exclude, list):
            object.__setattr__(self, "lesion_exclude", tuple(self.lesion_exclude))
        if not isinstance(self.lesion_exclude, tuple):
            raise ConfigError(f"{name}.lesion_exclude must be a list of slide names, e.g. [\"Test_114\"]; got "
                              f"{self.lesion_exclude!r}.")
        bad = [v for v in self.lesion_exclude if not isinstance(v, str) or not v.strip()]
        if bad:
            raise ConfigError(f"{name}.lesion_exclude must hold slide names; got {bad!r}.")

    def group_map(self):
        """The annotations' GroupMap for these groups."""
        from wsi_milssl.annotations.groups import GroupMap

        return GroupMap(tumor=self.tumor_groups, non_tumor=self.non_tumor_groups)
