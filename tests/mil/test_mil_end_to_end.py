"""Slow: generated slides -> tile -> label -> MIL-SSL training -> instance AUC on held-out slides."""

from __future__ import annotations

import json

import pytest

from wsi_milssl.cli import main


@pytest.mark.slow
def test_demo_scale_training_reaches_instance_auc_on_held_out_slides(tmp_path):
    for name, n, seed in (("train", 8, 0), ("test", 4, 1)):
        assert main(["synth", str(tmp_path / f"{name}_slides"), "--slides", str(n), "--seed", str(seed)]) == 0
        assert main(["tile", str(tmp_path / f"{name}_slides"), "--out", str(tmp_path / f"{name}_stores"),
                     "--magnification", "10", "--patch-size", "64"]) == 0
        assert main(["label", str(tmp_path / f"{name}_stores"), "--annotations", str(tmp_path / f"{name}_slides"),
                     "--labels", str(tmp_path / f"{name}_slides" / "labels.csv"), "--no-masks"]) == 0
    run = tmp_path / "run"
    # the held-out slides are only measured (last epoch), never used to pick a checkpoint
    assert main(["train", str(tmp_path / "train_stores"), "--labels", str(tmp_path / "train_slides" / "labels.csv"),
                 "--out", str(run), "--val", str(tmp_path / "test_stores"),
                 "--val-labels", str(tmp_path / "test_slides" / "labels.csv"), "--epochs", "6",
                 "--mu-ramp-epochs", "5"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["val_instance_auc"] >= 0.9
    assert records[-1]["pseudo_precision"] > 0.5
