"""The tile recipe as one frozen, validated object: TileConfig -> TilingPlan -> dict/JSON -> the same
plan; every store records it; the public cutting functions reproduce a store's cells."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from wsi_milssl.config import TileConfig
from wsi_milssl.errors import ConfigError
from wsi_milssl.slide import open_slide
from wsi_milssl.store import open_store
from wsi_milssl.tiling import PLAN_ATTR, TilingPlan, cut_band, open_band_source, plan_slide, tile_slide


def test_tile_config_gives_its_plan_and_the_plan_round_trips():
    config = TileConfig(magnification=20, patch_size_px=224, stride_px=112, entropy_threshold_bits=4.5,
                        tissue="none", min_tissue=0.25, mask_mpp=8, direct_tiff_read=False, allow_upsample=True,
                        pixels="raw", workers=3)
    plan = config.tiling_plan()
    assert plan == TilingPlan(target_mpp=0.5, patch_size_px=224, stride_px=112, tissue="none", min_tissue=0.25,
                              mask_mpp=8.0, entropy_threshold_bits=4.5, direct_tiff_read=False, allow_upsample=True)
    assert TileConfig(patch_size_px=64).tiling_plan().stride_px == 64  # stride None = the patch size
    data = plan.to_dict()
    assert json.loads(json.dumps(data)) == data and isinstance(data["mask_mpp"], float)
    assert TilingPlan.from_dict(data) == plan and TilingPlan.from_json(plan.to_json()) == plan
    assert hash(TilingPlan.from_dict(data)) == hash(plan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.stride_px = 1
    assert plan.with_tissue(min_tissue=0.5) == dataclasses.replace(plan, min_tissue=0.5)
    assert plan.with_tissue() is plan
    # only what decides the cells: pixel encoding, format and speed settings are not in it
    assert set(data) == {"target_mpp", "patch_size_px", "stride_px", "tissue", "min_tissue", "mask_mpp",
                         "entropy_threshold_bits", "direct_tiff_read", "allow_upsample"}


@pytest.mark.parametrize("data, message", [
    ({"target_mpp": 1.0, "patch_size_px": 64}, r"store\.h5: the tiling plan lacks stride_px\. Fix: re-tile"),
    ({"target_mpp": 1.0, "patch_size_px": 64, "stride_px": 64, "colour": 1},
     r"store\.h5: unknown key\(s\) colour for TilingPlan; valid keys are .*direct_tiff_read"),
    ({"target_mpp": 1.0, "patch_size_px": 64, "stride_px": 64, "tissue": "magic"},
     r"store\.h5: TilingPlan\.tissue must be one of .*'otsu'.*; got 'magic'"),
    ({"target_mpp": 1.0, "patch_size_px": 64.0, "stride_px": 64}, r"TilingPlan\.patch_size_px must be int; got 64\.0"),
    ({"target_mpp": 1.0, "patch_size_px": 64, "stride_px": 64, "entropy_threshold_bits": 9},
     r"TilingPlan\.entropy_threshold_bits must satisfy 0\.0 <= value <= 8\.0; got 9"),
    ([1, 2], r"store\.h5: a tiling plan must be a mapping of its fields; got list"),
])
def test_a_bad_plan_names_the_source_and_the_field(data, message):
    with pytest.raises(ConfigError, match=message):
        TilingPlan.from_dict(data, source="store.h5")


def test_bad_plan_json_names_the_source():
    with pytest.raises(ConfigError, match=r"tiles/a\.zarr: the tiling plan is not valid JSON"):
        TilingPlan.from_json("{not json", source="tiles/a.zarr")


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_every_store_records_the_plan_and_the_cutting_functions_reproduce_it(tmp_path, box_slide, fmt):
    # every cell is read (min_tissue 0): the glass ones are then dropped by the entropy filter
    config = TileConfig(magnification=10, patch_size_px=128, stride_px=96, entropy_threshold_bits=4.0,
                        min_tissue=0.0, format=fmt, pixels="none")
    result = tile_slide(box_slide, tmp_path, config)
    with open_store(result.store_path) as store:
        attrs = store.attrs
        coords, entropy = np.asarray(store.coords), store.read_array("entropy_bits")
        fraction = store.read_array("tissue_fraction")
    plan = TilingPlan.from_json(attrs[PLAN_ATTR])
    assert plan == config.tiling_plan()
    # the older separate attributes stay, and agree with the plan
    assert (attrs["target_mpp"], attrs["patch_size_px"], attrs["stride_px"]) == (1.0, 128, 96)
    assert (attrs["tissue_detector"], attrs["min_tissue"], attrs["entropy_threshold_bits"]) == ("otsu", 0.0, 4.0)

    with open_slide(box_slide) as slide:
        cells = plan_slide(slide, plan)
        source = open_band_source(slide, cells.geometry, cells.bands, plan=plan)
        cuts = [cut_band(slide, band, cells.geometry, plan=plan, source=source) for band in cells.bands]
        if source is not None:
            source.close()
    assert (cells.n_grid, cells.n_candidates) == (attrs["n_grid"], attrs["n_candidates"])
    assert cells.coords_lv0.dtype == np.int64 and cells.coords_lv0.shape == (cells.n_candidates, 2)
    kept = np.concatenate([cut.indices for cut in cuts])
    assert 0 < len(kept) < cells.n_candidates  # the entropy filter dropped some cells read
    np.testing.assert_array_equal(cells.coords_lv0[kept], coords)
    np.testing.assert_array_equal(cells.tissue_fraction[kept], fraction)
    np.testing.assert_array_equal(np.concatenate([c.entropy_bits[c.keep] for c in cuts]).astype(np.float32), entropy)
    assert all(c.patches.shape == (int(c.keep.sum()), 128, 128, 3) for c in cuts)
    # a stricter plan keeps fewer of the same cells
    strict = dataclasses.replace(plan, entropy_threshold_bits=6.0)
    with open_slide(box_slide) as slide:
        n_strict = sum(len(cut_band(slide, b, cells.geometry, plan=strict).indices) for b in cells.bands)
    assert n_strict < len(kept)
