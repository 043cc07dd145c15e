"""Review EC B4: an interrupted `aws s3 sync` leaves <name>.tif.<8 random characters> (s3transfer's temporary file);
prepare neither recognised it nor named the lesion annotation left without its slide, so a tumour training slide was
missing without a word. Both are notes now."""

from __future__ import annotations

import shutil

from prepare_trees import distinct_copy

from wsi_milssl.cohorts import prepare_camelyon16
from wsi_milssl.cohorts.discover import _is_partial_download


def _aws_tree(root, synth_slides):
    """The AWS bucket's layout: images/ (lower-case names), annotations/, evaluation/reference.csv."""
    tumour, normal = synth_slides["tumor"], synth_slides["normal"]
    for name, source in (("normal_001", normal), ("normal_002", normal), ("tumor_001", tumour), ("tumor_002", tumour),
                         ("test_001", tumour), ("test_002", normal)):
        distinct_copy(source, root / "images" / f"{name}.tif")
    (root / "annotations").mkdir(parents=True)
    for name in ("tumor_001", "tumor_002", "test_001"):
        shutil.copy(tumour.with_suffix(".xml"), root / "annotations" / f"{name}.xml")
    (root / "evaluation").mkdir()
    (root / "evaluation" / "reference.csv").write_text("test_001,Tumor,Macro,Primary\ntest_002,Normal,,\n")
    return root


def test_an_interrupted_aws_sync_is_named_twice(tmp_path, synth_slides):
    root = _aws_tree(tmp_path / "aws", synth_slides)
    images = root / "images"
    temporary = images / "tumor_002.tif.8aF3c9B1"
    (images / "tumor_002.tif").rename(temporary)
    with open(temporary, "r+b") as fh:
        fh.truncate(200_000)
    prepared = prepare_camelyon16(root, tmp_path / "out")
    assert sorted(prepared.sets["train"].slides) == ["normal_001", "normal_002", "tumor_001"]
    (partial,) = [n for n in prepared.notes if "did not finish" in n]
    assert "images/tumor_002.tif.8aF3c9B1" in partial
    (orphan,) = [n for n in prepared.notes if "have no slide below" in n]
    assert orphan == (f"1 lesion annotation file(s) have no slide below {root}: annotations/tumor_002.xml (each "
                      "annotates a tumour slide: not downloaded, or its download stopped; download the slide and "
                      "prepare again)")


def test_an_annotation_of_an_excluded_slide_is_no_orphan_and_other_names_are_no_temporary_files(tmp_path,
                                                                                                 synth_slides):
    root = _aws_tree(tmp_path / "aws", synth_slides)
    (root / "annotations" / "notes.xml").write_text("<x/>")  # not a CAMELYON16 name: not named
    prepared = prepare_camelyon16(root, tmp_path / "out", exclude=["tumor_002"])
    assert not [n for n in prepared.notes if "have no slide below" in n]
    assert _is_partial_download(root / "Tumor_001.TIF.a1b2c3d4")
    assert not _is_partial_download(root / "Tumor_001.tif.a1b2c3d")  # 7 characters
    assert not _is_partial_download(root / "notes.txt.a1b2c3d4")
