"""Many slides through one pool of readers: the same probabilities as one slide at a time, torch-free
readers, a bad slide (a reader that dies, a model error in a slide's last batch) that fails alone, JPEG
decoded by the model's device, slides planned as the readers need them, chunks joined into exact batches."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from processes import children

from wsi_milssl.config import HeatmapConfig, TileConfig
from wsi_milssl.inference import SlideInput, load_inference_model, predict_many, predict_slide, predict_store
from wsi_milssl.tiling import tile_slide


def test_the_reader_module_does_not_import_torch():
    code = ("import sys, wsi_milssl.inference.sources, wsi_milssl.inference; "
            "print(sorted(m for m in ('torch', 'torchvision') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.fixture(scope="module")
def three_slides(tmp_path_factory, slide_writer):
    folder = tmp_path_factory.mktemp("three")
    out = []
    for k, box in enumerate([(256, 256, 1792, 1792), (0, 512, 2048, 1536), (512, 0, 1536, 2048)]):
        out.append(slide_writer(folder / f"s{k}.tif", width=2048, height=2048, tissue_box=box,
                                tumour=lambda xs, ys, k=k: (xs // 300 + ys // 300 + k) % 4 == 0))
    return out


def test_slides_in_flight_give_what_each_slide_gives_alone(tmp_path, three_slides, checkpoint_factory):
    ckpt = checkpoint_factory(model_kwargs={"min_fraction": 0.5, "gain": 4.0})
    tile_slide(three_slides[1], tmp_path / "stores",
               TileConfig(target_mpp=1.0, patch_size_px=32, entropy_threshold_bits=3.0, pixels="raw", mask_mpp=8.0))
    alone_cfg = HeatmapConfig(num_workers=0, batch_size=24)
    alone_model = load_inference_model(ckpt, config=alone_cfg)
    alone = [predict_slide(three_slides[0], alone_model, config=alone_cfg),
             predict_store(tmp_path / "stores" / "s1.h5", alone_model, config=alone_cfg),
             predict_slide(three_slides[2], alone_model, config=alone_cfg)]
    inputs = [SlideInput("s0", three_slides[0], None), SlideInput("s1", three_slides[1], tmp_path / "stores" / "s1.h5"),
              SlideInput("s2", three_slides[2], None)]
    many_cfg = HeatmapConfig(num_workers=2, batch_size=24)
    many_model = load_inference_model(ckpt, config=many_cfg)
    events = []
    got = dict(predict_many(inputs, many_model, config=many_cfg, progress=events.append))
    assert sorted(got) == [0, 1, 2]
    for k, want in enumerate(alone):
        pred = got[k]
        assert pred.stem == f"s{k}" and len(pred) == len(want) > 100
        np.testing.assert_array_equal(pred.coords_lv0, want.coords_lv0)
        np.testing.assert_array_equal(pred.probs, want.probs)  # the same batches, bit for bit
        assert pred.grid_shape == want.grid_shape and pred.source == want.source
    last = [e for e in events if e.stage == "heatmap-patches"][-1]
    assert last.done == last.total == sum(p.n_candidates for p in got.values())


def test_a_bad_slide_among_many_fails_alone(tmp_path, three_slides, checkpoint_factory):
    bad = tmp_path / "broken.tif"
    bad.write_bytes(b"II*\x00 this is not a slide")
    config = HeatmapConfig(num_workers=2, batch_size=32)
    model = load_inference_model(checkpoint_factory(), config=config)
    inputs = [SlideInput("s0", three_slides[0], None), SlideInput("broken", bad, None),
              SlideInput("s2", three_slides[2], None)]
    got = dict(predict_many(inputs, model, config=config))
    assert isinstance(got[1], Exception) and "broken.tif" in str(got[1])
    assert len(got[0]) > 100 and len(got[2]) > 100


def test_store_jpeg_decoded_on_the_device_matches_the_readers(tmp_path, three_slides, checkpoint_factory):
    tile_slide(three_slides[0], tmp_path / "stores",
               TileConfig(target_mpp=1.0, patch_size_px=32, entropy_threshold_bits=3.0, pixels="jpeg", mask_mpp=8.0))
    ckpt = checkpoint_factory(model_kwargs={"min_fraction": 0.5, "gain": 4.0})
    store = tmp_path / "stores" / "s0.h5"
    preds = []
    for decode in ("workers", "device"):
        config = HeatmapConfig(num_workers=1, batch_size=32, decode=decode)
        preds.append(predict_store(store, load_inference_model(ckpt, config=config), config=config))
    np.testing.assert_array_equal(preds[0].coords_lv0, preds[1].coords_lv0)
    np.testing.assert_allclose(preds[0].probs, preds[1].probs, atol=2e-2)  # the same JPEG decoder family
    assert len(preds[0]) > 100


def test_slides_are_planned_only_as_far_as_the_readers_need_them():
    from wsi_milssl.inference.predict import plan_another

    rule = dict(n_slots=30, max_active=14)
    assert plan_another(n_waiting=12, n_active=0, backlog_chunks=0, **rule)
    assert plan_another(n_waiting=12, n_active=1, backlog_chunks=500, **rule)  # two slides always
    # big slides: two keep 14 readers busy, so the third waits until their chunks run low
    assert not plan_another(n_waiting=12, n_active=2, backlog_chunks=60, **rule)
    assert plan_another(n_waiting=12, n_active=2, backlog_chunks=59, **rule)
    # small slides: as many in flight as the readers need, up to the cap
    assert plan_another(n_waiting=12, n_active=13, backlog_chunks=5, **rule)
    assert not plan_another(n_waiting=12, n_active=14, backlog_chunks=5, **rule)
    assert not plan_another(n_waiting=0, n_active=0, backlog_chunks=0, **rule)


def test_a_slides_last_batch_takes_one_of_few_sizes():
    """On the CPU every new batch size leaves memory behind (ResNet18, 224 px, batch 64: +830 MB over the 64
    sizes a slide's last batch can have); padded to multiples of 8, at most batch_size / 8 sizes are seen."""
    from wsi_milssl.inference.predict import CPU_BATCH_STEP, padded_batch

    sizes = {padded_batch(n, 64, full=False) for n in range(1, 65)}
    assert sizes == set(range(CPU_BATCH_STEP, 65, CPU_BATCH_STEP))
    assert all(n <= padded_batch(n, 64, full=False) < n + CPU_BATCH_STEP for n in range(1, 65))
    assert {padded_batch(n, 20, full=False) for n in (17, 19, 20)} == {20}  # never above the batch size
    assert {padded_batch(n, 64, full=True) for n in (1, 33, 64)} == {64}


class _RecordingModel:
    """The engine's model interface, recording what each call gets (CPU; optional CUDA-style padding)."""

    def __init__(self, pad_last_batch: bool) -> None:
        import types

        self.runtime = types.SimpleNamespace(pad_last_batch=pad_last_batch)
        self.calls = []

    def forward_batch(self, x):
        self.calls.append((x.data_ptr(), x.clone()))
        return x.float().reshape(len(x), -1).sum(dim=1)


@pytest.mark.parametrize("pad", [False, True])
def test_chunks_are_joined_into_exact_batches_in_order(pad):
    """(The padded patches' outputs are dropped: ``out`` holds 103.)"""
    import torch

    from wsi_milssl.inference.predict import _Batcher

    rng = np.random.default_rng(0)
    pixels = torch.from_numpy(rng.integers(0, 256, size=(103, 4, 4, 3), dtype=np.uint8))
    model = _RecordingModel(pad)
    batcher = _Batcher(model, batch_size=10)
    sizes = [3, 25, 7, 1, 40, 27]  # chunks smaller and larger than a batch; a whole batch inside one
    start, chunks = 0, []
    for n in sizes:
        chunk = pixels[start:start + n].clone()  # the engine's chunk (a reader slot) is reused afterwards
        chunks.append(chunk)
        batcher.add(np.arange(start, start + n), chunk)
        chunk.fill_(0)
        start += n
    idx, out = batcher.finish()
    np.testing.assert_array_equal(idx, np.arange(103))
    np.testing.assert_allclose(out, pixels.float().reshape(103, -1).sum(dim=1).numpy())
    seen = [x for _, x in model.calls]
    # the last 3 patches: padded to the batch (CUDA) or to a multiple of 8 (CPU), the padding blank
    assert [len(x) for x in seen] == [10] * 10 + [10 if pad else 8]
    joined = torch.cat(seen)[:103]
    assert torch.equal(joined, pixels)
    assert not seen[-1][3:].any()
    # the 40-patch chunk completes the staged batch (4 patches), then its next 30 go to the model as
    # three batches without a copy
    chunk_40 = chunks[4]
    assert [ptr for ptr, _ in model.calls[4:7]] == [chunk_40[k].data_ptr() for k in (4, 14, 24)]


def test_a_model_error_in_a_slides_last_batch_fails_that_slide_alone(three_slides, checkpoint_factory):
    config = HeatmapConfig(num_workers=0, batch_size=50)
    model = load_inference_model(checkpoint_factory(), config=config)
    inner, failed_once = model.forward_batch, []

    def forward_batch(x):
        if len(x) < 50 and not failed_once:  # the first slide's last, smaller batch (run when it finishes)
            failed_once.append(len(x))
            raise RuntimeError("simulated device error in the last batch")
        return inner(x)

    model.forward_batch = forward_batch
    inputs = [SlideInput(f"s{k}", path, None) for k, path in enumerate(three_slides)]
    got = dict(predict_many(inputs, model, config=config))
    assert failed_once and sorted(got) == [0, 1, 2]
    errors = [k for k, v in got.items() if isinstance(v, Exception)]
    assert len(errors) == 1 and "simulated device error" in str(got[errors[0]])
    assert all(len(v) > 100 for k, v in got.items() if k not in errors)


def test_a_reader_that_dies_fails_its_slides_and_the_rest_go_on(three_slides, checkpoint_factory, monkeypatch):
    """A reader killed (as the OOM killer, or a crash in the slide library, would) right after the third
    chunk was handed out, so that a slide is being read when it dies. (Killing one at the first progress
    event failed the test 6 runs in 14 on a loaded machine: the readers had often filled every slot and sat
    idle, and a reader that dies idle rightly fails no slide.)"""
    from wsi_milssl.inference import predict as predict_module

    config = HeatmapConfig(num_workers=2, batch_size=16)
    model = load_inference_model(checkpoint_factory(), config=config)
    killed, chunks = [], []
    start = predict_module._Readers.start

    def start_and_watch(readers):
        start(readers)
        submit = readers.pool.submit

        def submit_then_kill(fn, *args, **kwargs):
            future = submit(fn, *args, **kwargs)
            if fn is predict_module.read_chunk and not killed:
                chunks.append(args[1])
                if len(chunks) == 3:
                    # the readers are children of the fork server, a child of this process
                    reader = [g for c in children(os.getpid()) for g in children(c)][0]
                    os.kill(reader, signal.SIGKILL)
                    killed.append(reader)
            return future

        readers.pool.submit = submit_then_kill

    monkeypatch.setattr(predict_module._Readers, "start", start_and_watch)
    inputs = [SlideInput(f"s{k}", three_slides[k % 3], None) for k in range(6)]
    got = dict(predict_many(inputs, model, config=config))
    assert killed and sorted(got) == list(range(6))
    failed = [k for k, v in got.items() if isinstance(v, Exception)]
    assert failed and all("a reader process died" in str(got[k]) for k in failed)
    assert len(failed) < 6 and all(len(got[k]) > 100 for k in got if k not in failed)


def test_a_failed_warm_up_leaves_the_slides_to_report_for_themselves(three_slides, checkpoint_factory, caplog):
    config = HeatmapConfig(num_workers=0, batch_size=64)
    model = load_inference_model(checkpoint_factory(), config=config)

    def warm_up(batch_size):  # what CUDA does when the batch does not fit in its memory
        raise RuntimeError("CUDA out of memory (simulated)")

    model.warm_up = warm_up
    got = dict(predict_many([SlideInput("s0", three_slides[0], None)], model, config=config))
    assert len(got[0]) > 100
    assert "warm-up batch of 64 failed" in caplog.text and "out of memory" in caplog.text
