"""Review EC B1: a tumour slide whose polygons are all in ASAP's group "None" passed prepare (a test slide got a note
suggesting [evaluate] lesion_exclude, a training slide not a word), and `run` stopped at `label` after tiling every
slide. prepare now refuses it as the label stage does (groups_hiding_the_tumour), before anything is written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prepare_trees import gigadb_tree

from wsi_milssl.cohorts import prepare_camelyon16
from wsi_milssl.errors import ConfigError


def _regroup(path: Path, old_groups: tuple[str, ...], new: str) -> None:
    text = path.read_text()
    for old in old_groups:
        text = re.sub(rf'(<Annotation [^>]*PartOfGroup=)"{re.escape(old)}"', rf'\1"{new}"', text)
    path.write_text(text)


@pytest.mark.parametrize("folder, stem", [("training", "Tumor_002"), ("testing", "Test_001")])
def test_a_tumour_slide_outlined_in_group_none_is_refused_before_anything_is_written(tmp_path, synth_slides, folder,
                                                                                     stem):
    root = gigadb_tree(tmp_path / "c16", synth_slides)
    xml = root / folder / "lesion_annotations" / f"{stem}.xml"
    _regroup(xml, ("_0", "_1"), "None")
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as info:
        prepare_camelyon16(root, out)
    message = str(info.value)
    assert message.startswith("1 annotation file(s) of tumour slides have no polygon in a tumour group of the "
                              "pipeline's [label] stage (_0, _1, Tumor), so that stage would stop at them")
    assert f"{xml} (" in message and "in group 'None', which ASAP writes for a polygon in no group" in message
    assert "Nothing was written." in message
    assert f"--exclude {stem}" in message and "lesion_exclude does not help" in message
    assert not out.exists()
    prepared = prepare_camelyon16(root, out, exclude=[stem])  # the way on the error gives
    assert stem not in {**prepared.sets["train"].slides, **prepared.sets["test"].slides}


def test_a_tumour_test_slide_with_only_carved_out_regions_is_still_a_note(tmp_path, synth_slides):
    """Polygons all in another non-tumour group (_2: regions carved out alone) pass the label stage with a warning,
    so prepare keeps its note for them."""
    root = gigadb_tree(tmp_path / "c16", synth_slides)
    xml = root / "testing" / "lesion_annotations" / "Test_001.xml"
    _regroup(xml, ("_0", "_1"), "_2")
    prepared = prepare_camelyon16(root, tmp_path / "out")
    (note,) = [n for n in prepared.notes if "without a tumour area" in n]
    assert str(xml) in note and "--exclude NAME" in note
