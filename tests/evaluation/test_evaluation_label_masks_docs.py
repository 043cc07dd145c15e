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


def test_the_label_stage_docstrings_do_not_call_its_masks_evaluation_masks():
    """LabelConfig and label_stores said the label stage writes "evaluation masks"; they are tumour masks to
    check the labels by (review AT, A4)."""
    from wsi_milssl.config.label import LabelConfig
    from wsi_milssl.labeling import stage

    for doc in (LabelConfig.__doc__, stage.label_stores.__doc__, stage.label_store.__doc__, stage._write_mask.__doc__):
        text = " ".join(doc.split())
        assert "evaluation mask" not in text and "tumour mask" in text


@pytest.mark.parametrize("module", ["wsi_milssl.inference.sources", "wsi_milssl.mil.checkpoint"])
def test_module_docstrings_point_to_modules_and_files_that_exist(module):
    """sources.py named a module wsi_milssl.inference.engine and checkpoint.py a file docs/artifacts.md/CONTRACTS,
    neither of which exists (review AT, A4)."""
    import importlib.util
    import re

    doc = importlib.import_module(module).__doc__
    for name in re.findall(r":mod:`~?(wsi_milssl[\w.]*)`", doc):
        assert importlib.util.find_spec(name) is not None, name
    for path in re.findall(r"``((?:docs/)?[\w./]+\.md[\w./]*)``", doc):
        assert (README.parent / path).is_file(), path
    assert "CONTRACTS" not in doc and "inference.engine" not in doc
