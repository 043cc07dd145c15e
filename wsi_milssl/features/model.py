"""A frozen encoder ready for the slide engine: the model object :func:`wsi_milssl.inference.predict.run_slides` runs.

:class:`FeatureModel` is a :class:`~wsi_milssl.inference.model.PatchModel` (the same device, precision,
BatchNorm folding, channels_last and reader-side normalisation as slide inference, with the encoder's
own mean/std) whose batch function returns the features (B, D) on the device, optionally after
resizing the patches to the encoder's input size.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from wsi_milssl.config.features import FeaturesConfig
from wsi_milssl.features.encoders import Encoder, create_encoder
from wsi_milssl.inference.model import InferenceRuntime, PatchModel, TilingSettings, resolve_runtime
from wsi_milssl.tiling import TilingPlan

__all__ = ["FeatureModel", "load_feature_model"]

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16}


class FeatureModel(PatchModel):
    """``encoder`` over patches cut with ``plan``: :meth:`forward_batch` gives float (B, D) features.

    ``dtype``: 'float32' or 'float16' output; ``input_size_px``: resize patches to this side first
    (None: as they come).
    """

    def __init__(self, encoder: Encoder, *, plan: TilingPlan, runtime: InferenceRuntime, dtype: str = "float32",
                 input_size_px: int | None = None) -> None:
        self.encoder = encoder
        self.input_size_px = None if input_size_px in (None, plan.patch_size_px) else int(input_size_px)
        self.out_dtype = _DTYPES[dtype]
        super().__init__(encoder.module, tiling=TilingSettings(plan=plan, mean=encoder.mean, std=encoder.std),
                         runtime=runtime, probe_side=self.input_size_px or plan.patch_size_px)

    @property
    def dim(self) -> int:
        return int(self.encoder.dim)

    def forward_batch(self, batch) -> torch.Tensor:
        """Features (B, D) in the output dtype, on the device: uint8 (B, H, W, 3) pixels or a reader-made
        tensor (B, 3, H, W)."""
        with torch.inference_mode():
            x = self.network_input(batch)
            if self.input_size_px is not None:
                side = self.input_size_px
                x = F.interpolate(x.float(), size=(side, side), mode="bilinear", antialias=True,
                                  align_corners=False).to(x.dtype)
                if self.runtime.channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
            with self.runtime.autocast():
                out = self.model(x)
            return out.reshape(out.shape[0], -1).to(self.out_dtype)


def load_feature_model(config: FeaturesConfig, *, plan: TilingPlan, encoder: Encoder | None = None) -> FeatureModel:
    """The encoder of ``config`` (or ``encoder``) on ``config``'s runtime, for patches cut with ``plan``.

    The input size: ``config.input_size_px``, else the encoder's fixed input size when it has one and the
    patches differ (logged), else the patches as they are. ``config.threads`` > 0 sets torch's thread count
    for the whole process (:func:`~wsi_milssl.features.extract_features` gives the count back when it returns).
    """
    runtime = resolve_runtime(config)
    if config.threads > 0:  # for the whole process: extract_features gives the count back, a model loaded by hand not
        torch.set_num_threads(config.threads)
    if runtime.device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    if encoder is None:
        encoder = create_encoder(config.encoder, weights=config.weights, kwargs=config.encoder_kwargs)
    size = config.input_size_px
    if size is None and encoder.input_size_px is not None and encoder.input_size_px != plan.patch_size_px:
        size = encoder.input_size_px
        log.info("encoder %s takes %d px input; patches of %d px are resized to it", encoder.name, size,
                 plan.patch_size_px)
    return FeatureModel(encoder, plan=plan, runtime=runtime, dtype=config.dtype, input_size_px=size)
