"""evaluate's instance labels are label's rule (labeling.patch_labels), also at the threshold itself: a patch
whose float32 tumour fraction equals positive_fraction, or equals its float32 rounding, is positive in both."""

from __future__ import annotations

import numpy as np
import pytest

from wsi_milssl.annotations import read_annotations
from wsi_milssl.config import EvaluateConfig
from wsi_milssl.evaluation import evaluate_predictions
from wsi_milssl.evaluation.inputs import read_patch_probs
from wsi_milssl.labeling import patch_labels

from evaluation_fixtures import PATCH_LV0


@pytest.mark.parametrize("above", [False, True], ids=["exactly-the-fraction", "rounds-to-the-fraction-in-float32"])
def test_evaluate_and_label_agree_at_the_threshold(synth_dir, annotations_dir, known_annotation, predictions,
                                                   tmp_path, above):
    pred_dir, info = predictions
    coords, _ = read_patch_probs(pred_dir / f"{info['tumor']}_patches.csv")
    region = read_annotations(known_annotation.path).region
    fraction, _ = patch_labels(region, coords, PATCH_LV0)
    partial = np.unique(fraction[(fraction > 0.3) & (fraction < 0.9)])
    f = partial[len(partial) // 2]  # a float32 fraction of a patch on a lesion's border
    # float64: f itself, or a value a quarter float32 step above f that float32 rounds down to f
    threshold = np.float64(f) + (np.float64(np.spacing(f)) / 4 if above else 0.0)
    assert np.float32(threshold) == f
    expected = patch_labels(region, coords, PATCH_LV0, positive_fraction=threshold)[1]
    assert expected[fraction == f].all() and 0 < expected.sum() < len(expected)

    result = evaluate_predictions(pred_dir, labels_csv=synth_dir / "labels.csv", out_dir=tmp_path / "out",
                                  annotations_dir=annotations_dir, slides=synth_dir,
                                  config=EvaluateConfig(positive_fraction=threshold))
    tumour = next(s for s in result.slides if s.stem == info["tumor"])
    assert tumour.instance_labels.dtype == np.uint8
    np.testing.assert_array_equal(tumour.instance_labels, expected)
