"""Features of one encoder name but other weights are not mixed: a head is not run on them (heatmap) and a
validation set of them is refused (train), as a training set mixing them is."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from wsi_milssl.cli import main
from wsi_milssl.features import write_feature_file

SHA_A, SHA_B = "a" * 64, "b" * 64


def _files(folder, sha, names, seed=0):
    """Feature files of a 6x6 grid at 20x (our attributes; encoder resnet18 with weights of ``sha``); odd
    slides positive with a shifted corner."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:6, 0:6]
    coords = np.stack([xs.ravel() * 512, ys.ravel() * 512], axis=1)
    folder.mkdir(parents=True)
    for i, name in enumerate(names):
        feats = rng.normal(size=(len(coords), 8)).astype(np.float32)
        feats[:6] += 3.0 * (i % 2)
        write_feature_file(folder / f"{name}.h5", features=feats, coords=coords,
                           attrs={"slide_stem": name, "mpp": 0.25, "dimensions_lv0": [3072, 3072],
                                  "encoder": "resnet18", "encoder_weights_sha256": sha},
                           coords_attrs={"patch_size": 256, "patch_size_level0": 512, "level0_magnification": 40.0,
                                         "target_magnification": 20.0, "overlap": 0},
                           features_attrs={"encoder": "resnet18"})
    return folder


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A head trained on features of weights A (2 epochs), its labels, and feature files of weights A and B."""
    root = tmp_path_factory.mktemp("encoder_weights")
    names = [f"s{i}" for i in range(4)]
    (root / "labels.csv").write_text("slide,label\n" + "".join(f"{n},{i % 2}\n" for i, n in enumerate(names)))
    a, b = _files(root / "a", SHA_A, names), _files(root / "b", SHA_B, names, seed=1)
    assert main(["train", str(a), "--labels", str(root / "labels.csv"), "--out", str(root / "run"), "--epochs", "2",
                 "--threads", "1", "--no-plots"]) == 0
    return root


def test_heatmap_refuses_features_of_other_encoder_weights(run, tmp_path):
    rc = main(["heatmap", "--features", str(run / "b"), "--model", str(run / "run" / "last.pt"), "--out",
               str(tmp_path / "maps"), "--threads", "1"])
    assert rc != 0
    rows = list(csv.DictReader((tmp_path / "maps" / "heatmap_status.csv").open()))
    assert {r["status"] for r in rows} == {"failed"}
    assert "features of resnet18 weights bbbbbbbbbbbb, but the head" in rows[0]["error"]
    assert "trained on features of resnet18 weights aaaaaaaaaaaa" in rows[0]["error"]
    # the training weights' files still run
    assert main(["heatmap", "--features", str(run / "a"), "--model", str(run / "run" / "last.pt"), "--out",
                 str(tmp_path / "ok"), "--threads", "1"]) == 0


def test_train_refuses_validation_features_of_other_encoder_weights(run, tmp_path, capsys):
    labels = str(run / "labels.csv")
    rc = main(["train", str(run / "a"), "--labels", labels, "--val", str(run / "b"), "--out", str(tmp_path / "r"),
               "--epochs", "1", "--threads", "1", "--no-plots"])
    err = capsys.readouterr().err
    assert rc != 0 and not (tmp_path / "r" / "last.pt").exists()
    assert "validation features" in err and "resnet18 weights bbbbbbbbbbbb" in err and "b/s0.h5" in err
    assert "resnet18 weights aaaaaaaaaaaa" in err and "a/s0.h5" in err
