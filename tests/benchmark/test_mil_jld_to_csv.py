"""benchmarks/mil_jld_to_csv.py on small JLD files written here the way Julia's JLD lays them out (object
references per bag to transposed matrices, the labels as a BitArray compound), read back with
read_mil_csv."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
from benchscripts import load_benchmark_script

from wsi_milssl.mil import read_mil_csv


def _module():
    return load_benchmark_script("mil_jld_to_csv")


def _write_jld(path: Path, bags: list[np.ndarray], labels: np.ndarray, *, bitarray: bool = True) -> None:
    with h5py.File(path, "w") as f:
        refs = f.create_group("_refs")
        ref_dtype = h5py.special_dtype(ref=h5py.Reference)
        x = f.create_dataset("X", (len(bags),), dtype=ref_dtype)
        for i, bag in enumerate(bags):
            x[i] = refs.create_dataset(f"{i + 1:08d}", data=bag.T.astype(np.float32)).ref  # Julia: column-major
        if not bitarray:
            f.create_dataset("y", data=labels.astype(np.int64))
            return
        words = np.zeros((len(labels) + 63) // 64, dtype=np.uint64)
        for i, v in enumerate(labels):
            words[i // 64] |= np.uint64(int(v) << (i % 64))
        chunks = refs.create_dataset("chunks", data=words)
        dims = refs.create_dataset("dims", data=np.array([len(labels)], dtype=np.int64))
        comp = np.dtype([("chunks_", ref_dtype), ("len_", "<i8"), ("dims_", ref_dtype)])
        rec = np.array((chunks.ref, len(labels), dims.ref), dtype=comp)
        f.create_dataset("y", data=rec)


def _bags(n_bags: int, rng: np.random.Generator) -> tuple[list[np.ndarray], np.ndarray]:
    bags = [rng.normal(size=(int(rng.integers(1, 6)), 4)).astype(np.float32) for _ in range(n_bags)]
    labels = rng.integers(0, 2, size=n_bags)
    labels[:2] = (0, 1)
    return bags, labels


@pytest.mark.parametrize("bitarray", [True, False])
def test_jld_converts_to_a_mil_csv_with_the_same_bags(tmp_path, bitarray):
    mod = _module()
    rng = np.random.default_rng(3)
    bags, labels = _bags(70, rng)  # more than 64 labels: the BitArray spans two words
    _write_jld(tmp_path / "Fox.jld", bags, labels, bitarray=bitarray)
    assert mod.main([str(tmp_path / "Fox.jld"), "--out-dir", str(tmp_path / "csv")]) == 0
    inst = read_mil_csv(tmp_path / "csv" / "fox.csv")
    assert inst.n_bags == 70
    np.testing.assert_array_equal(inst.bag_labels, labels)
    feats = np.asarray(inst.features)
    np.testing.assert_allclose(feats, np.concatenate(bags), rtol=1e-6, atol=1e-7)
    sizes = np.bincount(np.asarray(inst.bag_ids), minlength=70)
    np.testing.assert_array_equal(sizes, [len(b) for b in bags])


def test_bad_files_are_skipped_with_a_message_naming_them(tmp_path, capsys):
    mod = _module()
    rng = np.random.default_rng(0)
    bags, labels = _bags(5, rng)
    _write_jld(tmp_path / "short.jld", bags, labels[:4], bitarray=False)
    (tmp_path / "text.jld").write_text("not hdf5")
    with h5py.File(tmp_path / "nolabels.jld", "w") as f:
        f.create_dataset("X", data=np.zeros(3))
    _write_jld(tmp_path / "good.jld", bags, labels)
    files = [tmp_path / n for n in ("short.jld", "text.jld", "nolabels.jld", "missing.jld", "good.jld")]
    assert mod.main([str(p) for p in files] + ["--out-dir", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "short.jld: 5 bags but 4 labels" in err
    assert "text.jld: not an HDF5/JLD file" in err
    assert "nolabels.jld: expected datasets 'X'" in err
    assert "missing.jld: no such file" in err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["good.csv"]
