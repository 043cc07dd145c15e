"""Image mode on real patch stores (HDF5 and Zarr): batched reads in workers, ResNet18 training with
bf16 autocast + channels_last on the CPU, checkpoints that carry the tiling settings, exact resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wsi_milssl.config.train import TrainConfig
from wsi_milssl.errors import ConfigError, StoreError
from wsi_milssl.events import ProgressEvent
from wsi_milssl.mil import fit, load_model, read_labels_csv, read_patch_stores, to_tensor
from wsi_milssl.mil.data import PatchDataset, iterate_batches
from wsi_milssl.mil.selftrain import evaluate, resolve_runtime
from wsi_milssl.store import open_store


@pytest.fixture(scope="module", params=["h5", "zarr"])
def stores(request, tmp_path_factory, image_store_factory):
    paths, labels = image_store_factory(tmp_path_factory.mktemp(f"img_{request.param}"), fmt=request.param)
    return paths, labels


def _cfg(**kw) -> TrainConfig:
    base = dict(mode="images", epochs=2, batch_size=16, eval_batch_size=64, num_workers=0, threads=1,
                mu=0.25, mu_ramp_epochs=1, plots=False)
    base.update(kw)
    return TrainConfig(**base)


def test_read_patch_stores_indexes_without_reading_pixels(stores):
    paths, labels_csv = stores
    inst = read_patch_stores(paths, read_labels_csv(labels_csv))
    assert inst.kind == "images" and len(inst) == 4 * 48 and inst.n_bags == 4
    assert inst.bag_labels.tolist() == [0, 1, 0, 1]
    assert inst.instance_labels is not None and inst.instance_labels.sum() == 24
    assert inst.settings["patch_size_px"] == 32 and inst.settings["target_mpp"] == 1.0
    assert inst.settings["entropy_threshold_bits"] == 5.0


def test_patch_batches_match_store_reads_with_and_without_workers(stores):
    paths, labels_csv = stores
    inst = read_patch_stores(paths, read_labels_csv(labels_csv))
    order = np.random.default_rng(0).permutation(len(inst))[:70]
    a = list(iterate_batches(inst, order, batch_size=16, num_workers=0))
    b = list(iterate_batches(inst, order, batch_size=16, num_workers=2))
    assert len(a) == len(b) == 5
    for (ia, xa), (ib, xb) in zip(a, b):
        assert torch.equal(ia, ib) and torch.equal(xa, xb)
        assert xa.dtype == torch.uint8 and xa.shape[1:] == (32, 32, 3)
    # the batch holds exactly what the store returns for those indices
    i0, x0 = a[0]
    bag = int(inst.bag_ids[i0[0]])
    with open_store(paths[bag]) as store:
        expected = store.read_patches([int(inst.local_index[i0[0]])])[0]
    assert np.array_equal(x0[0].numpy(), expected)


def test_train_resume_and_load_model(tmp_path, image_store_factory):
    paths, labels_csv = image_store_factory(tmp_path / "stores", n_patches=8, pixels="raw")
    inst = read_patch_stores(paths, read_labels_csv(labels_csv))
    cfg = _cfg()
    runtime = resolve_runtime(cfg)
    assert runtime.amp_dtype is torch.bfloat16 and runtime.channels_last  # the CPU fast path
    full = fit(inst, config=cfg, out_dir=tmp_path / "full", val=inst)

    def kill(event: ProgressEvent) -> None:
        if event.stage == "train" and event.done == 1 and event.item:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fit(inst, config=cfg, out_dir=tmp_path / "cut", val=inst, progress=kill)
    resumed = fit(inst, config=cfg, out_dir=tmp_path / "cut", val=inst, resume=True)
    a, b = full.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)

    model, config = load_model(tmp_path / "full" / "last.pt")
    assert config["patch_size_px"] == 32 and config["target_mpp"] == 1.0
    assert config["entropy_threshold_bits"] == 5.0 and config["model_name"] == "resnet18"
    assert config["normalisation"]["mean"] == pytest.approx([0.485, 0.456, 0.406])
    with open_store(paths[1]) as store:
        x = to_tensor(store.read_patches(np.arange(8)))
    assert x.dtype == torch.float32 and x.shape == (8, 3, 32, 32)
    with torch.no_grad():
        probs = torch.softmax(model(x), 1)[:, 1].numpy()
    reference = evaluate(full.model, inst, runtime=resolve_runtime(_cfg(amp="off")))["probs"]
    start = int(np.flatnonzero(inst.bag_ids == 1)[0])
    np.testing.assert_allclose(probs, reference[start:start + 8], atol=1e-4)


def test_stores_without_pixels_or_labels_are_rejected(tmp_path, stores, image_store_factory):
    paths, labels_csv = stores
    with pytest.raises(ConfigError, match="has no row in"):
        read_patch_stores(paths, {"slide_0_00": 0}, labels_path="my_labels.csv")
    none_paths, _ = image_store_factory(tmp_path / "none", n_bags=2, n_patches=4, pixels="none")
    with pytest.raises(StoreError, match="holds no patch pixels"):
        read_patch_stores(none_paths, {"slide_0_00": 0, "slide_0_01": 1})


def test_patch_dataset_reopens_stores_after_fork(stores):
    paths, labels_csv = stores
    inst = read_patch_stores(paths, read_labels_csv(labels_csv))
    ds = PatchDataset(inst)
    ds[[0, 1]]
    state = ds.__getstate__()
    assert state["_stores"] == {} and state["_pid"] is None  # no open handle crosses a pickle/fork
    ds.close()


@pytest.mark.gpu
def test_cuda_training_uses_autocast_and_its_checkpoint_loads_on_the_cpu(tmp_path, image_store_factory):
    # deselected by default (pyproject addopts); run on a GPU machine with: pytest -m gpu
    assert torch.cuda.is_available(), "the gpu marker needs a CUDA device"
    paths, labels_csv = image_store_factory(tmp_path / "stores", n_patches=8, pixels="raw")
    inst = read_patch_stores(paths, read_labels_csv(labels_csv))
    cfg = _cfg(device="cuda", amp="auto", num_workers=2)
    runtime = resolve_runtime(cfg)
    assert runtime.device.type == "cuda" and runtime.amp_dtype in (torch.bfloat16, torch.float16)
    result = fit(inst, config=cfg, out_dir=tmp_path / "gpu", val=inst)
    assert next(result.model.parameters()).device.type == "cuda"
    gpu_probs = evaluate(result.model, inst, runtime=runtime)["probs"]
    model, _ = load_model(tmp_path / "gpu" / "last.pt")  # weights_only load onto the CPU
    assert next(model.parameters()).device.type == "cpu"
    cpu_probs = evaluate(model, inst, runtime=resolve_runtime(_cfg(amp="off", device="cpu")))["probs"]
    np.testing.assert_allclose(cpu_probs, gpu_probs, atol=2e-2)
    assert np.isfinite(cpu_probs).all() and np.std(cpu_probs) > 0


@pytest.mark.gpu
def test_cuda_training_with_device_decode_stays_finite(tmp_path, image_store_factory):
    # deselected by default (pyproject addopts); run on a GPU machine with: pytest -m gpu
    # nvJPEG's hardware decoder once overwrote memory that queued kernels still read: the first
    # refresh of `bench_train.py --decode device` got NaN probabilities on an H100 (2026-11).
    assert torch.cuda.is_available(), "the gpu marker needs a CUDA device"
    paths, labels_csv = image_store_factory(tmp_path / "stores", n_bags=6, n_patches=96, size_px=64)
    inst = read_patch_stores(paths, read_labels_csv(labels_csv))
    cfg = _cfg(device="cuda", amp="auto", num_workers=2, decode="device", epochs=3, eval_batch_size=128)
    result = fit(inst, config=cfg, val=inst)
    assert all(np.isfinite(h["loss"]) for h in result.history)
    probs = evaluate(result.model, inst, runtime=resolve_runtime(cfg))["probs"]
    assert np.isfinite(probs).all() and ((probs >= 0) & (probs <= 1)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_cuda_compiled_training_step_trains_and_saves_the_plain_model(tmp_path, image_store_factory, mode):
    # deselected by default (pyproject addopts); run on a GPU machine with: pytest -m gpu
    assert torch.cuda.is_available(), "the gpu marker needs a CUDA device"
    paths, labels_csv = image_store_factory(tmp_path / "stores", n_bags=6, n_patches=96, size_px=64)
    inst = read_patch_stores(paths, read_labels_csv(labels_csv))
    cfg = _cfg(device="cuda", amp="auto", num_workers=2, epochs=2, compile=mode)
    result = fit(inst, config=cfg, out_dir=tmp_path / "run", val=inst)
    assert all(np.isfinite(h["loss"]) for h in result.history)
    model, _ = load_model(tmp_path / "run" / "last.pt")
    assert list(model.state_dict()) == list(result.model.state_dict())
    probs = evaluate(result.model, inst, runtime=resolve_runtime(cfg))["probs"]
    assert np.isfinite(probs).all() and np.std(probs) > 0
