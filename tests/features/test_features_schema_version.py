"""Feature files of this project that record another schema version are refused (review finding 1 of
the feature-file review): reading them (train, heatmap --features) and reusing them (`features` into
their folder) name the file, the two versions and the fix, as patch stores of another version are
refused; files of other tools (no ``schema`` attribute) are still read."""

from __future__ import annotations

import csv
import shutil

import h5py
import numpy as np
import pytest

from feature_fixtures import write_clam_features
from wsi_milssl.config import FeaturesConfig
from wsi_milssl.errors import StoreError
from wsi_milssl.features import extract_features, read_feature_file
from wsi_milssl.features.schema import SCHEMA_VERSION
from wsi_milssl.mil.data import read_feature_files

FAST = FeaturesConfig(encoder="resnet18", weights="random", amp="off", num_workers=0, batch_size=64)


@pytest.fixture(scope="module")
def made(tmp_path_factory, labelled_stores):
    out = tmp_path_factory.mktemp("feats_v")
    run = extract_features([labelled_stores], out / "feats", FAST)
    assert run.ok
    return out / "feats"


def _set_version(path, version):
    with h5py.File(path, "r+") as fh:
        fh.attrs["schema_version"] = version


@pytest.mark.parametrize("version", [SCHEMA_VERSION + 1, SCHEMA_VERSION + 6, 0])
def test_a_feature_file_of_another_schema_version_is_not_read(tmp_path, made, version):
    path = tmp_path / "synth_000.h5"
    shutil.copy(made / "synth_000.h5", path)
    read_feature_file(path)  # this version's file reads
    _set_version(path, version)
    with pytest.raises(StoreError) as err:
        read_feature_file(path)
    msg = str(err.value)
    assert str(path) in msg and f"feature schema version {version}" in msg
    assert f"this package's {SCHEMA_VERSION}" in msg and "Fix:" in msg
    assert ("upgrade wsi-milssl" in msg) == (version > SCHEMA_VERSION)
    with pytest.raises(StoreError, match="feature schema version"):
        read_feature_files([path], {"synth_000": 1})  # train's reader


def test_files_of_other_tools_without_a_schema_are_still_read(tmp_path):
    rng = np.random.default_rng(0)
    coords = np.stack(np.meshgrid(np.arange(3) * 256, np.arange(3) * 256), -1).reshape(-1, 2)
    write_clam_features(tmp_path, "s", rng.normal(size=(9, 4)).astype(np.float32), coords)
    ff = read_feature_file(tmp_path / "h5_files" / "s.h5")
    assert len(ff) == 9


def test_features_does_not_reuse_a_file_of_another_schema_version(tmp_path, made, labelled_stores):
    folder = tmp_path / "feats"
    shutil.copytree(made, folder)
    _set_version(folder / "synth_000.h5", SCHEMA_VERSION + 1)
    run = extract_features([labelled_stores], folder, FAST)
    status = {r.slide: r for r in run.results}
    assert status["synth_001"].status == "skipped"
    assert status["synth_000"].status == "failed"  # was 'skipped': reused without a word
    assert f"feature schema version {SCHEMA_VERSION + 1}" in status["synth_000"].error
    assert str(folder / "synth_000.h5") in status["synth_000"].error
    rows = {r["slide"]: r for r in csv.DictReader(run.status_csv.open())}
    assert rows["synth_000"]["status"] == "failed"
    # --overwrite makes it again, in this version
    run = extract_features([labelled_stores], folder, FAST, overwrite=True)
    assert run.ok
    assert read_feature_file(folder / "synth_000.h5").attrs["schema_version"] == SCHEMA_VERSION
