"""Each slide's ``_probs.json`` records the run that made it (``fingerprint``, and the checkpoint's bytes as
``checkpoint_sha256`` beside the settings that shape the files), and ``evaluate`` takes slides of one model
and detection settings as one run: a partial re-run that changes only drawing settings (colour map,
thumbnail size, title, outlines) or gives the slide's own µm/px is one run (review finding F4: it was
refused, described twice alike but for the fingerprint); one with other detection settings or another
checkpoint at the same path is refused, naming what differs."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from wsi_milssl.config import EvaluateConfig, HeatmapConfig
from wsi_milssl.errors import EvaluationError
from wsi_milssl.evaluation import evaluate_predictions
from wsi_milssl.inference import make_heatmaps
from wsi_milssl.inference import stage as heatmap_stage

FAST = dict(thumbnail_px=128, batch_size=32, num_workers=0)


@pytest.fixture(scope="module")
def two_slides(tmp_path_factory, slide_writer) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("two")
    a = slide_writer(folder / "a.tif", width=2048, height=2048, tissue_box=(256, 256, 1792, 1792),
                     tumour=lambda xs, ys: (xs // 300 + ys // 300) % 4 == 0)
    b = slide_writer(folder / "b.tif", width=2048, height=2048, tissue_box=(0, 512, 2048, 1536),
                     tumour=lambda xs, ys: (xs // 300 + ys // 300 + 1) % 4 == 0)
    return a, b


def _evaluate(folder: Path, tmp_path: Path, name: str):
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\na,0\nb,0\n")  # normal slides: no annotation needed
    return evaluate_predictions(folder, labels_csv=labels, out_dir=tmp_path / name, config=EvaluateConfig())


def _sidecar(folder: Path, stem: str) -> dict:
    return json.loads((folder / f"{stem}_probs.json").read_text())


def test_a_partial_rerun_with_other_drawing_settings_is_one_run(tmp_path, two_slides, checkpoint_factory):
    a, b = two_slides
    checkpoint = checkpoint_factory()
    out = tmp_path / "hm"
    assert make_heatmaps([a], checkpoint, out, HeatmapConfig(**FAST)).ok
    drawing = HeatmapConfig(**{**FAST, "thumbnail_px": 96, "colormap": "magma", "title": False,
                               "annotation_color": "#ff0000", "tumor_groups": ("Metastasis",)})
    assert make_heatmaps([b], checkpoint, out, drawing).ok
    result = _evaluate(out, tmp_path, "eval")
    assert result.metrics["n_slides"] == 2
    report = (tmp_path / "eval" / "report.html").read_text()
    assert "describes a later heatmap run" not in report
    first, second = _sidecar(out, "a"), _sidecar(out, "b")
    assert first["fingerprint"] != second["fingerprint"]  # resuming still tells the two runs apart
    assert first["checkpoint_sha256"] == second["checkpoint_sha256"] == \
        hashlib.sha256(checkpoint.read_bytes()).hexdigest()
    assert first["tiling_plan"] == second["tiling_plan"] and first["tiling_plan"]["patch_size_px"] == 32
    config = json.loads((out / "heatmap_config.json").read_text())
    assert config["checkpoint_sha256"] == first["checkpoint_sha256"]
    # the report does not show the last partial run's heatmap_config.json as every slide's configuration
    assert "is not shown as the configuration of all of them" in report


def test_a_partial_rerun_with_another_slide_mpp_is_refused(tmp_path, two_slides, checkpoint_factory):
    """A --slide-mpp given to one partial run cuts its slides at another magnification (review: a wrong
    0.5 for a 0.25 µm/px slide gave 475 patches instead of 124, and evaluate mixed it in silently)."""
    a, b = two_slides
    checkpoint = checkpoint_factory()
    out = tmp_path / "hm"
    assert make_heatmaps([a], checkpoint, out, HeatmapConfig(**FAST)).ok
    assert make_heatmaps([b], checkpoint, out, HeatmapConfig(**{**FAST, "slide_mpp": 0.5})).ok
    with pytest.raises(EvaluationError, match=r"cut at µm/px given in different ways \(slides a with --slide-mpp "
                                              r"none \(the slide's own\); slides b with --slide-mpp 0.5\)"):
        _evaluate(out, tmp_path, "eval")


def test_the_slides_own_slide_mpp_and_stores_are_one_run(tmp_path, two_slides, checkpoint_factory):
    """--slide-mpp equal to the slide's own changes nothing, and a store brings its own µm/px; sidecars of
    the previous version (no slide_mpp key) match any value (review)."""
    a, b = two_slides
    checkpoint = checkpoint_factory()
    out = tmp_path / "hm"
    assert make_heatmaps([a], checkpoint, out, HeatmapConfig(**FAST)).ok
    assert make_heatmaps([b], checkpoint, out, HeatmapConfig(**{**FAST, "slide_mpp": 0.25})).ok
    assert _sidecar(out, "b")["slide_mpp"] is None  # the slides' own µm/px
    assert _evaluate(out, tmp_path, "eval").metrics["n_slides"] == 2
    # a sidecar without the key (written by the previous version) against one cut at another µm/px
    assert make_heatmaps([b], checkpoint, out, HeatmapConfig(**{**FAST, "slide_mpp": 0.5}), overwrite=True).ok
    first = out / "a_probs.json"
    sidecar = json.loads(first.read_text())
    del sidecar["slide_mpp"]
    first.write_text(json.dumps(sidecar))
    assert _evaluate(out, tmp_path, "eval2").metrics["n_slides"] == 2


def test_a_partial_rerun_with_other_detection_settings_is_refused_naming_them(tmp_path, two_slides,
                                                                            checkpoint_factory):
    a, b = two_slides
    checkpoint = checkpoint_factory()
    out = tmp_path / "hm"
    assert make_heatmaps([a], checkpoint, out, HeatmapConfig(**FAST)).ok
    assert make_heatmaps([b], checkpoint, out, HeatmapConfig(**FAST, nms_radius_um=50.0, min_tissue=0.5)).ok
    with pytest.raises(EvaluationError) as exc:
        _evaluate(out, tmp_path, "eval")
    message = str(exc.value)
    assert "its slides were predicted by 2 different heatmap runs" in message
    assert "What differs: slides b against slides a: nms_radius_um 50 vs 1000, tiling min_tissue 0.5 vs 0.1." \
        in message
    assert "checkpoint file contents" not in message


def test_a_checkpoint_retrained_at_the_same_path_is_named_as_the_difference(tmp_path, two_slides,
                                                                           checkpoint_writer):
    a, b = two_slides
    checkpoint = tmp_path / "run" / "best.pt"
    checkpoint_writer(checkpoint)
    out = tmp_path / "hm"
    assert make_heatmaps([a], checkpoint, out, HeatmapConfig(**FAST)).ok
    checkpoint_writer(checkpoint, model_kwargs={"gain": 20.0})  # retrained into the same --out
    assert make_heatmaps([b], checkpoint, out, HeatmapConfig(**FAST)).ok
    with pytest.raises(EvaluationError) as exc:
        _evaluate(out, tmp_path, "eval")
    message = str(exc.value)
    sha_a, sha_b = _sidecar(out, "a")["checkpoint_sha256"], _sidecar(out, "b")["checkpoint_sha256"]
    assert f"slides b against slides a: checkpoint file contents differ (SHA-256 {sha_b[:12]} vs {sha_a[:12]})" \
        in message


def test_a_resumed_run_and_a_copy_of_its_checkpoint_are_one_run(tmp_path, two_slides, checkpoint_factory):
    """The same weights by another path (a copied run folder), with other runtime settings, resuming."""
    a, b = two_slides
    checkpoint = checkpoint_factory()
    out = tmp_path / "hm"
    assert make_heatmaps([a], checkpoint, out, HeatmapConfig(**FAST)).ok
    copy = tmp_path / "copied" / "best.pt"
    copy.parent.mkdir()
    shutil.copy(checkpoint, copy)
    run = make_heatmaps([a, b], copy, out, HeatmapConfig(**{**FAST, "batch_size": 16}))
    assert run.ok
    assert _sidecar(out, "a")["checkpoint"] == str(checkpoint)  # a was kept: same fingerprint
    assert _sidecar(out, "b")["checkpoint"] == str(copy)
    assert _evaluate(out, tmp_path, "eval").metrics["n_slides"] == 2


def test_a_half_written_slide_has_no_sidecar(tmp_path, two_slides, checkpoint_factory, monkeypatch):
    """While a slide's files are written there is no sidecar (not even one without the run's identity,
    which evaluating that slide alone would take for an earlier version's finished slide); it comes last."""
    a, _ = two_slides
    out = tmp_path / "hm"
    checkpoint = checkpoint_factory()
    assert make_heatmaps([a], checkpoint, out, HeatmapConfig(**FAST)).ok  # an earlier run's files
    seen: list[bool] = []
    original = heatmap_stage.write_patches_csv

    def spy(path, *args, **kwargs):
        seen.append((Path(path).parent / "a_probs.json").exists())
        return original(path, *args, **kwargs)

    monkeypatch.setattr(heatmap_stage, "write_patches_csv", spy)
    assert make_heatmaps([a], checkpoint, out, HeatmapConfig(**{**FAST, "batch_size": 16}), overwrite=True).ok
    assert seen == [False]
    assert _sidecar(out, "a")["fingerprint"] and _sidecar(out, "a")["checkpoint_sha256"]
