"""HDF5 backend of the patch store (h5py): one ``<stem>.h5`` file per slide.

Layout: root attributes; datasets ``coords`` int64 (N, 2) with the CLAM/TRIDENT attributes,
``entropy_bits`` and ``tissue_fraction`` float32 (N,), and ``patches`` as variable-length uint8
(JPEG, chunks of 64 patches) or uint8 (N, H, W, 3) (raw, one uncompressed chunk per patch).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Mapping

import h5py
import numpy as np

from wsi_milssl.errors import StoreError
from wsi_milssl.store import schema
from wsi_milssl.store.base import PatchStore, StoreWriter, fsync_path, remove_path

__all__ = ["H5Store", "H5Writer", "h5_write_arrays"]

_SCALAR_CHUNK = 4096
_JPEG_CHUNK = 64


def _to_h5_attr(value: Any) -> Any:
    if isinstance(value, list):
        if all(isinstance(v, str) for v in value):
            return np.array(value, dtype=h5py.string_dtype())
        return np.asarray(value)
    return value


class H5Store(PatchStore):
    """A patch store in an HDF5 file (see :class:`wsi_milssl.store.base.PatchStore`)."""

    format = "h5"

    def _handle_fields(self) -> tuple[str, ...]:
        return ("_file",)

    def _open(self) -> None:
        if not self.path.is_file():
            raise self._fail("expected an HDF5 file but found a folder", "give the path of a .h5 store")
        self._file = h5py.File(self.path, "r")

    def _drop_inherited(self) -> None:
        self._file = None

    def _close(self) -> None:
        f = getattr(self, "_file", None)
        if f is not None:
            try:
                f.close()
            except Exception:  # noqa: BLE001 - closing a broken handle
                pass
        self._file = None

    def _read_attrs(self) -> dict[str, Any]:
        return dict(self._file.attrs)

    def _array_names(self) -> list[str]:
        return [k for k in self._file.keys() if isinstance(self._file[k], h5py.Dataset)]

    def _array_attrs(self, name: str) -> dict[str, Any]:
        return dict(self._file[name].attrs)

    def _array_len(self, name: str) -> int:
        return int(self._file[name].shape[0])

    def _array_shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self._file[name].shape)

    def _read_range(self, name: str, start: int, stop: int) -> np.ndarray:
        return self._file[name][start:stop]

    def _read_rows(self, name: str, sorted_unique: np.ndarray) -> np.ndarray:
        return self._file[name][sorted_unique]

    def _read_jpeg_sorted(self, sorted_unique: np.ndarray) -> list[bytes]:
        if len(sorted_unique) == 0:
            return []
        ds = self._file[schema.PATCHES]
        if sorted_unique[-1] - sorted_unique[0] + 1 == len(sorted_unique):
            rows = ds[int(sorted_unique[0]): int(sorted_unique[-1]) + 1]
        else:
            rows = ds[sorted_unique]
        return [r.tobytes() for r in rows]


class H5Writer(StoreWriter):
    """Streams a slide's patches into ``<stem>.h5.partial`` (resizable chunked datasets)."""

    format = "h5"

    def _create(self) -> None:
        self._file = h5py.File(self.partial_path, "w")
        f = self._file
        coords = f.create_dataset(schema.COORDS, shape=(0, 2), maxshape=(None, 2), dtype=np.int64,
                                  chunks=(_SCALAR_CHUNK, 2))
        for key, value in self.coords_attrs.items():
            coords.attrs[key] = _to_h5_attr(value)
        for name in (schema.ENTROPY, schema.TISSUE_FRACTION):
            f.create_dataset(name, shape=(0,), maxshape=(None,), dtype=np.float32, chunks=(_SCALAR_CHUNK,))
        p = self.patch_size_px
        if self.pixels == "jpeg":
            ds = f.create_dataset(schema.PATCHES, shape=(0,), maxshape=(None,), dtype=h5py.vlen_dtype(np.uint8),
                                  chunks=(_JPEG_CHUNK,))
            ds.attrs["encoding"] = "jpeg"
        elif self.pixels == "raw":
            ds = f.create_dataset(schema.PATCHES, shape=(0, p, p, 3), maxshape=(None, p, p, 3), dtype=np.uint8,
                                  chunks=(1, p, p, 3))
            ds.attrs["encoding"] = "raw"

    def _append(self, coords, entropy, tissue, patches) -> None:
        f = self._file
        start, stop = self.n_written, self.n_written + len(coords)
        for name, values in ((schema.COORDS, coords), (schema.ENTROPY, entropy), (schema.TISSUE_FRACTION, tissue)):
            ds = f[name]
            ds.resize(stop, axis=0)
            ds[start:stop] = values
        if self.pixels == "none":
            return
        ds = f[schema.PATCHES]
        ds.resize(stop, axis=0)
        if self.pixels == "jpeg":
            if len(patches) == 1:  # h5py cannot broadcast a length-1 object array of arrays
                ds[start] = np.frombuffer(patches[0], dtype=np.uint8)
                return
            arr = np.empty(len(patches), dtype=object)
            for i, b in enumerate(patches):
                arr[i] = np.frombuffer(b, dtype=np.uint8)
            ds[start:stop] = arr
        else:
            ds[start:stop] = patches

    def _write_attrs_and_close(self, attrs: dict[str, Any]) -> None:
        f = self._file
        for key, value in attrs.items():
            if key != schema.COMPLETE_ATTR:
                f.attrs[key] = _to_h5_attr(value)
        f.flush()
        f.attrs[schema.COMPLETE_ATTR] = True
        f.close()
        self._file = None

    def _close_quietly(self) -> None:
        f = getattr(self, "_file", None)
        if f is not None:
            try:
                f.close()
            except Exception:  # noqa: BLE001
                pass
        self._file = None


def h5_write_arrays(path: Path, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> None:
    """Add or replace arrays and attrs of an HDF5 store: edit a copy, fsync, then ``os.replace``."""
    tmp = path.with_name(f".{path.name}.write-{os.getpid()}")
    remove_path(tmp)
    try:
        shutil.copyfile(path, tmp)
        shutil.copymode(path, tmp)  # the store keeps its permission bits
        with h5py.File(tmp, "r+") as f:
            for name, values in arrays.items():
                if name in f:
                    del f[name]
                chunks = (min(max(len(values), 1), _SCALAR_CHUNK),) + values.shape[1:]
                f.create_dataset(name, data=values, maxshape=(None,) + values.shape[1:], chunks=chunks)
            for key, value in attrs.items():
                f.attrs[key] = _to_h5_attr(value)
        fsync_path(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        remove_path(tmp)
        raise StoreError(f"{path}: cannot update the store ({exc}). Fix: check free disk space and permissions.") from None
    except BaseException:
        remove_path(tmp)
        raise
