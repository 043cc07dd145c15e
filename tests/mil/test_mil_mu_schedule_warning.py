"""A μ schedule that never reaches μ is warned about once at the start (review AK, finding 4):
`--epochs 3 --mu 0.2 --mu-ramp-epochs 100` trained at μ_t 0.5 .. 0.494 without a word, and image mode's
defaults (10 epochs, T = 10) ended at μ_t = 0.185, not μ = 0.15: eq. 10 gives μ from epoch t = T on, with t
counted from 0, so T = epochs never reaches it either. Image mode's default T is now 5."""

from __future__ import annotations

import json
import logging

import h5py
import numpy as np
import pytest

from wsi_milssl.cli import main
from wsi_milssl.mil import adaptive_mu

BASE = ["--threads", "1", "--workers", "0", "--no-plots", "--amp", "off"]


def _folder(tmp_path):
    folder = tmp_path / "ftr"
    folder.mkdir()
    for i in range(4):
        rng = np.random.default_rng(i)
        feats = rng.normal(size=(6, 8)).astype(np.float32)
        feats[:2] += 3.0 * (i % 2)
        with h5py.File(folder / f"s{i}.h5", "w") as f:
            f.create_dataset("features", data=feats)
            f.create_dataset("coords", data=np.stack([np.arange(6) * 256, np.zeros(6, np.int64)], 1))
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\n" + "".join(f"s{i},{i % 2}\n" for i in range(4)))
    return folder, labels


def test_eq10_with_t_from_0_reaches_mu_at_epoch_t():
    # T = epochs = 10 leaves the last epoch (t = 9) at 0.185: the image mode's old defaults
    assert adaptive_mu(9, mu=0.15, ramp_epochs=10) == pytest.approx(0.185)
    assert adaptive_mu(10, mu=0.15, ramp_epochs=10) == 0.15


@pytest.mark.parametrize("mode", ["images", "features"])
def test_each_modes_defaults_reach_mu_without_a_warning(mode, caplog):
    """The defaults (images: 10 epochs, T = 5; features: 100 epochs, T = 10) train their last epochs at μ,
    so a run with default settings is not told its settings are wrong."""
    from wsi_milssl.config import TrainConfig
    from wsi_milssl.mil.selftrain import _warn_mu_not_reached

    config = TrainConfig(mode=mode)
    assert config.mu_ramp_epochs < config.epochs
    assert adaptive_mu(config.epochs - 1, mu=config.mu, ramp_epochs=config.mu_ramp_epochs) == config.mu
    with caplog.at_level(logging.WARNING):
        _warn_mu_not_reached(config)
    assert "never reaches" not in caplog.text
    assert TrainConfig(mode=mode, mu_ramp_epochs=3).mu_ramp_epochs == 3  # given: kept


@pytest.mark.parametrize("epochs, ramp, warned", [(3, 100, True), (3, 3, True), (3, 2, False), (3, 0, False)])
def test_a_schedule_that_never_reaches_mu_is_warned_about(tmp_path, caplog, epochs, ramp, warned):
    folder, labels = _folder(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert main(["train", str(folder), "--labels", str(labels), "--out", str(tmp_path / "run"), "--epochs",
                     str(epochs), "--mu", "0.2", "--mu-ramp-epochs", str(ramp), *BASE]) == 0
    last = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    hits = [r.getMessage() for r in caplog.records if "never reaches μ" in r.getMessage()]
    if warned:
        assert len(hits) == 1
        assert f"the last at μ_t = {last['mu_t']:.4f}" in hits[0] and "--mu-ramp-epochs 2 or less" in hits[0]
        assert last["mu_t"] > 0.2
    else:
        assert not hits and last["mu_t"] == pytest.approx(0.2)


def test_fixed_mu_is_not_warned_about(tmp_path, caplog):
    folder, labels = _folder(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert main(["train", str(folder), "--labels", str(labels), "--out", str(tmp_path / "run"), "--epochs", "2",
                     "--mu-ramp-epochs", "100", "--fixed-mu", *BASE]) == 0
    assert "never reaches μ" not in caplog.text


def test_on_a_resume_the_warning_suggests_only_what_a_resume_accepts(tmp_path, caplog):
    # review AL, finding 4: a resume was told '--mu-ramp-epochs 2 or less ... or --fixed-mu', both then refused
    # as changed settings; the fix of a resume is more epochs, and that fix is accepted
    folder, labels = _folder(tmp_path)
    run = ["train", str(folder), "--labels", str(labels), "--out", str(tmp_path / "run"), "--mu", "0.2",
           "--mu-ramp-epochs", "3", *BASE]
    assert main([*run, "--epochs", "2"]) == 0
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert main(["train", "--resume", str(tmp_path / "run"), "--epochs", "3", *BASE]) == 0
    hits = [r.getMessage() for r in caplog.records if "never reaches μ" in r.getMessage()]
    assert len(hits) == 1 and "resume with --epochs 4 or more" in hits[0]
    assert "--mu-ramp-epochs 2 or less" not in hits[0] and "--fixed-mu," not in hits[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert main(["train", "--resume", str(tmp_path / "run"), "--epochs", "4", *BASE]) == 0  # accepted: μ reached
    assert "never reaches μ" not in caplog.text
    last = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["mu_t"] == pytest.approx(0.2)


def test_the_fix_names_the_pipeline_settings_too(tmp_path, caplog):
    folder, labels = _folder(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert main(["train", str(folder), "--labels", str(labels), "--out", str(tmp_path / "run"), "--epochs", "2",
                     "--mu-ramp-epochs", "5", *BASE]) == 0
    assert "train.mu_ramp_epochs, train.epochs, train.fixed_mu" in caplog.text


@pytest.mark.parametrize("warmup, warned", [(3, True), (5, True), (2, False), (0, False)])
def test_warm_up_that_covers_every_epoch_is_warned_about(caplog, warmup, warned):
    """Review BR, A2: warmup_epochs >= epochs trained every epoch as warm-up (no pseudo label, no Sinkhorn) without
    a word; the only warning was the μ schedule's, whose fix would change nothing. Now the warm-up is named
    instead."""
    from wsi_milssl.config import TrainConfig
    from wsi_milssl.mil.selftrain import _warn_mu_not_reached

    with caplog.at_level(logging.WARNING):
        _warn_mu_not_reached(TrainConfig(mode="features", epochs=3, mu_ramp_epochs=5, warmup_epochs=warmup))
    assert ("MIL-SSL never runs" in caplog.text) == warned
    assert ("never reaches" in caplog.text) == (not warned)
