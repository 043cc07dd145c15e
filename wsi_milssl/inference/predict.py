"""The prediction loop: slide (or patch store) -> per-patch tumour probabilities.

Straight from a slide, the slide is cut with the model's :class:`~wsi_milssl.tiling.TilingPlan` (the
one its training stores were tiled with, recorded in the checkpoint) through the tile stage's own
functions, :func:`wsi_milssl.tiling.plan_slide` and :func:`wsi_milssl.tiling.cut_band`: the
probabilities are for exactly the cells a store tiled with that plan holds. From a store
(``--store``), the store's patches are used as they are.

Patches are read, decoded and filtered by DataLoader worker processes
(:mod:`wsi_milssl.inference.sources`) while the model runs in the main process
(:class:`~wsi_milssl.inference.model.InferenceModel`). On the CPU the workers also make the model
input and run at the lowest priority: the forward pass already keeps every core busy, so the readers
fill its gaps instead of stalling its threads. Items are re-batched here into model calls of exactly
``batch_size`` patches; on CUDA the last, smaller batch is padded to that size.

Memory is bounded by ``num_workers x prefetch`` items of at most ``batch_size`` patches (or one band,
when a band holds more) whatever the slide size: only the level-0 coordinates and one float per patch
are kept for the whole slide.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wsi_milssl.config.heatmap import HeatmapConfig
from wsi_milssl.config.tile import TileConfig
from wsi_milssl.errors import ConfigError, StoreError
from wsi_milssl.events import ProgressCallback, ProgressEvent, emit
from wsi_milssl.inference.model import InferenceModel
from wsi_milssl.inference.sources import SlideChunks, StoreChunks, chunk_bands, store_chunks
from wsi_milssl.slide.reader import open_slide
from wsi_milssl.slide.tissue import TissueMask
from wsi_milssl.tiling import plan_slide, slide_stem

__all__ = ["SlidePrediction", "predict_slide", "predict_store"]

logger = logging.getLogger(__name__)

_TILE_DEFAULTS = TileConfig()
_DEFAULT_TISSUE = _TILE_DEFAULTS.tissue
_DEFAULT_MASK_MPP = float(_TILE_DEFAULTS.mask_mpp)
_PREFETCH = 2


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


def predict_slide(slide_path: str | os.PathLike, model: InferenceModel, *, config: HeatmapConfig | None = None,
                  progress: ProgressCallback | None = None) -> SlidePrediction:
    """Cut ``slide_path`` on the fly with ``model.plan`` and predict every kept patch.

    The cells are those the tile stage stores for the same plan (:func:`wsi_milssl.tiling.plan_slide`,
    then :func:`wsi_milssl.tiling.cut_band`'s entropy filter in the readers).
    """
    config = config or HeatmapConfig()
    t0 = time.perf_counter()
    slide_path = Path(slide_path)
    plan = model.plan
    with open_slide(slide_path, mpp_override=config.slide_mpp) as slide:
        cells = plan_slide(slide, plan)
        mpp = float(slide.mpp)
        dims = tuple(int(v) for v in slide.dimensions)
    geometry = cells.geometry
    stem = slide_stem(slide_path)
    logger.info("%s: %d grid cells, %d with tissue; level %d, patch %d lv0 px; %s", stem, cells.n_grid,
                cells.n_candidates, geometry.level, geometry.patch_size_lv0, model.runtime.describe())
    dataset = SlideChunks(slide_path, mpp_override=config.slide_mpp, plan=plan, geometry=geometry,
                          chunks=chunk_bands(cells.bands, config.batch_size), preprocess=model.worker_preprocess)
    idx, probs = _run_model(dataset, model, total=cells.n_candidates, stem=stem, progress=progress,
                            batch_size=config.batch_size)
    return SlidePrediction(
        stem=stem, slide_path=slide_path, source="slide", coords_lv0=cells.coords_lv0[idx], probs=probs,
        origin_lv0=(0, 0), stride_lv0=geometry.stride_lv0, patch_size_lv0=geometry.patch_size_lv0,
        patch_size_px=geometry.patch_size_px, target_mpp=geometry.target_mpp, mpp=mpp, dimensions_lv0=dims,
        grid_shape=geometry.grid_shape(), n_candidates=cells.n_candidates, tissue=cells.tissue,
        tissue_detector=plan.tissue, mask_mpp=plan.mask_mpp, seconds=time.perf_counter() - t0,
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
    plan = model.plan
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
    if not (math.isclose(target_mpp, plan.target_mpp, rel_tol=1e-6) and patch_px == plan.patch_size_px):
        raise ConfigError(
            f"{store_path}: the store was tiled at {target_mpp:g} µm/px with {patch_px} px patches, but the model "
            f"was trained at {plan.target_mpp:g} µm/px with {plan.patch_size_px} px patches. Fix: drop --store to "
            "tile the slide on the fly with the model's settings, or pass stores tiled like the training stores."
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
    dataset = StoreChunks(store_path, store_chunks(n, config.batch_size), model.worker_preprocess)
    idx, probs = _run_model(dataset, model, total=n, stem=stem, progress=progress, batch_size=config.batch_size)
    return SlidePrediction(
        stem=stem, slide_path=slide_path, source="store", coords_lv0=coords[idx], probs=probs, origin_lv0=origin,
        stride_lv0=stride_lv0, patch_size_lv0=patch_lv0, patch_size_px=patch_px, target_mpp=target_mpp,
        mpp=float(attrs["mpp"]), dimensions_lv0=dims, grid_shape=shape, n_candidates=n, store_path=store_path,
        tissue=None, tissue_detector=str(attrs.get("tissue_detector") or plan.tissue),
        mask_mpp=float(attrs.get("mask_mpp") or plan.mask_mpp), seconds=time.perf_counter() - t0,
    )
