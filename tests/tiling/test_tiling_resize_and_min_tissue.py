"""Review EA (mutation test): the tests tiled only at magnifications a pyramid level holds, so the resize of
patches read between levels never ran (BOX swapped for BILINEAR went unnoticed, changing stored pixels by up to 33
grey levels), and nothing checked that ``min_tissue = 0`` reads every grid cell (``>`` for ``>=`` dropped 21 of 48
glass cells). A band's later patches can sit half a level pixel from where the reader's read_region, which rounds
each patch's place on its own, puts them; the first patch of a band starts on the same level pixel."""

from __future__ import annotations

import numpy as np

from wsi_milssl.config import TileConfig
from wsi_milssl.slide import open_slide
from wsi_milssl.tiling.cells import cut_band, plan_slide


def test_patches_cut_between_pyramid_levels_are_the_level_region_shrunk_by_area_averaging(synth_slides):
    # 15x on a 0.25 µm/px slide: 0.667 µm/px, read from the 0.5 µm/px level and shrunk (85 px -> 64 px) by area
    # averaging, as the reader's read_region does; a bilinear shrink differs by up to 33 grey levels.
    plan = TileConfig(magnification=15, patch_size_px=64, min_tissue=0.5, entropy_threshold_bits=0.0).tiling_plan()
    with open_slide(synth_slides["tumor"]) as slide:
        cells = plan_slide(slide, plan)
        g = cells.geometry
        assert g.patch_size_level > g.patch_size_px  # a shrink, not a level as it is
        bands = cells.bands[:: max(1, len(cells.bands) // 8)]
        assert len(bands) >= 4
        for band in bands:
            cut = cut_band(slide, band, g, plan=plan)
            x, y = cells.coords_lv0[cut.indices[0]]
            want = slide.read_region(int(x), int(y), 64, target_mpp=plan.target_mpp)
            np.testing.assert_array_equal(cut.patches[0], want)


def test_min_tissue_0_reads_every_grid_cell_and_a_fraction_equal_to_it_is_kept(synth_slides):
    with open_slide(synth_slides["tumor"]) as slide:
        every = plan_slide(slide, TileConfig(magnification=10, patch_size_px=64, min_tissue=0.0).tiling_plan())
        assert len(every.coords_lv0) == every.n_grid
        assert (every.tissue_fraction == 0).any()  # glass cells too
        # a threshold equal to some cell's fraction keeps that cell (>=)
        level = float(np.unique(every.tissue_fraction[every.tissue_fraction > 0])[0])
        kept = plan_slide(slide, TileConfig(magnification=10, patch_size_px=64, min_tissue=level).tiling_plan())
        assert len(kept.coords_lv0) == int((every.tissue_fraction >= np.float32(level)).sum())
        assert (kept.tissue_fraction == np.float32(level)).any()
