"""Coordinates a feature file cannot mean as (N, 2) level-0 (x, y) rows are refused (finding 2 of the
feature-file review): ``coords`` stored (2, N) was reshaped to (N, 2) and paired the wrong values, and
duplicate coordinates overwrote each other's map cells; both now fail naming the file, as open_store
refuses a store's duplicates. CLAM's (N, 1, 2) and TRIDENT's empty files still read. Duplicates are refused
where patches are mapped (grid_layout: heatmap --features), not by train, which places no patch on a map
(review AI, finding 3: a file of several bags with placeholder coordinates trained before)."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from wsi_milssl.cli import main
from wsi_milssl.errors import StoreError
from wsi_milssl.features import read_feature_file


def _grid(rows=3, cols=4, step=256):
    ys, xs = np.mgrid[0:rows, 0:cols]
    return np.stack([xs.ravel() * step, ys.ravel() * step], axis=1)


def _clam_file(path, coords, n=None):
    n = len(_grid()) if n is None else n
    with h5py.File(path, "w") as fh:
        fh.create_dataset("features", data=np.random.default_rng(0).normal(size=(n, 4)).astype(np.float32))
        fh.create_dataset("coords", data=coords)
    return path


def test_coords_stored_two_by_n_are_refused(tmp_path):
    path = _clam_file(tmp_path / "s.h5", np.ascontiguousarray(_grid().T).astype(np.int32))
    with pytest.raises(StoreError) as err:
        read_feature_file(path)  # was: reshaped to (12, 2), x and y paired wrongly
    msg = str(err.value)
    assert str(path) in msg and "(2, 12)" in msg and "(N, 2)" in msg and "Fix:" in msg
    flat = _clam_file(tmp_path / "f.h5", _grid().ravel())
    with pytest.raises(StoreError, match=r"\(24,\)"):
        read_feature_file(flat)


def test_duplicate_coordinates_are_refused_where_patches_are_mapped(tmp_path):
    coords = _grid()
    coords[5] = coords[2]
    path = _clam_file(tmp_path / "s.h5", coords)
    ff = read_feature_file(path)  # train reads it: it places no patch on a map
    with pytest.raises(StoreError) as err:
        ff.grid_layout(slide_mpp=0.25)
    msg = str(err.value)
    assert str(path) in msg and "1 duplicate coordinate" in msg and f"({coords[2][0]}, {coords[2][1]})" in msg


def test_n_by_one_by_two_and_empty_coords_still_read(tmp_path):
    ff = read_feature_file(_clam_file(tmp_path / "a.h5", _grid()[:, None, :]))
    np.testing.assert_array_equal(ff.coords, _grid())
    ff = read_feature_file(_clam_file(tmp_path / "b.h5", _grid()))
    np.testing.assert_array_equal(ff.coords, _grid())
    with h5py.File(tmp_path / "e.h5", "w") as fh:  # TRIDENT's file of a slide without patches
        fh.create_dataset("features", data=np.zeros(0, np.float32))
        fh.create_dataset("coords", data=np.zeros(0, np.int64))
    ff = read_feature_file(tmp_path / "e.h5")
    assert len(ff) == 0 and ff.coords.shape == (0, 2)


def test_one_position_in_two_bags_of_a_file_of_several_bags_is_no_duplicate(tmp_path):
    coords = np.concatenate([_grid(), _grid()])
    path = _clam_file(tmp_path / "bags.h5", coords, n=len(coords))
    with h5py.File(path, "a") as fh:
        fh.create_dataset("bag_ids", data=np.repeat([b"a", b"b"], len(_grid())))
    assert read_feature_file(path).grid_layout(slide_mpp=0.25).stride_lv0 == 256
    with h5py.File(path, "a") as fh:
        fh["bag_ids"][...] = np.repeat([b"a"], 24)
    with pytest.raises(StoreError, match="12 duplicate"):
        read_feature_file(path).grid_layout(slide_mpp=0.25)


def test_train_reads_a_file_of_several_bags_with_placeholder_coordinates(tmp_path, capsys):
    """A MIL-CSV-style file of 8 bags whose coords are all (0, 0): refused by train since 5725f4c ('72
    duplicate coordinate(s) ... two patches would fall on one map cell'), though training maps no patch."""
    rng = np.random.default_rng(0)
    bags = [f"b{i}" for i in range(8)]
    with h5py.File(tmp_path / "bags.h5", "w") as fh:
        fh.create_dataset("features", data=rng.normal(size=(80, 8)).astype(np.float32))
        fh.create_dataset("coords", data=np.zeros((80, 2), np.int64))
        fh.create_dataset("bag_ids", data=np.repeat([b.encode() for b in bags], 10))
    (tmp_path / "labels.csv").write_text("slide,label\n" + "".join(f"{b},{i % 2}\n" for i, b in enumerate(bags)))
    rc = main(["train", str(tmp_path / "bags.h5"), "--labels", str(tmp_path / "labels.csv"), "--out",
               str(tmp_path / "run"), "--epochs", "1", "--threads", "1", "--no-plots"])
    assert rc == 0, capsys.readouterr().err
    assert (tmp_path / "run" / "last.pt").exists()


def test_floating_point_coords_are_rounded_to_the_nearest_pixel_and_nan_refused(tmp_path):
    """Review EL, B1: coordinates stored as floats with rounding noise (2431.9999999) were cut down (to 2431), so
    the heatmap refused the file for a 1-px step and blamed the tiling level."""
    noisy = _grid().astype(np.float64)
    noisy[1::2] -= 1e-7
    ff = read_feature_file(_clam_file(tmp_path / "f.h5", noisy))
    np.testing.assert_array_equal(ff.coords, _grid())
    assert ff.grid_layout(slide_mpp=0.25) is not None
    bad = noisy.copy()
    bad[3, 0] = np.nan
    with pytest.raises(StoreError, match=r"NaN or infinite") as err:
        read_feature_file(_clam_file(tmp_path / "n.h5", bad))
    assert str(tmp_path / "n.h5") in str(err.value)


def test_a_recorded_slide_size_too_large_for_a_map_fails_that_file(tmp_path):
    """Review ES, B5: a feature file recording a 2e9 x 2e9 px slide made `heatmap --features` ask numpy for 55 TiB:
    a traceback, and the rest of the batch was lost. It is one error of that file now."""
    path = _clam_file(tmp_path / "s.h5", _grid())
    with h5py.File(path, "a") as fh:
        fh.attrs["dimensions_lv0"] = np.array([2_000_000_000, 2_000_000_000])
    with pytest.raises(StoreError, match=r"s\.h5: its patches would sit on a map of \d+ x \d+ cells .* more than"):
        read_feature_file(path).grid_layout(slide_mpp=0.25)
