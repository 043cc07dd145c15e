"""The label stage's ``<stem>_tumor_mask.png`` is for viewing and checking the labels: ``evaluate`` never reads
it (it rasterises the annotations itself), so the README and ``label --help`` must not call it the FROC's mask
(``--mask-downsample`` / ``--no-masks`` change nothing in the FROC)."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

from wsi_milssl.cli import main

README = Path(__file__).resolve().parents[2] / "README.md"
EVALUATION_MODULES = ("froc", "inputs", "metrics", "plots", "report", "stage")


def test_evaluate_reads_no_label_mask_and_the_docs_do_not_say_it_does(capsys):
    source = "".join(inspect.getsource(importlib.import_module(f"wsi_milssl.evaluation.{m}"))
                     for m in EVALUATION_MODULES)
    assert "read_eval_mask" not in source and "_tumor_mask.png" not in source and "MASK_SUFFIX" not in source

    with pytest.raises(SystemExit):
        main(["label", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "FROC evaluation mask" not in text and "evaluation masks" not in text
    assert "evaluate does not read it" in text and "do not change the FROC" in text

    readme = README.read_text()
    label_row = next(line for line in readme.splitlines() if line.startswith("| label |"))
    assert "for FROC" not in label_row and "to view and check the labels" in label_row
    assert "FROC evaluation masks" not in readme
