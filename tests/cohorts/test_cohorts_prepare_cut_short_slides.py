"""Review EC B3: a slide partly downloaded under its final name (curl -C -, wget -c, a copy that stopped) passed
prepare, and tile failed on it later; an empty Tumor_003.tif beside Tumor_003.tif.part was counted in the training set
while a note said it was in no set. prepare now refuses both, naming the file and --exclude NAME."""

from __future__ import annotations

import pytest
from prepare_trees import gigadb_tree

from wsi_milssl.cohorts import prepare_camelyon16, prepare_folder
from wsi_milssl.errors import LabelsError


def test_a_slide_cut_short_under_its_final_name_is_refused(tmp_path, synth_slides):
    root = gigadb_tree(tmp_path / "c16", synth_slides)
    whole = (root / "training" / "tumor" / "Tumor_001.tif").read_bytes()
    cut = root / "training" / "tumor" / "Tumor_003.tif"
    cut.write_bytes(whole[:100_000])
    out = tmp_path / "out"
    with pytest.raises(LabelsError) as info:
        prepare_camelyon16(root, out)
    message = str(info.value)
    assert (f"1 slide file(s) are empty or cut short, as a download or copy that stopped leaves them: {cut} (this "
            "TIFF file is incomplete: its directories point to byte ") in message
    assert message.endswith("Fix: download it again, or prepare again with --exclude Tumor_003 to leave it out of "
                            "every set.")
    assert not out.exists()
    prepared = prepare_camelyon16(root, out, exclude=["Tumor_003"])
    assert "Tumor_003" not in prepared.sets["train"].slides


def test_an_empty_slide_beside_its_part_file_is_refused_not_counted(tmp_path, synth_slides):
    root = gigadb_tree(tmp_path / "c16", synth_slides)
    folder = root / "training" / "tumor"
    (folder / "Tumor_003.tif").write_bytes(b"")  # what a browser leaves while it downloads Tumor_003.tif.part
    (folder / "Tumor_003.tif.part").write_bytes((folder / "Tumor_001.tif").read_bytes()[:50_000])
    with pytest.raises(LabelsError, match=r"Tumor_003\.tif \(this file is empty \(0 bytes\); Tumor_003\.tif\.part "
                                          r"beside it is a download that did not finish\).*--exclude Tumor_003"):
        prepare_camelyon16(root, tmp_path / "out")


def test_prepare_folder_refuses_an_empty_slide(tmp_path, synth_slides):
    root = gigadb_tree(tmp_path / "c16", synth_slides)
    slides = root / "training"
    (slides / "normal" / "Normal_003.tif").write_bytes(b"")
    (slides / "labels.csv").write_text("slide,label\nNormal_001,0\nNormal_002,0\nNormal_003,0\nTumor_001,1\n"
                                       "Tumor_002,1\n")
    with pytest.raises(LabelsError, match=r"Normal_003\.tif \(this file is empty \(0 bytes\)\).*Fix: .*download it "
                                          r"again, or prepare again with --exclude Normal_003"):
        prepare_folder(slides, slides / "labels.csv", tmp_path / "out", test_fraction=0.4)
