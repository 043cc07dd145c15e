"""`heatmap --features` places a feature file's patches only where they can be this slide's level-0
patches (findings 3, 4 and 6 of the feature-file review): coordinates outside the slide fail that
slide; coordinates at the tiling level (a step smaller than the level-0 patch) are refused; CLAM's
``patch_size`` is read at its ``patch_level``, so a correct CLAM file of the head's patches is drawn."""

from __future__ import annotations

import csv
import json

import h5py
import numpy as np
import pytest

from feature_heads import STEP, train_head
from feature_heads import grid as _grid
from feature_heads import write_clam as _clam
from feature_heads import write_ours as _ours
from wsi_milssl.cli import main

@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return train_head(tmp_path_factory.mktemp("coords_head"))


def _run(tmp_path, feats, head, slide=None, name="out"):
    out = tmp_path / name
    args = ["heatmap"] + ([str(slide)] if slide else []) + ["--features", str(feats), "--model", str(head),
                                                            "--out", str(out), "--thumbnail-px", "128"]
    rc = main(args)
    rows = {r["slide"]: r for r in csv.DictReader((out / "heatmap_status.csv").open())}
    return rc, rows, out


def test_coordinates_outside_the_slide_fail_that_slide(tmp_path, head, synth_dir):
    feats = tmp_path / "big"
    _clam(feats / "synth_000.h5", _grid() * 3)  # reaches 7680 px on a 4096 px slide
    rc, rows, out = _run(tmp_path, feats, head, synth_dir / "synth_000.tif")
    assert rc == 1 and rows["synth_000"]["status"] == "failed"  # was drawn on a widened grid
    error = rows["synth_000"]["error"]
    assert str(feats / "synth_000.h5") in error and "start outside the slide (4096 x 4096 level-0 px" in error
    assert "not level-0 pixels" in error and "Fix:" in error
    assert not (out / "synth_000_probs.json").exists()
    # the file's own recorded size counts as well (no slide given)
    ours = tmp_path / "ours" / "s.h5"
    _ours(ours, "s")
    with h5py.File(ours, "r+") as fh:
        fh.attrs["dimensions_lv0"] = [2048, 2048]
    rc, rows, _ = _run(tmp_path, ours.parent, head, name="out2")
    assert rc == 1 and "start outside the slide (2048 x 2048 level-0 px, as the file records it)" in rows["s"]["error"]


def test_a_patch_overhanging_the_right_edge_is_normal(tmp_path, head, synth_dir):
    feats = tmp_path / "edge"
    _clam(feats / "synth_000.h5", _grid() + np.array([3700, 0]) - np.array([5 * STEP, 0]))  # last column ends at 4212
    rc, rows, out = _run(tmp_path, feats, head, synth_dir / "synth_000.tif")
    assert rc == 0 and rows["synth_000"]["status"] == "ok", rows["synth_000"]["error"]


# -- finding 4: coordinates at the tiling level, not level 0 ------------------------------------------

def test_coordinates_at_the_tiling_level_are_refused(tmp_path, head, synth_dir):
    slide = synth_dir / "synth_000.tif"
    # CLAM's attributes say 128 px at level 2 (downsample 4) = 512 level-0 px; the coords step by 128
    clam = _clam(tmp_path / "lvl2" / "synth_000.h5", _grid() // 4,
                 {"patch_size": 128, "patch_level": 2, "downsample": np.array([4.0, 4.0]),
                  "level_dim": np.array([1024, 1024])})
    rc, rows, out = _run(tmp_path, clam.parent, head, slide, name="a")
    assert rc == 1 and rows["synth_000"]["status"] == "failed"  # was drawn on a 4x-overlapping grid
    error = rows["synth_000"]["error"]
    assert str(clam) in error and "step by 128 px, less than 512 px" in error
    assert "CLAM's patch_size 128 at patch_level 2" in error and "coords must be level-0 pixels" in error
    assert not (out / "synth_000_probs.json").exists()
    # no attributes at all: the head's patches (256 px at 0.5 µm/px = 512 px of this 0.25 µm/px slide) decide
    bare = _clam(tmp_path / "bare" / "synth_000.h5", _grid() // 4)
    rc, rows, _ = _run(tmp_path, bare.parent, head, slide, name="b")
    assert rc == 1 and "step by 128 px, less than 512 px (the level-0 size of the patches the head was trained " \
                       "on: 256 px at 0.5 µm/px" in rows["synth_000"]["error"]
    # the same file in level-0 pixels is drawn, with the head's resolution (finding 6)
    good = _clam(tmp_path / "good" / "synth_000.h5", _grid())
    rc, rows, out = _run(tmp_path, good.parent, head, slide, name="c")
    assert rc == 0, rows["synth_000"]["error"]
    probs = json.loads((out / "synth_000_probs.json").read_text())
    assert probs["patch_size_lv0"] == probs["stride_lv0"] == 512
    assert probs["target_mpp"] == pytest.approx(0.5) and probs["patch_size_px"] == 256  # was 0.25 µm/px, 512 px


def test_a_declared_overlap_is_drawn(tmp_path, head, synth_dir):
    # TRIDENT: 256 px at 20x (0.5 µm/px) = 512 level-0 px, overlapping by 128 px: a step of 256 level-0 px
    path = _clam(tmp_path / "ov" / "synth_000.h5", _grid(step=256, n=10),
                 {"patch_size": 256, "patch_size_level0": 512, "target_magnification": 20.0,
                  "level0_magnification": 40.0, "overlap": 128})
    rc, rows, out = _run(tmp_path, path.parent, head, synth_dir / "synth_000.tif")
    assert rc == 0, rows["synth_000"]["error"]
    probs = json.loads((out / "synth_000_probs.json").read_text())
    assert probs["stride_lv0"] == 256 and probs["patch_size_lv0"] == 512


# -- finding 6: CLAM's patch_size is at its patch_level ------------------------------------------------

def test_a_correct_clam_file_of_the_heads_patches_is_drawn(tmp_path, head, synth_dir):
    from wsi_milssl.features import read_feature_file

    attrs = {"patch_size": 512, "patch_level": 0, "downsample": np.array([1.0, 1.0]),
             "level_dim": np.array([4096, 4096])}
    path = _clam(tmp_path / "clam" / "synth_000.h5", _grid(), attrs)
    assert "patch_size_px" not in read_feature_file(path).feature_settings  # was 512: a level-0 size
    rc, rows, out = _run(tmp_path, path.parent, head, synth_dir / "synth_000.tif")
    assert rc == 0, rows["synth_000"]["error"]  # was refused: "patch_size_px 512 vs 256"
    probs = json.loads((out / "synth_000_probs.json").read_text())
    assert probs["patch_size_lv0"] == 512 and probs["target_mpp"] == pytest.approx(0.5)
    assert probs["patch_size_px"] == 256


def test_clam_patches_of_another_physical_size_are_refused(tmp_path, head, synth_dir):
    # 512 px at level 1 (downsample 2) = 1024 level-0 px = 256 µm; the head's patches are 128 µm
    attrs = {"patch_size": 512, "patch_level": 1, "downsample": np.array([2.0, 2.0]),
             "level_dim": np.array([2048, 2048])}
    path = _clam(tmp_path / "big" / "synth_000.h5", _grid(step=1024, n=3), attrs)
    rc, rows, _ = _run(tmp_path, path.parent, head, synth_dir / "synth_000.tif")
    assert rc == 1
    error = rows["synth_000"]["error"]
    assert str(path) in error and "patches of 256 µm (1024 level-0 px at 0.25 µm/px)" in error
    assert "trained on patches of 128 µm (256 px at 0.5 µm/px)" in error
