"""Review EG (mutation test, round 2): rules of training and scoring that no test held. A bug in any of them
changed results without a failing test: the best epoch forgotten by a resume, refresh_every counted per epoch
instead of across epochs, the bag accuracy's strict threshold, the bag NLL's clip, and the rows of a feature file
whose bags alternate."""

from __future__ import annotations

import math

import h5py
import numpy as np
import pytest

from wsi_milssl.config.train import TrainConfig
from wsi_milssl.mil import fit, read_checkpoint, read_mil_csv, selftrain
from wsi_milssl.mil.data import read_feature_files
from wsi_milssl.mil.scores import bag_metrics


class _Kill(Exception):
    pass


def _kill_after(epochs):
    def callback(event):
        if event.stage == "train" and event.done == epochs and event.item:
            raise _Kill()
    return callback


def test_a_resume_keeps_the_best_epoch_chosen_before_the_kill(tmp_path, mil_csv, mil_csv_val):
    """The existing resume tests' best epoch came after the kill; here it comes before, so a resume that forgot the
    best score so far would take a later, worse epoch for best.pt (4 instead of 1 with the bug)."""
    train, val = read_mil_csv(mil_csv), read_mil_csv(mil_csv_val)
    cfg = TrainConfig(mode="features", epochs=5, batch_size=64, mu=0.25, mu_ramp_epochs=5, plots=False, threads=1,
                      lr=0.1, select_metric="bag_auc")
    full = fit(train, config=cfg, out_dir=tmp_path / "full", val=val)
    assert full.best_epoch <= 2  # the precondition: the best epoch lies before the kill
    with pytest.raises(_Kill):
        fit(train, config=cfg, out_dir=tmp_path / "cut", val=val, progress=_kill_after(2))
    resumed = fit(train, config=cfg, out_dir=tmp_path / "cut", val=val, resume=True)
    assert resumed.best_epoch == full.best_epoch
    assert read_checkpoint(tmp_path / "cut" / "best.pt")["epoch"] == full.best_epoch


def test_refresh_every_counts_steps_across_epochs(mil_csv, monkeypatch):
    """With an odd number of steps per epoch and refresh_every 2, the refreshes fall at global steps 0, 2, 4, ...
    (the train_one_epoch docstring), not at steps 0, 2, ... of every epoch."""
    train = read_mil_csv(mil_csv)
    n = len(train)
    batch = next(b for b in range(16, 128) if math.ceil(n / b) % 2 == 1 and n % b != 1)
    steps = math.ceil(n / batch)
    calls = []
    real = selftrain.refresh_pseudo_labels
    monkeypatch.setattr(selftrain, "refresh_pseudo_labels", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    fit(train, config=TrainConfig(mode="features", epochs=3, batch_size=batch, refresh_every=2, plots=False,
                                  threads=1))
    assert len(calls) == len(range(0, 3 * steps, 2)), (steps, len(calls))


def test_bag_accuracy_takes_a_score_above_the_threshold_for_tumour_and_the_nll_of_a_certain_score_is_finite():
    assert bag_metrics(np.array([0.5, 0.9, 0.1]), np.array([0, 1, 0]))["bag_accuracy"] == 1.0  # 0.5 is normal
    nll = bag_metrics(np.array([1.0, 0.0]), np.array([0, 1]))["bag_nll"]  # certain and wrong: clipped at 1e-7
    assert np.isfinite(nll) and nll == pytest.approx(-np.log(1e-7))


def test_alternating_bags_in_one_feature_file_keep_their_rows(tmp_path):
    feats = np.arange(8, dtype=np.float32).reshape(4, 2)  # rows of bags a, b, a, b
    with h5py.File(tmp_path / "multi.h5", "w") as f:
        f.create_dataset("features", data=feats)
        f.create_dataset("bag_ids", data=np.array(["a", "b", "a", "b"], dtype=h5py.string_dtype()))
    bags = read_feature_files([tmp_path / "multi.h5"], {"a": 0, "b": 1})
    assert bags.bag_names == ["a", "b"]
    np.testing.assert_array_equal(bags.features, feats[[0, 2, 1, 3]])
    np.testing.assert_array_equal(bags.bag_ids, [0, 0, 1, 1])
