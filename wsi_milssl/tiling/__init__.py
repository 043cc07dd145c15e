"""The tile stage: tissue mask -> grid at a physical resolution -> entropy filter -> patch stores.

    from wsi_milssl.config import TileConfig
    from wsi_milssl.tiling import find_slides, tile_slides

    run = tile_slides(find_slides(["slides/"]), "tiles/", TileConfig(magnification=10, patch_size_px=512))
    run.ok, run.status_csv          # tiles/tile_status.csv: slide,status,n_patches,seconds,error
"""

from wsi_milssl.tiling.grid import TileGeometry, grid_coords
from wsi_milssl.tiling.inputs import SLIDE_SUFFIXES, find_slides, slide_stem
from wsi_milssl.tiling.qc import render_qc
from wsi_milssl.tiling.reading import Band, plan_bands, read_band
from wsi_milssl.tiling.runner import (
    CONFIG_FILENAME,
    QC_DIRNAME,
    TileRun,
    check_existing_store,
    qc_path,
    tile_slide,
    tile_slides,
)
from wsi_milssl.tiling.status import STATUS_COLUMNS, STATUS_FILENAME, TileResult, read_status_csv, write_status_csv

__all__ = [
    "Band",
    "CONFIG_FILENAME",
    "QC_DIRNAME",
    "SLIDE_SUFFIXES",
    "STATUS_COLUMNS",
    "STATUS_FILENAME",
    "TileGeometry",
    "TileResult",
    "TileRun",
    "check_existing_store",
    "find_slides",
    "grid_coords",
    "plan_bands",
    "qc_path",
    "read_band",
    "read_status_csv",
    "render_qc",
    "slide_stem",
    "tile_slide",
    "tile_slides",
    "write_status_csv",
]
