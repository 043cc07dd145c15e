"""Acceptance (issue 17): on generated slides, `features` (random-weight ResNet50 trunk) then `train
--mode features` then `heatmap --features` then `evaluate` run end to end, and the maps sit on the
stores' grid; foreign feature files make heatmaps too; wrong pairings are refused."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from feature_fixtures import write_clam_features
from processes import hold_lock, release
from wsi_milssl.cli import main
from wsi_milssl.errors import StoreError
from wsi_milssl.features import read_feature_file
from wsi_milssl.store import open_store


@pytest.fixture(scope="module")
def feature_run(tmp_path_factory, labelled_stores, synth_dir):
    """features -> train on them: (feature folder, run folder)."""
    root = tmp_path_factory.mktemp("feature_run")
    feats, run = root / "feats", root / "run"
    assert main(["features", str(labelled_stores), "--out", str(feats), "--encoder", "resnet50_trunc",
                 "--weights", "random", "--workers", "1", "--batch-size", "32"]) == 0
    assert main(["train", str(feats), "--mode", "features", "--labels", str(synth_dir / "labels.csv"), "--out",
                 str(run), "--epochs", "3", "--mu", "0.2", "--mu-ramp-epochs", "1", "--threads", "1", "--no-plots"]) == 0
    return feats, run


def test_features_train_heatmap_evaluate_end_to_end(tmp_path, feature_run, labelled_stores, synth_dir):
    feats, run = feature_run
    assert read_feature_file(feats / "synth_000.h5").features.shape[1] == 1024
    hm = tmp_path / "hm"
    assert main(["heatmap", str(synth_dir), "--features", str(feats), "--model", str(run), "--out", str(hm),
                 "--annotations", str(synth_dir), "--thumbnail-px", "256"]) == 0
    for stem in ("synth_000", "synth_001"):
        sidecar = json.loads((hm / f"{stem}_probs.json").read_text())
        with open_store(labelled_stores / f"{stem}.h5") as store:
            attrs, coords = store.attrs, store.coords
        assert sidecar["stride_lv0"] == attrs["stride_lv0"] and sidecar["patch_size_lv0"] == attrs["patch_size_lv0"]
        assert sidecar["origin_lv0"] == [0, 0] and sidecar["mpp"] == pytest.approx(attrs["mpp"])
        assert sidecar["shape"] == [attrs["dimensions_lv0"][1] // attrs["stride_lv0"],
                                    attrs["dimensions_lv0"][0] // attrs["stride_lv0"]]
        probs = np.load(hm / f"{stem}_probs.npy")
        assert np.isfinite(probs).sum() == len(coords)
        with open(hm / f"{stem}_patches.csv", newline="") as fh:
            rows = list(csv.DictReader(fh))
        assert [[int(r["x_lv0"]), int(r["y_lv0"])] for r in rows] == coords.tolist()
        assert (hm / f"{stem}_heatmap.png").stat().st_size > 0 and (hm / f"{stem}_detections.csv").exists()
    ev = tmp_path / "ev"
    assert main(["evaluate", "--predictions", str(hm), "--annotations", str(synth_dir), "--slides", str(synth_dir),
                 "--labels", str(synth_dir / "labels.csv"), "--out", str(ev)]) == 0
    metrics = json.loads((ev / "metrics.json").read_text())
    assert metrics["froc"] is not None and metrics["instance_auc"] is not None and metrics["n_slides"] == 2
    assert metrics["n_patches"] == sum(len(read_feature_file(p)) for p in feats.glob("*.h5"))


def test_clam_files_without_attributes_make_heatmaps_with_the_slide(tmp_path, feature_run, synth_dir):
    feats, run = feature_run
    ours = read_feature_file(feats / "synth_000.h5")
    clam = write_clam_features(tmp_path / "clam", "synth_000", ours.features, ours.coords)
    hm = tmp_path / "hm"
    assert main(["heatmap", str(synth_dir / "synth_000.tif"), "--features", str(clam), "--model", str(run),
                 "--out", str(hm), "--thumbnail-px", "256"]) == 0
    got = json.loads((hm / "synth_000_probs.json").read_text())
    assert got["mpp"] == pytest.approx(0.25) and got["stride_lv0"] == 256 and got["shape"] == [16, 16]
    mine = tmp_path / "mine"
    assert main(["heatmap", "--features", str(feats / "synth_000.h5"), "--model", str(run), "--out", str(mine)]) == 0
    np.testing.assert_array_equal(np.load(hm / "synth_000_probs.npy"), np.load(mine / "synth_000_probs.npy"))


def test_heatmap_features_refuses_wrong_pairings(tmp_path, feature_run, labelled_stores, capsys):
    from wsi_milssl.mil.models import create_model
    from wsi_milssl.mil.checkpoint import save_checkpoint

    feats, run = feature_run
    assert main(["heatmap", "--features", str(feats), "--store", str(labelled_stores), "--model", str(run),
                 "--out", str(tmp_path / "a")]) == 2
    assert "--features and --store are two sources" in capsys.readouterr().err
    image = save_checkpoint({"model": create_model("resnet18").state_dict(), "model_name": "resnet18",
                             "model_kwargs": {}, "config": {"mode": "images"}}, tmp_path / "img" / "best.pt")
    assert main(["heatmap", "--features", str(feats), "--model", str(image), "--out", str(tmp_path / "b")]) == 1
    assert "classifies image patches, not feature vectors. Fix: drop --features" in capsys.readouterr().err
    narrow = tmp_path / "narrow.h5"
    from wsi_milssl.features import write_feature_file

    write_feature_file(narrow, features=np.zeros((2, 8), np.float32), coords=np.array([[0, 0], [256, 0]]),
                       attrs={"mpp": 0.25}, coords_attrs={}, features_attrs={"encoder": "resnet50_trunc"})
    assert main(["heatmap", "--features", str(narrow), "--model", str(run), "--out", str(tmp_path / "c")]) == 1
    assert "features of width 8, but the head was trained on 1024" in capsys.readouterr().err


def test_heatmap_features_with_a_nan_head_fails_each_slide_before_writing(tmp_path, feature_run, capsys):
    """A diverged feature head (NaN weights): every slide is failed with the fix, no per-slide file is
    written, and the command ends with its summary, not a ValueError from the scores file."""
    import torch

    from wsi_milssl.mil.checkpoint import save_checkpoint

    feats, run = feature_run
    ckpt = torch.load(run / "last.pt", weights_only=True)
    first = next(k for k, v in ckpt["model"].items() if v.is_floating_point())
    ckpt["model"][first] = torch.full_like(ckpt["model"][first], float("nan"))
    save_checkpoint(ckpt, tmp_path / "nan.pt")
    hm = tmp_path / "hm"
    code = main(["heatmap", "--features", str(feats), "--model", str(tmp_path / "nan.pt"), "--out", str(hm)])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    with open(hm / "heatmap_status.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["status"] for r in rows] == ["failed", "failed"]
    assert all("the model gives non-finite probabilities" in r["error"] and "lower learning rate" in r["error"]
               for r in rows)
    assert not list(hm.glob("synth_*")) and not (hm / "scores.csv").exists()


def test_heatmap_features_with_extreme_rows_blames_the_rows_not_a_finite_head(tmp_path, feature_run, synth_dir,
                                                                               capsys):
    """Was reported as 'the checkpoint is likely from a diverged run (its weights hold NaN or infinity). Fix:
    retrain with a lower learning rate' although the head's weights were finite and a feature row of 3e38
    (finite in float32) overflowed it."""
    feats, run = feature_run
    ours = read_feature_file(feats / "synth_000.h5")
    extreme = ours.features.astype(np.float32)
    extreme[[7, 9]] = 3e38
    clam = write_clam_features(tmp_path / "clam", "synth_000", extreme, ours.coords)
    hm = tmp_path / "hm"
    code = main(["heatmap", str(synth_dir / "synth_000.tif"), "--features", str(clam), "--model", str(run),
                 "--out", str(hm), "--thumbnail-px", "256"])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    with open(hm / "heatmap_status.csv", newline="") as fh:
        (row,) = list(csv.DictReader(fh))
    x, y = ours.coords[7].tolist()
    assert row["status"] == "failed" and "non-finite probabilities (NaN or infinity) for 2 of " in row["error"]
    assert "diverged" not in row["error"] and "--lr" not in row["error"]
    assert (f"its weights are finite, so the inputs of those patches are the cause (first: row 7, level-0 ({x}, {y}))"
            in row["error"])
    assert "Fix: check those rows of the slide's features for extreme values" in row["error"]
    assert row["error"].startswith(f"{clam}: "), row["error"]  # the file to check, before the head
    assert not list(hm.glob("synth_000_*"))


def test_heatmap_features_draws_maps_of_files_whose_instance_labels_it_never_reads(tmp_path, feature_run, synth_dir):
    """Instance labels other than 0/1 fail training and evaluation reads (a5e3fae), not the maps, which never
    read them."""
    import h5py

    feats, run = feature_run
    odd = tmp_path / "odd"
    odd.mkdir()
    shutil.copy(feats / "synth_000.h5", odd / "synth_000.h5")
    with h5py.File(odd / "synth_000.h5", "r+") as h:
        n = h["features"].shape[0]
        if "instance_label" in h:
            del h["instance_label"]
        h["instance_label"] = np.full(n, -1, dtype=np.int8)
    with pytest.raises(StoreError, match="'instance_label' must hold 0"):
        read_feature_file(odd / "synth_000.h5")
    assert main(["heatmap", str(synth_dir / "synth_000.tif"), "--features", str(odd), "--model", str(run),
                 "--out", str(tmp_path / "hm"), "--thumbnail-px", "256"]) == 0


def test_a_feature_heatmap_holds_its_folder_so_evaluate_and_a_second_run_are_refused(tmp_path, feature_run, synth_dir):
    """revS 1: heatmap --features took no lock: evaluate scored a half-written folder (3 of 12 slides, rc 0),
    and two runs into one --out both ran. While it writes, another process's evaluate is refused."""
    from wsi_milssl.inference.feature_maps import make_feature_heatmaps

    feats, run = feature_run
    hm = tmp_path / "hm"
    refused = []

    def progress(event):
        if event.done == 1:  # the first slide's files are written, the second's not yet
            refused.append(subprocess.run([
                sys.executable, "-m", "wsi_milssl", "evaluate", "--predictions", str(hm), "--annotations",
                str(synth_dir), "--slides", str(synth_dir), "--labels", str(synth_dir / "labels.csv"), "--out",
                str(tmp_path / "ev")], capture_output=True, text=True))

    made = make_feature_heatmaps([feats], run, hm, progress=progress)
    assert [r.status for r in made.results] == ["ok", "ok"]
    assert len(refused) == 1 and refused[0].returncode == 1, refused
    assert f"(pid {os.getpid()}" in refused[0].stderr and "is still writing this folder" in refused[0].stderr
    assert not (tmp_path / "ev" / "metrics.json").exists() and not (hm / ".wsi-milssl.lock").exists()


def test_a_second_feature_heatmap_into_a_folder_being_written_is_refused(tmp_path, feature_run, capsys):
    feats, run = feature_run
    hm = tmp_path / "hm"
    other = hold_lock(hm)  # holds the folder as a running heatmap run does
    try:
        assert main(["heatmap", "--features", str(feats), "--model", str(run), "--out", str(hm)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: {hm}: another wsi-milssl run (pid {other.pid}"), err
        assert err.rstrip().endswith("Fix: wait until it finishes, or write to another folder (--out).")
        assert sorted(p.name for p in hm.iterdir() if not p.name.startswith(".")) == []
    finally:
        release(other)
