"""Fuzzing the store reader: arbitrary bytes written as a .h5 file or into a .zarr folder, and stores
corrupted byte by byte, give a store or a StoreError, never another exception."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from fuzzing import DEFAULT, LONG, json_values, mutated
from hypothesis import given
from hypothesis import strategies as st

from wsi_milssl.errors import StoreError
from wsi_milssl.store import create_writer, encode_jpeg, open_store

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
PATCH_PX = 16


def build_store(path, *, pixels: str, n: int = 12, batch: int = 5) -> None:
    """A small valid store of ``n`` random patches (written in batches of ``batch``)."""
    rng = np.random.default_rng(0)
    patches = rng.integers(0, 256, (n, PATCH_PX, PATCH_PX, 3), dtype=np.uint8)
    coords = np.stack([np.arange(n) * PATCH_PX, np.zeros(n, np.int64)], 1)
    with create_writer(path, pixels=pixels, patch_size_px=PATCH_PX, coords_attrs={"patch_size": PATCH_PX}) as w:
        for s in range(0, n, batch):
            payload = {"jpeg": [encode_jpeg(p) for p in patches[s:s + batch]], "raw": patches[s:s + batch],
                       "none": None}[pixels]
            w.append(coords=coords[s:s + batch], entropy_bits=np.full(len(coords[s:s + batch]), 6.0),
                     tissue_fraction=np.ones(len(coords[s:s + batch])), patches=payload)
        w.finalize({"slide_path": "/data/s1.tif", "slide_stem": "s1", "dimensions_lv0": [n * PATCH_PX, PATCH_PX],
                    "mpp": 0.25, "target_mpp": 0.25, "patch_size_px": PATCH_PX, "patch_size_lv0": PATCH_PX,
                    "stride_px": PATCH_PX, "stride_lv0": PATCH_PX, "pixels": pixels, "config_hash": "fuzz"})


def _exercise(path) -> None:
    """Open the store and read what the stages read: attributes, every array, a few patches."""
    try:
        with open_store(path) as store:
            n = len(store)
            assert store.coords.shape == (n, 2)
            store.attrs, store.stem, store.names()
            some = np.unique(np.array([0, n // 2, n - 1])) if n else np.zeros(0, np.int64)
            for name in store.names():
                store.array_attrs(name)
                assert len(store.read_array(name, some)) == len(some)
            if store.has("patches") and store.pixels in ("jpeg", "raw") and n:
                patches = store.read_patches(some)
                assert patches.dtype == np.uint8 and len(patches) == len(some)
            store.patch_size_lv0, store.slide_path
    except StoreError:
        pass


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Small valid stores of every pixel kind and format: {(fmt, pixels): path}."""
    root = tmp_path_factory.mktemp("store_fuzz_base")
    out = {}
    for fmt in ("h5", "zarr"):
        for pixels in ("jpeg", "raw", "none"):
            out[fmt, pixels] = root / f"{pixels}.{fmt}"
            build_store(out[fmt, pixels], pixels=pixels)
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("store_fuzz")


# -- HDF5 --------------------------------------------------------------------------------------------

def _check_h5_bytes(work, data: bytes) -> None:
    path = work / "fuzz.h5"
    path.write_bytes(data)
    _exercise(path)


def _check_h5_mutation(stores, work, pixels: str, edits: list[tuple[float, int]], cut: float | None) -> None:
    data = bytearray(stores["h5", pixels].read_bytes())
    for where, value in edits:  # positions as fractions, so that one strategy fits every file size
        data[int(where * (len(data) - 1))] = value
    if cut is not None:
        data = data[: int(cut * len(data))]
    _check_h5_bytes(work, bytes(data))


EDITS = st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1, max_size=12)
CUTS = st.one_of(st.none(), st.floats(0, 1))
PIXELS = st.sampled_from(["jpeg", "raw", "none"])


@DEFAULT
@given(data=st.one_of(st.binary(max_size=4096), st.binary(max_size=4096).map(lambda b: HDF5_SIGNATURE + b)))
def test_h5_random_bytes(work, data):
    _check_h5_bytes(work, data)


@DEFAULT
@given(pixels=PIXELS, edits=EDITS, cut=CUTS)
def test_h5_corrupted_store(stores, work, pixels, edits, cut):
    _check_h5_mutation(stores, work, pixels, edits, cut)


@pytest.mark.slow
@LONG
@given(pixels=PIXELS, edits=EDITS, cut=CUTS)
def test_h5_corrupted_store_long(stores, work, pixels, edits, cut):
    _check_h5_mutation(stores, work, pixels, edits, cut)


# -- Zarr --------------------------------------------------------------------------------------------

def _zarr_files(store) -> list[str]:
    return sorted(str(p.relative_to(store)) for p in store.rglob("*") if p.is_file())


@st.composite
def zarr_damage(draw, stores):
    """(pixels, file inside the store, new bytes for it): arbitrary bytes, a byte mutation, or a
    JSON metadata file with one value replaced."""
    pixels = draw(PIXELS)
    files = _zarr_files(stores["zarr", pixels])
    name = draw(st.sampled_from(files))
    old = (stores["zarr", pixels] / name).read_bytes()
    kind = draw(st.sampled_from(["bytes", "mutate", "json"] if name.endswith("zarr.json") else ["bytes", "mutate"]))
    if kind == "bytes":
        new = draw(st.binary(max_size=512))
    elif kind == "mutate":
        new = draw(mutated(old))
    else:
        doc = json.loads(old)
        node, key = doc, None
        for _ in range(draw(st.integers(1, 4))):  # walk down to a random member
            keys = list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
            if not keys:
                break
            key = draw(st.sampled_from(keys))
            if draw(st.booleans()) and isinstance(node[key], (dict, list)) and node[key]:
                node = node[key]
                key = None
            else:
                break
        if key is not None:
            node[key] = draw(json_values(8))
        new = json.dumps(doc, allow_nan=True).encode()
    return pixels, name, new


def _check_zarr(stores, work, damage) -> None:
    pixels, name, new = damage
    path = work / "fuzz.zarr"
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(stores["zarr", pixels], path)
    (path / name).write_bytes(new)
    _exercise(path)


@pytest.fixture(scope="module")
def damage_strategy(stores):
    return zarr_damage(stores)


def test_zarr_random_root_metadata(work):
    """A .zarr folder whose zarr.json is arbitrary bytes (a few fixed cases; the fuzz tests below vary them)."""
    for data in (b"", b"{}", b"[]", b"\x00\xff", b'{"zarr_format": 3, "node_type": "group", "attributes": 7}',
                 b'{"zarr_format": 3, "node_type": "array"}'):
        path = work / "root.zarr"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir()
        (path / "zarr.json").write_bytes(data)
        with pytest.raises(StoreError, match=r"root\.zarr: "):
            open_store(path)


@DEFAULT
@given(data=st.data())
def test_zarr_corrupted_store(stores, work, damage_strategy, data):
    _check_zarr(stores, work, data.draw(damage_strategy))


@pytest.mark.slow
@LONG
@given(data=st.data())
def test_zarr_corrupted_store_long(stores, work, damage_strategy, data):
    _check_zarr(stores, work, data.draw(damage_strategy))
