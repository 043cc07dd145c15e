"""Fixtures of the evaluation tests: prediction folders in the heatmap stage's format and one
shared evaluation run (see evaluation_fixtures.py for how the predictions are made)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from evaluation_fixtures import write_predictions


@pytest.fixture(scope="session")
def annotations_dir(synth_dir, tmp_path_factory) -> Path:
    """Only the annotation files of the generated slides."""
    out = tmp_path_factory.mktemp("annotations")
    for p in synth_dir.glob("*.xml"):
        shutil.copy(p, out / p.name)
    return out


@pytest.fixture(scope="session")
def predictions(synth_dir, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("predictions")
    return out, write_predictions(synth_dir, out)


@pytest.fixture(scope="session")
def evaluated(synth_dir, annotations_dir, predictions, tmp_path_factory):
    """One full evaluation run of the heatmap-style folder (shared by the stage and report tests)."""
    from wsi_milssl.evaluation import evaluate_predictions

    pred_dir, info = predictions
    out = tmp_path_factory.mktemp("evaluation")
    result = evaluate_predictions(pred_dir, labels_csv=synth_dir / "labels.csv", out_dir=out,
                                  annotations_dir=annotations_dir, slides=synth_dir)
    return result, out, info
