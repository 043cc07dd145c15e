"""Review BH, a CAMELYON16 download as people have it: annotations downloaded apart from the slides
(``--annotations``), downloads that did not finish, test annotations that contradict the test labels, and the
official test slides put into training by ``prepare folder``."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
from prepare_trees import gigadb_tree

from wsi_milssl.cli import main
from wsi_milssl.cohorts import prepare_camelyon16, prepare_folder
from wsi_milssl.errors import ConfigError, LabelsError


def _annotations_apart(tmp_path: Path, synth_slides) -> tuple[Path, Path]:
    root = gigadb_tree(tmp_path / "c16", synth_slides)
    apart = tmp_path / "annotations"
    apart.mkdir()
    for folder in ("training", "testing"):
        for xml in (root / folder / "lesion_annotations").glob("*.xml"):
            shutil.move(xml, apart / xml.name)
    return root, apart


def test_annotations_kept_apart_from_the_slides_are_given_with_annotations(tmp_path, synth_slides):
    """There was no --annotations for camelyon16, and its error sent users to `prepare folder`."""
    root, apart = _annotations_apart(tmp_path, synth_slides)
    with pytest.raises(LabelsError, match=r"1 tumour test slide\(s\) have no annotation .*Test_001.*Fix: .*"
                                          r"--annotations DIR when they are not below the folder; --exclude NAME"):
        prepare_camelyon16(root, tmp_path / "out")
    argv = ["prepare", "camelyon16", str(root), "--annotations", str(apart), "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    record = json.loads((tmp_path / "out" / "cohort" / "prepare.json").read_text())
    assert record["annotations"] == str(apart.resolve())
    assert record["sets"]["test"]["annotated"] == 1 and record["sets"]["train"]["annotated"] == 2
    assert f"--annotations {shlex.quote(str(apart))}" in record["command"]
    with pytest.raises(ConfigError, match=r"nope: no such folder \(--annotations\)"):
        prepare_camelyon16(root, tmp_path / "out2", annotations_dir=tmp_path / "nope")


def test_downloads_that_did_not_finish_are_named(tmp_path, synth_slides):
    """A Tumor_004.tif.part was no slide and was left out without a word (only test slides got a note)."""
    root = gigadb_tree(tmp_path / "c16", synth_slides)
    shutil.copy(root / "training" / "tumor" / "Tumor_001.tif", root / "training" / "tumor" / "Tumor_004.tif.part")
    (root / "training" / "normal" / "Normal_004.tif.crdownload").write_bytes(b"II*\x00")
    (root / "training" / "tumor" / "Tumor_002.tif.part").write_bytes(b"II*\x00")  # a leftover beside its slide
    prepared = prepare_camelyon16(root, tmp_path / "out")
    (note,) = [n for n in prepared.notes if "did not finish" in n]
    assert note == (f"2 file(s) below {root} are downloads that did not finish, so they are no slides and in no set: "
                    "training/normal/Normal_004.tif.crdownload, training/tumor/Tumor_004.tif.part (download them "
                    "again, then prepare again)")


def test_test_annotations_that_contradict_the_labels_are_named(tmp_path, synth_slides):
    """A tumour test slide whose annotation has no tumour polygon (ASAP's group "None") passed prepare, and the FROC
    counted every detection on it as a false positive; a normal test slide with a tumour annotation likewise."""
    root = gigadb_tree(tmp_path / "c16", synth_slides)
    ann = root / "testing" / "lesion_annotations"
    text = (ann / "Test_001.xml").read_text()
    assert 'PartOfGroup="_0"' in text
    (ann / "Test_001.xml").write_text(text.replace('PartOfGroup="_0"', 'PartOfGroup="None"')
                                      .replace('PartOfGroup="_1"', 'PartOfGroup="None"'))
    shutil.copy(root / "training" / "lesion_annotations" / "Tumor_001.xml", ann / "Test_002.xml")
    # review EC B1: the label stage stops at such a slide, so prepare refuses it (no more a note)
    with pytest.raises(ConfigError, match=r"1 annotation file\(s\) of tumour slides have no polygon in a tumour group "
                                          r".*Test_001\.xml \(\d+ polygon\(s\); \d+ of them (is|are) in group 'None'"
                                          r".*--exclude Test_001"):
        prepare_camelyon16(root, tmp_path / "out")
    (ann / "Test_001.xml").write_text(text)
    prepared = prepare_camelyon16(root, tmp_path / "out")
    (normal,) = [n for n in prepared.notes if "normal test slide" in n]
    assert normal.startswith("1 normal test slide(s) have tumour areas in their annotation: ") and "Test_002" in normal


def test_prepare_folder_names_official_test_slides_in_training(tmp_path, synth_slides):
    root = gigadb_tree(tmp_path / "c16", synth_slides)
    flat = tmp_path / "flat"
    flat.mkdir()
    for tif in root.rglob("*.tif"):
        shutil.copy(tif, flat / tif.name)
    for xml in root.rglob("*.xml"):
        shutil.copy(xml, flat / xml.name)
    labels = {"Normal_001": 0, "Normal_002": 0, "Tumor_001": 1, "Tumor_002": 1, "Test_001": 1, "Test_002": 0,
              "Test_003": 0}
    (flat / "labels.csv").write_text("slide,label\n" + "".join(f"{k},{v}\n" for k, v in labels.items()))
    prepared = prepare_folder(flat, flat / "labels.csv", tmp_path / "out", test_fraction=0.3)
    in_train = sorted(s for s in prepared.sets["train"].slides if s.startswith("Test_"))
    assert in_train
    (note,) = [n for n in prepared.notes if "official test" in n]
    assert note.startswith(f"{len(in_train)} slide(s) in the training set are named as CAMELYON16's official test "
                           f"slides (Test_NNN): {', '.join(in_train)} (")
    # an in-house cohort whose slides are only called test_NNN is no CAMELYON16 (review BL)
    own = tmp_path / "own"
    own.mkdir()
    for k, tif in enumerate(sorted(flat.glob("*.tif"))):
        shutil.copy(tif, own / f"test_{k:03d}.tif")
    (own / "labels.csv").write_text("slide,label\n" + "".join(f"test_{k:03d},{v}\n" for k, v in enumerate(
        labels[p.stem] for p in sorted(flat.glob("*.tif")))))
    for k, tif in enumerate(sorted(flat.glob("*.tif"))):
        if tif.with_suffix(".xml").is_file():
            shutil.copy(tif.with_suffix(".xml"), own / f"test_{k:03d}.xml")
    prepared = prepare_folder(own, own / "labels.csv", tmp_path / "out_own", test_fraction=0.3)
    assert not [n for n in prepared.notes if "official test" in n]


def test_a_loop_of_links_and_a_lesion_exclude_that_is_no_list_are_named(tmp_path):
    from wsi_milssl.config import EvaluateConfig

    with pytest.raises(ConfigError, match=r'lesion_exclude must be a list of slide names, e\.g\. \["Test_114"\]; got '
                                          r"'Test_114'"):
        EvaluateConfig(lesion_exclude="Test_114")
    from wsi_milssl.cohorts.checks import _unreadable_slides

    (tmp_path / "a.tif").symlink_to("b.tif")
    (tmp_path / "b.tif").symlink_to("a.tif")
    (tmp_path / "c.tif").symlink_to("gone.tif")
    problem = _unreadable_slides([tmp_path / "a.tif", tmp_path / "c.tif"])
    assert f"{tmp_path / 'a.tif'} (a link to b.tif, in a loop of links that never reaches a file)" in problem
    assert f"{tmp_path / 'c.tif'} (a link to gone.tif, which does not exist)" in problem


def test_a_download_in_progress_is_named_though_its_empty_slide_file_exists(tmp_path, synth_slides):
    """Review BM: a browser makes an empty Tumor_004.tif while it writes Tumor_004.tif.part; taking that empty file
    for the finished slide hid the download."""
    root = gigadb_tree(tmp_path / "c16", synth_slides)
    tumour = root / "training" / "tumor"
    shutil.copy(tumour / "Tumor_001.tif", tumour / "Tumor_004.tif.part")
    (tumour / "Tumor_004.tif").write_bytes(b"")
    shutil.copy(tumour / "Tumor_001.tif", root / "training" / "normal" / "Tumor_002.tif.part")  # another folder's
    # review EC B3: the empty file is refused (it was counted in the training set while the note said it was not)
    with pytest.raises(LabelsError, match=r"Tumor_004\.tif \(this file is empty \(0 bytes\); Tumor_004\.tif\.part "
                                          r"beside it is a download that did not finish\)"):
        prepare_camelyon16(root, tmp_path / "out")
    (tumour / "Tumor_004.tif").unlink()
    prepared = prepare_camelyon16(root, tmp_path / "out")
    (note,) = [n for n in prepared.notes if "did not finish" in n]
    assert "training/tumor/Tumor_004.tif.part" in note and "training/normal/Tumor_002.tif.part" in note
