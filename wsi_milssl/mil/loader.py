"""Batches for a whole training run: one set of reader processes, sequential reads, pinned copies.

:class:`BatchLoader` serves every pass of a run (training passes, pseudo-label refreshes, validation,
all epochs) from one ``torch.utils.data.DataLoader`` whose worker processes live until the loader is
closed (``persistent_workers``): a pass hands the workers a new plan of items instead of starting new
processes. An item is a run of at most :data:`ITEM_BYTES` of patches, decoded by a worker (or, with
``decode='device'``, the JPEG bytes, decoded on the training device in batches by
``torchvision.io.decode_jpeg``: nvJPEG on CUDA); items come back in order, are copied from pinned
memory without blocking, and are joined into batches on the device. Results therefore do not depend on
the worker count or the item size.

Training order (:func:`block_order`): the instances of each bag (slide) are cut into blocks of
``block_size`` consecutive patches in store order; blocks are shuffled, and so are the patches inside
each block. A batch of 64 with blocks of 16 then reads four runs of neighbouring patches (four slice
reads) instead of 64 scattered ones. The effect on randomness: patches of one block always share a
batch (or two neighbouring batches) within an epoch, so a batch holds fewer slides and spatially
correlated patches; every patch is still seen once per epoch, block membership and order change
every epoch (the blocks' boundaries do not), and ``block_size = 1`` gives a uniformly random
permutation.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
from typing import Iterator

import numpy as np
import torch

from wsi_milssl import shm as shm_rules
from wsi_milssl.errors import ConfigError, ReaderLostError
from wsi_milssl.mil.data import InstanceSet, PatchDataset
from wsi_milssl.runtime import decode_jpeg_batch, require_device_decode

__all__ = ["ITEM_BYTES", "DECODE_CHOICES", "BatchLoader", "block_order", "without_lone_last", "normalises_batches"]

log = logging.getLogger(__name__)

#: Decoded bytes per worker item: bounds the memory in flight to about
#: ``workers x prefetch x ITEM_BYTES`` whatever the batch and patch size.
ITEM_BYTES = 16 << 20
#: Where stored JPEG patches are decoded.
DECODE_CHOICES = ("workers", "device")
_PREFETCH = 4


def block_order(instances: InstanceSet, generator: torch.Generator, *, block_size: int) -> torch.Tensor:
    """int64 (N,): a random order of all instances in which runs of ``block_size`` consecutive patches of
    one bag stay together (shuffled blocks, shuffled within each block; see the module docstring).

    ``block_size = 1`` is ``torch.randperm(N, generator=generator)``. Feature instances have no reading
    cost and always get a plain permutation.
    """
    n = len(instances)
    if block_size <= 1 or instances.kind != "images" or n == 0:
        return torch.randperm(n, generator=generator)
    local = instances.local_index if instances.local_index is not None else np.arange(n)
    by_store = np.lexsort((local, instances.bag_ids))  # instance indices in (bag, store index) order
    bags = instances.bag_ids[by_store]
    starts = np.flatnonzero(np.r_[True, bags[1:] != bags[:-1]])
    run_start = np.repeat(starts, np.diff(np.r_[starts, n]))
    block_in_bag = (np.arange(n) - run_start) // block_size
    new_block = np.r_[True, (bags[1:] != bags[:-1]) | (block_in_bag[1:] != block_in_bag[:-1])]
    block_id = np.cumsum(new_block) - 1  # (N,) in by_store order
    n_blocks = int(block_id[-1]) + 1
    rank = torch.empty(n_blocks, dtype=torch.int64)
    rank[torch.randperm(n_blocks, generator=generator)] = torch.arange(n_blocks)
    keys = torch.rand(n, generator=generator).numpy()
    order = np.lexsort((keys, rank.numpy()[block_id]))
    return torch.from_numpy(by_store[order].astype(np.int64))


def without_lone_last(order: torch.Tensor, *, batch_size: int, world_size: int = 1) -> torch.Tensor:
    """``order`` (an epoch's global instance order) without its last, smaller global batch when that batch
    would give some rank a training batch of one instance, which BatchNorm cannot normalise in training mode
    ("Expected more than 1 value per channel when training").

    The ranks' steps together are the steps of one process with batch ``batch_size x world_size``
    (:func:`wsi_milssl.distributed.rank_share`), whose last global batch of t instances is split evenly,
    the smallest piece holding t // world_size; so the t instances after the last full global batch are
    dropped when 0 < t < 2 x world_size (one process: a last batch of one instance). Decided on the global
    order, before the ranks' split, so every rank takes the same steps; the order changes every epoch, so
    no instance is left out for long."""
    n = int(order.numel())
    tail = n % (batch_size * world_size)
    if 0 < tail < 2 * world_size:
        return order[:n - tail]
    return order


def normalises_batches(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds BatchNorm layers (which need two or more instances per training batch)."""
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


class _Plan(torch.utils.data.Sampler):
    """The items of the current pass; replaced before each pass (the DataLoader re-reads it)."""

    def __init__(self) -> None:
        self.items: list[tuple[int, np.ndarray]] = []

    def __iter__(self):
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


class _Reader(torch.utils.data.Dataset):
    """Item ``(set_number, indices)`` -> ``(indices int64 (B,), pixels uint8 (B, H, W, 3))``, or with
    ``encoded`` JPEG stores ``(indices, [uint8 (n_bytes,) per patch])``."""

    def __init__(self, datasets: dict[int, PatchDataset], *, encoded: bool) -> None:
        self.datasets = datasets
        self.encoded = encoded

    def __len__(self) -> int:
        return 0  # only ever indexed through the plan

    def __getitem__(self, item):
        key, idx = item
        return self.datasets[key].fetch(idx, encoded=self.encoded)

    def close(self) -> None:
        for ds in self.datasets.values():
            ds.close()


class BatchLoader:
    """Batches of instance sets for a whole run from one pool of reader processes.

    Parameters
    ----------
    sets : the instance sets this loader serves (training, validation); others passed to
        :meth:`batches` are read by a temporary pool.
    num_workers : reader processes (0 reads in the calling process).
    device : where batches are delivered (features, pixels, decoded JPEG).
    decode : 'workers' (decode in the readers) or 'device' (JPEG bytes decoded on ``device`` with
        ``torchvision.io.decode_jpeg``; stores of raw pixels are decoded by the readers regardless).
    item_bytes : decoded bytes per reader item (see :data:`ITEM_BYTES`).

    Use as a context manager, or call :meth:`close`, to stop the readers.
    """

    def __init__(self, sets: list[InstanceSet], *, num_workers: int = 0, device: torch.device | str = "cpu",
                 decode: str = "workers", item_bytes: int = ITEM_BYTES) -> None:
        if decode not in DECODE_CHOICES:
            raise ConfigError(f"decode must be one of {', '.join(DECODE_CHOICES)}; got {decode!r}.")
        self.device = torch.device(device)
        self.num_workers = int(num_workers)
        self.decode = decode
        self.item_bytes = int(item_bytes)
        self._sets: dict[int, InstanceSet] = {id(s): s for s in sets if s is not None}
        self._features: dict[int, torch.Tensor] = {}
        self._busy = False
        self._loader: torch.utils.data.DataLoader | None = None
        self._plan = _Plan()
        if decode == "device":
            require_device_decode(owner="TrainConfig")
        images = {k: PatchDataset(s) for k, s in self._sets.items() if s.kind == "images"}
        self._reader = _Reader(images, encoded=decode == "device")

    # -- public ---------------------------------------------------------------------------------
    def batches(self, instances: InstanceSet, order, *, batch_size: int
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield ``(indices int64 (B,) on the CPU, inputs on the device)`` over ``order`` (instance
        indices) in batches of ``batch_size`` (the last one smaller): float32 (B, D) features or uint8
        (B, H, W, 3) RGB pixels."""
        order = torch.as_tensor(np.asarray(order), dtype=torch.int64).reshape(-1)
        if instances.kind == "features":
            yield from self._feature_batches(instances, order, batch_size)
            return
        per_item = self._item_patches(instances, batch_size)
        items = [order[i:i + per_item] for i in range(0, order.numel(), per_item)]
        yield from _rebatch(self._items(instances, items), batch_size)

    def close(self) -> None:
        """Stop the reader processes and close this process's store handles."""
        loader, self._loader = self._loader, None
        if loader is not None:
            iterator = getattr(loader, "_iterator", None)
            if iterator is not None:
                iterator._shutdown_workers()
        self._reader.close()

    def __enter__(self) -> "BatchLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------
    def _feature_batches(self, instances: InstanceSet, order: torch.Tensor, batch_size: int):
        feats = self._features.get(id(instances))
        if feats is None:
            feats = torch.from_numpy(instances.features).to(self.device)
            if id(instances) in self._sets:
                self._features[id(instances)] = feats
        order_dev = order.to(self.device)
        for i in range(0, order.numel(), batch_size):
            yield order[i:i + batch_size], feats[order_dev[i:i + batch_size]]

    def _item_patches(self, instances: InstanceSet, batch_size: int) -> int:
        side = int(instances.settings.get("patch_size_px") or 256)
        return max(1, min(batch_size, self.item_bytes // (side * side * 3)))

    def _items(self, instances: InstanceSet, items: list[torch.Tensor]):
        """Yield (indices, pixels on the device) per item, in order."""
        key = id(instances)
        temporary = key not in self._sets
        reader = self._reader
        if temporary:
            reader = _Reader({key: PatchDataset(instances)}, encoded=self.decode == "device")
        plan = [(key, i.numpy()) for i in items]
        if self.num_workers > 0 and plan:
            self._check_shared_memory(instances, max(len(i) for _, i in plan))
        try:
            if self.num_workers <= 0:
                for item in plan:
                    idx, raw = reader[item]
                    yield idx, self._to_device(raw)
                return
            yield from self._from_readers(reader, plan, temporary)
        finally:
            if temporary:
                reader.close()

    def _from_readers(self, reader: _Reader, plan: list, temporary: bool):
        """:meth:`_items` from the reader processes; one that dies (the out-of-memory killer, a kill) is a
        ReaderLostError, not torch's RuntimeError (review BJ: a raw traceback without a word of what to do)."""
        try:
            if temporary or self._busy:  # a nested pass (a refresh inside a training pass): own readers
                sampler = _Plan()
                sampler.items = plan
                loader = self._make_loader(reader, sampler, persistent=False)
                for idx, raw in loader:
                    yield idx, self._to_device(raw)
            else:
                self._busy = True
                try:
                    if self._loader is None:
                        self._loader = self._make_loader(reader, self._plan, persistent=True)
                    self._plan.items = plan
                    for idx, raw in self._loader:
                        yield idx, self._to_device(raw)
                finally:
                    self._busy = False
        except RuntimeError as exc:
            text = str(exc)
            if "DataLoader worker" not in text or not ("killed by signal" in text or "exited unexpectedly" in text):
                raise
            first = text.splitlines()[0].strip()
            if "bus error" in text.lower():  # (review BL) a write into a full /dev/shm
                raise ReaderLostError(f"a reader process of training stopped ({first}): the shared memory the "
                                      "readers hand their batches through (/dev/shm, `df -h /dev/shm`) is full; a "
                                      "container's is 64 MB unless `docker run --shm-size 8g` or `--ipc=host` gives "
                                      "more") from None
            raise ReaderLostError(f"a reader process of training stopped ({first}), most likely stopped by the "
                                  "out-of-memory killer (see `dmesg`) or by a full /dev/shm (a bus error; "
                                  "`df -h /dev/shm`)") from None

    def _check_shared_memory(self, instances: InstanceSet, item_patches: int) -> None:
        """The workers pass their items to this process through /dev/shm, ``prefetch`` items each at once: with
        less free there (a container's 64 MB), a worker's item fails in its queue thread and the training waits
        for it forever. Raises OutputError naming the bytes needed and the fix instead (decoded pixels; stored
        JPEG bytes, ``decode = "device"``, are smaller and not checked)."""
        if self.decode == "device":
            return
        side = int(instances.settings.get("patch_size_px") or 256)
        need = self.num_workers * _PREFETCH * item_patches * side * side * 3
        free = shm_rules.free_bytes()
        if free is not None and free < need:
            raise shm_rules.shm_error(
                f"too little shared memory for the training data workers: {self.num_workers} workers x {_PREFETCH} "
                f"items of {item_patches} patches of {side} px need {shm_rules.mib(need)}, {shm_rules.mib(free)} are "
                "free", errno.ENOSPC, fewer="or train with fewer --workers (0: read in the training process)")

    def _make_loader(self, reader: _Reader, sampler: _Plan, *, persistent: bool) -> torch.utils.data.DataLoader:
        if self.num_workers > 0:  # its workers hand batches over through sockets below TMPDIR
            from wsi_milssl.sockets import fit_socket_paths

            fit_socket_paths()
        return torch.utils.data.DataLoader(
            reader, batch_size=None, sampler=sampler, num_workers=self.num_workers,
            persistent_workers=persistent, prefetch_factor=_PREFETCH,
            pin_memory=self.device.type == "cuda",
            worker_init_fn=functools.partial(_end_with_trainer, os.getpid()) if self.num_workers > 0 else None,
        )

    def _to_device(self, raw) -> torch.Tensor:
        if isinstance(raw, (list, tuple)):  # JPEG bytes: decode on the device in one call
            return decode_jpeg_batch(list(raw), self.device)
        return raw.to(self.device, non_blocking=True)


def _end_with_trainer(main_pid: int, worker_id: int) -> None:
    """A data worker ends as soon as the training process is gone (:func:`wsi_milssl.parent_watch.watch_parent`):
    after a ``kill -9`` torch's own check took about 5 s, and the orphans held the run folder's lock meanwhile, so a
    run started again at once was refused naming a process that no longer existed (review EV)."""
    from wsi_milssl.parent_watch import watch_parent

    watch_parent(main_pid)


def _rebatch(stream, batch_size: int):
    """Join consecutive (indices, pixels) items into batches of exactly ``batch_size`` (the last one
    smaller); items are never larger than a batch."""
    idx_parts: list[torch.Tensor] = []
    x_parts: list[torch.Tensor] = []
    n = 0
    for idx, x in stream:
        idx_parts.append(idx)
        x_parts.append(x)
        n += int(idx.numel())
        if n >= batch_size:
            idx_all = idx_parts[0] if len(idx_parts) == 1 else torch.cat(idx_parts)
            x_all = x_parts[0] if len(x_parts) == 1 else torch.cat(x_parts)
            yield idx_all[:batch_size], x_all[:batch_size]
            n -= batch_size
            idx_parts, x_parts = ([idx_all[batch_size:]], [x_all[batch_size:]]) if n else ([], [])
    if n:
        yield (idx_parts[0], x_parts[0]) if len(idx_parts) == 1 else (torch.cat(idx_parts), torch.cat(x_parts))

