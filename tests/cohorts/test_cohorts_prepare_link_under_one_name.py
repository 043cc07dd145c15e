"""Review EH, B3: one slide file reached under one name twice (``images/tumor_001.tif``, a link to
``training/tumor/Tumor_001.tif``) was called two files "with different bytes", and the fix to remove one of them
could delete the link's target. It is the links problem, whose fix is to keep one name per slide file."""

from __future__ import annotations

import pytest

from wsi_milssl.cohorts import prepare_camelyon16
from wsi_milssl.errors import WsiMilsslError

from prepare_trees import gigadb_tree


def test_a_link_under_the_same_name_is_named_a_link_not_a_different_file(tmp_path, synth_slides):
    root = gigadb_tree(tmp_path / "c16", synth_slides)
    (root / "images").mkdir()
    (root / "images" / "tumor_001.tif").symlink_to(root / "training" / "tumor" / "Tumor_001.tif")
    with pytest.raises(WsiMilsslError) as info:
        prepare_camelyon16(root, tmp_path / "out")
    message = str(info.value)
    assert "reached under more than one name (links)" in message and "keep one name per slide file" in message
    assert "different bytes" not in message
    assert not (tmp_path / "out").exists()


def test_a_link_beside_its_target_and_a_copy_are_one_slide_and_a_link(tmp_path):
    """Review EI, B5: a link beside its target and a byte copy of it were called files of different bytes."""
    from wsi_milssl.cohorts.checks import _linked_twice, _same_name_slides

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    target = tmp_path / "a" / "tumor_001.tif"
    target.write_bytes(b"slide bytes" * 100)
    (tmp_path / "b" / "Tumor_001.tif").symlink_to(target)
    (tmp_path / "c" / "tumor_001.tif").write_bytes(target.read_bytes())
    kept, problem, note = _same_name_slides([target, tmp_path / "b" / "Tumor_001.tif", tmp_path / "c" / "tumor_001.tif"])
    assert problem is None and "the same bytes" in note
    assert tmp_path / "c" / "tumor_001.tif" not in kept and target in kept
    assert "reached under more than one name (links)" in _linked_twice(kept)
