"""When ``evaluate`` refuses a heatmap folder whose slides must be predicted again, its Fix names both ways to do
that: the ``heatmap`` command's ``--overwrite`` and, in a pipeline, ``run PIPELINE --force heatmap`` (review AS,
finding 11: it named only ``--overwrite``, an option ``wsi-milssl run`` does not have)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from wsi_milssl.config import EvaluateConfig
from wsi_milssl.errors import EvaluationError
from wsi_milssl.evaluation import evaluate_predictions

BOTH = "`wsi-milssl heatmap ... --overwrite` (in a pipeline: `wsi-milssl run PIPELINE --force heatmap`)."


def _refusal(pred_dir: Path, synth_dir: Path, annotations_dir: Path, out: Path, **config) -> str:
    with pytest.raises(EvaluationError) as exc:
        evaluate_predictions(pred_dir, labels_csv=synth_dir / "labels.csv", out_dir=out,
                             annotations_dir=annotations_dir, slides=synth_dir, config=EvaluateConfig(**config))
    assert not (out / "metrics.json").exists()
    return str(exc.value)


def _with_sidecars(predictions, tmp_path: Path, **per_slide: dict) -> Path:
    """A copy of the heatmap folder whose two sidecars record one heatmap run, with ``per_slide`` changes
    ({"tumor" | "normal": {key: value}})."""
    pred_dir, info = predictions
    copy = tmp_path / "preds"
    shutil.copytree(pred_dir, copy)
    run = {"checkpoint": "/runs/a/best.pt", "fingerprint": "aaaaaaaaaaaaaaaa", "model_name": "resnet18",
           "bag_pooling": "max", "detection_threshold": 0.5, "nms_radius_um": 100.0, "tumor_threshold": 0.5}
    for which in ("tumor", "normal"):
        path = copy / f"{info[which]}_probs.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **run, **per_slide.get(which, {})}))
    return copy


def test_slides_of_two_heatmap_runs(synth_dir, annotations_dir, predictions, tmp_path):
    copy = _with_sidecars(predictions, tmp_path, normal={"fingerprint": "bbbbbbbbbbbbbbbb"})
    message = _refusal(copy, synth_dir, annotations_dir, tmp_path / "out")
    assert "its slides were predicted by 2 different heatmap runs" in message
    assert message.endswith("Fix: run the heatmap stage again with --overwrite on the whole set of slides into this "
                            f"folder (or into a new one), then evaluate: {BOTH}"), message


def test_slides_cut_with_different_slide_mpp(synth_dir, annotations_dir, predictions, tmp_path):
    copy = _with_sidecars(predictions, tmp_path, tumor={"slide_mpp": None}, normal={"slide_mpp": 0.25})
    message = _refusal(copy, synth_dir, annotations_dir, tmp_path / "out")
    assert "its slides were cut at µm/px given in different ways" in message
    assert message.endswith(f"with one --slide-mpp (or none), then evaluate: {BOTH}"), message


def test_a_slide_mpp_other_than_the_heatmaps(synth_dir, annotations_dir, predictions, tmp_path):
    copy = _with_sidecars(predictions, tmp_path)
    message = _refusal(copy, synth_dir, annotations_dir, tmp_path / "out", mpp=3.0)
    assert "--slide-mpp 3 (in a pipeline, [evaluate] mpp) is not the µm/px the heatmaps" in message
    assert message.endswith("or run the heatmap stage again with --slide-mpp 3 --overwrite. In a pipeline, whose "
                            "heatmaps take the stores' µm/px: drop [evaluate] mpp, or set [tile] slide_mpp = 3 (which "
                            "tiles and predicts again)."), message
