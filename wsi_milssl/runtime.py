"""Device and precision choices shared by training and slide inference.

Both stages take ``device`` ('auto', 'cpu', 'cuda') and ``amp`` ('auto', 'off', 'bf16', 'fp16') settings;
this module turns them into a torch device, an autocast dtype and the autocast context, so the rules
live in one place: CUDA when asked for or available; on CUDA bfloat16 where the GPU supports it, else
float16; on the CPU the caller's default (bfloat16 for convolutional models, float32 for small heads).
"""

from __future__ import annotations

import contextlib

import torch

from wsi_milssl.errors import ConfigError

__all__ = ["pick_device", "pick_amp_dtype", "autocast", "describe"]

_AMP_DTYPES = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def pick_device(requested: str, *, owner: str) -> torch.device:
    """The torch device for ``requested`` ('auto', 'cpu' or 'cuda'); ``owner`` names the config in errors."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{owner}.device is 'cuda' but no CUDA device is available; use 'auto' or 'cpu'.")
    return torch.device("cuda" if requested in ("auto", "cuda") and torch.cuda.is_available() else "cpu")


def pick_amp_dtype(amp: str, device: torch.device, *, cpu_auto: str = "bf16") -> torch.dtype | None:
    """Autocast dtype for ``amp`` on ``device`` (None = full precision). 'auto' is bf16 on CUDA with
    bf16 support, else fp16; on the CPU it is ``cpu_auto``."""
    if amp == "auto":
        if device.type == "cuda":
            amp = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        else:
            amp = cpu_auto
    return _AMP_DTYPES[amp]


def autocast(device: torch.device, dtype: torch.dtype | None):
    """``torch.autocast`` for ``dtype`` on ``device``, or a no-op context for full precision."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def describe(device: torch.device, dtype: torch.dtype | None, **flags) -> str:
    """One line for logs and configs: ``cpu amp=bfloat16 channels_last=True workers=2``."""
    amp = "off" if dtype is None else str(dtype).replace("torch.", "")
    return " ".join([str(device), f"amp={amp}"] + [f"{k}={v}" for k, v in flags.items()])
