"""The training data path: block-shuffled order, one pool of readers for a whole run, batches that do
not depend on workers, item size or where JPEG is decoded."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from wsi_milssl.config.train import TrainConfig
from wsi_milssl.errors import ConfigError
from wsi_milssl.mil import fit, read_labels_csv, read_patch_stores
from wsi_milssl.mil.loader import BatchLoader, block_order
from wsi_milssl.store import open_store


@pytest.fixture(scope="module")
def instances(tmp_path_factory, image_store_factory):
    paths, labels = image_store_factory(tmp_path_factory.mktemp("loader"), n_bags=4, n_patches=40)
    return read_patch_stores(paths, read_labels_csv(labels))


def test_block_order_keeps_runs_of_a_store_together(instances):
    order = block_order(instances, torch.Generator().manual_seed(0), block_size=8).numpy()
    assert sorted(order.tolist()) == list(range(len(instances)))  # every instance once
    bags, local = instances.bag_ids[order], instances.local_index[order]
    blocks = bags * 1000 + local // 8
    # each block's 8 patches sit in 8 consecutive positions, shuffled inside the block
    for start in range(0, len(order), 8):
        assert len(set(blocks[start:start + 8].tolist())) == 1
    assert not np.array_equal(local[:8], np.sort(local[:8])) or not np.array_equal(local[8:16], np.sort(local[8:16]))
    again = block_order(instances, torch.Generator().manual_seed(0), block_size=8).numpy()
    other = block_order(instances, torch.Generator().manual_seed(1), block_size=8).numpy()
    assert np.array_equal(order, again) and not np.array_equal(order, other)
    plain = block_order(instances, torch.Generator().manual_seed(3), block_size=1)
    assert torch.equal(plain, torch.randperm(len(instances), generator=torch.Generator().manual_seed(3)))


def test_block_order_with_a_ragged_last_block(instances):
    order = block_order(instances, torch.Generator().manual_seed(0), block_size=7).numpy()
    assert sorted(order.tolist()) == list(range(len(instances)))
    bags, local = instances.bag_ids[order], instances.local_index[order]
    blocks = list(zip(bags.tolist(), (local // 7).tolist()))
    runs = [b for i, b in enumerate(blocks) if i == 0 or b != blocks[i - 1]]
    assert len(runs) == len(set(runs)) == 4 * 6  # 40 patches per store: 5 blocks of 7 and one of 5


def _all_batches(loader, inst, order, batch_size):
    return [(i.clone(), x.clone()) for i, x in loader.batches(inst, order, batch_size=batch_size)]


def test_batches_do_not_depend_on_workers_or_item_size(instances):
    order = block_order(instances, torch.Generator().manual_seed(0), block_size=4)
    with BatchLoader([instances], num_workers=0) as loader:
        ref = _all_batches(loader, instances, order, 24)
    # items of 5 patches (rebatched into 24) read by 2 persistent workers, for two passes
    with BatchLoader([instances], num_workers=2, item_bytes=5 * 32 * 32 * 3) as loader:
        first = _all_batches(loader, instances, order, 24)
        second = _all_batches(loader, instances, order, 24)
    for got in (first, second):
        assert [len(i) for i, _ in got] == [24] * 6 + [16]
        for (ia, xa), (ib, xb) in zip(ref, got):
            assert torch.equal(ia, ib) and torch.equal(xa, xb)
    i0, x0 = ref[0]
    bag, local = int(instances.bag_ids[i0[3]]), int(instances.local_index[i0[3]])
    with open_store(instances.store_paths[bag]) as store:
        assert np.array_equal(x0[3].numpy(), store.read_patches([local])[0])


def test_an_abandoned_pass_and_a_nested_pass_leave_the_readers_usable(instances):
    order = torch.arange(len(instances))
    with BatchLoader([instances], num_workers=2) as loader:
        ref = _all_batches(loader, instances, order, 16)
        stream = loader.batches(instances, order, batch_size=16)
        next(stream)
        nested = _all_batches(loader, instances, order.flip(0), 16)  # while the outer pass is open
        rest = [(i, x.clone()) for i, x in stream]
        assert all(torch.equal(a[1], b[1]) for a, b in zip(ref[1:], rest))
        assert torch.equal(torch.cat([i for i, _ in nested]), order.flip(0))
        stream = loader.batches(instances, order, batch_size=16)
        next(stream)
        stream.close()  # abandoned after one batch
        again = _all_batches(loader, instances, order, 16)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(ref, again))


def test_device_decode_gives_the_readers_pixels(instances):
    order = torch.arange(60)
    with BatchLoader([instances], num_workers=0) as loader:
        ref = _all_batches(loader, instances, order, 32)
    with BatchLoader([instances], num_workers=1, decode="device") as loader:
        got = _all_batches(loader, instances, order, 32)
    for (ia, xa), (ib, xb) in zip(ref, got):
        assert torch.equal(ia, ib) and xb.dtype == torch.uint8 and xb.shape == xa.shape
        # libjpeg-turbo in both; allow the last bit for other IDCTs (nvJPEG on a GPU)
        assert (xa.int() - xb.int()).abs().max() <= 1


def test_unknown_decode_is_refused():
    with pytest.raises(ConfigError, match="decode must be one of workers, device"):
        BatchLoader([], decode="gpu")
    with pytest.raises(ConfigError, match="TrainConfig.decode"):
        TrainConfig(decode="gpu")


def test_one_pool_of_readers_serves_every_pass_and_the_result_does_not_depend_on_workers(
        tmp_path, instances, monkeypatch):
    made = []
    original = BatchLoader._make_loader

    def counting(self, reader, sampler, *, persistent):
        made.append(persistent)
        return original(self, reader, sampler, persistent=persistent)

    monkeypatch.setattr(BatchLoader, "_make_loader", counting)
    # 2 epochs: the second epoch's passes are the ones a non-persistent loader would make again
    cfg = dict(mode="images", epochs=2, batch_size=16, eval_batch_size=32, threads=1, mu=0.25,
               mu_ramp_epochs=1, plots=False, shuffle_block=4)
    two = fit(instances, config=TrainConfig(num_workers=2, **cfg), val=instances)
    # training, refresh and validation passes of 2 epochs: one persistent DataLoader
    assert made == [True]
    # the same run read in the training process: equal weights and losses (a second 2-worker run was dropped:
    # a 2-worker run that differed from run to run could not equal the one 0-worker run)
    none = fit(instances, config=TrainConfig(num_workers=0, **cfg), val=instances)
    a, b = two.model.state_dict(), none.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [h["loss"] for h in two.history] == [h["loss"] for h in none.history]
    assert len(two.history) == 2


@pytest.mark.gpu
def test_cuda_batches_from_pinned_memory_and_nvjpeg_match_the_cpu(instances):
    # deselected by default (pyproject addopts); run on a GPU machine with: pytest -m gpu
    assert torch.cuda.is_available(), "the gpu marker needs a CUDA device"
    order = block_order(instances, torch.Generator().manual_seed(0), block_size=4)
    with BatchLoader([instances], num_workers=0) as loader:
        ref = _all_batches(loader, instances, order, 32)
    for decode in ("workers", "device"):
        with BatchLoader([instances], num_workers=2, device="cuda", decode=decode) as loader:
            got = _all_batches(loader, instances, order, 32)
        assert len(got) == len(ref)
        for (ia, xa), (ib, xb) in zip(ref, got):
            assert xb.device.type == "cuda" and torch.equal(ia, ib) and xb.shape == xa.shape
            diff = (xa.int() - xb.cpu().int()).abs().float()
            if decode == "workers":
                assert diff.max() == 0
            else:
                # nvJPEG is another conforming decoder than libjpeg-turbo (PIL): its IDCT and chroma
                # upsampling differ. On an H100 (2026-11): mean 2.37 levels, max 30 on these noisy
                # patches; mean 1.11, max 23 on the stored patches of generated slides
                # (benchmarks/nvjpeg_vs_pil.py). A swapped channel order, a transposed or shifted
                # patch would be off by tens of levels on average.
                assert diff.mean() <= 4.0, f"mean |nvJPEG - PIL| {diff.mean():.2f} levels"


@pytest.mark.parametrize("signame", ["SIGKILL", "SIGBUS"])
def test_a_reader_killed_during_training_is_one_error_naming_the_resume(tmp_path, instances, signame):
    """Review BJ: a reader process killed (the out-of-memory killer) gave torch's raw RuntimeError traceback, with
    no word of what to do; it is one ReaderLostError naming the checkpoint kept and `train --resume`."""
    import multiprocessing
    import os
    import signal

    from wsi_milssl.errors import ReaderLostError

    def kill_a_reader(event):
        if event.stage == "train" and event.unit == "epoch" and event.done == 1:
            readers = multiprocessing.active_children()  # the persistent pool of the first epoch
            assert len(readers) == 2
            os.kill(readers[0].pid, getattr(signal, signame))

    cfg = TrainConfig(mode="images", epochs=3, batch_size=16, eval_batch_size=32, threads=1, mu=0.25,
                      mu_ramp_epochs=1, plots=False, num_workers=2)
    out = tmp_path / "run"
    # torch names the signal when its watchdog sees it (a bus error: a full /dev/shm), else "exited unexpectedly"
    cause = (r"\), most likely stopped by the out-of-memory killer \(see `dmesg`\) or by a full /dev/shm \(a bus "
             r"error; `df -h /dev/shm`\)" if signame == "SIGKILL" else
             r"(\): the shared memory .*/dev/shm.* is full; .*--shm-size.*|\), most likely .* by a full /dev/shm .*)")
    with pytest.raises(ReaderLostError, match=(
            r"^a reader process of training stopped \(DataLoader worker \(pid.*\d+\) (is killed|exited).*" + cause
            + rf"; {re.escape(str(out))} keeps the checkpoint of the last finished epoch\. Fix: train with fewer "
            r"--workers .* then "
            r"continue with `wsi-milssl train --resume")):
        fit(instances, config=cfg, out_dir=out, progress=kill_a_reader)
    assert (out / "last.pt").is_file()


def test_data_workers_end_when_the_trainer_is_killed(tmp_path, image_store_factory):
    """Review EV, C1: after `kill -9` of a training process its data workers lived on until torch's own check
    (about 5 s), holding the run folder's lock: a run started again at once was refused, naming a process gone.
    They watch the trainer now and end with it (in milliseconds; the bound below is torch's 5 s less a margin)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    paths, labels = image_store_factory(tmp_path, n_bags=2, n_patches=40)
    script = (
        "import multiprocessing, sys, time, torch\n"
        "from wsi_milssl.mil import read_labels_csv, read_patch_stores\n"
        "from wsi_milssl.mil.loader import BatchLoader\n"
        f"inst = read_patch_stores({[str(p) for p in paths]!r}, read_labels_csv({str(labels)!r}))\n"
        "loader = BatchLoader([inst], num_workers=2).__enter__()\n"
        "stream = loader.batches(inst, torch.arange(len(inst)), batch_size=8)\n"
        "next(stream)\n"
        "print(' '.join(str(p.pid) for p in multiprocessing.active_children()), flush=True)\n"
        "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) == 2, workers
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    killed = time.monotonic()

    def alive(pid) -> bool:
        try:
            with open(f"/proc/{pid}/status") as fh:
                return "\nState:\tZ" not in fh.read()
        except OSError:
            return False

    while any(alive(p) for p in workers) and time.monotonic() - killed < 30:
        time.sleep(0.02)
    assert not any(alive(p) for p in workers)
    assert time.monotonic() - killed < 4.0
