"""Opening stores that are missing, incomplete, corrupt or of another schema fails with a clear message."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import zarr

from wsi_milssl.errors import StoreError, StoreReadError
from wsi_milssl.store import create_writer, open_store

FORMATS = ["h5", "zarr"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_missing_and_wrong_suffix(tmp_path, fmt):
    with pytest.raises(StoreError, match=rf"nope\.{fmt}: patch store not found\. Fix: check the path"):
        open_store(tmp_path / f"nope.{fmt}")
    (tmp_path / "x.npy").write_bytes(b"")
    with pytest.raises(StoreError, match=r"not a patch store path \(expected a name ending in \.h5 or \.zarr\)"):
        open_store(tmp_path / "x.npy")


@pytest.mark.parametrize("fmt", FORMATS)
def test_partial_store_is_not_opened(tmp_path, fmt):
    w = create_writer(tmp_path / f"s.{fmt}", pixels="none", patch_size_px=8)
    w.append(coords=np.zeros((2, 2)), entropy_bits=np.ones(2), tissue_fraction=np.ones(2))
    assert w.partial_path.exists() and not (tmp_path / f"s.{fmt}").exists()
    with pytest.raises(StoreError, match="incomplete store .*re-run `wsi-milssl tile`"):
        open_store(w.partial_path)
    with pytest.raises(StoreError, match="not found"):
        open_store(tmp_path / f"s.{fmt}")
    w.abort()
    assert not w.partial_path.exists()


@pytest.mark.parametrize("fmt", FORMATS)
def test_writer_context_removes_partial_on_error(tmp_path, fmt):
    with pytest.raises(RuntimeError, match="boom"):
        with create_writer(tmp_path / f"s.{fmt}", pixels="jpeg", patch_size_px=8) as w:
            w.append(coords=np.zeros((1, 2)), entropy_bits=[6.0], tissue_fraction=[1.0], patches=[b"\xff\xd8"])
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_corrupt_files(tmp_path):
    (tmp_path / "bad.h5").write_bytes(b"this is not hdf5" * 10)
    # a StoreReadError: the error of the process that opened it (a training reader reopening it, review BM)
    with pytest.raises(StoreReadError, match=r"bad\.h5: cannot read the patch store .*Fix: .*re-run `wsi-milssl tile`"):
        open_store(tmp_path / "bad.h5")
    (tmp_path / "bad.zarr").mkdir()
    with pytest.raises(StoreError, match=r"no zarr\.json in this folder"):
        open_store(tmp_path / "bad.zarr")
    with h5py.File(tmp_path / "foreign.h5", "w") as f:
        f["coords"] = np.zeros((1, 2), np.int64)
    with pytest.raises(StoreError, match="not a wsi-milssl patch store"):
        open_store(tmp_path / "foreign.h5")


@pytest.mark.parametrize("fmt", FORMATS)
def test_schema_version_and_incomplete_flag(tmp_path, make_store, fmt):
    path = tmp_path / f"s.{fmt}"
    make_store(path, pixels="none")

    def set_attr(key, value):
        if fmt == "h5":
            with h5py.File(path, "r+") as f:
                f.attrs[key] = value
        else:
            zarr.open_group(path, mode="r+").attrs[key] = value

    set_attr("schema_version", 99)
    with pytest.raises(StoreError, match="schema version 99 differs .*upgrade wsi-milssl"):
        open_store(path)
    set_attr("schema_version", 0)
    with pytest.raises(StoreError, match="schema version 0 differs .*--overwrite"):
        open_store(path)
    set_attr("schema_version", 1)
    set_attr("complete", False)
    with pytest.raises(StoreError, match="the store is incomplete"):
        open_store(path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_bad_indices_and_batches(tmp_path, make_store, fmt):
    make_store(tmp_path / f"s.{fmt}", n=5)
    with open_store(tmp_path / f"s.{fmt}") as store:
        with pytest.raises(IndexError, match="out of range for a store of 5 patches"):
            store.read_patches([5])
        with pytest.raises(IndexError, match="must be integers"):
            store.read_patches([0.5])
        with pytest.raises(StoreError, match="no array 'tumor_fraction' .*wsi-milssl label"):
            store.read_array("tumor_fraction")
    w = create_writer(tmp_path / f"t.{fmt}", pixels="raw", patch_size_px=8)
    with pytest.raises(ValueError, match=r"raw patches must be uint8 \(1, 8, 8, 3\)"):
        w.append(coords=np.zeros((1, 2)), entropy_bits=[1.0], tissue_fraction=[1.0],
                 patches=np.zeros((1, 4, 4, 3), np.uint8))
    with pytest.raises(ValueError, match="differ in length"):
        w.append(coords=np.zeros((2, 2)), entropy_bits=[1.0], tissue_fraction=[1.0])
    w.abort()


def test_a_jpeg_patch_declaring_a_huge_size_is_refused_before_it_is_decoded(tmp_path, make_store, monkeypatch):
    """Review ES, B7: a 3 KB patch whose frame header declares 40000 x 40000 px was decoded whole (5.5 GB) before
    its shape was checked. The declared size is read first now, and the decoder never sees such a patch."""
    import struct

    from wsi_milssl.store import base

    path = tmp_path / "s.h5"
    make_store(path)
    with h5py.File(path, "a") as fh:
        data = bytearray(fh["patches"][0].tobytes())
        sof = data.find(b"\xff\xc0")
        data[sof + 5:sof + 9] = struct.pack(">HH", 40000, 40000)
        fh["patches"][0] = np.frombuffer(bytes(data), np.uint8)
    decoded = []
    real = base.decode_jpeg
    monkeypatch.setattr(base, "decode_jpeg", lambda d, **k: decoded.append(1) or real(d, **k))
    with open_store(path) as store, pytest.raises(StoreError, match=r"patch 0 declares 40000 x 40000 px, expected "):
        store.read_patches([0])
    assert decoded == []
    # the bytes handed to a GPU decoder (decode = 'device': nvJPEG) are checked as they are read, too
    with open_store(path) as store:
        assert len(store.read_jpeg([1])) == 1
        for read in (lambda: store.read_jpeg([1, 0]), lambda: store.read_array("patches")):
            with pytest.raises(StoreError, match=r"patch 0 declares 40000 x 40000 px, expected "):
                read()
