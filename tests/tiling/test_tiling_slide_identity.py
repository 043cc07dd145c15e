"""``tile`` reuses a store only for the slide file it was cut from (path, or file name for a slide moved, size
and modification time),
and a slide whose tile data is corrupt fails with a message that names it and the fix."""

from __future__ import annotations

import logging
import os
import shutil

import h5py
import pytest
import tifffile

from wsi_milssl.cli import main
from wsi_milssl.config import TileConfig
from wsi_milssl.store import open_store
from wsi_milssl.tiling import read_status_csv, tile_slides

# 20x / 256 px on the 4096-px fixture slides: 8 x 8 grid cells; pixels are not kept (fast).
FAST = dict(magnification=20, patch_size_px=256, entropy_threshold_bits=4.0, pixels="none", threads=1)


def _fingerprint(store_path) -> tuple:
    with open_store(store_path) as s:
        a = s.attrs
        return a["slide_path"], a["slide_size_bytes"], a["slide_mtime_ns"], len(s)


def _stat(path) -> tuple:
    st = os.stat(path)
    return str(path.resolve()), st.st_size, st.st_mtime_ns


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_slide_rewritten_in_place_is_tiled_again(synth_slides, tmp_path, fmt, caplog):
    slide = tmp_path / "slides" / "case.tif"
    slide.parent.mkdir()
    shutil.copyfile(synth_slides["normal"], slide)
    config = TileConfig(**FAST, format=fmt)
    out = tmp_path / "stores"
    store = out / f"case.{fmt}"
    first = tile_slides([slide], out, config)
    assert [r.status for r in first.results] == ["ok"]
    assert _fingerprint(store)[:3] == _stat(slide)
    # unchanged: skipped
    assert [r.status for r in tile_slides([slide], out, config).results] == ["skipped"]

    # the same name now holds another slide (as `synth` with another seed leaves it)
    shutil.copyfile(synth_slides["tumor"], slide)
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.tiling.runner"):
        again = tile_slides([slide], out, config)
    assert [r.status for r in again.results] == ["ok"]
    assert read_status_csv(out / "tile_status.csv")[0]["status"] == "ok"
    assert "the slide file changed since it was tiled" in caplog.text
    path, size, mtime, n = _fingerprint(store)
    assert (path, size, mtime) == _stat(slide)
    fresh = tile_slides([synth_slides["tumor"]], tmp_path / "fresh", config).results[0]
    assert n == fresh.n_patches != first.results[0].n_patches

    # same size, only the modification time moved: still tiled again
    st = os.stat(slide)
    os.utime(slide, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    assert [r.status for r in tile_slides([slide], out, config).results] == ["ok"]
    assert _fingerprint(store)[2] == os.stat(slide).st_mtime_ns


def test_a_store_of_another_slide_file_with_the_same_name_is_replaced(synth_slides, tmp_path, caplog):
    """The reviewer's case: stores copied, then `tile s2/synth_002.tif` into the copy reported 'skipped'
    and kept s1's patches."""
    a, b = tmp_path / "a" / "case.tif", tmp_path / "b" / "case.tif"
    for path, source in ((a, synth_slides["normal"]), (b, synth_slides["tumor"])):
        path.parent.mkdir()
        shutil.copyfile(source, path)
    config = TileConfig(**FAST)
    out = tmp_path / "stores"
    tile_slides([a], out, config)
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.tiling.runner"):
        run = tile_slides([b], out, config)
    assert [r.status for r in run.results] == ["ok"]
    assert "it was cut from another slide file" in caplog.text and str(a.resolve()) in caplog.text
    assert _fingerprint(out / "case.h5")[:3] == _stat(b)


def test_a_store_of_a_slide_moved_with_its_times_is_reused(synth_slides, tmp_path, caplog):
    """A slide folder moved (`mv`) or copied with its times (`cp -a`, `rsync -a`): same file name, size and
    modification time, so the store is kept (not cut again); a copy with a new time is cut again."""
    a = tmp_path / "a" / "case.tif"
    a.parent.mkdir()
    shutil.copyfile(synth_slides["normal"], a)
    config = TileConfig(**FAST)
    out = tmp_path / "stores"
    tile_slides([a], out, config)
    store = out / "case.h5"
    made = os.stat(store).st_mtime_ns
    moved = tmp_path / "moved" / "case.tif"
    moved.parent.mkdir()
    a.rename(moved)
    copied = tmp_path / "copied" / "case.tif"
    copied.parent.mkdir()
    shutil.copy2(moved, copied)
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.tiling.runner"):
        for slide in (moved, copied):
            assert [r.status for r in tile_slides([slide], out, config).results] == ["skipped"]
    assert caplog.text == "" and os.stat(store).st_mtime_ns == made
    assert _fingerprint(store)[0] == str(a.resolve())  # the store keeps the path it was cut from
    renamed = tmp_path / "copied" / "other.tif"  # another name: another slide
    shutil.copy2(moved, renamed)
    assert [r.status for r in tile_slides([renamed], out, config).results] == ["ok"]
    fresh = tmp_path / "fresh" / "case.tif"  # copied without its time
    fresh.parent.mkdir()
    shutil.copyfile(moved, fresh)
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.tiling.runner"):
        assert [r.status for r in tile_slides([fresh], out, config).results] == ["ok"]
    # review DD: said "another slide file", though only the modification time differs
    assert f"it was cut from {str(a.resolve())!r}, and the slide file of that name and size here " \
           f"({str(fresh.resolve())!r}) has another modification time" in caplog.text
    assert _fingerprint(store)[:3] == _stat(fresh)


def test_a_store_without_the_slide_fingerprint_is_tiled_again(synth_slides, tmp_path, caplog):
    """Stores written before slide_size_bytes / slide_mtime_ns existed cannot be checked: re-tiled."""
    config = TileConfig(**FAST)
    out = tmp_path / "stores"
    slide = synth_slides["normal"]
    tile_slides([slide], out, config)
    store = out / f"{slide.stem}.h5"
    with h5py.File(store, "r+") as fh:
        del fh.attrs["slide_size_bytes"]
        del fh.attrs["slide_mtime_ns"]
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.tiling.runner"):
        run = tile_slides([slide], out, config)
    assert [r.status for r in run.results] == ["ok"]
    assert "records no slide size and modification time" in caplog.text
    assert _fingerprint(store)[:3] == _stat(slide)


def test_corrupt_tile_data_fails_naming_the_slide_and_the_fix(synth_slides, tmp_path):
    slides = tmp_path / "slides"
    slides.mkdir()
    bad, good = slides / "bad.tif", slides / "good.tif"
    shutil.copyfile(synth_slides["tumor"], bad)
    shutil.copyfile(synth_slides["normal"], good)
    # zero the JPEG tiles of the lower rows of level 1 (the level read at 20x); the thumbnail level and
    # the first rows stay readable, so the slide opens and the damage shows only while tiling
    with tifffile.TiffFile(bad) as tif:
        page = tif.pages[1]
        assert page.shape[:2] == (2048, 2048)
        spans = list(zip(page.dataoffsets, page.databytecounts))[40:]
    with open(bad, "r+b") as fh:
        for offset, count in spans:
            fh.seek(offset)
            fh.write(b"\0" * count)
    run = tile_slides([bad, good], tmp_path / "out", TileConfig(**FAST))
    status = {r.slide: r for r in run.results}
    assert status["good"].status == "ok" and status["bad"].status == "failed"
    error = read_status_csv(tmp_path / "out" / "tile_status.csv")[0]["error"]
    assert error == " ".join(status["bad"].error.split())
    assert error.startswith(f"{bad}: the slide's tile data is corrupt: tile ")
    assert "Not a JPEG file" in error
    assert "Fix: re-export the slide from the scanner software (or re-scan it)" in error
    # `info` decodes the centre of the first and the last level only: it passes this slide, as the hint says
    assert error.endswith("(`wsi-milssl info` decodes only a small square at the centre of the first and the "
                          "last level, so it may pass this slide).")
    assert main(["info", str(bad), "-q"]) == 0
    assert not (tmp_path / "out" / "bad.h5").exists()


def _copy_with_tile_34(slide, target):
    """(``slide`` copied to ``target``, the file offset and byte count of tile 34 of its level 1: a tile inside the
    slide, read while tiling at 20x, not at its first patch)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(slide, target)
    with tifffile.TiffFile(target) as tif:
        page = tif.pages[1]
        return target, int(page.dataoffsets[34]), int(page.databytecounts[34])


def test_a_tile_whose_jpeg_data_is_cut_short_fails_the_slide_not_grey_pixels(synth_slides, tmp_path):
    """Review ES, A2: a level tile with the second half of its JPEG data zeroed decoded, through the direct TIFF
    reads, into grey rows, and the slide was tiled "ok" (OpenSlide refuses it): the tile's end-of-image marker is
    checked now."""
    bad, offset, count = _copy_with_tile_34(synth_slides["tumor"], tmp_path / "slides" / "bad.tif")
    with open(bad, "r+b") as fh:
        fh.seek(offset + count // 2)
        fh.write(b"\0" * (count - count // 2))
    run = tile_slides([bad], tmp_path / "out", TileConfig(**FAST))
    assert [r.status for r in run.results] == ["failed"], run.results
    assert run.results[0].error.startswith(f"{bad}: the slide's tile data is corrupt: tile 34 ")
    assert "has no end-of-image marker after its scan: cut short" in run.results[0].error


def test_bytes_after_a_tiles_end_of_image_marker_are_allowed(synth_slides, tmp_path):
    """Review ET: the first end-of-image check wanted the marker last (after zero padding), so a valid tile with
    bytes after it (OpenSlide and libjpeg read it) failed the whole slide."""
    padded, offset, count = _copy_with_tile_34(synth_slides["tumor"], tmp_path / "slides" / "padded.tif")
    data = padded.read_bytes()
    assert data[offset + count - 2:offset + count] == b"\xff\xd9"
    with open(padded, "r+b") as fh:  # the tile's last bytes moved one pair back, two 0xFF bytes after its marker
        fh.seek(offset + count - 4)
        fh.write(data[offset + count - 2:offset + count] + b"\xff\xff")
    run = tile_slides([padded], tmp_path / "out", TileConfig(**FAST))
    assert [r.status for r in run.results] == ["ok"], run.results
