"""`train` on a folder with several damaged feature files or stores names every one of them in its one
error, not only the first (finding 7 of the feature-file review); it still refuses to train."""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import pytest

from wsi_milssl.cli import main
from wsi_milssl.config import TileConfig
from wsi_milssl.errors import StoreError
from wsi_milssl.features import write_feature_file
from wsi_milssl.mil.data import read_feature_files, read_patch_stores
from wsi_milssl.tiling import find_slides, tile_slides

NAMES = [f"s{i}" for i in range(4)]


def _cut_short(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


def _feature_folder(root):
    ys, xs = np.mgrid[0:4, 0:4]
    coords = np.stack([xs.ravel() * 512, ys.ravel() * 512], axis=1)
    for i, name in enumerate(NAMES):
        write_feature_file(root / f"{name}.h5", features=np.random.default_rng(i).normal(size=(16, 8)).astype(np.float32),
                           coords=coords, attrs={"slide_stem": name, "mpp": 0.25}, coords_attrs={},
                           features_attrs={})
    (root / "labels.csv").write_text("slide,label\n" + "".join(f"{n},{i % 2}\n" for i, n in enumerate(NAMES)))
    return root


def test_every_damaged_feature_file_is_named(tmp_path, capsys):
    root = _feature_folder(tmp_path / "feats")
    _cut_short(root / "s1.h5")
    _cut_short(root / "s3.h5")
    with pytest.raises(StoreError) as err:
        read_feature_files(sorted(root.glob("*.h5")), {n: i % 2 for i, n in enumerate(NAMES)})
    msg = str(err.value)
    assert "2 of 4 feature files cannot be read" in msg
    assert str(root / "s1.h5") in msg and str(root / "s3.h5") in msg  # was: s1 alone
    assert msg.count("looks damaged") == 2
    rc = main(["train", str(root), "--labels", str(root / "labels.csv"), "--out", str(tmp_path / "run"),
               "--epochs", "1", "--threads", "1", "--no-plots"])
    assert rc != 0 and not (tmp_path / "run" / "last.pt").exists()
    err = capsys.readouterr().err
    assert str(root / "s1.h5") in err and str(root / "s3.h5") in err


def test_every_damaged_store_is_named(tmp_path, synth_dir):
    tile = TileConfig(target_mpp=4.0, patch_size_px=32, entropy_threshold_bits=3.0, min_tissue=0.3, mask_mpp=8.0,
                      threads=1)
    assert tile_slides(find_slides([synth_dir]), tmp_path / "st", tile).ok
    stores = tmp_path / "st"
    for k in range(2):  # four stores: two copies of each slide's
        for name in ("synth_000", "synth_001"):
            if k:  # a store names its slide as its file does
                shutil.copy(stores / f"{name}.h5", stores / f"{name}_b.h5")
                with h5py.File(stores / f"{name}_b.h5", "a") as fh:
                    fh.attrs["slide_stem"] = f"{name}_b"
    _cut_short(stores / "synth_000.h5")
    _cut_short(stores / "synth_001_b.h5")
    labels = {"synth_000": 1, "synth_001": 0, "synth_000_b": 1, "synth_001_b": 0}
    with pytest.raises(StoreError) as err:
        read_patch_stores([stores], labels)
    msg = str(err.value)
    assert "2 of 4 stores cannot be read" in msg
    assert str(stores / "synth_000.h5") in msg and str(stores / "synth_001_b.h5") in msg
