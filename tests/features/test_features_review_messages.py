"""The messages of review findings F8 and F9: a damaged feature file (in `features` and in `train`), feature
files of different lengths, and tile options given with stores."""

from __future__ import annotations

import numpy as np
import pytest

from wsi_milssl.cli import main
from wsi_milssl.config import FeaturesConfig
from wsi_milssl.errors import StoreError
from wsi_milssl.features import extract_features, read_feature_file, write_feature_file
from wsi_milssl.mil.data import read_feature_files

FAST = FeaturesConfig(encoder="resnet18", weights="random", num_workers=0, batch_size=64, amp="off")


def _cut_short(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_a_damaged_feature_file_names_the_one_file_to_delete(tmp_path, labelled_stores, synth_dir, capsys):
    feats = tmp_path / "feats"
    assert extract_features([labelled_stores], feats, FAST).ok
    _cut_short(feats / "synth_000.h5")
    # features: that file alone can be deleted; --overwrite embeds every slide again
    run = extract_features([labelled_stores], feats, FAST)
    assert [r.status for r in run.results] == ["failed", "skipped"]
    error = run.results[0].error
    assert "synth_000.h5: a file is already there but cannot be read, so it looks damaged" in error
    assert "Fix: delete that file (this slide alone is embedded again), or pass --overwrite (every slide is " \
           "embedded again)" in error
    # train: the file looks damaged, not like a file of another kind
    with pytest.raises(StoreError) as err:
        read_feature_file(feats / "synth_000.h5")
    assert "synth_000.h5: the file looks damaged" in str(err.value)
    assert "Fix: delete it and make it again" in str(err.value)
    assert "`wsi-milssl run PIPELINE --force features`" in str(err.value)
    capsys.readouterr()
    rc = main(["train", str(feats), "--labels", str(synth_dir / "labels.csv"), "--out", str(tmp_path / "run"),
               "--epochs", "1", "--threads", "1", "--no-plots"])
    assert rc != 0 and "the file looks damaged" in capsys.readouterr().err
    # a file that is no HDF5 at all keeps its own message
    (tmp_path / "notes.h5").write_text("not hdf5")
    with pytest.raises(StoreError, match="cannot open as HDF5"):
        read_feature_file(tmp_path / "notes.h5")


def test_feature_files_of_different_lengths_are_named(tmp_path):
    coords = np.array([[0, 0], [256, 0]])
    for name, dim in (("a", 8), ("b", 16)):
        write_feature_file(tmp_path / f"{name}.h5", features=np.zeros((2, dim), np.float32), coords=coords,
                           attrs={"slide_stem": name}, coords_attrs={}, features_attrs={})
    with pytest.raises(StoreError) as err:
        read_feature_files([tmp_path / "a.h5", tmp_path / "b.h5"], {"a": 0, "b": 1})
    assert f"feature files disagree on the feature length ([8, 16]): {tmp_path / 'a.h5'} holds 8-d features, " \
           f"{tmp_path / 'b.h5'} 16-d" in str(err.value)


def test_tile_options_with_stores_say_they_cut_slides_only(tmp_path, labelled_stores, capsys):
    rc = main(["features", str(labelled_stores), "--out", str(tmp_path / "f"), "--magnification", "20",
               "--encoder", "resnet18", "--weights", "random", "--workers", "0"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "tiled at 2 µm/px with 32 px patches, but the tile settings given (0.5 µm/px, 512 px: " \
           "--magnification" in err
    assert "apply to slides cut on the fly only: a store is embedded as it was tiled. Fix: drop those options" in err


def test_a_feature_file_with_damaged_hdf5_structures_is_one_error_naming_it(tmp_path):
    """Review BW: bytes flipped in an HDF5 file's own structures (a heap, an object header) made h5py raise
    RuntimeError, KeyError or ValueError, which `train` showed as a traceback."""
    import h5py

    good = tmp_path / "good.h5"
    rng = np.random.default_rng(0)
    with h5py.File(good, "w") as fh:
        fh["features"] = rng.normal(size=(40, 8)).astype(np.float32)
        fh["coords"] = np.stack([np.arange(40) * 32, np.zeros(40)], 1).astype(np.int64)
    data = good.read_bytes()
    outcomes = {"read": 0, "refused": 0}
    for seed in range(150):
        damaged = bytearray(data)
        for pos in np.random.default_rng(seed).integers(0, len(data), 8):
            damaged[pos] ^= 0xFF
        path = tmp_path / "bag.h5"
        path.write_bytes(bytes(damaged))
        try:
            read_feature_file(path)  # flips in the data alone read (HDF5 keeps no checksums by default)
            outcomes["read"] += 1
        except StoreError as exc:
            assert str(exc).startswith(f"{path}: "), exc
            outcomes["refused"] += 1
    assert outcomes["refused"] > 50, outcomes


def test_intact_files_with_odd_contents_are_not_called_damaged(tmp_path):
    """Review BY: catching h5py's error types everywhere called an intact file with latin-1 bag ids or text
    coordinates damaged ("delete it and make it again"); only errors raised inside h5py are damage."""
    import h5py

    latin = tmp_path / "latin.h5"
    with h5py.File(latin, "w") as fh:
        fh["features"] = np.zeros((2, 3), np.float32)
        fh["bag_ids"] = np.array([b"caf\xe9", b"x"])
    with pytest.raises(StoreError, match=r"latin.h5: its 'bag_ids' are not UTF-8 text \(b'caf\\xe9'\.\.\.\)\. Fix: "):
        read_feature_file(latin)
    text = tmp_path / "text.h5"
    with h5py.File(text, "w") as fh:
        fh["features"] = np.zeros((2, 3), np.float32)
        fh["coords"] = np.array([[b"a", b"b"], [b"c", b"d"]])
    with pytest.raises(StoreError, match=r"text.h5: 'coords' must hold numbers \(level-0 x, y pixels\); got \|S1\."):
        read_feature_file(text)
