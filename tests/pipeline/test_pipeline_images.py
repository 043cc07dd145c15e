"""The image pipeline end to end (what ``wsi-milssl demo`` runs, at a tiny scale): synth -> tile ->
label -> train -> heatmap -> evaluate, ending in a report whose images load in headless Chromium."""

from __future__ import annotations

import importlib.util
import json
from importlib.resources import files
from pathlib import Path

from tinypipeline import GENERATED_SLIDES
from wsi_milssl.config import load_toml
from wsi_milssl.pipeline import load_pipeline, run_pipeline

HERE = Path(__file__).resolve().parent


def _browser_check():
    path = HERE.parent / "evaluation" / "test_evaluation_report.py"
    spec = importlib.util.spec_from_file_location("_report_browser", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.images_in_browser


TINY = """
[pipeline]
name = "tiny"
""" + GENERATED_SLIDES + """[train]
mode = "images"
model = "resnet18"
epochs = 2
batch_size = 32
mu = 0.2
mu_ramp_epochs = 1
num_workers = 0
[heatmap]
num_workers = 0
thumbnail_px = 256
[evaluate]
thumbnail_px = 128
"""


def test_tiny_image_pipeline_ends_in_a_report_that_renders(tmp_path, monkeypatch):
    toml = tmp_path / "tiny.toml"
    toml.write_text(TINY)
    monkeypatch.chdir(tmp_path)  # a relative output folder: the run's config.json must still hold absolute paths
    spec = load_pipeline(toml, out_dir=Path("out"))
    outcomes = run_pipeline(spec)
    assert [(o.stage, o.status) for o in outcomes] == [
        (s, "ran") for s in ("synth", "tile", "label", "train", "heatmap", "evaluate")
    ]
    out = tmp_path / "out"
    metrics = json.loads((out / "evaluation" / "metrics.json").read_text())
    for key in ("instance_auc", "bag_auc", "froc", "froc_sensitivities", "n_slides", "n_lesions"):
        assert key in metrics
    assert metrics["n_slides"] == 2 and len(metrics["froc_sensitivities"]) == 6
    # the stage's line names the FROC's protocol, as metrics.json and the report do (review AP, finding 9)
    assert outcomes[-1].summary.endswith("(75 µm margin, 275 µm ITC limit, each slide's µm/px)"), outcomes[-1].summary
    assert (out / "model" / "last.pt").exists() and (out / "heatmaps" / "test" / "scores.csv").exists()
    data = json.loads((out / "model" / "config.json").read_text())["data"]
    recorded = data["inputs"] + (data["val_inputs"] or []) + [data["labels"]]
    assert all(Path(p).is_absolute() and Path(p).exists() for p in recorded), recorded
    loaded, total, broken = _browser_check()(out / "evaluation" / "report.html", tmp_path)
    assert total >= 4 and loaded == total, broken
    assert [o.status for o in run_pipeline(spec)] == ["skipped"] * 6


def test_demo_pipeline_covers_every_stage():
    demo = load_toml(files("wsi_milssl") / "pipelines" / "demo.toml")
    assert {"synth", "tile", "label", "train", "heatmap", "evaluate"} <= set(demo)
