"""`heatmap --features` over CLAM-style files of the head's patches (review AI, findings 1, 2, 5, 6):
slides of another scanner's nominal magnification (0.243 or 0.226 µm/px for "40x") are drawn, not refused
over a 3 % size difference or called coordinates at a tiling level; an overlap declared by `overlap` alone
is used; one patch is mapped with the patch size as stride, not 1 px; a sparse file on the patch grid is
drawn with the patch size as stride."""

from __future__ import annotations

import csv
import json

import h5py
import numpy as np
import pytest

from feature_heads import train_head
from feature_heads import grid as _grid
from feature_heads import write_clam as _clam
from wsi_milssl.cli import main
from wsi_milssl.errors import StoreError
from wsi_milssl.features import read_feature_file

CLAM_ATTRS = {"patch_size": 512, "patch_level": 0, "downsample": np.array([1.0, 1.0]),
              "level_dim": np.array([4096, 4096])}


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return train_head(tmp_path_factory.mktemp("grid_head"))


def _run(tmp_path, feats, head, mpp, name="out"):
    """heatmap --features of the folder ``feats`` without a slide, at level-0 ``mpp`` (--slide-mpp)."""
    out = tmp_path / name
    rc = main(["heatmap", "--features", str(feats), "--model", str(head), "--out", str(out), "--slide-mpp", str(mpp),
               "--thumbnail-px", "128"])
    rows = {r["slide"]: r for r in csv.DictReader((out / "heatmap_status.csv").open())}
    return rc, rows, out


# -- finding 1: nominal magnifications -----------------------------------------------------------------

@pytest.mark.parametrize("mpp", [0.243, 0.226])
@pytest.mark.parametrize("attrs", [CLAM_ATTRS, None], ids=["clam", "clam_no_attrs"])
def test_clam_files_of_a_scanner_of_another_nominal_resolution_are_drawn(tmp_path, head, mpp, attrs):
    # "20x" patches of 512 level-0 px: 124.4 µm at 0.243 µm/px, 115.7 µm at 0.226; the head's are 128 µm
    path = _clam(tmp_path / "f" / "s.h5", _grid(), attrs)
    rc, rows, out = _run(tmp_path, path.parent, head, mpp)
    # was: "patches of 124.416 µm ... trained on patches of 128 µm" (with attrs), "step by 512 px, less than
    # 527 px ... coordinates at the tiling level" (without)
    assert rc == 0, rows["s"]["error"]
    probs = json.loads((out / "s_probs.json").read_text())
    assert probs["stride_lv0"] == probs["patch_size_lv0"] == 512
    assert probs["target_mpp"] == pytest.approx(0.5) and probs["patch_size_px"] == 256


def test_a_factor_of_two_is_still_refused(tmp_path, head):
    # at 0.125 µm/px the 512 px patches are 64 µm, half the head's
    clam = _clam(tmp_path / "a" / "s.h5", _grid(), CLAM_ATTRS)
    rc, rows, _ = _run(tmp_path, clam.parent, head, 0.125, name="oa")
    assert rc == 1 and "patches of 64 µm" in rows["s"]["error"] and "nominal magnifications" in rows["s"]["error"]
    bare = _clam(tmp_path / "b" / "s.h5", _grid())
    rc, rows, _ = _run(tmp_path, bare.parent, head, 0.125, name="ob")
    error = rows["s"]["error"]
    assert rc == 1 and "step by 512 px, less than 1024 px" in error and "tiling level" in error


def test_a_step_between_a_half_and_the_tolerance_is_a_size_difference_not_a_tiling_level(tmp_path, head):
    # at 0.18 µm/px the head's patches are 711 level-0 px: a step of 512 is 1.39x less, no tiling level
    bare = _clam(tmp_path / "b" / "s.h5", _grid())
    rc, rows, _ = _run(tmp_path, bare.parent, head, 0.18)
    error = rows["s"]["error"]
    assert rc == 1 and str(bare) in error and "step by 512 px, 1.39x less than 711 px" in error
    assert "nominal magnifications" in error and "tiling level" not in error  # was: "coordinates at the tiling level"


# -- finding 2: an overlap declared by 'overlap' alone ---------------------------------------------------

def test_overlap_alone_declares_the_overlap_of_a_clam_file_without_attributes(tmp_path, head):
    # the head's 512 px patches, cut every 256 px (CLAM's step_size 256): no attributes
    path = _clam(tmp_path / "ov" / "s.h5", _grid(step=256, n=12))
    rc, rows, _ = _run(tmp_path, path.parent, head, 0.25, name="o1")
    error = rows["s"]["error"]
    assert rc == 1 and "'overlap' attribute, in level-0 pixels where coords record no patch_size (256 here)" in error
    with h5py.File(path, "r+") as fh:  # as the message says
        fh["coords"].attrs["overlap"] = 256
    rc, rows, out = _run(tmp_path, path.parent, head, 0.25, name="o2")
    assert rc == 0, rows["s"]["error"]  # was refused the same way
    probs = json.loads((out / "s_probs.json").read_text())
    assert probs["stride_lv0"] == 256 and probs["patch_size_lv0"] == 512 and probs["patch_size_px"] == 256


def test_the_overlap_fix_names_the_value_in_patch_size_pixels_for_clam_attributes(tmp_path, head):
    attrs = dict(CLAM_ATTRS, patch_size=256, patch_level=1, downsample=np.array([2.0, 2.0]))
    path = _clam(tmp_path / "ov" / "s.h5", _grid(step=384, n=8), attrs)  # 512 level-0 px every 384
    rc, rows, _ = _run(tmp_path, path.parent, head, 0.25)
    error = rows["s"]["error"]
    assert rc == 1 and "overlap by 128 level-0 px" in error
    assert "'overlap' attribute in pixels of its patch_size (256): 64 here" in error
    with h5py.File(path, "r+") as fh:
        fh["coords"].attrs["overlap"] = 64
    rc, rows, out = _run(tmp_path, path.parent, head, 0.25, name="o2")
    assert rc == 0, rows["s"]["error"]
    assert json.loads((out / "s_probs.json").read_text())["stride_lv0"] == 384


# -- finding 5: one patch ------------------------------------------------------------------------------

def test_a_single_patch_is_mapped_with_the_patch_size_as_stride(tmp_path):
    one = read_feature_file(_clam(tmp_path / "a.h5", [[1024, 1536]], CLAM_ATTRS))
    layout = one.grid_layout(slide_mpp=0.25, slide_dimensions=(4096, 4096))
    assert layout.stride_lv0 == 512 and layout.grid_shape == (8, 8)  # was stride 1: 3585 x 3585 cells
    bare = read_feature_file(_clam(tmp_path / "b.h5", [[1024, 1536]]))
    layout = bare.grid_layout(slide_mpp=0.25, slide_dimensions=(4096, 4096), trained_on=(0.5, 256))
    assert layout.stride_lv0 == layout.patch_size_lv0 == 512  # the head's patches at this slide's µm/px
    with pytest.raises(StoreError) as err:  # nothing tells the patch size
        bare.grid_layout(slide_mpp=0.25, slide_dimensions=(4096, 4096))
    assert str(bare.path) in str(err.value) and "single patch position" in str(err.value) and "Fix:" in str(err.value)


def test_a_single_patch_heatmap(tmp_path, head):
    path = _clam(tmp_path / "one" / "s.h5", [[1024, 1536]], CLAM_ATTRS)
    rc, rows, out = _run(tmp_path, path.parent, head, 0.25)
    assert rc == 0, rows["s"]["error"]
    probs = json.loads((out / "s_probs.json").read_text())
    assert probs["stride_lv0"] == 512 and np.load(out / "s_probs.npy").size <= 16


# -- finding 6: a sparse file on the patch grid ------------------------------------------------------

def test_a_sparse_clam_file_on_the_patch_grid_is_drawn_with_the_patch_size(tmp_path):
    attrs = dict(CLAM_ATTRS, patch_size=256)
    # most steps are two patches, one is one patch: every coordinate is on the 256 px grid
    sparse = read_feature_file(_clam(tmp_path / "a.h5", [[0, 0], [512, 0], [1024, 0], [1280, 0], [0, 512],
                                                         [512, 512]], attrs))
    layout = sparse.grid_layout(slide_mpp=0.25, slide_dimensions=(2000, 1800))
    assert layout.stride_lv0 == 256  # was refused: "not on one regular grid of stride 512"
    gaps = read_feature_file(_clam(tmp_path / "b.h5", [[0, 0], [512, 0], [1024, 0], [0, 512]], attrs))
    layout = gaps.grid_layout(slide_mpp=0.25, slide_dimensions=(2000, 1800))
    assert layout.stride_lv0 == layout.patch_size_lv0 == 256  # was 512: cells of 4 patches
    bare = read_feature_file(_clam(tmp_path / "c.h5", [[0, 0], [512, 0], [1024, 0], [0, 512]]))
    layout = bare.grid_layout(slide_mpp=0.25, slide_dimensions=(2000, 1800), trained_on=(1.0, 64))
    assert layout.stride_lv0 == layout.patch_size_lv0 == 256  # the head's patches: 64 px at 1 µm/px


def test_patches_that_never_touch_at_a_multiple_of_the_heads_size_are_warned_about(tmp_path, caplog):
    """Review DB: CLAM coordinates of a 0.25 µm/px slide mapped with --slide-mpp 0.5 drew a lattice of half-size
    patches, no two touching, without a word. A tiling with neighbours is not warned about."""
    import logging

    dense = np.array([[x, y] for x in range(0, 2048, 256) for y in range(0, 1024, 256)])
    wrong = read_feature_file(_clam(tmp_path / "a.h5", dense))
    with caplog.at_level(logging.WARNING):
        layout = wrong.grid_layout(slide_mpp=0.5, slide_dimensions=(2048, 1024), trained_on=(1.0, 64))
    assert layout.stride_lv0 == 128  # the head's 64 µm at 0.5 µm/px
    assert ("the patches step by 256 level-0 px, 2x the 128 px of the patches the head was trained on at this "
            "slide's 0.5 µm/px, and no two of them touch") in caplog.text
    assert "If the slide's µm/px is 2x too coarse (0.25 would fit), check --slide-mpp" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        layout = wrong.grid_layout(slide_mpp=0.25, slide_dimensions=(2048, 1024), trained_on=(1.0, 64))
    assert layout.stride_lv0 == 256 and "touch" not in caplog.text
