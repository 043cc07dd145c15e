"""The evaluation stage end to end on generated slides: real TIFFs, real ASAP XML, real files."""

from __future__ import annotations

import csv
import json
import shutil

import numpy as np
import pytest

from wsi_milssl.errors import EvaluationError, LabelsError
from wsi_milssl.evaluation import evaluate_predictions, read_labels
from wsi_milssl.evaluation.froc import FP_RATES

from evaluation_fixtures import write_predictions


def test_metrics_json_by_hand(evaluated):
    """The tumour slide's annotation (written by the fixture) has two discs: a 320 µm lesion, about
    395 µm once grown by the 75/2 µm margin (a lesion), and a 70 µm one, about 145 µm grown (an ITC:
    under 275 µm). Detections: 0.7 on the lesion (TP), 0.7 again on it (repeat), 0.95 on the ITC
    (ignored); 0.8 on the normal slide (FP). Two slides.

    Curve: (0, 0); t=0.8: (1/2, 0); t=0.7: (1/2, 1). Sensitivity at 1/4 FP/slide: 0 (between (0, 0)
    and (1/2, 0)); at 1/2: 1 (vertical step, the higher value); at 1..8: 1. FROC = 5/6.
    """
    result, out, info = evaluated
    metrics = json.loads((out / "metrics.json").read_text())
    assert {"instance_auc", "bag_auc", "froc", "froc_sensitivities", "n_slides", "n_lesions"} <= set(metrics)
    assert metrics["n_slides"] == 2 and metrics["n_lesions"] == 1 and metrics["n_itc"] == 1
    assert metrics["froc_sensitivities"] == pytest.approx([0, 1, 1, 1, 1, 1], abs=1e-12)
    assert metrics["froc"] == pytest.approx(5 / 6, abs=1e-12)
    assert metrics["fp_rates"] == list(FP_RATES)
    # patch probability = exact tumour fraction, labels = fraction >= 0.25: separable -> AUC 1
    assert metrics["instance_auc"] == 1.0
    assert metrics["n_positive_patches"] == info["n_positive_patches"] > 0
    assert metrics["n_patches"] == 2 * 16 * 16
    assert metrics["bag_auc"] == 1.0
    assert metrics["reasons"] == {}
    assert result.metrics == metrics
    # the regions as designed: major axes on the level-5 (8 µm/px) raster within two pixels
    mask = next(s for s in result.slides if s.stem == info["tumor"]).match.mask
    lesion, itc = mask.lesion_labels[0], next(iter(mask.itc_labels))
    assert mask.major_axis_um[lesion - 1] == pytest.approx(395, abs=16)
    assert mask.major_axis_um[itc - 1] == pytest.approx(145, abs=16)


def test_per_slide_csv_and_detection_outcomes(evaluated):
    _, out, info = evaluated
    with open(out / "per_slide.csv") as fh:
        rows = {r["slide"]: r for r in csv.DictReader(fh)}
    tumour, normal = rows[info["tumor"]], rows[info["normal"]]
    assert tumour["label"] == "1" and tumour["n_detections"] == "3" and tumour["n_fp"] == "0"
    assert tumour["n_lesions"] == "1" and tumour["n_lesions_detected"] == "1"
    assert tumour["n_repeat_hits"] == "1" and tumour["n_itc_hits"] == "1"
    assert float(tumour["mpp"]) == pytest.approx(0.25)
    assert normal["n_fp"] == "1" and normal["n_lesions"] == "0" and float(normal["score"]) == 0.2
    with open(out / "detection_outcomes.csv") as fh:
        outcomes = [(r["slide"], r["outcome"]) for r in csv.DictReader(fh)]
    assert sorted(outcomes) == sorted([(info["tumor"], "tp"), (info["tumor"], "itc"), (info["tumor"], "repeat"),
                                       (info["normal"], "fp")])
    with open(out / "froc_curve.csv") as fh:
        curve = list(csv.DictReader(fh))
    assert [(float(r["fp_per_slide"]), float(r["sensitivity"])) for r in curve] == [(0, 0), (0.5, 0), (0.5, 1)]


def test_every_output_is_written(evaluated):
    _, out, _ = evaluated
    for name in ("metrics.json", "per_slide.csv", "detection_outcomes.csv", "froc_curve.csv", "froc.png",
                 "roc_instance.png", "roc_bag.png", "config.json", "report.html"):
        assert (out / name).stat().st_size > 0, name
    for name in ("froc.png", "roc_instance.png", "roc_bag.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG")
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp"))
    config = json.loads((out / "config.json").read_text())
    assert config["positive_fraction"] == 0.25 and config["margin_um"] == 75.0


def test_detection_csvs_from_another_tool(synth_dir, annotations_dir, known_annotation, tmp_path):
    """Only CAMELYON16 detection CSVs (no patch table, no scores): AUCs are null with a reason,
    FROC is still computed, no ROC plot is left behind."""
    pred = tmp_path / "pred"
    write_predictions(synth_dir, known_annotation, pred, with_patches=False, with_scores=False)
    out = tmp_path / "out"
    out.mkdir()
    (out / "roc_bag.png").write_bytes(b"stale")  # from an imagined earlier run
    result = evaluate_predictions(pred, labels_csv=synth_dir / "labels.csv", out_dir=out,
                                  annotations_dir=annotations_dir, slides=synth_dir)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["instance_auc"] is None and "patches.csv" in metrics["reasons"]["instance_auc"]
    assert metrics["bag_auc"] is None and "scores.csv" in metrics["reasons"]["bag_auc"]
    assert metrics["froc"] == pytest.approx(5 / 6)
    assert not (out / "roc_bag.png").exists() and not (out / "roc_instance.png").exists()
    html = (out / "report.html").read_text()
    assert "scores.csv is missing" in html
    assert result.instance_roc is None and result.bag_roc is None


def test_camelyon16_submission_names_and_header(synth_dir, annotations_dir, known_annotation, tmp_path):
    """Detection files named <stem>.csv (CAMELYON16 submissions), one with a 'prob,x,y' header and
    one empty (a slide with no detections)."""
    pred = tmp_path / "pred"
    info = write_predictions(synth_dir, known_annotation, pred, with_patches=False, with_scores=False)
    tumour_lines = (pred / f"{info['tumor']}_detections.csv").read_text()
    (pred / f"{info['tumor']}_detections.csv").unlink()
    (pred / f"{info['tumor']}.csv").write_text("prob,x,y\n" + tumour_lines)
    (pred / f"{info['normal']}_detections.csv").unlink()
    (pred / f"{info['normal']}.csv").write_text("")
    result = evaluate_predictions(pred, labels_csv=synth_dir / "labels.csv", out_dir=tmp_path / "out",
                                  annotations_dir=annotations_dir, slides=synth_dir)
    # no FP at all now: the lesion is found at 0 FP/slide -> sensitivity 1 everywhere
    assert result.metrics["n_slides"] == 2 and result.metrics["froc"] == 1.0


def test_slides_given_as_csv_and_mpp_override(synth_dir, annotations_dir, predictions, tmp_path):
    """--slides as a CSV 'slide,path'. With mpp forced to 1.0 µm/px a level-5 px is 32 µm: the
    lesion disc (1280 px) is 1280 µm across, about 1355 µm grown, and the ITC disc (280 px) is 280 µm,
    about 355 µm grown: past 275 µm, so it is a second lesion and no ITC is left. The heatmaps must
    have been made at 1.0 (their sidecars say so; ``--mpp`` that contradicts them is refused:
    test_evaluation_heatmap_records.py).

    Lesion best hits 0.7 and 0.95, one FP at 0.8. Curve: (0, 0); t=0.95: (0, 1/2); t=0.8: (1/2, 1/2);
    t=0.7: (1/2, 1). Sensitivity at 1/4: 1/2 (flat between (0, 1/2) and (1/2, 1/2)); at 1/2..8: 1.
    FROC = (1/2 + 5) / 6 = 11/12.
    """
    pred_dir, info = predictions
    listing = tmp_path / "slides.csv"
    listing.write_text("slide,path\n" + "".join(f"{s},{synth_dir / (s + '.tif')}\n" for s in info["labels"]))
    from wsi_milssl.config import EvaluateConfig

    base = evaluate_predictions(pred_dir, labels_csv=synth_dir / "labels.csv", out_dir=tmp_path / "a",
                                annotations_dir=annotations_dir, slides=listing)
    assert base.metrics["n_lesions"] == 1 and base.metrics["n_itc"] == 1
    assert base.metrics["froc"] == pytest.approx(5 / 6, abs=1e-12)
    pred_dir = tmp_path / "at_1"  # as `heatmap --slide-mpp 1.0` records it
    shutil.copytree(predictions[0], pred_dir)
    for sidecar in pred_dir.glob("*_probs.json"):
        sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()), "mpp": 1.0}))
    forced = evaluate_predictions(pred_dir, labels_csv=synth_dir / "labels.csv", out_dir=tmp_path / "b",
                                  annotations_dir=annotations_dir, slides=listing, config=EvaluateConfig(mpp=1.0))
    assert forced.metrics["n_lesions"] == 2 and forced.metrics["n_itc"] == 0
    assert forced.metrics["froc_sensitivities"] == pytest.approx([0.5, 1, 1, 1, 1, 1], abs=1e-12)
    assert forced.metrics["froc"] == pytest.approx(11 / 12, abs=1e-12)
    assert all(s.mpp == 1.0 for s in forced.slides)
    mask = next(s for s in forced.slides if s.stem == info["tumor"]).match.mask
    assert sorted(mask.major_axis_um) == pytest.approx([355, 1355], abs=32)  # within one 32 µm pixel


def test_unlabelled_slide_is_an_error(synth_dir, annotations_dir, predictions, tmp_path):
    pred_dir, info = predictions
    labels = tmp_path / "labels.csv"
    labels.write_text(f"slide,label\n{info['tumor']},1\n")
    with pytest.raises(LabelsError, match=rf"labels\.csv: no label for 1 predicted slide\(s\): {info['normal']} .*Fix: add"):
        evaluate_predictions(pred_dir, labels_csv=labels, out_dir=tmp_path / "o", annotations_dir=annotations_dir,
                             slides=synth_dir)
    # `only` (the pipeline's test set now, by exact stem) leaves the other slides' files out
    result = evaluate_predictions(pred_dir, labels_csv=labels, out_dir=tmp_path / "o",
                                  annotations_dir=annotations_dir, slides=synth_dir, only=[info["tumor"]])
    assert [s.stem for s in result.slides] == [info["tumor"]]


def test_tumour_slide_without_annotation_is_an_error(synth_dir, predictions, tmp_path):
    pred_dir, info = predictions
    empty = tmp_path / "ann"
    empty.mkdir()
    with pytest.raises(EvaluationError, match=rf"{info['tumor']}' is labelled tumour but has no annotation file"):
        evaluate_predictions(pred_dir, labels_csv=synth_dir / "labels.csv", out_dir=tmp_path / "o",
                             annotations_dir=empty, slides=empty)


def test_tumour_slide_without_slide_file_is_an_error(synth_dir, annotations_dir, known_annotation, tmp_path):
    pred = tmp_path / "pred"
    write_predictions(synth_dir, known_annotation, pred, with_patches=False)  # no sidecar: no slide_path fallback
    with pytest.raises(EvaluationError, match="slide file was not found.*--slides"):
        evaluate_predictions(pred, labels_csv=synth_dir / "labels.csv", out_dir=tmp_path / "o",
                             annotations_dir=annotations_dir, slides=tmp_path)


def test_no_detection_files_is_an_error(synth_dir, tmp_path):
    with pytest.raises(EvaluationError, match="no detection files"):
        evaluate_predictions(tmp_path, labels_csv=synth_dir / "labels.csv", out_dir=tmp_path / "o")


def test_labels_reader(tmp_path):
    p = tmp_path / "labels.csv"
    p.write_text("slide,label\nA.tif,Tumor\nB,0\nC,normal\n")
    assert read_labels(p) == {"A": 1, "B": 0, "C": 0}
    p.write_text("slide,label\nA,maybe\n")
    with pytest.raises(LabelsError, match=r"labels\.csv: line 2: label 'maybe' of slide 'A' is not 0/1.*Fix"):
        read_labels(p)
    p.write_text("name,class\nA,1\n")
    with pytest.raises(LabelsError, match=r"line 1: 'name,class' is neither a header with a name column"):
        read_labels(p)


def test_bad_detection_file_names_file_and_line(synth_dir, annotations_dir, known_annotation, tmp_path):
    pred = tmp_path / "pred"
    info = write_predictions(synth_dir, known_annotation, pred, with_patches=False)
    (pred / f"{info['normal']}_detections.csv").write_text("0.5,10,20\n0.4,abc,5\n")
    with pytest.raises(EvaluationError, match=r"_detections.csv: line 2: x 'abc' is not a number"):
        evaluate_predictions(pred, labels_csv=synth_dir / "labels.csv", out_dir=tmp_path / "o",
                             annotations_dir=annotations_dir, slides=synth_dir)
    (pred / f"{info['normal']}_detections.csv").write_text("0.5,10\n")
    with pytest.raises(EvaluationError, match=r"line 1: expected 3 values 'prob,x,y'"):
        evaluate_predictions(pred, labels_csv=synth_dir / "labels.csv", out_dir=tmp_path / "o",
                             annotations_dir=annotations_dir, slides=synth_dir)


def test_roc_points_match_scikit_learn(evaluated):
    from sklearn.metrics import roc_auc_score

    result, _, _ = evaluated
    labels = np.concatenate([s.instance_labels for s in result.slides])
    probs = np.concatenate([s.patch_probs for s in result.slides])
    assert result.instance_roc.auc == roc_auc_score(labels, probs)
    assert result.instance_roc.fpr[0] == 0 and result.instance_roc.tpr[-1] == 1


def test_margin_zero_keeps_the_lesions(evaluated, synth_dir, annotations_dir, predictions, tmp_path):
    """--margin-um 0 evaluates the annotated tumour undilated: the fixture's 320 µm lesion stays a lesion
    (the 70 µm ITC disc stays an ITC) and the detections on it are TPs, as with the 75 µm margin; before,
    the mask was empty, the FROC n/a and every hit inside the lesion a false positive."""
    from wsi_milssl.config import EvaluateConfig

    pred_dir, info = predictions
    result = evaluate_predictions(pred_dir, labels_csv=synth_dir / "labels.csv", out_dir=tmp_path / "out",
                                  annotations_dir=annotations_dir, slides=synth_dir,
                                  config=EvaluateConfig(margin_um=0.0))
    assert result.metrics["n_lesions"] == 1 and result.metrics["n_itc"] == 1
    assert result.metrics["froc"] == pytest.approx(evaluated[0].metrics["froc"], abs=1e-12)
    assert result.metrics["n_false_positives"] == evaluated[0].metrics["n_false_positives"]


def test_the_froc_is_called_camelyon16_only_with_the_challenges_settings(evaluated, synth_dir, annotations_dir,
                                                                        predictions, tmp_path):
    """metrics.json records the margin, the ITC limit and the µm/px they were measured at; the report and
    its FROC plot say "CAMELYON16" only for 75 µm, 275 µm and 0.243 µm/px for every slide (the challenge
    script's), and name the settings otherwise (each slide's own µm/px, the default, included)."""
    from wsi_milssl.config import EvaluateConfig

    pred_dir, _ = predictions
    result, out, _ = evaluated  # the defaults: each slide's own µm/px
    m = json.loads((out / "metrics.json").read_text())
    assert (m["margin_um"], m["itc_major_axis_um"], m["froc_mpp"]) == (75.0, 275.0, None)
    assert m["froc_protocol"] == "75 µm margin, 275 µm ITC limit, at each slide's own µm/px"
    html = (out / "report.html").read_text()
    assert "CAMELYON16 protocol" not in html and "FROC score (CAMELYON16)" not in html
    assert "FROC score (75 µm margin, 275 µm ITC limit, at each slide&#x27;s own µm/px)" in html

    def run(name, **settings):
        evaluate_predictions(pred_dir, labels_csv=synth_dir / "labels.csv", out_dir=tmp_path / name,
                             annotations_dir=annotations_dir, slides=synth_dir, config=EvaluateConfig(**settings))
        return json.loads((tmp_path / name / "metrics.json").read_text()), (tmp_path / name / "report.html").read_text()

    m, html = run("c16", froc_mpp=0.243)
    assert (m["margin_um"], m["itc_major_axis_um"], m["froc_mpp"], m["froc_protocol"]) == (75.0, 275.0, 0.243,
                                                                                          "CAMELYON16")
    assert "FROC score (CAMELYON16)" in html and "FROC curve (CAMELYON16 protocol)" in html
    m, html = run("other", froc_mpp=0.243, margin_um=50.0, itc_major_axis_um=200.0)
    assert (m["margin_um"], m["itc_major_axis_um"], m["froc_mpp"]) == (50.0, 200.0, 0.243)
    assert m["froc_protocol"] == "50 µm margin, 200 µm ITC limit, at 0.243 µm/px"
    assert "CAMELYON16" not in html.split("<h2>Configuration</h2>")[0]
    assert "FROC curve (50 µm margin, 200 µm ITC limit, at 0.243 µm/px)" in html


def test_the_froc_is_called_camelyon16_only_with_the_challenges_annotation_groups(synth_dir, annotations_dir,
                                                                                   predictions, tmp_path):
    """The challenge reads _0 and _1 as tumour and _2 as exclusion; with other groups (here _1 carved out, review
    AJ) the lesions are others, so froc_protocol names the groups instead of saying "CAMELYON16" (it said
    "CAMELYON16" whatever the groups were)."""
    from wsi_milssl.config import EvaluateConfig

    pred_dir, _ = predictions

    def protocol(name, **groups):
        evaluate_predictions(pred_dir, labels_csv=synth_dir / "labels.csv", out_dir=tmp_path / name,
                             annotations_dir=annotations_dir, slides=synth_dir,
                             config=EvaluateConfig(froc_mpp=0.243, **groups))
        html = (tmp_path / name / "report.html").read_text()
        return json.loads((tmp_path / name / "metrics.json").read_text())["froc_protocol"], html

    m, html = protocol("other", tumor_groups=("_0",), non_tumor_groups=("_1", "_2"))
    assert m == "75 µm margin, 275 µm ITC limit, at 0.243 µm/px, tumour groups _0, non-tumour groups _1, _2"
    assert "CAMELYON16" not in html.split("<h2>Configuration</h2>")[0]
    assert protocol("none", tumor_groups=("_0", "_1"), non_tumor_groups=())[0] == (
        "75 µm margin, 275 µm ITC limit, at 0.243 µm/px, tumour groups _0, _1, no non-tumour group")
    # the challenge's groups, alone or with more groups beside them, read its files alike
    assert protocol("c16", tumor_groups=("_0", "_1"), non_tumor_groups=("_2",))[0] == "CAMELYON16"
    assert protocol("c16_more", tumor_groups=("_1", "_0", "Tumour"), non_tumor_groups=("_2", "Other"))[0] == "CAMELYON16"
