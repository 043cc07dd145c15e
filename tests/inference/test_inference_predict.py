"""Slide inference: the map overlaps the true tumour, slide and store inputs agree, checkpoints are
checked, and the ``wsi-milssl heatmap`` command writes every file."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from PIL import Image

from wsi_milssl.annotations import read_annotations, tumor_fraction
from wsi_milssl.cli import main
from wsi_milssl.config import HeatmapConfig, TileConfig
from wsi_milssl.errors import CheckpointError, ConfigError
from wsi_milssl.inference import load_inference_model, make_heatmaps, predict_slide, predict_store
from wsi_milssl.inference.heatmap import PNG_TEXT_KEY
from wsi_milssl.inference import Preprocess
from wsi_milssl.mil.data import to_tensor

FAST = dict(thumbnail_px=256, batch_size=64)


def _iou(pred_cells: np.ndarray, true_cells: np.ndarray) -> float:
    union = (pred_cells | true_cells).sum()
    return float((pred_cells & true_cells).sum() / union) if union else 1.0


def test_probability_map_overlaps_the_tumour_polygons(tmp_path, tumour_slide, checkpoint_factory):
    ckpt = checkpoint_factory(model_kwargs={"min_fraction": 0.5})
    model = load_inference_model(ckpt, config=HeatmapConfig(num_workers=1))
    pred = predict_slide(tumour_slide, model, config=HeatmapConfig(num_workers=1))
    grid = pred.grid()
    rows, cols = grid.shape
    rr, cc = np.mgrid[:rows, :cols]
    coords = np.stack([cc.ravel() * pred.stride_lv0, rr.ravel() * pred.stride_lv0], axis=1)
    region = read_annotations(tumour_slide.with_suffix(".xml")).region
    truth = (tumor_fraction(region, coords, pred.patch_size_lv0) >= 0.5).reshape(rows, cols)
    high = np.nan_to_num(grid, nan=0.0) >= 0.5
    assert truth.sum() > 50
    assert _iou(high, truth) >= 0.9
    # shifting the map by one cell would lose a good part of the overlap
    assert _iou(np.roll(high, 1, axis=1), truth) < 0.85
    assert pred.score("max") == pytest.approx(float(np.nanmax(grid)))
    assert pred.score("mean") == pytest.approx(float(np.nanmean(grid)), rel=1e-5)


@pytest.mark.parametrize("model_name, target_mpp", [("darkness", 1.0), ("resnet18", 4.0)])
def test_slide_and_raw_store_give_the_same_probabilities(tmp_path, tumour_slide, checkpoint_factory, model_name,
                                                         target_mpp):
    torch.manual_seed(0)
    kwargs = {"min_fraction": 0.5, "gain": 4.0} if model_name == "darkness" else {}
    ckpt = checkpoint_factory(model_name=model_name, model_kwargs=kwargs, target_mpp=target_mpp, bag_pooling="mean")
    from wsi_milssl.tiling import tile_slide

    tile_slide(tumour_slide, tmp_path / "stores",
               TileConfig(target_mpp=target_mpp, patch_size_px=32, entropy_threshold_bits=3.0, pixels="raw"))
    model = load_inference_model(ckpt, config=HeatmapConfig(num_workers=1))
    a = predict_slide(tumour_slide, model, config=HeatmapConfig(num_workers=1))
    b = predict_store(tmp_path / "stores" / "tumour.h5", model, config=HeatmapConfig(num_workers=1, batch_size=50))
    assert len(a) > (500 if target_mpp == 1.0 else 30)
    np.testing.assert_array_equal(a.coords_lv0, b.coords_lv0)
    np.testing.assert_allclose(a.probs, b.probs, atol=2e-3)
    assert np.std(a.probs) > 1e-3  # not a constant map
    assert (a.grid_shape, a.stride_lv0, a.patch_size_lv0) == (b.grid_shape, b.stride_lv0, b.patch_size_lv0)
    assert model.pooling == "mean" and model.runtime.preprocess_in_workers


def test_reading_in_workers_or_in_process_gives_the_same_map(tumour_slide, checkpoint_factory):
    ckpt = checkpoint_factory(model_kwargs={"min_fraction": 0.5, "gain": 4.0})
    maps = []
    for workers in (0, 2):
        config = HeatmapConfig(num_workers=workers, batch_size=40)
        model = load_inference_model(ckpt, config=config)
        assert model.runtime.preprocess_in_workers  # on the CPU the readers make the model input
        maps.append(predict_slide(tumour_slide, model, config=config).grid())
    np.testing.assert_allclose(maps[0], maps[1], atol=2e-3)
    assert 0.05 < np.nanstd(maps[0])


def test_model_calls_have_one_batch_size(tumour_slide, checkpoint_factory):
    config = HeatmapConfig(num_workers=1, batch_size=40)
    model = load_inference_model(checkpoint_factory(), config=config)
    sizes: list[int] = []
    model.model.register_forward_hook(lambda module, args, output: sizes.append(int(args[0].shape[0])))
    pred = predict_slide(tumour_slide, model, config=config)
    assert len(sizes) > 5
    # this slide's count is not a multiple of 40: its last batch is padded to a multiple of 8 on the CPU
    assert set(sizes[:-1]) == {40} and 0 < sizes[-1] < 40 and sizes[-1] % 8 == 0
    assert sum(sizes) - 8 < len(pred) <= sum(sizes)
    # padding the last batch (what CUDA does) gives one shape and the same probabilities
    assert not model.runtime.pad_last_batch
    model.runtime = dataclasses.replace(model.runtime, pad_last_batch=True)
    sizes.clear()
    padded = predict_slide(tumour_slide, model, config=config)
    assert set(sizes) == {40} and len(padded) == len(pred)
    np.testing.assert_array_equal(padded.coords_lv0, pred.coords_lv0)
    np.testing.assert_allclose(padded.probs, pred.probs, atol=2e-3)


def test_preprocess_matches_to_tensor_and_honours_the_checkpoint_normalisation():
    u8 = np.random.default_rng(0).integers(0, 256, (3, 8, 8, 3), dtype=np.uint8)
    from wsi_milssl.mil.data import NORMALISATION

    standard = Preprocess(NORMALISATION["mean"], NORMALISATION["std"])
    assert standard.standard
    torch.testing.assert_close(standard(torch.from_numpy(u8)), to_tensor(u8))
    assert standard(torch.from_numpy(u8)).is_contiguous(memory_format=torch.channels_last)
    fast = Preprocess(NORMALISATION["mean"], NORMALISATION["std"], dtype=torch.bfloat16)
    assert fast.tables is not None and fast.tables.pairs is not None  # table lookups, equal to to_tensor bit for bit
    big = np.random.default_rng(1).integers(0, 256, (2, 64, 64, 3), dtype=np.uint8)
    assert torch.equal(fast(torch.from_numpy(big)), to_tensor(big).to(torch.bfloat16))
    odd = big[:1, :5, :5]  # 25 pixels: the byte-pair tables do not apply, the one-byte ones do
    assert torch.equal(fast(torch.from_numpy(odd)), to_tensor(odd).to(torch.bfloat16))
    half = Preprocess(NORMALISATION["mean"], NORMALISATION["std"], dtype=torch.float16)
    assert half.tables.pairs is not None and torch.equal(half(torch.from_numpy(big)), to_tensor(big).to(torch.float16))
    custom = Preprocess((0.5, 0.5, 0.5), (0.25, 0.25, 0.25), dtype=torch.bfloat16)
    out = custom(torch.from_numpy(u8))
    assert out.dtype == torch.bfloat16
    expected = (torch.from_numpy(u8).permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.25
    torch.testing.assert_close(out.float(), expected, atol=0.02, rtol=0.01)


def test_checkpoints_without_image_model_or_tiling_settings_are_refused(tmp_path, checkpoint_factory):
    from wsi_milssl.mil.models import create_model

    head = checkpoint_factory(model_name="mlp", model_kwargs={"in_features": 4},
                              model=create_model("mlp", in_features=4))
    with pytest.raises(CheckpointError, match="classifies feature vectors, not image patches"):
        load_inference_model(head)
    bare = checkpoint_factory(drop=("target_mpp", "patch_size_px"))
    with pytest.raises(CheckpointError, match=r"records no tiling settings \(target_mpp, patch_size_px\)"):
        load_inference_model(bare)
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        load_inference_model(tmp_path / "missing.pt")
    # review EW, B5: RUN/best.pt of a run without validation was "not found; pass RUN_DIR/best.pt, ..."
    run = tmp_path / "run"
    run.mkdir()
    (run / "last.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=rf"best\.pt: not written by this run \(best\.pt is the epoch that "
                                              rf"validation chose: `train --val`\).* Fix: pass the run folder {run} "):
        load_inference_model(run / "best.pt")


def test_store_tiled_at_another_resolution_fails_that_slide_with_a_clear_message(tmp_path, tumour_slide,
                                                                                  checkpoint_factory):
    from wsi_milssl.tiling import tile_slide

    tile_slide(tumour_slide, tmp_path / "stores", TileConfig(target_mpp=2.0, patch_size_px=32,
                                                             entropy_threshold_bits=3.0))
    ckpt = checkpoint_factory()
    run = make_heatmaps([], ckpt, tmp_path / "hm", HeatmapConfig(num_workers=0, **FAST), stores=[tmp_path / "stores"])
    assert not run.ok
    assert "was tiled at 2 µm/px with 32 px patches, but the model was trained at 1 µm/px" in run.results[0].error
    status = (tmp_path / "hm" / "heatmap_status.csv").read_text()
    assert status.startswith("slide,status,n_patches,score,seconds,error\ntumour,failed,0,,")
    with pytest.raises(ConfigError, match="no store for slide 'other'"):
        make_heatmaps([tmp_path / "other.tif"], ckpt, tmp_path / "hm2", stores=[tmp_path / "stores"])


def test_heatmap_command_writes_every_output(tmp_path, tumour_slide, checkpoint_factory, capsys):
    ckpt = checkpoint_factory(model_kwargs={"min_fraction": 0.5})
    out = tmp_path / "hm"
    code = main(["heatmap", str(tumour_slide), "--model", str(ckpt.parent), "--out", str(out),
                 "--annotations", str(tumour_slide.parent), "--thumbnail-px", "256", "--workers", "1",
                 "--smooth-um", "100", "--colormap", "inferno", "--detection-threshold", "0.5",
                 "--nms-radius-um", "300"])
    assert code == 0, capsys.readouterr().err
    stem = tumour_slide.stem
    for suffix in ("_probs.npy", "_probs.tif", "_probs.json", "_patches.csv", "_patches.geojson",
                   "_detections.csv", "_heatmap.png"):
        assert (out / f"{stem}{suffix}").is_file(), suffix
    scores = (out / "scores.csv").read_text().splitlines()
    assert scores[0] == "slide,score" and scores[1].startswith("tumour,") and float(scores[1].split(",")[1]) > 0.99
    cfg = json.loads((out / "heatmap_config.json").read_text())
    assert cfg["heatmap"]["colormap"] == "inferno" and cfg["tiling"]["patch_size_px"] == 32
    meta = json.loads(Image.open(out / f"{stem}_heatmap.png").text[PNG_TEXT_KEY])
    assert meta["annotations"] is True and meta["colormap"] == "inferno"
    dets = (out / f"{stem}_detections.csv").read_text().splitlines()
    # two lesions, each bigger than the 300 µm radius: a handful of detections, all at p >= 0.5
    assert 2 <= len(dets) <= 12 and all(float(d.split(",")[0]) >= 0.5 for d in dets)
    assert "tumour: score " in capsys.readouterr().out


def test_heatmap_command_usage_errors(tmp_path, checkpoint_factory, capsys):
    ckpt = checkpoint_factory()
    assert main(["heatmap", "--model", str(ckpt), "--out", str(tmp_path / "o")]) == 2
    assert "no slides given" in capsys.readouterr().err
    assert main(["heatmap", str(tmp_path / "nope.tif"), "--model", str(ckpt), "--out", str(tmp_path / "o")]) == 2
    assert "no such slide file or folder" in capsys.readouterr().err
    assert main(["heatmap", str(tmp_path), "--model", str(ckpt), "--out", str(tmp_path / "o"), "--alpha", "2"]) == 2
    assert "HeatmapConfig.alpha must satisfy 0.0 <= value <= 1.0; got 2.0" in capsys.readouterr().err


@pytest.mark.gpu
def test_cuda_autocast_matches_the_cpu(tmp_path, tumour_slide, checkpoint_factory):
    # deselected by default (pyproject addopts); run on a GPU machine with: pytest -m gpu
    assert torch.cuda.is_available(), "the gpu marker needs a CUDA device"
    torch.manual_seed(0)
    ckpt = checkpoint_factory(model_name="resnet18")
    cpu = predict_slide(tumour_slide, load_inference_model(ckpt, config=HeatmapConfig(device="cpu", amp="off")))
    gpu_model = load_inference_model(ckpt, config=HeatmapConfig(device="cuda"))
    assert gpu_model.runtime.device.type == "cuda" and not gpu_model.runtime.preprocess_in_workers
    side = gpu_model.plan.patch_size_px
    batch = torch.randint(0, 256, (8, side, side, 3), dtype=torch.uint8).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the forward of a batch never waits for the device
    try:
        queued = gpu_model.forward_batch(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert queued.shape == (8,) and bool(torch.isfinite(queued).all())
    gpu = predict_slide(tumour_slide, gpu_model, config=HeatmapConfig(device="cuda"))
    np.testing.assert_array_equal(cpu.coords_lv0, gpu.coords_lv0)
    np.testing.assert_allclose(cpu.probs, gpu.probs, atol=2e-2)


def test_a_slide_without_a_patch_is_empty_never_a_confident_zero(tmp_path, checkpoint_factory, slide_writer):
    # issue 14 row 4: 0 patches used to be status ok with score 0.000000, a confidently normal slide
    glass = slide_writer(tmp_path / "glass.tif", width=2048, height=2048, tissue_box=(0, 0, 0, 0),
                         tumour=lambda xs, ys: np.zeros(xs.shape, bool))
    tissue = slide_writer(tmp_path / "tissue.tif", width=2048, height=2048, tissue_box=(256, 256, 1792, 1792),
                          tumour=lambda xs, ys: np.zeros(xs.shape, bool))
    run = make_heatmaps([glass, tissue], checkpoint_factory(), tmp_path / "hm",
                        HeatmapConfig(num_workers=1, **FAST))
    empty, ok = run.results
    assert empty.status == "empty" and empty.score is None and empty.n_patches == 0
    assert "glass.tif: no patch has tissue" in empty.error and "Fix:" in empty.error
    assert ok.status == "ok" and ok.n_patches > 0
    assert not run.ok and run.n_empty == 1 and run.n_failed == 0
    # no map, no probabilities: an empty detections CSV alone (the CAMELYON16 script counts slides by them)
    assert [p.name for p in (tmp_path / "hm").glob("glass_*")] == ["glass_detections.csv"]
    assert (tmp_path / "hm" / "glass_detections.csv").read_bytes() == b""
    scores = (tmp_path / "hm" / "scores.csv").read_text()
    assert "tissue," in scores and "glass" not in scores
    status = (tmp_path / "hm" / "heatmap_status.csv").read_text().splitlines()
    assert status[1].startswith("glass,empty,0,,") and status[2].startswith("tissue,ok,")
