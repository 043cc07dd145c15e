"""The store entry points: open a store by path, add per-patch arrays, find stores, make a writer."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from wsi_milssl.errors import StoreError
from wsi_milssl.store import schema
from wsi_milssl.store.base import PatchStore, StoreWriter, check_attr_value
from wsi_milssl.store.h5_store import H5Store, H5Writer, h5_write_arrays
from wsi_milssl.store.zarr_store import ZarrStore, ZarrWriter, zarr_write_arrays

__all__ = ["open_store", "write_arrays", "find_stores", "create_writer"]

_READERS = {"h5": H5Store, "zarr": ZarrStore}
_WRITERS = {"h5": H5Writer, "zarr": ZarrWriter}


def _format_or_fail(path: Path) -> str:
    if str(path).rstrip("/\\").endswith(schema.PARTIAL_SUFFIX):
        raise StoreError(
            f"{path}: this is an incomplete store (still being written, or left by a run that was killed). "
            "Fix: re-run `wsi-milssl tile` with the same settings to finish it, then open the final store."
        )
    fmt = schema.format_of(path)
    if fmt is None:
        raise StoreError(
            f"{path}: not a patch store path (expected a name ending in "
            f"{' or '.join(schema.FORMAT_SUFFIXES.values())}). Fix: give a store written by `wsi-milssl tile`."
        )
    return fmt


def open_store(path: str | os.PathLike) -> PatchStore:
    """Open the patch store at ``path`` (``.h5`` file or ``.zarr`` folder) for reading.

    Raises StoreError naming the path and the fix when it is missing, incomplete, corrupt or of
    another schema version. Usable as a context manager; safe to pass to DataLoader workers.
    """
    path = Path(path)
    return _READERS[_format_or_fail(path)](path)


def create_writer(path: str | os.PathLike, *, pixels: str, patch_size_px: int,
                  coords_attrs: Mapping[str, Any] | None = None) -> StoreWriter:
    """A streaming writer for a new store at ``path`` (format from the suffix); see StoreWriter."""
    path = Path(path)
    return _WRITERS[_format_or_fail(path)](path, pixels=pixels, patch_size_px=patch_size_px,
                                           coords_attrs=coords_attrs)


def _check_array(path: Path, name: Any, values: Any, n: int) -> np.ndarray:
    if not isinstance(name, str) or not name or "/" in name or name.startswith((".", "_")):
        raise StoreError(f"{path}: invalid array name {name!r}; use a plain name such as 'tumor_fraction'.")
    if name in schema.PROTECTED_ARRAYS:
        raise StoreError(
            f"{path}: array {name!r} is written by the tile stage and cannot be replaced. "
            "Fix: re-run `wsi-milssl tile --overwrite` to change it."
        )
    arr = np.asarray(values)
    if arr.ndim == 0 or arr.shape[0] != n:
        raise StoreError(
            f"{path}: array {name!r} has shape {arr.shape} but the store has {n} patches; "
            f"per-patch arrays need first axis {n} in the order of store.coords."
        )
    if name in schema.PER_PATCH_DTYPES:
        dtype, trailing = schema.PER_PATCH_DTYPES[name]
        if arr.shape[1:] != trailing:
            raise StoreError(f"{path}: array {name!r} must have shape ({n}, *{trailing}); got {arr.shape}.")
        if not np.can_cast(arr.dtype, dtype, casting="same_kind") and arr.dtype != bool:
            raise StoreError(f"{path}: array {name!r} must be {dtype}; got {arr.dtype}.")
        arr = arr.astype(dtype, copy=False)
    elif arr.dtype.kind not in "biuf":
        raise StoreError(f"{path}: array {name!r} has dtype {arr.dtype}; per-patch arrays must be numeric or bool.")
    return np.ascontiguousarray(arr)


def _check_writable(path: Path) -> None:
    """Refuse to rebuild a store the user protected: one without write permission (``chmod a-w``)."""
    targets = [path] if path.is_file() else [path, path / "zarr.json"]
    for target in targets:
        try:
            mode = target.stat().st_mode
        except OSError:
            continue  # a missing part is reported by the reader
        if not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH) or not os.access(target, os.W_OK):
            raise StoreError(
                f"{path}: the store is read-only ({target.name} has mode {stat.S_IMODE(mode):04o}), and adding "
                "arrays would replace it; a protected store is never replaced. Fix: make it writable "
                f"(chmod -R u+w {path}) if it may be changed, or run the stage on a writable copy."
            )


def write_arrays(path: str | os.PathLike, arrays: Mapping[str, Any], *, attrs: Mapping[str, Any] | None = None) -> None:
    """Add or replace per-patch arrays (first axis N, store order) and store attributes, all or nothing.

    Known names get their schema dtype (``tumor_fraction`` float32, ``instance_label`` uint8); other
    names must be numeric. ``coords``/``patches`` and the tile stage's attributes cannot be changed.
    The store is rebuilt beside itself and swapped in atomically, so a crash leaves the old store;
    it keeps its permission bits. A symbolic link to a store stays a link: the store it names is rebuilt. A read-only store (no write permission) is refused with a
    StoreError and left as it is.
    """
    path = Path(path)
    with open_store(path) as store:
        n = len(store)
        fmt = store.format
    checked = {name: _check_array(path, name, values, n) for name, values in arrays.items()}
    clean_attrs: dict[str, Any] = {}
    for key, value in (attrs or {}).items():
        if not isinstance(key, str) or not key:
            raise StoreError(f"{path}: invalid attribute name {key!r}.")
        if key in schema.RESERVED_ATTRS:
            raise StoreError(
                f"{path}: attribute {key!r} is set by the tile stage and cannot be changed; choose another name."
            )
        clean_attrs[key] = check_attr_value(key, value, where=str(path))
    if not checked and not clean_attrs:
        return
    path = Path(os.path.realpath(path))  # a link to a store: rebuild the store it names, not a copy in the link's place
    _check_writable(path)
    if fmt == "h5":
        h5_write_arrays(path, checked, clean_attrs)
    else:
        zarr_write_arrays(path, checked, clean_attrs)


def _is_store(path: Path) -> bool:
    fmt = schema.format_of(path)
    if fmt == "h5":
        return path.is_file()
    if fmt == "zarr":
        return path.is_dir()
    return False


def find_stores(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    """Sorted, de-duplicated store paths from store paths and folders holding stores (not recursive).

    Partial stores (``*.partial``) and hidden files are ignored. Raises StoreError for a path that
    does not exist.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    found: dict[str, Path] = {}
    for p in paths:
        p = Path(p)
        if not p.exists():
            raise StoreError(f"{p}: no such file or folder. Fix: give patch stores or folders that hold them.")
        if _is_store(p):
            found[str(p.resolve())] = p
        elif p.is_dir():
            for child in p.iterdir():
                if not child.name.startswith(".") and _is_store(child):
                    found[str(child.resolve())] = child
        else:
            raise StoreError(
                f"{p}: not a patch store (expected a .h5 file, a .zarr folder or a folder of them)."
            )
    return sorted(found.values(), key=lambda q: str(q))
