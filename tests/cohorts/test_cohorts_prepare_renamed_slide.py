"""Review EC C3: an old download that holds Normal_086 and Tumor_111 (one file under its old and its new name) lost
both, as identical slides with different labels, and asked the user to find out which label is right, which prepare
knows: Normal_086 was renamed Tumor_111."""

from __future__ import annotations

from prepare_trees import distinct_copy, gigadb_tree, same_copy

from wsi_milssl.cohorts import prepare_camelyon16


def test_the_old_name_of_a_renamed_slide_is_left_out_and_the_new_one_kept(tmp_path, synth_slides):
    root = gigadb_tree(tmp_path / "c16", synth_slides)
    new = distinct_copy(synth_slides["tumor"], root / "training" / "tumor" / "Tumor_111.tif")
    same_copy(new, root / "training" / "normal" / "Normal_086.tif")
    prepared = prepare_camelyon16(root, tmp_path / "out")
    train = prepared.sets["train"]
    assert train.labels["Tumor_111"] == 1 and "Normal_086" not in train.slides
    assert not [n for n in prepared.notes if "different labels" in n]
    (note,) = [n for n in prepared.notes if "the name the organisers replaced" in n]
    assert note.endswith(": Normal_086 (the same file as Tumor_111)")
