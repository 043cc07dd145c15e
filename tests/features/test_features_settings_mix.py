"""Feature files of different resolutions or settings are not mixed: not in one training set, not between
a training and its validation set, not between a head and the features it is run on (review finding F5);
files of other tools, which record less, still train. And `features` does not silently replace a file made
from another slide of the same name."""

from __future__ import annotations

import csv
import shutil

import h5py
import numpy as np
import pytest

from feature_fixtures import TILE, write_clam_features, write_trident_features
from wsi_milssl.cli import main
from wsi_milssl.config import FeaturesConfig, TileConfig
from wsi_milssl.errors import ConfigError
from wsi_milssl.features import extract_features, write_feature_file
from wsi_milssl.mil.data import read_feature_files

FAST = FeaturesConfig(encoder="resnet18", weights="random", num_workers=0, batch_size=64, amp="off")
SETTINGS = '{"amp": "off", "dtype": "float32", "encoder": "resnet18", "input_size_px": 224}'


def _ours(path, name, *, target_mpp=0.5, patch=224, settings_hash="h1", dtype="float32", n=6, seed=0, dim=8):
    """A feature file with this project's root attributes (those that decide the features)."""
    rng = np.random.default_rng(seed)
    coords = np.stack([np.arange(n) * 448, np.zeros(n, np.int64)], axis=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_feature_file(path, features=rng.normal(size=(n, dim)).astype(np.float32), coords=coords,
                       attrs={"schema": "wsi-milssl-features", "slide_stem": name, "encoder": "resnet18",
                              "encoder_weights_sha256": "", "encoder_kwargs": "{}", "feature_dtype": dtype,
                              "input_size_px": 224, "settings": SETTINGS, "settings_hash": settings_hash,
                              "mpp": 0.25, "dimensions_lv0": [4096, 4096], "target_mpp": target_mpp,
                              "patch_size_px": patch},
                       coords_attrs={"patch_size": patch}, features_attrs={"encoder": "resnet18"})
    return path


def _labels(folder, names):
    path = folder / "labels.csv"
    path.write_text("slide,label\n" + "".join(f"{n},{i % 2}\n" for i, n in enumerate(names)))
    return path


def test_slides_embedded_at_two_resolutions_into_one_folder_do_not_train(tmp_path, synth_slides, synth_dir, capsys):
    """The reviewer's case: two `features` calls at 2 and 4 µm/px into one folder; `train FOLDER` refused."""
    feats = tmp_path / "feats"
    assert extract_features([synth_slides["tumor"]], feats, FAST, tile=TILE).ok
    coarse = TileConfig(**{**TILE.__dict__, "target_mpp": 4.0})
    assert extract_features([synth_slides["normal"]], feats, FAST, tile=coarse).ok
    with pytest.raises(ConfigError) as err:
        read_feature_files(sorted(feats.glob("*.h5")), {"synth_000": 1, "synth_001": 0})
    message = str(err.value)
    assert "synth_000.h5 and " in message and "synth_001.h5 hold features made with different settings" in message
    assert "target_mpp 2 vs 4 µm/px" in message and "Fix: extract every slide with the same settings" in message
    rc = main(["train", str(feats), "--labels", str(synth_dir / "labels.csv"), "--out", str(tmp_path / "run"),
               "--epochs", "1", "--threads", "1", "--no-plots"])
    assert rc != 0 and not (tmp_path / "run" / "last.pt").exists()
    assert "hold features made with different settings" in capsys.readouterr().err


def test_files_that_differ_only_in_precision_train_together(tmp_path):
    """float16 storage or another autocast is the same features to rounding (amp = auto differs between
    machines): not refused; the settings hash, which covers the precision, is not compared then."""
    a = _ours(tmp_path / "a.h5", "a")
    b = _ours(tmp_path / "b.h5", "b", seed=1, settings_hash="h2", dtype="float16")
    assert read_feature_files([a, b], {"a": 0, "b": 1}).n_bags == 2


@pytest.mark.parametrize("change, shown", [
    ({"patch": 256}, "patch_size_px 224 vs 256"),
    ({"target_mpp": 1.0}, "target_mpp 0.5 vs 1 µm/px"),
])
def test_one_training_set_shares_the_settings_its_files_record(tmp_path, change, shown):
    a = _ours(tmp_path / "a.h5", "a")
    b = _ours(tmp_path / "b.h5", "b", seed=1, **change)
    with pytest.raises(ConfigError, match="hold features made with different settings") as err:
        read_feature_files([a, b], {"a": 0, "b": 1})
    assert shown in str(err.value) and str(a) in str(err.value) and str(b) in str(err.value)
    same = _ours(tmp_path / "c.h5", "c", seed=2)
    data = read_feature_files([a, same], {"a": 0, "c": 1})
    assert data.settings["feature_settings"]["target_mpp"] == 0.5
    assert data.settings["feature_settings"]["settings_hash"] == "h1"


def test_files_of_other_tools_train_and_are_compared_on_what_they_record(tmp_path):
    """TRIDENT's files record the encoder and their magnification and patch size, CLAM's nothing: a set of
    ours, TRIDENT's and CLAM's of one resolution trains; a TRIDENT file at 10x beside ours at 20x does not."""
    rng = np.random.default_rng(0)
    coords = np.array([[0, 0], [512, 0], [1024, 0]])
    ours = _ours(tmp_path / "ours" / "s0.h5", "s0")
    trident = write_trident_features(tmp_path / "trident", "s1", rng.normal(size=(3, 8)).astype(np.float32), coords,
                                     patch_size=224, src_mag=40, dst_mag=20, width=4096, height=4096,
                                     encoder="resnet18")
    clam = write_clam_features(tmp_path / "clam", "s2", rng.normal(size=(3, 8)).astype(np.float32), coords)
    data = read_feature_files([ours, trident, clam], {"s0": 0, "s1": 1, "s2": 0})
    assert data.n_bags == 3
    tenx = write_trident_features(tmp_path / "trident10", "s3", rng.normal(size=(3, 8)).astype(np.float32), coords,
                                  patch_size=224, src_mag=40, dst_mag=10, width=4096, height=4096,
                                  encoder="resnet18")
    with pytest.raises(ConfigError, match=r"target_mpp 0.5 vs 1 µm/px"):
        read_feature_files([ours, clam, tenx], {"s0": 0, "s2": 0, "s3": 1})


def test_train_refuses_validation_features_of_another_resolution(tmp_path, capsys):
    names = ["s0", "s1", "s2", "s3"]
    train = [_ours(tmp_path / "train" / f"{n}.h5", n, seed=i) for i, n in enumerate(names)]
    val = [_ours(tmp_path / "val" / f"{n}.h5", n, seed=9 + i, target_mpp=1.0) for i, n in enumerate(names[:2])]
    labels = _labels(tmp_path, names)
    rc = main(["train", str(tmp_path / "train"), "--labels", str(labels), "--val", str(tmp_path / "val"), "--out",
               str(tmp_path / "run"), "--epochs", "1", "--threads", "1", "--no-plots"])
    err = capsys.readouterr().err
    assert rc != 0 and not (tmp_path / "run" / "last.pt").exists()
    assert f"the validation features {val[0]} were made with other settings than the training features {train[0]}" \
        in err and "target_mpp 0.5 vs 1 µm/px" in err


def test_a_head_is_not_run_on_features_of_another_resolution(tmp_path):
    names = ["s0", "s1", "s2", "s3"]
    for i, n in enumerate(names):
        _ours(tmp_path / "train" / f"{n}.h5", n, seed=i)
    labels = _labels(tmp_path, names)
    assert main(["train", str(tmp_path / "train"), "--labels", str(labels), "--out", str(tmp_path / "run"),
                 "--epochs", "1", "--threads", "1", "--no-plots"]) == 0
    _ours(tmp_path / "test" / "t0.h5", "t0", seed=5, patch=256)
    _ours(tmp_path / "test" / "t1.h5", "t1", seed=6)
    rc = main(["heatmap", "--features", str(tmp_path / "test"), "--model", str(tmp_path / "run"), "--out",
               str(tmp_path / "maps"), "--threads", "1"])
    assert rc == 1
    rows = {r["slide"]: r for r in csv.DictReader((tmp_path / "maps" / "heatmap_status.csv").open())}
    assert rows["t1"]["status"] == "ok" and rows["t0"]["status"] == "failed"
    assert "features made with other settings than those the head" in rows["t0"]["error"]
    assert "patch_size_px 256 vs 224" in rows["t0"]["error"]


def test_features_of_another_slide_of_the_same_name_are_not_replaced_silently(tmp_path, synth_slides):
    """Test slides embedded into the training folder, both named synth_000: the slide fails with the fix;
    --overwrite and the pipeline's replace_other replace the file; the same slide again is skipped."""
    feats = tmp_path / "feats"
    assert extract_features([synth_slides["tumor"]], feats, FAST, tile=TILE).ok
    other = tmp_path / "test_slides" / "synth_000.tif"
    other.parent.mkdir()
    shutil.copy(synth_slides["normal"], other)
    run = extract_features([other], feats, FAST, tile=TILE)
    assert not run.ok and run.results[0].status == "failed"
    error = run.results[0].error
    assert f"these features were made from another slide file, {synth_slides['tumor'].resolve()}, not " \
           f"{other.resolve()}" in error and "Fix: write this slide's features to another folder with --out" in error
    with h5py.File(feats / "synth_000.h5", "r") as fh:
        assert fh.attrs["slide_path"] == str(synth_slides["tumor"].resolve())  # kept
    assert [r.status for r in extract_features([synth_slides["tumor"]], feats, FAST, tile=TILE).results] == ["skipped"]
    assert extract_features([other], feats, FAST, tile=TILE, replace_other=True).results[0].status == "ok"
    with h5py.File(feats / "synth_000.h5", "r") as fh:
        assert fh.attrs["slide_path"] == str(other.resolve())
    assert extract_features([synth_slides["tumor"]], feats, FAST, tile=TILE, overwrite=True).results[0].status == "ok"
