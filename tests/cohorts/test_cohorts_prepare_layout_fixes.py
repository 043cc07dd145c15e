"""Review EC B5: layout problems of prepare camelyon16 ended with one generic fix ("download testing/reference.csv and
the lesion annotations ...") that did not fit them; each now has its own. A slide downloaded twice under one name
(GigaDB and the AWS bucket) was refused although the files are byte-identical: it is one slide now, with a note."""

from __future__ import annotations

import shutil

import pytest
from prepare_trees import distinct_copy, gigadb_tree, same_copy

from wsi_milssl.cohorts import prepare_camelyon16, prepare_folder
from wsi_milssl.errors import LabelsError

GENERIC = "download testing/reference.csv and the lesion annotations"


def test_two_different_files_of_one_name_say_keep_one(tmp_path, synth_slides):
    root = gigadb_tree(tmp_path / "c16", synth_slides)
    other = distinct_copy(synth_slides["tumor"], root / "images" / "tumor_001.tif")
    with pytest.raises(LabelsError) as info:
        prepare_camelyon16(root, tmp_path / "out")
    message = str(info.value)
    assert (f"1 name(s) used by more than one slide file, with different bytes: {other} and "
            f"{root / 'training' / 'tumor' / 'Tumor_001.tif'}") in message
    assert message.endswith("Fix: keep one of the two files (remove the other, or move it out of the folder), then "
                            "prepare again.")
    assert GENERIC not in message


def test_byte_identical_files_of_one_name_are_one_slide(tmp_path, synth_slides):
    root = gigadb_tree(tmp_path / "c16", synth_slides)
    first = root / "training" / "tumor" / "Tumor_001.tif"
    copy = same_copy(first, root / "images" / "tumor_001.tif")
    prepared = prepare_camelyon16(root, tmp_path / "out")
    assert len(prepared.sets["train"].slides) == 4
    assert [s.casefold() for s in prepared.sets["train"].slides].count("tumor_001") == 1
    (note,) = [n for n in prepared.notes if "each is one slide" in n]
    assert note == ("1 slide name(s) are used by more than one file that holds the same bytes (one slide downloaded "
                    f"twice), so each is one slide: {copy} (kept; the same bytes as {first})")


def test_prepare_folder_takes_byte_identical_files_of_one_name_as_one_slide(tmp_path, synth_slides):
    slides = tmp_path / "slides"
    for k in range(3):
        distinct_copy(synth_slides["tumor"], slides / f"t{k}.tif")
        distinct_copy(synth_slides["normal"], slides / f"n{k}.tif")
        shutil.copy(synth_slides["tumor"].with_suffix(".xml"), slides / f"t{k}.xml")
    same_copy(slides / "t0.tif", slides / "again" / "t0.tif")
    (tmp_path / "labels.csv").write_text("slide,label\n" + "".join(f"t{k},1\nn{k},0\n" for k in range(3)))
    prepared = prepare_folder(slides, tmp_path / "labels.csv", tmp_path / "out", test_fraction=0.34)
    assert len(prepared.sets["train"].slides) + len(prepared.sets["test"].slides) == 6
    assert [n for n in prepared.notes if "each is one slide" in n]


def test_two_reference_files_say_pass_reference(tmp_path, synth_slides):
    root = gigadb_tree(tmp_path / "c16", synth_slides)
    (root / "testing" / "evaluation").mkdir()
    shutil.copy(root / "testing" / "reference.csv", root / "testing" / "evaluation" / "reference.csv")
    with pytest.raises(LabelsError) as info:
        prepare_camelyon16(root, tmp_path / "out")
    message = str(info.value)
    assert "more than one reference.csv: " in message and GENERIC not in message
    assert message.endswith("Fix: pass --reference FILE to say which one holds the test labels (or remove the "
                            "others).")


def test_a_missing_reference_file_says_download_it_or_pass_reference(tmp_path, synth_slides):
    root = gigadb_tree(tmp_path / "c16", synth_slides)
    (root / "testing" / "reference.csv").unlink()
    with pytest.raises(LabelsError) as info:
        prepare_camelyon16(root, tmp_path / "out")
    assert str(info.value).endswith("Fix: download testing/reference.csv (the AWS bucket's evaluation/reference.csv) "
                                    "into the folder, or pass --reference FILE.")


def test_annotations_found_only_as_a_partial_archive_are_named(tmp_path, synth_slides):
    root = gigadb_tree(tmp_path / "c16", synth_slides)
    shutil.rmtree(root / "testing" / "lesion_annotations")
    (root / "testing" / "lesion_annotations.zip.part").write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(LabelsError) as info:
        prepare_camelyon16(root, tmp_path / "out")
    message = str(info.value)
    assert "1 tumour test slide(s) have no annotation" in message
    assert (f"Fix: {root / 'testing' / 'lesion_annotations.zip.part'} is a download that did not finish: download it "
            "again, then prepare again; or download the lesion annotations") in message
    assert GENERIC not in message
