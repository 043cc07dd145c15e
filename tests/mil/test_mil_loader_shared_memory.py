"""Review AZ, B1: training's data workers pass their items through /dev/shm. In a container with Docker's 64 MB
there (no --shm-size / --ipc=host), a worker's item failed in its queue thread ("unable to allocate shared
memory") and `train` waited for it forever, with 2 workers and 512-px patches. The loader now checks the free
space before it starts its workers and stops with one error naming the bytes and the fix, as the readers of
heatmap and features do."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wsi_milssl import shm as shm_rules
from wsi_milssl.errors import OutputError
from wsi_milssl.mil import read_labels_csv, read_patch_stores
from wsi_milssl.mil.loader import BatchLoader


@pytest.fixture
def instances(tmp_path, image_store_factory):
    paths, labels = image_store_factory(tmp_path / "stores", n_bags=2, n_patches=24, size_px=64)
    return read_patch_stores(paths, read_labels_csv(labels))


def test_too_little_shared_memory_for_the_workers_is_one_clear_error(instances, monkeypatch):
    monkeypatch.setattr(shm_rules, "free_bytes", lambda: 1 << 20)
    order = torch.arange(len(instances))
    with BatchLoader([instances], num_workers=2) as loader:
        with pytest.raises(OutputError) as caught:
            next(loader.batches(instances, order, batch_size=16))
    # 2 workers x 4 items x 16 patches x 64 x 64 x 3 bytes = 1.5 MiB
    assert str(caught.value) == (
        "/dev/shm: too little shared memory for the training data workers: 2 workers x 4 items of 16 patches of 64 px "
        "need 1.5 MiB, 1.0 MiB are free. Fix: give the container more shared memory (`docker run --shm-size=16g`, or "
        "`--ipc=host`) or free /dev/shm (`df -h /dev/shm`), or train with fewer --workers (0: read in the training "
        "process).")


def test_enough_shared_memory_or_no_workers_reads_as_before(instances, monkeypatch):
    order = torch.arange(len(instances))
    with BatchLoader([instances], num_workers=0) as loader:
        serial = [idx.numpy() for idx, _ in loader.batches(instances, order, batch_size=16)]
    monkeypatch.setattr(shm_rules, "free_bytes", lambda: 2 << 20)  # 1.5 MiB needed
    with BatchLoader([instances], num_workers=2) as loader:
        parallel = [idx.numpy() for idx, _ in loader.batches(instances, order, batch_size=16)]
    assert np.array_equal(np.concatenate(serial), np.concatenate(parallel))
