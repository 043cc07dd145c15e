"""Review BN, B2: `evaluate` on the folder of a heatmap run killed midway scored the slides done so far and
exited 0 (a live run's folder is refused, a dead one's was not). The heatmap stage now marks its folder as an
unfinished run until its last slide is done, as tile and features do; evaluate refuses a folder whose stopped run
was to predict labelled slides that have no files, and the run made again clears the mark."""

from __future__ import annotations

import numpy as np
import pytest

from wsi_milssl.config import HeatmapConfig
from wsi_milssl.errors import EvaluationError
from wsi_milssl.evaluation import evaluate_predictions
from wsi_milssl.inference import make_heatmaps
from wsi_milssl.tiling.status import unfinished_runs

FAST = dict(thumbnail_px=128, batch_size=64, num_workers=0)


def test_a_stopped_heatmap_run_is_refused_by_evaluate_until_it_is_run_again(tmp_path, checkpoint_factory,
                                                                            slide_writer, monkeypatch):
    from wsi_milssl.inference import stage

    none = lambda xs, ys: np.zeros(xs.shape, bool)  # noqa: E731
    slides = [slide_writer(tmp_path / f"s{i}.tif", width=2048, height=2048, tissue_box=(256, 256, 1792, 1792),
                           tumour=none) for i in range(2)]
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\ns0,0\ns1,0\n")
    checkpoint, hm = checkpoint_factory(), tmp_path / "hm"
    real = stage.write_slide_outputs

    def stopped_at_the_second(pred, *args, **kwargs):
        if pred.stem == "s1":
            raise KeyboardInterrupt  # Ctrl-C (or a kill) while the second slide is written
        return real(pred, *args, **kwargs)

    monkeypatch.setattr(stage, "write_slide_outputs", stopped_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        make_heatmaps(slides, checkpoint, hm, HeatmapConfig(**FAST))
    monkeypatch.setattr(stage, "write_slide_outputs", real)
    assert (hm / "s0_probs.json").is_file() and not (hm / "s1_probs.json").exists()
    assert [r["slides"] for r in unfinished_runs(hm, "heatmap")] == [["s0", "s1"]]
    with pytest.raises(EvaluationError, match=r"a heatmap run into it stopped before it finished \(`.*`"
                                              r"( started [0-9: -]+)?\): 1 labelled slide\(s\) it was to predict have "
                                              r"no files yet \(s1\), so the metrics would count only the slides done"):
        evaluate_predictions(hm, labels_csv=labels, slides=tmp_path, out_dir=tmp_path / "ev")
    assert not (tmp_path / "ev" / "metrics.json").exists()

    make_heatmaps(slides, checkpoint, hm, HeatmapConfig(**FAST))  # finishes s1, keeps s0
    assert unfinished_runs(hm, "heatmap") == []
    metrics = evaluate_predictions(hm, labels_csv=labels, slides=tmp_path, out_dir=tmp_path / "ev").metrics
    assert metrics["n_slides"] == 2 and metrics["not_evaluated"] == []
