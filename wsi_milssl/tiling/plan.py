"""The tile recipe as one frozen object: which grid cells of a slide are cut, and how they are read.

    from wsi_milssl.config import TileConfig
    from wsi_milssl.tiling import TilingPlan

    plan = TileConfig(magnification=10, patch_size_px=512).tiling_plan()
    plan.to_dict()                       # plain JSON-able dict; TilingPlan.from_dict(d) == plan

The tile stage records the plan in every store (root attribute ``tiling_plan``, its JSON), training
copies it unchanged into the checkpoint (config key ``tiling_plan``), and the heatmap stage cuts
slides with it through the same functions (:mod:`wsi_milssl.tiling.cells`), so both stages keep the
same cells.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping

from wsi_milssl.config.base import check_choice, check_range, check_type, config_from_mapping, config_to_dict
from wsi_milssl.errors import ConfigError

__all__ = ["PLAN_ATTR", "TilingPlan"]

#: Store root attribute (JSON of :meth:`TilingPlan.to_dict`) and checkpoint config key of the plan.
PLAN_ATTR = "tiling_plan"


@dataclass(frozen=True)
class TilingPlan:
    """Everything that decides which cells of a slide become patches, and the reader that cuts them.

    target_mpp : patch resolution, µm per pixel.
    patch_size_px, stride_px : patch side and grid step in pixels at ``target_mpp``; the grid starts
        at level-0 (0, 0) and keeps only cells wholly inside the slide.
    tissue : tissue detector run on a thumbnail (``wsi_milssl.slide.tissue.TISSUE_DETECTORS``).
    min_tissue : fraction of a cell that must be tissue on the mask for it to be read, in [0, 1].
    mask_mpp : resolution of the tissue-mask thumbnail, µm per pixel.
    entropy_threshold_bits : cells whose greyscale-histogram entropy is below this are dropped.
    direct_tiff_read : decode tiled JPEG TIFF levels directly (only where a probe read equals
        OpenSlide's pixels) instead of through OpenSlide; the same pixels either way.
    allow_upsample : cut slides scanned coarser than ``target_mpp`` by enlarging them; False refuses
        such a slide (ResolutionError) instead of cutting it.
    """

    target_mpp: float
    patch_size_px: int
    stride_px: int
    tissue: str = "otsu"
    min_tissue: float = 0.1
    mask_mpp: float = 16.0
    entropy_threshold_bits: float = 5.0
    direct_tiff_read: bool = True
    allow_upsample: bool = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        check_range(name, "target_mpp", self.target_mpp, low=0.01, high=1000.0)
        check_type(name, "patch_size_px", self.patch_size_px, int)
        check_range(name, "patch_size_px", self.patch_size_px, low=8, high=8192)
        check_type(name, "stride_px", self.stride_px, int)
        check_range(name, "stride_px", self.stride_px, low=1, high=65536)
        check_type(name, "tissue", self.tissue, str)
        from wsi_milssl.config.tile import tissue_detectors

        check_choice(name, "tissue", self.tissue, tissue_detectors(), registry="register_tissue_detector")
        check_range(name, "min_tissue", self.min_tissue, low=0.0, high=1.0)
        check_range(name, "mask_mpp", self.mask_mpp, low=0.5, high=200.0)
        check_range(name, "entropy_threshold_bits", self.entropy_threshold_bits, low=0.0, high=8.0)
        check_type(name, "direct_tiff_read", self.direct_tiff_read, bool)
        check_type(name, "allow_upsample", self.allow_upsample, bool)
        # one representation for equal plans (an int given for a float field compares and hashes equal,
        # but would print and serialise as an int)
        for field in ("target_mpp", "min_tissue", "mask_mpp", "entropy_threshold_bits"):
            object.__setattr__(self, field, float(getattr(self, field)))

    @classmethod
    def from_tile_config(cls, config) -> "TilingPlan":
        """The plan of a :class:`~wsi_milssl.config.TileConfig` (its resolved target µm/px and stride)."""
        return cls(
            target_mpp=float(config.resolved_target_mpp),
            patch_size_px=int(config.patch_size_px),
            stride_px=int(config.resolved_stride_px),
            tissue=str(config.tissue),
            min_tissue=float(config.min_tissue),
            mask_mpp=float(config.mask_mpp),
            entropy_threshold_bits=float(config.entropy_threshold_bits),
            direct_tiff_read=bool(config.direct_tiff_read),
            allow_upsample=bool(config.allow_upsample),
        )

    def to_dict(self) -> dict[str, Any]:
        """The plan as a plain dict (JSON-able); :meth:`from_dict` rebuilds an equal plan."""
        return config_to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "tiling plan") -> "TilingPlan":
        """Rebuild a plan from :meth:`to_dict`'s output. Raises ConfigError naming ``source`` and the
        field on an unknown key, a missing field or a bad value."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: a tiling plan must be a mapping of its fields; got {type(data).__name__}.")
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        missing = [k for k in required if k not in data]
        if missing:
            raise ConfigError(f"{source}: the tiling plan lacks {', '.join(missing)}. "
                              "Fix: re-tile the slides with `wsi-milssl tile` to record a complete plan.")
        return config_from_mapping(cls, data, source=source)

    def to_json(self) -> str:
        """Compact JSON of :meth:`to_dict` with sorted keys (the store attribute's value)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "tiling plan") -> "TilingPlan":
        """Rebuild a plan from :meth:`to_json`'s output (ConfigError naming ``source`` on bad JSON)."""
        try:
            data = json.loads(text)
        except (TypeError, ValueError, RecursionError) as exc:  # (nested past Python's limit: review ES)
            raise ConfigError(f"{source}: the tiling plan is not valid JSON ({type(exc).__name__}: {exc}). "
                              "Fix: re-tile the slides with `wsi-milssl tile`.") from None
        return cls.from_dict(data, source=source)

    def with_tissue(self, *, tissue: str | None = None, min_tissue: float | None = None,
                    mask_mpp: float | None = None) -> "TilingPlan":
        """A copy with the tissue-mask settings that are not None replaced (HeatmapConfig's overrides)."""
        changes = {k: v for k, v in (("tissue", tissue), ("min_tissue", min_tissue), ("mask_mpp", mask_mpp))
                   if v is not None}
        return dataclasses.replace(self, **changes) if changes else self
