"""Review EC C1: --annotations given the lesion_annotations.zip itself said "no such folder" of a file that exists.
Review EC C2: a normal training slide whose annotation has tumour polygons got no note (a normal test slide did)."""

from __future__ import annotations

import shlex
import shutil
import zipfile

import pytest
from prepare_trees import gigadb_tree

from wsi_milssl.cohorts import prepare_camelyon16, prepare_folder
from wsi_milssl.errors import ConfigError, WsiMilsslError


def test_annotations_given_as_the_archive_name_the_folder_to_give(tmp_path, synth_slides):
    root = gigadb_tree(tmp_path / "c16", synth_slides)
    archive = tmp_path / "downloads" / "lesion_annotations.zip"
    archive.parent.mkdir()
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("Test_001.xml", (root / "testing" / "lesion_annotations" / "Test_001.xml").read_text())
    with pytest.raises(ConfigError) as info:
        prepare_camelyon16(root, tmp_path / "out", annotations_dir=archive)
    assert str(info.value) == (f"{archive}: is a file, not a folder (--annotations). Fix: give the folder that holds "
                               f"it: --annotations {shlex.quote(str(archive.parent))}")
    assert prepare_camelyon16(root, tmp_path / "out", annotations_dir=archive.parent).sets["test"].annotations


def test_a_normal_training_slide_with_tumour_areas_is_named(tmp_path, synth_slides):
    root = gigadb_tree(tmp_path / "c16", synth_slides)
    ann = root / "training" / "lesion_annotations"
    shutil.copy(ann / "Tumor_002.xml", ann / "Normal_002.xml")
    prepared = prepare_camelyon16(root, tmp_path / "out")
    (note,) = [n for n in prepared.notes if "normal training slide" in n]
    assert note == (f"1 normal training slide(s) have tumour areas in their annotation: {ann / 'Normal_002.xml'} "
                    "(training goes by the label, normal: every patch of such a slide is a negative; check the label "
                    "or the annotation)")


def test_prepare_folder_given_an_annotation_file_for_the_folder_says_so_once(tmp_path, synth_slides):
    """Review EH, C7: `prepare folder --annotations FILE` said "annotation folder FILE does not exist" twice."""
    folder = tmp_path / "fl"
    folder.mkdir()
    for name, path in synth_slides.items():
        shutil.copy(path, folder / path.name)
    labels = folder / "labels.csv"
    labels.write_text("slide,label\n" + "".join(f"{p.stem},{int(n == 'tumor')}\n" for n, p in synth_slides.items()))
    xml = folder / "note.xml"
    xml.write_text("<ASAP_Annotations><Annotations /></ASAP_Annotations>\n")
    with pytest.raises(WsiMilsslError) as info:
        prepare_folder(folder, labels, tmp_path / "out", annotations_dir=xml)
    message = str(info.value)
    assert message.count(f"annotation folder {xml} is a file, not a folder") == 1, message
    assert "does not exist" not in message
