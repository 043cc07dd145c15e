"""A feature file's bag is named by its ``slide_stem`` attribute (else its file name); two files of one bag name
the other file and the fix (review DB: a renamed copy said only "appears in more than one file")."""

from __future__ import annotations

import re

import h5py
import numpy as np
import pytest

from wsi_milssl.errors import ConfigError
from wsi_milssl.mil.data import read_feature_files


def _write(path, stem: str | None, seed: int) -> None:
    with h5py.File(path, "w") as fh:
        fh["features"] = np.random.default_rng(seed).normal(size=(5, 4)).astype(np.float32)
        fh["coords"] = np.stack([np.arange(5) * 256, np.zeros(5, np.int64)], 1)
        if stem is not None:
            fh.attrs["slide_stem"] = stem


def test_a_renamed_file_of_a_bag_names_the_other_file_and_the_attribute(tmp_path):
    _write(tmp_path / "s0.h5", "s0", 0)
    _write(tmp_path / "s1.h5", "s1", 1)
    _write(tmp_path / "x_s0.h5", "s0", 2)  # renamed to match a labels file: still bag s0
    labels = {"s0": 0, "s1": 1, "x_s0": 1}
    with pytest.raises(ConfigError, match=re.escape(
            f"{tmp_path / 'x_s0.h5'}: bag 's0' (named by the file's slide_stem attribute) is also in "
            f"{tmp_path / 's0.h5'}; each bag must live in one file. Fix: remove the copy")):
        read_feature_files([tmp_path], labels)
    (tmp_path / "x_s0.h5").unlink()
    _write(tmp_path / "x_s0.h5", None, 2)  # without the attribute: named by the file
    assert sorted(read_feature_files([tmp_path], labels).bag_names) == ["s0", "s1", "x_s0"]


def test_a_file_named_twice_is_read_once(tmp_path):
    """Review DT: a folder and a file in it (or one folder spelled two ways) said the bag was "also in" itself."""
    _write(tmp_path / "s0.h5", "s0", 0)
    _write(tmp_path / "s1.h5", "s1", 1)
    labels = {"s0": 0, "s1": 1}
    both = read_feature_files([tmp_path, tmp_path / "s0.h5", tmp_path / "." / "s1.h5"], labels)
    assert sorted(both.bag_names) == ["s0", "s1"] and len(both) == 10
