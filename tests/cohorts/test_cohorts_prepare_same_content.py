"""Slide files that hold the same bytes under different names (review AO, finding 4): CAMELYON16's withdrawn
Test_049 was a copy of a training slide, and its misfiled Normal_86 was re-released as Tumor_111. prepare
leaves the copies out (never refusing the download) instead of training on a test slide or on one slide
under two labels."""

from __future__ import annotations

import json

from prepare_trees import distinct_copy, gigadb_tree, same_copy

from wsi_milssl.cohorts import prepare_camelyon16, prepare_folder


def test_a_test_slide_that_is_a_copy_of_a_training_slide_keeps_it_out_of_training(tmp_path, synth_slides):
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    same_copy(root / "training" / "tumor" / "Tumor_001.tif", root / "testing" / "images" / "Test_049.tif")
    (root / "testing" / "lesion_annotations" / "Test_049.xml").write_bytes(
        (root / "training" / "lesion_annotations" / "Tumor_001.xml").read_bytes())
    (root / "testing" / "reference.csv").write_text(
        (root / "testing" / "reference.csv").read_text() + "Test_049,Tumor,Macro,\n")
    result = prepare_camelyon16(root, tmp_path / "out")
    assert sorted(result.sets["train"].slides) == ["Normal_001", "Normal_002", "Tumor_002"]
    assert "Test_049" in result.sets["test"].slides
    note = [n for n in result.notes if "same bytes as a test slide" in n]
    assert len(note) == 1 and "Tumor_001 (the same file as test slide Test_049)" in note[0]
    assert note[0] in json.loads(result.summary_json.read_text())["notes"]


def test_copies_of_one_training_slide_with_other_labels_are_all_left_out(tmp_path, synth_slides):
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    tumour = root / "training" / "tumor" / "Tumor_002.tif"
    same_copy(tumour, root / "training" / "normal" / "Normal_087.tif")
    same_copy(tumour, root / "training" / "tumor" / "Tumor_111.tif")
    same_copy(root / "training" / "normal" / "Normal_001.tif", root / "training" / "normal" / "Normal_005.tif")
    result = prepare_camelyon16(root, tmp_path / "out")
    # Tumor_002 = Normal_087 = Tumor_111 (labels differ): all out; Normal_001 = Normal_005 (same label): one kept
    assert sorted(result.sets["train"].slides) == ["Normal_001", "Normal_002", "Tumor_001"]
    conflict = [n for n in result.notes if "different labels" in n]
    assert len(conflict) == 1 and "Normal_087 (0), Tumor_002 (1), Tumor_111 (1)" in conflict[0]
    repeat = [n for n in result.notes if "same label are left out" in n]
    assert len(repeat) == 1 and "Normal_005 (the same file as Normal_001, kept)" in repeat[0]


def test_a_held_out_split_never_puts_a_copy_on_the_other_side(tmp_path, synth_slides):
    """prepare folder: copies are left out before the split, so the test set cannot hold a training slide."""
    root = tmp_path / "cohort"
    lines = ["slide,label"]
    for k in range(6):
        label = k % 2
        distinct_copy(synth_slides["tumor" if label else "normal"], root / f"s{k}.tif")
        if label:
            (root / f"s{k}.xml").write_bytes(synth_slides["tumor"].with_suffix(".xml").read_bytes())
        lines.append(f"s{k},{label}")
    for k in range(6, 10):  # copies of s1 (tumour) and s0 (normal), same labels
        same_copy(root / f"s{k % 2}.tif", root / f"s{k}.tif")
        lines.append(f"s{k},{k % 2}")
    (root / "labels.csv").write_text("\n".join(lines) + "\n")
    result = prepare_folder(root, root / "labels.csv", tmp_path / "out", test_fraction=0.5)
    kept = {*result.sets["train"].slides, *result.sets["test"].slides}
    assert kept == {"s0", "s1", "s2", "s3", "s4", "s5"}
