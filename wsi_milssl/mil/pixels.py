"""Image patches -> model input: normalisation and the training augmentation, in one fused pass.

Every image model sees ``(x / 255 - mean) / std`` per RGB channel (:data:`NORMALISATION`, the ImageNet
statistics). Training adds, per patch, one of the eight symmetries of the square (horizontal flip,
vertical flip, then a 90-degree rotation, each with probability 1/2) and a mild colour jitter:
brightness, contrast and saturation factors ``b, c, s`` drawn uniformly from ``[1 - j, 1 + j]``.

The colour jitter is an affine map of each pixel's RGB vector, so it is applied as one 3x3 matrix and
offset per patch, folded together with the normalisation. With ``w = (0.299, 0.587, 0.114)`` the
luma weights, ``x`` a pixel in [0, 1] and ``m`` the patch's mean luma::

    brightness   x1 = b x
    contrast     x2 = c (x1 - b m) + b m
    saturation   x3 = s x2 + (1 - s) (w . x2) 1   = M x2,  M = s I + (1 - s) 1 w^T
    so           x3 = c b M x + (1 - c) b m 1      (M 1 = 1 because w sums to 1)
    clamped to [0, 1], then normalised.

Geometric transforms run on the uint8 pixels (a quarter of the bytes of float), grouped by symmetry;
the colour map is one batched matrix product on the float pixels. Random numbers come from an
explicit CPU ``torch.Generator`` (6 uniform draws per patch: flips, rotation, b, c, s), so a batch is
reproducible on any device, and nothing here waits for the GPU: what is computed on the host goes to a
CUDA device through pinned memory without blocking (a blocking copy would wait for every queued kernel,
the previous training step's included, and leave the GPU idle while the next step is launched).
"""

from __future__ import annotations

import numpy as np
import torch

from wsi_milssl.runtime import host_to_device

__all__ = ["NORMALISATION", "LUMA_WEIGHTS", "to_unit_float", "normalize", "to_tensor", "prepare_patches"]

#: Per-channel RGB mean and standard deviation (of [0, 1] pixel values) applied to every image input.
#: The ImageNet statistics, so a local ImageNet state dict passed with ``--weights`` sees familiar input.
NORMALISATION = {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}

#: ITU-R BT.601 luma weights (R, G, B), used by the contrast and saturation jitter.
LUMA_WEIGHTS = (0.299, 0.587, 0.114)


def to_unit_float(patches_uint8) -> torch.Tensor:
    """uint8 (B, H, W, 3) RGB (numpy or torch) -> float32 (B, 3, H, W) in [0, 1]."""
    x = torch.as_tensor(patches_uint8)
    if x.dtype != torch.uint8 or x.ndim != 4 or x.shape[-1] != 3:
        raise ValueError(f"patches must be uint8 (B, H, W, 3) RGB; got {x.dtype} {tuple(x.shape)}.")
    return x.permute(0, 3, 1, 2).float().div_(255.0)


def normalize(x_unit: torch.Tensor) -> torch.Tensor:
    """float (B, 3, H, W) in [0, 1] -> normalised with :data:`NORMALISATION` (a new tensor)."""
    mean_std = host_to_device(torch.tensor([NORMALISATION["mean"], NORMALISATION["std"]], dtype=x_unit.dtype),
                              x_unit.device)
    return (x_unit - mean_std[0].view(1, 3, 1, 1)) / mean_std[1].view(1, 3, 1, 1)


def to_tensor(patches_uint8) -> torch.Tensor:
    """The model input for image patches: uint8 (B, H, W, 3) RGB -> float32 (B, 3, H, W), normalised.

    Pixels are scaled to [0, 1] and standardised per channel with :data:`NORMALISATION`. Training
    (through :func:`prepare_patches`) and inference apply the same normalisation.
    """
    return normalize(to_unit_float(patches_uint8))


def _symmetries(x: torch.Tensor, code: np.ndarray) -> torch.Tensor:
    """Apply to each uint8 (H, W, 3) patch of ``x`` (B, H, W, 3) its symmetry ``code`` (int64 (B,)):
    bit 0 horizontal flip, bit 1 vertical flip, bit 2 a 90-degree rotation (after the flips).

    Each of the three transforms is computed for the whole batch and kept where its bit is set (a
    select): at most six kernels per batch whatever the mix of symmetries, instead of a group of
    kernels per symmetry present."""
    bits = ((code[None, :] >> np.arange(3)[:, None]) & 1).astype(bool)  # (3, B) on the host
    wanted = bits.any(axis=1).tolist()
    if not any(wanted):
        return x
    masks = host_to_device(torch.from_numpy(bits), x.device).view(3, -1, 1, 1, 1)
    for k, transform in enumerate((lambda t: t.flip(2), lambda t: t.flip(1), lambda t: t.rot90(1, (1, 2)))):
        if wanted[k]:
            x = torch.where(masks[k], transform(x), x)
    return x


def prepare_patches(pixels: torch.Tensor, *, generator: torch.Generator | None = None, flips: bool = True,
                    rot90: bool = True, colour_jitter: float = 0.0,
                    mean: tuple[float, float, float] = NORMALISATION["mean"],
                    std: tuple[float, float, float] = NORMALISATION["std"]) -> torch.Tensor:
    """uint8 (B, H, W, 3) RGB patches (on any device) -> float32 (B, 3, H, W) model input.

    Without ``generator`` this is the normalisation alone (inference, pseudo-label refresh,
    validation). With it, each patch also gets the random symmetry (``flips``; ``rot90`` only for
    square patches) and the colour jitter of strength ``colour_jitter`` described in the module
    docstring. The result is channels_last in memory (a permuted (B, H, W, 3) buffer) on the input's
    device; the same generator state gives the same batch.
    """
    x = torch.as_tensor(pixels)
    if x.dtype != torch.uint8 or x.ndim != 4 or x.shape[-1] != 3:
        raise ValueError(f"patches must be uint8 (B, H, W, 3) RGB; got {x.dtype} {tuple(x.shape)}.")
    b, h, w, _ = x.shape
    dev = x.device
    # The per-patch parameters are a few numbers per patch: computed with numpy on the host (torch's
    # per-operation overhead on such small tensors cost about 14 % of a 64-patch training step on an
    # H100, where the step is bound by the host), then sent to the device in one transfer.
    inv_std = np.array([1.0 / s for s in std], dtype=np.float32)
    mean_t = np.array(mean, dtype=np.float32)
    jitter = generator is not None and colour_jitter > 0 and b > 0
    if generator is not None and b > 0:
        draws = torch.rand(b, 6, generator=generator).numpy()
        code = np.zeros(b, dtype=np.int64)
        if flips:
            code |= (draws[:, 0] < 0.5).astype(np.int64) | ((draws[:, 1] < 0.5).astype(np.int64) << 1)
        if rot90 and h == w:
            code |= (draws[:, 2] < 0.5).astype(np.int64) << 2
        x = _symmetries(x.contiguous(), code)
    u = x.reshape(b, h * w, 3).float()  # (B, HW, 3) in 0..255
    if not jitter:
        scale_shift = host_to_device(torch.from_numpy(np.stack([inv_std / np.float32(255.0), -mean_t * inv_std])), dev)
        z = torch.addcmul(scale_shift[1], u, scale_shift[0])
        return z.view(b, h, w, 3).permute(0, 3, 1, 2)
    factors = np.float32(1.0) + (np.float32(2.0) * draws[:, 3:6] - np.float32(1.0)) * np.float32(colour_jitter)
    bright, contrast, sat = factors[:, 0], factors[:, 1], factors[:, 2]  # (B,) each
    luma = np.array(LUMA_WEIGHTS, dtype=np.float32)
    one = np.float32(1.0)
    m = sat[:, None, None] * np.eye(3, dtype=np.float32) + (one - sat)[:, None, None] * luma[None, None, :]
    # z = A u + o, with A = diag(1/std) c b M / 255 and o = diag(1/std) ((1 - c) b m_luma 1 - mean)
    a = inv_std[None, :, None] * (contrast * bright)[:, None, None] * m / np.float32(255.0)
    k = (one - contrast) * bright
    # every host value in one transfer: per patch A (9) and k (1), then the rows luma, 1/std,
    # mean/std and the clamp bounds
    fixed = np.stack([luma, inv_std, mean_t * inv_std, -mean_t * inv_std, (one - mean_t) * inv_std])  # (5, 3)
    packed = np.concatenate([a.reshape(b, 9), k[:, None]], axis=1).reshape(-1)
    packed = host_to_device(torch.from_numpy(np.concatenate([packed, fixed.reshape(-1)])), dev)
    per_patch_d = packed[:10 * b].view(b, 10)
    a_d, k_d = per_patch_d[:, :9].reshape(b, 3, 3), per_patch_d[:, 9]
    luma_d, inv_std_d, mean_std_d, low, high = packed[10 * b:].view(5, 3)
    mean_luma = u.mean(dim=1) @ luma_d / 255.0  # (B,) on the device
    o = (k_d * mean_luma).view(b, 1) * inv_std_d.view(1, 3) - mean_std_d.view(1, 3)
    z = torch.baddbmm(o.view(b, 1, 3), u, a_d.transpose(1, 2))
    z.clamp_(low, high)
    return z.view(b, h, w, 3).permute(0, 3, 1, 2)
