"""Review EI, C5: `prepare folder` given one folder as the training and the test set named its slides twice, once
as "in both sets" and again as "under other names (links)", though their names were the same. A slide linked into
the test set under another name is still named as a link."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from wsi_milssl.cohorts import prepare_folder
from wsi_milssl.errors import WsiMilsslError


def _folder(tmp_path, synth_slides):
    folder = tmp_path / "fl"
    folder.mkdir()
    for path in synth_slides.values():
        shutil.copy(path, folder / path.name)
    labels = folder / "labels.csv"
    labels.write_text("slide,label\n" + "".join(f"{p.stem},{int(n == 'tumor')}\n" for n, p in synth_slides.items()))
    return folder, labels


def test_one_folder_for_both_sets_is_named_once(tmp_path, synth_slides):
    folder, labels = _folder(tmp_path, synth_slides)
    with pytest.raises(WsiMilsslError) as info:
        prepare_folder(folder, labels, tmp_path / "out", test_slides_dir=folder, test_labels_csv=labels)
    message = str(info.value)
    assert f"{len(synth_slides)} slide(s) are in both the training and the test set" in message
    assert "under other names (links)" not in message


def test_a_training_slide_linked_into_the_test_set_under_another_name_is_named(tmp_path, synth_slides):
    folder, labels = _folder(tmp_path, synth_slides)
    test = tmp_path / "test"
    test.mkdir()
    normal = synth_slides["normal"]
    (test / "other_name.tif").symlink_to(folder / normal.name)
    (test / "labels.csv").write_text("slide,label\nother_name,0\n")
    with pytest.raises(WsiMilsslError) as info:
        prepare_folder(folder, labels, tmp_path / "out", test_slides_dir=test, test_labels_csv=test / "labels.csv")
    assert "1 slide file(s) are in both the training and the test set under other names (links)" in str(info.value)


def test_two_files_that_only_share_a_name_are_two_slides_each_with_its_own_patient(tmp_path, synth_slides):
    """Review EK, B1: `prepare folder` refused a training and a test folder whose slides share names (synth names
    every set synth_000, ...) though the files differ, saying they are "in both sets", where `run` counts them as
    two slides. A shared name of two files is a note now; a training copy of its test namesake (the same bytes) is
    left out of training; each set's labels keep their own patients (they were merged by name)."""
    import csv

    from prepare_trees import distinct_copy

    train, test = tmp_path / "train", tmp_path / "test"
    train.mkdir()
    test.mkdir()
    kinds = {"s0": "normal", "s1": "tumor", "s2": "normal", "s3": "tumor"}
    for name, kind in kinds.items():
        distinct_copy(synth_slides[kind], train / f"{name}.tif")
        if kind == "tumor":
            shutil.copy(synth_slides[kind].with_suffix(".xml"), train / f"{name}.xml")
    (train / "labels.csv").write_text("slide,patient,label\n" + "".join(
        f"{n},train_{n},{int(k == 'tumor')}\n" for n, k in kinds.items()))
    distinct_copy(synth_slides["tumor"], test / "s0.tif")  # another slide under a training slide's name
    shutil.copy(synth_slides["tumor"].with_suffix(".xml"), test / "s0.xml")
    shutil.copy(train / "s2.tif", test / "s2.tif")  # a copy: the same slide
    (test / "labels.csv").write_text("slide,patient,label\ns0,test_s0,1\ns2,test_s2,0\n")
    done = prepare_folder(train, train / "labels.csv", tmp_path / "out", test_slides_dir=test,
                          test_labels_csv=test / "labels.csv")
    notes = "\n".join(done.notes)
    assert "1 name(s) are used in both sets by different slide files: s0 (two slides each" in notes, notes
    assert "s2 (the same file as test slide s2)" in notes, notes
    assert "are in both the training and the test set" not in notes

    def rows(cohort_set):
        with open(cohort_set.labels_csv, newline="") as fh:
            return [tuple(r) for r in csv.reader(fh)][1:]

    assert rows(done.sets["train"]) == [("s0", "0", "train_s0"), ("s1", "1", "train_s1"), ("s3", "1", "train_s3")]
    assert rows(done.sets["test"]) == [("s0", "1", "test_s0"), ("s2", "0", "test_s2")]


@pytest.mark.parametrize("spelling", ["same", "absolute", "link"])
def test_two_slides_of_one_name_reading_one_annotation_file_are_refused(tmp_path, synth_slides, spelling,
                                                                        monkeypatch):
    """Review EN, A2: with one annotations folder for both sets, the test slide of a name both sets use read the
    training slide's annotation (its own was missing), and the FROC scored the wrong outline. Review EU, A1: the
    folder given once relative and once absolute, or through a link, was not seen as one."""
    from prepare_trees import distinct_copy

    train, test, ann = tmp_path / "train", tmp_path / "test", tmp_path / "ann"
    for folder in (train, test, ann):
        folder.mkdir()
    for name, kind in {"s0": "normal", "s1": "tumor"}.items():
        distinct_copy(synth_slides[kind], train / f"{name}.tif")
    distinct_copy(synth_slides["normal"], test / "s1.tif")  # other bytes than the training s1 (its annotation lost)
    shutil.copy(synth_slides["tumor"].with_suffix(".xml"), ann / "s1.xml")
    (train / "labels.csv").write_text("slide,label\ns0,0\ns1,1\n")
    (test / "labels.csv").write_text("slide,label\ns1,1\n")
    monkeypatch.chdir(tmp_path)
    test_ann = {"same": Path("ann"), "absolute": ann.resolve(), "link": Path("ann_link")}[spelling]
    if spelling == "link":
        (tmp_path / "ann_link").symlink_to(ann, target_is_directory=True)
    with pytest.raises(WsiMilsslError) as info:
        prepare_folder(train, train / "labels.csv", tmp_path / "out", annotations_dir=Path("ann"),
                       test_slides_dir=test, test_labels_csv=test / "labels.csv", test_annotations_dir=test_ann)
    message = str(info.value)
    assert "1 slide name(s) of both sets would read one annotation file for two different slides: s1" in message
    assert "--test-annotations" in message
