"""Review EI, C5: `prepare folder` given one folder as the training and the test set named its slides twice, once
as "in both sets" and again as "under other names (links)", though their names were the same. A slide linked into
the test set under another name is still named as a link."""

from __future__ import annotations

import shutil

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
