"""Review EC B2: a CAMELYON16 training set without normal slides passed prepare, with a note advising
select_metric = "bag_nll"; `run` then tiled and labelled every slide before train refused it (no negative bag).
prepare now refuses a training set of one class at once, naming what is missing and where to download it."""

from __future__ import annotations

import shutil

import pytest
from prepare_trees import distinct_copy, gigadb_tree

from wsi_milssl.cohorts import prepare_camelyon16, prepare_folder
from wsi_milssl.errors import LabelsError


def test_a_training_set_without_normal_slides_is_refused(tmp_path, synth_slides):
    root = gigadb_tree(tmp_path / "c16", synth_slides)
    shutil.rmtree(root / "training" / "normal")
    out = tmp_path / "out"
    with pytest.raises(LabelsError) as info:
        prepare_camelyon16(root, out)
    message = str(info.value)
    assert ("no Normal_NNN training slide: MIL-SSL learns negatives from normal slides (its negative bags), and the "
            "2 training slide(s) found are all tumour") in message
    assert "Fix: download training/normal/ (the AWS bucket's images/normal_NNN.tif), then prepare again." in message
    assert "bag_nll" not in message and not out.exists()


def test_a_training_set_without_tumour_slides_is_refused(tmp_path, synth_slides):
    root = gigadb_tree(tmp_path / "c16", synth_slides)
    shutil.rmtree(root / "training" / "tumor")
    shutil.rmtree(root / "training" / "lesion_annotations")
    with pytest.raises(LabelsError, match=r"no Tumor_NNN training slide: MIL-SSL learns tumour from the tumour slides "
                                          r".*Fix: download training/tumor/ and training/lesion_annotations/"):
        prepare_camelyon16(root, tmp_path / "out")


def test_only_tumour_training_slides_name_the_missing_normal_slides_too(tmp_path, synth_slides):
    """With the test set missing as well, the error named only the test set."""
    root = gigadb_tree(tmp_path / "c16", synth_slides)
    shutil.rmtree(root / "training" / "normal")
    shutil.rmtree(root / "testing")
    with pytest.raises(LabelsError, match=r"no test slide \(Test_NNN\) found; no Normal_NNN training slide"):
        prepare_camelyon16(root, tmp_path / "out")


def test_prepare_folder_refuses_a_training_set_of_one_class(tmp_path, synth_slides):
    train, test = tmp_path / "train", tmp_path / "test"
    for k in range(2):
        distinct_copy(synth_slides["tumor"], train / f"t{k}.tif")
        distinct_copy(synth_slides["tumor"], test / f"x{k}.tif")
    distinct_copy(synth_slides["normal"], test / "n0.tif")
    (train / "labels.csv").write_text("slide,label\nt0,1\nt1,1\n")
    (test / "labels.csv").write_text("slide,label\nx0,0\nx1,0\nn0,0\n")
    with pytest.raises(LabelsError, match=r"no normal \(label 0\) training slide: .*Fix: add normal slides to "):
        prepare_folder(train, train / "labels.csv", tmp_path / "out", test_slides_dir=test,
                       test_labels_csv=test / "labels.csv")


def test_normal_slides_left_out_with_exclude_are_named_as_the_way_back(tmp_path, synth_slides):
    """Review EH, C6: with the normal slides there but left out by --exclude, the fix said to download them."""
    root = gigadb_tree(tmp_path / "c16", synth_slides)
    normals = sorted(p.stem for p in (root / "training" / "normal").glob("*.tif"))
    with pytest.raises(LabelsError) as info:
        prepare_camelyon16(root, tmp_path / "out", exclude=normals)
    assert ("(the AWS bucket's images/normal_NNN.tif) (or, if --exclude left them out, drop them from --exclude), "
            "then prepare again." in str(info.value)), info.value
