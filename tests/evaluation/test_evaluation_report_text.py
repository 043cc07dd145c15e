"""Small text slips of report.html (review AP, finding 9): µ in the configuration, the sensitivity rows'
indent, counts of one, and the metrics' names in the notes."""

from __future__ import annotations

import re

from report_probe import probe
from wsi_milssl.cli import main

TABLE_LABELS = """out.th = [].map.call(document.querySelectorAll('table')[0].querySelectorAll('th.l'), function (th) {
  return {text: th.textContent,
          left: th.getBoundingClientRect().left + parseFloat(getComputedStyle(th).paddingLeft)}; });"""


def test_configuration_mu_and_indented_sensitivity_rows(evaluated, tmp_path):
    """µ was written \\u00b5 in the configuration block; the sensitivity rows' indent (two spaces) was lost."""
    _, out, _ = evaluated
    page = (out / "report.html").read_text(encoding="utf-8")
    config = page.split("<h2>Configuration</h2>")[1]
    assert "\\u00b5" not in config and "75 µm margin" in config
    rows = {r["text"]: r["left"] for r in probe(out / "report.html", tmp_path, TABLE_LABELS)["th"]}
    assert rows["sensitivity at 1/4 FP/slide"] >= rows["Bag AUC (slides)"] + 10
    assert rows["sensitivity at 8 FP/slide"] == rows["sensitivity at 1/4 FP/slide"]


def test_one_slide_counts_and_metric_names(synth_dir, annotations_dir, known_annotation, tmp_path, capsys):
    """"all 1 slides are positive", "for 1 of 1 slides" and "instance auc unavailable"."""
    from evaluation_fixtures import write_predictions

    pred = tmp_path / "pred"
    info = write_predictions(synth_dir, known_annotation, pred, with_patches=False)
    for path in pred.glob(f"{info['normal']}_*"):
        path.unlink()
    labels = tmp_path / "labels.csv"
    labels.write_text(f"slide,label\n{info['tumor']},1\n")
    assert main(["evaluate", "--predictions", str(pred), "--annotations", str(annotations_dir), "--slides",
                 str(synth_dir), "--labels", str(labels), "--out", str(tmp_path / "out")]) == 0
    assert "bag_auc: n/a (the one slide is positive; AUC needs both classes)" in capsys.readouterr().out
    page = (tmp_path / "out" / "report.html").read_text(encoding="utf-8")
    assert "bag AUC unavailable: the one slide is positive; AUC needs both classes." in page
    assert re.search(r"instance AUC unavailable: no patch probabilities [^<]* for the one slide ", page)
    assert "1 slides" not in page and "instance auc" not in page and "bag auc" not in page


def test_the_model_line_says_what_the_training_summary_holds():
    """Review CS: the training behind the model was only in the configuration dump at the end of the report."""
    from wsi_milssl.evaluation.report import ReportData, model_line, render_report_html

    training = {"model": "resnet18", "epochs": 6, "mu": 0.15, "mu_ramp_epochs": 5, "lam": 25.0,
                "select_metric": "instance_auc", "run_folder": "/x", "best_epoch": 4,
                "best_epoch_validation": {"val_bag_auc": 1.0, "val_instance_auc": 0.95124}}
    line = model_line(training)
    assert line == ("resnet18, 6 epochs, μ 0.15, T 5, λ 25; best.pt: epoch 4, chosen by instance_auc "
                    "(validation bag AUC 1.000, validation instance AUC 0.951)")
    assert model_line({"model": "mlp", "epochs": 20}) == "mlp, 20 epochs" and model_line({}) == ""
    # review CT: a fixed μ has no ramp T to name; one epoch is not "1 epochs"
    assert model_line({"model": "mlp", "epochs": 1, "mu": 0.8, "mu_ramp_epochs": 10, "fixed_mu": True,
                       "lam": 25}) == "mlp, 1 epoch, μ 0.8 fixed, λ 25"
    page = render_report_html(ReportData(title="t", metrics={}, model="a <b> & c"))
    assert "<p><b>Model:</b> a &lt;b&gt; &amp; c</p>" in page
    assert "<b>Model:</b>" not in render_report_html(ReportData(title="t", metrics={}))
