"""Many slides through one pool of readers: the same probabilities as one slide at a time, torch-free
readers, a bad slide that fails alone, JPEG decoded by the model's device."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

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
