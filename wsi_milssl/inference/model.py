"""Model loading for slide inference: the checkpoint's model, how slides are cut for it, and the runtime.

:func:`load_inference_model` reads a training checkpoint and returns an :class:`InferenceModel`: the
network in eval mode on the chosen device (eval-mode BatchNorm folded into the convolutions,
:func:`fuse_batchnorm`; channels_last), its :class:`TilingSettings` (the checkpoint's
:class:`~wsi_milssl.tiling.TilingPlan` with HeatmapConfig's tissue overrides, and the input
normalisation) and the :class:`InferenceRuntime` (device, autocast dtype, reader workers). On the CPU
the readers apply :class:`Preprocess` (uint8 pixels -> the normalised bfloat16 model input, by table
lookup) so the main process only runs the forward pass; on CUDA they hand over uint8 pixels, which are
normalised on the GPU. :func:`check_run_finished` refuses the checkpoint of a run that a live ``train``
still writes and warns about one of a run that stopped before its last epoch.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from wsi_milssl import runtime as runtime_rules
from wsi_milssl.config.heatmap import HeatmapConfig
from wsi_milssl.config.tile import TileConfig
from wsi_milssl.distributed import is_main_rank
from wsi_milssl.errors import CheckpointError, ConfigError
from wsi_milssl.inference.sources import PixelTables, apply_tables
from wsi_milssl.mil.data import NORMALISATION, to_tensor, to_unit_float
from wsi_milssl.tiling import PLAN_ATTR, TilingPlan
from wsi_milssl.weights import load_torch_file

__all__ = [
    "TilingSettings",
    "InferenceRuntime",
    "Preprocess",
    "PatchModel",
    "InferenceModel",
    "check_run_finished",
    "fuse_batchnorm",
    "load_inference_model",
    "plan_from_checkpoint_config",
    "resolve_runtime",
]

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# How slides are cut for the model (recorded in the checkpoint)
# ----------------------------------------------------------------------------------------------

def _first(*values: Any) -> Any:
    for v in values:
        if v is not None:
            return v
    return None


def _legacy_plan(cfg: Mapping[str, Any], *, source: str) -> TilingPlan:
    """The plan of a checkpoint written before plans were recorded: from its separate tiling keys and
    the store attributes it copied, with the tile stage's defaults for what neither records."""
    defaults = TileConfig()
    store = dict(cfg.get("store_settings") or {})
    target_mpp = _first(cfg.get("target_mpp"), store.get("target_mpp"))
    patch = _first(cfg.get("patch_size_px"), store.get("patch_size_px"))
    if target_mpp is None or patch is None:
        raise CheckpointError(
            f"{source}: the checkpoint records no tiling settings (target_mpp, patch_size_px) of the stores "
            "it was trained on, so slides cannot be cut the same way. Fix: train the model with "
            "`wsi-milssl train` on patch stores (a feature-head checkpoint cannot make heatmaps)."
        )
    entropy = _first(cfg.get("entropy_threshold_bits"), store.get("entropy_threshold_bits"))
    if entropy is None:
        entropy = float(defaults.entropy_threshold_bits)
        if is_main_rank():  # about the checkpoint, the same on every rank: torchrun's rank 0 alone says it
            logger.warning("%s: no entropy threshold recorded; using the tile stage's default %.1f bits.", source,
                           entropy)
    return TilingPlan(
        target_mpp=float(target_mpp), patch_size_px=int(patch),
        stride_px=int(_first(store.get("stride_px"), cfg.get("stride_px"), patch)),
        tissue=str(_first(store.get("tissue_detector"), store.get("tissue"), defaults.tissue)),
        min_tissue=float(_first(store.get("min_tissue"), defaults.min_tissue)),
        mask_mpp=float(_first(store.get("mask_mpp"), defaults.mask_mpp)),
        entropy_threshold_bits=float(entropy), direct_tiff_read=defaults.direct_tiff_read,
    )


def plan_from_checkpoint_config(cfg: Mapping[str, Any], *, source: str = "checkpoint") -> TilingPlan:
    """The tile recipe of a checkpoint's config dict: its ``tiling_plan`` (copied from the training
    stores), or for older checkpoints the separate keys ``target_mpp``, ``patch_size_px``,
    ``entropy_threshold_bits`` and ``store_settings`` (stride and tissue settings), with the tile
    stage's defaults where those are missing. Raises CheckpointError naming ``source``."""
    try:
        if cfg.get(PLAN_ATTR) is not None:
            return TilingPlan.from_dict(cfg[PLAN_ATTR], source=f"{source}: {PLAN_ATTR}")
        return _legacy_plan(cfg, source=source)
    except ConfigError as exc:
        raise CheckpointError(f"{exc} The checkpoint's tiling settings are unusable; retrain on stores made by "
                              "`wsi-milssl tile`.") from None


@dataclass(frozen=True)
class TilingSettings:
    """How slides are cut for a model and how its input is normalised.

    ``plan``: the tile recipe of its training stores (:class:`~wsi_milssl.tiling.TilingPlan`), with
    HeatmapConfig's tissue settings (``tissue``, ``min_tissue``, ``mask_mpp``) where given;
    ``mean``/``std``: the input normalisation per RGB channel, of [0, 1] pixel values.
    """

    plan: TilingPlan
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @classmethod
    def from_checkpoint_config(cls, cfg: Mapping[str, Any], *, config: HeatmapConfig,
                               source: str = "checkpoint") -> "TilingSettings":
        """Read the settings from a checkpoint's config dict (see :func:`plan_from_checkpoint_config`);
        HeatmapConfig's tissue settings override the plan's."""
        plan = plan_from_checkpoint_config(cfg, source=source).with_tissue(
            tissue=config.tissue, min_tissue=config.min_tissue, mask_mpp=config.mask_mpp)
        norm = cfg.get("normalisation") or NORMALISATION
        try:
            mean = tuple(float(v) for v in norm["mean"])
            std = tuple(float(v) for v in norm["std"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{source}: 'normalisation' must hold 'mean' and 'std' lists of 3 numbers; "
                                  f"got {norm!r}.") from None
        if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
            raise CheckpointError(f"{source}: normalisation mean/std must be 3 numbers each (std > 0); got {norm!r}.")
        return cls(plan=plan, mean=mean, std=std)

    def to_dict(self) -> dict[str, Any]:
        """The plan's fields and ``normalisation`` (``{"mean": [...], "std": [...]}``), JSON-able."""
        return {**self.plan.to_dict(), "normalisation": {"mean": list(self.mean), "std": list(self.std)}}

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
    #: on the CPU they would be wasted forward passes (so: True on CUDA only; the CPU pads to a multiple of
    #: 8: :func:`wsi_milssl.inference.predict.padded_batch`)
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
    """Pick device, precision and workers for ``config`` on this machine (rules in :mod:`wsi_milssl.runtime`).

    ``config``: a HeatmapConfig, or any config with its fields ``device``, ``amp``, ``num_workers``,
    ``channels_last`` and ``fuse_batchnorm`` (the feature stage's FeaturesConfig)."""
    device = runtime_rules.pick_device(config.device, owner=type(config).__name__)
    cuda = device.type == "cuda"
    dtype = runtime_rules.pick_amp_dtype(config.amp, device, cpu_auto="bf16")
    workers = config.num_workers
    if workers < 0:  # the GPU outpaces the readers (keep most cores reading), the CPU forward does not
        cpus = os.cpu_count() or 1  # (shared by torchrun's ranks on this machine: each takes its share)
        workers = runtime_rules.readers_per_rank(max(1, min(16, cpus - 2)) if cuda else min(4, max(2, cpus)),
                                                 minimum=1)
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
        #: the lookup tables (None: computed directly), also handed to the reader processes
        self.tables: PixelTables | None = None
        self._make_tables()

    def _direct(self, patches_uint8) -> torch.Tensor:
        if self.standard:
            x = to_tensor(patches_uint8)
        else:
            x = to_unit_float(patches_uint8)
            mean_std = runtime_rules.host_to_device(torch.tensor([self.mean, self.std], dtype=x.dtype), x.device)
            x = (x - mean_std[0].view(1, 3, 1, 1)) / mean_std[1].view(1, 3, 1, 1)
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
        lut = np.ascontiguousarray(lut)
        pairs = None
        if lut.itemsize == 2 and sys.byteorder == "little":
            bits = lut.view(np.uint16).astype(np.uint32)
            code = np.arange(65536, dtype=np.uint32)  # a byte pair read as one little-endian uint16
            pairs = np.stack([bits[lo][code & 255] | (bits[hi][code >> 8] << 16)
                              for lo, hi in ((0, 1), (2, 0), (1, 2))])
        self.tables = PixelTables(lut=lut, pairs=pairs)
        probe = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (2, 8, 8, 3), dtype=np.uint8))
        odd = probe[:1, :1, :3].contiguous()  # an odd pixel count: the one-byte tables
        try:
            same = all(torch.equal(self._from_tables(p), self._direct(p)) for p in (probe, odd))
        except Exception:  # noqa: BLE001 - any doubt: no tables
            same = False
        if not same:
            self.tables = None

    def _from_tables(self, patches: torch.Tensor) -> torch.Tensor:
        out = apply_tables(patches.numpy(), self.tables)
        x = torch.from_numpy(out.view(np.int16)).view(torch.bfloat16) if self.dtype is torch.bfloat16 \
            else torch.from_numpy(out)
        return x.permute(0, 3, 1, 2)

    def __call__(self, patches_uint8) -> torch.Tensor:
        x = torch.as_tensor(patches_uint8)
        if (self.tables is not None and x.device.type == "cpu" and x.dtype == torch.uint8 and x.ndim == 4
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


class PatchModel:
    """A network over image patches, ready for the slide engine (:func:`wsi_milssl.inference.predict.run_slides`).

    ``model`` in eval mode on ``runtime.device`` (BatchNorm folded into the convolutions when
    ``runtime.fuse_batchnorm`` and the outputs allow, channels_last when asked); ``tiling``: how slides
    are cut for it (``plan``) and its input normalisation. ``probe_side``: the input side of the probe
    batch that checks the folding (default: the plan's patch size).

    What the engine uses: :attr:`plan`, :attr:`runtime`, :attr:`reader_tables` / :attr:`reader_dtype`
    (what the readers make of uint8 pixels on the CPU) and :meth:`forward_batch`, which subclasses define:
    a batch of patches -> a device tensor (B,) (probabilities) or (B, D) (features).
    """

    def __init__(self, model: torch.nn.Module, *, tiling: TilingSettings, runtime: InferenceRuntime,
                 probe_side: int | None = None) -> None:
        self.runtime = runtime
        model = model.to(runtime.device).eval()
        #: whether BatchNorm was folded into the convolutions (``runtime.fuse_batchnorm``)
        self.fused = False
        if runtime.fuse_batchnorm:
            generator = torch.Generator().manual_seed(0)
            side = int(probe_side or tiling.plan.patch_size_px)
            probe = torch.randn(2, 3, side, side, generator=generator)
            model, self.fused = fuse_batchnorm(model, probe.to(runtime.device))
        self.model = model
        if runtime.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.tiling = tiling
        worker_dtype = runtime.amp_dtype if runtime.preprocess_in_workers else None
        #: the model input readers make from uint8 pixels on the CPU (None: the main process makes it)
        self.worker_preprocess: Preprocess | None = (
            Preprocess(tiling.mean, tiling.std, dtype=worker_dtype) if runtime.preprocess_in_workers else None)
        #: its lookup tables, handed to the reader processes (None: readers deliver uint8 pixels)
        self.reader_tables: PixelTables | None = (
            None if self.worker_preprocess is None else self.worker_preprocess.tables)
        #: the torch dtype of the readers' output with ``reader_tables``
        self.reader_dtype: torch.dtype = worker_dtype or torch.float32
        self._main_preprocess = Preprocess(tiling.mean, tiling.std)

    @property
    def plan(self) -> TilingPlan:
        """The tile recipe slides are cut with for this model (``tiling.plan``)."""
        return self.tiling.plan

    def network_input(self, batch: torch.Tensor | np.ndarray) -> torch.Tensor:
        """The network's input on the device: uint8 (B, H, W, 3) pixels are normalised here, a tensor
        (B, 3, H, W) made by :attr:`worker_preprocess` is moved as it is; channels_last when asked.
        Call inside ``torch.inference_mode()``."""
        x = torch.as_tensor(batch)
        if x.dtype == torch.uint8:
            x = self._main_preprocess(x.to(self.runtime.device, non_blocking=True))
        else:
            x = x.to(self.runtime.device, non_blocking=True)
        if self.runtime.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def forward_batch(self, batch: torch.Tensor | np.ndarray) -> torch.Tensor:
        """The engine's batch function: a device tensor (B,) or (B, D) for a batch of patches."""
        raise NotImplementedError

    def warm_up(self, batch_size: int) -> None:
        """On CUDA, run one batch of ``batch_size`` blank patches, as the readers deliver them, through
        :meth:`forward_batch`: cuDNN picks its convolution algorithms for that shape now (about 1 s for
        ResNet18 at 256 x 224 px on an H100), while the readers plan the first slides, instead of inside
        the first slide's batches. Nothing happens on the CPU, where nothing is tuned."""
        if self.runtime.device.type != "cuda" or batch_size < 1:
            return
        side = int(self.plan.patch_size_px)
        if self.reader_tables is None:
            blank = torch.zeros((batch_size, side, side, 3), dtype=torch.uint8)
        else:
            blank = torch.zeros((batch_size, side, side, 3), dtype=self.reader_dtype).permute(0, 3, 1, 2)
        self.forward_batch(blank)


class InferenceModel(PatchModel):
    """A trained patch classifier ready for slide inference.

    ``model`` in eval mode on ``runtime.device``; ``tiling``: how slides are cut for it (``plan``) and
    its input normalisation;
    ``pooling``: 'max' or 'mean', the bag pooling it was trained with; ``config``: the checkpoint's
    config dict; ``checkpoint_path``. Its batch function is :meth:`probabilities`.
    """

    def __init__(self, model: torch.nn.Module, *, tiling: TilingSettings, runtime: InferenceRuntime,
                 pooling: str = "max", config: Mapping[str, Any] | None = None,
                 checkpoint_path: str | os.PathLike | None = None) -> None:
        from wsi_milssl.config.train import BAG_POOLINGS

        if pooling not in BAG_POOLINGS:
            raise CheckpointError(f"{checkpoint_path}: bag pooling {pooling!r} is not one of {', '.join(BAG_POOLINGS)}.")
        super().__init__(model, tiling=tiling, runtime=runtime)
        self.pooling = pooling
        self.config = dict(config or {})
        self.checkpoint_path = None if checkpoint_path is None else Path(checkpoint_path)

    def predict(self, batch: torch.Tensor | np.ndarray) -> np.ndarray:
        """Positive-class probabilities float32 (B,) of a batch: uint8 (B, H, W, 3) pixels, or a
        tensor (B, 3, H, W) already made by :attr:`worker_preprocess`."""
        if len(batch) == 0:
            return np.zeros(0, np.float32)
        return self.probabilities(batch).cpu().numpy().astype(np.float32, copy=False)

    def probabilities(self, batch: torch.Tensor | np.ndarray) -> torch.Tensor:
        """As :meth:`predict`, but a float32 (B,) tensor left on the device (nothing waits for it)."""
        with torch.inference_mode():
            x = self.network_input(batch)
            with self.runtime.autocast():
                logits = self.model(x)
            return torch.softmax(logits.float(), dim=1)[:, 1]

    def forward_batch(self, batch: torch.Tensor | np.ndarray) -> torch.Tensor:
        """The engine's batch function: :meth:`probabilities`."""
        return self.probabilities(batch)


def _run_record(path: Path) -> dict[str, Any] | None:
    """The checkpoint's own record, its tensors left on disk (memory-mapped), or None when it cannot be
    read that way (loading it proper reports a damaged file)."""
    try:  # (a TorchScript archive is refused before torch reads it: no torch warning here)
        ckpt = load_torch_file(path, mmap=True)
    except CheckpointError:  # load_model names what is wrong with the file
        return None
    return ckpt if isinstance(ckpt, dict) else None


def _epochs(ckpt: Mapping[str, Any] | None) -> tuple[int, int] | None:
    """(epochs done, epochs the run was set to train) that a checkpoint records, or None."""
    config = (ckpt or {}).get("config")
    done, planned = (ckpt or {}).get("epoch"), config.get("epochs") if isinstance(config, Mapping) else None
    if isinstance(done, bool) or isinstance(planned, bool) or not isinstance(done, int) or not isinstance(planned, int):
        return None
    return done, planned


def check_run_finished(checkpoint: str | os.PathLike) -> Path:
    """Check the run of ``checkpoint`` (RUN_DIR/best.pt, RUN_DIR/last.pt or RUN_DIR) before its model is
    used; returns the checkpoint file (:func:`wsi_milssl.mil.checkpoint.resolve_checkpoint_path`).

    A run folder that another run still writes (a live ``train`` holds its lock,
    :func:`wsi_milssl.locks.folder_writer`; a run of this process does not count) raises FolderLockedError
    naming that run: its checkpoints are of an epoch on the way, not the run's result. A run that stopped
    before its last epoch (killed, failed) gets a warning naming the epochs: ``last.pt`` beside the
    checkpoint (or the checkpoint itself, unless it is a ``best.pt`` without its run's ``last.pt``) records
    fewer epochs than the run's config. The model may still be the one wanted, so it is not refused. A
    checkpoint that records no epochs (another version's) is taken as it is.
    """
    from wsi_milssl.errors import FolderLockedError
    from wsi_milssl.locks import folder_writer
    from wsi_milssl.mil.checkpoint import resolve_checkpoint_path

    path = resolve_checkpoint_path(checkpoint)
    run_dir = path.parent
    writer = folder_writer(run_dir)
    if writer is not None:
        raise FolderLockedError(f"{run_dir}: {writer} is still writing this run folder, so {path.name} is the "
                                "checkpoint of an epoch on the way, not the run's result. Fix: wait until that "
                                "run finishes, then make the heatmaps.")
    own = _run_record(path)
    held = _epochs(own)
    if held is None:
        return path
    last = run_dir / "last.pt"
    if path != last and last.is_file():  # the run's progress: last.pt is saved after every epoch
        run = _epochs(_run_record(last))
        if run is None:
            return path
        done, planned = max(run[0], held[0]), run[1]  # (a kill between best.pt's save and last.pt's)
    else:
        best = (own or {}).get("best")
        if path != last and isinstance(best, Mapping) and best.get("epoch") == held[0]:
            return path  # a best.pt without its run's last.pt: where that run stopped is not known here
        done, planned = held
    if done < planned and is_main_rank():  # the same on every rank: torchrun's rank 0 alone says it
        fix = (f"continue the run with `wsi-milssl train --resume {shlex.quote(str(run_dir))}`" if last.is_file()
               else "train the run to its end")
        what = (f"{path}: its run stopped after epoch {done}" if done == held[0] else
                f"{path} holds epoch {held[0]} of a run that stopped after epoch {done}")
        logger.warning("%s of the %d it was set to train (killed or failed before its end%s), so this model is not "
                       "the finished run's. Fix, unless it is the model you want: %s, then make the heatmaps again.",
                       what, planned, "" if done == held[0] else ", as last.pt records", fix)
    return path


def load_inference_model(checkpoint_path: str | os.PathLike, *, config: HeatmapConfig | None = None
                         ) -> InferenceModel:
    """Load ``RUN_DIR/best.pt`` (or a run folder) for inference with ``config``'s runtime settings.

    Raises CheckpointError when the checkpoint cannot be read, holds a feature head (heatmaps need a
    model over image patches) or lacks the tiling settings of its training stores, and FolderLockedError
    while another run (a live ``train``) writes its run folder; a run that stopped before its last epoch
    is warned about (:func:`check_run_finished`). ``config.threads`` > 0 sets torch's thread count for the
    whole process (:func:`make_heatmaps` gives the count back when it returns; the model outlives this call).
    """
    from wsi_milssl.mil import load_model
    from wsi_milssl.mil.checkpoint import resolve_checkpoint_path
    from wsi_milssl.mil.models import is_image_model

    # the file itself (a run folder's best.pt, else last.pt): what is recorded and fingerprinted
    checkpoint_path = check_run_finished(resolve_checkpoint_path(checkpoint_path))
    config = config or HeatmapConfig()
    runtime = resolve_runtime(config)
    if config.threads > 0:  # for the whole process: make_heatmaps gives the count back, a model loaded by hand not
        torch.set_num_threads(config.threads)
    if runtime.device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    model, cfg = load_model(checkpoint_path, device=runtime.device)
    name = str(cfg.get("model_name"))
    if not is_image_model(name):
        raise CheckpointError(
            f"{checkpoint_path}: model {name!r} classifies feature vectors, not image patches, so it cannot "
            "make heatmaps from slides. Fix: map it on the slides' feature files (`heatmap --features FEATS`; "
            "from Python wsi_milssl.inference.make_feature_heatmaps), or pass a checkpoint trained on patch stores "
            "(`wsi-milssl train STORES --model resnet18`)."
        )
    tiling = TilingSettings.from_checkpoint_config(cfg, config=config, source=str(checkpoint_path))
    return InferenceModel(model, tiling=tiling, runtime=runtime, pooling=str(cfg.get("bag_pooling") or "max"),
                          config=cfg, checkpoint_path=checkpoint_path)
