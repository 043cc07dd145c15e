"""``evaluate`` refuses a heatmap folder's slide that has no ``<stem>_probs.json``: the heatmap stage removes a
slide's sidecar before it rewrites the slide's files and writes it again after all of them, so a slide without
one is an interrupted run's (review finding: a heatmap run killed part-way through a slide left its earlier
run's ``_detections.csv`` and ``scores.csv`` row, and evaluate counted them as a finished slide's). Folders of
other tools (detection CSVs alone, no sidecar) are evaluated as before."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from wsi_milssl.config import EvaluateConfig, HeatmapConfig
from wsi_milssl.errors import EvaluationError
from wsi_milssl.evaluation import evaluate_predictions
from wsi_milssl.inference import make_heatmaps
from wsi_milssl.mil.checkpoint import save_checkpoint
from wsi_milssl.mil.data import NORMALISATION
from wsi_milssl.mil.models import create_model

FAST = dict(thumbnail_px=64, batch_size=64, num_workers=0, detection_threshold=0.0)


def _checkpoint(path: Path) -> Path:
    """A resnet18 checkpoint (fixed random weights) that tiles at 1 µm/px into 32-px patches."""
    torch.manual_seed(0)
    model = create_model("resnet18")
    tiling = {"target_mpp": 1.0, "patch_size_px": 32, "stride_px": 32, "entropy_threshold_bits": 3.0,
              "tissue_detector": "otsu", "min_tissue": 0.1, "mask_mpp": 8.0}
    config = {"mode": "images", "model": "resnet18", "bag_pooling": "max", "target_mpp": 1.0, "patch_size_px": 32,
              "entropy_threshold_bits": 3.0, "store_settings": tiling,
              "normalisation": {k: list(v) for k, v in NORMALISATION.items()}, "model_name": "resnet18",
              "model_kwargs": {}}
    return save_checkpoint({"model": model.state_dict(), "optimizer": {}, "epoch": 1, "step": 1, "pseudo_labels": {},
                            "rng": {}, "config": config, "model_name": "resnet18", "model_kwargs": {},
                            "bag_pooling": "max"}, path)


@pytest.fixture(scope="module")
def heatmap_run(synth_dir, tmp_path_factory) -> tuple[Path, Path]:
    """(folder of one finished heatmap run over both synth slides, its checkpoint)."""
    ckpt = _checkpoint(tmp_path_factory.mktemp("ckpt") / "best.pt")
    out = tmp_path_factory.mktemp("heatmaps")
    slides = sorted(synth_dir.glob("synth_*.tif"))
    assert make_heatmaps(slides, ckpt, out, HeatmapConfig(**FAST), annotations_dir=synth_dir).ok
    return out, ckpt


def _evaluate(pred_dir: Path, synth_dir: Path, out: Path):
    return evaluate_predictions(pred_dir, labels_csv=synth_dir / "labels.csv", out_dir=out, annotations_dir=synth_dir,
                                slides=synth_dir, config=EvaluateConfig())


def _killed_copy(heatmap_run, tmp_path: Path, stem: str = "synth_000") -> Path:
    """A copy of the run's folder as a heatmap run killed in ``stem``'s files leaves it: its sidecar removed
    (the stage's first step), every other file of the slide an earlier run's."""
    copy = tmp_path / "heatmaps"
    shutil.copytree(heatmap_run[0], copy)
    (copy / f"{stem}_probs.json").unlink()
    assert (copy / f"{stem}_detections.csv").is_file() and (copy / f"{stem}_probs.npy").is_file()
    return copy


def test_a_slide_without_its_sidecar_is_refused_naming_it_and_the_fix(synth_dir, heatmap_run, tmp_path):
    copy = _killed_copy(heatmap_run, tmp_path)
    with pytest.raises(EvaluationError) as exc:
        _evaluate(copy, synth_dir, tmp_path / "out")
    message = str(exc.value)
    assert f"{copy}: slides synth_000 have prediction files but no <stem>_probs.json" in message
    assert "Fix: run the heatmap stage again into this folder" in message
    assert not (tmp_path / "out" / "metrics.json").exists()


def test_the_sidecars_of_other_slides_mark_a_heatmap_folder_without_its_config(synth_dir, heatmap_run, tmp_path):
    copy = _killed_copy(heatmap_run, tmp_path)
    (copy / "heatmap_config.json").unlink()
    with pytest.raises(EvaluationError, match="slides synth_000 have prediction files but no <stem>_probs.json"):
        _evaluate(copy, synth_dir, tmp_path / "out")


def test_running_the_heatmap_stage_again_mends_the_folder(synth_dir, heatmap_run, tmp_path):
    """The fix the refusal names: the heatmap stage resumes, predicts the slide without a sidecar again (and
    only it), and the folder evaluates as the uninterrupted run's."""
    pred_dir, ckpt = heatmap_run
    copy = _killed_copy(heatmap_run, tmp_path)
    events = []
    run = make_heatmaps(sorted(synth_dir.glob("synth_*.tif")), ckpt, copy, HeatmapConfig(**FAST),
                        annotations_dir=synth_dir, progress=events.append)
    assert run.ok and {e.item for e in events if e.stage == "heatmap-patches" and e.item} == {"synth_000"}
    mended = _evaluate(copy, synth_dir, tmp_path / "mended")
    finished = _evaluate(pred_dir, synth_dir, tmp_path / "finished")
    assert mended.metrics["n_slides"] == 2
    assert {k: v for k, v in mended.metrics.items() if k != "config_hash"} == \
        {k: v for k, v in finished.metrics.items() if k != "config_hash"}


def test_detection_csvs_of_other_tools_need_no_sidecar(synth_dir, heatmap_run, tmp_path):
    """A folder with no wsi-milssl record (no heatmap_config.json, no sidecar): the detections are evaluated."""
    folder = tmp_path / "challenge"
    folder.mkdir()
    for path in heatmap_run[0].glob("*_detections.csv"):
        shutil.copy(path, folder / path.name.replace("_detections", ""))  # CAMELYON16 naming: Test_001.csv
    shutil.copy(heatmap_run[0] / "scores.csv", folder / "scores.csv")
    result = _evaluate(folder, synth_dir, tmp_path / "out")
    assert result.metrics["n_slides"] == 2 and result.metrics["froc"] is not None
