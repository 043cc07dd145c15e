"""Settings of the feature stage (``wsi-milssl features``): a frozen encoder over every patch."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from wsi_milssl.config.base import (coerce_float_fields, check_choice, check_inference_runtime, check_range,
                                     check_slide_mpp, check_type)
from wsi_milssl.errors import ConfigError

__all__ = ["FeaturesConfig", "FEATURES_RUNTIME_ONLY_FIELDS"]

#: FeaturesConfig fields that change speed, not the features (beyond rounding): left out of what a finished
#: feature file is reused for, and ``wsi-milssl run`` does not run the stage for them.
FEATURES_RUNTIME_ONLY_FIELDS = ("batch_size", "num_workers", "device", "channels_last", "fuse_batchnorm", "threads",
                                "decode")


@dataclass(frozen=True)
class FeaturesConfig:
    """Embedding patches with a frozen encoder.

    Encoder
    -------
    encoder : a registered encoder (``resnet50_trunc``: CLAM's ImageNet ResNet50 up to layer3, 1024-d;
        ``resnet18``: 512-d) or ``timm:NAME`` for any timm model (optional extra ``wsi-milssl[timm]``).
    weights : where the encoder's weights come from, never downloaded: a local file (e.g. a foundation
        model's checkpoint), 'cached' (the file torchvision's or timm's own download left in
        ``$TORCH_HOME/hub/checkpoints`` or the Hugging Face cache) or 'random' (a fixed random
        initialisation: speed tests only).
    encoder_kwargs : extra arguments of ``timm.create_model`` (JSON-able; e.g. ``{"init_values": 1e-5,
        "dynamic_img_size": true}`` for UNI).
    dtype : 'float32' or 'float16' features in the files.
    input_size_px : resize patches to this side (bilinear, antialiased) before the encoder; None = the
        encoder's fixed input size when it has one (vision transformers), else patches as tiled.

    Runtime (as for heatmaps; they change speed, not the features, beyond rounding)
    -------
    batch_size : patches per encoder call; 0 = auto: 256 on CUDA, 64 on the CPU.
    num_workers : reader processes (-1 = auto: 2-4 low-priority readers on the CPU, CPUs - 2 up to 16
        with CUDA; 0 = read in the main process).
    device : 'auto' (CUDA when present), 'cpu' or 'cuda'.
    amp : autocast precision: 'auto' = bfloat16 on the CPU and bf16-capable GPUs, else float16;
        'off' = float32; 'bf16' / 'fp16'. Part of the settings a finished file is reused for.
    channels_last, fuse_batchnorm : NHWC layout; BatchNorm folded into the convolutions (checked on a
        probe batch, kept off for models that cannot be traced).
    decode : where a store's JPEG patches are decoded: 'workers' or 'device' (torchvision, nvJPEG on CUDA).
    threads : torch CPU threads (0 = torch's default).
    slide_mpp : level-0 µm/px for slides without one (slides cut on the fly).
    """

    encoder: str = "resnet50_trunc"
    weights: str = "cached"
    encoder_kwargs: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    input_size_px: int | None = None
    batch_size: int = 0
    num_workers: int = -1
    device: str = "auto"
    amp: str = "auto"
    channels_last: bool = True
    fuse_batchnorm: bool = True
    decode: str = "workers"
    threads: int = 0
    slide_mpp: float | None = None

    def __post_init__(self) -> None:
        name = type(self).__name__
        coerce_float_fields(self)  # 10 and 10.0: the same config, the same digests
        check_type(name, "encoder", self.encoder, str)
        if not self.encoder.strip() or self.encoder.strip() == "timm:":
            raise ConfigError(f"{name}.encoder must name an encoder (e.g. 'resnet50_trunc' or 'timm:NAME'); "
                              f"got {self.encoder!r}.")
        check_type(name, "weights", self.weights, str)
        if not self.weights.strip():
            raise ConfigError(f"{name}.weights must be a file path, 'cached' or 'random'; got {self.weights!r}.")
        check_type(name, "encoder_kwargs", self.encoder_kwargs, dict)
        try:
            json.dumps(self.encoder_kwargs)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}.encoder_kwargs must hold JSON values (numbers, strings, lists, tables); "
                              f"got {self.encoder_kwargs!r}.") from None
        check_choice(name, "dtype", self.dtype, ("float32", "float16"))
        if self.input_size_px is not None:
            check_type(name, "input_size_px", self.input_size_px, int)
            check_range(name, "input_size_px", self.input_size_px, low=16, high=4096)
        check_inference_runtime(self)
        if self.slide_mpp is not None:
            check_slide_mpp(name, "slide_mpp", self.slide_mpp)
