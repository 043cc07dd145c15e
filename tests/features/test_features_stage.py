"""The feature stage: the encoder's output on exactly the stored patches, in files TRIDENT and CLAM
read; slides cut on the fly like the stores; resume, settings changes and bad inputs per slide."""

from __future__ import annotations

import csv

import h5py
import numpy as np
import pytest
import torch

from feature_fixtures import TILE
from wsi_milssl.cli import main
from wsi_milssl.config import FeaturesConfig, TileConfig
from wsi_milssl.errors import ConfigError
from wsi_milssl.features import create_encoder, extract_features, read_feature_file
from wsi_milssl.features.schema import FEATURES_ATTRS, SCHEMA, TRIDENT_COORDS_ATTRS
from wsi_milssl.store import open_store
from wsi_milssl.store.schema import COORDS_ATTRS


#: float32 end to end, nothing folded: the stage must give the encoder's own numbers.
EXACT = FeaturesConfig(encoder="resnet18", weights="random", amp="off", fuse_batchnorm=False, channels_last=False,
                       num_workers=1, batch_size=24)


def _status(path):
    with open(path, newline="") as fh:
        return {row["slide"]: row for row in csv.DictReader(fh)}


def test_features_of_stores_are_the_encoders_output_on_the_stored_patches(tmp_path, labelled_stores):
    run = extract_features([labelled_stores], tmp_path / "feats", EXACT)
    assert run.ok and [r.status for r in run.results] == ["ok", "ok"]
    encoder = create_encoder("resnet18", weights="random")
    mean = torch.tensor(encoder.mean).view(1, 3, 1, 1)
    std = torch.tensor(encoder.std).view(1, 3, 1, 1)
    for result in run.results:
        ff = read_feature_file(result.path)
        with open_store(labelled_stores / f"{result.slide}.h5") as store:
            pixels = store.read_patches(np.arange(len(store)))
            coords, labels = store.coords, store.read_array("instance_label")
            store_coords_attrs = store.array_attrs("coords")
        x = (torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255 - mean) / std
        with torch.no_grad():
            want = encoder.module(x).numpy()
        assert ff.features.dtype == np.float32 and ff.features.shape == (len(coords), 512) and len(coords) > 30
        np.testing.assert_allclose(ff.features, want, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(ff.coords, coords)
        np.testing.assert_array_equal(ff.instance_label, labels)  # evaluation labels ride along
        assert set(FEATURES_ATTRS) <= set(ff.features_attrs) and ff.features_attrs["encoder"] == "resnet18"
        assert set(COORDS_ATTRS) | set(TRIDENT_COORDS_ATTRS) <= set(ff.coords_attrs)
        assert ff.coords_attrs["patch_size_level0"] == store_coords_attrs["patch_size_level0"] == 256
        assert ff.attrs["schema"] == SCHEMA and ff.attrs["slide_stem"] == result.slide == ff.stem
        assert ff.attrs["stride_lv0"] == 256 and ff.attrs["mpp"] == pytest.approx(0.25)
    rows = _status(run.status_csv)
    assert rows["synth_000"]["status"] == "ok" and rows["synth_000"]["feature_dim"] == "512"
    assert (tmp_path / "feats" / "features_config.json").is_file()


def test_slides_cut_on_the_fly_are_the_cells_the_stores_hold(tmp_path, labelled_stores, synth_slides):
    slide = synth_slides["normal"]
    run = extract_features([slide], tmp_path / "feats", EXACT, tile=TILE)
    assert run.ok
    ff = read_feature_file(run.results[0].path)
    with open_store(labelled_stores / f"{slide.stem}.h5") as store:
        np.testing.assert_array_equal(ff.coords, store.coords)
        want = store.array_attrs("coords")
        attrs = store.attrs
    for key in ("patch_size", "patch_level", "patch_size_level0", "level_dim", "overlap"):
        assert np.array_equal(ff.coords_attrs[key], want[key]), key
    assert ff.attrs["source"] == "slide" and ff.attrs["store_path"] == "" and ff.instance_label is None
    assert list(ff.attrs["grid_shape"]) == [attrs["dimensions_lv0"][1] // 256, attrs["dimensions_lv0"][0] // 256]


def test_resume_skips_refuses_other_settings_and_overwrites_on_request(tmp_path, stores_copy):
    out = tmp_path / "feats"
    first = extract_features([stores_copy], out, EXACT)
    assert [r.status for r in first.results] == ["ok", "ok"]
    again = extract_features([stores_copy], out, EXACT)
    assert [r.status for r in again.results] == ["skipped", "skipped"] and again.n_patches == 0
    # runtime settings do not matter ...
    faster = extract_features([stores_copy], out, FeaturesConfig(**{**EXACT.__dict__, "batch_size": 7, "num_workers": 0}))
    assert {r.status for r in faster.results} == {"skipped"}
    # ... the features' dtype does: never replaced silently
    half = FeaturesConfig(**{**EXACT.__dict__, "dtype": "float16"})
    config_before = (out / "features_config.json").read_bytes()
    status_before = (out / "features_status.csv").read_bytes()
    with pytest.raises(ConfigError) as refused:  # before anything is written (review AL, finding 3)
        extract_features([stores_copy], out, half)
    assert "made with other settings (dtype 'float32' -> 'float16')" in str(refused.value)
    assert "nothing was written. Fix: write to a new folder" in str(refused.value)
    assert (out / "features_config.json").read_bytes() == config_before  # still the files' settings
    assert (out / "features_status.csv").read_bytes() == status_before
    redone = extract_features([stores_copy], out, half, overwrite=True)
    assert redone.ok and read_feature_file(out / "synth_000.h5").features.dtype == np.float16
    # a store made again (another source fingerprint) is embedded again
    with h5py.File(out / "synth_001.h5", "r+") as fh:
        fh.attrs["source_hash"] = "stale"
    third = extract_features([stores_copy], out, half)
    assert [r.status for r in third.results] == ["skipped", "ok"]
    assert not list(out.glob(".*"))  # no temporaries left
    # replace_other (what `run` uses in its own folders): files of other settings, or not feature files,
    # are made again; files of these settings are kept
    with h5py.File(out / "synth_000.h5", "r+") as fh:
        fh.attrs["settings_hash"] = "other"
    (out / "synth_001.h5").write_bytes(b"not hdf5")
    kept_inode = (out / "synth_001.h5").stat().st_ino
    fourth = extract_features([stores_copy], out, half, replace_other=True)
    assert [r.status for r in fourth.results] == ["ok", "ok"]
    assert (out / "synth_001.h5").stat().st_ino != kept_inode and read_feature_file(out / "synth_001.h5")
    fifth = extract_features([stores_copy], out, half, replace_other=True)
    assert [r.status for r in fifth.results] == ["skipped", "skipped"]


def test_bad_inputs_fail_alone_or_before_anything_runs(tmp_path, stores_copy, synth_slides, capsys):
    with pytest.raises(ConfigError, match="would replace the store itself"):
        extract_features([stores_copy], stores_copy, EXACT)
    other = tmp_path / "other"
    from wsi_milssl.tiling import tile_slide

    tile_slide(synth_slides["tumor"], other, TileConfig(**{**TILE.__dict__, "patch_size_px": 16}))
    (other / "synth_000.h5").rename(other / "coarse.h5")
    with h5py.File(other / "coarse.h5", "r+") as fh:
        fh.attrs["slide_stem"] = "coarse"
    rc = main(["features", str(stores_copy), str(other / "coarse.h5"), "--out", str(tmp_path / "f"),
               "--encoder", "resnet18", "--weights", "random", "--workers", "0"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "coarse.h5: tiled at 2 µm/px with 16 px patches, but this run embeds patches of 2 µm/px and 32 px" in err
    rows = _status(tmp_path / "f" / "features_status.csv")
    assert rows["coarse"]["status"] == "failed" and rows["synth_000"]["status"] == "ok"
    assert main(["features", str(stores_copy), "--out", str(tmp_path / "g"), "--encoder-kwargs", "[1]"]) == 2
    assert "--encoder-kwargs must be a JSON object" in capsys.readouterr().err
    assert main(["features", str(stores_copy), "--out", str(tmp_path / "g"), "--encoder", "nope",
                 "--weights", "random"]) == 1
    assert "unknown encoder 'nope'; registered: resnet18, resnet50_trunc" in capsys.readouterr().err


def test_a_store_tiled_again_from_a_changed_slide_is_embedded_again(tmp_path, stores_copy):
    """Same settings and patch count, but the store was cut from a changed slide file (its recorded size
    and modification time differ): its features are made again, the other slide's are kept."""
    out = tmp_path / "feats"
    assert extract_features([stores_copy], out, EXACT).ok
    with h5py.File(stores_copy / "synth_001.h5", "r+") as fh:
        assert "slide_mtime_ns" in fh.attrs
        fh.attrs["slide_mtime_ns"] = int(fh.attrs["slide_mtime_ns"]) + 1
    again = extract_features([stores_copy], out, EXACT)
    assert [r.status for r in again.results] == ["skipped", "ok"]


def test_a_store_labelled_again_keeps_its_features_with_the_new_labels(tmp_path, stores_copy, synth_dir):
    """`label` with another threshold changes the tumour store's instance labels: its feature file is kept
    (the features do not depend on labels) and its labels are brought up to date in place."""
    from wsi_milssl.config import LabelConfig
    from wsi_milssl.labeling import label_stores

    out = tmp_path / "feats"
    assert extract_features([stores_copy], out, EXACT).ok
    old = read_feature_file(out / "synth_000.h5").instance_label
    label_stores(stores_copy, annotations_dir=synth_dir, labels_csv=synth_dir / "labels.csv",
                 config=LabelConfig(positive_fraction=1.0), out_dir=tmp_path / "labels")
    with open_store(stores_copy / "synth_000.h5") as store:
        new = np.asarray(store.read_array("instance_label"))
    assert not np.array_equal(old, new)
    feats = read_feature_file(out / "synth_000.h5").features.copy()
    again = extract_features([stores_copy], out, EXACT)
    assert [r.status for r in again.results] == ["skipped", "skipped"]
    np.testing.assert_array_equal(read_feature_file(out / "synth_000.h5").instance_label, new)
    np.testing.assert_array_equal(read_feature_file(out / "synth_000.h5").features, feats)


def test_a_kept_file_is_only_read_when_its_labels_are_unchanged(tmp_path, stores_copy):
    import h5py

    out = tmp_path / "feats"
    assert extract_features([stores_copy], out, EXACT).ok
    files = sorted(out.glob("*.h5"))
    for f in files:
        f.chmod(0o444)  # a file another process holds, or one not ours to write: reading it is enough
    try:
        before = [f.stat().st_mtime_ns for f in files]
        with h5py.File(files[0], "r"):  # held open for reading elsewhere
            again = extract_features([stores_copy], out, EXACT)
        assert [r.status for r in again.results] == ["skipped", "skipped"]
        assert [f.stat().st_mtime_ns for f in files] == before
    finally:
        for f in files:
            f.chmod(0o644)
