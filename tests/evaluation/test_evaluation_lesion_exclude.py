"""``lesion_exclude``: slides left out of the lesion-level metrics (FROC, instance AUC) and kept in the bag AUC, as
CAMELYON16's organisers left Test_114 (not exhaustively annotated) out of the lesion task only (review BH: the only
way was prepare's --exclude, which drops the slide from the slide-level AUC too)."""

from __future__ import annotations

import csv
import json
import logging

from wsi_milssl.cli import main
from wsi_milssl.config import EvaluateConfig
from wsi_milssl.evaluation import evaluate_predictions


def test_an_excluded_slide_leaves_the_froc_and_the_instance_auc_only(evaluated, predictions, synth_dir,
                                                                      synth_slides, annotations_dir, tmp_path,
                                                                      caplog):
    full, _, _ = evaluated
    assert full.metrics["lesion_excluded"] == [] and full.metrics["n_lesions"] >= 1
    normal = synth_slides["normal"].stem
    with caplog.at_level(logging.WARNING):
        result = evaluate_predictions(predictions[0], labels_csv=synth_dir / "labels.csv", out_dir=tmp_path / "out",
                                      annotations_dir=annotations_dir, slides=synth_dir,
                                      config=EvaluateConfig(lesion_exclude=(normal.upper(), "Test_114")))
    m = result.metrics
    assert m["lesion_excluded"] == [normal] and m["n_slides"] == 2
    assert m["bag_auc"] == full.metrics["bag_auc"] and m["bag_auc"] is not None
    # the FROC counts the tumour slide alone: its lesions stay, the normal slide's false positives go
    assert m["n_lesions"] == full.metrics["n_lesions"]
    assert m["n_false_positives"] < full.metrics["n_false_positives"]
    assert m["n_patches"] < full.metrics["n_patches"]
    assert "lesion_exclude names 1 slide(s) that are not evaluated here: Test_114" in caplog.text
    rows = {r["slide"]: r for r in csv.DictReader(open(tmp_path / "out" / "per_slide.csv"))}
    assert rows[normal]["lesion_excluded"] == "1" and rows[synth_slides["tumor"].stem]["lesion_excluded"] == "0"
    report = (tmp_path / "out" / "report.html").read_text()
    assert f"1 slide(s) are left out of the FROC and the instance AUC (lesion_exclude) and kept in the bag AUC: " \
           f"{normal}." in report
    # review BS: the count rows are the FROC's slides', and the excluded slide's card says so
    assert report.count("of the 1 slides of the FROC and the instance AUC (1 left out by lesion_exclude)") == 5
    assert report.count("left out of the FROC and the instance AUC (lesion_exclude)</p>") == 1


def test_the_command_line_takes_lesion_exclude(predictions, synth_dir, synth_slides, annotations_dir, tmp_path):
    tumour = synth_slides["tumor"].stem
    argv = ["evaluate", "--predictions", str(predictions[0]), "--annotations", str(annotations_dir), "--slides",
            str(synth_dir), "--labels", str(synth_dir / "labels.csv"), "--out", str(tmp_path / "out"),
            "--lesion-exclude", tumour]
    assert main(argv) == 0
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["lesion_excluded"] == [tumour] and metrics["n_lesions"] == 0 and metrics["froc"] is None
    assert metrics["bag_auc"] is not None
    # the instance AUC leaves the tumour slide out too: the normal slide's patches are all of one class (review EG)
    assert metrics["instance_auc"] is None and "instance_auc" in metrics["reasons"], metrics["instance_auc"]
    assert main(argv[:-2] + ["--lesion-exclude", " ", "--out", str(tmp_path / "bad")]) == 2


def test_a_pipeline_passes_lesion_exclude_to_its_evaluate_stage(tmp_path):
    from wsi_milssl.cohorts.write import default_template
    from wsi_milssl.pipeline import load_pipeline
    from wsi_milssl.pipeline.spec import stage_config

    spec = load_pipeline(default_template(), out_dir=tmp_path / "out",
                         overrides=['evaluate.lesion_exclude=["Test_114"]'])
    assert stage_config(spec, "evaluate").lesion_exclude == ("Test_114",)
    assert stage_config(load_pipeline(default_template(), out_dir=tmp_path / "out"), "evaluate").lesion_exclude == ()


def test_every_slide_excluded_leaves_the_bag_auc_alone(predictions, synth_dir, synth_slides, annotations_dir,
                                                        tmp_path):
    """Review BL: excluding every evaluated slide stopped evaluate with a traceback (froc_curve of no slide)."""
    names = (synth_slides["tumor"].stem, synth_slides["normal"].stem)
    result = evaluate_predictions(predictions[0], labels_csv=synth_dir / "labels.csv", out_dir=tmp_path / "out",
                                  annotations_dir=annotations_dir, slides=synth_dir,
                                  config=EvaluateConfig(lesion_exclude=names))
    m = result.metrics
    assert m["froc"] is None and m["instance_auc"] is None and m["bag_auc"] is not None
    assert m["reasons"]["instance_auc"] == "every evaluated slide is in lesion_exclude"
    assert m["reasons"]["froc"] == (f"no lesions: lesion_exclude left out the 1 lesion(s) of {names[0]}; "
                                    "sensitivity is undefined")  # the tumour slide alone (review BM)


def test_names_given_as_one_comma_list_are_said_to_be_separate_values(caplog):
    """Review EW, C8: `--lesion-exclude A,B` (a comma list, as --tumor-groups takes) was one unknown name with a
    plain warning, and both slides stayed in the FROC."""
    from types import SimpleNamespace

    from wsi_milssl.evaluation.stage import _lesion_excluded

    results = [SimpleNamespace(stem="Test_049"), SimpleNamespace(stem="Test_114")]
    with caplog.at_level(logging.WARNING):
        excluded, kept = _lesion_excluded(results, EvaluateConfig(lesion_exclude=("Test_049,Test_114",)))
    assert excluded == [] and len(kept) == 2
    assert ("lesion_exclude names 1 slide(s) that are not evaluated here: 'Test_049,Test_114' (names are separate "
            "values: --lesion-exclude A B, or a list in TOML, not one 'A,B')") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        excluded, _ = _lesion_excluded(results, EvaluateConfig(lesion_exclude=("Test_049", "Test_114")))
    assert excluded == ["Test_049", "Test_114"] and "not evaluated here" not in caplog.text
