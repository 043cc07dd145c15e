"""The order inputs are listed in, and the names of the folders that hold them, do not change a fixed-seed
run (review AK, finding 2): `train ftr/s3.h5 ftr/s1.h5 ...` and `train ftr` trained different weights, and
stores found in two folders were taken in the order of their full paths. Bags are now read in name order."""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import torch

from wsi_milssl.cli import main
from wsi_milssl.mil.data import read_feature_files, read_patch_stores

BASE = ["--epochs", "2", "--threads", "1", "--workers", "0", "--no-plots", "--amp", "off", "--seed", "3"]
NAMES = ["s0", "s1", "s2", "s3", "s4", "s5"]


def _clam_folder(folder):
    folder.mkdir(parents=True)
    for i, name in enumerate(NAMES):
        rng = np.random.default_rng(i)
        feats = rng.normal(size=(5 + i, 8)).astype(np.float32)
        feats[:2] += 3.0 * (i % 2)
        with h5py.File(folder / f"{name}.h5", "w") as f:
            f.create_dataset("features", data=feats)
            f.create_dataset("coords", data=np.stack([np.arange(5 + i) * 256, np.zeros(5 + i, np.int64)], 1))
            f.create_dataset("instance_label", data=(np.arange(5 + i) < 2 * (i % 2)).astype(np.uint8))
    return folder


def _weights(run):
    ckpt = torch.load(run / "last.pt", map_location="cpu", weights_only=False)
    return ckpt["model"]


def test_feature_files_are_read_in_bag_name_order(tmp_path):
    folder = _clam_folder(tmp_path / "ftr")
    labels = {n: i % 2 for i, n in enumerate(NAMES)}
    listed = read_feature_files(sorted(folder.glob("*.h5")), labels)
    shuffled = read_feature_files([folder / f"{n}.h5" for n in ("s3", "s1", "s5", "s0", "s4", "s2")], labels)
    assert listed.bag_names == shuffled.bag_names == NAMES
    for key in ("bag_ids", "bag_labels", "features", "instance_labels"):
        assert np.array_equal(getattr(listed, key), getattr(shuffled, key)), key
    assert listed.bag_sources == shuffled.bag_sources


def test_train_gives_the_same_weights_whatever_the_input_order(tmp_path):
    folder = _clam_folder(tmp_path / "ftr")
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\n" + "".join(f"{n},{i % 2}\n" for i, n in enumerate(NAMES)))
    assert main(["train", str(folder), "--labels", str(labels), "--out", str(tmp_path / "a"), *BASE]) == 0
    listed = [str(folder / f"{n}.h5") for n in ("s3", "s1", "s5", "s0", "s4", "s2")]
    assert main(["train", *listed, "--labels", str(labels), "--out", str(tmp_path / "b"), *BASE]) == 0
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_stores_are_read_in_bag_name_order_whatever_their_folders(tmp_path, image_store_factory):
    paths, labels_csv = image_store_factory(tmp_path / "all", n_bags=4, n_patches=4, size_px=16)
    labels = {line.split(",")[0]: int(line.split(",")[1]) for line in labels_csv.read_text().split()[1:]}
    # the first two slides in a folder whose name sorts after the other folder's
    for folder, part in (("z_first", paths[:2]), ("a_second", paths[2:])):
        (tmp_path / folder).mkdir()
        for p in part:
            shutil.copy(p, tmp_path / folder / p.name)
    split = read_patch_stores([tmp_path / "z_first", tmp_path / "a_second"], labels)
    reversed_ = read_patch_stores([tmp_path / "a_second", tmp_path / "z_first"], labels)
    one = read_patch_stores([tmp_path / "all"], labels)
    assert split.bag_names == reversed_.bag_names == one.bag_names == sorted(labels)
    for key in ("bag_ids", "bag_labels", "local_index", "instance_labels"):
        assert np.array_equal(getattr(split, key), getattr(one, key)), key
    assert [p.rsplit("/", 1)[1] for p in split.store_paths] == [p.name for p in paths]
    assert split.bag_sources == one.bag_sources
