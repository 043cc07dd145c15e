"""Fixtures of the evaluation tests: the tumour slide's annotation (written by the test, with known
lesions), prediction folders in the heatmap stage's format and one shared evaluation run (see
evaluation_fixtures.py for how the annotation and the predictions are made)."""

from __future__ import annotations

from pathlib import Path

import pytest

from evaluation_fixtures import KnownAnnotation, write_known_annotation, write_predictions


@pytest.fixture(scope="session")
def known_annotation(synth_dir, tmp_path_factory) -> KnownAnnotation:
    """The tumour slide's ASAP XML with one lesion and one ITC disc at known places."""
    return write_known_annotation(synth_dir, tmp_path_factory.mktemp("annotations"))


@pytest.fixture(scope="session")
def annotations_dir(known_annotation) -> Path:
    """The folder holding only the tumour slide's known annotation (the generator's XML is not used)."""
    return known_annotation.path.parent


@pytest.fixture(scope="session")
def predictions(synth_dir, known_annotation, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("predictions")
    return out, write_predictions(synth_dir, known_annotation, out)


@pytest.fixture(scope="session")
def evaluated(synth_dir, annotations_dir, predictions, tmp_path_factory):
    """One full evaluation run of the heatmap-style folder (shared by the stage and report tests)."""
    from wsi_milssl.evaluation import evaluate_predictions

    pred_dir, info = predictions
    out = tmp_path_factory.mktemp("evaluation")
    result = evaluate_predictions(pred_dir, labels_csv=synth_dir / "labels.csv", out_dir=out,
                                  annotations_dir=annotations_dir, slides=synth_dir)
    return result, out, info
