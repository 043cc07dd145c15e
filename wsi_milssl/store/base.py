"""Backend-independent parts of the patch store: the reader base class, the streaming writer base
class and the helpers both backends share (attribute conversion, index handling, JPEG codec,
atomic directory swaps).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import logging
import math
import os
import shutil
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import imagecodecs
import numpy as np

from wsi_milssl.atomic import find_write_error, output_error, temp_path
from wsi_milssl.errors import FeatureFileGivenError, StoreError, StoreReadError
from wsi_milssl.store import schema

#: The root ``schema`` attribute of a feature file (``wsi_milssl.features.schema.SCHEMA``), which may sit
#: where a store is expected (same .h5 suffix) and must not be called an incomplete store.
_FEATURES_SCHEMA = "wsi-milssl-features"

__all__ = [
    "MAX_PATCHES",
    "PatchStore",
    "StoreWriter",
    "check_attr_value",
    "decode_jpeg",
    "dumps_settings",
    "encode_jpeg",
    "fsync_path",
    "normalize_indices",
    "plain_attr",
    "remove_path",
    "runs",
    "swap_into_place",
]


#: More patches than any slide has (a 200,000 x 100,000 px slide in 64 px patches has 5 million): a
#: store claiming more is corrupt, and reading its coordinates would exhaust memory.
MAX_PATCHES = 1 << 26

_CORRUPT_FIX = "the store is corrupt; delete it and re-run `wsi-milssl tile` for this slide"


def too_many_open_files(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says the process or the system has run out of
    file handles (EMFILE/ENFILE). h5py and zarr sometimes keep only the message, so it is checked too."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
            return True
        if "too many open files" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def too_many_open_files_fix(what: str = "store") -> str:
    """The fix for running out of file handles, naming the current soft limit (``ulimit -n``); ``what`` was not
    damaged ("store", "file")."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        limit = f"now {soft}" if soft != resource.RLIM_INFINITY else "now unlimited"
        most = f" (at most {hard} without root)" if hard != resource.RLIM_INFINITY else ""
    except (ImportError, OSError, ValueError):
        limit, most = "", ""
    return (f"raise the limit on open files per process (`ulimit -n`{', ' + limit if limit else ''}), e.g. "
            f"`ulimit -n 4096`{most} in the shell before running, or run fewer processes at once; "
            f"the {what} is not damaged, keep it")


log = logging.getLogger(__name__)


# -- codec --------------------------------------------------------------------------------------
def encode_jpeg(rgb: np.ndarray, *, quality: int = 90) -> bytes:
    """JPEG bytes (baseline, 4:2:0) of an RGB uint8 (h, w, 3) patch. Deterministic for equal input."""
    return bytes(imagecodecs.jpeg8_encode(np.ascontiguousarray(rgb), level=int(quality), subsampling="420"))


#: JPEG start-of-frame markers (SOF0-SOF15 but DHT, JPG and DAC), whose segment holds the image's height and width
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def jpeg_size(data: bytes | np.ndarray) -> tuple[int, int] | None:
    """(width, height) a JPEG stream declares in its start-of-frame segment, read before decoding it; None when
    none is found (the decoder then says what is wrong). A few bytes can declare 65535 x 65535 px, which a decoder
    allocates before any check of the result (review ES: 5.5 GB for a 3 KB patch)."""
    buf = data if isinstance(data, (bytes, bytearray)) else np.asarray(data).tobytes()
    i = 2 if buf[:2] == b"\xff\xd8" else len(buf)
    while i + 4 <= len(buf):
        if buf[i] != 0xFF:
            return None
        marker = buf[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        length = int.from_bytes(buf[i + 2:i + 4], "big")
        if marker in _SOF_MARKERS:
            if i + 9 > len(buf):
                return None
            height, width = int.from_bytes(buf[i + 5:i + 7], "big"), int.from_bytes(buf[i + 7:i + 9], "big")
            return width, height
        if marker == 0xDA or length < 2:  # start of scan: the frame header comes before it
            return None
        i += 2 + length
    return None


def decode_jpeg(data: bytes | np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
    """RGB uint8 (h, w, 3) pixels of JPEG ``data``."""
    img = imagecodecs.jpeg8_decode(data if isinstance(data, (bytes, bytearray)) else np.asarray(data).tobytes())
    if img.ndim == 2:
        img = np.repeat(img[..., None], 3, axis=2)
    if out is not None:
        out[...] = img
        return out
    return img


# -- attributes ---------------------------------------------------------------------------------
def plain_attr(value: Any) -> Any:
    """A stored attribute value as plain Python (numpy scalars/arrays -> int/float/bool/list, bytes -> str)."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray):
        return [plain_attr(v) for v in value.tolist()] if value.ndim else plain_attr(value.item())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [plain_attr(v) for v in value]
    return value


def check_attr_value(name: str, value: Any, *, where: str) -> Any:
    """Validate a user attribute (JSON-able scalar or flat list of scalars) and return it as plain Python."""
    value = plain_attr(value)
    ok_scalar = (bool, int, float, str)
    if isinstance(value, ok_scalar) or (
        isinstance(value, list) and value and all(isinstance(v, ok_scalar) for v in value)
        and len({type(v) for v in value}) == 1
    ):
        return value
    raise StoreError(
        f"{where}: attribute {name!r} has value {value!r} ({type(value).__name__}); attributes must be "
        "an int, float, bool or str, or a non-empty list of one of those. Fix: convert it (e.g. json.dumps)."
    )


# -- indices ------------------------------------------------------------------------------------
def normalize_indices(indices: Any, n: int, *, where: str) -> np.ndarray:
    """int64 (B,) indices in [0, n) from an int, slice, sequence or array (negative values count from the end)."""
    if isinstance(indices, slice):
        return np.arange(n, dtype=np.int64)[indices]
    idx = np.asarray(indices)
    if idx.ndim == 0:
        idx = idx.reshape(1)
    if idx.size == 0:
        return np.zeros(0, np.int64)
    if idx.dtype == bool:
        if idx.shape != (n,):
            raise IndexError(f"{where}: boolean index of shape {idx.shape} for {n} patches.")
        return np.flatnonzero(idx).astype(np.int64)
    if not np.issubdtype(idx.dtype, np.integer):
        raise IndexError(f"{where}: patch indices must be integers; got dtype {idx.dtype}.")
    idx = idx.astype(np.int64).ravel()
    idx = np.where(idx < 0, idx + n, idx)
    if idx.min() < 0 or idx.max() >= n:
        raise IndexError(f"{where}: patch index out of range for a store of {n} patches.")
    return idx


def runs(sorted_unique: np.ndarray) -> list[tuple[int, int]]:
    """[(start, stop)) ranges of consecutive values in a sorted, unique int array."""
    if len(sorted_unique) == 0:
        return []
    breaks = np.flatnonzero(np.diff(sorted_unique) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [len(sorted_unique)]])
    return [(int(sorted_unique[a]), int(sorted_unique[b - 1]) + 1) for a, b in zip(starts, stops)]


# -- files --------------------------------------------------------------------------------------
def fsync_path(path: Path) -> None:
    """fsync a file, or every file and folder under a directory (best effort on folders)."""
    path = Path(path)
    if path.is_dir():
        for root, _dirs, files in os.walk(path):
            for f in files:
                _fsync_file(Path(root) / f)
            _fsync_dir(Path(root))
    else:
        _fsync_file(path)
    _fsync_dir(path.parent)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux renameat2(RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def swap_into_place(new: Path, final: Path) -> None:
    """Move the complete file or folder ``new`` to ``final``, replacing what is there.

    Files use ``os.replace`` (atomic). A folder replacing a folder is swapped atomically with
    renameat2(RENAME_EXCHANGE) where the kernel offers it, else renamed aside first; the old copy is
    then deleted.
    """
    new, final = Path(new), Path(final)
    if not final.exists() or not (new.is_dir() or final.is_dir()):
        if final.is_dir() and not new.is_dir():
            shutil.rmtree(final)
        os.replace(new, final)
        _fsync_dir(final.parent)
        return
    if _exchange(new, final):
        _fsync_dir(final.parent)
        shutil.rmtree(new) if new.is_dir() else new.unlink()
        return
    aside = temp_path(final, kind="old")
    os.replace(final, aside)
    os.replace(new, final)
    _fsync_dir(final.parent)
    shutil.rmtree(aside) if aside.is_dir() else aside.unlink()


def remove_path(path: Path) -> None:
    """Delete a file or folder if it exists. A folder's entries that vanish while it is removed (Zarr's
    writer threads still clean up their own temporaries after a failed write) are no error; one retry
    takes what appeared meanwhile."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        for attempt in range(2):
            try:
                shutil.rmtree(path, onerror=_gone_is_fine)
                return
            except OSError:
                if attempt or not path.exists():
                    raise
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


def _gone_is_fine(function, name, exc_info) -> None:
    if not issubclass(exc_info[0], FileNotFoundError):
        raise exc_info[1]


# -- reader -------------------------------------------------------------------------------------
class PatchStore(ABC):
    """Read access to one patch store (HDF5 or Zarr); open it with :func:`wsi_milssl.store.open_store`.

    The file is opened lazily in each process (and re-opened after a fork), so a store object can
    be handed to DataLoader workers. ``attrs`` and ``len`` are read once at open.
    """

    format: str = ""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._pid: int | None = None
        self._cache: dict[str, Any] = {}
        self._validate()

    # backend hooks ------------------------------------------------------------------------------
    @abstractmethod
    def _open(self) -> None:
        """Open the backend handle for this process."""

    @abstractmethod
    def _close(self) -> None:
        """Close the backend handle (if any)."""

    @abstractmethod
    def _read_attrs(self) -> dict[str, Any]:
        """Root attributes as stored."""

    @abstractmethod
    def _array_names(self) -> list[str]:
        """Names of the per-patch arrays present."""

    @abstractmethod
    def _array_attrs(self, name: str) -> dict[str, Any]:
        """Attributes of one array."""

    @abstractmethod
    def _array_len(self, name: str) -> int:
        """First-axis length of one array."""

    @abstractmethod
    def _array_shape(self, name: str) -> tuple[int, ...]:
        """Shape of one array (not the Zarr JPEG ``patches`` group)."""

    @abstractmethod
    def _read_range(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a per-patch array (not JPEG patches)."""

    @abstractmethod
    def _read_rows(self, name: str, sorted_unique: np.ndarray) -> np.ndarray:
        """Rows at sorted unique indices of a per-patch array (not JPEG patches)."""

    @abstractmethod
    def _read_jpeg_sorted(self, sorted_unique: np.ndarray) -> list[bytes]:
        """JPEG byte strings of the patches at sorted unique indices."""

    # lifecycle ----------------------------------------------------------------------------------
    def _ensure_open(self) -> None:
        if self._pid != os.getpid():
            self._drop_inherited()
            self._open()
            self._pid = os.getpid()

    def _drop_inherited(self) -> None:
        """Forget handles inherited through fork without touching the parent's."""

    def _fail(self, what: str, fix: str) -> StoreError:
        return StoreError(f"{self.path}: {what}. Fix: {fix}")

    @contextmanager
    def _reading(self, what: str) -> Iterator[None]:
        """Turn any backend or codec failure while reading ``what`` into a StoreError (a corrupt store)."""
        try:
            yield
        except StoreError:
            raise
        except Exception as exc:  # noqa: BLE001 - h5py, zarr, numcodecs and the JPEG codec raise many types
            if too_many_open_files(exc):
                raise StoreReadError(f"{self.path}: cannot read {what}: too many open files ({type(exc).__name__}: "
                                     f"{exc}). Fix: {too_many_open_files_fix()}") from None
            raise StoreReadError(f"{self.path}: cannot read {what} ({type(exc).__name__}: {exc}). Fix: "
                                 f"{_CORRUPT_FIX}") from None

    def _check_shapes(self, names: list[str]) -> int:
        """Number of patches, after checking coords is (N, 2) and every per-patch array has N rows."""
        shape = tuple(self._array_shape(schema.COORDS))
        if len(shape) != 2 or shape[1] != 2:
            raise self._fail(f"'coords' has shape {shape}, not (N, 2)", _CORRUPT_FIX)
        n = int(shape[0])
        if n > MAX_PATCHES:
            raise self._fail(f"'coords' claims {n} patches, more than any slide has ({MAX_PATCHES})", _CORRUPT_FIX)
        for name in names:
            if name == schema.PATCHES and self.format == "zarr" and self._attrs_pixels == "jpeg":
                continue  # a group (data + offsets), checked when patches are read
            length = int(self._array_len(name))
            if length != n:
                raise self._fail(f"array {name!r} has {length} rows but 'coords' has {n}", _CORRUPT_FIX)
        self._check_chunks([name for name in names if name != schema.PATCHES])  # patches: on their first read
        return n

    def _check_chunks(self, names: list[str]) -> None:
        """Raise StoreError if a backend stores arrays in chunk files and one of them is missing."""

    def _check_patch_chunks_once(self) -> None:
        """The chunk check of ``patches`` (most of a store's files), made on the first read of patches
        rather than on every open, so opening a store to read its attributes or coordinates stays cheap."""
        if "patch_chunks_checked" not in self._cache:
            with self._reading("the chunk files of 'patches'"):  # a damaged array's metadata: one StoreError
                self._ensure_open()
                self._check_chunks([schema.PATCHES])
            self._cache["patch_chunks_checked"] = True

    def _validate(self) -> None:
        if str(self.path).rstrip("/").endswith(schema.PARTIAL_SUFFIX):
            raise self._fail(
                "this is an incomplete store (still being written, or left by a run that was killed)",
                "re-run `wsi-milssl tile` with the same settings to finish it, then open the final store",
            )
        if not self.path.exists():
            raise self._fail("patch store not found", "check the path, or run `wsi-milssl tile` to make it")
        try:
            self._ensure_open()
            attrs = {k: plain_attr(v) for k, v in self._read_attrs().items()}
            names = sorted(self._array_names())
        except StoreError:
            raise
        except Exception as exc:  # noqa: BLE001 - any backend failure means an unreadable store
            self.close()
            # StoreReadError: the error of the process that opened it (a training reader reopening it; review BM)
            if too_many_open_files(exc):  # out of file handles: the store itself is fine
                raise StoreReadError(f"{self.path}: cannot open the patch store: too many open files "
                                     f"({type(exc).__name__}: {exc}). Fix: {too_many_open_files_fix()}") from None
            raise StoreReadError(f"{self.path}: cannot read the patch store ({type(exc).__name__}: {exc}). Fix: the "
                                 "store is corrupt or not a wsi-milssl store; delete it and re-run `wsi-milssl tile`"
                                 ) from None
        if attrs.get("schema") == _FEATURES_SCHEMA:
            self.close()
            made_from = str(attrs.get("store_path") or "")
            raise FeatureFileGivenError(str(self._fail(
                "this is a feature file (`wsi-milssl features`), not a patch store",
                f"pass the patch stores (`wsi-milssl tile` output{f', e.g. {made_from}, which it was made from' if made_from else ''}); "
                "feature files are read by `wsi-milssl train FEATURES` (feature mode) and `wsi-milssl heatmap "
                "--features FEATURES`; tile into another folder with --out, not the features' folder",
            )))
        version = attrs.get("schema_version")
        if version is None:
            self.close()
            raise self._fail("not a wsi-milssl patch store (no schema_version attribute)",
                             "give a store written by `wsi-milssl tile`")
        if version != schema.SCHEMA_VERSION:
            self.close()
            newer = isinstance(version, int) and version > schema.SCHEMA_VERSION
            raise self._fail(
                f"store schema version {version} differs from this package's {schema.SCHEMA_VERSION}",
                "upgrade wsi-milssl to read it" if newer else "re-run `wsi-milssl tile --overwrite` to rewrite it",
            )
        if attrs.get(schema.COMPLETE_ATTR) is not True or schema.COORDS not in names:
            self.close()
            raise self._fail("the store is incomplete", "re-run `wsi-milssl tile --overwrite` for this slide")
        self._attrs = attrs
        self._names = names
        self._attrs_pixels = attrs.get("pixels", "none")
        try:
            with self._reading("the array shapes"):
                self._n = self._check_shapes(names)
        except StoreError:
            self.close()
            raise

    def close(self) -> None:
        """Close the backend handle; the store reopens on next use."""
        if self._pid == os.getpid():
            self._close()
        self._pid = None

    def __enter__(self) -> "PatchStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pid"] = None
        for key in self._handle_fields():
            state[key] = None
        state["_cache"] = {}
        return state

    def _handle_fields(self) -> tuple[str, ...]:
        return ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, n={self._n}, pixels={self.pixels!r})"

    # metadata ------------------------------------------------------------------------------------
    @property
    def attrs(self) -> dict[str, Any]:
        """Root attributes as plain Python values (a copy)."""
        return dict(self._attrs)

    def __len__(self) -> int:
        return self._n

    def names(self) -> list[str]:
        """Names of the per-patch arrays present (``patches`` included when pixels are stored)."""
        return list(self._names)

    def has(self, name: str) -> bool:
        return name in self._names

    @property
    def pixels(self) -> str:
        """'jpeg', 'raw' or 'none'."""
        return str(self._attrs.get("pixels", "none"))

    def _positive_int_attr(self, key: str) -> int:
        value = self._attrs.get(key)
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or value <= 0 or value != int(value)):
            raise self._fail(f"attribute {key!r} is {value!r}, not a positive whole number", _CORRUPT_FIX)
        return int(value)

    @property
    def patch_size_px(self) -> int:
        """Patch side in pixels at the target resolution."""
        return self._positive_int_attr("patch_size_px")

    @property
    def patch_size_lv0(self) -> int:
        """Patch side in level-0 pixels."""
        return self._positive_int_attr("patch_size_lv0")

    @property
    def slide_path(self) -> Path:
        value = self._attrs.get("slide_path")
        if not isinstance(value, str) or not value:
            raise self._fail(f"attribute 'slide_path' is {value!r}, not a path", _CORRUPT_FIX)
        return Path(value)

    @property
    def stem(self) -> str:
        """The slide's name, from ``slide_stem``: a plain name, the store file's own (``<stem>.h5``), as `tile`
        writes it (review ES: a path there wrote outputs outside ``--out``, and two stores swapped by name were
        labelled with each other's annotations by label, which matches by the file name)."""
        from wsi_milssl.cohorts.names import name_key, slide_stem, unsafe_stem

        value = self._attrs.get("slide_stem")
        if not value:
            return self.path.stem
        value = str(value)
        why = unsafe_stem(value)
        if why is not None:
            raise self._fail(f"its slide_stem attribute {value[:80]!r} cannot name output files: {why}",
                             "write the slide's name there (the slide file's name without its folder and suffix), "
                             "or tile the slide again")
        if name_key(value) != name_key(slide_stem(self.path.name)):  # the value as it is: a slide named "case.svs.tif"
            # or "B .tif" has the stem "case.svs" or "B " (review EU: its stem's own suffix or blank was taken off)
            raise self._fail(f"its slide_stem attribute says slide {value[:80]!r}, but the store file is named for "
                             f"{self.path.stem!r}", f"rename the store to {value[:80]}{self.path.suffix} (stores are "
                             "named for their slide), or tile the slide again")
        return value

    def array_attrs(self, name: str) -> dict[str, Any]:
        """Attributes of one array, e.g. the CLAM attrs of ``coords``."""
        self._require(name)
        with self._reading(f"the attributes of {name!r}"):
            self._ensure_open()
            return {k: plain_attr(v) for k, v in self._array_attrs(name).items()}

    # data ----------------------------------------------------------------------------------------
    @property
    def coords(self) -> np.ndarray:
        """int64 (N, 2) level-0 top-left (x, y) of every patch (each patch once)."""
        if "coords" not in self._cache:
            coords = self.read_array(schema.COORDS)
            if len(coords) > 1:
                order = np.lexsort((coords[:, 1], coords[:, 0]))
                dup = np.flatnonzero((np.diff(coords[order], axis=0) == 0).all(axis=1))
                if dup.size:
                    x, y = (int(v) for v in coords[order[dup[0]]])
                    raise self._fail(f"'coords' holds {dup.size} duplicate coordinate(s), e.g. ({x}, {y}), "
                                     "so patches are not the slide's grid", _CORRUPT_FIX)
            self._cache["coords"] = coords
        return self._cache["coords"]

    def _require(self, name: str) -> None:
        if name not in self._names:
            hint = (
                "this store holds coordinates only (made with --pixels none); re-run `wsi-milssl tile` "
                "with --pixels jpeg or raw into a new --out folder"
                if name == schema.PATCHES
                else "run the stage that adds it (e.g. `wsi-milssl label` for tumor_fraction/instance_label)"
            )
            raise self._fail(f"no array {name!r} in this store (it has {', '.join(self._names)})", hint)

    def read_array(self, name: str, indices: Any = None) -> np.ndarray:
        """A per-patch array, whole or at ``indices``. JPEG ``patches`` come back as an object array of bytes."""
        self._require(name)
        if name == schema.PATCHES:
            self._check_patch_chunks_once()
        if name == schema.PATCHES and self.pixels == "jpeg":
            idx = np.arange(self._n) if indices is None else normalize_indices(indices, self._n, where=str(self.path))
            out = np.empty(len(idx), dtype=object)
            for i, b in enumerate(self.read_jpeg(idx) if len(idx) else []):
                out[i] = b
            return out
        idx = None if indices is None else normalize_indices(indices, self._n, where=str(self.path))
        with self._reading(f"array {name!r}"):
            self._ensure_open()
            rows = self._read_range(name, 0, self._n) if idx is None else self._gather(name, idx)
            if len(rows) != (self._n if idx is None else len(idx)):
                raise self._fail(f"array {name!r} returned {len(rows)} rows where {self._n} were stored",
                                 _CORRUPT_FIX)
            return rows

    def _gather(self, name: str, idx: np.ndarray) -> np.ndarray:
        uniq, inverse = np.unique(idx, return_inverse=True)
        if len(uniq) == 0:
            return self._read_range(name, 0, 0)
        if uniq[-1] - uniq[0] + 1 == len(uniq):
            rows = self._read_range(name, int(uniq[0]), int(uniq[-1]) + 1)
        else:
            rows = self._read_rows(name, uniq)
        return rows if len(uniq) == len(idx) and np.array_equal(uniq, idx) else rows[inverse]

    def read_jpeg(self, indices: Any) -> list[bytes]:
        """JPEG byte strings of the patches at ``indices`` (stores with pixels = 'jpeg')."""
        self._require(schema.PATCHES)
        if self.pixels != "jpeg":
            raise self._fail(f"patches are stored as {self.pixels!r}, not JPEG", "use read_patches()")
        idx = normalize_indices(indices, self._n, where=str(self.path))
        uniq, inverse = np.unique(idx, return_inverse=True)
        self._check_patch_chunks_once()
        with self._reading("JPEG patches"):
            self._ensure_open()
            data = self._read_jpeg_sorted(uniq)
        size = self.patch_size_px
        for k, raw in enumerate(data):  # before any decoder (libjpeg here, nvJPEG on a GPU) allocates what it declares
            declared = jpeg_size(raw)
            if declared is not None and declared != (size, size):
                raise self._fail(f"patch {int(uniq[k])} declares {declared[0]} x {declared[1]} px, expected {size} x "
                                 f"{size}", "the store is corrupt; delete it and re-run `wsi-milssl tile`")
        return [data[i] for i in inverse.ravel()]

    def read_patches(self, indices: Any) -> np.ndarray:
        """uint8 (B, H, W, 3) RGB patches at the target resolution, decoded, in the order of ``indices``."""
        self._require(schema.PATCHES)
        idx = normalize_indices(indices, self._n, where=str(self.path))
        size = self.patch_size_px
        if self.pixels == "raw":
            self._check_patch_chunks_once()
            with self._reading("raw patches"):
                self._ensure_open()
                return self._gather(schema.PATCHES, idx)
        if size > 16384:
            raise self._fail(f"attribute 'patch_size_px' is {size}, larger than any patch", _CORRUPT_FIX)
        out = np.empty((len(idx), size, size, 3), np.uint8)
        uniq, inverse = np.unique(idx, return_inverse=True)
        data = self.read_jpeg(uniq)
        decoded: dict[int, int] = {}
        for pos, u in enumerate(inverse.ravel()):
            if u in decoded:
                out[pos] = out[decoded[u]]
                continue
            raw = data[u] if isinstance(data[u], (bytes, bytearray)) else np.asarray(data[u]).tobytes()  # once
            with self._reading(f"patch {int(uniq[u])} (JPEG)"):
                img = decode_jpeg(raw)
            if img.shape != (size, size, 3):
                raise self._fail(
                    f"patch {int(uniq[u])} decodes to shape {img.shape}, expected {(size, size, 3)}",
                    "the store is corrupt; delete it and re-run `wsi-milssl tile`",
                )
            out[pos] = img
            decoded[u] = pos
        return out


# -- writer -------------------------------------------------------------------------------------
class StoreWriter(ABC):
    """Streams one slide's patches into a new store under a temporary name and renames it when complete.

    The temporary name is unique per writer (``.<final name>.<pid>.<random>.partial``, see
    :func:`wsi_milssl.atomic.temp_path`), so two writers never share one. Use as a context manager:
    leaving the block with an exception deletes the partial store. ``append`` takes one batch at a
    time, so memory stays bounded by the batch. A write that fails because the disk is full, the file
    system is read-only or permission is denied deletes the partial store and raises OutputError
    naming the store and the fix.
    """

    format: str = ""

    def __init__(self, final_path: str | os.PathLike, *, pixels: str, patch_size_px: int,
                 coords_attrs: Mapping[str, Any] | None = None) -> None:
        if pixels not in schema.PIXEL_ENCODINGS:
            raise ValueError(f"pixels must be one of {', '.join(schema.PIXEL_ENCODINGS)}; got {pixels!r}.")
        self.path = Path(final_path)
        self.partial_path = temp_path(self.path, kind=schema.PARTIAL_SUFFIX.lstrip("."))
        self.pixels = pixels
        self.patch_size_px = int(patch_size_px)
        self.coords_attrs = dict(coords_attrs or {})
        self.n_written = 0
        self._done = False
        self._io(self.path.parent.mkdir, parents=True, exist_ok=True)
        self._io(self._create)

    @abstractmethod
    def _create(self) -> None:
        """Create the empty partial store."""

    @abstractmethod
    def _append(self, coords: np.ndarray, entropy: np.ndarray, tissue: np.ndarray, patches: Any) -> None:
        """Append one validated batch."""

    @abstractmethod
    def _write_attrs_and_close(self, attrs: dict[str, Any]) -> None:
        """Flush buffers, write root attributes and close the partial store."""

    @abstractmethod
    def _close_quietly(self) -> None:
        """Close handles after a failure."""

    def _write_error(self, exc: BaseException) -> OSError | None:
        """The OSError behind ``exc`` when it says the store cannot be written (disk full, read-only,
        no permission), else None. Backends that see more (the HDF5 file wrapper) extend it."""
        return find_write_error(exc, access=True)

    def _io(self, fn, *args, **kwargs):
        """Run one write step; when the disk is full (or read-only, or permission is denied) the
        partial store is deleted and OutputError names the store and the fix."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            cause = self._write_error(exc)
            if cause is None:
                raise
            self.abort()
            raise output_error(self.path, cause, what="cannot write this patch store") from None

    def append(self, *, coords: np.ndarray, entropy_bits: np.ndarray, tissue_fraction: np.ndarray,
               patches: Sequence[bytes] | np.ndarray | None = None) -> None:
        """Append B patches: coords int (B, 2), entropy_bits (B,), tissue_fraction (B,), and patches as
        B JPEG byte strings (pixels='jpeg'), uint8 (B, H, W, 3) (pixels='raw') or None (pixels='none')."""
        coords = np.asarray(coords, dtype=np.int64).reshape(-1, 2)
        b = len(coords)
        entropy = np.asarray(entropy_bits, dtype=np.float32).reshape(-1)
        tissue = np.asarray(tissue_fraction, dtype=np.float32).reshape(-1)
        if len(entropy) != b or len(tissue) != b:
            raise ValueError(f"batch arrays differ in length: coords {b}, entropy {len(entropy)}, tissue {len(tissue)}.")
        if self.pixels == "none":
            if patches is not None:
                raise ValueError("this store keeps no pixels (pixels='none'); pass patches=None.")
        elif self.pixels == "raw":
            patches = np.asarray(patches)
            expected = (b, self.patch_size_px, self.patch_size_px, 3)
            if patches.dtype != np.uint8 or patches.shape != expected:
                raise ValueError(f"raw patches must be uint8 {expected}; got {patches.dtype} {patches.shape}.")
        else:
            patches = [bytes(p) for p in patches]
            if len(patches) != b:
                raise ValueError(f"got {len(patches)} JPEG patches for {b} coordinates.")
        if b == 0:
            return
        self._io(self._append, coords, entropy, tissue, patches)
        self.n_written += b

    def finalize(self, attrs: Mapping[str, Any]) -> Path:
        """Write ``attrs`` (plus schema_version and complete=True), fsync and rename into place."""
        full = dict(attrs)
        full["schema_version"] = schema.SCHEMA_VERSION
        full["n_patches"] = self.n_written
        full[schema.COMPLETE_ATTR] = True
        clean = {k: check_attr_value(k, v, where=str(self.path)) for k, v in full.items()}
        self._io(self._write_attrs_and_close, clean)
        self._io(fsync_path, self.partial_path)
        self._io(swap_into_place, self.partial_path, self.path)
        self._done = True
        return self.path

    def abort(self) -> None:
        """Close and delete the partial store."""
        if self._done:
            return
        self._done = True
        self._close_quietly()
        for attempt in range(3):
            try:
                remove_path(self.partial_path)
                return
            except OSError:  # a file vanished under us (Zarr finishing an in-flight write), or read-only
                time.sleep(0.05 * (attempt + 1))
        log.warning("%s: cannot remove this partial store; the next run into its folder removes it",
                    self.partial_path)

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def dumps_settings(settings: Mapping[str, Any]) -> str:
    """Canonical JSON of a settings mapping (sorted keys), as stored in the ``settings`` attribute."""
    return json.dumps(dict(settings), sort_keys=True, separators=(",", ":"))

