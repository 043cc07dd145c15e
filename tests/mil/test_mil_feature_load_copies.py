"""Feature files are loaded into one preallocated float32 array (review AU 3): the same arrays as the
concatenate-then-reorder of before, bit for bit, without its three copies of the cohort."""

from __future__ import annotations

import tracemalloc

import h5py
import numpy as np

from wsi_milssl.mil.data import _gather_rows, read_feature_files


def _old_gather(parts, order):
    return np.concatenate([np.asarray(p, dtype=np.float32) for p in parts])[order]


def test_gather_rows_matches_concatenate_then_reorder():
    rng = np.random.default_rng(1)
    for dtype in (np.float16, np.float32):
        parts = [rng.normal(size=(n, 5)).astype(dtype) for n in (4, 1, 9, 3, 6)]
        for order in (np.arange(23), rng.permutation(23), np.r_[9:14, 0:4, 14:23, 4:9]):
            want = _old_gather(parts, order)
            got = _gather_rows(list(parts), order)
            assert got.dtype == np.float32 and got.flags.c_contiguous
            np.testing.assert_array_equal(got, want)


def _write(path, feats, bag_ids=None, stem=None):
    with h5py.File(path, "w") as f:
        f.create_dataset("features", data=feats)
        if bag_ids is not None:
            f.create_dataset("bag_ids", data=np.array(bag_ids, dtype=h5py.string_dtype()))
        if stem is not None:
            f.attrs["slide_stem"] = stem


def test_files_of_mixed_dtypes_sizes_and_interleaved_bags_load_bit_identically(tmp_path):
    rng = np.random.default_rng(2)
    files = {
        "zeta": rng.normal(size=(7, 6)).astype(np.float16),
        "alpha": rng.normal(size=(3, 6)).astype(np.float32),
        "mid": rng.normal(size=(5, 6)).astype(np.float64) * 1e3,
    }
    for stem, feats in files.items():
        _write(tmp_path / f"{stem}.h5", feats, stem=stem)
    multi = rng.normal(size=(6, 6)).astype(np.float32)
    multi_ids = ["b2", "b1", "b2", "b1", "b3", "b2"]  # bags interleaved within one file
    _write(tmp_path / "multi.h5", multi, bag_ids=multi_ids)
    labels = {"zeta": 1, "alpha": 0, "mid": 1, "b1": 0, "b2": 1, "b3": 0}
    inst = read_feature_files(sorted(tmp_path.glob("*.h5"), reverse=True), labels)
    rows = {stem: np.asarray(f, dtype=np.float32) for stem, f in files.items()}
    for b in ("b1", "b2", "b3"):
        rows[b] = multi[[i for i, x in enumerate(multi_ids) if x == b]]
    assert inst.bag_names == sorted(labels)
    want = np.concatenate([rows[name] for name in inst.bag_names])
    assert inst.features.dtype == np.float32
    np.testing.assert_array_equal(inst.features, want)
    np.testing.assert_array_equal(inst.bag_ids, np.repeat(np.arange(6), [len(rows[n]) for n in inst.bag_names]))


def test_loading_holds_at_most_the_files_and_the_result(tmp_path):
    rng = np.random.default_rng(3)
    n_files, n, dim = 12, 400, 64
    for i in range(n_files):
        _write(tmp_path / f"s{i:02d}.h5", rng.normal(size=(n, dim)).astype(np.float32), stem=f"s{i:02d}")
    labels = {f"s{i:02d}": i % 2 for i in range(n_files)}
    size = n_files * n * dim * 4
    tracemalloc.start()
    try:
        inst = read_feature_files(sorted(tmp_path.glob("*.h5")), labels)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert inst.features.nbytes == size
    assert peak < 2.4 * size, f"peak {peak / size:.2f}x the feature array"  # before: 3 copies
