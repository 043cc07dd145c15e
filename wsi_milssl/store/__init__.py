"""The patch-store contract (``schema``) and its HDF5 and Zarr backends behind one reader API.

    from wsi_milssl.store import open_store, write_arrays, find_stores

    with open_store("tiles/synth_000.h5") as store:     # or .zarr
        coords = store.coords                            # int64 (N, 2) level-0 top-left x, y
        patches = store.read_patches([0, 5, 7])          # uint8 (3, H, W, 3) RGB
"""

from wsi_milssl.store import schema
from wsi_milssl.store.api import create_writer, find_stores, open_store, write_arrays
from wsi_milssl.store.base import PatchStore, StoreWriter, decode_jpeg, encode_jpeg
from wsi_milssl.store.schema import SCHEMA_VERSION

__all__ = [
    "SCHEMA_VERSION",
    "PatchStore",
    "StoreWriter",
    "create_writer",
    "decode_jpeg",
    "encode_jpeg",
    "find_stores",
    "open_store",
    "schema",
    "write_arrays",
]
