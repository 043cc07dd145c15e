"""The cross-stage contract (wsi_milssl/artifacts.py + docs/artifacts.md): one set of names that the
heatmap stage writes with and the evaluation stage reads with, and one slide-name rule for every stage."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from wsi_milssl import artifacts, cohorts, tiling
from wsi_milssl.errors import ConfigError
from wsi_milssl.evaluation import inputs as eval_inputs
from wsi_milssl.inference import exports
from wsi_milssl.inference import stage as heatmap_stage

ROOT = Path(__file__).resolve().parents[1]


def test_every_heatmap_file_name_parses_back_to_its_stem_and_kind():
    paths = artifacts.heatmap_paths("/x", "Tumor_001.v2")
    assert set(paths) == set(artifacts.HEATMAP_FILES)
    for kind, path in paths.items():
        assert artifacts.parse_heatmap_name(path.name) == ("Tumor_001.v2", kind)
    # the OME-TIFF is never mistaken for the plain TIFF of a slide called "x_probs.ome" or vice versa
    assert artifacts.parse_heatmap_name("x_probs.ome.tif") == ("x", "probs_ome_tif")
    assert artifacts.parse_heatmap_name("x_probs.tif") == ("x", "probs_tif")
    assert artifacts.parse_heatmap_name("scores.csv") is None
    assert artifacts.parse_heatmap_name("_detections.csv") is None


def test_writer_and_reader_modules_share_the_contract():
    assert exports.output_paths("/d", "s") == artifacts.heatmap_paths("/d", "s")
    assert exports.SCORES_FILENAME == artifacts.SCORES_FILENAME
    assert heatmap_stage.CONFIG_FILENAME == artifacts.HEATMAP_CONFIG_FILENAME
    assert heatmap_stage.STATUS_FILENAME == artifacts.HEATMAP_STATUS_FILENAME
    assert eval_inputs.read_detections is artifacts.read_detections
    assert eval_inputs.find_predictions is artifacts.find_predictions


def test_find_predictions_reads_the_files_the_writers_name(tmp_path):
    paths = artifacts.heatmap_paths(tmp_path, "s1")
    for path in paths.values():
        path.write_text("")
    (tmp_path / artifacts.SCORES_FILENAME).write_text("slide,score\n")
    (tmp_path / artifacts.HEATMAP_STATUS_FILENAME).write_text("slide,status\n")
    found = artifacts.find_predictions(tmp_path, known_stems={"scores", "heatmap_status"})
    assert list(found) == ["s1"]
    files = found["s1"]
    assert (files.detections, files.patches, files.sidecar, files.probs_npy, files.heatmap_png) == (
        paths["detections_csv"], paths["patches_csv"], paths["probs_json"], paths["probs_npy"], paths["heatmap_png"])


def test_evaluation_reports_the_heatmap_folders_config(tmp_path):
    """The evaluation used to look for config.json while the heatmap stage writes heatmap_config.json."""
    from wsi_milssl.evaluation import evaluate_predictions

    pred = tmp_path / "pred"
    pred.mkdir()
    exports.write_detections_csv(artifacts.heatmap_paths(pred, "n1")["detections_csv"], [0.5], [10], [20])
    artifacts.heatmap_paths(pred, "n1")["probs_json"].write_text(json.dumps({"slide": "n1", "patch_size_lv0": 256}))
    (pred / artifacts.HEATMAP_CONFIG_FILENAME).write_text(json.dumps({"fingerprint": "f1ngerpr1nt"}))
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\nn1,0\n")
    result = evaluate_predictions(pred, labels_csv=labels, out_dir=tmp_path / "eval")
    assert set(result.paths) >= {"metrics", "per_slide", "config", "report"}
    for key, path in result.paths.items():
        assert path.name == artifacts.EVALUATION_FILES[key]
    assert "f1ngerpr1nt" in result.paths["report"].read_text()
    header = result.paths["per_slide"].read_text().splitlines()[0]
    assert header == ",".join(artifacts.PER_SLIDE_COLUMNS)


def test_docs_list_every_file_and_column_of_the_contract():
    text = (ROOT / "docs" / "artifacts.md").read_text()
    for suffix in artifacts.HEATMAP_FILES.values():
        assert f"`<stem>{suffix}`" in text, suffix
    for name in artifacts.EVALUATION_FILES.values():
        assert f"`{name}`" in text, name
    for name in (artifacts.SCORES_FILENAME, artifacts.HEATMAP_STATUS_FILENAME, artifacts.HEATMAP_CONFIG_FILENAME):
        assert f"`{name}`" in text, name
    for columns in (artifacts.PER_SLIDE_COLUMNS, artifacts.DETECTION_OUTCOME_COLUMNS, artifacts.FROC_CURVE_COLUMNS,
                    artifacts.HEATMAP_STATUS_COLUMNS, artifacts.PATCHES_COLUMNS):
        assert ",".join(columns) in text, columns
    for suffix in cohorts.SLIDE_SUFFIXES:
        assert re.search(rf"[`\s]{re.escape(suffix)}[`\s]", text), suffix


# ------------------------------------------------------------------------------ slide names, every stage

def test_one_slide_stem_and_one_suffix_list_for_every_stage():
    assert tiling.slide_stem is cohorts.slide_stem
    assert tiling.SLIDE_SUFFIXES is cohorts.SLIDE_SUFFIXES
    assert eval_inputs.slide_stem is cohorts.slide_stem
    assert eval_inputs.SLIDE_SUFFIXES is cohorts.SLIDE_SUFFIXES
    assert heatmap_stage.slide_stem is cohorts.slide_stem
    # a name with an unknown suffix keeps it in every stage (Path.stem would cut "case.01" to "case")
    assert tiling.slide_stem("/s/case.01") == "case.01"
    assert tiling.slide_stem("/s/Tumor_001.TIF") == "Tumor_001"


def test_tile_reads_a_prepared_slide_path_csv_and_refuses_stems_differing_in_case(tmp_path):
    for name in ("Tumor_001.tif", "normal_002.svs"):
        (tmp_path / name).write_bytes(b"")
    listing = tmp_path / "slides.csv"
    listing.write_text(f"slide,path\nTumor_001,{tmp_path / 'Tumor_001.tif'}\nnormal_002,normal_002.svs\n")
    assert tiling.find_slides([listing]) == [tmp_path / "Tumor_001.tif", tmp_path / "normal_002.svs"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "tumor_001.tif").write_bytes(b"")
    with pytest.raises(ConfigError, match="have the same name"):
        tiling.find_slides([tmp_path / "Tumor_001.tif", tmp_path / "other" / "tumor_001.tif"])


def test_detections_reader_keeps_accepting_other_tools_files(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("prob,x,y\n0.9,10.5,20\n")
    dets = artifacts.read_detections(path)
    assert dets.x_lv0.tolist() == [10.5] and len(dets) == 1
    np.testing.assert_array_equal(dets.y_lv0, [20.0])


def test_find_predictions_names_the_plain_csvs_it_passes_over(tmp_path):
    """A plain <stem>.csv (the challenge's naming) counts only for a labelled slide; the others are passed
    over, and ``passed_over`` receives them (the evaluation warns and lists them) - scores.csv,
    heatmap_status.csv and the evaluation's own CSVs excepted."""
    for name in ("a.csv", "B.csv", "c_detections.csv", "zz.csv", artifacts.SCORES_FILENAME,
                 artifacts.HEATMAP_STATUS_FILENAME, artifacts.EVALUATION_FILES["per_slide"], "notes.txt"):
        (tmp_path / name).write_text("")
    passed_over: list = []
    found = artifacts.find_predictions(tmp_path, known_stems={"A", "c"}, passed_over=passed_over)
    assert list(found) == ["a", "c"]
    assert passed_over == [tmp_path / "B.csv", tmp_path / "zz.csv"]
    passed_over.clear()
    artifacts.find_predictions(tmp_path, known_stems={"A", "c"}, only=["a", "c"], passed_over=passed_over)
    assert passed_over == []  # files of slides outside ``only`` are not this evaluation's


def test_find_predictions_names_a_plain_csv_beside_its_slide_s_detections_file(tmp_path):
    """A labelled slide's plain <stem>.csv beside its <stem>_detections.csv (in any letter case) was passed over
    without a word (review AJ); the _detections.csv is evaluated, and the plain CSV is in ``passed_over``."""
    for name in ("a.csv", "A_detections.csv", "b.csv"):
        (tmp_path / name).write_text("")
    passed_over: list = []
    found = artifacts.find_predictions(tmp_path, known_stems={"a", "b"}, passed_over=passed_over)
    assert found["A"].detections == tmp_path / "A_detections.csv" and found["b"].detections == tmp_path / "b.csv"
    assert passed_over == [tmp_path / "a.csv"]


def test_find_predictions_leaves_hidden_files_out(tmp_path):
    """macOS writes '._<name>' files beside copied ones; they were read as slides ('._s' without a label stopped
    the evaluation, review AJ). Hidden files are left out, as find_slides leaves them out."""
    for name in ("s_detections.csv", "._s_detections.csv", "._s_probs.json", "._s_patches.csv", "._t.csv", ".u.csv"):
        (tmp_path / name).write_text("")
    passed_over: list = []
    found = artifacts.find_predictions(tmp_path, known_stems={"s", "._t"}, passed_over=passed_over)
    assert list(found) == ["s"] and passed_over == []
    assert found["s"].detections == tmp_path / "s_detections.csv" and found["s"].sidecar is None
