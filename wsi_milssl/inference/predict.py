"""The slide engine: slides (or patch stores) -> a model's output per patch, many slides at once.

Heatmaps run a classifier through it (per-patch tumour probabilities, :func:`predict_many`); the
feature stage runs a frozen encoder (per-patch features, :mod:`wsi_milssl.features`). Both go through
:func:`run_slides` with a model object that has ``plan`` (the
:class:`~wsi_milssl.tiling.TilingPlan` slides are cut with), ``runtime`` (an
:class:`~wsi_milssl.inference.model.InferenceRuntime`), ``reader_tables`` / ``reader_dtype`` (what the
readers make of uint8 pixels on the CPU) and ``forward_batch(x)`` returning a device tensor (B,) or
(B, D): :class:`~wsi_milssl.inference.model.PatchModel` and its subclasses.

A slide is cut with the model's :class:`~wsi_milssl.tiling.TilingPlan` (for a classifier the one its
training stores were tiled with, recorded in the checkpoint) through the tile stage's own functions
(:func:`wsi_milssl.tiling.plan_slide`, :func:`wsi_milssl.tiling.cut_band`), so the outputs are for
exactly the cells a store tiled with that plan holds. From a store (``--store``) the store's patches
are used as they are.

:func:`run_slides` serves a whole batch of slides from one pool of reader processes
(:mod:`wsi_milssl.inference.sources`; they start from a small fork server and never import torch):

- readers plan the next slides (tissue mask, bands) while others are read, so several slides are in
  flight and the model never waits at a slide boundary;
- each chunk of patches is written by a reader into a slot of one shared-memory buffer (uint8
  pixels; on the CPU the bfloat16 model input, by table lookup; with ``decode='device'`` a store's
  JPEG bytes, decoded on the GPU by ``torchvision.io.decode_jpeg``), so only indices cross a pipe;
- the main process takes each slide's chunks in order and runs the model on batches of exactly
  ``batch_size`` patches (a slide's last batch is smaller, padded on CUDA), keeping the
  outputs on the device until the slide is done. Per slide the batches are the ones a slide
  alone would get, so results do not depend on the worker count or on the other slides.

Memory is bounded by the slots (``(workers x 2 + 2)`` chunks of at most :data:`CHUNK_BYTES`) and a few
planned slides (a slide is planned only while the chunks waiting for a reader are fewer than twice the
slots, so slides finish one after another rather than all at the end), whatever the slide count or
size: per slide only the level-0 coordinates and the outputs (one float, or one feature vector, per
patch) are kept. On the CPU the readers run at the lowest priority: the forward pass keeps every core
busy, so they fill its gaps instead of stalling its threads.
"""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import resource
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from wsi_milssl import shm as shm_rules
from wsi_milssl.atomic import preallocate
from wsi_milssl.config.heatmap import HeatmapConfig
from wsi_milssl.config.tile import TileConfig
from wsi_milssl.errors import OutputError
from wsi_milssl.events import ProgressCallback, ProgressEvent, emit
from wsi_milssl.runtime import decode_jpeg_batch, host_to_device, inference_batch_size, require_device_decode
from wsi_milssl.inference.model import InferenceModel, PatchModel
from wsi_milssl.inference.sources import (
    ChunkResult,
    JobPlan,
    PredictJob,
    ReaderSetup,
    close_reader,
    init_reader,
    plan_job,
    read_chunk,
    start_reader,
)
from wsi_milssl.slide.tissue import TissueMask
from wsi_milssl.sockets import fit_socket_paths
from wsi_milssl.tiling import MAX_BAND_PX, TileGeometry, slide_stem

__all__ = ["CHUNK_BYTES", "SlideInput", "SlideOutputs", "SlidePrediction", "run_slides", "predict_many",
           "predict_slide", "predict_store", "prestart_readers"]

logger = logging.getLogger(__name__)

_TILE_DEFAULTS = TileConfig()
_DEFAULT_TISSUE = _TILE_DEFAULTS.tissue
_DEFAULT_MASK_MPP = float(_TILE_DEFAULTS.mask_mpp)
#: Bytes of model input in one reader chunk (a slot of the shared buffer); chunks hold at most
#: ``batch_size`` patches, or one band when a band holds more. Small enough that a slide is many
#: chunks (its reading spreads over the readers; 55 patches of 224 px) and the slots stay small.
CHUNK_BYTES = 8 << 20
#: Slots per reader: one being written, one waiting for the model.
_SLOTS_PER_READER = 2
#: Room for the JPEG bytes of a patch beyond its raw size (headers of tiny patches).
_JPEG_SLACK = 4096
#: Where POSIX shared memory (the readers' slots, the reader pool's semaphores) lives on Linux.
SHM_DIR = shm_rules.SHM_DIR


@dataclass(frozen=True)
class SlideInput:
    """One slide to predict: its stem, the slide file (None when only a store is known and its recorded
    slide is missing) and the store to read patches from (None: cut the slide on the fly)."""

    stem: str
    slide_path: Path | None
    store_path: Path | None


@dataclass
class SlideOutputs:
    """A model's outputs for the patches of one slide and the grid they sit on.

    ``coords_lv0``: int64 (N, 2) level-0 top-left (x, y) of each patch, row-major; ``outputs``: (N,)
    or (N, D), float32 (float16 when the model returns float16), row i for patch i. Grid cell (r, c)
    is the patch with top-left (origin_x + c * stride_lv0, origin_y + r * stride_lv0); ``grid_shape``
    = (rows, cols). ``mpp`` is the level-0 µm/px, ``dimensions_lv0`` the slide's (width, height).
    ``tissue`` is the mask used to pick cells (slides tiled on the fly). ``n_candidates``: cells read
    (before the entropy filter) or patches in the store. ``geometry``: how a slide cut on the fly was
    read (None for stores).
    """

    stem: str
    slide_path: Path | None
    source: str
    coords_lv0: np.ndarray
    outputs: np.ndarray
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
    geometry: TileGeometry | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.outputs.shape[0])


@dataclass
class SlidePrediction(SlideOutputs):
    """Per-patch tumour probabilities of one slide (``probs``: float32 (N,), the ``outputs`` of a
    classifier) and the grid they sit on (see :class:`SlideOutputs`)."""

    @property
    def probs(self) -> np.ndarray:
        """float32 (N,) positive-class probability of each patch."""
        return self.outputs

    def grid(self) -> np.ndarray:
        """float32 (rows, cols) probability map, NaN where there is no patch."""
        from wsi_milssl.inference.heatmap import probability_grid

        return probability_grid(self.coords_lv0, self.probs, origin_lv0=self.origin_lv0,
                                stride_lv0=self.stride_lv0, shape=self.grid_shape)

    def score(self, pooling: str) -> float | None:
        """Slide score: max or mean of the patch probabilities (paper eq. 11); None without patches (no score,
        never a confident 0: the heatmap stage's rule, as ``bag_scores`` gives an empty bag NaN)."""
        from wsi_milssl.mil.scores import bag_scores

        score = float(bag_scores(self.probs, np.zeros(len(self), np.int64), 1, pooling=pooling)[0])
        return None if len(self) == 0 else score


# ----------------------------------------------------------------------------------------------
# The reader pool
# ----------------------------------------------------------------------------------------------

class _InlineExecutor:
    """Runs tasks in the calling process (no reader processes), with the executor's interface."""

    def submit(self, fn, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - delivered through the future, as a process pool does
            future.set_exception(exc)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        close_reader()


def _reader_context():
    """A fork server that imports only the readers' module: readers start small (no torch, no CUDA
    state, nothing of the main process's memory); spawn where there is no fork server."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        fit_socket_paths()
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["wsi_milssl.inference.sources"])
        return ctx
    return multiprocessing.get_context("spawn")


def prestart_readers() -> None:
    """Start the readers' fork server now: it imports the reader module in its own process while the
    caller goes on (building a model takes about as long), so the first :func:`run_slides` does not wait
    for it (about 0.6 s on the 2-core development machine). Nothing happens without a fork server."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        from multiprocessing import forkserver

        _reader_context()
        forkserver.ensure_running()


def _shm_error(problem: str, code: int | None) -> OutputError:
    """The readers' shared-memory error (:func:`wsi_milssl.shm.shm_error`)."""
    return shm_rules.shm_error(problem, code, fewer="or run with fewer --workers (each takes 2 slots) or a smaller "
                                              "--batch-size")


def _create_slots(*, workers: int, slot_bytes: int, n_slots: int) -> shared_memory.SharedMemory:
    """The readers' shared buffer of ``n_slots`` slots, its memory reserved now.

    A shared-memory segment is sparse: created in a :data:`SHM_DIR` too small for it (Docker's default
    is 64 MB), it fails only when a reader first writes a slot, and that reader dies of a SIGBUS (or,
    with ``workers == 0``, the whole process: "Bus error"). So the free space is checked first, and the
    segment's pages are allocated at once (:func:`~wsi_milssl.atomic.preallocate`): too little room or
    a file-size limit is one OutputError naming :data:`SHM_DIR`, the bytes needed and the fix.
    """
    n_bytes = max(1, slot_bytes * n_slots)
    need = f"{n_slots} slots of {shm_rules.mib(slot_bytes)} ({workers} workers) need {shm_rules.mib(n_bytes)}"
    free = shm_rules.free_bytes()
    if free is not None and free < n_bytes:
        raise _shm_error(f"too little shared memory for the patch readers: {need}, {shm_rules.mib(free)} are free",
                         errno.ENOSPC)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and limit < n_bytes:  # checked first: SharedMemory would fail untidily
        raise _shm_error(f"cannot make the patch readers' shared memory: {need}, more than the file-size limit "
                         f"of {shm_rules.mib(limit)}", errno.EFBIG)
    shm = None
    try:
        shm = shared_memory.SharedMemory(create=True, size=n_bytes)
        fd = getattr(shm, "_fd", -1)  # POSIX only
        if fd >= 0:
            preallocate(fd, n_bytes)
    except OSError as exc:
        if shm is not None:
            shm.close()
            shm.unlink()
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        raise _shm_error(f"cannot make the patch readers' shared memory: {need} ({exc.strerror})",
                         exc.errno) from None
    return shm


class _Readers:
    """The reader processes (or the calling process with ``workers == 0``) and the shared slots. Reader
    processes end by themselves when the process that started them is gone (:func:`start_reader`).
    Shared memory that cannot be made (the slots, the pool's semaphores) is an OutputError naming
    :data:`SHM_DIR` and the fix (:func:`_create_slots`)."""

    def __init__(self, *, workers: int, slot_bytes: int, n_slots: int, setup_kwargs: dict[str, Any]) -> None:
        self.workers = workers
        self.slot_bytes = slot_bytes
        self.n_slots = n_slots
        self.shm = _create_slots(workers=workers, slot_bytes=slot_bytes, n_slots=n_slots)
        self.setup = ReaderSetup(shm_name=self.shm.name, slot_bytes=slot_bytes, **setup_kwargs)
        self.free = list(range(n_slots))
        self.pool = None
        try:
            self.start()
        except BaseException:
            self.shm.close()
            self.shm.unlink()
            raise

    def start(self) -> None:
        if self.workers > 0:
            try:
                self.pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=_reader_context(),
                                                initializer=start_reader, initargs=(self.setup, os.getpid()))
            except OSError as exc:  # its semaphores live in /dev/shm too
                if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG, 0, None):
                    raise
                cause = exc.strerror if exc.errno else "the system gave no cause"
                raise _shm_error(f"cannot make the patch readers' semaphores ({cause})", exc.errno) from None
        else:
            init_reader(self.setup, shm=self.shm)
            self.pool = _InlineExecutor()

    def restart(self) -> None:
        """A new pool after a reader died (every slot is free again)."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.free = list(range(self.n_slots))
        self.start()

    def view(self, slot: int, shape: tuple[int, ...], dtype) -> np.ndarray:
        return np.ndarray(shape, dtype=dtype, buffer=self.shm.buf, offset=slot * self.slot_bytes)

    def close(self) -> None:
        try:
            if self.pool is not None:
                self.pool.shutdown(wait=True, cancel_futures=True)
        finally:
            try:
                self.shm.close()
            except BufferError:  # a view still referenced somewhere: the unlink below frees it at exit
                logger.debug("shared reader buffer %s still referenced at close", self.shm.name)
            self.shm.unlink()


# ----------------------------------------------------------------------------------------------
# Batches of one slide
# ----------------------------------------------------------------------------------------------

#: on the CPU a slide's last, smaller batch is padded to a multiple of this many patches: every new
#: batch size leaves memory behind in the CPU kernels' caches and the allocator (ResNet18 on 224 px
#: patches, batch 64, 2-core machine: RSS grew by 830 MB over the 64 possible last-batch sizes, by 170 MB
#: over the 8 sizes left with this step, 2026-11-28), for at most 7 wasted patches a slide
CPU_BATCH_STEP = 8


def padded_batch(n: int, batch_size: int, *, full: bool) -> int:
    """How many patches a model call of ``n`` patches is given (``n`` <= ``batch_size``; the padding's outputs
    are dropped): ``batch_size`` with ``full`` (CUDA: every new input shape costs a cuDNN autotune, padded
    patches next to nothing), else ``n`` rounded up to a multiple of :data:`CPU_BATCH_STEP`."""
    if full:
        return batch_size
    return min(batch_size, -(-n // CPU_BATCH_STEP) * CPU_BATCH_STEP)


class _Batcher:
    """Joins a slide's chunks, in order, into model calls of exactly ``batch_size`` patches; the
    outputs stay on the device until :meth:`finish`.

    Patches of a batch that spans chunks are copied once, into a staging batch (chunks usually hold
    fewer patches than a batch); a whole batch inside one chunk goes to the model as it is."""

    def __init__(self, model: PatchModel, batch_size: int) -> None:
        self.model = model
        self.batch_size = batch_size
        self._stage: torch.Tensor | None = None  # (batch_size, ...) like the chunks, allocated once
        self._idx_parts: list[np.ndarray] = []
        self._count = 0  # patches waiting in the staging batch
        self._out_idx: list[np.ndarray] = []
        self._outputs: list[torch.Tensor] = []

    def _staging(self, x: torch.Tensor) -> torch.Tensor:
        if self._stage is None:
            shape = (self.batch_size,) + tuple(x.shape[1:])
            # the readers' (B, 3, H, W) view of (B, H, W, 3) pixels is channels_last: keep that layout
            channels_last = (x.dim() == 4 and not x.is_contiguous()
                             and x.is_contiguous(memory_format=torch.channels_last))
            layout = torch.channels_last if channels_last else torch.contiguous_format
            self._stage = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=layout)
        return self._stage

    def add(self, idx: np.ndarray, x: torch.Tensor) -> None:
        """Add patches ``x`` (may alias a reader slot: nothing of it is kept after the call)."""
        b, n, pos = self.batch_size, len(idx), 0
        while pos < n:
            if self._count == 0 and n - pos >= b:  # a whole batch in this chunk: no copy
                self._run(idx[pos:pos + b], x[pos:pos + b])
                pos += b
                continue
            take = min(b - self._count, n - pos)
            self._staging(x)[self._count:self._count + take].copy_(x[pos:pos + take])
            self._idx_parts.append(idx[pos:pos + take])
            self._count += take
            pos += take
            if self._count == b:
                self._run_staged(b)

    def _run_staged(self, n: int) -> None:
        """Run the staging batch's first ``n`` patches, with zeroed patches after them up to
        :func:`padded_batch` (whose outputs are dropped)."""
        stage = self._stage
        padded = padded_batch(n, self.batch_size, full=self.model.runtime.pad_last_batch)
        if padded > n:
            stage[n:padded].zero_()
            out = self.model.forward_batch(stage[:padded])[:n]
        else:
            out = self.model.forward_batch(stage[:n])
        self._out_idx.append(np.concatenate(self._idx_parts))
        self._outputs.append(out)
        self._idx_parts, self._count = [], 0

    def _run(self, idx: np.ndarray, x: torch.Tensor) -> None:
        self._out_idx.append(idx)
        self._outputs.append(self.model.forward_batch(x))

    def finish(self) -> tuple[np.ndarray, np.ndarray]:
        """(int64 indices, outputs (N,) or (N, D)) of every patch added, in order; float16 outputs
        stay float16, any other dtype becomes float32."""
        if self._count:
            self._run_staged(self._count)
        self._stage = None
        if not self._out_idx:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        out = torch.cat(self._outputs)
        if out.dtype != torch.float16:
            out = out.float()
        return np.concatenate(self._out_idx).astype(np.int64), out.cpu().numpy()


def plan_another(*, n_waiting: int, n_active: int, backlog_chunks: float, n_slots: int, max_active: int) -> bool:
    """Whether the engine plans the next slide now: while slides wait, always up to two slides in flight,
    then (up to ``max_active``) only while the chunks waiting for a reader (``backlog_chunks``: those of
    planned slides not yet handed out, plus an estimate for slides being planned) are fewer than twice
    the ``n_slots`` shared slots. So the readers always have work, yet slides are read in order and
    finish one after another: their files are written while the model goes on with the next ones,
    instead of all at the end (14 slides in flight on an H100 machine left 2.9 s of file writing after
    the last batch, 2026-11-27)."""
    if n_waiting == 0 or n_active >= max_active:
        return False
    return n_active < 2 or backlog_chunks < 2 * n_slots


@dataclass(eq=False)
class _Run:
    """A slide in flight: its plan, chunks submitted / received / consumed, and its batches."""

    index: int
    job: PredictJob
    t0: float
    plan: JobPlan | None = None
    planning: bool = False
    next_submit: int = 0
    next_consume: int = 0
    received: dict[int, tuple[int, ChunkResult]] = field(default_factory=dict)
    inflight: int = 0
    batcher: _Batcher | None = None
    error: BaseException | None = None

    @property
    def complete(self) -> bool:
        return self.plan is not None and self.next_consume == len(self.plan.chunks)


def _chunk_patches(model: PatchModel, batch_size: int, itemsize: int) -> int:
    side = model.plan.patch_size_px
    return max(1, min(batch_size, CHUNK_BYTES // (side * side * 3 * itemsize)))


def predict_many(inputs: Sequence[SlideInput], model: InferenceModel, *, config: HeatmapConfig | None = None,
                 progress: ProgressCallback | None = None) -> Iterator[tuple[int, SlidePrediction | Exception]]:
    """Predict every input with ``model``; yields ``(position in inputs, SlidePrediction or the error)``
    as slides finish (not in input order). One bad slide is yielded as its exception and the others go
    on; a reader that dies fails the slides it was reading and a new pool takes the rest.

    Progress: ``heatmap-patches`` events count the patches read over all slides planned so far.
    """
    config = config or HeatmapConfig()
    yield from run_slides(inputs, model, batch_size=config.batch_size, decode=config.decode,
                          slide_mpp=config.slide_mpp, progress=progress, event="heatmap-patches",
                          owner="HeatmapConfig", result_type=SlidePrediction)


def run_slides(inputs: Sequence[SlideInput], model: PatchModel, *, batch_size: int, decode: str = "workers",
               slide_mpp: float | None = None, progress: ProgressCallback | None = None,
               event: str = "patches", owner: str = "config", result_type: type[SlideOutputs] = SlideOutputs
               ) -> Iterator[tuple[int, SlideOutputs | Exception]]:
    """Run ``model.forward_batch`` over every patch of every input; yields ``(position in inputs,
    result_type or the error)`` as slides finish (not in input order).

    ``batch_size``: patches per model call (0: auto, per device); ``decode``: 'workers' or 'device'
    (a store's JPEG bytes decoded on the model's device); ``slide_mpp``: level-0 µm/px instead of the slides' metadata.
    One bad slide is yielded as its exception and the others go on; a reader that dies fails the
    slides it was reading and a new pool takes the rest. Progress: ``event`` events count the patches
    read over all slides planned so far; ``owner`` names the config in errors.
    """
    inputs = list(inputs)
    if not inputs:
        return
    rt = model.runtime
    batch_size = inference_batch_size(batch_size, rt.device)
    tables = model.reader_tables
    itemsize = 1 if tables is None else tables.itemsize
    side = model.plan.patch_size_px
    encoded = decode == "device"
    if encoded:
        require_device_decode(owner=owner)
    chunk = _chunk_patches(model, batch_size, itemsize)
    capacity = max(chunk, MAX_BAND_PX // max(1, model.plan.stride_px) + 1)  # a band is never split
    slot_bytes = capacity * (side * side * 3 * itemsize + (_JPEG_SLACK if encoded else 0))
    workers = max(0, rt.num_workers)
    readers = _Readers(workers=workers, slot_bytes=slot_bytes, n_slots=max(1, workers) * _SLOTS_PER_READER + 2,
                       setup_kwargs={"tables": tables, "niceness": rt.reader_niceness})
    runs = [_Run(i, PredictJob(stem=item.stem, slide_path=None if item.slide_path is None else Path(item.slide_path),
                               store_path=None if item.store_path is None else Path(item.store_path),
                               plan=model.plan, mpp_override=slide_mpp, chunk_patches=chunk,
                               encoded=encoded and item.store_path is not None), time.perf_counter())
            for i, item in enumerate(inputs)]
    waiting = deque(runs)  # not yet planned
    active: list[_Run] = []  # planned or planning, not finished
    futures: dict[Future, tuple] = {}
    lookahead = max(2, workers)
    totals = {"read": 0, "candidates": 0, "planned": 0, "chunks": 0}

    def another_slide() -> bool:
        planned = [len(r.plan.chunks) - r.next_submit for r in active if r.plan is not None and r.error is None]
        per_slide = totals["chunks"] / totals["planned"] if totals["planned"] else readers.n_slots
        planning = sum(1 for r in active if r.plan is None and r.error is None)
        return plan_another(n_waiting=len(waiting), n_active=len(active), n_slots=readers.n_slots,
                            backlog_chunks=sum(planned) + planning * per_slide, max_active=lookahead)

    def submit() -> bool:
        """Hand out plans and chunks to the readers; False when the pool broke meanwhile (a reader died
        while the model ran): the work not handed out stays where it was, for the pool that replaces it."""
        try:
            while another_slide():
                run = waiting[0]
                futures[readers.pool.submit(plan_job, run.job)] = ("plan", run)
                waiting.popleft()
                run.t0, run.planning = time.perf_counter(), True
                active.append(run)
            for run in active:
                if run.plan is None or run.error is not None:
                    continue
                plan = run.plan
                while readers.free and run.next_submit < len(plan.chunks):
                    slot = readers.free[-1]
                    fut = readers.pool.submit(read_chunk, plan.job, plan.chunks[run.next_submit], slot,
                                              geometry=plan.geometry, probe_bands=plan.probe_bands)
                    readers.free.pop()
                    futures[fut] = ("chunk", run, run.next_submit, slot)
                    run.next_submit += 1
                    run.inflight += 1
        except BrokenProcessPool:
            return False
        return True

    def inputs_of(run: _Run, slot: int, result: ChunkResult) -> torch.Tensor:
        k = len(result.indices)
        if result.offsets is not None:  # JPEG bytes: decode on the device
            raw = readers.view(slot, (int(result.offsets[-1]),), np.uint8)
            data = [torch.from_numpy(raw[a:b].copy()) for a, b in zip(result.offsets[:-1], result.offsets[1:])]
            return decode_jpeg_batch(data, rt.device)
        if tables is None:
            x = torch.from_numpy(readers.view(slot, (k, side, side, 3), np.uint8))
            # on CUDA pinned first (the slot is reused as soon as this returns), then a copy that waits for nothing
            return host_to_device(x, rt.device)
        if tables.lut.dtype == np.uint16:  # bfloat16 bits
            x = torch.from_numpy(readers.view(slot, (k, side, side, 3), np.int16)).view(model.reader_dtype)
        else:
            x = torch.from_numpy(readers.view(slot, (k, side, side, 3), tables.lut.dtype))
        return x.permute(0, 3, 1, 2)

    def finished(run: _Run) -> tuple[int, SlideOutputs | Exception]:
        active.remove(run)
        for slot, _ in run.received.values():
            readers.free.append(slot)
        run.received.clear()
        if run.error is not None:
            return run.index, run.error
        idx, outputs = np.zeros(0, np.int64), np.zeros(0, np.float32)
        try:  # the last, smaller batch runs here, and on CUDA the device's errors surface here
            if run.batcher is not None:
                idx, outputs = run.batcher.finish()
        except Exception as exc:  # noqa: BLE001 - a model error fails this slide only
            return run.index, exc
        return run.index, _result(result_type, run.plan, idx, outputs, seconds=time.perf_counter() - run.t0)

    def consume(run: _Run) -> None:
        while run.next_consume in run.received:
            slot, result = run.received.pop(run.next_consume)
            try:
                run.batcher.add(result.indices, inputs_of(run, slot, result))
            finally:
                readers.free.append(slot)
            run.next_consume += 1
            totals["read"] += result.n_read
            emit(progress, ProgressEvent(event, totals["read"], totals["candidates"], unit="patch",
                                         item=run.job.stem))

    emit(progress, ProgressEvent(event, 0, 0, unit="patch"))
    try:
        submit()
        try:
            model.warm_up(batch_size)  # while the readers plan the first slides
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory at this batch size: each slide reports it
            logger.warning("the model's warm-up batch of %d failed (%s); the slides will report it",
                           batch_size, exc)
        while waiting or active:
            if not submit():
                for run in dict.fromkeys(_fail_broken(active, futures, readers)):
                    if run in active:
                        yield finished(run)
                continue
            done_runs: list[_Run] = []
            if not futures:  # every active slide finished without reads (no chunks)
                done_runs = [r for r in active if r.complete or r.error is not None]
            else:
                done, _ = wait(list(futures), return_when=FIRST_COMPLETED)
                broken = False
                for fut in sorted(done, key=lambda f: futures[f][1].index):
                    kind, run, *rest = futures.pop(fut)
                    try:
                        result = fut.result()
                    except BrokenProcessPool:
                        broken = True
                        continue
                    except Exception as exc:  # noqa: BLE001 - one bad slide must not stop the others
                        if kind == "chunk":
                            readers.free.append(rest[1])
                            run.inflight -= 1
                        run.planning = False
                        run.error = run.error or exc
                        if run.inflight == 0:
                            done_runs.append(run)
                        continue
                    if kind == "plan":
                        run.plan, run.planning = result, False
                        run.batcher = _Batcher(model, batch_size)
                        totals["candidates"] += result.n_candidates
                        totals["planned"] += 1
                        totals["chunks"] += len(result.chunks)
                        logger.info("%s; %s", result.log, rt.describe())
                        if not result.chunks:
                            done_runs.append(run)
                        continue
                    k, slot = rest
                    run.inflight -= 1
                    if run.error is not None:
                        readers.free.append(slot)
                        if run.inflight == 0:
                            done_runs.append(run)
                        continue
                    run.received[k] = (slot, result)
                    try:
                        consume(run)
                    except Exception as exc:  # noqa: BLE001 - a model error fails this slide only
                        run.error = exc
                    if run.complete or (run.error is not None and run.inflight == 0):
                        done_runs.append(run)
                if broken:
                    done_runs += _fail_broken(active, futures, readers)
            for run in dict.fromkeys(done_runs):
                if run in active:
                    yield finished(run)
    finally:
        readers.close()


def _fail_broken(active: list[_Run], futures: dict, readers: _Readers) -> list[_Run]:
    """A reader died (a crash in the slide library, or out of memory): fail the slides it may have been
    reading, start a new pool for the rest."""
    hit = [r for r in active if r.inflight > 0 or r.planning or r.received]
    for run in hit:
        run.error = run.error or RuntimeError(
            f"{run.job.slide_path or run.job.store_path}: a reader process died while reading this slide (a crash "
            "in the slide library or out of memory). Fix: check the file with `wsi-milssl info`, or run with "
            "fewer --workers.")
        run.inflight, run.planning = 0, False
        run.received.clear()
    futures.clear()
    readers.restart()
    return hit


def _result(result_type: type[SlideOutputs], plan: JobPlan, idx: np.ndarray, outputs: np.ndarray, *,
            seconds: float) -> SlideOutputs:
    job = plan.job
    return result_type(
        stem=job.stem, slide_path=plan.slide_path, source=plan.source, coords_lv0=plan.coords_lv0[idx], outputs=outputs,
        origin_lv0=plan.origin_lv0, stride_lv0=plan.stride_lv0, patch_size_lv0=plan.patch_size_lv0,
        patch_size_px=plan.patch_size_px, target_mpp=plan.target_mpp, mpp=plan.mpp,
        dimensions_lv0=plan.dimensions_lv0, grid_shape=plan.grid_shape, n_candidates=plan.n_candidates,
        store_path=job.store_path, tissue=plan.tissue, tissue_detector=plan.tissue_detector, mask_mpp=plan.mask_mpp,
        seconds=seconds, geometry=plan.geometry,
    )


def _predict_one(item: SlideInput, model: InferenceModel, config: HeatmapConfig | None,
                 progress: ProgressCallback | None) -> SlidePrediction:
    for _, outcome in predict_many([item], model, config=config, progress=progress):
        if isinstance(outcome, Exception):
            raise outcome
        return outcome
    raise AssertionError("predict_many yielded nothing for one input")  # pragma: no cover


def predict_slide(slide_path, model: InferenceModel, *, config: HeatmapConfig | None = None,
                  progress: ProgressCallback | None = None) -> SlidePrediction:
    """Cut ``slide_path`` on the fly with ``model.plan`` and predict every kept patch (the cells the
    tile stage stores for the same plan)."""
    path = Path(slide_path)
    return _predict_one(SlideInput(slide_stem(path), path, None), model, config, progress)


def predict_store(store_path, model: InferenceModel, *, config: HeatmapConfig | None = None,
                  progress: ProgressCallback | None = None) -> SlidePrediction:
    """Predict every patch of an existing patch store.

    Raises StoreError when the store holds no pixels or its coordinates are off its grid, and
    ConfigError when it was tiled at another resolution or patch size than the model was trained on.
    """
    from wsi_milssl.store import open_store

    path = Path(store_path)
    with open_store(path) as store:
        stem = store.stem
    return _predict_one(SlideInput(stem, None, path), model, config, progress)
