"""prepare checks the annotations' groups against the label stage of the pipeline it writes (review AO, finding 7)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prepare_trees import gigadb_tree

from wsi_milssl.cohorts import prepare_camelyon16
from wsi_milssl.cohorts.prepare import default_template
from wsi_milssl.errors import ConfigError


def _regroup(path: Path, groups: dict[str, str]) -> None:
    """Rename the annotations' groups in the ASAP XML ``path`` (PartOfGroup of each <Annotation>)."""
    text = path.read_text()
    for old, new in groups.items():
        text = re.sub(rf'(<Annotation [^>]*PartOfGroup=)"{re.escape(old)}"', rf'\1"{new}"', text)
    path.write_text(text)


def test_a_tumour_annotation_in_unknown_groups_only_stops_prepare(tmp_path, synth_slides):
    """CAMELYON17-style 'metastases': prepare passed and the run stopped at label, after tile."""
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    xml = root / "testing" / "lesion_annotations" / "Test_001.xml"
    _regroup(xml, {"_0": "metastases", "_1": "metastases", "_2": "metastases"})
    with pytest.raises(ConfigError) as info:
        prepare_camelyon16(root, tmp_path / "out")
    message = str(info.value)
    assert f"{xml} ('metastases')" in message and "Nothing was written" in message
    assert "[label] tumor_groups" in message and "--template" in message
    assert 'tumor_groups = ["_0", "_1", "Tumor", "metastases"]' in message
    assert not (tmp_path / "out").exists()

    # the fix it names: a template whose [label] stage knows the group
    template = tmp_path / "mine.toml"
    template.write_text(default_template().read_text().replace(
        "[label]\n", '[label]\ntumor_groups = ["_0", "_1", "Tumor", "metastases"]\n', 1))
    result = prepare_camelyon16(root, tmp_path / "out", template=template)
    assert not any("metastases" in n for n in result.notes)

    # a folder prepared before: its edited pipeline.toml (kept by prepare) is the one checked
    _regroup(root / "training" / "lesion_annotations" / "Tumor_002.xml", {"_0": "metastases", "_1": "metastases"})
    edited = result.pipeline_toml.read_text().replace(
        'tumor_groups = ["_0", "_1", "Tumor", "metastases"]', 'tumor_groups = ["_0", "_1", "metastases"]')
    result.pipeline_toml.write_text(edited)
    again = prepare_camelyon16(root, tmp_path / "out")
    assert again.pipeline_toml.read_text() == edited


def test_unknown_groups_beside_tumour_ones_are_a_note(tmp_path, synth_slides):
    """The label stage ignores such polygons with a warning: prepare says so, with the setting that uses them."""
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    xml = root / "training" / "lesion_annotations" / "Tumor_001.xml"
    _regroup(xml, {"_1": "itc"})  # _0 stays
    result = prepare_camelyon16(root, tmp_path / "out")
    note = [n for n in result.notes if "[label] stage ignores" in n]
    assert len(note) == 1 and f"{xml} ('itc')" in note[0]
    assert "tumor_groups" in note[0] and "--set 'label.tumor_groups=[\"_0\", \"_1\", \"Tumor\", \"itc\"]'" in note[0]
    assert note[0] in json.loads(result.summary_json.read_text())["notes"]
