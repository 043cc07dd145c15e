"""Settings of the heatmap stage (``wsi-milssl heatmap``): slide inference, overlay and exports.

The tiling settings (target resolution, patch size, stride, entropy threshold, normalisation) are
not here: they come from the checkpoint, so a slide is cut exactly as the training stores were.
Only the tissue-mask settings, which checkpoints of older stores may lack, can be given here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from wsi_milssl.config.base import (DEFAULT_NON_TUMOR_GROUPS, DEFAULT_TUMOR_GROUPS, coerce_float_fields,
                                     check_choice, check_groups,
                                     check_inference_runtime, check_range, check_slide_mpp, check_type)

__all__ = ["HeatmapConfig", "HEATMAP_RUNTIME_ONLY_FIELDS"]

#: HeatmapConfig fields that change speed, not the maps (``channels_last`` and ``fuse_batchnorm`` by ~1e-6 at
#: most): a slide predicted with other values is kept, and ``wsi-milssl run`` does not run the stage for them.
#: ``amp`` counts through the precision it resolves to (:func:`wsi_milssl.inference.stage.resolved_precision`).
HEATMAP_RUNTIME_ONLY_FIELDS = ("batch_size", "num_workers", "device", "channels_last", "fuse_batchnorm", "threads",
                               "decode")

_HEX_COLOR = re.compile(r"^#[0-9a-fA-F]{6}$")


@dataclass(frozen=True)
class HeatmapConfig:
    """Slide inference, the overlay PNG and the exported files.

    Inference
    ---------
    batch_size : patches per model call (a DataLoader item holds at most this many); 0 = auto: 256 on
        CUDA, 64 on the CPU (:data:`wsi_milssl.runtime.AUTO_INFERENCE_BATCH`).
    num_workers : reader processes (one pool for the whole call, several slides in flight) that read,
        filter and decode patches while the model runs; -1 = auto: for a CPU model min(4, max(2, CPUs))
        readers at the lowest priority (they fill the forward pass's gaps), for CUDA CPUs - 2 (at
        most 16), divided by the ranks per machine under torchrun (LOCAL_WORLD_SIZE); 0 = read in the main
        process.
    decode : where a store's JPEG patches are decoded (``--store``): 'workers' (the readers) or
        'device' (``torchvision.io.decode_jpeg`` on the model's device in batches: nvJPEG on CUDA).
        Slides cut on the fly are always decoded by the readers.
    device : 'auto' (CUDA when present), 'cpu' or 'cuda'.
    amp : autocast precision: 'auto' = bfloat16 on the CPU and on CUDA with bf16 support, float16 on
        older GPUs; 'off' = float32; 'bf16' / 'fp16' force one. A slide predicted at another resolved
        precision is predicted again (float32 and bfloat16 maps differ by up to ~0.01).
    channels_last : NHWC memory layout for the convolutional model (faster on CPU and tensor cores).
    fuse_batchnorm : fold each eval-mode BatchNorm into the convolution before it
        (``torch.fx.experimental.optimization.fuse``; the same function, ~1e-7 apart in float32, about
        1.2x faster on the CPU). Kept off for a model that cannot be traced or whose folded outputs
        differ on a probe batch.
    threads : torch intra-op CPU threads (0 = leave torch's default).
    tissue, min_tissue, mask_mpp : tissue detector, minimum tissue fraction of a patch, and mask
        resolution (µm/px) used when tiling a slide on the fly; None = the value recorded with the
        training stores in the checkpoint, else the tile stage's default ('otsu', 0.1, 16.0).
    slide_mpp : level-0 µm/px to use instead of the slides' metadata (slides without an MPP).

    Overlay (``<stem>_heatmap.png``)
    --------------------------------
    The defaults keep the H&E readable: only patches at or above ``overlay_threshold`` are coloured,
    with a perceptually uniform map (viridis: brightness rises with the probability, readable in grey
    and by colour-blind readers) at half opacity.

    colormap : a registered colour map (``wsi_milssl.inference.heatmap.COLORMAPS``).
    alpha : opacity of the colour over the thumbnail, in [0, 1].
    vmin, vmax : probabilities mapped to the two ends of the colour map (and the colour bar).
    overlay_threshold : patches with a probability below this are left uncoloured (transparent).
    smooth_um : standard deviation in µm of a Gaussian applied to the map before drawing (0 = none;
        the map is then drawn with bilinear interpolation). Exports always hold the raw map.
    clip_to_tissue : colour only thumbnail pixels inside the tissue mask.
    thumbnail_px : longer side of the slide thumbnail under the overlay, in pixels.
    colorbar : append a colour bar panel to the right of the thumbnail.
    title : write the slide name and score in a band below the thumbnail.
    scale_bar : draw a scale bar (a round length in µm or mm) in that band.
    annotation_color, annotation_width_px : outline colour (#RRGGBB) and width of the tumour
        annotations, drawn when an annotation file is found for the slide.
    tumor_groups, non_tumor_groups : the annotation groups outlined as tumour and carved out of it, as
        ``LabelConfig`` reads them (default CAMELYON16's; ``run`` takes ``[label]``'s).

    Viewer files (``<stem>_probs.ome.tif``, ``_patches.geojson``, ``_lesions.geojson/.xml``)
    ---------------------------------------------------------------------------------------
    tumor_threshold : a patch at or above this probability is classified Tumor in the patch GeoJSON
        (else Normal), and the predicted lesion polygons are the contours of the map at this level.
    ome_downsample : level-0 pixels per pixel of the OME-TIFF's level 0 (an integer, so that it is
        registered to the slide exactly); 0 = automatic, the largest power of two that leaves at least
        8 pixels per grid stride (256 for 10x / 512 px patches on a 0.243 µm/px slide).

    Detections (``<stem>_detections.csv``)
    --------------------------------------
    detection_threshold : non-maximum suppression reports local maxima of the probability map down
        to this probability. FROC sweeps a threshold over the reported detections, so keep this well
        below the operating point (default 0.1).
    nms_radius_um : after a maximum is reported, every patch whose centre lies within this distance
        (µm, centre to centre) is suppressed. The default 1000 µm also suppresses the eight
        neighbours on the paper's grid (10x, 512 px patches = 512 µm stride).
    """

    batch_size: int = 0
    num_workers: int = -1
    device: str = "auto"
    amp: str = "auto"
    channels_last: bool = True
    fuse_batchnorm: bool = True
    decode: str = "workers"
    threads: int = 0
    tissue: str | None = None
    min_tissue: float | None = None
    mask_mpp: float | None = None
    slide_mpp: float | None = None
    colormap: str = "viridis"
    alpha: float = 0.5
    vmin: float = 0.0
    vmax: float = 1.0
    overlay_threshold: float = 0.5
    smooth_um: float = 0.0
    clip_to_tissue: bool = True
    thumbnail_px: int = 2048
    colorbar: bool = True
    title: bool = True
    scale_bar: bool = True
    annotation_color: str = "#000000"
    annotation_width_px: int = 3
    tumor_groups: tuple[str, ...] = DEFAULT_TUMOR_GROUPS
    non_tumor_groups: tuple[str, ...] = DEFAULT_NON_TUMOR_GROUPS
    tumor_threshold: float = 0.5
    ome_downsample: int = 0
    detection_threshold: float = 0.1
    nms_radius_um: float = 1000.0

    def __post_init__(self) -> None:
        name = type(self).__name__
        coerce_float_fields(self)  # 10 and 10.0: the same config, the same digests
        check_inference_runtime(self)
        if self.tissue is not None:
            check_type(name, "tissue", self.tissue, str)
            from wsi_milssl.config.tile import tissue_detectors

            check_choice(name, "tissue", self.tissue, tissue_detectors(), registry="register_tissue_detector")
        if self.min_tissue is not None:
            check_range(name, "min_tissue", self.min_tissue, low=0.0, high=1.0)
        if self.mask_mpp is not None:
            check_range(name, "mask_mpp", self.mask_mpp, low=0.5, high=200.0)
        if self.slide_mpp is not None:
            check_slide_mpp(name, "slide_mpp", self.slide_mpp)
        check_type(name, "colormap", self.colormap, str)
        from wsi_milssl.inference.colormaps import COLORMAPS

        check_choice(name, "colormap", self.colormap, sorted(COLORMAPS))
        check_range(name, "alpha", self.alpha, low=0.0, high=1.0)
        check_range(name, "vmin", self.vmin, low=0.0, high=1.0)
        check_range(name, "vmax", self.vmax, low=0.0, high=1.0)
        if not self.vmin < self.vmax:
            from wsi_milssl.errors import ConfigError

            raise ConfigError(f"{name}.vmin must be below vmax; got vmin={self.vmin!r}, vmax={self.vmax!r}.")
        check_range(name, "overlay_threshold", self.overlay_threshold, low=0.0, high=1.0)
        check_range(name, "smooth_um", self.smooth_um, low=0.0, high=1e6)
        check_type(name, "clip_to_tissue", self.clip_to_tissue, bool)
        check_type(name, "thumbnail_px", self.thumbnail_px, int)
        check_range(name, "thumbnail_px", self.thumbnail_px, low=64, high=16384)
        check_type(name, "colorbar", self.colorbar, bool)
        check_type(name, "title", self.title, bool)
        check_type(name, "scale_bar", self.scale_bar, bool)
        check_range(name, "tumor_threshold", self.tumor_threshold, low=0.0, high=1.0)
        check_type(name, "ome_downsample", self.ome_downsample, int)
        check_range(name, "ome_downsample", self.ome_downsample, low=0, high=65536)
        check_type(name, "annotation_color", self.annotation_color, str)
        if not _HEX_COLOR.match(self.annotation_color):
            from wsi_milssl.errors import ConfigError

            raise ConfigError(
                f"{name}.annotation_color must be a colour '#RRGGBB'; got {self.annotation_color!r}."
            )
        check_type(name, "annotation_width_px", self.annotation_width_px, int)
        check_range(name, "annotation_width_px", self.annotation_width_px, low=1, high=64)
        check_groups(self)
        check_range(name, "detection_threshold", self.detection_threshold, low=0.0, high=1.0)
        check_range(name, "nms_radius_um", self.nms_radius_um, low=0.0, high=1e6)
