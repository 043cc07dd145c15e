"""Patch sources for slide inference: DataLoader datasets whose items are chunks of patches.

- :class:`SlideChunks` cuts patches from the slide itself with the tile stage's public functions
  (:func:`wsi_milssl.tiling.plan_slide`'s bands -> :func:`wsi_milssl.tiling.cut_band`: read, then the
  entropy filter), so it keeps exactly the patches a store tiled with the same plan holds.
- :class:`StoreChunks` decodes the patches of an existing patch store.

Item ``k`` is ``{"index": int64 (K,), "n_read": int, "pixels": ...}``: the kept patches' positions
(in the slide's candidate cells, or in the store), how many patches were read for it (progress), and
their pixels, uint8 (K, P, P, 3), or the model input made by ``preprocess`` when one is given (CPU:
the workers do it). Slides and stores open lazily once per process, so the datasets are safe in
DataLoader worker processes (no handle crosses a fork).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from wsi_milssl.slide.reader import open_slide
from wsi_milssl.tiling import Band, TileGeometry, TilingPlan, cut_band, open_band_source

__all__ = ["SlideChunks", "StoreChunks", "chunk_bands", "store_chunks"]

#: what readers apply to uint8 (K, P, P, 3) pixels (e.g. :class:`wsi_milssl.inference.model.Preprocess`)
PixelTransform = Callable[[torch.Tensor], torch.Tensor]


def chunk_bands(bands: Sequence[Band], batch_size: int) -> list[list[Band]]:
    """Group consecutive bands into items of at most ``batch_size`` patches; bands are never split, so
    a band wider than ``batch_size`` patches is an item of its own."""
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


def store_chunks(n: int, batch_size: int) -> list[np.ndarray]:
    """int64 index runs [0, batch_size), [batch_size, 2 batch_size), ... covering ``n`` store patches."""
    return [np.arange(i, min(i + batch_size, n), dtype=np.int64) for i in range(0, n, batch_size)]


class SlideChunks(torch.utils.data.Dataset):
    """Item k: the patches of ``chunks[k]`` (a few bands of neighbouring cells) cut from the slide by
    ``plan`` (read, entropy-filtered) and optionally preprocessed. The slide opens lazily once per
    process, with the plan's reader (:func:`wsi_milssl.tiling.open_band_source`)."""

    def __init__(self, slide_path: Path, *, mpp_override: float | None, plan: TilingPlan, geometry: TileGeometry,
                 chunks: list[list[Band]], preprocess: PixelTransform | None) -> None:
        self.slide_path = slide_path
        self.mpp_override = mpp_override
        self.plan = plan
        self.geometry = geometry
        self.chunks = chunks
        self.preprocess = preprocess
        self._pid: int | None = None
        self._slide = None
        self._source = None

    def __len__(self) -> int:
        return len(self.chunks)

    def _open(self):
        if self._pid != os.getpid():
            self._slide = open_slide(self.slide_path, mpp_override=self.mpp_override)
            # probe on the same bands as the tile stage: the first one on a whole pixel of the read level
            self._source = open_band_source(self._slide, self.geometry, (b for chunk in self.chunks for b in chunk),
                                            plan=self.plan)
            self._pid = os.getpid()
        return self._slide

    def __getitem__(self, k: int) -> dict[str, Any]:
        slide = self._open()
        idx_parts: list[np.ndarray] = []
        pix_parts: list[np.ndarray] = []
        n_read = 0
        for band in self.chunks[k]:
            cut = cut_band(slide, band, self.geometry, plan=self.plan, source=self._source)
            n_read += cut.n_read
            idx_parts.append(cut.indices)
            pix_parts.append(cut.patches)
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


class StoreChunks(torch.utils.data.Dataset):
    """Item k: the decoded patches ``chunks[k]`` (consecutive store indices), optionally preprocessed."""

    def __init__(self, store_path: Path, chunks: list[np.ndarray], preprocess: PixelTransform | None) -> None:
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
