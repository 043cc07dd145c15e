"""Helpers of the feature-stage tests: the tile recipe of their stores, and feature files written the
way TRIDENT and CLAM write theirs."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np

from wsi_milssl.config import TileConfig

#: The tile recipe of the test stores: coarse, so a random ResNet50 embeds a slide in a second or two.
TILE = TileConfig(target_mpp=2.0, patch_size_px=32, entropy_threshold_bits=3.0, min_tissue=0.3, mask_mpp=8.0)


def trident_save_h5(path: Path, assets: dict, attributes: dict | None = None, mode: str = "w") -> None:
    """What TRIDENT's ``trident.IO.save_h5`` does (v0.2, ``WSI.extract_patch_features`` calls it with
    ``features`` (N, D) float32 and the coordinate file's ``coords`` int64 and attributes): chunks of one
    row, resizable first axis, attributes on the datasets, dicts as JSON and None as 'None'."""
    with h5py.File(path, mode) as file:
        for key, val in assets.items():
            if key not in file:
                dset = file.create_dataset(key, shape=val.shape, maxshape=(None,) + val.shape[1:],
                                           chunks=(1,) + val.shape[1:], dtype=val.dtype)
                dset[:] = val
                for attr_key, attr_val in (attributes or {}).get(key, {}).items():
                    if isinstance(attr_val, dict):
                        attr_val = json.dumps(attr_val)
                    elif attr_val is None:
                        attr_val = "None"
                    dset.attrs[attr_key] = attr_val
            else:
                dset = file[key]
                dset.resize(len(dset) + val.shape[0], axis=0)
                dset[-val.shape[0]:] = val


def write_trident_features(folder: Path, name: str, features: np.ndarray, coords: np.ndarray, *,
                           patch_size: int, src_mag: float, dst_mag: float, width: int, height: int,
                           encoder: str = "conch_v15") -> Path:
    """A TRIDENT patch-feature file ``folder/<name>.h5``: the coords attributes of ``trident.IO.coords_to_h5``
    and the features attributes of ``WSI.extract_patch_features``; a slide without patches gets features of
    shape (0,) as TRIDENT writes them."""
    folder.mkdir(parents=True, exist_ok=True)
    coords_attrs = {"patch_size": patch_size, "patch_size_level0": patch_size * src_mag // dst_mag,
                    "level0_magnification": src_mag, "target_magnification": dst_mag, "overlap": 0, "name": name,
                    "savetodir": str(folder), "level0_width": width, "level0_height": height}
    path = folder / f"{name}.h5"
    trident_save_h5(path, {"features": features, "coords": coords},
                    {"features": {"name": name, "savetodir": str(folder), "encoder": encoder}, "coords": coords_attrs})
    return path


def write_clam_features(folder: Path, slide_id: str, features: np.ndarray, coords: np.ndarray, *,
                        batch: int = 16) -> Path:
    """A CLAM feature file ``folder/h5_files/<slide_id>.h5`` as ``extract_features_fp.py`` writes it: batch
    by batch through ``utils.file_utils.save_hdf5`` (mode 'w' then 'a', chunks of 32 rows), features
    float32, coords int32, no attributes."""
    out = folder / "h5_files" / f"{slide_id}.h5"
    out.parent.mkdir(parents=True, exist_ok=True)
    mode = "w"
    for start in range(0, len(features), batch):
        assets = {"features": features[start:start + batch].astype(np.float32),
                  "coords": coords[start:start + batch].astype(np.int32)}
        with h5py.File(out, mode) as file:
            for key, val in assets.items():
                if key not in file:
                    dset = file.create_dataset(key, shape=val.shape, maxshape=(None,) + val.shape[1:],
                                               chunks=(32,) + val.shape[1:], dtype=val.dtype)
                    dset[:] = val
                else:
                    dset = file[key]
                    dset.resize(len(dset) + val.shape[0], axis=0)
                    dset[-val.shape[0]:] = val
        mode = "a"
    return out
