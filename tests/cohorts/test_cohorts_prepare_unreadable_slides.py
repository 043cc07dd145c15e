"""A slide file that cannot be opened for reading, such as a link to a disk that is not mounted, is named in
prepare's one error (review AO, finding 5)."""

from __future__ import annotations

import pytest
from prepare_trees import gigadb_tree

from wsi_milssl.cohorts import prepare_camelyon16
from wsi_milssl.errors import LabelsError


def test_a_slide_link_to_a_disk_that_is_not_mounted_is_an_error_naming_it(tmp_path, synth_slides):
    """It passed, and run's advice for the missing slide then sent the user back to prepare."""
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    link = root / "testing" / "images" / "Test_003.tif"
    link.unlink()
    link.symlink_to(tmp_path / "mnt" / "disk2" / "Test_003.tif")
    with pytest.raises(LabelsError) as info:
        prepare_camelyon16(root, tmp_path / "out")
    message = str(info.value)
    assert f"1 slide file(s) cannot be opened for reading: {link} (a link to {tmp_path / 'mnt'}" in message
    assert "mount the disk or restore the file a link points to" in message and "remove the link" in message
    assert not (tmp_path / "out").exists()
