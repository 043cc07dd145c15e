"""The tile stage: tissue mask -> grid at a physical resolution -> entropy filter -> patch stores.

    from wsi_milssl.config import TileConfig
    from wsi_milssl.tiling import find_slides, tile_slides

    run = tile_slides(find_slides(["slides/"]), "tiles/", TileConfig(magnification=10, patch_size_px=512))
    run.ok, run.status_csv          # tiles/tile_status.csv: slide,status,n_patches,seconds,error

    tile_slides(slides, "tiles/", config, shard=(i, n))   # shard i of n: the slides whose stem hashes to i

The recipe is one :class:`TilingPlan` (``TileConfig.tiling_plan()``), recorded in every store; any
stage that cuts a slide (the heatmap stage too) does it with :func:`plan_slide`,
:func:`open_band_source` and :func:`cut_band`, so it keeps the cells the tile stage keeps.
"""

from wsi_milssl.tiling.cells import MAX_BAND_PX, BandCut, SlideCells, cut_band, open_band_source, plan_slide
from wsi_milssl.tiling.grid import TileGeometry, grid_coords
from wsi_milssl.tiling.inputs import SLIDE_SUFFIXES, file_fingerprint, find_slides, slide_stem
from wsi_milssl.tiling.plan import PLAN_ATTR, TilingPlan
from wsi_milssl.tiling.qc import render_qc
from wsi_milssl.tiling.reading import Band, plan_bands, read_band
from wsi_milssl.tiling.runner import (
    CONFIG_FILENAME,
    QC_DIRNAME,
    TileRun,
    check_existing_store,
    feature_file_error,
    qc_path,
    tile_slide,
    tile_slides,
)
from wsi_milssl.tiling.status import (
    STATUS_COLUMNS,
    STATUS_FILENAME,
    TileResult,
    merge_status_csv,
    read_status_csv,
)

__all__ = [
    "Band",
    "BandCut",
    "CONFIG_FILENAME",
    "MAX_BAND_PX",
    "PLAN_ATTR",
    "QC_DIRNAME",
    "SLIDE_SUFFIXES",
    "STATUS_COLUMNS",
    "STATUS_FILENAME",
    "SlideCells",
    "TileGeometry",
    "TileResult",
    "TileRun",
    "TilingPlan",
    "check_existing_store",
    "feature_file_error",
    "cut_band",
    "file_fingerprint",
    "find_slides",
    "grid_coords",
    "merge_status_csv",
    "open_band_source",
    "plan_bands",
    "plan_slide",
    "qc_path",
    "read_band",
    "read_status_csv",
    "render_qc",
    "slide_stem",
    "tile_slide",
    "tile_slides",
]
