"""SlidePrediction.score of a slide without patches is None (no score, never a confident 0.0), as the heatmap
stage writes an empty slide and as bag_scores scores an empty bag (NaN); the pooling is still checked."""

from __future__ import annotations

import numpy as np
import pytest

from wsi_milssl.errors import ConfigError
from wsi_milssl.inference.predict import SlidePrediction


def _prediction(probs) -> SlidePrediction:
    probs = np.asarray(probs, dtype=np.float32)
    coords = np.stack([np.arange(len(probs)) * 256, np.zeros(len(probs))], axis=1).astype(np.int64)
    return SlidePrediction(stem="s", slide_path=None, source="test", coords_lv0=coords, outputs=probs,
                           origin_lv0=(0, 0), stride_lv0=256, patch_size_lv0=256, patch_size_px=256, target_mpp=0.5,
                           mpp=0.5, dimensions_lv0=(4096, 4096), grid_shape=(1, max(1, len(probs))), n_candidates=0)


@pytest.mark.parametrize("pooling", ["max", "mean"])
def test_a_slide_without_patches_has_no_score(pooling):
    assert _prediction([]).score(pooling) is None


def test_scores_of_slides_with_patches_and_the_pooling_check():
    pred = _prediction([0.1, 0.7, 0.4])
    assert pred.score("max") == pytest.approx(0.7)
    assert pred.score("mean") == pytest.approx(0.4)
    with pytest.raises(ConfigError, match="bag pooling"):
        _prediction([]).score("median")
