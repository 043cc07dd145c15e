"""The evaluate command's summary line says which FROC it printed (review AP, finding 8): "FROC 0.5000" was
printed alike for the CAMELYON16 protocol and for any other settings."""

from __future__ import annotations

import re

from wsi_milssl.cli import main


def test_the_summary_line_names_the_froc_protocol(synth_dir, annotations_dir, predictions, tmp_path, capsys):
    pred_dir, _ = predictions
    common = ["evaluate", "--predictions", str(pred_dir), "--annotations", str(annotations_dir), "--slides",
              str(synth_dir), "--labels", str(synth_dir / "labels.csv")]

    def line(name, *extra):
        assert main([*common, "--out", str(tmp_path / name), *extra]) == 0
        return capsys.readouterr().out.splitlines()[0]

    assert re.search(r"  FROC 0\.8333 \(75 µm margin, 275 µm ITC limit, each slide's µm/px\)  instance AUC ",
                     line("own"))
    assert re.search(r"  FROC 0\.8333 \(CAMELYON16\)  instance AUC ", line("c16", "--froc-mpp", "0.243"))
    assert re.search(r"  FROC \d\.\d{4} \(50 µm margin, 200 µm ITC limit, at 0\.243 µm/px, other annotation groups\)"
                     r"  instance AUC ", line("groups", "--froc-mpp", "0.243", "--margin-um", "50",
                                              "--itc-major-axis-um", "200", "--tumor-groups", "_0,Tumor"))


def test_froc_protocol_summary_of_earlier_metrics():
    """metrics.json of a version before froc_protocol: no words; a protocol without its settings: as recorded."""
    from wsi_milssl.evaluation import froc_protocol_summary

    assert froc_protocol_summary({"froc": 0.5}) == ""
    assert froc_protocol_summary({"froc_protocol": "CAMELYON16"}) == "CAMELYON16"
    assert froc_protocol_summary({"froc_protocol": "75 µm margin"}) == "75 µm margin"


def test_checking_an_evaluations_protocol_imports_no_evaluation_stack(tmp_path):
    """`run` asks whether an up-to-date evaluation is an earlier version's (outdated_metrics) on every run: that
    check imported scikit-learn, scikit-image and matplotlib with the whole evaluation package (about 1 s of a
    4.7 s `run` that found everything up to date)."""
    import json
    import subprocess
    import sys

    (tmp_path / "metrics.json").write_text(json.dumps({"froc_protocol": "CAMELYON16"}))
    code = ("import sys\nfrom wsi_milssl.config import EvaluateConfig\nfrom wsi_milssl.evaluation import "
            f"outdated_metrics, MARGIN_UM\nprint(outdated_metrics({str(tmp_path)!r}, EvaluateConfig()), MARGIN_UM)\n"
            "print(*(m in sys.modules for m in ('sklearn', 'skimage', 'matplotlib', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[-1] == "False False False False", out
    assert out[-2].endswith(" 75.0"), out
