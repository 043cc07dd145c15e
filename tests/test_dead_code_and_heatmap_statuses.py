"""Review AT, B4: helpers nothing called are gone, and the heatmap stage writes the statuses of the contract
(wsi_milssl.artifacts.HEATMAP_STATUSES) instead of literals of its own."""

from __future__ import annotations

import ast
import importlib
import inspect

import pytest

from wsi_milssl.artifacts import HEATMAP_STATUSES


@pytest.mark.parametrize("module, name", [
    ("wsi_milssl.inference.sources", "stem_of"),
    ("wsi_milssl.labeling.slide_labels", "slide_stem_of"),
    ("wsi_milssl.labeling", "slide_stem_of"),
    ("wsi_milssl.mil.data", "_NAME_COLUMNS"),
    ("wsi_milssl.tiling.status", "write_status_csv"),
    ("wsi_milssl.tiling", "write_status_csv"),
])
def test_unused_helpers_are_gone(module, name):
    mod = importlib.import_module(module)
    assert not hasattr(mod, name) and name not in getattr(mod, "__all__", ())


def test_unused_method_and_parameter_are_gone():
    from wsi_milssl.annotations.geometry import AnnotationSet
    from wsi_milssl.cohorts.prepare import _camelyon16_role

    assert not hasattr(AnnotationSet, "non_tumor_annotations")
    assert list(inspect.signature(_camelyon16_role).parameters) == ["path"]


def test_the_heatmap_stage_writes_the_contract_statuses():
    from wsi_milssl.inference import stage

    assert (stage.OK, stage.FAILED, stage.EMPTY) == HEATMAP_STATUSES == ("ok", "failed", "empty")
    literals = [node.lineno for node in ast.walk(ast.parse(inspect.getsource(stage)))
                if isinstance(node, ast.Constant) and node.value in HEATMAP_STATUSES]
    assert literals == [], f"status literals at lines {literals} of inference/stage.py"
