"""Settings of the synthetic-slide generator (``wsi-milssl synth``)."""

from __future__ import annotations

from dataclasses import dataclass

from wsi_milssl.config.base import coerce_float_fields, check_choice, check_range, check_type
from wsi_milssl.errors import ConfigError

__all__ = ["SynthConfig", "MAX_SYNTH_SLIDES"]

#: the most slides one generated set holds (a test set of CAMELYON16's size is 130; review ES: 10^11 ran out of
#: memory with a traceback)
MAX_SYNTH_SLIDES = 100_000


@dataclass(frozen=True)
class SynthConfig:
    """Synthetic slide generation.

    Sizes are level-0 pixels; ``mpp`` is the level-0 resolution in µm per pixel, written into the
    TIFF resolution tags. Lesion and cell sizes are drawn in µm, so a slide at another ``mpp``
    shows the same biology at another scale.
    """

    n_slides: int = 4
    seed: int = 0
    width_px: int = 8192
    height_px: int = 8192
    mpp: float = 0.25
    tumor_slide_fraction: float = 0.5
    tile_size_px: int = 256
    jpeg_quality: int = 90
    level_downsample: int = 2
    min_level_size_px: int = 512

    def __post_init__(self) -> None:
        name = type(self).__name__
        coerce_float_fields(self)  # 10 and 10.0: the same config, the same digests
        check_type(name, "n_slides", self.n_slides, int)
        check_range(name, "n_slides", self.n_slides, low=1, high=MAX_SYNTH_SLIDES)
        check_type(name, "seed", self.seed, int)
        check_range(name, "seed", self.seed, low=0)
        for field in ("width_px", "height_px"):
            check_type(name, field, getattr(self, field), int)
            check_range(name, field, getattr(self, field), low=1024, high=200_000)
        check_range(name, "mpp", self.mpp, low=0.05, high=10.0)
        check_range(name, "tumor_slide_fraction", self.tumor_slide_fraction, low=0.0, high=1.0)
        check_type(name, "tile_size_px", self.tile_size_px, int)
        if self.tile_size_px % 16 or not 64 <= self.tile_size_px <= 2048:
            raise ConfigError(
                f"{name}.tile_size_px must be a multiple of 16 between 64 and 2048; got {self.tile_size_px!r}."
            )
        check_type(name, "jpeg_quality", self.jpeg_quality, int)
        check_range(name, "jpeg_quality", self.jpeg_quality, low=1, high=100)
        check_type(name, "level_downsample", self.level_downsample, int)
        check_choice(name, "level_downsample", self.level_downsample, (2, 4))
        check_type(name, "min_level_size_px", self.min_level_size_px, int)
        check_range(name, "min_level_size_px", self.min_level_size_px, low=64)
