"""Zarr v3 backend of the patch store: one ``<stem>.zarr`` folder per slide.

Same content as the HDF5 backend. Scalar per-patch arrays are chunked 65,536 rows. JPEG patches
live in the group ``patches`` as ``data`` (uint8, all streams back to back, 256 KiB chunks) and
``offsets`` (int64 (N + 1,)), so a patch read touches one or two small chunk files rather than one
file per patch; raw patches are uint8 (N, H, W, 3) with one chunk per patch inside shards of 16
patches. The writer buffers each array up to a whole chunk (or shard), so every chunk file is
written once.
"""

from __future__ import annotations

import itertools
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import zarr

from wsi_milssl.atomic import find_write_error, output_error, temp_path
from wsi_milssl.errors import StoreError
from wsi_milssl.store import schema
from wsi_milssl.store.base import PatchStore, StoreWriter, fsync_path, remove_path, swap_into_place

__all__ = ["ZarrStore", "ZarrWriter", "zarr_write_arrays"]

_SCALAR_CHUNK = 65536
_JPEG_DATA_CHUNK = 1 << 18  # 256 KiB
_RAW_SHARD = 16
_MAX_JPEG_BYTES = 1 << 26  # one JPEG patch is at most a few MB; larger offsets mean a corrupt store
# Store every chunk, even one of zeros (e.g. instance_label of a normal slide): a missing chunk file
# then always means a damaged store, which the reader detects.
_CONFIG = {"write_empty_chunks": True}
#: array attribute marking an array written with every chunk (stores of earlier versions skipped all-zero
#: chunks, so a missing chunk there is not damage; only marked arrays are checked)
_ALL_CHUNKS_ATTR = "all_chunks_written"


def _new_array(group, name: str, **kwargs):
    """``group.create_array`` writing every chunk, marked so the reader checks its chunk files."""
    arr = group.create_array(name, config=_CONFIG, **kwargs)
    arr.attrs[_ALL_CHUNKS_ATTR] = True
    return arr


class ZarrStore(PatchStore):
    """A patch store in a Zarr v3 folder (see :class:`wsi_milssl.store.base.PatchStore`)."""

    format = "zarr"

    def _handle_fields(self) -> tuple[str, ...]:
        return ("_group", "_arrays")

    def _open(self) -> None:
        if not (self.path / "zarr.json").is_file():
            raise self._fail("no zarr.json in this folder, so it is not a Zarr v3 store",
                             "give the path of a .zarr store written by `wsi-milssl tile`")
        self._group = zarr.open_group(self.path, mode="r")
        self._arrays: dict[str, Any] = {}

    def _drop_inherited(self) -> None:
        self._group = None
        self._arrays = {}

    def _close(self) -> None:
        self._group = None
        self._arrays = {}

    def _array(self, name: str):
        arr = self._arrays.get(name)
        if arr is None:
            arr = self._group[name]
            self._arrays[name] = arr
        return arr

    def _read_attrs(self) -> dict[str, Any]:
        return dict(self._group.attrs)

    def _array_names(self) -> list[str]:
        names = sorted(self._group.array_keys())
        if schema.PATCHES in self._group.group_keys():
            names.append(schema.PATCHES)
        return names

    def _array_attrs(self, name: str) -> dict[str, Any]:
        # the chunk mark is this backend's bookkeeping, not content (both formats hold the same attributes)
        return {k: v for k, v in self._group[name].attrs.items() if k != _ALL_CHUNKS_ATTR}

    def _array_len(self, name: str) -> int:
        return int(self._array(name).shape[0])

    def _array_shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self._array(name).shape)

    def _check_chunks(self, names: list[str]) -> None:
        """Raise StoreError if a chunk (or shard) file of an array is missing: Zarr would read it as zeros.

        Only lists file names; no data is read. The writers store every chunk, even an all-zero one, and
        mark the array (``all_chunks_written``); arrays of earlier versions, which skipped all-zero
        chunks, are not checked.
        """
        for name in names:
            if name == schema.PATCHES and self._attrs_pixels == "jpeg":
                self._check_array_chunks(f"{schema.PATCHES}/{schema.ZARR_JPEG_DATA}")
                self._check_array_chunks(f"{schema.PATCHES}/{schema.ZARR_JPEG_OFFSETS}")
            else:
                self._check_array_chunks(name)

    def _check_array_chunks(self, name: str) -> None:
        arr = self._array(name)
        if not arr.attrs.get(_ALL_CHUNKS_ATTR):  # written by an earlier version: all-zero chunks were skipped
            return
        unit = arr.shards or arr.chunks
        grid = [-(-int(n) // int(c)) for n, c in zip(arr.shape, unit)]
        folder = os.fspath(self.path / name)
        present: set[str] = set()  # chunk keys ("c/3", "c/1/0/0/0"), built as strings: a big store has ~10^4
        for root, _dirs, files in os.walk(folder):
            rel = os.path.relpath(root, folder)
            prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            present.update(prefix + f for f in files)
        enc = arr.metadata.chunk_key_encoding
        if getattr(enc, "name", "") == "default" and getattr(enc, "separator", "") == "/":  # what the writers use
            keys = ("c/" + "/".join(map(str, i)) for i in itertools.product(*map(range, grid)))
        else:
            keys = (arr.metadata.encode_chunk_key(i) for i in np.ndindex(*grid))
        missing = [key for key in keys if key not in present]
        if missing:
            shown = ", ".join(f"{name}/{k}" for k in missing[:3]) + (", ..." if len(missing) > 3 else "")
            raise self._fail(
                f"array {name!r} is missing {len(missing)} of its {int(np.prod(grid))} chunk files ({shown}); "
                "its data would read as zeros",
                "the store is corrupt; delete it and re-run `wsi-milssl tile` for this slide",
            )

    def _read_range(self, name: str, start: int, stop: int) -> np.ndarray:
        return self._array(name)[start:stop]

    def _read_rows(self, name: str, sorted_unique: np.ndarray) -> np.ndarray:
        return self._array(name).get_orthogonal_selection((sorted_unique,) + (slice(None),) * (self._array(name).ndim - 1))

    def _offsets(self) -> np.ndarray:
        offsets = self._cache.get("offsets")
        if offsets is None or self._cache.get("offsets_pid") != os.getpid():
            offsets = np.asarray(self._array(f"{schema.PATCHES}/{schema.ZARR_JPEG_OFFSETS}")[:], dtype=np.int64)
            n_bytes = self._array(f"{schema.PATCHES}/{schema.ZARR_JPEG_DATA}").shape[0]
            sizes = np.diff(offsets)
            if (offsets.shape != (self._n + 1,) or offsets[0] != 0 or offsets[-1] > n_bytes
                    or (sizes.size and (sizes.min() < 0 or sizes.max() > _MAX_JPEG_BYTES))):
                raise self._fail(
                    f"the JPEG offsets do not fit {self._n} patches in {n_bytes} bytes (corrupt 'patches/offsets')",
                    "the store is corrupt; delete it and re-run `wsi-milssl tile` for this slide",
                )
            self._cache["offsets"] = offsets
            self._cache["offsets_pid"] = os.getpid()
        return offsets

    def _read_jpeg_sorted(self, sorted_unique: np.ndarray) -> list[bytes]:
        from wsi_milssl.store.base import runs

        offsets = self._offsets()
        data = self._array(f"{schema.PATCHES}/{schema.ZARR_JPEG_DATA}")
        out: list[bytes] = []
        for start, stop in runs(sorted_unique):
            lo, hi = int(offsets[start]), int(offsets[stop])
            blob = data[lo:hi].tobytes()
            for i in range(start, stop):
                out.append(blob[int(offsets[i]) - lo: int(offsets[i + 1]) - lo])
        return out


class _Appender:
    """Appends rows to a Zarr array in whole write units (a chunk or a shard), buffering the rest."""

    def __init__(self, array, unit: int) -> None:
        self.array = array
        self.unit = int(unit)
        self.n_written = 0
        self._buf: list[np.ndarray] = []
        self._buf_len = 0

    def append(self, values: np.ndarray) -> None:
        if len(values) == 0:
            return
        self._buf.append(values)
        self._buf_len += len(values)
        if self._buf_len >= self.unit:
            self._flush(full_only=True)

    def _take(self, n: int) -> np.ndarray:
        """The first ``n`` buffered rows (removed from the buffer), copying only what is needed."""
        parts: list[np.ndarray] = []
        need = n
        while need:
            head = self._buf[0]
            if len(head) <= need:
                parts.append(self._buf.pop(0))
                need -= len(head)
            else:
                parts.append(head[:need])
                self._buf[0] = head[need:]
                need = 0
        self._buf_len -= n
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _flush(self, *, full_only: bool) -> None:
        # One write unit at a time, so at most one extra unit is copied in memory.
        while self._buf_len >= self.unit or (not full_only and self._buf_len > 0):
            data = self._take(min(self.unit, self._buf_len))
            stop = self.n_written + len(data)
            self.array.resize((stop,) + tuple(self.array.shape[1:]))
            self.array[self.n_written:stop] = data
            self.n_written = stop

    def close(self) -> None:
        self._flush(full_only=False)


def _to_zarr_attrs(attrs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in attrs.items()}


class ZarrWriter(StoreWriter):
    """Streams a slide's patches into a Zarr v3 folder under a temporary name (see StoreWriter)."""

    format = "zarr"

    def _create(self) -> None:
        g = zarr.open_group(self.partial_path, mode="w", zarr_format=3)
        self._group = g
        coords = _new_array(g, schema.COORDS, shape=(0, 2), dtype=np.int64, chunks=(_SCALAR_CHUNK, 2))
        coords.attrs.update(_to_zarr_attrs(self.coords_attrs))
        self._app = {schema.COORDS: _Appender(coords, _SCALAR_CHUNK)}
        for name in (schema.ENTROPY, schema.TISSUE_FRACTION):
            arr = _new_array(g, name, shape=(0,), dtype=np.float32, chunks=(_SCALAR_CHUNK,))
            self._app[name] = _Appender(arr, _SCALAR_CHUNK)
        p = self.patch_size_px
        if self.pixels == "jpeg":
            pg = g.create_group(schema.PATCHES, attributes={"encoding": "jpeg"})
            data = _new_array(pg, schema.ZARR_JPEG_DATA, shape=(0,), dtype=np.uint8, chunks=(_JPEG_DATA_CHUNK,),
                              compressors=None)
            offsets = _new_array(pg, schema.ZARR_JPEG_OFFSETS, shape=(0,), dtype=np.int64, chunks=(_SCALAR_CHUNK,))
            self._app["data"] = _Appender(data, _JPEG_DATA_CHUNK)
            self._app["offsets"] = _Appender(offsets, _SCALAR_CHUNK)
            self._app["offsets"].append(np.zeros(1, np.int64))
            self._n_bytes = 0
        elif self.pixels == "raw":
            arr = _new_array(g, schema.PATCHES, shape=(0, p, p, 3), dtype=np.uint8, chunks=(1, p, p, 3),
                             shards=(_RAW_SHARD, p, p, 3), compressors=None)
            arr.attrs["encoding"] = "raw"
            self._app[schema.PATCHES] = _Appender(arr, _RAW_SHARD)

    def _append(self, coords, entropy, tissue, patches) -> None:
        self._app[schema.COORDS].append(coords)
        self._app[schema.ENTROPY].append(entropy)
        self._app[schema.TISSUE_FRACTION].append(tissue)
        if self.pixels == "jpeg":
            lengths = np.fromiter((len(b) for b in patches), dtype=np.int64, count=len(patches))
            ends = self._n_bytes + np.cumsum(lengths)
            self._n_bytes = int(ends[-1])
            self._app["offsets"].append(ends)
            self._app["data"].append(np.frombuffer(b"".join(patches), dtype=np.uint8))
        elif self.pixels == "raw":
            self._app[schema.PATCHES].append(patches)

    def _write_attrs_and_close(self, attrs: dict[str, Any]) -> None:
        for app in self._app.values():
            app.close()
        body = {k: v for k, v in attrs.items() if k != schema.COMPLETE_ATTR}
        self._group.attrs.update(_to_zarr_attrs(body))
        self._group.attrs[schema.COMPLETE_ATTR] = True
        self._group = None
        self._app = {}

    def _close_quietly(self) -> None:
        self._group = None
        self._app = {}


def _link_tree(src: Path, dst: Path, *, skip: set[Path]) -> None:
    """Recreate ``src`` at ``dst`` with hard links to its files (copies where links fail), leaving out ``skip``."""
    for root, dirs, files in os.walk(src):
        root_p = Path(root)
        rel = root_p.relative_to(src)
        dirs[:] = [d for d in dirs if (rel / d) not in skip]
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for name in files:
            if (rel / name) in skip:
                continue
            s, d = root_p / name, dst / rel / name
            try:
                os.link(s, d)
            except OSError:
                shutil.copy2(s, d)


def zarr_write_arrays(path: Path, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> None:
    """Add or replace arrays and attrs of a Zarr store atomically.

    A new folder is built beside the store from hard links to the unchanged chunk files (Zarr
    writes every file through a temporary name, so linked files are never modified in place), the
    new arrays and a fresh root ``zarr.json``; it is then swapped in with one atomic rename.
    """
    tmp = temp_path(path, kind="partial")
    try:
        skip = {Path(name) for name in arrays} | {Path("zarr.json")}
        _link_tree(path, tmp, skip=skip)
        shutil.copymode(path, tmp)  # the store keeps its permission bits
        shutil.copy2(path / "zarr.json", tmp / "zarr.json")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            g = zarr.open_group(tmp, mode="r+")
            for name, values in arrays.items():
                chunks = (min(max(len(values), 1), _SCALAR_CHUNK),) + values.shape[1:]
                _new_array(g, name, shape=values.shape, dtype=values.dtype, chunks=chunks)[...] = values
            if attrs:
                g.attrs.update(_to_zarr_attrs(attrs))
        fsync_path(tmp)
        swap_into_place(tmp, path)
    except OSError as exc:
        remove_path(tmp)
        cause = find_write_error(exc, access=True)
        if cause is not None:  # the fix of the cause (free space, ``ulimit -f``, ...), as every stage names it
            raise StoreError(str(output_error(path, cause, what="cannot update the store"))) from None
        raise StoreError(f"{path}: cannot update the store ({exc}). Fix: check free disk space and permissions.") from None
    except BaseException:
        remove_path(tmp)
        raise
