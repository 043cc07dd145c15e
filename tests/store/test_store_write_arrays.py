"""write_arrays: add or replace per-patch arrays and attributes, all or nothing; find_stores."""

from __future__ import annotations

import numpy as np
import pytest

from wsi_milssl.errors import StoreError
from wsi_milssl.store import find_stores, open_store, write_arrays

FORMATS = ["h5", "zarr"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_add_then_replace_arrays_and_attrs(tmp_path, make_store, fmt):
    path = tmp_path / f"s.{fmt}"
    made = make_store(path, pixels="jpeg", n=12)
    frac = np.linspace(0, 1, 12)  # float64 in, float32 stored
    write_arrays(path, {"tumor_fraction": frac, "instance_label": frac >= 0.25}, attrs={"slide_label": 1})
    with open_store(path) as s:
        tf = s.read_array("tumor_fraction")
        assert tf.dtype == np.float32
        np.testing.assert_allclose(tf, frac, rtol=1e-6)
        il = s.read_array("instance_label")
        assert il.dtype == np.uint8 and il.tolist() == (frac >= 0.25).astype(int).tolist()
        assert s.attrs["slide_label"] == 1
        assert s.read_jpeg([3]) == [made["jpeg"][3]]  # pixels untouched
    write_arrays(path, {"tumor_fraction": np.zeros(12)}, attrs={"slide_label": 0, "note": "relabelled"})
    with open_store(path) as s:
        assert s.read_array("tumor_fraction").tolist() == [0.0] * 12
        assert s.read_array("instance_label").sum() == 9  # kept
        assert s.attrs["slide_label"] == 0 and s.attrs["note"] == "relabelled"
        np.testing.assert_array_equal(s.coords, made["coords"])
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != path.name]
    assert leftovers == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_invalid_updates_change_nothing(tmp_path, make_store, fmt):
    path = tmp_path / f"s.{fmt}"
    make_store(path, pixels="none", n=6)
    write_arrays(path, {"tumor_fraction": np.ones(6)})
    with pytest.raises(StoreError, match=r"array 'instance_label' has shape \(5,\) but the store has 6 patches"):
        write_arrays(path, {"tumor_fraction": np.zeros(6), "instance_label": np.zeros(5)})
    with pytest.raises(StoreError, match="'coords' is written by the tile stage and cannot be replaced"):
        write_arrays(path, {"coords": np.zeros((6, 2))})
    with pytest.raises(StoreError, match="attribute 'mpp' is set by the tile stage"):
        write_arrays(path, {}, attrs={"mpp": 1.0})
    with pytest.raises(StoreError, match="attribute 'meta' has value"):
        write_arrays(path, {}, attrs={"meta": {"a": 1}})
    with pytest.raises(StoreError, match="must be float32; got <U1"):
        write_arrays(path, {"tumor_fraction": np.array(list("abcdef"))})
    with open_store(path) as s:
        assert s.read_array("tumor_fraction").tolist() == [1.0] * 6
        assert not s.has("instance_label")


def test_find_stores(tmp_path, make_store):
    make_store(tmp_path / "b.h5", pixels="none", n=2)
    make_store(tmp_path / "a.zarr", pixels="none", n=2)
    (tmp_path / "c.h5.partial").write_bytes(b"")
    (tmp_path / "qc").mkdir()
    (tmp_path / "tile_status.csv").write_text("slide\n")
    (tmp_path / ".hidden.h5").write_bytes(b"")
    found = find_stores(tmp_path)
    assert [p.name for p in found] == ["a.zarr", "b.h5"]
    assert find_stores([tmp_path / "b.h5", tmp_path, tmp_path / "a.zarr"]) == found
    with pytest.raises(StoreError, match="no such file or folder"):
        find_stores(tmp_path / "missing")
    with pytest.raises(StoreError, match="not a patch store"):
        find_stores(tmp_path / "tile_status.csv")


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_link_to_a_store_stays_a_link_and_the_store_it_names_is_written(tmp_path, make_store, fmt):
    """Was: the link replaced by a labelled copy, the real store left without the labels."""
    real = tmp_path / "stores" / f"s.{fmt}"
    real.parent.mkdir()
    make_store(real, pixels="none", n=4)
    link = tmp_path / "links" / f"s.{fmt}"
    link.parent.mkdir()
    link.symlink_to(real)
    write_arrays(link, {"instance_label": np.array([0, 1, 1, 0], dtype=np.uint8)})
    assert link.is_symlink()
    with open_store(real) as store:
        np.testing.assert_array_equal(store.read_array("instance_label"), [0, 1, 1, 0])
