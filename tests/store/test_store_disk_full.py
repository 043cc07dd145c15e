"""Store writers on a full disk (issue 14 row 1, deliverable 2): an OutputError naming the store and
the fix, the partial store removed, and the process unharmed. HDF5 used to leave the library with a
file it could neither flush nor close, and the process died with a segmentation fault."""

from __future__ import annotations

import errno
import io
import re
import shlex

import numpy as np
import pytest

from diskfaults import can_mount, file_size_limit, full_disk
from wsi_milssl.errors import OutputError, StoreError
from wsi_milssl.store import create_writer, open_store, write_arrays
from wsi_milssl.store import h5_store

FORMATS = ["h5", "zarr"]


def _batch(rng, pixels: str, n: int = 50):
    if pixels == "raw":
        patches = rng.integers(0, 255, (n, 64, 64, 3), dtype=np.uint8)
    elif pixels == "jpeg":
        patches = [rng.bytes(int(rng.integers(2000, 4000))) for _ in range(n)]
    else:
        patches = None
    return dict(coords=rng.integers(0, 10_000, (n, 2)), entropy_bits=np.ones(n), tissue_fraction=np.ones(n),
                patches=patches)


def _write(path, pixels: str, *, batches: int = 10) -> None:
    rng = np.random.default_rng(0)
    with create_writer(path, pixels=pixels, patch_size_px=64) as w:
        for _ in range(batches):
            w.append(**_batch(rng, pixels))
        w.finalize({"pixels": pixels, "patch_size_px": 64})


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("pixels", ["jpeg", "raw"])
@pytest.mark.parametrize("limit", [20_000, 100_000, 180_000])  # below a Zarr chunk or shard
def test_a_write_past_the_file_size_limit_fails_cleanly(tmp_path, fmt, pixels, limit):
    """A real failed write(2) at several points of the store (RLIMIT_FSIZE: EFBIG from the kernel)."""
    path = tmp_path / f"s.{fmt}"
    path_re, tmp_re = re.escape(str(path)), re.escape(str(tmp_path))
    with file_size_limit(limit):
        with pytest.raises(OutputError, match=(
                rf"^{path_re}: cannot write this patch store \(File too large: the file grew past a size limit\)\. "
                rf"Fix: raise the file-size limit \(`ulimit -f`\) or write to another file system than {tmp_re}'s\.$")
                           ) as info:
            _write(path, pixels)
    assert info.value.errno == errno.EFBIG
    assert list(tmp_path.iterdir()) == []  # the partial store is gone
    _write(path, pixels, batches=2)  # the process (and HDF5) still work
    with open_store(path) as store:
        assert len(store) == 100


def test_hdf5_on_a_full_disk_raises_enospc(tmp_path, monkeypatch):
    """ENOSPC itself: a real tmpfs that fills up where the machine allows a mount, else the store's
    file fails its writes with ENOSPC past 150 KB (a fault-injecting file under the HDF5 writer)."""
    path = tmp_path / "disk" / "s.h5"

    class FullDisk(io.FileIO):
        def write(self, data):
            if self.tell() + len(data) > 150_000:
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(data)

    def attempt() -> None:
        path_re, folder_re = re.escape(str(path)), re.escape(str(path.parent))
        df = re.escape(f"df -h {shlex.quote(str(path.parent))}")  # the command as the product quotes it
        with pytest.raises(OutputError, match=(
                rf"^{path_re}: cannot write this patch store \(No space left on device: the disk is full\)\. Fix: free "
                rf"disk space where {folder_re} lives \(`{df}`\), or write to another folder, and "
                r"re-run\.$")):
            _write(path, "raw")
        assert list(path.parent.iterdir()) == []

    if can_mount():
        with full_disk(path.parent, n_bytes=150_000) as (method, _):
            assert method == "tmpfs"
            attempt()
    else:
        path.parent.mkdir()
        with monkeypatch.context() as mp:
            mp.setattr(h5_store, "open", lambda p, mode, buffering=-1: FullDisk(p, mode.replace("b", "")),
                       raising=False)
            attempt()
    _write(path, "raw", batches=1)  # the process is unharmed


@pytest.mark.parametrize("limit", [200, 112_000])  # the copy of the 111.5 KB store fails, or HDF5's writes
def test_adding_arrays_to_an_hdf5_store_on_a_full_disk_keeps_the_store(tmp_path, limit):
    """``write_arrays`` (the label stage) rebuilds the store beside itself through the same fail-safe
    file: a failed write leaves the old store as it was and no temporary. The message names the
    store and the fix of the cause, as every other stage (it used to show the temporary's name and
    "check free disk space" for a file-size limit)."""
    path = tmp_path / "s.h5"
    _write(path, "none", batches=2)
    size_before = sorted(p.name for p in tmp_path.iterdir())
    path_re, tmp_re = re.escape(str(path)), re.escape(str(tmp_path))
    with file_size_limit(limit):
        with pytest.raises(StoreError, match=(
                rf"^{path_re}: cannot update the store \(File too large: the file grew past a size limit\)\. Fix: "
                rf"raise the file-size limit \(`ulimit -f`\) or write to another file system than {tmp_re}'s\.$")):
            write_arrays(path, {"tumor_fraction": np.zeros(100, np.float32) + np.arange(100)})
    assert sorted(p.name for p in tmp_path.iterdir()) == size_before
    with open_store(path) as store:
        assert len(store) == 100 and "tumor_fraction" not in store.names()


def test_adding_arrays_to_a_zarr_store_past_a_file_size_limit_names_the_fix(tmp_path):
    """The Zarr store's rebuild words a failed write as the HDF5 one does (it said "check free disk space
    and permissions" for a file-size limit)."""
    path = tmp_path / "s.zarr"
    _write(path, "none", batches=2)
    values = np.random.default_rng(0).random(100).astype(np.float32)  # 400 incompressible bytes
    with file_size_limit(200):
        with pytest.raises(StoreError, match=rf"^{re.escape(str(path))}: cannot update the store \(File too large: "
                                             r".*Fix: raise the "
                                             r"file-size limit \(`ulimit -f`\)"):
            write_arrays(path, {"tumor_fraction": values})
    with open_store(path) as store:
        assert len(store) == 100 and "tumor_fraction" not in store.names()


def test_removing_a_partial_store_whose_entries_vanish_meanwhile_is_no_error(tmp_path, monkeypatch):
    """Zarr's writer threads still remove their own temporaries after a failed write, so a file listed by the
    removal of the partial store can be gone when it is unlinked: that raised FileNotFoundError out of the
    store's clean-up (a flaky failure of the file-size-limit test above in a full-suite run)."""
    import os

    from wsi_milssl.store.base import remove_path

    folder = tmp_path / ".s.zarr.partial"
    (folder / "tumor_fraction").mkdir(parents=True)
    for k in range(4):
        (folder / "tumor_fraction" / f"c{k}.partial").write_bytes(b"x")
    real_unlink = os.unlink

    def raced(name, *args, **kwargs):  # another thread removed the temporary first
        if str(name).startswith("c1"):
            real_unlink(name, *args, **kwargs)
        return real_unlink(name, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", raced)
    remove_path(folder)
    assert not folder.exists()
