"""Review BB, A1: feature mode's test evaluation left out a labelled test slide whose feature file has no row
(TRIDENT writes one for a slide without patches), with a warning that spoke of the training set: a missed tumour
slide vanished from the bag metrics (AUC 1.000 on 3 bags where image mode, scoring the slide 0, gives 0.5 on 4).
Such a slide is now a bag with score 0, named in metrics.json's ``empty_bags``."""

from __future__ import annotations

import csv
import json
import logging

import h5py
import numpy as np
import pytest

from tinypipeline import feature_bags
from wsi_milssl.config import TrainConfig
from wsi_milssl.evaluation.bags import evaluate_feature_bags
from wsi_milssl.mil import fit, read_feature_files, read_labels_csv


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    root = tmp_path_factory.mktemp("head")
    feature_bags(root / "train", 8, seed=0)
    train = read_feature_files(sorted((root / "train").glob("*.h5")), read_labels_csv(root / "train" / "labels.csv"))
    fit(train, config=TrainConfig(mode="features", model="linear", epochs=3, threads=1, plots=False),
        out_dir=root / "model")
    return root / "model" / "last.pt"


def test_a_test_slide_without_feature_rows_counts_as_a_bag_scored_0(tmp_path, head, caplog):
    test = tmp_path / "test"
    feature_bags(test, 4, seed=1)
    with h5py.File(test / "bag_04.h5", "w") as fh:  # a tumour slide without patches
        fh["features"] = np.zeros((0, 8), np.float32)
    (test / "labels.csv").write_text((test / "labels.csv").read_text() + "bag_04,1\n")
    with caplog.at_level(logging.WARNING):
        summary = evaluate_feature_bags(head, sorted(test.glob("*.h5")), test / "labels.csv", tmp_path / "ev")
    assert summary["n_bags"] == 5 and summary["empty_bags"] == ["bag_04"] and summary["not_evaluated"] == []
    assert json.loads((tmp_path / "ev" / "metrics.json").read_text()) == summary
    with open(tmp_path / "ev" / "scores.csv", newline="") as fh:
        rows = {r["slide"]: r for r in csv.DictReader(fh)}
    assert rows["bag_04"] == {"slide": "bag_04", "score": "0.000000", "label": "1"} and len(rows) == 5
    scores = np.array([float(r["score"]) for r in rows.values()])
    labels = np.array([int(r["label"]) for r in rows.values()])
    assert summary["bag_accuracy"] == pytest.approx(np.mean((scores > summary["bag_accuracy_threshold"]) == (labels == 1)))
    # review BS: a null instance AUC says why (feature_bags writes no instance labels)
    assert summary["instance_auc"] is None and "no instance labels" in summary["reasons"]["instance_auc"]
    assert "1 test slide(s) have feature files without a row (no patches): bag_04" in caplog.text
    assert "training set" not in caplog.text


def test_a_labelled_test_slide_without_a_feature_file_is_named_not_evaluated(tmp_path, head, caplog):
    """A lost test feature file only shrank n_bags (the pipeline said "on 5 test bags" of 6 labelled): it is named
    in metrics.json's not_evaluated, as image mode names labelled slides without predictions."""
    test = tmp_path / "test"
    feature_bags(test, 6, seed=1)
    (test / "bag_05.h5").unlink()
    with caplog.at_level(logging.INFO, logger="wsi_milssl.evaluation.bags"):
        summary = evaluate_feature_bags(head, sorted(test.glob("*.h5")), test / "labels.csv", tmp_path / "ev")
    assert summary["n_bags"] == 5 and summary["not_evaluated"] == ["bag_05"] and summary["empty_bags"] == []
    assert json.loads((tmp_path / "ev" / "metrics.json").read_text())["not_evaluated"] == ["bag_05"]
    assert "1 labelled slide(s) have no bag in the test feature files and are not evaluated" in caplog.text


def test_a_linear_head_saved_with_a_no_op_dropout_by_an_earlier_version_still_evaluates(tmp_path, head):
    """Review CX's refusal of hidden_dims/dropout for linear and resnet18 is for new settings: a checkpoint whose
    config recorded them (an earlier version accepted them, and they changed nothing) still evaluates."""
    import torch

    ckpt = torch.load(head, weights_only=True)
    ckpt["config"] = {**ckpt["config"], "dropout": 0.2, "hidden_dims": [64]}
    old = tmp_path / "old.pt"
    torch.save(ckpt, old)
    test = tmp_path / "test"
    feature_bags(test, 4, seed=1)
    summary = evaluate_feature_bags(old, sorted(test.glob("*.h5")), test / "labels.csv", tmp_path / "ev")
    assert summary["n_bags"] == 4


def test_a_null_bag_auc_says_why_as_in_image_mode(tmp_path, head):
    """Review DX, C2: test bags of one class gave bag_auc null with no reason (image mode says "all N slides are
    positive; AUC needs both classes")."""
    test = tmp_path / "test"
    feature_bags(test, 4, seed=1)
    rows = (test / "labels.csv").read_text().splitlines()
    (test / "labels.csv").write_text("\n".join([rows[0], *(r.rsplit(",", 1)[0] + ",1" for r in rows[1:])]) + "\n")
    summary = evaluate_feature_bags(head, sorted(test.glob("*.h5")), test / "labels.csv", tmp_path / "ev")
    assert summary["bag_auc"] is None
    assert summary["reasons"]["bag_auc"] == "all 4 bags are positive; AUC needs both classes"
    assert summary["bag_accuracy"] is not None


def test_a_run_stopped_before_its_scores_leaves_no_metrics_of_an_earlier_run(tmp_path, head, monkeypatch):
    """Review EV, C5: feature mode wrote metrics.json, then scores.csv, over an earlier pair: a stop between the two
    left this run's metrics beside the earlier scores. An earlier metrics.json goes first now, and is written last."""
    import wsi_milssl.evaluation.bags as bags

    test = tmp_path / "test"
    feature_bags(test, 4, seed=1)
    evaluate_feature_bags(head, sorted(test.glob("*.h5")), test / "labels.csv", tmp_path / "ev")
    assert (tmp_path / "ev" / "metrics.json").is_file()

    def stopped(path, *args, **kwargs):
        raise KeyboardInterrupt  # the run stopped while it wrote scores.csv

    monkeypatch.setattr(bags, "atomic_open", stopped)
    with pytest.raises(KeyboardInterrupt):
        evaluate_feature_bags(head, sorted(test.glob("*.h5")), test / "labels.csv", tmp_path / "ev")
    assert not (tmp_path / "ev" / "metrics.json").exists()
