"""The wording of prepare's annotation-group check (3bb3683; review AQ, finding C): the error read as a broken
sentence, and the note went on after its full stop ('...: FILE ('itc'). To use them, add them ...' without an end).
The error is now one message naming the files, their unknown groups and the fix; the note one sentence."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prepare_trees import gigadb_tree

from wsi_milssl.cohorts import prepare_camelyon16
from wsi_milssl.errors import ConfigError


def _regroup(path: Path, groups: dict[str, str]) -> None:
    """Rename the annotations' groups in the ASAP XML ``path`` (PartOfGroup of each <Annotation>)."""
    text = path.read_text()
    for old, new in groups.items():
        text = re.sub(rf'(<Annotation [^>]*PartOfGroup=)"{re.escape(old)}"', rf'\1"{new}"', text)
    path.write_text(text)


def test_the_unknown_groups_error_is_one_clean_message(tmp_path, synth_slides):
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    xml = root / "testing" / "lesion_annotations" / "Test_001.xml"
    _regroup(xml, {"_0": "metastases", "_1": "metastases", "_2": "metastases"})
    with pytest.raises(ConfigError) as info:
        prepare_camelyon16(root, tmp_path / "out")
    assert str(info.value) == (
        "1 annotation file(s) of tumour slides have no area in a tumour group of the pipeline's [label] stage "
        "(_0, _1, Tumor) but polygons in groups it does not know, so that stage would stop at them: "
        f"{xml} ('metastases'). Nothing was written. Fix: add 'metastases' to [label] tumor_groups (or to "
        "non_tumor_groups, now _2, Exclusion, None, for regions that are not tumour) and prepare again with "
        "--template PIPELINE.toml, a copy of the template whose [label] table has tumor_groups = "
        '["_0", "_1", "Tumor", "metastases"]; or correct the annotation files.')


def test_the_ignored_groups_note_is_one_sentence(tmp_path, synth_slides):
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    xml = root / "training" / "lesion_annotations" / "Tumor_001.xml"
    _regroup(xml, {"_1": "itc"})  # _0 stays
    result = prepare_camelyon16(root, tmp_path / "out")
    note = [n for n in result.notes if "[label] stage ignores" in n]
    assert len(note) == 1
    assert not re.search(r"\. [A-Z]", note[0]), note[0]  # nothing after a full stop
    assert note[0].endswith(f"{xml} ('itc') (to use those polygons, add the groups to [label] tumor_groups or "
                            f"non_tumor_groups in {tmp_path / 'out' / 'pipeline.toml'}, or run with --set "
                            "'label.tumor_groups=[\"_0\", \"_1\", \"Tumor\", \"itc\"]')")
