"""Slide (or patch store) -> per-patch tumour probabilities.

Straight from a slide, the slide is tiled on the fly exactly as the tile stage does, with the
settings recorded in the checkpoint (target µm/px, patch size, stride, entropy threshold, and the
tissue-mask settings): tissue mask on a thumbnail -> grid of level-0 cells -> cells with enough
tissue -> bands of neighbouring cells read at the pyramid level of the read plan -> entropy filter.
From a store (``--store``), the store's patches are used as they are.

Patches are read, decoded and filtered by DataLoader worker processes while the model runs in the
main process. On the CPU the workers also apply the model's preprocessing
(:func:`wsi_milssl.mil.data.to_tensor`) and cast to bfloat16, so the main process does nothing but
the forward pass (bfloat16 autocast, channels_last), and they run at the lowest priority: the forward
pass already keeps every core busy, so the readers fill its gaps instead of stalling its threads. On
CUDA the workers hand over uint8 pixels (4x less to copy), which are moved to the GPU from pinned
memory and normalised there; the forward pass runs under autocast (bfloat16, or float16 on GPUs
without bf16). On both, eval-mode BatchNorm is folded into the convolutions first
(:func:`fuse_batchnorm`).

Memory is bounded by ``num_workers x prefetch x batch_size`` patches whatever the slide size: only
the level-0 coordinates and one float per patch are kept for the whole slide.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from wsi_milssl import runtime as runtime_rules
from wsi_milssl.config.heatmap import HeatmapConfig
from wsi_milssl.config.tile import TileConfig
from wsi_milssl.errors import CheckpointError, ConfigError, MissingResolutionError, StoreError
from wsi_milssl.events import ProgressCallback, ProgressEvent, emit
from wsi_milssl.mil.data import NORMALISATION, to_tensor, to_unit_float
from wsi_milssl.slide.entropy import entropy_bits_batch
from wsi_milssl.slide.reader import open_slide
from wsi_milssl.slide.tissue import TissueMask, slide_tissue_mask
from wsi_milssl.tiling.grid import TileGeometry
from wsi_milssl.tiling.inputs import slide_stem
from wsi_milssl.tiling.reading import Band, plan_bands, read_band
from wsi_milssl.tiling.tiff_source import direct_source

__all__ = [
    "TilingSettings",
    "InferenceRuntime",
    "Preprocess",
    "InferenceModel",
    "fuse_batchnorm",
    "SlidePrediction",
    "load_inference_model",
    "resolve_runtime",
    "predict_slide",
    "predict_store",
    "tissue_mask_for",
]

logger = logging.getLogger(__name__)

# Tile-stage defaults for settings a checkpoint may not record (read from TileConfig itself).
_TILE_DEFAULTS = TileConfig()
_DEFAULT_TISSUE = _TILE_DEFAULTS.tissue
_DEFAULT_MIN_TISSUE = float(_TILE_DEFAULTS.min_tissue)
_DEFAULT_MASK_MPP = float(_TILE_DEFAULTS.mask_mpp)
_DEFAULT_ENTROPY_BITS = float(_TILE_DEFAULTS.entropy_threshold_bits)
_MAX_BAND_PX = 4096
_PREFETCH = 2


# ----------------------------------------------------------------------------------------------
# Settings recorded in the checkpoint
# ----------------------------------------------------------------------------------------------

def _first(*values: Any) -> Any:
    for v in values:
        if v is not None:
            return v
    return None


@dataclass(frozen=True)
class TilingSettings:
    """How slides are cut for a model: what its training stores were made with.

    ``target_mpp`` µm/px, ``patch_size_px`` / ``stride_px`` target pixels, ``entropy_threshold_bits``,
    the tissue detector ``tissue``, ``min_tissue`` (fraction of a patch) and ``mask_mpp`` (µm/px of
    the mask thumbnail), and the input normalisation ``mean``/``std`` (per RGB channel, of [0, 1]
    pixel values).
    """

    target_mpp: float
    patch_size_px: int
    stride_px: int
    entropy_threshold_bits: float
    tissue: str
    min_tissue: float
    mask_mpp: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @classmethod
    def from_checkpoint_config(cls, cfg: Mapping[str, Any], *, config: HeatmapConfig,
                               source: str = "checkpoint") -> "TilingSettings":
        """Read the settings from a checkpoint's config dict; HeatmapConfig's tissue settings override."""
        store = dict(cfg.get("store_settings") or {})
        target_mpp = _first(cfg.get("target_mpp"), store.get("target_mpp"))
        patch = _first(cfg.get("patch_size_px"), store.get("patch_size_px"))
        if target_mpp is None or patch is None:
            raise CheckpointError(
                f"{source}: the checkpoint records no tiling settings (target_mpp, patch_size_px) of the stores "
                "it was trained on, so slides cannot be cut the same way. Fix: train the model with "
                "`wsi-milssl train` on patch stores (a feature-head checkpoint cannot make heatmaps)."
            )
        stride = _first(store.get("stride_px"), cfg.get("stride_px"), patch)
        entropy = _first(cfg.get("entropy_threshold_bits"), store.get("entropy_threshold_bits"))
        if entropy is None:
            logger.warning("%s: no entropy threshold recorded; using the tile stage's default %.1f bits.",
                           source, _DEFAULT_ENTROPY_BITS)
            entropy = _DEFAULT_ENTROPY_BITS
        tissue = _first(config.tissue, store.get("tissue_detector"), store.get("tissue"), _DEFAULT_TISSUE)
        min_tissue = _first(config.min_tissue, store.get("min_tissue"), _DEFAULT_MIN_TISSUE)
        mask_mpp = _first(config.mask_mpp, store.get("mask_mpp"), _DEFAULT_MASK_MPP)
        norm = cfg.get("normalisation") or NORMALISATION
        try:
            mean = tuple(float(v) for v in norm["mean"])
            std = tuple(float(v) for v in norm["std"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{source}: 'normalisation' must hold 'mean' and 'std' lists of 3 numbers; "
                                  f"got {norm!r}.") from None
        if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
            raise CheckpointError(f"{source}: normalisation mean/std must be 3 numbers each (std > 0); got {norm!r}.")
        return cls(target_mpp=float(target_mpp), patch_size_px=int(patch), stride_px=int(stride),
                   entropy_threshold_bits=float(entropy), tissue=str(tissue), min_tissue=float(min_tissue),
                   mask_mpp=float(mask_mpp), mean=mean, std=std)


# ----------------------------------------------------------------------------------------------
# Runtime and preprocessing
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class InferenceRuntime:
    """Device, autocast dtype (None = float32), memory layout and DataLoader workers.

    ``preprocess_in_workers``: the readers (DataLoader workers, or the main process with 0 workers)
    return model-ready tensors (CPU) instead of uint8 pixels (CUDA).
    """

    device: torch.device
    amp_dtype: torch.dtype | None
    channels_last: bool
    num_workers: int
    preprocess_in_workers: bool
    fuse_batchnorm: bool = True
    #: pad each slide's last, smaller batch to the full batch size and drop the padding's outputs:
    #: on CUDA every new input shape costs a cuDNN autotune and padded patches cost next to nothing;
    #: on the CPU they would be wasted forward passes (so: True on CUDA only)
    pad_last_batch: bool = False

    @property
    def reader_niceness(self) -> int:
        """Niceness of the DataLoader workers. On the CPU the forward pass keeps every core busy, and
        a reader that takes one of its threads' cores stalls all of them at the next synchronisation
        point; at niceness 19 the readers run in the gaps instead. On the 2-core development machine
        (median ratio of predict_slide to the bare forward): 1 worker at normal priority 0.72, 2 niced
        workers 0.83. On CUDA the readers are the bottleneck: no change there."""
        return 19 if self.device.type == "cpu" and self.num_workers > 0 else 0

    def autocast(self):
        return runtime_rules.autocast(self.device, self.amp_dtype)

    def describe(self) -> str:
        return runtime_rules.describe(self.device, self.amp_dtype, channels_last=self.channels_last,
                                      fuse_batchnorm=self.fuse_batchnorm, workers=self.num_workers)


def resolve_runtime(config: HeatmapConfig) -> InferenceRuntime:
    """Pick device, precision and workers for ``config`` on this machine (rules in :mod:`wsi_milssl.runtime`)."""
    device = runtime_rules.pick_device(config.device, owner="HeatmapConfig")
    cuda = device.type == "cuda"
    dtype = runtime_rules.pick_amp_dtype(config.amp, device, cpu_auto="bf16")
    workers = config.num_workers
    if workers < 0:  # the GPU outpaces the readers, the CPU forward does not
        workers = min(8, max(1, (os.cpu_count() or 1) - 1)) if cuda else min(4, max(2, os.cpu_count() or 1))
    return InferenceRuntime(device=device, amp_dtype=dtype, channels_last=bool(config.channels_last),
                            num_workers=int(workers), preprocess_in_workers=not cuda,
                            fuse_batchnorm=bool(config.fuse_batchnorm), pad_last_batch=cuda)


class Preprocess:
    """uint8 (B, H, W, 3) RGB -> the model input float (B, 3, H, W), normalised as in training.

    With the checkpoint's normalisation equal to :data:`wsi_milssl.mil.data.NORMALISATION` this is
    :func:`wsi_milssl.mil.data.to_tensor`; otherwise the checkpoint's mean/std are applied to
    :func:`~wsi_milssl.mil.data.to_unit_float`. ``dtype`` casts the result (bfloat16 for CPU autocast:
    the same rounding autocast applies to the first layer's input). The output is channels_last in
    memory (a permuted NHWC buffer), so a channels_last model needs no copy.

    On CPU tensors the result of all 256 values of each channel is tabulated once (by running the
    function above on them) and patches are converted by table lookup. With a 16-bit output (bfloat16,
    float16) two neighbouring bytes are looked up at once, in three tables of 65,536 value pairs (the
    byte pairs of RGBRGB are RG, BR, GB), about 2.3x faster than one lookup per byte. The tables are
    used only when they reproduce the function bit for bit on a random probe batch.
    """

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...], *, dtype: torch.dtype | None = None) -> None:
        self.mean = tuple(float(v) for v in mean)
        self.std = tuple(float(v) for v in std)
        self.dtype = dtype
        self.standard = bool(np.allclose(self.mean, NORMALISATION["mean"], atol=1e-7)
                             and np.allclose(self.std, NORMALISATION["std"], atol=1e-7))
        self._lut: np.ndarray | None = None
        self._pairs: np.ndarray | None = None
        self._make_tables()

    def _direct(self, patches_uint8) -> torch.Tensor:
        if self.standard:
            x = to_tensor(patches_uint8)
        else:
            x = to_unit_float(patches_uint8)
            mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
            std = torch.tensor(self.std, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
            x = (x - mean) / std
        if self.dtype is not None:
            x = x.to(self.dtype)
        return x

    def _make_tables(self) -> None:
        """(3, 256) table of the output values (as their numpy storage type) and, for 16-bit outputs
        on a little-endian machine, the (3, 65536) uint32 pair tables; dropped unless exact."""
        storage = {None: np.float32, torch.float32: np.float32, torch.float16: np.float16,
                   torch.bfloat16: np.uint16}.get(self.dtype)
        if storage is None:
            return
        values = torch.arange(256, dtype=torch.uint8).view(1, 1, 256, 1).expand(1, 1, 256, 3).contiguous()
        table = self._direct(values)[0, :, 0, :].contiguous()  # (3, 256)
        if self.dtype is torch.bfloat16:
            lut = table.view(torch.int16).numpy().view(np.uint16)
        else:
            lut = table.numpy().astype(storage, copy=False)
        self._lut = np.ascontiguousarray(lut)
        if self._lut.itemsize == 2 and sys.byteorder == "little":
            bits = self._lut.view(np.uint16).astype(np.uint32)
            code = np.arange(65536, dtype=np.uint32)  # a byte pair read as one little-endian uint16
            self._pairs = np.stack([bits[lo][code & 255] | (bits[hi][code >> 8] << 16)
                                    for lo, hi in ((0, 1), (2, 0), (1, 2))])
        probe = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (2, 8, 8, 3), dtype=np.uint8))
        odd = probe[:1, :1, :3].contiguous()  # an odd pixel count: the one-byte tables
        try:
            same = all(torch.equal(self._from_tables(p), self._direct(p)) for p in (probe, odd))
        except Exception:  # noqa: BLE001 - any doubt: no tables
            same = False
        if not same:
            self._lut, self._pairs = None, None

    def _from_tables(self, patches: torch.Tensor) -> torch.Tensor:
        u8 = patches.numpy()
        if self._pairs is not None and u8.size % 6 == 0:
            codes = u8.reshape(-1).view(np.uint16).reshape(-1, 3)
            out = np.empty(codes.shape, np.uint32)
            for k in range(3):
                out[:, k] = self._pairs[k][codes[:, k]]
            out = out.view(self._lut.dtype).reshape(u8.shape)
        else:
            out = np.empty(u8.shape, self._lut.dtype)
            for c in range(3):
                out[..., c] = self._lut[c][u8[..., c]]
        x = torch.from_numpy(out.view(np.int16)).view(torch.bfloat16) if self.dtype is torch.bfloat16 \
            else torch.from_numpy(out)
        return x.permute(0, 3, 1, 2)

    def __call__(self, patches_uint8) -> torch.Tensor:
        x = torch.as_tensor(patches_uint8)
        if (self._lut is not None and x.device.type == "cpu" and x.dtype == torch.uint8 and x.ndim == 4
                and x.shape[-1] == 3):
            return self._from_tables(x.contiguous())
        return self._direct(x)


def fuse_batchnorm(model: torch.nn.Module, probe: torch.Tensor) -> tuple[torch.nn.Module, bool]:
    """``model`` (eval mode) with each BatchNorm folded into the convolution before it, and True; or
    ``model`` itself and False when it cannot be traced, has nothing to fold, or the folded network's
    float32 logits on ``probe`` differ by more than 1e-3 (relative to their scale) from the original's.

    Folding is exact in real arithmetic (eval-mode BatchNorm is an affine map per channel); in float32
    a ResNet18's logits move by about 1e-7. The folding itself is ``torch.fx.experimental.optimization.fuse``.
    """
    from torch.fx.experimental.optimization import fuse

    if not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return model, False
    try:
        fused = fuse(model.eval(), inplace=False)
        with torch.inference_mode():
            want = model(probe).float()
            got = fused(probe).float()
    except Exception as exc:  # noqa: BLE001 - untraceable models run as they are
        logger.debug("BatchNorm folding skipped: %s", exc)
        return model, False
    if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in fused.modules()):
        return model, False  # BatchNorm not right after a convolution: nothing gained
    tolerance = 1e-3 * (1.0 + float(want.abs().max()))
    if not bool(torch.isfinite(got).all()) or float((got - want).abs().max()) > tolerance:
        logger.warning("BatchNorm folding changed the model's outputs on a probe batch; running it unfolded.")
        return model, False
    return fused, True


class InferenceModel:
    """A trained patch classifier ready for slide inference.

    ``model`` in eval mode on ``runtime.device``; ``tiling``: how slides are cut for it;
    ``pooling``: 'max' or 'mean', the bag pooling it was trained with; ``config``: the checkpoint's
    config dict; ``checkpoint_path``.
    """

    def __init__(self, model: torch.nn.Module, *, tiling: TilingSettings, runtime: InferenceRuntime,
                 pooling: str = "max", config: Mapping[str, Any] | None = None,
                 checkpoint_path: str | os.PathLike | None = None) -> None:
        if pooling not in ("max", "mean"):
            raise CheckpointError(f"{checkpoint_path}: bag pooling {pooling!r} is not 'max' or 'mean'.")
        self.runtime = runtime
        model = model.to(runtime.device).eval()
        #: whether BatchNorm was folded into the convolutions (HeatmapConfig.fuse_batchnorm)
        self.fused = False
        if runtime.fuse_batchnorm:
            generator = torch.Generator().manual_seed(0)
            probe = torch.randn(2, 3, tiling.patch_size_px, tiling.patch_size_px, generator=generator)
            model, self.fused = fuse_batchnorm(model, probe.to(runtime.device))
        self.model = model
        if runtime.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.tiling = tiling
        self.pooling = pooling
        self.config = dict(config or {})
        self.checkpoint_path = None if checkpoint_path is None else Path(checkpoint_path)
        worker_dtype = runtime.amp_dtype if runtime.preprocess_in_workers else None
        #: what DataLoader workers apply to uint8 pixels (None: the main process does it)
        self.worker_preprocess: Preprocess | None = (
            Preprocess(tiling.mean, tiling.std, dtype=worker_dtype) if runtime.preprocess_in_workers else None)
        self._main_preprocess = Preprocess(tiling.mean, tiling.std)

    def predict(self, batch: torch.Tensor | np.ndarray) -> np.ndarray:
        """Positive-class probabilities float32 (B,) of a batch: uint8 (B, H, W, 3) pixels, or a
        tensor (B, 3, H, W) already made by :attr:`worker_preprocess`."""
        x = torch.as_tensor(batch)
        if x.shape[0] == 0:
            return np.zeros(0, np.float32)
        with torch.inference_mode():
            if x.dtype == torch.uint8:
                x = self._main_preprocess(x.to(self.runtime.device, non_blocking=True))
            else:
                x = x.to(self.runtime.device, non_blocking=True)
            if self.runtime.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            with self.runtime.autocast():
                logits = self.model(x)
            probs = torch.softmax(logits.float(), dim=1)[:, 1]
            return probs.cpu().numpy().astype(np.float32, copy=False)


def load_inference_model(checkpoint_path: str | os.PathLike, *, config: HeatmapConfig | None = None
                         ) -> InferenceModel:
    """Load ``RUN_DIR/best.pt`` (or a run folder) for inference with ``config``'s runtime settings.

    Raises CheckpointError when the checkpoint cannot be read, holds a feature head (heatmaps need a
    model over image patches) or lacks the tiling settings of its training stores.
    """
    from wsi_milssl.mil import load_model
    from wsi_milssl.mil.models import is_image_model

    config = config or HeatmapConfig()
    runtime = resolve_runtime(config)
    if config.threads > 0:
        torch.set_num_threads(config.threads)
    if runtime.device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    model, cfg = load_model(checkpoint_path, device=runtime.device)
    name = str(cfg.get("model_name"))
    if not is_image_model(name):
        raise CheckpointError(
            f"{checkpoint_path}: model {name!r} classifies feature vectors, not image patches, so it cannot "
            "make heatmaps from slides. Fix: pass a checkpoint trained on patch stores (e.g. --model resnet18)."
        )
    tiling = TilingSettings.from_checkpoint_config(cfg, config=config, source=str(checkpoint_path))
    return InferenceModel(model, tiling=tiling, runtime=runtime, pooling=str(cfg.get("bag_pooling") or "max"),
                          config=cfg, checkpoint_path=checkpoint_path)


# ----------------------------------------------------------------------------------------------
# Predictions
# ----------------------------------------------------------------------------------------------

@dataclass
class SlidePrediction:
    """Per-patch probabilities of one slide and the grid they sit on.

    ``coords_lv0``: int64 (N, 2) level-0 top-left (x, y) of each patch, row-major; ``probs``: float32
    (N,). Grid cell (r, c) is the patch with top-left (origin_x + c * stride_lv0, origin_y + r *
    stride_lv0); ``grid_shape`` = (rows, cols). ``mpp`` is the level-0 µm/px, ``dimensions_lv0`` the
    slide's (width, height). ``tissue`` is the mask used to pick cells (slides tiled on the fly).
    ``n_candidates``: cells read (before the entropy filter) or patches in the store.
    """

    stem: str
    slide_path: Path | None
    source: str
    coords_lv0: np.ndarray
    probs: np.ndarray
    origin_lv0: tuple[int, int]
    stride_lv0: int
    patch_size_lv0: int
    patch_size_px: int
    target_mpp: float
    mpp: float
    dimensions_lv0: tuple[int, int]
    grid_shape: tuple[int, int]
    n_candidates: int
    store_path: Path | None = None
    tissue: TissueMask | None = None
    tissue_detector: str = _DEFAULT_TISSUE
    mask_mpp: float = _DEFAULT_MASK_MPP
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.probs.shape[0])

    def grid(self) -> np.ndarray:
        """float32 (rows, cols) probability map, NaN where there is no patch."""
        from wsi_milssl.inference.heatmap import probability_grid

        return probability_grid(self.coords_lv0, self.probs, origin_lv0=self.origin_lv0,
                                stride_lv0=self.stride_lv0, shape=self.grid_shape)

    def score(self, pooling: str) -> float:
        """Slide score: max or mean of the patch probabilities (paper eq. 11); 0.0 without patches."""
        from wsi_milssl.mil.selftrain import bag_scores

        if len(self) == 0:
            return 0.0
        return float(bag_scores(self.probs, np.zeros(len(self), np.int64), 1, pooling=pooling)[0])


class _SlideChunks(torch.utils.data.Dataset):
    """Item k: the patches of ``chunks[k]`` (a few bands of neighbouring cells) read from the slide,
    entropy-filtered and (optionally) preprocessed. The slide opens lazily once per process."""

    def __init__(self, slide_path: Path, *, mpp_override: float | None, geometry: TileGeometry,
                 chunks: list[list[Band]], entropy_threshold_bits: float, preprocess: Preprocess | None) -> None:
        self.slide_path = slide_path
        self.mpp_override = mpp_override
        self.geometry = geometry
        self.chunks = chunks
        self.threshold = float(entropy_threshold_bits)
        self.preprocess = preprocess
        self._pid: int | None = None
        self._slide = None
        self._source = None

    def __len__(self) -> int:
        return len(self.chunks)

    def _open(self):
        if self._pid != os.getpid():
            self._slide = open_slide(self.slide_path, mpp_override=self.mpp_override)
            self._source = direct_source(self._slide, [b for chunk in self.chunks[:4] for b in chunk], self.geometry)
            self._pid = os.getpid()
        return self._slide

    def __getitem__(self, k: int) -> dict[str, Any]:
        slide = self._open()
        idx_parts: list[np.ndarray] = []
        pix_parts: list[np.ndarray] = []
        n_read = 0
        for band in self.chunks[k]:
            patches = read_band(slide, band, self.geometry, **({"source": self._source} if self._source else {}))
            n_read += len(patches)
            keep = entropy_bits_batch(patches) >= self.threshold
            idx_parts.append(band.indices[keep])
            pix_parts.append(patches[keep])
        idx = np.concatenate(idx_parts)
        pixels = np.concatenate(pix_parts)
        out = torch.from_numpy(pixels)
        if self.preprocess is not None:
            out = self.preprocess(out)
        return {"index": torch.from_numpy(idx), "n_read": n_read, "pixels": out}

    def close(self) -> None:
        """Close this process's slide handles."""
        if self._pid == os.getpid():
            if self._source is not None:
                self._source.close()
            if self._slide is not None:
                self._slide.close()
        self._pid, self._slide, self._source = None, None, None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_pid"] = None
        state["_slide"] = None
        state["_source"] = None
        return state


class _StoreChunks(torch.utils.data.Dataset):
    """Item k: the decoded patches ``chunks[k]`` (consecutive store indices), optionally preprocessed."""

    def __init__(self, store_path: Path, chunks: list[np.ndarray], preprocess: Preprocess | None) -> None:
        self.store_path = store_path
        self.chunks = chunks
        self.preprocess = preprocess
        self._pid: int | None = None
        self._store = None

    def __len__(self) -> int:
        return len(self.chunks)

    def _open(self):
        if self._pid != os.getpid():
            from wsi_milssl.store import open_store

            self._store = open_store(self.store_path)
            self._pid = os.getpid()
        return self._store

    def __getitem__(self, k: int) -> dict[str, Any]:
        idx = self.chunks[k]
        pixels = np.asarray(self._open().read_patches(idx))
        out = torch.from_numpy(np.ascontiguousarray(pixels))
        if self.preprocess is not None:
            out = self.preprocess(out)
        return {"index": torch.from_numpy(idx), "n_read": int(len(idx)), "pixels": out}

    def close(self) -> None:
        """Close this process's store handle."""
        if self._pid == os.getpid() and self._store is not None:
            self._store.close()
        self._pid, self._store = None, None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_pid"] = None
        state["_store"] = None
        return state


def _renice(niceness: int, _worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: raise this worker's niceness."""
    try:
        os.nice(niceness)
    except OSError:  # pragma: no cover - not allowed here: run at the same priority
        pass


def _run_model(dataset: torch.utils.data.Dataset, model: InferenceModel, *, total: int, stem: str,
               progress: ProgressCallback | None, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Run ``model`` over every item of ``dataset``; (int64 indices, float32 probabilities) in order.

    Items hold a variable number of patches (whole bands, minus those the entropy filter drops); they
    are re-batched here into model calls of exactly ``batch_size`` (the last one smaller), so the
    backend sees one input shape (oneDNN primitives / cuDNN plans are made once, not per size).
    """
    rt = model.runtime
    workers = min(rt.num_workers, len(dataset))
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=None, shuffle=False, num_workers=workers,
        pin_memory=rt.device.type == "cuda", prefetch_factor=_PREFETCH if workers > 0 else None,
        persistent_workers=False,
        worker_init_fn=functools.partial(_renice, rt.reader_niceness) if rt.reader_niceness else None,
    )
    idx_parts: list[np.ndarray] = []
    prob_parts: list[np.ndarray] = []
    buf_idx: list[np.ndarray] = []
    buf_x: list[torch.Tensor] = []
    n_buf = 0
    done = 0
    emit(progress, ProgressEvent("heatmap-patches", 0, total, unit="patch", item=stem))
    try:
        for item in loader:
            index = item["index"].numpy()
            if index.size:
                buf_idx.append(index)
                buf_x.append(item["pixels"])
                n_buf += int(index.size)
            while n_buf >= batch_size:
                idx_all = buf_idx[0] if len(buf_idx) == 1 else np.concatenate(buf_idx)
                x_all = buf_x[0] if len(buf_x) == 1 else torch.cat(buf_x)
                idx_parts.append(idx_all[:batch_size])
                prob_parts.append(model.predict(x_all[:batch_size]))
                n_buf -= batch_size
                buf_idx = [idx_all[batch_size:]] if n_buf else []
                buf_x = [x_all[batch_size:]] if n_buf else []
            done += int(item["n_read"])
            emit(progress, ProgressEvent("heatmap-patches", done, total, unit="patch", item=stem))
        if n_buf:
            idx_parts.append(np.concatenate(buf_idx))
            x = torch.cat(buf_x)
            if rt.pad_last_batch and n_buf < batch_size:
                x = torch.cat([x, x.new_zeros((batch_size - n_buf,) + tuple(x.shape[1:]))])
            prob_parts.append(model.predict(x)[:n_buf])
    finally:
        dataset.close()  # handles opened here when num_workers == 0
    if not idx_parts:
        return np.zeros(0, np.int64), np.zeros(0, np.float32)
    return np.concatenate(idx_parts).astype(np.int64), np.concatenate(prob_parts).astype(np.float32)


def _chunk_bands(bands: list[Band], batch_size: int) -> list[list[Band]]:
    """Group consecutive bands into items of at most ``batch_size`` patches (bands are never split)."""
    chunks: list[list[Band]] = []
    current: list[Band] = []
    n = 0
    for band in bands:
        b = len(band.indices)
        if current and n + b > batch_size:
            chunks.append(current)
            current, n = [], 0
        current.append(band)
        n += b
    if current:
        chunks.append(current)
    return chunks


def tissue_mask_for(slide, *, method: str, mask_mpp: float) -> TissueMask:
    """The tile stage's tissue mask of an open SlideReader (see :func:`wsi_milssl.slide.tissue.slide_tissue_mask`)."""
    return slide_tissue_mask(slide, method=method, mask_mpp=mask_mpp)


def _slide_mpp(slide, slide_path: Path) -> float:
    try:
        return float(slide.mpp)
    except MissingResolutionError:
        raise MissingResolutionError(
            f"{slide_path}: the slide has no MPP and no objective power, so its physical scale is unknown. "
            "Fix: give its level-0 resolution with --slide-mpp (µm per pixel, e.g. --slide-mpp 0.25)."
        ) from None


def predict_slide(slide_path: str | os.PathLike, model: InferenceModel, *, config: HeatmapConfig | None = None,
                  progress: ProgressCallback | None = None) -> SlidePrediction:
    """Tile ``slide_path`` on the fly with ``model.tiling`` and predict every kept patch.

    The cells are those the tile stage would store for the same settings: grid at the target
    resolution from level-0 (0, 0), tissue fraction >= ``min_tissue``, entropy >= the threshold.
    """
    config = config or HeatmapConfig()
    t0 = time.perf_counter()
    slide_path = Path(slide_path)
    t = model.tiling
    with open_slide(slide_path, mpp_override=config.slide_mpp) as slide:
        mpp = _slide_mpp(slide, slide_path)
        geometry = TileGeometry.from_slide(slide, target_mpp=t.target_mpp, patch_size_px=t.patch_size_px,
                                           stride_px=t.stride_px)
        tissue = tissue_mask_for(slide, method=t.tissue, mask_mpp=t.mask_mpp)
        dims = tuple(int(v) for v in slide.dimensions)
    grid = geometry.grid()
    if t.tissue == "none":
        fraction = np.ones(len(grid), np.float32)
    else:
        fraction = tissue.fraction(grid, geometry.patch_size_lv0)
    cand = grid[fraction >= t.min_tissue]
    stride_level = geometry.stride_lv0 / geometry.level_downsample
    max_band_px = int(min(_MAX_BAND_PX, geometry.patch_size_level + (config.batch_size - 1) * stride_level))
    bands = plan_bands(cand, geometry, max_band_px=max(max_band_px, geometry.patch_size_level))
    chunks = _chunk_bands(bands, config.batch_size)
    stem = slide_stem(slide_path)
    logger.info("%s: %d grid cells, %d with tissue; level %d, patch %d lv0 px; %s", stem, len(grid), len(cand),
                geometry.level, geometry.patch_size_lv0, model.runtime.describe())
    dataset = _SlideChunks(slide_path, mpp_override=config.slide_mpp, geometry=geometry, chunks=chunks,
                           entropy_threshold_bits=t.entropy_threshold_bits, preprocess=model.worker_preprocess)
    idx, probs = _run_model(dataset, model, total=len(cand), stem=stem, progress=progress,
                            batch_size=config.batch_size)
    return SlidePrediction(
        stem=stem, slide_path=slide_path, source="slide", coords_lv0=cand[idx], probs=probs, origin_lv0=(0, 0),
        stride_lv0=geometry.stride_lv0, patch_size_lv0=geometry.patch_size_lv0,
        patch_size_px=geometry.patch_size_px, target_mpp=geometry.target_mpp, mpp=mpp, dimensions_lv0=dims,
        grid_shape=geometry.grid_shape(), n_candidates=int(len(cand)), tissue=tissue, tissue_detector=t.tissue,
        mask_mpp=t.mask_mpp, seconds=time.perf_counter() - t0,
    )


def _grid_shape(dims: tuple[int, int] | None, coords: np.ndarray, *, origin: tuple[int, int], patch: int,
                stride: int) -> tuple[int, int]:
    if dims is not None:
        w, h = dims
        cols = (w - origin[0] - patch) // stride + 1 if w - origin[0] >= patch else 0
        rows = (h - origin[1] - patch) // stride + 1 if h - origin[1] >= patch else 0
        if len(coords):
            cols = max(cols, int((coords[:, 0].max() - origin[0]) // stride) + 1)
            rows = max(rows, int((coords[:, 1].max() - origin[1]) // stride) + 1)
        return int(rows), int(cols)
    if len(coords) == 0:
        return 0, 0
    return (int((coords[:, 1].max() - origin[1]) // stride) + 1, int((coords[:, 0].max() - origin[0]) // stride) + 1)


def predict_store(store_path: str | os.PathLike, model: InferenceModel, *, config: HeatmapConfig | None = None,
                  progress: ProgressCallback | None = None) -> SlidePrediction:
    """Predict every patch of an existing patch store.

    Raises StoreError when the store holds no pixels or its coordinates are off its grid, and
    ConfigError when it was tiled at another resolution or patch size than the model was trained on.
    """
    from wsi_milssl.store import open_store

    config = config or HeatmapConfig()
    t0 = time.perf_counter()
    store_path = Path(store_path)
    t = model.tiling
    with open_store(store_path) as store:
        attrs = store.attrs
        if not store.has("patches"):
            raise StoreError(f"{store_path}: the store holds coordinates only (tiled with --pixels none), so there "
                             "is nothing to classify. Fix: drop --store to tile the slide on the fly, or re-tile "
                             "with --pixels jpeg.")
        coords = np.asarray(store.coords, dtype=np.int64).reshape(-1, 2)
        stem = store.stem
        slide_path = Path(attrs["slide_path"]) if attrs.get("slide_path") else None
    target_mpp = float(attrs.get("target_mpp", math.nan))
    patch_px = int(attrs.get("patch_size_px", -1))
    if not (math.isclose(target_mpp, t.target_mpp, rel_tol=1e-6) and patch_px == t.patch_size_px):
        raise ConfigError(
            f"{store_path}: the store was tiled at {target_mpp:g} µm/px with {patch_px} px patches, but the model "
            f"was trained at {t.target_mpp:g} µm/px with {t.patch_size_px} px patches. Fix: drop --store to tile "
            "the slide on the fly with the model's settings, or pass stores tiled like the training stores."
        )
    stride_lv0 = int(attrs.get("stride_lv0") or attrs["patch_size_lv0"])
    patch_lv0 = int(attrs["patch_size_lv0"])
    origin = tuple(int(v) for v in (attrs.get("grid_origin_lv0") or (0, 0)))
    off_grid = (coords - np.asarray(origin)) % stride_lv0 != 0
    if len(coords) and off_grid.any():
        raise StoreError(f"{store_path}: patch coordinates are not on a regular grid of stride {stride_lv0} level-0 "
                         f"px from {list(origin)}, so they cannot form a probability map. Fix: re-tile the slide "
                         "with `wsi-milssl tile`.")
    dims_attr = attrs.get("dimensions_lv0")
    dims = (int(dims_attr[0]), int(dims_attr[1])) if dims_attr else None
    shape = _grid_shape(dims, coords, origin=origin, patch=patch_lv0, stride=stride_lv0)
    if dims is None:
        dims = (origin[0] + (shape[1] - 1) * stride_lv0 + patch_lv0,
                origin[1] + (shape[0] - 1) * stride_lv0 + patch_lv0)
    n = len(coords)
    chunks = [np.arange(i, min(i + config.batch_size, n), dtype=np.int64) for i in range(0, n, config.batch_size)]
    dataset = _StoreChunks(store_path, chunks, model.worker_preprocess)
    idx, probs = _run_model(dataset, model, total=n, stem=stem, progress=progress, batch_size=config.batch_size)
    return SlidePrediction(
        stem=stem, slide_path=slide_path, source="store", coords_lv0=coords[idx], probs=probs, origin_lv0=origin,
        stride_lv0=stride_lv0, patch_size_lv0=patch_lv0, patch_size_px=patch_px, target_mpp=target_mpp,
        mpp=float(attrs["mpp"]), dimensions_lv0=dims, grid_shape=shape, n_candidates=n, store_path=store_path,
        tissue=None, tissue_detector=str(attrs.get("tissue_detector") or t.tissue),
        mask_mpp=float(attrs.get("mask_mpp") or t.mask_mpp), seconds=time.perf_counter() - t0,
    )
