"""Device and precision choices shared by training and slide inference.

Both stages take ``device`` ('auto', 'cpu', 'cuda') and ``amp`` ('auto', 'off', 'bf16', 'fp16') settings;
this module turns them into a torch device, an autocast dtype and the autocast context, so the rules
live in one place: CUDA when asked for or available; on CUDA bfloat16 where the GPU supports it, else
float16; on the CPU the caller's default (bfloat16 for convolutional models, float32 for small heads).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from wsi_milssl.errors import ConfigError

__all__ = ["pick_device", "pick_amp_dtype", "autocast", "describe", "host_to_device", "require_device_decode",
           "decode_jpeg_batch", "inference_batch_size", "AUTO_INFERENCE_BATCH", "readers_per_rank",
           "restores_torch_settings"]

def restores_torch_settings(fn):
    """Decorator of the stage functions that change process-wide torch settings: their ``threads`` setting
    (``torch.set_num_threads``) and cuDNN's ``benchmark`` / ``deterministic`` flags (training on CUDA is made
    deterministic, inference benchmarks its kernels). After the call they are as before it, so a later call in the
    same process (a notebook, a pipeline) with ``threads = 0`` (leave torch's count) runs with the caller's count,
    and the caller's own cuDNN choice holds again (review DB)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        before = torch.get_num_threads()
        cudnn = torch.backends.cudnn
        flags = (cudnn.benchmark, cudnn.deterministic)
        try:
            return fn(*args, **kwargs)
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)
            cudnn.benchmark, cudnn.deterministic = flags

    return wrapper


_AMP_DTYPES = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def readers_per_rank(workers: int, *, minimum: int) -> int:
    """An automatic reader count ``workers``, worked out for the whole machine, shared among the ranks that
    torchrun starts on it (:func:`wsi_milssl.distributed.local_world_size`): ``workers // ranks``, at least
    ``minimum``. One process keeps ``workers``."""
    from wsi_milssl.distributed import local_world_size

    return max(minimum, workers // local_world_size())


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


def _decode_jpeg():
    import warnings

    with warnings.catch_warnings():  # torchvision 0.29 announces a move of its codecs to torchcodec
        warnings.simplefilter("ignore", DeprecationWarning)
        from torchvision.io import ImageReadMode, decode_jpeg
    return decode_jpeg, ImageReadMode


#: Patches per model call of ``heatmap`` and ``features`` when their ``batch_size`` is 0 (auto), per
#: device type. On one H100 with 16 cores, ``heatmap`` of 14 slides (12,049 patches of 224 px) ran
#: 1.40x faster at 256 than at 64 (patches/s from the first slide opened to the last file written),
#: and 512 was no faster than 256 (benchmarks/results/gpu_h100_2026-11-27).
AUTO_INFERENCE_BATCH = {"cuda": 256, "cpu": 64}


def inference_batch_size(batch_size: int, device: torch.device) -> int:
    """``batch_size``, or for 0 (auto) the device's :data:`AUTO_INFERENCE_BATCH`."""
    return batch_size if batch_size > 0 else AUTO_INFERENCE_BATCH.get(device.type, 64)


def host_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host tensor ``t`` on ``device`` without waiting for the device: through pinned memory and a
    non-blocking copy on CUDA (a blocking copy waits for every kernel queued before it)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def require_device_decode(*, owner: str) -> None:
    """Raise ConfigError (naming ``owner``) when JPEG cannot be decoded on the device (no torchvision)."""
    try:
        _decode_jpeg()
    except ImportError:
        raise ConfigError(f"{owner}.decode 'device' decodes JPEG patches with torchvision.io.decode_jpeg, but "
                          "torchvision is not installed. Fix: pip install torchvision (the build matching torch), "
                          "or decode in the readers (--decode workers).") from None


def decode_jpeg_batch(data: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """uint8 (B, H, W, 3) RGB on ``device`` from B JPEG byte tensors (uint8, 1-D, on the CPU), decoded
    there in one call (``torchvision.io.decode_jpeg``: nvJPEG on CUDA, libjpeg-turbo on the CPU)."""
    if not data:
        return torch.zeros((0, 1, 1, 3), dtype=torch.uint8, device=device)
    import warnings

    decode_jpeg, mode = _decode_jpeg()
    if device.type == "cuda":
        # nvJPEG's hardware decoder (A100, H100) writes its output before the work already queued on the
        # stream has run, into blocks the caching allocator just freed: kernels still queued then read
        # the decoded bytes instead of their own data (NaN probabilities on an H100, 2026-11; see
        # pytorch/vision#9606 and meta-pytorch/torchcodec#1634). Drain the stream first.
        torch.cuda.current_stream(device).synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        images = decode_jpeg(list(data), mode=mode.RGB, device=device)
    return torch.stack(images).permute(0, 2, 3, 1)
