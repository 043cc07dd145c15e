"""One tiling plan from tile to heatmap: the heatmap stage cuts the cells the tile stage stores.

For the same settings, ``predict_slide`` runs on exactly the level-0 coordinates ``tile`` writes (same
cells, same order, the entropy filter dropping the same ones) on generic pyramidal TIFFs and on an
Aperio-style SVS whose reduced levels have non-integer downsamples (4.0017, ...), where reading the
same cell as part of a different band can move it by a pixel. The plan travels store -> checkpoint
(``wsi-milssl train``) -> heatmap unchanged; older checkpoints fall back to their separate keys.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import tifffile
from PIL import Image

from wsi_milssl.config import HeatmapConfig, TileConfig
from wsi_milssl.errors import CheckpointError
from wsi_milssl.inference import load_inference_model, plan_from_checkpoint_config, predict_slide
from wsi_milssl.slide import open_slide
from wsi_milssl.store import open_store
from wsi_milssl.tiling import TilingPlan, tile_slide

SVS_SIZE = (5003, 4001)  # odd sizes: the reduced levels' downsamples are not whole numbers


def write_aperio_svs(path: Path, *, width: int, height: int, mpp: float = 0.25, seed: int = 0) -> Path:
    """An Aperio-style SVS: tiled JPEG (256 x 256) pyramid, every level a top-level IFD, reduced levels
    ``subfiletype=1`` (4x steps), the Aperio ImageDescription with ``AppMag`` and ``MPP``.

    Content: glass (near white, faint noise), an elliptical textured tissue region, and inside it a
    flat pink block: tissue on the mask but about 0 bits of entropy, so the entropy filter drops it.
    """
    rng = np.random.default_rng(seed)
    img = np.full((height, width, 3), 242, np.uint8)
    img += rng.integers(0, 3, (height, width, 1), dtype=np.uint8)
    yy, xx = np.mgrid[0:height, 0:width]
    tissue = ((xx - width * 0.45) / (width * 0.38)) ** 2 + ((yy - height * 0.5) / (height * 0.4)) ** 2 < 1
    cells = rng.random((height // 8 + 1, width // 8 + 1, 1), dtype=np.float32)
    t = np.repeat(np.repeat(cells, 8, axis=0), 8, axis=1)[:height, :width]
    pink, purple = np.array([230, 140, 190], np.float32), np.array([90, 50, 150], np.float32)
    texture = np.clip(pink * (1 - t) + purple * t, 0, 255).astype(np.uint8)
    img[tissue] = texture[tissue]
    img[int(height * 0.35):int(height * 0.65), int(width * 0.3):int(width * 0.55)] = (225, 150, 195)
    levels = [img]
    w, h = width, height
    while min(w, h) // 4 >= 200:
        w, h = w // 4, h // 4
        levels.append(np.asarray(Image.fromarray(levels[-1]).resize((w, h), Image.Resampling.BOX)))
    description = (f"Aperio Image Library v12.0.15 \r\n{width}x{height} [0,0 {width}x{height}] (256x256) "
                   f"JPEG/RGB Q=90|AppMag = 40|MPP = {mpp}")
    with tifffile.TiffWriter(path) as tif:
        for i, level in enumerate(levels):
            tif.write(level, tile=(256, 256), compression="jpeg", compressionargs={"level": 90}, photometric="rgb",
                      subfiletype=0 if i == 0 else 1, metadata=None,
                      description=description if i == 0 else f"Aperio Image Library v12.0.15 \r\nlevel {i}")
    return path


@pytest.fixture(scope="module")
def svs_slide(tmp_path_factory) -> Path:
    path = write_aperio_svs(tmp_path_factory.mktemp("svs") / "aperio.svs", width=SVS_SIZE[0], height=SVS_SIZE[1])
    with open_slide(path) as slide:  # OpenSlide reads it as an Aperio slide with a real pyramid
        assert slide.vendor == "aperio" and slide.mpp_source == "metadata" and slide.mpp == pytest.approx(0.25)
        assert slide.level_count >= 3 and slide.level_dimensions[0] == SVS_SIZE
        assert not float(slide.level_downsamples[1]).is_integer()
    return path


@pytest.fixture(scope="module")
def coarse_svs(tmp_path_factory) -> Path:
    """A small Aperio SVS scanned at 0.5 µm/px (2 levels): cutting it at 0.4 µm/px needs allow_upsample."""
    return write_aperio_svs(tmp_path_factory.mktemp("svs") / "coarse.svs", width=1500, height=1200, mpp=0.5, seed=1)


# slide, tile settings, store format, heatmap reading (batch_size, num_workers)
CASES = {
    "tif-otsu": ("tumor", dict(target_mpp=2.0, patch_size_px=32, entropy_threshold_bits=5.5), "h5", (7, 0)),
    "tif-no-mask-overlapping": ("normal", dict(target_mpp=2.0, patch_size_px=32, stride_px=24, tissue="none",
                                               entropy_threshold_bits=3.0), "zarr", (16, 1)),
    "svs-between-levels": ("svs", dict(target_mpp=1.1, patch_size_px=32, entropy_threshold_bits=4.0, mask_mpp=8.0),
                           "h5", (7, 0)),
    "svs-overlapping": ("svs", dict(target_mpp=1.0, patch_size_px=32, stride_px=24, min_tissue=0.5,
                                    entropy_threshold_bits=4.0), "zarr", (64, 1)),
    "svs-upsampled": ("coarse", dict(target_mpp=0.4, patch_size_px=32, entropy_threshold_bits=4.0, mask_mpp=8.0,
                                     allow_upsample=True), "h5", (16, 0)),
}


def _store_plan(store_path: Path) -> tuple[np.ndarray, dict, TilingPlan]:
    with open_store(store_path) as store:
        coords = np.asarray(store.coords)
        attrs = store.attrs
    return coords, attrs, TilingPlan.from_json(attrs["tiling_plan"])


@pytest.mark.parametrize("case", list(CASES))
def test_tile_and_heatmap_cut_the_same_cells(tmp_path, case, synth_slides, svs_slide, coarse_svs, checkpoint_factory):
    which, settings, fmt, (batch_size, workers) = CASES[case]
    slide = {"svs": svs_slide, "coarse": coarse_svs}.get(which) or synth_slides[which]
    config = TileConfig(pixels="none", format=fmt, **settings)
    result = tile_slide(slide, tmp_path / "tiles", config)
    assert result.status == "ok", result.error
    coords, attrs, plan = _store_plan(Path(result.store_path))
    assert plan == config.tiling_plan()
    assert attrs["n_candidates"] > attrs["n_patches"] == len(coords) > 50  # the entropy filter dropped some

    # a checkpoint carrying the stores' plan; its older separate keys say otherwise and must be ignored
    ckpt = checkpoint_factory(tiling_plan=plan.to_dict(), target_mpp=4.0, patch_size_px=64, stride_px=16,
                              entropy_threshold_bits=0.0, min_tissue=0.0)
    heatmap = HeatmapConfig(batch_size=batch_size, num_workers=workers)
    model = load_inference_model(ckpt, config=heatmap)
    assert model.plan == plan
    pred = predict_slide(slide, model, config=heatmap)
    np.testing.assert_array_equal(pred.coords_lv0, coords)
    assert pred.n_candidates == attrs["n_candidates"]
    assert (pred.stride_lv0, pred.patch_size_lv0) == (attrs["stride_lv0"], attrs["patch_size_lv0"])


def test_training_copies_the_store_plan_into_the_checkpoint_and_heatmaps_use_it(tmp_path, synth_dir, synth_slides):
    from wsi_milssl.config import TrainConfig
    from wsi_milssl.mil import fit, load_model, read_labels_csv, read_patch_stores

    config = TileConfig(target_mpp=8.0, patch_size_px=32, entropy_threshold_bits=4.5, min_tissue=0.3, pixels="raw",
                        direct_tiff_read=False)
    for slide in synth_slides.values():
        assert tile_slide(slide, tmp_path / "tiles", config).status == "ok"
    stored = {}
    for path in sorted((tmp_path / "tiles").glob("*.h5")):
        with open_store(path) as store:
            stored[path.stem] = (np.asarray(store.coords), store.attrs["tiling_plan"])
    assert len({plan for _, plan in stored.values()}) == 1

    instances = read_patch_stores([tmp_path / "tiles"], read_labels_csv(synth_dir / "labels.csv"))
    run = tmp_path / "run"
    fit(instances, config=TrainConfig(mode="images", model="resnet18", epochs=1, batch_size=32, eval_batch_size=64,
                                      num_workers=0, threads=1, plots=False), out_dir=run)
    _, saved = load_model(run / "last.pt")
    recorded = next(iter(stored.values()))[1]
    assert saved["tiling_plan"] == json.loads(recorded)  # unchanged, and not duplicated in store_settings
    assert "tiling_plan" not in saved["store_settings"]

    model = load_inference_model(run / "last.pt", config=HeatmapConfig(num_workers=0, batch_size=32))
    assert model.plan == TilingPlan.from_json(recorded) and not model.plan.direct_tiff_read
    tumour = synth_slides["tumor"]
    pred = predict_slide(tumour, model, config=HeatmapConfig(num_workers=0, batch_size=32))
    np.testing.assert_array_equal(pred.coords_lv0, stored[tumour.stem][0])


def test_stores_tiled_with_other_plans_are_named_in_a_warning(tmp_path, synth_dir, synth_slides, caplog):
    from wsi_milssl.mil import read_labels_csv, read_patch_stores

    tile_slide(synth_slides["tumor"], tmp_path, TileConfig(target_mpp=8.0, patch_size_px=32, min_tissue=0.3))
    tile_slide(synth_slides["normal"], tmp_path, TileConfig(target_mpp=8.0, patch_size_px=32, min_tissue=0.5,
                                                            direct_tiff_read=False))
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.mil.data"):
        instances = read_patch_stores([tmp_path], read_labels_csv(synth_dir / "labels.csv"))
    first = min(synth_slides.values(), key=lambda p: p.stem)
    expected = 0.3 if first == synth_slides["tumor"] else 0.5
    assert instances.settings["tiling_plan"]["min_tissue"] == expected
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert "tiled with other settings (min_tissue" in warning and "direct_tiff_read" not in warning


def test_checkpoint_plan_falls_back_to_the_older_keys_and_refuses_a_broken_one(tmp_path):
    legacy = {"target_mpp": 0.5, "patch_size_px": 224, "entropy_threshold_bits": 4.5,
              "store_settings": {"stride_px": 112, "tissue_detector": "none", "min_tissue": 0.3, "mask_mpp": 4.0}}
    plan = plan_from_checkpoint_config(legacy)
    assert plan == TilingPlan(target_mpp=0.5, patch_size_px=224, stride_px=112, tissue="none", min_tissue=0.3,
                              mask_mpp=4.0, entropy_threshold_bits=4.5, direct_tiff_read=True)
    recorded = TilingPlan(target_mpp=1.0, patch_size_px=64, stride_px=32, entropy_threshold_bits=2.0)
    assert plan_from_checkpoint_config({**legacy, "tiling_plan": recorded.to_dict()}) == recorded
    broken = {**legacy, "tiling_plan": {**recorded.to_dict(), "min_tissue": 3.0}}
    with pytest.raises(CheckpointError, match=r"run/best.pt: tiling_plan: TilingPlan.min_tissue must satisfy "
                                              r"0.0 <= value <= 1.0; got 3.0.*retrain"):
        plan_from_checkpoint_config(broken, source="run/best.pt")
    # HeatmapConfig's tissue settings still override the recorded plan
    from wsi_milssl.inference import TilingSettings

    t = TilingSettings.from_checkpoint_config({**legacy, "tiling_plan": recorded.to_dict()},
                                              config=HeatmapConfig(tissue="none", min_tissue=0.6))
    assert t.plan == TilingPlan(target_mpp=1.0, patch_size_px=64, stride_px=32, tissue="none", min_tissue=0.6,
                                entropy_threshold_bits=2.0)

