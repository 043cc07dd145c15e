"""tile never replaces a feature file, of this project, TRIDENT or CLAM, with or without --overwrite
(finding 4 of review AI): --overwrite skipped the check and replaced the features with a patch store, and a
TRIDENT or CLAM file (no schema attribute) without --overwrite was 'a store ... that cannot be reused. Fix:
pass --overwrite to replace it'. Now one error names the file, says it is a feature file and to tile into
another folder with --out."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from wsi_milssl.cli import main
from wsi_milssl.features import write_feature_file
from wsi_milssl.features.schema import SCHEMA, SCHEMA_VERSION

TILE = ["--magnification", "10", "--patch-size", "64"]


def _trident(path):
    """A TRIDENT-style feature file: features and coords with TRIDENT's attributes, no root attributes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as fh:
        fh.create_dataset("features", data=np.ones((3, 4), np.float32))
        ds = fh.create_dataset("coords", data=np.array([[0, 0], [512, 0], [1024, 0]], np.int64))
        ds.attrs.update({"patch_size": 256, "patch_size_level0": 512, "overlap": 0, "target_magnification": 20.0})
    return path


def _clam(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as fh:
        fh.create_dataset("features", data=np.ones((3, 4), np.float32))
        fh.create_dataset("coords", data=np.array([[0, 0], [512, 0], [1024, 0]], np.int32))
    return path


def _ours(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_feature_file(path, features=np.ones((3, 4), np.float32), coords=np.array([[0, 0], [256, 0], [512, 0]]),
                              attrs={"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "slide_stem": path.stem},
                              coords_attrs={}, features_attrs={"encoder": "resnet18"})


@pytest.mark.parametrize("make", [_trident, _clam, _ours], ids=["trident", "clam", "ours"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
def test_tile_never_replaces_a_feature_file(tmp_path, synth_slides, capsys, make, overwrite):
    slide = synth_slides["normal"]
    feature = make(tmp_path / "feats" / f"{slide.stem}.h5")
    before = feature.read_bytes()
    rc = main(["tile", str(slide), "--out", str(tmp_path / "feats"), *TILE] + (["--overwrite"] if overwrite else []))
    err = capsys.readouterr().err
    assert rc != 0
    assert feature.read_bytes() == before  # was replaced by a patch store under --overwrite
    assert str(feature) in err and "this is a feature file" in err and "--out" in err, err
    assert "cannot be reused" not in err and "pass --overwrite" not in err, err


def test_tile_slide_refuses_a_feature_file_under_overwrite(tmp_path, synth_slides):
    from wsi_milssl.config.tile import TileConfig
    from wsi_milssl.errors import FeatureFileGivenError
    from wsi_milssl.tiling.runner import tile_slide

    slide = synth_slides["normal"]
    feature = _trident(tmp_path / f"{slide.stem}.h5")
    before = feature.read_bytes()
    with pytest.raises(FeatureFileGivenError, match="this is a feature file"):
        tile_slide(slide, tmp_path, TileConfig(magnification=10, patch_size_px=64), overwrite=True)
    assert feature.read_bytes() == before
