"""Copies of training feature files that record no slide_path (CLAM's, TRIDENT's) given as --val are
training bags (review AK, finding 1): told apart by their path only, a copied folder validated on the
training data and chose best.pt there. A bag with a training bag's feature rows is now shared, as copies
of this project's files (their slide_path) and of a MIL CSV (their rows) were."""

from __future__ import annotations

import shutil

import h5py
import numpy as np

from wsi_milssl.cli import main
from wsi_milssl.mil.data import held_out_bags, read_feature_files

BASE = ["--epochs", "1", "--threads", "1", "--workers", "0", "--no-plots", "--amp", "off"]


def _clam_file(path, *, n=6, positive=False, seed=0):
    """A CLAM-style feature file: 'features' and 'coords' only, no slide_path or slide_stem."""
    rng = np.random.default_rng(seed)
    feats = rng.normal(size=(n, 8)).astype(np.float32)
    if positive:
        feats[:2] += 3.0
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        f.create_dataset("features", data=feats)
        coords = f.create_dataset("coords", data=np.stack([np.arange(n) * 256, np.zeros(n, np.int64)], 1))
        coords.attrs["patch_size"] = 256
        coords.attrs["patch_level"] = 0


def _folder(folder, names, *, seed=0):
    for i, name in enumerate(names):
        _clam_file(folder / f"{name}.h5", positive=i % 2 == 1, seed=seed + i)
    return folder


NAMES = ["s0", "s1", "s2", "s3"]
LABELS = {n: i % 2 for i, n in enumerate(NAMES)}


def test_copied_clam_files_are_training_bags(tmp_path):
    train = read_feature_files(sorted(_folder(tmp_path / "train", NAMES).glob("*.h5")), LABELS)
    shutil.copytree(tmp_path / "train", tmp_path / "copy")
    copy = read_feature_files(sorted((tmp_path / "copy").glob("*.h5")), LABELS)
    assert held_out_bags(train, copy) == []
    # other slides of the same names and row counts are held out; a renamed copy is not
    _folder(tmp_path / "other", NAMES, seed=10)
    shutil.copy(tmp_path / "train" / "s1.h5", tmp_path / "other" / "s9.h5")
    other = read_feature_files(sorted((tmp_path / "other").glob("*.h5")), {**LABELS, "s9": 1})
    assert held_out_bags(train, other) == NAMES


def test_train_refuses_a_copy_of_the_training_folder_as_val(tmp_path, capsys):
    train = _folder(tmp_path / "train", NAMES)
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\n" + "".join(f"{n},{v}\n" for n, v in LABELS.items()))
    shutil.copytree(train, tmp_path / "copy")
    rc = main(["train", str(train), "--labels", str(labels), "--val", str(tmp_path / "copy"), "--out",
               str(tmp_path / "run"), *BASE])
    assert rc != 0 and not (tmp_path / "run" / "last.pt").exists()
    assert "all 4 validation bags are training bags (s0, s1, s2, s3)" in capsys.readouterr().err
    # a partial copy is refused too (review CK: it trained with a warning, which -q hides)
    part = _folder(tmp_path / "part", ["t0", "t1"], seed=20)
    shutil.copy(train / "s1.h5", part / "s1.h5")
    part_labels = tmp_path / "part.csv"
    part_labels.write_text("slide,label\nt0,0\nt1,1\ns1,1\n")
    assert main(["train", str(train), "--labels", str(labels), "--val", str(part), "--val-labels",
                 str(part_labels), "--out", str(tmp_path / "run2"), *BASE]) == 1
    err = capsys.readouterr().err
    assert f"--val {part}: 1 of the 3 validation bags is a training bag (s1)" in err
    assert "drop those from --val or from INPUTS" in err and not (tmp_path / "run2" / "last.pt").exists()
