"""``heatmap SLIDE --store STORES``: a store cut from another slide of the same name fails that slide
(not drawn on the given one), and a store that cannot be opened fails only its slide."""

from __future__ import annotations

import csv
import logging
import shutil
from pathlib import Path

import h5py
import pytest

from wsi_milssl.config import HeatmapConfig, TileConfig
from wsi_milssl.errors import ConfigError
from wsi_milssl.inference import make_heatmaps
from wsi_milssl.tiling import tile_slide

FAST = dict(thumbnail_px=128, batch_size=32, num_workers=0)
# the checkpoints' tiling (conftest.make_checkpoint defaults)
TILE = dict(target_mpp=1.0, patch_size_px=32, entropy_threshold_bits=3.0, mask_mpp=8.0, pixels="raw")


def _status(folder: Path) -> dict[str, dict]:
    with open(folder / "heatmap_status.csv", newline="") as fh:
        return {r["slide"]: r for r in csv.DictReader(fh)}


@pytest.fixture(scope="module")
def cohort(tmp_path_factory, slide_writer):
    """``old/case.tif`` (2048 x 2048) and ``other.tif`` tiled into ``stores/``; ``new/case.tif``: another
    slide of the same name (2048 x 1024) that was never tiled."""
    root = tmp_path_factory.mktemp("pairing")
    (root / "old").mkdir()
    (root / "new").mkdir()
    old = slide_writer(root / "old" / "case.tif", width=2048, height=2048, tissue_box=(256, 256, 1792, 1792),
                       tumour=lambda xs, ys: (xs // 300 + ys // 300) % 4 == 0)
    new = slide_writer(root / "new" / "case.tif", width=2048, height=1024, tissue_box=(0, 128, 2048, 896),
                       tumour=lambda xs, ys: (xs // 300) % 3 == 0)
    other = slide_writer(root / "other.tif", width=1024, height=1024, tissue_box=(128, 128, 896, 896),
                         tumour=lambda xs, ys: xs < 400)
    stores = root / "stores"
    for slide in (old, other):
        assert tile_slide(slide, stores, TileConfig(**TILE)).status == "ok"
    return {"old": old, "new": new, "other": other, "stores": stores}


def _copy_stores(cohort, dest: Path) -> Path:
    shutil.copytree(cohort["stores"], dest)
    return dest


def test_a_store_of_another_slide_of_the_same_name_fails_that_slide(tmp_path, cohort, checkpoint_factory):
    ckpt = checkpoint_factory()
    out = tmp_path / "hm"
    run = make_heatmaps([cohort["new"], cohort["other"]], ckpt, out, HeatmapConfig(**FAST),
                        stores=[cohort["stores"]])
    assert [r.status for r in run.results] == ["failed", "ok"]  # the other slide still ran
    error = _status(out)["case"]["error"]
    assert error.startswith(f"{cohort['new']}: the store {cohort['stores'] / 'case.h5'} was cut from another slide")
    assert str(cohort["old"].resolve()) in error and "2048 x 2048 px" in error
    assert "Fix: tile this slide again" in error
    assert not (out / "case_probs.json").exists() and (out / "other_probs.json").exists()


def test_the_same_slide_at_another_path_still_uses_the_store(tmp_path, cohort, checkpoint_factory):
    copy = tmp_path / "copy" / "case.tif"
    copy.parent.mkdir()
    shutil.copyfile(cohort["old"], copy)
    run = make_heatmaps([copy], checkpoint_factory(), tmp_path / "hm", HeatmapConfig(**FAST),
                        stores=[cohort["stores"]])
    assert run.ok and run.results[0].n_patches > 0


def test_an_older_store_without_the_slide_size_is_checked_on_its_dimensions(tmp_path, cohort, checkpoint_factory):
    stores = _copy_stores(cohort, tmp_path / "stores")
    with h5py.File(stores / "case.h5", "a") as fh:
        for key in ("slide_size_bytes", "slide_mtime_ns"):
            del fh.attrs[key]
    ckpt = checkpoint_factory()
    run = make_heatmaps([cohort["new"]], ckpt, tmp_path / "hm", HeatmapConfig(**FAST), stores=[stores])
    assert run.results[0].status == "failed"
    assert "2048 x 2048 px" in run.results[0].error and "2048 x 1024 px" in run.results[0].error
    # the slide it was cut from passes; without any record the store is accepted
    assert make_heatmaps([cohort["old"]], ckpt, tmp_path / "hm2", HeatmapConfig(**FAST), stores=[stores]).ok
    with h5py.File(stores / "case.h5", "a") as fh:
        del fh.attrs["dimensions_lv0"]
    assert make_heatmaps([cohort["new"]], ckpt, tmp_path / "hm3", HeatmapConfig(**FAST), stores=[stores]).ok


@pytest.mark.parametrize("with_slides", [False, True])
def test_a_damaged_store_fails_only_its_slide(tmp_path, cohort, checkpoint_factory, with_slides):
    stores = _copy_stores(cohort, tmp_path / "stores")
    damaged = stores / "case.h5"
    damaged.write_bytes(damaged.read_bytes()[:1000])  # truncated
    out = tmp_path / "hm"
    slides = [cohort["old"], cohort["other"]] if with_slides else []
    run = make_heatmaps(slides, checkpoint_factory(), out, HeatmapConfig(**FAST), stores=[stores])
    assert {r.slide: r.status for r in run.results} == {"case": "failed", "other": "ok"}
    status = _status(out)
    assert status["other"]["status"] == "ok"
    assert status["case"]["status"] == "failed" and str(damaged) in status["case"]["error"]


def test_a_slide_rewritten_with_the_same_level0_size_keeps_its_store(tmp_path, slide_writer, checkpoint_factory,
                                                                     caplog):
    (tmp_path / "s").mkdir()
    slide = slide_writer(tmp_path / "s" / "case.tif", width=1024, height=1024, tissue_box=(128, 128, 896, 896),
                         tumour=lambda xs, ys: xs < 400)
    stores = tmp_path / "stores"
    assert tile_slide(slide, stores, TileConfig(**TILE)).status == "ok"
    with open(slide, "ab") as fh:  # a tool rewrote the file (more bytes), not its pixels
        fh.write(b"\0" * 10)
    with caplog.at_level("WARNING", logger="wsi_milssl.inference.stage"):
        run = make_heatmaps([slide], checkpoint_factory(), tmp_path / "hm", HeatmapConfig(**FAST), stores=[stores])
    assert run.ok and run.results[0].n_patches > 0
    assert any("the file's size changed since" in r.getMessage() for r in caplog.records)


def test_another_slide_of_the_same_level0_size_does_not_take_the_store(tmp_path, cohort, slide_writer,
                                                                       checkpoint_factory):
    (tmp_path / "s").mkdir()  # as large as old/case.tif, other pixels, other file
    other = slide_writer(tmp_path / "s" / "case.tif", width=2048, height=2048, tissue_box=(0, 0, 2048, 2048),
                         tumour=lambda xs, ys: xs < 400)
    run = make_heatmaps([other], checkpoint_factory(), tmp_path / "hm", HeatmapConfig(**FAST),
                        stores=[cohort["stores"]])
    assert run.results[0].status == "failed" and "another slide of the same name" in run.results[0].error


def test_a_slide_changed_since_it_was_tiled_is_named_so(tmp_path, cohort, slide_writer, checkpoint_factory):
    (tmp_path / "s").mkdir()
    slide = slide_writer(tmp_path / "s" / "case.tif", width=1024, height=1024, tissue_box=(128, 128, 896, 896),
                         tumour=lambda xs, ys: xs < 400)
    stores = tmp_path / "stores"
    assert tile_slide(slide, stores, TileConfig(**TILE)).status == "ok"
    slide_writer(slide, width=2048, height=1024, tissue_box=(0, 128, 2048, 896), tumour=lambda xs, ys: xs < 400)
    run = make_heatmaps([slide], checkpoint_factory(), tmp_path / "hm", HeatmapConfig(**FAST), stores=[stores])
    assert run.results[0].status == "failed"
    assert "was cut from this slide before it changed" in run.results[0].error


def test_a_slide_finds_its_store_whatever_the_case_of_its_name(tmp_path, cohort, checkpoint_factory):
    copy = tmp_path / "copy" / "CASE.tif"  # names match by stem_key (case and Unicode form aside)
    copy.parent.mkdir()
    shutil.copyfile(cohort["old"], copy)  # CASE.tif: the store is case.h5
    run = make_heatmaps([copy], checkpoint_factory(), tmp_path / "hm", HeatmapConfig(**FAST),
                        stores=[cohort["stores"]])
    assert run.ok and run.results[0].n_patches > 0


def test_stores_whose_names_differ_only_in_case_need_the_exact_one(tmp_path, cohort, checkpoint_factory):
    stores = _copy_stores(cohort, tmp_path / "stores")
    upper = tmp_path / "more" / "CASE.h5"
    upper.parent.mkdir()
    shutil.copyfile(stores / "case.h5", upper)
    with h5py.File(upper, "a") as fh:
        fh.attrs["slide_stem"] = "CASE"
    run = make_heatmaps([cohort["old"]], checkpoint_factory(), tmp_path / "hm", HeatmapConfig(**FAST),
                        stores=[stores, upper.parent])
    assert run.ok  # case.tif takes case.h5, its exact name
    lower = tmp_path / "copy" / "Case.tif"
    lower.parent.mkdir()
    shutil.copyfile(cohort["old"], lower)
    with pytest.raises(ConfigError, match="differ only in case or Unicode form"):
        make_heatmaps([lower], checkpoint_factory(), tmp_path / "hm2", HeatmapConfig(**FAST),
                      stores=[stores, upper.parent])


def test_stores_whose_slide_moved_say_so_once_per_slide(tmp_path, slide_writer, checkpoint_factory, caplog):
    """``heatmap --store DIR`` without slides, the stores' slides moved away: each slide's missing overlay is
    one warning with the recorded path and the fix (it used to be two: one when the stores were read, one
    when the PNG was not drawn)."""
    (tmp_path / "slides").mkdir()
    slide = slide_writer(tmp_path / "slides" / "moved.tif", width=1024, height=1024, tissue_box=(128, 128, 896, 896),
                         tumour=lambda xs, ys: xs < 400)
    stores = tmp_path / "stores"
    assert tile_slide(slide, stores, TileConfig(**TILE)).status == "ok"
    slide.rename(tmp_path / "moved.tif")
    with caplog.at_level(logging.WARNING):
        run = make_heatmaps([], checkpoint_factory(), tmp_path / "hm", HeatmapConfig(**FAST), stores=[stores])
    assert [r.status for r in run.results] == ["ok"]
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "moved" in r.getMessage()]
    assert lines == [f"moved: slide file {slide.resolve()} not found; moved_heatmap.png not drawn. Fix: pass the slide "
                     "file (a SLIDE argument of `wsi-milssl heatmap`) to draw it."]
    assert (tmp_path / "hm" / "moved_probs.npy").is_file()


def test_slide_mpp_with_stores_is_said_to_change_nothing(tmp_path, capsys):
    """Review EW, C13: `heatmap --store ... --slide-mpp` was accepted without a word; the stores' patches are cut at
    the µm/px each records."""
    from wsi_milssl.cli import main

    (tmp_path / "stores").mkdir()
    main(["heatmap", "--store", str(tmp_path / "stores"), "--model", str(tmp_path / "missing.pt"), "--out",
          str(tmp_path / "hm"), "--slide-mpp", "0.5"])
    assert ("--slide-mpp 0.5: with --store the patches are the stores', cut at the µm/px each records, so it changes "
            "nothing") in capsys.readouterr().err
