"""Settings of the tile stage (``wsi-milssl tile``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wsi_milssl.config.base import coerce_float_fields, check_choice, check_range, check_slide_mpp, check_type, config_hash
from wsi_milssl.errors import ConfigError

if TYPE_CHECKING:
    from wsi_milssl.tiling.plan import TilingPlan

__all__ = ["TileConfig", "DEFAULT_MAGNIFICATION", "TILE_RUNTIME_ONLY_FIELDS", "BUILTIN_TISSUE_DETECTORS",
           "tissue_detectors"]

#: TileConfig fields that change speed only: left out of a store's ``config_hash`` (:meth:`TileConfig.settings`),
#: and ``wsi-milssl run`` does not run the stage for them.
TILE_RUNTIME_ONLY_FIELDS = ("workers", "threads", "batch_size", "direct_tiff_read")

DEFAULT_MAGNIFICATION = 10.0


#: The built-in tissue detectors, as :mod:`wsi_milssl.slide.tissue` registers them (a test checks that they agree):
#: the settings are checked without importing the slide stack (OpenSlide, scikit-image; review CH).
BUILTIN_TISSUE_DETECTORS = ("none", "otsu")


def tissue_detectors() -> list[str]:
    """The tissue detectors a setting may name: the built-in ones, and every registered one once the registry has
    been imported (as code that registers its own detector has)."""
    import sys

    tissue = sys.modules.get("wsi_milssl.slide.tissue")
    return sorted(BUILTIN_TISSUE_DETECTORS if tissue is None else tissue.TISSUE_DETECTORS)


@dataclass(frozen=True)
class TileConfig:
    """Tiling a slide into patches at a physical resolution.

    magnification : target objective magnification (10 -> 1.0 µm/px with 40x = 0.25 µm/px). Give
        this or ``target_mpp``; with neither, 10x (the paper's setting).
    target_mpp : target resolution in µm per pixel.
    patch_size_px : patch side in pixels at the target resolution (the paper: 512 at 10x).
    stride_px : grid step in target pixels; None = patch_size_px (no overlap).
    entropy_threshold_bits : patches whose greyscale-histogram entropy is below this are dropped as
        background (the paper: 5 bits). 0 keeps every patch read.
    tissue : tissue detector run on a thumbnail before any patch is read ('otsu' or 'none').
    min_tissue : fraction of a patch's square that must be tissue for it to be read, in [0, 1].
    mask_mpp : resolution of the tissue-mask thumbnail in µm per pixel (16 = 64x downsample of a
        0.25 µm/px slide); the thumbnail's longer side is kept between 256 and 8192 px.
    pixels : keep patches as 'jpeg' bytes, 'raw' uint8, or 'none' (coordinates only).
    jpeg_quality : JPEG quality 1-100 when pixels = 'jpeg'.
    format : store format, 'h5' (HDF5) or 'zarr' (Zarr v3).
    slide_mpp : level-0 µm/px to use instead of the slides' metadata (for slides without an MPP).
    workers : slides tiled in parallel (processes); 0 or 1: one at a time in this process, as 0 means for the
        other stages' readers.
    threads : reader threads per worker (pixel reading, entropy and JPEG encoding overlap).
    batch_size : patches per write to the store (memory is bounded by this, not by slide size).
    direct_tiff_read : decode the tiles of tiled JPEG TIFF slides (generic TIFF, SVS) directly,
        several times faster than OpenSlide; used only when a probe read gives exactly OpenSlide's
        pixels. False reads everything through OpenSlide.
    allow_upsample : read slides whose resolution is coarser than the target by enlarging them
        (``--allow-upsample``). By default such a slide fails with an error that names both
        resolutions: upsampled patches look sharp but hold no more detail than the scan.

    ``workers``, ``threads``, ``batch_size`` and ``direct_tiff_read`` change speed only, so they are
    left out of the settings hash that decides whether an existing store can be reused.
    ``allow_upsample`` is left out too: it only permits a read, and a store records the resolution
    it was read at (``mpp``, ``target_mpp``).
    """

    magnification: float | None = None
    target_mpp: float | None = None
    patch_size_px: int = 512
    stride_px: int | None = None
    entropy_threshold_bits: float = 5.0
    tissue: str = "otsu"
    min_tissue: float = 0.1
    mask_mpp: float = 16.0
    pixels: str = "jpeg"
    jpeg_quality: int = 90
    format: str = "h5"
    slide_mpp: float | None = None
    workers: int = 1
    threads: int = 2
    batch_size: int = 256
    direct_tiff_read: bool = True
    allow_upsample: bool = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        coerce_float_fields(self)  # 10 and 10.0: the same config, the same digests
        if self.magnification is not None and self.target_mpp is not None:
            raise ConfigError(
                f"{name}: give magnification or target_mpp, not both; got magnification={self.magnification!r} "
                f"and target_mpp={self.target_mpp!r}."
            )
        if self.magnification is not None:
            check_range(name, "magnification", self.magnification, low=0.1, high=200.0)
        if self.target_mpp is not None:
            check_range(name, "target_mpp", self.target_mpp, low=0.01, high=1000.0)
        check_type(name, "patch_size_px", self.patch_size_px, int)
        check_range(name, "patch_size_px", self.patch_size_px, low=8, high=8192)
        if self.stride_px is not None:
            check_type(name, "stride_px", self.stride_px, int)
            check_range(name, "stride_px", self.stride_px, low=1, high=65536)
        check_range(name, "entropy_threshold_bits", self.entropy_threshold_bits, low=0.0, high=8.0)
        check_type(name, "tissue", self.tissue, str)
        check_choice(name, "tissue", self.tissue, tissue_detectors(), registry="register_tissue_detector")
        check_range(name, "min_tissue", self.min_tissue, low=0.0, high=1.0)
        check_range(name, "mask_mpp", self.mask_mpp, low=0.5, high=200.0)
        check_choice(name, "pixels", self.pixels, ("jpeg", "raw", "none"))
        check_type(name, "jpeg_quality", self.jpeg_quality, int)
        check_range(name, "jpeg_quality", self.jpeg_quality, low=1, high=100)
        check_choice(name, "format", self.format, ("h5", "zarr"))
        if self.slide_mpp is not None:
            check_slide_mpp(name, "slide_mpp", self.slide_mpp)
        for field, low, high in (("workers", 0, 256), ("threads", 1, 64), ("batch_size", 1, 1 << 20)):
            check_type(name, field, getattr(self, field), int)
            check_range(name, field, getattr(self, field), low=low, high=high)
        check_type(name, "direct_tiff_read", self.direct_tiff_read, bool)
        check_type(name, "allow_upsample", self.allow_upsample, bool)

    @property
    def resolved_target_mpp(self) -> float:
        """Target resolution in µm/px (from target_mpp, magnification, or the 10x default)."""
        from wsi_milssl.slide.resolution import magnification_to_mpp

        if self.target_mpp is not None:
            return float(self.target_mpp)
        return magnification_to_mpp(self.magnification if self.magnification is not None else DEFAULT_MAGNIFICATION)

    @property
    def resolved_stride_px(self) -> int:
        return self.patch_size_px if self.stride_px is None else self.stride_px

    def settings(self) -> dict[str, Any]:
        """The resolved settings that decide a store's content (hashed into ``config_hash``)."""
        from wsi_milssl.store.schema import SCHEMA_VERSION

        return {
            "schema_version": SCHEMA_VERSION,
            "target_mpp": round(self.resolved_target_mpp, 9),
            "patch_size_px": self.patch_size_px,
            "stride_px": self.resolved_stride_px,
            "entropy_threshold_bits": float(self.entropy_threshold_bits),
            "tissue": self.tissue,
            "min_tissue": float(self.min_tissue),
            "mask_mpp": float(self.mask_mpp),
            "pixels": self.pixels,
            "jpeg_quality": self.jpeg_quality if self.pixels == "jpeg" else None,
            "format": self.format,
            "slide_mpp": None if self.slide_mpp is None else float(self.slide_mpp),
        }

    def settings_hash(self) -> str:
        """Short SHA-256 of :meth:`settings`."""
        return config_hash(self.settings())

    def tiling_plan(self) -> "TilingPlan":
        """The tile recipe of this config (:class:`wsi_milssl.tiling.TilingPlan`): what decides which
        cells are cut and how they are read; recorded in every store and carried into checkpoints."""
        from wsi_milssl.tiling.plan import TilingPlan

        return TilingPlan.from_tile_config(self)
