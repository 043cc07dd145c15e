"""revS 2b: `heatmap --model RUN` while `train` still wrote RUN made heatmaps of an epoch on the way (its
last.pt), and evaluate took them (both rc 0); a run killed with kill -9 after epoch 5 of 60 was used without
a word. Now a run folder that a live run holds is refused, naming that run and the fix (wait), and the
checkpoint of a run that stopped before its last epoch gets a warning naming the epochs; the best.pt of a
finished run (an earlier epoch than the last) gets none. Feature heads (`heatmap --features`) and image
models (`heatmap --store`) alike."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from processes import hold_lock, release
from wsi_milssl.cli import main
from wsi_milssl.config import TrainConfig

WARNING = "stopped after epoch"


class _Killed(Exception):
    """Stands for a kill right after an epoch's checkpoints were saved."""


def _stop_after(epoch: int):
    def progress(event):
        if event.stage == "train" and event.done == epoch:
            raise _Killed
    return progress


@pytest.fixture(scope="module")
def feats(tmp_path_factory, labelled_stores):
    out = tmp_path_factory.mktemp("run_in_progress") / "feats"
    assert main(["features", str(labelled_stores), "--out", str(out), "--encoder", "resnet18", "--weights", "random",
                 "--workers", "1", "--batch-size", "64"]) == 0
    return out


def _fit(run, data, *, epochs: int, stop_after: int | None = None, **config):
    """Train into ``run`` (validation on the training slides, evaluated at epoch 1 only: best.pt is epoch 1)."""
    from wsi_milssl.mil.selftrain import fit

    config = TrainConfig(**{"epochs": epochs, "threads": 1, "plots": False, "select_metric": "bag_nll", **config})
    progress = None if stop_after is None else _stop_after(stop_after)
    if stop_after is None:
        fit(data, config=config, out_dir=run, val=data, eval_at=[1])
    else:
        with pytest.raises(_Killed):
            fit(data, config=config, out_dir=run, val=data, eval_at=[1], progress=progress)


def _feature_set(feats, synth_dir):
    from wsi_milssl.mil.data import read_feature_files, read_labels_csv

    return read_feature_files(sorted(feats.glob("*.h5")), read_labels_csv(synth_dir / "labels.csv"))


def test_heatmap_refuses_a_run_that_train_still_writes_then_warns_once_it_was_killed(tmp_path, feats, synth_dir,
                                                                                     capsys):
    run = tmp_path / "run"
    train = subprocess.Popen([sys.executable, "-m", "wsi_milssl", "train", str(feats), "--mode", "features", "--labels",
                              str(synth_dir / "labels.csv"), "--out", str(run), "--epochs", "100000", "--threads", "1",
                              "--no-plots", "-q"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (run / "last.pt").is_file():
            assert train.poll() is None and time.monotonic() < deadline, "train never saved an epoch"
            time.sleep(0.02)
        os.kill(train.pid, signal.SIGSTOP)
        for model in (run, run / "last.pt"):
            hm = tmp_path / f"hm_{model.name}"
            assert main(["heatmap", "--features", str(feats), "--model", str(model), "--out", str(hm)]) == 1
            err = capsys.readouterr().err
            assert err.startswith(f"error: {run}: another wsi-milssl run (pid {train.pid}"), err
            assert "wsi-milssl train" in err
            assert err.rstrip().endswith("is still writing this run folder, so last.pt is the checkpoint of an epoch "
                                         "on the way, not the run's result. Fix: wait until that run finishes, then "
                                         "make the heatmaps.")
            assert not (hm / "scores.csv").exists()
    finally:
        train.kill()  # kill -9, as the reviewer's run was killed
        train.wait()
    assert main(["heatmap", "--features", str(feats), "--model", str(run), "--out", str(tmp_path / "hm")]) == 0
    err = capsys.readouterr().err
    found = re.search(rf"{re.escape(str(run / 'last.pt'))}: its run stopped after epoch (\d+) of the 100000 it was "
                      r"set to train \(killed or failed before its end\), so this model is not the finished run's\. "
                      rf"Fix, unless it is the model you want: continue the run with `wsi-milssl train --resume "
                      rf"{re.escape(shlex.quote(str(run)))}`, then make the heatmaps again\.", err)
    assert found and int(found.group(1)) >= 1, err

def test_a_finished_runs_best_pt_is_not_warned_about_an_unfinished_runs_is(tmp_path, feats, synth_dir, capsys):
    data = _feature_set(feats, synth_dir)
    done, stopped = tmp_path / "done", tmp_path / "stopped"
    _fit(done, data, epochs=3, mode="features")  # best.pt: epoch 1 of 3, last.pt: epoch 3
    _fit(stopped, data, epochs=3, stop_after=2, mode="features")  # best.pt: epoch 1, last.pt: epoch 2 of 3
    capsys.readouterr()
    for i, model in enumerate((done, done / "best.pt", done / "last.pt")):
        assert main(["heatmap", "--features", str(feats), "--model", str(model), "--out", str(tmp_path / f"d{i}")]) == 0
        assert WARNING not in capsys.readouterr().err
    assert main(["heatmap", "--features", str(feats), "--model", str(stopped), "--out", str(tmp_path / "s")]) == 0
    assert (f"{stopped / 'best.pt'} holds epoch 1 of a run that stopped after epoch 2 of the 3 it was set to train "
            "(killed or failed before its end, as last.pt records)") in capsys.readouterr().err
    # best.pt alone (copied elsewhere): where its run stopped is not known, so nothing is said
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "best.pt").write_bytes((stopped / "best.pt").read_bytes())
    assert main(["heatmap", "--features", str(feats), "--model", str(alone), "--out", str(tmp_path / "a")]) == 0
    assert WARNING not in capsys.readouterr().err


def test_image_heatmap_refuses_a_run_being_written_and_warns_about_a_stopped_one(tmp_path, labelled_stores, synth_dir,
                                                                                 capsys):
    """The image path (load_inference_model, which `run` uses too) checks the same."""
    from wsi_milssl.mil.data import read_labels_csv, read_patch_stores

    data = read_patch_stores([labelled_stores], read_labels_csv(synth_dir / "labels.csv"))
    run = tmp_path / "run"
    _fit(run, data, epochs=2, stop_after=1, mode="images", model="resnet18", batch_size=32, num_workers=0, amp="off")
    cmd = ["heatmap", "--store", str(labelled_stores), "--model", str(run / "last.pt"), "--out", str(tmp_path / "hm"),
           "--workers", "0", "--threads", "1"]
    holder = hold_lock(run)
    try:
        capsys.readouterr()
        assert main(cmd) == 1
        err = capsys.readouterr().err
        assert f"{run}: another wsi-milssl run (pid {holder.pid}" in err and "is still writing this run folder" in err
    finally:
        release(holder)
    assert main(cmd) == 0
    assert f"{run / 'last.pt'}: its run stopped after epoch 1 of the 2 it was set to train" in capsys.readouterr().err



def test_the_feature_heatmap_api_refuses_a_run_being_written(tmp_path, feats, synth_dir):
    """make_feature_heatmaps (the Python API, and `run`'s heatmap stage of a feature pipeline) checks as the
    CLI does: it loads the head through load_feature_head, which checks the run."""
    from wsi_milssl.errors import WsiMilsslError
    from wsi_milssl.inference.feature_maps import make_feature_heatmaps

    run = tmp_path / "run"
    _fit(run, _feature_set(feats, synth_dir), epochs=1, mode="features")
    holder = hold_lock(run)
    try:
        with pytest.raises(WsiMilsslError, match=rf"another wsi-milssl run \(pid {holder.pid}"):
            make_feature_heatmaps([feats], run, tmp_path / "hm")
    finally:
        release(holder)
    assert not (tmp_path / "hm").exists()
