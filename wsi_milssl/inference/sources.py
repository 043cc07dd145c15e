"""The reader processes of slide inference: slides and stores -> patches in shared memory, without torch.

Every function here runs in a reader process (or, with no readers, in the calling process) and
imports only numpy, the slide and store readers and :mod:`wsi_milssl.tiling`; none imports torch, so a
reader holds about 100 MB instead of the 500 MB of a torch import, and readers start from a small
fork server instead of a copy of the main process (:mod:`wsi_milssl.inference.predict`).

Tasks:

- :func:`plan_job`: open a slide and cut it with the model's :class:`~wsi_milssl.tiling.TilingPlan`
  (:func:`wsi_milssl.tiling.plan_slide`: grid, tissue mask, bands of neighbouring cells), or read a
  store's coordinates and check them; returns a :class:`JobPlan` with the chunks to read.
- :func:`read_chunk`: read one chunk (a few bands of a slide, through
  :func:`wsi_milssl.tiling.cut_band` with its entropy filter; or a run of store patches) and write the
  kept patches into a slot of the shared buffer: uint8 (K, P, P, 3) RGB, the model input made by
  table lookup (:class:`PixelTables`; on the CPU), or the stored JPEG bytes (decoded on the device).

Slides and stores stay open in each reader (the last :data:`OPEN_HANDLES`), since several slides
are read at once.
"""

from __future__ import annotations

import math
import os
import signal
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from wsi_milssl.errors import ConfigError, StoreError
from wsi_milssl.parent_watch import watch_parent
from wsi_milssl.slide.reader import open_slide
from wsi_milssl.slide.tissue import TissueMask
from wsi_milssl.tiling import Band, TileGeometry, TilingPlan, cut_band, open_band_source, plan_slide

__all__ = [
    "OPEN_HANDLES",
    "PixelTables",
    "ReaderSetup",
    "PredictJob",
    "JobPlan",
    "ChunkResult",
    "apply_tables",
    "init_reader",
    "close_reader",
    "plan_job",
    "read_chunk",
]

#: Slides or stores a reader keeps open.
OPEN_HANDLES = 4
#: Probe bands passed with every chunk of a slide: the direct TIFF reader is checked on the first of
#: them that starts on a whole pixel of the read level (the tile stage probes the same way).
_PROBE_BANDS = 16


@dataclass(frozen=True)
class PixelTables:
    """The model input of each byte value, for readers that make the model input themselves (CPU).

    ``lut``: (3, 256) output values per channel, as their storage type (uint16 bits of bfloat16 or
    float16, or float32); ``pairs``: None or (3, 65536) uint32, the outputs of two neighbouring bytes
    at once (byte pairs RG, BR, GB of RGBRGB, read as little-endian uint16). Built and checked bit for
    bit by :class:`wsi_milssl.inference.model.Preprocess`.
    """

    lut: np.ndarray
    pairs: np.ndarray | None = None

    @property
    def itemsize(self) -> int:
        return int(self.lut.dtype.itemsize)


def apply_tables(u8: np.ndarray, tables: PixelTables, out: np.ndarray | None = None) -> np.ndarray:
    """uint8 (..., 3) RGB -> the table values (..., 3) in ``tables.lut``'s storage dtype (into ``out``)."""
    if out is None:
        out = np.empty(u8.shape, tables.lut.dtype)
    if tables.pairs is not None and u8.size % 6 == 0 and u8.flags.c_contiguous:
        codes = u8.reshape(-1).view(np.uint16).reshape(-1, 3)
        pairs_out = out.reshape(-1).view(np.uint32).reshape(-1, 3)
        for k in range(3):
            pairs_out[:, k] = tables.pairs[k][codes[:, k]]
    else:
        for c in range(3):
            out[..., c] = tables.lut[c][u8[..., c]]
    return out


@dataclass(frozen=True)
class ReaderSetup:
    """What every reader gets once: the shared buffer (``shm_name``, ``slot_bytes`` per slot), the
    output (``tables`` for the model input, None for uint8 pixels or JPEG bytes) and its niceness."""

    shm_name: str
    slot_bytes: int
    tables: PixelTables | None = None
    niceness: int = 0


@dataclass(frozen=True)
class PredictJob:
    """One slide to predict: cut from ``slide_path`` with ``plan`` (``store_path`` None), or the patches
    of ``store_path``. ``mpp_override``: level-0 µm/px instead of the slide's metadata."""

    stem: str
    slide_path: Path | None
    store_path: Path | None
    plan: TilingPlan
    mpp_override: float | None = None
    chunk_patches: int = 64
    encoded: bool = False


@dataclass
class JobPlan:
    """A job's cells and how to read them: ``coords_lv0`` int64 (N, 2) candidates (slide) or all store
    patches; ``chunks``: lists of bands (slide) or int64 store-index runs; the grid and slide facts
    for :class:`wsi_milssl.inference.predict.SlidePrediction`."""

    job: PredictJob
    source: str
    coords_lv0: np.ndarray
    chunks: list
    origin_lv0: tuple[int, int]
    stride_lv0: int
    patch_size_lv0: int
    patch_size_px: int
    target_mpp: float
    mpp: float
    dimensions_lv0: tuple[int, int]
    grid_shape: tuple[int, int]
    slide_path: Path | None
    geometry: TileGeometry | None = None
    tissue: TissueMask | None = None
    tissue_detector: str = "otsu"
    mask_mpp: float = 16.0
    probe_bands: tuple[Band, ...] = ()
    log: str = ""

    @property
    def n_candidates(self) -> int:
        return int(len(self.coords_lv0))


@dataclass
class ChunkResult:
    """What a reader wrote into its slot: ``indices`` int64 (K,) of the kept patches in
    :attr:`JobPlan.coords_lv0`, ``n_read`` patches read (K or more), and for JPEG bytes their
    ``offsets`` int64 (K + 1,) into the slot."""

    indices: np.ndarray
    n_read: int
    offsets: np.ndarray | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# Per-process state
# ----------------------------------------------------------------------------------------------

_STATE: dict[str, Any] = {}


def init_reader(setup: ReaderSetup, *, shm=None) -> None:
    """Attach the shared buffer and lower this process's priority (a reader process's initializer).
    ``shm``: the buffer itself, when the readers run in the process that made it (no priority change)."""
    from multiprocessing import shared_memory

    close_reader()
    if shm is None:
        # a reader shares the main process's resource tracker (fork server and spawn pass it on), so
        # attaching registers nothing new and the main process alone unlinks the buffer
        shm = shared_memory.SharedMemory(name=setup.shm_name)
        _STATE["owned_shm"] = True
        if setup.niceness:
            try:
                os.nice(setup.niceness)
            except OSError:  # pragma: no cover - not permitted: run at the same priority
                pass
    _STATE.update(setup=setup, shm=shm, handles=OrderedDict())


def start_reader(setup: ReaderSetup, main_pid: int) -> None:
    """A reader process's initializer: :func:`init_reader`, then a thread that ends the reader as soon as
    the process that started the pool (``main_pid``) is gone (:func:`wsi_milssl.parent_watch.watch_parent`).
    A main process killed (SIGKILL, or SIGTERM, which ends Python without cleanup) cannot shut its pool
    down, and a reader waiting for a task never notices: the readers, the fork server (kept alive by them),
    the resource tracker and the shared buffer in /dev/shm stayed for minutes. With the readers gone the
    fork server exits and the resource tracker unlinks the buffer.

    A reader ignores SIGINT: Ctrl-C reaches every process of the terminal's group, and each reader printed its
    own KeyboardInterrupt traceback (review BN); the main process stops the pool, and its reads are short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    init_reader(setup)
    watch_parent(main_pid)


def close_reader() -> None:
    """Close this process's slides, stores and its view of the shared buffer."""
    handles = _STATE.pop("handles", None) or {}
    for handle in handles.values():
        _close_handle(handle)
    shm = _STATE.pop("shm", None)
    if shm is not None and _STATE.get("owned_shm"):
        shm.close()
    _STATE.clear()


def _close_handle(handle) -> None:
    for item in handle:
        close = getattr(item, "close", None)
        if close is not None:
            close()


def _handle(key, opener):
    handles: OrderedDict = _STATE.setdefault("handles", OrderedDict())
    if key in handles:
        handles.move_to_end(key)
        return handles[key]
    handle = opener()
    handles[key] = handle
    while len(handles) > OPEN_HANDLES:
        _close_handle(handles.popitem(last=False)[1])
    return handle


def _slot(index: int) -> memoryview:
    setup: ReaderSetup = _STATE["setup"]
    start = index * setup.slot_bytes
    return _STATE["shm"].buf[start:start + setup.slot_bytes]


# ----------------------------------------------------------------------------------------------
# Tasks
# ----------------------------------------------------------------------------------------------

def plan_job(job: PredictJob) -> JobPlan:
    """Cut ``job``'s slide with its plan (or read its store's coordinates) into chunks to read."""
    if job.store_path is not None:
        return _plan_store(job)
    plan = job.plan
    with open_slide(job.slide_path, mpp_override=job.mpp_override) as slide:
        cells = plan_slide(slide, plan)
        mpp = float(slide.mpp)
        dims = (int(slide.dimensions[0]), int(slide.dimensions[1]))
    g = cells.geometry
    return JobPlan(
        job=job, source="slide", coords_lv0=cells.coords_lv0, chunks=chunk_bands(cells.bands, job.chunk_patches),
        origin_lv0=(0, 0), stride_lv0=g.stride_lv0, patch_size_lv0=g.patch_size_lv0, patch_size_px=g.patch_size_px,
        target_mpp=g.target_mpp, mpp=mpp, dimensions_lv0=dims, grid_shape=g.grid_shape(), slide_path=job.slide_path,
        geometry=g, tissue=cells.tissue, tissue_detector=plan.tissue, mask_mpp=plan.mask_mpp,
        probe_bands=tuple(cells.bands[:_PROBE_BANDS]),
        log=(f"{job.stem}: {cells.n_grid} grid cells, {cells.n_candidates} with tissue; level {g.level}, "
             f"patch {g.patch_size_lv0} lv0 px"),
    )


def chunk_bands(bands: Sequence[Band], max_patches: int) -> list[list[Band]]:
    """Group consecutive bands into chunks of at most ``max_patches`` patches; bands are never split,
    so a band wider than that is a chunk of its own."""
    chunks: list[list[Band]] = []
    current: list[Band] = []
    n = 0
    for band in bands:
        b = len(band.indices)
        if current and n + b > max_patches:
            chunks.append(current)
            current, n = [], 0
        current.append(band)
        n += b
    if current:
        chunks.append(current)
    return chunks


def _store_grid_shape(dims: tuple[int, int] | None, coords: np.ndarray, *, origin: tuple[int, int], patch: int,
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


def _plan_store(job: PredictJob) -> JobPlan:
    from wsi_milssl.store import open_store

    store_path = Path(job.store_path)
    plan = job.plan
    with open_store(store_path) as store:
        attrs = store.attrs
        if not store.has("patches"):
            raise StoreError(f"{store_path}: the store holds coordinates only (tiled with --pixels none), so there "
                             "is nothing to classify. Fix: drop --store to tile the slide on the fly, or re-tile "
                             "with --pixels jpeg.")
        coords = np.asarray(store.coords, dtype=np.int64).reshape(-1, 2)
        pixels = store.pixels
        recorded = Path(attrs["slide_path"]) if attrs.get("slide_path") else None
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
    if len(coords) and ((coords - np.asarray(origin)) % stride_lv0 != 0).any():
        raise StoreError(f"{store_path}: patch coordinates are not on a regular grid of stride {stride_lv0} level-0 "
                         f"px from {list(origin)}, so they cannot form a probability map. Fix: re-tile the slide "
                         "with `wsi-milssl tile`.")
    dims_attr = attrs.get("dimensions_lv0")
    dims = (int(dims_attr[0]), int(dims_attr[1])) if dims_attr else None
    shape = _store_grid_shape(dims, coords, origin=origin, patch=patch_lv0, stride=stride_lv0)
    if dims is None:
        dims = (origin[0] + (shape[1] - 1) * stride_lv0 + patch_lv0,
                origin[1] + (shape[0] - 1) * stride_lv0 + patch_lv0)
    n = len(coords)
    step = max(1, job.chunk_patches)
    chunks = [np.arange(i, min(i + step, n), dtype=np.int64) for i in range(0, n, step)]
    encoded = job.encoded and pixels == "jpeg"
    if encoded != job.encoded:
        job = PredictJob(**{**job.__dict__, "encoded": False})
    return JobPlan(
        job=job, source="store", coords_lv0=coords, chunks=chunks, origin_lv0=origin, stride_lv0=stride_lv0,
        patch_size_lv0=patch_lv0, patch_size_px=patch_px, target_mpp=target_mpp, mpp=float(attrs["mpp"]),
        dimensions_lv0=dims, grid_shape=shape, slide_path=recorded,
        tissue_detector=str(attrs.get("tissue_detector") or plan.tissue),
        mask_mpp=float(attrs.get("mask_mpp") or plan.mask_mpp),
        log=f"{job.stem}: {n} patches in {store_path.name}",
    )


def read_chunk(job: PredictJob, chunk, slot: int, *, geometry: TileGeometry | None = None,
               probe_bands: Sequence[Band] = ()) -> ChunkResult:
    """Read ``chunk`` of ``job`` into shared slot ``slot`` (see the module docstring)."""
    if job.store_path is not None:
        return _read_store_chunk(job, np.asarray(chunk, dtype=np.int64), slot)
    key = ("slide", str(job.slide_path), job.mpp_override)

    def opener():
        slide = open_slide(job.slide_path, mpp_override=job.mpp_override)
        source = open_band_source(slide, geometry, probe_bands, plan=job.plan)
        return (source, slide)  # closed in this order

    source, slide = _handle(key, opener)
    idx_parts, pix_parts, n_read = [], [], 0
    for band in chunk:
        cut = cut_band(slide, band, geometry, plan=job.plan, source=source)
        n_read += cut.n_read
        idx_parts.append(cut.indices)
        pix_parts.append(cut.patches)
    indices = np.concatenate(idx_parts) if idx_parts else np.zeros(0, np.int64)
    _write_pixels(pix_parts, int(len(indices)), geometry.patch_size_px, slot)
    return ChunkResult(indices=indices.astype(np.int64), n_read=n_read)


def _read_store_chunk(job: PredictJob, indices: np.ndarray, slot: int) -> ChunkResult:
    from wsi_milssl.store import open_store

    store = _handle(("store", str(job.store_path)), lambda: (open_store(job.store_path),))[0]
    if job.encoded:
        data = store.read_jpeg(indices)
        offsets = np.zeros(len(data) + 1, np.int64)
        offsets[1:] = np.cumsum([len(b) for b in data])
        buf = _slot(slot)
        if offsets[-1] > len(buf):
            raise StoreError(f"{job.store_path}: {int(offsets[-1])} bytes of JPEG in {len(indices)} patches exceed the "
                             f"reader buffer ({len(buf)} bytes). Fix: lower --batch-size or use --decode workers.")
        np.frombuffer(buf, np.uint8, count=int(offsets[-1]))[:] = np.frombuffer(b"".join(data), np.uint8)
        return ChunkResult(indices=indices, n_read=int(len(indices)), offsets=offsets)
    pixels = np.asarray(store.read_patches(indices))
    _write_pixels([pixels], int(len(indices)), int(pixels.shape[1]) if len(pixels) else 0, slot)
    return ChunkResult(indices=indices, n_read=int(len(indices)))


def _write_pixels(parts: list[np.ndarray], n: int, side: int, slot: int) -> None:
    """Write ``n`` uint8 (side, side, 3) patches (in ``parts``) into ``slot``: as they are, or through the
    setup's tables."""
    if n == 0:
        return
    setup: ReaderSetup = _STATE["setup"]
    tables = setup.tables
    dtype = np.uint8 if tables is None else tables.lut.dtype
    need = n * side * side * 3 * np.dtype(dtype).itemsize
    buf = _slot(slot)
    if need > len(buf):
        raise ValueError(f"a chunk of {n} patches needs {need} bytes but a reader slot holds {len(buf)}")
    out = np.ndarray((n, side, side, 3), dtype=dtype, buffer=buf)
    pos = 0
    for part in parts:
        k = len(part)
        if k == 0:
            continue
        if tables is None:
            out[pos:pos + k] = part
        else:
            apply_tables(np.ascontiguousarray(part), tables, out=out[pos:pos + k])
        pos += k
