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

from wsi_milssl.cli import main
from wsi_milssl.features import write_feature_file

#: The head's training patches: 256 px at 0.5 µm/px = 512 level-0 px of the 0.25 µm/px synth slides.
STEP = 512


def _grid(step=STEP, n=6):
    ys, xs = np.mgrid[0:n, 0:n]
    return np.stack([xs.ravel() * step, ys.ravel() * step], axis=1)


def _features(seed=0, n=36):
    rng = np.random.default_rng(seed)
    feats = rng.normal(size=(n, 8)).astype(np.float32)
    feats[:6] += 3.0 * (seed % 2)
    return feats


def _ours(path, name, seed=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    write_feature_file(path, features=_features(seed), coords=_grid(),
                       attrs={"slide_stem": name, "slide_path": "", "mpp": 0.25, "dimensions_lv0": [4096, 4096],
                              "encoder": "resnet18", "target_mpp": 0.5, "patch_size_px": 256},
                       coords_attrs={"patch_size": 256}, features_attrs={"encoder": "resnet18"})


def _clam(path, coords, coords_attrs=None):
    """A CLAM-style file: ``features`` and ``coords`` only, CLAM's optional ``coords`` attributes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as fh:
        fh.create_dataset("features", data=_features(1, len(coords)))
        ds = fh.create_dataset("coords", data=np.asarray(coords, np.int32))
        for key, value in (coords_attrs or {}).items():
            ds.attrs[key] = value
    return path


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    root = tmp_path_factory.mktemp("coords_head")
    names = [f"s{i}" for i in range(4)]
    for i, n in enumerate(names):
        _ours(root / "train" / f"{n}.h5", n, seed=i)
    (root / "labels.csv").write_text("slide,label\n" + "".join(f"{n},{i % 2}\n" for i, n in enumerate(names)))
    assert main(["train", str(root / "train"), "--labels", str(root / "labels.csv"), "--out", str(root / "run"),
                 "--epochs", "1", "--threads", "1", "--no-plots"]) == 0
    return root / "run"


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
