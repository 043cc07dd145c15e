"""The evaluate command's summary line says which FROC it printed (review AP, finding 8): "FROC 0.5000" was
printed alike for the CAMELYON16 protocol and for any other settings."""

from __future__ import annotations

import re

import pytest

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


def test_the_evaluation_package_gives_its_names_and_submodules_on_first_use():
    """Its names are imported lazily since `run` checks an evaluation without the evaluation stack; every name of
    __all__ comes from its module, and a submodule is an attribute as in an eager package (review CO)."""
    import importlib
    import pickle

    import wsi_milssl.evaluation as ev

    for name in ev.__all__:
        assert getattr(ev, name) is not None and name in dir(ev)
    assert ev.froc.froc_score is ev.froc_score and ev.protocol.MARGIN_UM == ev.MARGIN_UM == 75.0
    import subprocess
    import sys

    code = "import wsi_milssl.evaluation as ev\nprint(ev.report.__name__, ev.protocol.MARGIN_UM)"  # none imported yet
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.split() == ["wsi_milssl.evaluation.report", "75.0"]
    assert importlib.import_module("wsi_milssl.evaluation.stage").evaluate_predictions is ev.evaluate_predictions
    assert pickle.loads(pickle.dumps(ev.Metric)) is ev.Metric
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        ev.no_such_name  # noqa: B018
    assert not hasattr(ev, "a.b") and not hasattr(ev, "..")  # review CP: a dotted name raised ModuleNotFoundError
