"""HDF5 backend of the patch store (h5py): one ``<stem>.h5`` file per slide.

Layout: root attributes; datasets ``coords`` int64 (N, 2) with the CLAM/TRIDENT attributes,
``entropy_bits`` and ``tissue_fraction`` float32 (N,), and ``patches`` as variable-length uint8
(JPEG, chunks of 64 patches) or uint8 (N, H, W, 3) (raw, one uncompressed chunk per patch).

Stores are written through :class:`FailSafeFile` (h5py's ``fileobj`` driver), not by the HDF5
library's own file driver: when the disk fills up, HDF5's POSIX driver leaves the library with a
file it can neither flush nor close, and the process dies with a segmentation fault at exit. The
wrapper records the first failed write and then discards further writes, so the file closes
cleanly, the partial store is deleted and the failure is reported as an OutputError.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

import h5py
import numpy as np

from wsi_milssl.atomic import find_write_error, output_error, temp_path
from wsi_milssl.errors import StoreError
from wsi_milssl.store import schema
from wsi_milssl.store.base import PatchStore, StoreWriter, fsync_path, remove_path

__all__ = ["FailSafeFile", "H5Store", "H5Writer", "h5_write_arrays"]

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


class FailSafeFile(io.RawIOBase):
    """The file HDF5 writes a store through (h5py ``fileobj`` driver) that survives a full disk.

    Writes are written completely (h5py ignores short writes). The first failed write or truncate is
    kept in ``error`` and not passed to HDF5 (whose failure paths print "Exception ignored" tracebacks
    and can leave a file it cannot close); from then on writes are discarded and reads past the data
    are zero-filled. The writer calls :meth:`check` after every step, which raises the error; the
    partial store is then closed and deleted.
    """

    def __init__(self, path: str | os.PathLike, mode: str = "w+b") -> None:
        super().__init__()
        self._raw = open(path, mode, buffering=0)
        self.error: OSError | None = None

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def fileno(self) -> int:
        return self._raw.fileno()

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            return self._raw.read()
        parts, got = [], 0
        while got < size:
            chunk = self._raw.read(size - got)
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
        data = b"".join(parts)
        if self.error is not None and len(data) < size:
            data += bytes(size - len(data))  # never written: HDF5 only reads it to close the file
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self.error is not None:
            return len(view)
        done = 0
        try:
            while done < len(view):
                n = self._raw.write(view[done:])
                if not n:
                    raise OSError(errno.EIO, "the write stored no bytes")
                done += n
        except OSError as exc:
            self.error = exc
        return len(view)

    def truncate(self, size: int | None = None) -> int:
        if self.error is not None:
            return self.tell() if size is None else size
        try:
            return self._raw.truncate(size)
        except OSError as exc:
            self.error = exc
            return self.tell() if size is None else size

    def flush(self) -> None:
        pass  # unbuffered; the store is fsynced by the writer before it is renamed

    def check(self) -> None:
        """Raise the first failed write (HDF5 does not always pass it on: chunk-cache writes fail quietly)."""
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        if not self.closed:
            try:
                super().close()
            finally:
                self._raw.close()


class H5Writer(StoreWriter):
    """Streams a slide's patches into an HDF5 file under a temporary name (resizable chunked datasets)."""

    format = "h5"

    def _create(self) -> None:
        self._fh = FailSafeFile(self.partial_path)
        self._file = h5py.File(self._fh, "w")
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
        self._append_rows(coords, entropy, tissue, patches)
        self._fh.check()

    def _append_rows(self, coords, entropy, tissue, patches) -> None:
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
            if len({len(b) for b in patches}) == 1:  # one patch, or all of one length (two identical patches): h5py
                for i, b in enumerate(patches):  # reads the object array as 2-D and cannot broadcast it (review EZ)
                    ds[start + i] = np.frombuffer(b, dtype=np.uint8)
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
        self._fh.check()
        f.attrs[schema.COMPLETE_ATTR] = True
        f.close()
        self._file = None
        self._fh.check()
        self._fh.close()

    def _write_error(self, exc: BaseException) -> OSError | None:
        fh = getattr(self, "_fh", None)
        if fh is not None and fh.error is not None:
            return fh.error  # HDF5 reports it as its own error (e.g. "Unable to flush file's cached information")
        return super()._write_error(exc)

    def _close_quietly(self) -> None:
        f = getattr(self, "_file", None)
        if f is not None:
            try:
                f.close()
            except Exception:  # noqa: BLE001
                pass
        self._file = None
        fh = getattr(self, "_fh", None)
        if fh is not None:
            try:
                fh.close()
            except OSError:
                pass


def h5_write_arrays(path: Path, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> None:
    """Add or replace arrays and attrs of an HDF5 store: edit a copy, fsync, then ``os.replace``."""
    tmp = temp_path(path)
    try:
        shutil.copyfile(path, tmp)
        shutil.copymode(path, tmp)  # the store keeps its permission bits
        fh = FailSafeFile(tmp, "r+b")  # a full disk must not leave HDF5 unable to close (see above)
        try:
            with h5py.File(fh, "r+") as f:
                for name, values in arrays.items():
                    if name in f:
                        del f[name]
                    chunks = (min(max(len(values), 1), _SCALAR_CHUNK),) + values.shape[1:]
                    f.create_dataset(name, data=values, maxshape=(None,) + values.shape[1:], chunks=chunks)
                for key, value in attrs.items():
                    f.attrs[key] = _to_h5_attr(value)
            fh.check()
        except Exception:
            if fh.error is not None:
                raise fh.error from None
            raise
        finally:
            fh.close()
        fsync_path(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        remove_path(tmp)
        cause = find_write_error(exc, access=True)
        if cause is not None:  # the fix of the cause (free space, ``ulimit -f``, ...), as every stage names it
            raise StoreError(str(output_error(path, cause, what="cannot update the store"))) from None
        raise StoreError(f"{path}: cannot update the store ({exc}). Fix: check free disk space and permissions.") from None
    except BaseException:
        remove_path(tmp)
        raise
