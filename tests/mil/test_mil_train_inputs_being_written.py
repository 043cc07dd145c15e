"""revS 2a: `train` on a folder that another run still writes (`features` or `tile` still adding slides,
`label` rewriting the stores) trained on the slides written so far, without a word (5 of 12, rc 0).
Now it is refused, naming the folder, the other run's pid and command, and the fix (wait), as `evaluate`
refuses a heatmap folder still being written; for INPUTS, --val and the inputs a --resume reads."""

from __future__ import annotations


import numpy as np
import pytest

from processes import hold_lock, release
from wsi_milssl.cli import main
from wsi_milssl.features import write_feature_file

BASE = ["--epochs", "1", "--threads", "1", "--workers", "0", "--no-plots", "--amp", "off"]


def _features(folder, names):
    rng = np.random.default_rng(0)
    coords = np.stack([np.arange(6) * 512, np.zeros(6, np.int64)], axis=1)
    folder.mkdir(parents=True)
    rows = ["slide,label"]
    for i, name in enumerate(names):
        feats = rng.normal(size=(6, 8)).astype(np.float32)
        feats[:2] += 3.0 * (i % 2)
        write_feature_file(folder / f"{name}.h5", features=feats, coords=coords,
                           attrs={"slide_stem": name, "slide_path": str(folder / f"{name}.tif")},
                           coords_attrs={}, features_attrs={"encoder": "resnet18"})
        rows.append(f"{name},{i % 2}")
    (folder.parent / "labels.csv").write_text("\n".join(rows) + "\n")
    return folder, folder.parent / "labels.csv"


def _refusal(err: str, option: str, folder, pid: int) -> None:
    assert f"error: {option} {folder}: another wsi-milssl run (pid {pid}" in err, err
    assert "is still writing this folder, so the slides in it are not complete" in err
    assert err.rstrip().endswith("Fix: wait until that run (every shard of it) finishes, then train.")


def test_train_refuses_a_feature_folder_being_written(tmp_path, capsys):
    feats, labels = _features(tmp_path / "data" / "feats", ["a", "b", "c", "d"])
    run = tmp_path / "run"
    cmd = ["train", str(feats), "--labels", str(labels), "--out", str(run), *BASE]
    other = hold_lock(feats)
    try:
        assert main(cmd) == 1
        _refusal(capsys.readouterr().err, "INPUTS", feats, other.pid)
        # the files themselves (a shell glob of the folder) are as incomplete
        assert main(["train", *map(str, sorted(feats.glob("*.h5"))), "--labels", str(labels), "--out", str(run),
                     *BASE]) == 1
        _refusal(capsys.readouterr().err, "INPUTS", feats, other.pid)
        assert not (run / "last.pt").exists()
    finally:
        release(other)
    assert main(cmd) == 0  # once the writer has finished
    assert (run / "last.pt").is_file()


def test_train_refuses_validation_stores_being_written(tmp_path, image_store_factory, capsys):
    paths, labels = image_store_factory(tmp_path / "stores", n_bags=4, n_patches=8, size_px=16)
    val, _ = image_store_factory(tmp_path / "val", n_bags=2, n_patches=8, size_px=16, seed=1)
    (tmp_path / "labels.csv").write_text(labels.read_text() + "".join(
        f"{p.stem},{i % 2}\n" for i, p in enumerate(val)))
    cmd = ["train", str(paths[0].parent), "--labels", str(tmp_path / "labels.csv"), "--val", str(val[0].parent),
           "--out", str(tmp_path / "run"), *BASE]
    other = hold_lock(val[0].parent)
    try:
        assert main(cmd) == 1
        _refusal(capsys.readouterr().err, "--val", val[0].parent, other.pid)
    finally:
        release(other)
    other = hold_lock(paths[0].parent)  # the training stores (`label` rewriting them holds their folder)
    try:
        assert main(cmd) == 1
        _refusal(capsys.readouterr().err, "INPUTS", paths[0].parent, other.pid)
    finally:
        release(other)
    assert not (tmp_path / "run" / "last.pt").exists()


def test_train_resume_refuses_its_inputs_being_written(tmp_path, capsys):
    feats, labels = _features(tmp_path / "data" / "feats", ["a", "b", "c", "d"])
    run = tmp_path / "run"
    assert main(["train", str(feats), "--labels", str(labels), "--out", str(run), *BASE]) == 0
    other = hold_lock(feats)
    try:
        assert main(["train", "--resume", str(run), "--epochs", "2"]) == 1
        _refusal(capsys.readouterr().err, "the run's input", feats.resolve(), other.pid)
    finally:
        release(other)


@pytest.mark.parametrize("mode", ["features", "images"])
def test_a_folder_this_process_holds_is_no_refusal(tmp_path, image_store_factory, mode):
    """A pipeline holds the folders it writes in its own process: its own hold is not another run's."""
    from wsi_milssl.cli.train import load_instances
    from wsi_milssl.locks import folder_lock

    if mode == "features":
        folder, labels = _features(tmp_path / "data" / "feats", ["a", "b"])
    else:
        paths, labels = image_store_factory(tmp_path / "stores", n_bags=2, n_patches=8, size_px=16)
        folder = paths[0].parent
    with folder_lock(folder):
        assert load_instances([folder], mode=mode, labels_path=labels).n_bags == 2
