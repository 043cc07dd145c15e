"""``evaluate`` groups slides by the run that made them: two slides are of one run when their sidecars share
a ``fingerprint``, or the same ``checkpoint_sha256`` (the checkpoint's bytes) with the same settings that
shape the evaluated files; runs linked through a slide are one. A refusal names what differs between the
runs (review findings F1, F2, F4)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from wsi_milssl.config import EvaluateConfig
from wsi_milssl.errors import EvaluationError
from wsi_milssl.evaluation import evaluate_predictions
from wsi_milssl.evaluation.stage import _one_run

SHA_A = "a" * 64
SHA_B = "b" * 64
RUN = {"checkpoint": "/runs/a/best.pt", "model_name": "resnet18", "bag_pooling": "max", "detection_threshold": 0.5,
       "nms_radius_um": 100.0, "tumor_threshold": 0.5, "target_mpp": 0.5, "patch_size_px": 256,
       "tiling_plan": {"target_mpp": 0.5, "patch_size_px": 256, "stride_px": 256, "min_tissue": 0.1}}


def _evaluate(pred_dir: Path, synth_dir: Path, annotations_dir: Path, out: Path):
    return evaluate_predictions(pred_dir, labels_csv=synth_dir / "labels.csv", out_dir=out,
                                annotations_dir=annotations_dir, slides=synth_dir, config=EvaluateConfig())


def _folder(predictions, tmp_path: Path, tumor: dict, normal: dict) -> Path:
    """A copy of the prediction folder whose two sidecars record RUN with ``tumor`` / ``normal`` changes
    (None removes a key)."""
    pred_dir, info = predictions
    copy = tmp_path / "preds"
    shutil.copytree(pred_dir, copy)
    for which, change in (("tumor", tumor), ("normal", normal)):
        path = copy / f"{info[which]}_probs.json"
        data = {**json.loads(path.read_text()), **RUN, **change}
        path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    return copy


def test_one_run_by_two_paths_and_other_drawing_settings(synth_dir, annotations_dir, predictions, tmp_path):
    """The same checkpoint bytes and detection settings: other fingerprints (a re-run with another colour map)
    and another path to the checkpoint are one run."""
    copy = _folder(predictions, tmp_path, {"fingerprint": "1111111111111111", "checkpoint_sha256": SHA_A},
                   {"fingerprint": "2222222222222222", "checkpoint_sha256": SHA_A, "checkpoint": "run/best.pt",
                    "mpp": 0.2431, "stride_lv0": 999})  # per-slide facts are not compared
    result = _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out")
    assert result.metrics["froc"] == pytest.approx(5 / 6)


@pytest.mark.parametrize("normal, differs", [  # normal: the changes of the second run
    ({"checkpoint_sha256": SHA_B}, f"checkpoint file contents differ (SHA-256 {SHA_B[:12]} vs {SHA_A[:12]})"),
    ({"nms_radius_um": 1000.0}, "nms_radius_um 1000 vs 100"),
    ({"target_mpp": 0.25, "patch_size_px": 512}, "target_mpp 0.25 vs 0.5, patch_size_px 512 vs 256"),
    ({"tiling_plan": {**RUN["tiling_plan"], "min_tissue": 0.5}}, "tiling min_tissue 0.5 vs 0.1"),
])
def test_other_weights_or_settings_are_refused_naming_them(synth_dir, annotations_dir, predictions, tmp_path,
                                                           normal, differs):
    _, info = predictions
    base, other = sorted([info["tumor"], info["normal"]])  # runs of one slide each: named in name order
    changes = {"fingerprint": "2222222222222222", "checkpoint_sha256": SHA_A, **normal}
    unchanged = {"fingerprint": "1111111111111111", "checkpoint_sha256": SHA_A}
    copy = _folder(predictions, tmp_path, changes if other == info["tumor"] else unchanged,
                   changes if other == info["normal"] else unchanged)
    with pytest.raises(EvaluationError) as exc:
        _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out")
    message = str(exc.value)
    assert "its slides were predicted by 2 different heatmap runs" in message
    assert f"What differs: slides {other} against slides {base}: {differs}." in message
    assert "Fix: run the heatmap stage again with --overwrite" in message


def test_a_feature_head_retrained_at_the_same_path_is_refused(synth_dir, annotations_dir, predictions, tmp_path):
    copy = _folder(predictions, tmp_path,
                   {"fingerprint": "1111111111111111", "checkpoint_sha256": SHA_A, "source": "features",
                    "tiling_plan": None},
                   {"fingerprint": "2222222222222222", "checkpoint_sha256": SHA_B, "source": "features",
                    "tiling_plan": None})
    with pytest.raises(EvaluationError, match="checkpoint file contents differ"):
        _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out")


def test_slides_linked_through_another_are_one_run():
    """An earlier version's slide (fingerprint only), one of the same run resumed now (the fingerprint and the
    checkpoint's bytes) and one re-run with another colour map (another fingerprint, the same bytes)."""
    sidecars = {
        "old": {**RUN, "fingerprint": "1111111111111111"},
        "resumed": {**RUN, "fingerprint": "1111111111111111", "checkpoint_sha256": SHA_A},
        "redrawn": {**RUN, "fingerprint": "2222222222222222", "checkpoint_sha256": SHA_A},
    }
    assert _one_run(Path("hm"), sidecars) is sidecars["old"]
    with pytest.raises(EvaluationError) as exc:  # without the middle slide, nothing links the other two
        _one_run(Path("hm"), {k: v for k, v in sidecars.items() if k != "resumed"})
    assert ("What differs: slides redrawn against slides old: slides old record no checkpoint_sha256 (made by an "
            "earlier version, or left half-written by an interrupted run), so their checkpoint file contents "
            "cannot be compared.") in str(exc.value)


def test_sidecars_of_earlier_versions_keep_their_comparison():
    """Without checkpoint_sha256: the fingerprint, else the checkpoint path and settings."""
    old = {k: v for k, v in RUN.items() if k != "tiling_plan"}
    same = {"a": dict(old), "b": dict(old)}
    assert _one_run(Path("hm"), same) is same["a"]  # feature heads of earlier versions: no fingerprint
    with pytest.raises(EvaluationError) as exc:
        _one_run(Path("hm"), {"a": {**old, "fingerprint": "1111111111111111"},
                              "b": {**old, "fingerprint": "2222222222222222"}})
    assert ("What differs: slides b against slides a: fingerprint 2222222222222222 vs 1111111111111111 (the "
            "checkpoint's bytes or another heatmap setting") in str(exc.value)
    with pytest.raises(EvaluationError) as exc:
        _one_run(Path("hm"), {"a": old, "b": {**old, "checkpoint": "/runs/b/best.pt"}})
    assert "What differs: slides b against slides a: checkpoint /runs/b/best.pt vs /runs/a/best.pt." in str(exc.value)
    # a feature slide of an earlier version beside one of this version: the bytes of the first are unknown
    with pytest.raises(EvaluationError, match="slides a record no checkpoint_sha256"):
        _one_run(Path("hm"), {"a": old, "b": {**old, "fingerprint": "2222222222222222", "checkpoint_sha256": SHA_A}})
    assert _one_run(Path("hm"), {}) is None  # detection CSVs of other tools


def test_a_slide_file_other_than_the_one_predicted_is_refused(synth_dir, annotations_dir, predictions, tmp_path):
    """Review CN: `evaluate --slides` of another set whose slides have the same names (synth names every set
    synth_000...), or a slide replaced since its heatmap, was scored against these predictions without a word.
    A copy of the same file (another modification time) is the same slide."""
    import os

    _, info = predictions
    slide = synth_dir / f"{info['tumor']}.tif"
    size = slide.stat().st_size
    recorded = {"path": "/elsewhere/" + slide.name, "size_bytes": size, "mtime_ns": 1}  # copied: another time
    copy = _folder(predictions, tmp_path, {"input_files": {"slide": recorded, "store": None}}, {})
    assert _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out").metrics["froc"] == pytest.approx(5 / 6)
    other = {**recorded, "size_bytes": size + 1234}
    shutil.rmtree(copy)
    copy = _folder(predictions, tmp_path, {"input_files": {"slide": other, "store": None}}, {})
    with pytest.raises(EvaluationError) as err:
        _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out2")
    assert (f"{copy}: 1 slide file(s) are not the ones their heatmaps were predicted from: {info['tumor']} (predicted "
            f"from a {size + 1234:,}-byte {slide.name}, evaluated with {slide}, {size:,} bytes)") in str(err.value)
    assert "Fix: pass the slides, annotations and labels of the predicted set" in str(err.value)
    assert not os.path.exists(tmp_path / "out2" / "metrics.json")


def test_a_slide_read_from_a_store_tiled_otherwise_is_another_run(synth_dir, annotations_dir, predictions, tmp_path):
    """Review CN: a slide predicted from a store tiled with another min_tissue shares its run's fingerprint (the
    checkpoint and heatmap settings); its sidecar now records the store's tiling, and the slides are two runs."""
    copy = _folder(predictions, tmp_path, {"fingerprint": "1111111111111111", "checkpoint_sha256": SHA_A},
                   {"fingerprint": "1111111111111111", "checkpoint_sha256": SHA_A,
                    "tiling_plan": {**RUN["tiling_plan"], "min_tissue": 0.95}})
    with pytest.raises(EvaluationError, match=r"tiling min_tissue 0\.95 vs 0\.1|tiling min_tissue 0\.1 vs 0\.95"):
        _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out")


def test_an_overlay_of_another_annotation_version_is_noted(synth_dir, annotations_dir, predictions, tmp_path):
    """Review CN: an annotation edited after the heatmap was scored as edited while the report's overlay still
    outlined the old one, without a word."""
    from wsi_milssl.annotations import find_annotation
    from wsi_milssl.tiling import file_fingerprint

    _, info = predictions
    current = file_fingerprint(find_annotation(info["tumor"], annotations_dir))
    copy = _folder(predictions, tmp_path, {"outline_file": current}, {})
    _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out")
    assert "another version of their annotation" not in (tmp_path / "out" / "report.html").read_text()
    shutil.rmtree(copy)
    copy = _folder(predictions, tmp_path, {"outline_file": {**current, "size_bytes": current["size_bytes"] + 7}}, {})
    _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out2")
    report = (tmp_path / "out2" / "report.html").read_text()
    assert (f"the heatmap overlays of 1 slide(s) outline another version of their annotation than the one evaluated "
            f"(edited since, or another annotations folder): {info['tumor']}") in report


def test_an_overlay_of_an_annotation_edited_in_place_is_noted(synth_dir, annotations_dir, predictions, tmp_path):
    """Review EM, A1: the overlay's annotation is compared by its bytes (its size and time can be kept while an
    outline moves)."""
    from wsi_milssl.annotations import annotation_version, find_annotation

    _, info = predictions
    current = annotation_version(find_annotation(info["tumor"], annotations_dir))
    copy = _folder(predictions, tmp_path, {"outline_file": {**current, "sha256": "0" * 64}}, {})
    _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out")
    assert f"outline another version of their annotation than the one evaluated (edited since, or another " \
           f"annotations folder): {info['tumor']}" in (tmp_path / "out" / "report.html").read_text()
    shutil.rmtree(copy)
    copy = _folder(predictions, tmp_path, {"outline_file": {**current, "mtime_ns": 1}}, {})  # touched: same bytes
    _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out2")
    assert "another version of their annotation" not in (tmp_path / "out2" / "report.html").read_text()
