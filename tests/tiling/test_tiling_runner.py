"""The tile runner on generated slides: both formats, resume, settings mismatch, workers, bad slides."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from PIL import Image

from wsi_milssl.config import TileConfig
from wsi_milssl.errors import ConfigError, StoreError
from wsi_milssl.slide import open_slide
from wsi_milssl.store import find_stores, open_store
from wsi_milssl.synth.pyramid import write_pyramidal_tiff
from wsi_milssl.tiling import find_slides, qc_path, read_status_csv, tile_slide, tile_slides

# 20x / 256 px on the 4096-px fixture slides: 8 x 8 grid cells of 512 level-0 px. The entropy
# threshold is lowered so that the test does not depend on how rich the synthetic texture is.
FAST = dict(magnification=20, patch_size_px=256, entropy_threshold_bits=4.0)


@pytest.fixture(scope="module")
def h5_run(synth_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiles_h5")
    return out, tile_slides(find_slides([synth_dir]), out, TileConfig(**FAST, format="h5"))


def test_run_writes_stores_status_config_and_qc(h5_run, synth_dir):
    out, run = h5_run
    assert run.ok and [r.status for r in run.results] == ["ok", "ok"]
    rows = read_status_csv(out / "tile_status.csv")
    assert list(rows[0]) == ["slide", "status", "n_patches", "seconds", "error"]
    assert [(r["slide"], r["status"]) for r in rows] == [("synth_000", "ok"), ("synth_001", "ok")]
    assert [int(r["n_patches"]) for r in rows] == [r.n_patches for r in run.results]
    assert all(r.n_patches > 0 for r in run.results)
    assert [p.name for p in find_stores(out)] == ["synth_000.h5", "synth_001.h5"]
    cfg = json.loads((out / "tile_config.json").read_text())
    assert cfg["tile"]["patch_size_px"] == 256 and cfg["settings"]["target_mpp"] == 0.5
    for r in run.results:
        with Image.open(qc_path(out, r.slide)) as im:
            assert im.format == "PNG" and max(im.size) >= 512
        with open_store(r.store_path) as s:
            a = s.attrs
            assert a["slide_path"] == str((synth_dir / f"{r.slide}.tif").resolve())
            assert a["target_magnification"] == 20.0 and a["target_mpp"] == 0.5 and a["mpp"] == 0.25
            assert a["patch_size_lv0"] == 512 and a["level"] == 1 and a["level_downsample"] == 2.0
            assert a["n_patches"] == len(s) <= a["n_candidates"] <= a["n_grid"] == 64
            assert a["config_hash"] == TileConfig(**FAST).settings_hash()
            assert (s.read_array("entropy_bits") >= 4.0).all()
            assert (s.read_array("tissue_fraction") >= 0.1).all()
            # rows in grid order (y, then x)
            order = np.lexsort((s.coords[:, 0], s.coords[:, 1]))
            np.testing.assert_array_equal(order, np.arange(len(s)))


def test_jpeg_patches_match_the_slide_and_raw_is_exact(h5_run, synth_slides, tmp_path):
    out, _ = h5_run
    raw = tile_slide(synth_slides["tumor"], tmp_path, TileConfig(**FAST, pixels="raw", format="zarr"))
    with open_store(out / "synth_000.h5") as jp, open_store(raw.store_path) as rw, \
            open_slide(synth_slides["tumor"]) as slide:
        assert jp.stem == rw.stem == synth_slides["tumor"].stem
        np.testing.assert_array_equal(jp.coords, rw.coords)
        idx = np.arange(0, len(jp), 3)
        want = np.stack([slide.read_region(int(x), int(y), 256, target_mpp=0.5) for x, y in jp.coords[idx]])
        np.testing.assert_array_equal(rw.read_patches(idx), want)
        err = np.abs(jp.read_patches(idx).astype(int) - want).mean()
        assert err < 4.0  # JPEG quality 90


def test_h5_and_zarr_runs_have_the_same_content(h5_run, synth_dir, tmp_path, store_contents, same_contents):
    out, _ = h5_run
    run = tile_slides(find_slides([synth_dir / "labels.csv"]), tmp_path, TileConfig(**FAST, format="zarr", threads=1))
    assert run.ok
    for r in run.results:
        same_contents(store_contents(out / f"{r.slide}.h5"), store_contents(r.store_path),
                      ignore_attrs=("settings", "config_hash"))


def test_workers_2_give_the_same_stores(h5_run, synth_dir, tmp_path, store_contents, same_contents):
    out, _ = h5_run
    run = tile_slides(find_slides([synth_dir]), tmp_path, TileConfig(**FAST, workers=2, threads=1))
    assert run.ok and [r.slide for r in run.results] == ["synth_000", "synth_001"]
    for r in run.results:
        same_contents(store_contents(out / f"{r.slide}.h5"), store_contents(r.store_path))


def test_resume_skips_same_settings_and_refuses_others(synth_slides, tmp_path):
    slides = [synth_slides["normal"]]
    first = tile_slides(slides, tmp_path, TileConfig(**FAST, pixels="none"))
    store = tmp_path / f"{slides[0].stem}.h5"
    mtime = store.stat().st_mtime_ns
    again = tile_slides(slides, tmp_path, TileConfig(**FAST, pixels="none", threads=1, batch_size=7))
    assert [r.status for r in again.results] == ["skipped"]
    assert again.results[0].n_patches == first.results[0].n_patches
    assert store.stat().st_mtime_ns == mtime
    assert read_status_csv(tmp_path / "tile_status.csv")[0]["status"] == "skipped"
    other = TileConfig(**{**FAST, "patch_size_px": 128}, pixels="none")
    with pytest.raises(StoreError, match=r"made with different settings \(patch_size_px 256 -> 128; "
                                         r"stride_px 256 -> 128\)\. "
                                         r"Fix: write to a new folder with --out, or pass --overwrite"):
        tile_slides(slides, tmp_path, other)
    redo = tile_slides(slides, tmp_path, other, overwrite=True)
    assert redo.results[0].status == "ok"
    with open_store(store) as s:
        assert s.patch_size_px == 128


def test_one_folder_holds_stores_of_one_setting(synth_slides, tmp_path, caplog):
    """Stores of other slides count too: tiling slide B with 128 px into a folder that holds slide A's
    256-px store used to succeed, leaving stores of two settings and a tile_config.json that claimed 128 px
    for both. Now it stops with one error naming A's store, the settings that differ and the fix; with
    --overwrite A's store stays, with a warning, and tile_config.json lists it."""
    import logging

    a, b = synth_slides["normal"], synth_slides["tumor"]
    fast = dict(FAST, pixels="none")
    tile_slides([a], tmp_path, TileConfig(**fast))
    config_before = (tmp_path / "tile_config.json").read_bytes()
    other = TileConfig(**{**fast, "patch_size_px": 128})
    with pytest.raises(StoreError) as err:
        tile_slides([b], tmp_path, other)
    assert str(err.value) == (
        f"{tmp_path / a.stem}.h5: this store was made with different settings (patch_size_px 256 -> 128; stride_px "
        "256 -> 128); its slide is not in this run, but one folder holds the stores of one setting. Fix: write to a "
        "new folder with --out, or pass --overwrite and give its slide too, to re-tile it with these settings.")
    assert [p.name for p in find_stores(tmp_path)] == [f"{a.stem}.h5"]
    assert (tmp_path / "tile_config.json").read_bytes() == config_before
    # the stores of the run's slides and of others in one error
    tile_slides([b], tmp_path / "two", TileConfig(**fast))
    tile_slides([a], tmp_path / "two", TileConfig(**fast))
    first, second = sorted([a.stem, b.stem])
    two = re.escape(str(tmp_path / "two"))
    with pytest.raises(StoreError, match=(
            rf"^{two}: 2 stores in this folder were made with different settings: {first}\.h5, "
            rf"{second}\.h5 \(patch_size_px 256 -> 128; stride_px 256 -> 128\); the slide of 1 of them is not in "
            rf"this run \({b.stem}\.h5\), but one folder holds .* pass --overwrite and give the slides of the "
            r"stores not in this run too, to re-tile them with these settings\.$")):
        tile_slides([a], tmp_path / "two", other)

    with caplog.at_level(logging.WARNING, logger="wsi_milssl.tiling.runner"):
        run = tile_slides([b], tmp_path, other, overwrite=True)
    assert run.ok
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path}: 1 store(s) of slides not in this run were made with other settings and stay as they are: "
        f"{a.stem}.h5 (patch_size_px 256 -> 128; stride_px 256 -> 128); tile_config.json lists them under "
        "'stores_with_other_settings'. Fix: re-tile their slides with --overwrite too, or move them to another folder."]
    config = json.loads((tmp_path / "tile_config.json").read_text())
    assert config["tile"]["patch_size_px"] == 128 and config["stores_with_other_settings"] == [f"{a.stem}.h5"]
    # the pipeline keeps the stores of slides that left a set: no refusal, no warning, still listed
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.tiling.runner"):
        again = tile_slides([b], tmp_path, other, keep_other_stores=True)
    assert [r.status for r in again.results] == ["skipped"] and caplog.records == []
    assert json.loads((tmp_path / "tile_config.json").read_text())["stores_with_other_settings"] == [f"{a.stem}.h5"]
    # once every store has these settings, the folder is one setting again
    tile_slides([a], tmp_path, other, overwrite=True)
    assert json.loads((tmp_path / "tile_config.json").read_text())["stores_with_other_settings"] == []
    assert [r.status for r in tile_slides([a, b], tmp_path, other).results] == ["skipped", "skipped"]


def test_stores_in_the_other_format_count_as_another_setting(synth_slides, tmp_path, caplog):
    """The format is a setting: tiling the same slides with 128 px into Zarr in a folder of 256-px HDF5
    stores used to succeed without a word (the .h5 stores were skipped by the check), leaving both sets in
    one folder, a tile_config.json that described only the Zarr ones and `label` labelling both. Now it is
    refused with one error naming the .h5 stores and the fix; with --overwrite (or the pipeline's
    keep_other_stores) they stay, with a warning unless keep_other_stores, and tile_config.json lists them."""
    import logging

    slides = sorted(synth_slides.values())
    fast = dict(FAST, pixels="none")
    tile_slides(slides, tmp_path, TileConfig(**fast))
    status_before = (tmp_path / "tile_status.csv").read_bytes()
    names = [f"{s.stem}.h5" for s in slides]
    zarr = TileConfig(**{**fast, "patch_size_px": 128, "format": "zarr"})
    with pytest.raises(StoreError) as err:
        tile_slides(slides, tmp_path, zarr)
    assert str(err.value) == (
        f"{tmp_path}: 2 stores in this folder were made with different settings: {', '.join(names)} (format 'h5' "
        "-> 'zarr'; patch_size_px 256 -> 128; stride_px 256 -> 128); none of them is in this run's format (zarr). "
        "Fix: write to a new folder with --out, or move the .h5 stores to another folder.")
    assert [p.name for p in find_stores(tmp_path)] == names
    assert (tmp_path / "tile_status.csv").read_bytes() == status_before
    # the same settings in the other format are another setting too
    with pytest.raises(StoreError, match=r"\(format 'h5' -> 'zarr'\); none of them is in this run's format"):
        tile_slides(slides, tmp_path, TileConfig(**{**fast, "format": "zarr"}))

    with caplog.at_level(logging.WARNING, logger="wsi_milssl.tiling.runner"):
        run = tile_slides(slides, tmp_path, zarr, overwrite=True)
    assert run.ok
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path}: 2 store(s) not in this run's format (zarr) were made with other settings and stay as they "
        f"are: {', '.join(names)} (format 'h5' -> 'zarr'; patch_size_px 256 -> 128; stride_px 256 -> 128); "
        "tile_config.json lists them under 'stores_with_other_settings'. Fix: move them to another folder."]
    config = json.loads((tmp_path / "tile_config.json").read_text())
    assert config["tile"]["format"] == "zarr" and config["stores_with_other_settings"] == names
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.tiling.runner"):
        again = tile_slides(slides, tmp_path, zarr, keep_other_stores=True)
    assert [r.status for r in again.results] == ["skipped", "skipped"] and caplog.records == []
    assert json.loads((tmp_path / "tile_config.json").read_text())["stores_with_other_settings"] == names
    # back to HDF5 with the Zarr stores' settings: the .h5 stores of the run's slides are replaced, the .zarr
    # ones are named in the error
    with pytest.raises(StoreError, match=(
            r"stores of this run's slides and move the \.zarr stores to another folder\.$")):
        tile_slides(slides, tmp_path, TileConfig(**{**fast, "patch_size_px": 128}))


def test_bad_slide_is_recorded_and_others_finish(synth_slides, tmp_path):
    bad = tmp_path / "slides" / "broken.tif"
    bad.parent.mkdir()
    bad.write_text("this is a text file, not a slide\n")
    good = bad.parent / "good.tif"
    good.symlink_to(synth_slides["normal"])
    run = tile_slides(find_slides([bad.parent]), tmp_path / "out",
                      TileConfig(**FAST, pixels="none", workers=2, threads=1))
    status = {r.slide: r for r in run.results}
    assert status["broken"].status == "failed" and status["good"].status == "ok"
    assert "broken.tif: OpenSlide does not recognise this file" in status["broken"].error
    assert not run.ok and run.n_failed == 1
    rows = {r["slide"]: r for r in read_status_csv(tmp_path / "out" / "tile_status.csv")}
    assert rows["broken"]["status"] == "failed" and "OpenSlide" in rows["broken"]["error"]
    assert [p.name for p in (tmp_path / "out").iterdir() if "broken" in p.name] == []


def test_a_slide_name_too_long_for_its_outputs_fails_that_slide_naming_the_fix(synth_slides, tmp_path):
    # 239 bytes: every file named after it fits (the store's temporary too); 240: `<stem>_patches.geojson` would not
    slides = tmp_path / "slides"
    slides.mkdir()
    fits, too_long = slides / ("a" * 239 + ".tif"), slides / ("b" * 240 + ".tif")
    fits.symlink_to(synth_slides["normal"])
    too_long.symlink_to(synth_slides["tumor"])
    run = tile_slides(find_slides([slides]), tmp_path / "out", TileConfig(**FAST, pixels="none"))
    status = {r.slide: r for r in run.results}
    assert status["a" * 239].status == "ok" and (tmp_path / "out" / ("a" * 239 + ".h5")).is_file()
    assert status["b" * 240].status == "failed"
    assert status["b" * 240].error == (
        f"{too_long}: the slide's name is 240 bytes long, too long for the files named after it "
        "(bbbbbbbbbbbb..._patches.geojson would pass the 255 bytes a file name may have). Fix: rename the slide "
        "(and its annotation file) to at most 239 bytes.")


def test_a_72_dpi_tag_is_named_in_the_tile_error(tmp_path):
    """The tile stage's error used to drop what `info` says about the ignored resolution tag."""
    import tifffile

    path = tmp_path / "boxes.tiff"
    tifffile.imwrite(path, np.full((512, 512, 3), 120, np.uint8), tile=(256, 256), compression="jpeg",
                     photometric="rgb", resolution=(72, 72), resolutionunit="INCH", metadata=None)
    run = tile_slides([path], tmp_path / "out", TileConfig(**FAST))
    assert run.results[0].status == "failed"
    assert run.results[0].error == (
        f"{path}: the slide has no MPP (its metadata says 72 pixels per inch = 352.778 µm/px, which is not a "
        "microscope's resolution) and no objective power, so its physical scale is unknown. Fix: pass the "
        "level-0 resolution with --slide-mpp (µm per pixel, e.g. --slide-mpp 0.25; in a pipeline, [tile] slide_mpp).")


def test_a_slide_smaller_than_one_patch_says_so(tmp_path, caplog):
    """1 x 3000 px: no grid cell fits, which is not "no patch passed the tissue and entropy filters"."""
    import logging

    path = tmp_path / "thin.tif"
    write_pyramidal_tiff(path, lambda x0, y0, x1, y1: np.full((y1 - y0, x1 - x0, 3), 120, np.uint8),
                         width=1, height=3000, mpp=0.25)
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.tiling.runner"):
        run = tile_slides([path], tmp_path / "out", TileConfig(**FAST))
    assert run.ok and run.results[0].n_patches == 0
    assert [r.getMessage() for r in caplog.records] == [
        "thin: the slide (1 x 3000 px at level 0, 0.25 µm/px) is smaller than one patch at the chosen resolution "
        "(256 px at 0.5 µm/px cover 512 x 512 level-0 px), so no grid cell fits in it; the store is empty."]


def test_slide_without_mpp_needs_slide_mpp(tmp_path):
    path = tmp_path / "nompp.tif"
    write_pyramidal_tiff(path, lambda x0, y0, x1, y1: np.full((y1 - y0, x1 - x0, 3), 240, np.uint8),
                         width=1024, height=1024, mpp=None)
    run = tile_slides([path], tmp_path / "out", TileConfig(**FAST))
    assert run.results[0].status == "failed"
    assert run.results[0].error == (
        f"{path}: the slide has no MPP and no objective power, so its physical scale is unknown. Fix: pass the "
        "level-0 resolution with --slide-mpp (µm per pixel, e.g. --slide-mpp 0.25; in a pipeline, [tile] slide_mpp).")
    run = tile_slides([path], tmp_path / "out", TileConfig(**FAST, slide_mpp=0.5))
    assert run.ok and run.results[0].n_patches == 0  # blank glass: an empty store, not an error
    with open_store(tmp_path / "out" / "nompp.h5") as s:
        assert s.attrs["mpp"] == 0.5 and s.attrs["mpp_source"] == "override" and len(s) == 0


def test_a_slide_mpp_other_than_the_slide_s_own_is_warned_about(tmp_path, caplog):
    """Review CX, C7: --slide-mpp overrode a slide's own resolution without a word (4x the patches)."""
    import logging

    path = tmp_path / "own.tif"
    write_pyramidal_tiff(path, lambda x0, y0, x1, y1: np.full((y1 - y0, x1 - x0, 3), 240, np.uint8),
                         width=1024, height=1024, mpp=0.25)
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.tiling"):
        tile_slides([path], tmp_path / "out", TileConfig(**FAST, slide_mpp=0.5))
    assert "own: --slide-mpp 0.5 µm/px overrides the slide's own 0.25 µm/px (its metadata): the patches cover 0.25x" \
        in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.tiling"):
        tile_slides([path], tmp_path / "out2", TileConfig(**FAST, slide_mpp=0.25))  # the slide's own: no word
    assert "overrides the slide's own" not in caplog.text


def test_config_validation_messages():
    from wsi_milssl.errors import ConfigError

    with pytest.raises(ConfigError, match="give magnification or target_mpp, not both"):
        TileConfig(magnification=10, target_mpp=1.0)
    with pytest.raises(ConfigError, match=r"TileConfig.pixels must be one of 'jpeg', 'raw', 'none'; got 'png'"):
        TileConfig(pixels="png")
    with pytest.raises(ConfigError, match=r"TileConfig.tissue must be one of 'none', 'otsu'; got 'x'"):
        TileConfig(tissue="x")
    with pytest.raises(ConfigError, match=r"TileConfig.patch_size_px must satisfy 8 <= value <= 8192; got 0"):
        TileConfig(patch_size_px=0)
    assert TileConfig().resolved_target_mpp == 1.0 and TileConfig(target_mpp=0.5).resolved_target_mpp == 0.5
    assert TileConfig(workers=4, threads=1, batch_size=3).settings_hash() == TileConfig().settings_hash()
    assert TileConfig(magnification=20).settings_hash() == TileConfig(target_mpp=0.5).settings_hash()


def test_workers_0_tiles_in_this_process_as_the_other_stages_mean_it(h5_run, synth_dir, tmp_path, store_contents,
                                                                     same_contents):
    """Review EL, C4: `tile --workers 0` was refused, while features, heatmap and train take 0 as "in this
    process"; -1 stays refused."""
    out, _ = h5_run
    run = tile_slides(find_slides([synth_dir]), tmp_path, TileConfig(**FAST, workers=0, threads=1))
    assert run.ok and [r.slide for r in run.results] == ["synth_000", "synth_001"]
    for r in run.results:
        same_contents(store_contents(out / f"{r.slide}.h5"), store_contents(r.store_path))
    with pytest.raises(ConfigError, match=r"workers must satisfy 0 <= value <= 256; got -1"):
        TileConfig(workers=-1)
