"""A Zarr store with a missing chunk file, or a store with duplicate coordinates, is refused as corrupt
instead of reading the lost data as zeros."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from wsi_milssl.cli import main
from wsi_milssl.errors import StoreError
from wsi_milssl.store import create_writer, open_store

TILE_ARGS = ["--format", "zarr", "--magnification", "10", "--patch-size", "64"]


@pytest.fixture(scope="module")
def tiled(synth_dir, tmp_path_factory):
    """Zarr stores (JPEG pixels) made by `tile --format zarr` for the two generated slides, then labelled."""
    out = tmp_path_factory.mktemp("zarr_chunks") / "stores"
    slides = [str(synth_dir / "synth_000.tif"), str(synth_dir / "synth_001.tif")]
    assert main(["tile", *slides, "--out", str(out), *TILE_ARGS]) == 0
    assert main(["label", str(out), "--annotations", str(synth_dir), "--labels", str(synth_dir / "labels.csv"),
                 "--out", str(out.parent / "labels")]) == 0
    return out


def _copy(tiled, tmp_path, stem):
    dst = tmp_path / f"{stem}.zarr"
    shutil.copytree(tiled / f"{stem}.zarr", dst)
    return dst


def test_tiled_and_labelled_stores_open(tiled):
    """Every chunk is written, even an all-zero one (instance_label of the normal slide)."""
    for stem in ("synth_000", "synth_001"):
        with open_store(tiled / f"{stem}.zarr") as store:
            assert len(store) > 0 and store.has("instance_label")
            assert len(np.unique(store.coords, axis=0)) == len(store)
    with open_store(tiled / "synth_001.zarr") as store:
        labels = store.read_array("instance_label")
    normal = "synth_001" if not labels.any() else "synth_000"
    with open_store(tiled / f"{normal}.zarr") as store:
        assert not store.read_array("instance_label").any()
    assert (tiled / f"{normal}.zarr" / "instance_label" / "c" / "0").is_file()


@pytest.mark.parametrize("chunk", ["coords/c/0/0", "entropy_bits/c/0", "tissue_fraction/c/0", "instance_label/c/0",
                                   "patches/data/c/0", "patches/offsets/c/0"])
def test_missing_chunk_is_refused(tiled, tmp_path, chunk):
    store = _copy(tiled, tmp_path, "synth_000")
    (store / chunk).unlink()
    name = chunk.split("/c/")[0]
    message = (rf"synth_000\.zarr: array '{name}' is missing 1 of its \d+ chunk files \({chunk}\); its data would "
               r"read as zeros\. Fix: .*re-run `wsi-milssl tile`")
    if name.startswith("patches/"):  # the patches' many chunk files are listed on their first read, not on open
        opened = open_store(store)
        assert len(opened.coords) == len(opened)
        with pytest.raises(StoreError, match=message):
            opened.read_patches([0])
    else:
        with pytest.raises(StoreError, match=message):
            open_store(store)


def test_missing_chunk_cli_error(tiled, tmp_path, synth_dir, capsys):
    store = _copy(tiled, tmp_path, "synth_000")
    (store / "coords" / "c" / "0" / "0").unlink()
    code = main(["label", str(store), "--annotations", str(synth_dir), "--labels", str(synth_dir / "labels.csv"),
                 "--out", str(tmp_path / "labels")])
    err = capsys.readouterr().err
    assert code != 0
    assert "missing 1 of its 1 chunk files" in err and "Traceback" not in err


def test_missing_shard_of_raw_patches(tmp_path, make_store):
    path = tmp_path / "s.zarr"
    make_store(path, pixels="raw", n=37)  # 3 shards of 16 patches
    open_store(path).close()
    (path / "patches" / "c" / "1" / "0" / "0" / "0").unlink()
    for read in (lambda s: s.read_patches([0]), lambda s: s.read_array("patches")):
        with pytest.raises(StoreError, match=r"array 'patches' is missing 1 of its 3 chunk files \(patches/c/1/0/0/0\)"):
            read(open_store(path))


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_duplicate_coords_are_refused(tmp_path, fmt):
    path = tmp_path / f"s.{fmt}"
    coords = np.array([[0, 0], [64, 0], [128, 0], [64, 0]])
    with create_writer(path, pixels="none", patch_size_px=64) as w:
        w.append(coords=coords, entropy_bits=np.ones(4), tissue_fraction=np.ones(4))
        w.finalize({"slide_stem": "s", "pixels": "none", "patch_size_px": 64})
    store = open_store(path)
    with pytest.raises(StoreError, match=r"'coords' holds 1 duplicate coordinate\(s\), e\.g\. \(64, 0\).*Fix: .*"
                                         r"re-run `wsi-milssl tile`"):
        store.coords


def test_an_array_of_an_earlier_version_without_its_zero_chunks_still_opens(tiled, tmp_path):
    """Earlier versions skipped all-zero chunks and did not mark their arrays: a chunk missing there is not
    damage (the normal slide's instance_label was all zeros), so unmarked arrays are not checked."""
    import json

    store = _copy(tiled, tmp_path, "synth_000")
    meta_path = store / "instance_label" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    assert meta["attributes"].pop("all_chunks_written") is True
    meta_path.write_text(json.dumps(meta))
    (store / "instance_label" / "c" / "0").unlink()
    with open_store(store) as opened:
        assert len(opened.read_array("instance_label")) == len(opened)
