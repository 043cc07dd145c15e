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
