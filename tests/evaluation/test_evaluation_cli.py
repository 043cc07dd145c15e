"""``wsi-milssl evaluate`` through the real command-line entry point."""

from __future__ import annotations

import json

import pytest

from wsi_milssl.cli import COMMANDS, main
from wsi_milssl.config import EvaluateConfig
from wsi_milssl.errors import ConfigError


def test_evaluate_command(synth_dir, annotations_dir, predictions, tmp_path, capsys):
    pred_dir, _ = predictions
    out = tmp_path / "out"
    rc = main(["evaluate", "--predictions", str(pred_dir), "--annotations", str(annotations_dir),
               "--slides", str(synth_dir), "--labels", str(synth_dir / "labels.csv"), "--out", str(out),
               "--title", "CLI run"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "FROC 0.8333" in printed and "report:" in printed
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["froc"] == pytest.approx(5 / 6)
    assert "<title>CLI run</title>" in (out / "report.html").read_text()
    assert "evaluate" in COMMANDS


def test_evaluate_command_reports_input_errors(synth_dir, annotations_dir, tmp_path, capsys):
    rc = main(["evaluate", "--predictions", str(tmp_path / "nope"), "--annotations", str(annotations_dir),
               "--slides", str(synth_dir), "--labels", str(synth_dir / "labels.csv"), "--out", str(tmp_path / "o")])
    assert rc == 1
    assert "the predictions folder does not exist" in capsys.readouterr().err


def test_evaluate_command_requires_its_inputs(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["evaluate", "--predictions", "x"])
    assert exc.value.code == 2
    assert "--annotations" in capsys.readouterr().err


def test_evaluate_config_validation():
    with pytest.raises(ConfigError, match=r"EvaluateConfig.positive_fraction must satisfy 0.0 < value <= 1.0"):
        EvaluateConfig(positive_fraction=0.0)
    with pytest.raises(ConfigError, match=r"EvaluateConfig.mpp must satisfy"):
        EvaluateConfig(mpp=-1.0)
    with pytest.raises(ConfigError, match=r"EvaluateConfig.thumbnail_px must be int"):
        EvaluateConfig(thumbnail_px=100.0)
