"""Review EA (mutation test): the check, when a store is opened, that every per-patch array has one row per patch
ran in no test (a later check at read time still caught a short array, but only when that array was read)."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import zarr

from wsi_milssl.errors import StoreError
from wsi_milssl.store import open_store


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
@pytest.mark.parametrize("rows", [36, 38])
def test_a_per_patch_array_of_another_length_is_refused_when_the_store_is_opened(tmp_path, make_store, fmt, rows):
    path = tmp_path / f"s.{fmt}"
    make_store(path, pixels="none", n=37)
    entropy = np.linspace(5, 8, rows, dtype=np.float32)
    if fmt == "h5":
        with h5py.File(path, "r+") as f:
            del f["entropy_bits"]
            f["entropy_bits"] = entropy
    else:
        group = zarr.open_group(path, mode="r+")
        attrs = dict(group["entropy_bits"].attrs)
        del group["entropy_bits"]
        group.create_array("entropy_bits", data=entropy).attrs.update(attrs)
    with pytest.raises(StoreError, match=rf"s\.{fmt}: .*array 'entropy_bits' has {rows} rows but 'coords' has 37"):
        open_store(path)
