"""A feature file given where a patch store is expected (`heatmap --store`, `label`, `train --mode images`,
`tile --out FEATURE_FOLDER`) is called a feature file, not an incomplete store whose fix (`tile --overwrite`)
would replace it (finding 5 of the feature-file review)."""

from __future__ import annotations

import numpy as np
import pytest

from wsi_milssl.cli import main
from wsi_milssl.errors import StoreError
from wsi_milssl.features import write_feature_file
from wsi_milssl.features.schema import SCHEMA, SCHEMA_VERSION
from wsi_milssl.store import open_store


def _feature_file(path, store_path="/data/stores/s.h5"):
    """A feature file with this project's root attributes (as `wsi-milssl features` writes them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_feature_file(path, features=np.zeros((3, 4), np.float32),
                              coords=np.array([[0, 0], [256, 0], [512, 0]]),
                              attrs={"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "slide_stem": path.stem,
                                     "store_path": store_path, "source": "store"},
                              coords_attrs={}, features_attrs={"encoder": "resnet18"})


def test_open_store_on_a_feature_file_says_it_is_a_feature_file(tmp_path):
    path = _feature_file(tmp_path / "feats" / "s.h5")
    with pytest.raises(StoreError) as err:
        open_store(path)
    msg = str(err.value)
    assert str(path) in msg and "a feature file (`wsi-milssl features`), not a patch store" in msg
    assert "incomplete" not in msg and "--overwrite" not in msg  # was: incomplete, `tile --overwrite`
    assert "/data/stores/s.h5" in msg and "heatmap --features" in msg


def test_label_of_a_feature_folder_names_feature_files(tmp_path, capsys):
    _feature_file(tmp_path / "feats" / "s.h5")
    (tmp_path / "ann").mkdir()
    rc = main(["label", str(tmp_path / "feats"), "--annotations", str(tmp_path / "ann"), "--out", str(tmp_path / "lab")])
    assert rc != 0
    status = (tmp_path / "lab" / "label_status.csv").read_text()
    assert "a feature file (`wsi-milssl features`), not a patch store" in status and "--overwrite" not in status


def test_tile_into_a_folder_of_feature_files_does_not_suggest_overwrite(tmp_path, synth_slides, capsys):
    """tile into the features' folder said 'a store is already there but cannot be reused ... Fix: pass
    --overwrite to replace it', and --overwrite replaced the feature file with a patch store."""
    slide = synth_slides["normal"]
    feature = _feature_file(tmp_path / "feats" / f"{slide.stem}.h5")
    before = feature.read_bytes()
    rc = main(["tile", str(slide), "--out", str(tmp_path / "feats"), "--magnification", "10", "--patch-size", "64"])
    err = capsys.readouterr().err
    assert rc != 0
    assert "a feature file (`wsi-milssl features`), not a patch store" in err and "--overwrite" not in err, err
    assert feature.read_bytes() == before
