"""``prepare camelyon16`` on the downloads as they come: the AWS bucket's layout (with its tumour masks
and tissue masks beside the slides) and a damaged member inside ``lesion_annotations.zip``.

The slides are copies of the session's tiny generated slides (tests/conftest.py), one file per name
(prepare refuses one file under two names); prepare matches names and never opens them."""

from __future__ import annotations

import csv
import json
import math
import re
import shutil
import struct
import zipfile
from pathlib import Path

import pytest

from wsi_milssl.cli import main
from wsi_milssl.cohorts import prepare_camelyon16, prepare_folder
from wsi_milssl.errors import ConfigError, LabelsError


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="") as fh:
        return list(csv.reader(fh))


def _link(source: Path, target: Path) -> None:
    """A copy of the slide ``source`` at ``target``, its name appended after the TIFF data (which readers ignore):
    prepare leaves out slide files that hold the same bytes as another, so each name gets its own."""
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(source, target)
    with open(target, "ab") as fh:
        fh.write(target.name.encode())


def _xml(k: int) -> str:
    """An ASAP XML file long enough to be compressed into many bytes: one lesion, an ellipse whose width grows
    with ``k`` (files of two ``k`` describe different regions)."""
    coords = "".join(f'<Coordinate Order="{i}" X="{1000 + round(40 * k * math.cos(i * math.pi / 100), 2)}" '
                     f'Y="{2000 + round(300 * math.sin(i * math.pi / 100), 2)}" />' for i in range(200))
    return ('<?xml version="1.0"?><ASAP_Annotations><Annotations><Annotation Name="_0" Type="Polygon" '
            f'PartOfGroup="_0"><Coordinates>{coords}</Coordinates></Annotation></Annotations></ASAP_Annotations>\n')


def aws_tree(root: Path, slides: dict[str, Path]) -> Path:
    """``aws s3 sync s3://camelyon-dataset/CAMELYON16/``: images/, masks/<name>_mask.tif,
    background_tissue/<name>_tissue.tif (every slide), annotations/, evaluation/reference.csv."""
    names = {"normal_001": "normal", "normal_002": "normal", "tumor_001": "tumor", "tumor_002": "tumor",
             "test_001": "tumor", "test_002": "normal"}
    for name, kind in names.items():
        _link(slides[kind], root / "images" / f"{name}.tif")
        _link(slides["normal"], root / "background_tissue" / f"{name}_tissue.tif")
        if kind == "tumor":
            _link(slides["normal"], root / "masks" / f"{name}_mask.tif")
            (root / "annotations").mkdir(parents=True, exist_ok=True)
            (root / "annotations" / f"{name}.xml").write_text(_xml(1))
    (root / "evaluation").mkdir(parents=True)
    (root / "evaluation" / "reference.csv").write_text("test_001,Tumor,Macro,Yes\ntest_002,Normal,,\n")
    return root


def test_aws_download_masks_and_tissue_masks_are_not_slides(tmp_path, synth_slides):
    root = aws_tree(tmp_path / "CAMELYON16", synth_slides)
    # the bucket's mask folders also hold images without the suffix now and then: not slides either
    _link(synth_slides["normal"], root / "masks" / "Tumor_002.tif")
    _link(synth_slides["normal"], root / "background_tissue" / "extra" / "TEST_002.TIF")
    result = prepare_camelyon16(root, tmp_path / "out")
    train, test = result.sets["train"], result.sets["test"]
    assert _rows(train.labels_csv) == [["slide", "label"], ["normal_001", "0"], ["normal_002", "0"],
                                       ["tumor_001", "1"], ["tumor_002", "1"]]
    assert _rows(test.labels_csv) == [["slide", "label"], ["test_001", "1"], ["test_002", "0"]]
    listed = [row[1] for row in _rows(train.slides_csv)[1:] + _rows(test.slides_csv)[1:]]
    assert all(Path(p).parent == (root / "images").resolve() for p in listed)
    assert sorted(p.name for p in train.annotations_dir.iterdir()) == ["tumor_001.xml", "tumor_002.xml"]
    summary = json.loads(result.summary_json.read_text())
    assert summary["mask_images_left_out"] == 6 + 3 + 2  # tissue masks, tumour masks, the two unsuffixed
    assert summary["sets"]["train"]["slides"] == 4 and summary["sets"]["test"]["slides"] == 2


def test_aws_download_without_test_tissue_masks_lists_six_training_slides(tmp_path, synth_slides):
    """Without the test set's tissue masks the old prepare exited 0 with normal_001_tissue,0 and
    tumor_001_tissue,1 among the training slides."""
    root = aws_tree(tmp_path / "CAMELYON16", synth_slides)
    for p in (root / "background_tissue").glob("test_*"):
        p.unlink()
    result = prepare_camelyon16(root, tmp_path / "out")
    stems = [row[0] for row in _rows(result.sets["train"].labels_csv)[1:]]
    assert stems == ["normal_001", "normal_002", "tumor_001", "tumor_002"]
    assert not any("tissue" in s or "mask" in s for s in stems)


def test_only_camelyon16_names_are_slides(tmp_path, synth_slides):
    root = aws_tree(tmp_path / "CAMELYON16", synth_slides)
    _link(synth_slides["normal"], root / "images" / "Normal_001_copy.tif")  # once counted as Normal
    _link(synth_slides["normal"], root / "images" / "tumor_a.tif")
    _link(synth_slides["normal"], root / "images" / "TUMOR_003_Tissue.tif")  # a tissue mask in any case: skipped
    with pytest.raises(LabelsError) as info:
        prepare_camelyon16(root, tmp_path / "out")
    message = str(info.value)
    assert "2 slide(s) not named as in CAMELYON16" in message
    assert "Normal_001_copy.tif" in message and "tumor_a.tif" in message
    assert "TUMOR_003_Tissue" not in message
    assert "no line in" not in message  # the tissue masks are not taken for test slides
    assert not (tmp_path / "out").exists()


def _damage_member(archive: Path, member: str) -> None:
    """Flip bytes in the middle of ``member``'s compressed data."""
    with zipfile.ZipFile(archive) as z:
        info = z.getinfo(member)
        assert info.compress_type == zipfile.ZIP_DEFLATED and info.compress_size > 200
    data = bytearray(archive.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26: info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    for i in range(start + info.compress_size // 3, start + info.compress_size // 3 + 16):
        data[i] ^= 0xA5
    archive.write_bytes(bytes(data))


def gigadb_tree(root: Path, slides: dict[str, Path]) -> Path:
    for name, kind, folder in (("Normal_001", "normal", "training/normal"), ("normal_002", "normal", "training/normal"),
                               ("Tumor_001", "tumor", "training/tumor"), ("tumor_002", "tumor", "training/tumor"),
                               ("test_001", "tumor", "testing/images"), ("Test_002", "normal", "testing/images")):
        _link(slides[kind], root / folder / f"{name}.tif")
    with zipfile.ZipFile(root / "training" / "lesion_annotations.zip", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("lesion_annotations/", "")
        z.writestr("lesion_annotations/tumor_001.xml", _xml(1))
        z.writestr("lesion_annotations/tumor_002.xml", _xml(2))
    with zipfile.ZipFile(root / "testing" / "lesion_annotations.zip", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("test_001.xml", _xml(3))
    (root / "testing" / "reference.csv").write_text("Test_001,Tumor,Macro,Yes\r\nTest_002,Normal,,\r\n")
    return root


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_damaged_archive_member_is_one_error_and_nothing_is_written(tmp_path, synth_slides, capsys):
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    archive = root / "training" / "lesion_annotations.zip"
    _damage_member(archive, "lesion_annotations/tumor_002.xml")
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as info:
        prepare_camelyon16(root, out)
    message = str(info.value)
    assert message.startswith(f"{archive}:lesion_annotations/tumor_002.xml: cannot be read")
    assert "download lesion_annotations.zip again" in message
    assert not out.exists()  # no cohort/ with the slide lists and half the annotations
    # the command line: one error line, no traceback
    assert main(["prepare", "camelyon16", str(root), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "lesion_annotations.zip:lesion_annotations/tumor_002.xml" in err and "Traceback" not in err
    assert not out.exists()


def test_damaged_archive_leaves_an_earlier_prepare_as_it_was(tmp_path, synth_slides):
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    out = tmp_path / "out"
    prepare_camelyon16(root, out)
    before = _snapshot(out)
    assert "pipeline.toml" in before and "cohort/annotations/train/tumor_002.xml" in before
    _link(synth_slides["normal"], root / "training" / "normal" / "Normal_003.tif")  # a new slide, then damage
    _damage_member(root / "testing" / "lesion_annotations.zip", "test_001.xml")
    with pytest.raises(ConfigError, match=r"lesion_annotations\.zip:test_001\.xml: cannot be read"):
        prepare_camelyon16(root, out)
    assert _snapshot(out) == before
    assert not [p for p in out.rglob(".*") if p.is_file()]  # no temporaries left


def test_truncated_archive_member_is_one_error(tmp_path, synth_slides):
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    archive = root / "training" / "lesion_annotations.zip"
    with zipfile.ZipFile(archive) as z:
        info = z.getinfo("lesion_annotations/tumor_001.xml")
    # the member's data overwritten with zeros: a CRC or inflate failure, depending on the bytes
    data = bytearray(archive.read_bytes())
    data[info.header_offset + 80: info.header_offset + 80 + 64] = bytes(64)
    archive.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"tumor_001\.xml: cannot be read .*Fix: download"):
        prepare_camelyon16(root, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_template_that_gives_no_valid_pipeline_writes_nothing(tmp_path, synth_slides):
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    template = tmp_path / "bad.toml"
    template.write_text("[tile]\nno_such_setting = 1\n")
    with pytest.raises(ConfigError) as info:
        prepare_camelyon16(root, tmp_path / "out", template=template)
    assert "nothing was written" in str(info.value) and ".tmp" not in str(info.value)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------
# Folders reached through links, several annotation files for one slide, earlier prepare outputs,
# annotation files that do not parse and archives that cannot be read
# ------------------------------------------------------------------------------------------------

def test_slides_in_linked_folders_are_found_and_a_link_loop_ends(tmp_path, synth_slides):
    """An 800 GB download spread over disks: training/tumor and testing/ are links to folders elsewhere
    (once silently left out: 'train: 2 slides (0 tumour, 2 normal)'). A link back to an ancestor is
    searched once, not forever."""
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    disk2 = tmp_path / "disk2"
    disk2.mkdir()
    (root / "training" / "tumor").rename(disk2 / "tumor")
    (root / "training" / "tumor").symlink_to(disk2 / "tumor", target_is_directory=True)
    (root / "testing").rename(disk2 / "testing")
    (root / "testing").symlink_to(disk2 / "testing", target_is_directory=True)
    (disk2 / "tumor" / "loop").symlink_to(root, target_is_directory=True)  # back to an ancestor
    result = prepare_camelyon16(root, tmp_path / "out")
    train, test = result.sets["train"], result.sets["test"]
    assert sorted(train.labels.items()) == [("Normal_001", 0), ("Tumor_001", 1), ("normal_002", 0), ("tumor_002", 1)]
    assert sorted(test.labels.items()) == [("Test_002", 0), ("test_001", 1)]
    assert sorted(test.annotations) == ["test_001"]
    # the slide lists keep the link's path (the names the user sees below ROOT)
    listed = dict(_rows(train.slides_csv)[1:])
    assert listed["Tumor_001"] == str((root / "training" / "tumor" / "Tumor_001.tif").absolute())

    from wsi_milssl.cohorts import find_slide_files

    found = find_slide_files(root)  # prepare folder's search: each slide once, not again through loop/
    assert [p.relative_to(root).as_posix() for p in found] == [
        "testing/images/Test_002.tif", "testing/images/test_001.tif",
        "training/normal/Normal_001.tif", "training/normal/normal_002.tif",
        "training/tumor/Tumor_001.tif", "training/tumor/tumor_002.tif"]


def test_two_different_annotation_files_for_one_slide_are_refused(tmp_path, synth_slides):
    """Once the first by path order was taken without a word (annotations_corrected/ sorts before
    training/): for a test slide that decides the FROC's ground truth."""
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    corrected = root / "annotations_corrected" / "tumor_001.xml"
    corrected.parent.mkdir()
    corrected.write_text(_xml(5))
    with pytest.raises(ConfigError) as info:
        prepare_camelyon16(root, tmp_path / "out")
    message = str(info.value)
    assert "tumor_001" in message and str(corrected) in message
    assert f"{root / 'training' / 'lesion_annotations.zip'}:lesion_annotations/tumor_001.xml" in message
    assert "Fix:" in message and "keep one" in message
    assert not (tmp_path / "out").exists()
    # the same file twice (extracted beside its archive) is one annotation
    corrected.write_text(_xml(1))
    result = prepare_camelyon16(root, tmp_path / "out")
    assert (result.sets["train"].annotations_dir / "Tumor_001.xml").read_text() == _xml(1)


def test_an_earlier_prepare_below_root_is_not_searched(tmp_path, synth_slides):
    """--out inside ROOT, then the download's annotation is corrected: the next prepare (into a new
    folder) took the earlier prepare's stale copy, and once a run wrote heatmaps there it refused them as
    slides 'not named as in CAMELYON16'."""
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    prepare_camelyon16(root, root / "prep1")
    heatmaps = root / "prep1" / "run" / "heatmaps" / "test"
    _link(synth_slides["normal"], heatmaps / "test_001_probs.tif")
    (root / "testing" / "lesion_annotations.zip").unlink()
    corrected = root / "testing" / "lesion_annotations" / "test_001.xml"
    corrected.parent.mkdir()
    corrected.write_text(_xml(7))
    result = prepare_camelyon16(root, root / "prep2")
    assert (result.sets["test"].annotations_dir / "test_001.xml").read_text() == _xml(7)
    assert result.sets["test"].annotations == {"test_001": str(corrected)}
    assert sorted(result.sets["test"].slides) == ["Test_002", "test_001"]


def test_annotation_files_that_do_not_parse_are_one_error_naming_the_downloaded_files(tmp_path, synth_slides,
                                                                                       capsys):
    """A truncated XML and one with a DOCTYPE once passed prepare and failed only at run's label stage,
    after tiling, one set at a time, naming the copy in cohort/annotations/ (which the next prepare
    overwrites) instead of the downloaded file."""
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    out = tmp_path / "out"
    prepare_camelyon16(root, out)
    before = _snapshot(out)
    (root / "training" / "lesion_annotations.zip").unlink()
    loose = root / "training" / "lesion_annotations"
    loose.mkdir()
    (loose / "tumor_001.xml").write_text(_xml(1))
    (loose / "tumor_002.xml").write_text('<?xml version="1.0"?><!DOCTYPE x [<!ENTITY a "a">]>'
                                         "<ASAP_Annotations><Annotations /></ASAP_Annotations>\n")
    archive = root / "testing" / "lesion_annotations.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("test_001.xml", _xml(3)[:2000])  # a complete archive holding a truncated file
    with pytest.raises(ConfigError) as info:
        prepare_camelyon16(root, out)
    message = str(info.value)
    assert message.startswith("2 annotation files cannot be used")
    assert f"{loose / 'tumor_002.xml'}: refused XML with a DOCTYPE" in message
    assert f"{archive}:test_001.xml: not well-formed XML" in message
    assert str(out / "cohort") not in message and "Fix:" in message  # the downloaded files, not the copies
    assert _snapshot(out) == before
    assert main(["prepare", "camelyon16", str(root), "--out", str(tmp_path / "out2")]) == 1
    err = capsys.readouterr().err
    assert "tumor_002.xml" in err and "test_001.xml" in err and "Traceback" not in err
    assert not (tmp_path / "out2").exists()


def test_prepare_folder_reads_its_annotations_before_writing(tmp_path, synth_slides):
    slides = tmp_path / "slides"
    for name, kind in (("n1", "normal"), ("n2", "normal"), ("t1", "tumor"), ("t2", "tumor")):
        _link(synth_slides[kind], slides / f"{name}.tif")
    (slides / "t1.geojson").write_text('{"type": "FeatureCollection", "features": [')
    (slides / "t2.xml").write_text(_xml(1))
    labels = tmp_path / "labels.csv"
    labels.write_text("n1,0\nn2,0\nt1,1\nt2,1\n")
    with pytest.raises(ConfigError, match=r"t1\.geojson: .*Nothing was written") as info:
        prepare_folder(slides, labels, tmp_path / "out", test_fraction=0.5, seed=0)
    assert "t2.xml" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_an_archive_that_cannot_be_read_is_an_error(tmp_path, synth_slides):
    """A partly downloaded lesion_annotations.zip was a warning ('not read (File is not a zip file)') and
    prepare went on with no training annotations; a damaged member of a complete archive was an error."""
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    archive = root / "training" / "lesion_annotations.zip"
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    with pytest.raises(ConfigError) as info:
        prepare_camelyon16(root, tmp_path / "out")
    message = str(info.value)
    assert message.startswith(f"{archive}: cannot be read")
    assert "download lesion_annotations.zip again" in message
    assert not (tmp_path / "out").exists()


def test_prepare_into_root_itself_can_run_again(tmp_path, synth_slides):
    """--out ROOT: the second prepare found its own cohort/annotations/ copy beside a corrected download
    ('2 different annotation files ... keep one') and its run's heatmap TIFFs as slides 'not named as in
    CAMELYON16'; the folder's own cohort/ and run/ are left out now, the rest of it is still searched."""
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    first = prepare_camelyon16(root, root)
    assert sorted(first.sets["test"].slides) == ["Test_002", "test_001"]
    (root / "testing" / "lesion_annotations.zip").unlink()
    corrected = root / "testing" / "lesion_annotations" / "test_001.xml"
    corrected.parent.mkdir()
    corrected.write_text(_xml(7))
    _link(synth_slides["normal"], root / "run" / "heatmaps" / "test" / "test_001_probs.ome.tif")
    again = prepare_camelyon16(root, root)
    assert again.sets["test"].annotations == {"test_001": str(corrected)}
    assert (again.sets["test"].annotations_dir / "test_001.xml").read_text() == _xml(7)
    assert sorted(again.sets["train"].slides) == ["Normal_001", "Tumor_001", "normal_002", "tumor_002"]
    assert sorted(again.sets["test"].slides) == ["Test_002", "test_001"]


def test_prepare_folder_into_the_slides_folder_can_run_again(tmp_path, synth_slides):
    slides = tmp_path / "cohort"
    for name, kind in (("n1", "normal"), ("n2", "normal"), ("t1", "tumor"), ("t2", "tumor")):
        _link(synth_slides[kind], slides / f"{name}.tif")
        if kind == "tumor":
            (slides / f"{name}.xml").write_text(_xml(1))
    labels = slides / "labels.csv"
    labels.write_text("n1,0\nn2,0\nt1,1\nt2,1\n")
    first = prepare_folder(slides, labels, slides, test_fraction=0.5, seed=0)
    (slides / "t1.xml").write_text(_xml(4))
    (slides / "t2.xml").write_text(_xml(5))
    _link(synth_slides["normal"], slides / "run" / "heatmaps" / "test" / "t1_probs.ome.tif")
    again = prepare_folder(slides, labels, slides, test_fraction=0.5, seed=0)
    assert again.sets["test"].slides == first.sets["test"].slides
    assert sorted({**again.sets["train"].annotations, **again.sets["test"].annotations}.values()) == [
        str(slides / "t1.xml"), str(slides / "t2.xml")]


def test_an_unrelated_archive_that_cannot_be_read_is_a_warning(tmp_path, synth_slides, caplog):
    """Since 4401871 any unreadable .zip below ROOT stopped prepare ('download other_download.zip again, or
    remove it'). Only an archive that may hold annotations stops it: named so (annotation(s), lesion, also
    its folders below ROOT), beside loose annotation files, or below a folder given as --annotations."""
    import logging

    root = gigadb_tree(tmp_path / "C16", synth_slides)
    other = root / "other_download.zip"
    other.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 40)
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.cohorts.prepare"):
        result = prepare_camelyon16(root, tmp_path / "out")
    assert sorted(result.sets["train"].annotations) == ["Tumor_001", "tumor_002"]
    assert any(str(other) in r.getMessage() and "not read" in r.getMessage() for r in caplog.records)

    for archive in (root / "CAMELYON16_Annotations.zip", root / "lesions" / "part1.zip"):
        archive.parent.mkdir(exist_ok=True)
        archive.write_bytes(other.read_bytes())
        with pytest.raises(ConfigError, match=rf"^{re.escape(str(archive))}: cannot be read .*download {re.escape(archive.name)} again"):
            prepare_camelyon16(root, tmp_path / "out2")
        archive.unlink()
    beside = root / "testing" / "xml" / "more.zip"  # beside loose annotation files
    beside.parent.mkdir()
    (beside.parent / "test_009.xml").write_text(_xml(1))
    beside.write_bytes(other.read_bytes())
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(beside))}: cannot be read"):
        prepare_camelyon16(root, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def test_an_unreadable_archive_in_a_given_annotations_folder_is_an_error(tmp_path, synth_slides):
    slides, ann = tmp_path / "slides", tmp_path / "ann"
    for name, kind in (("n1", "normal"), ("n2", "normal"), ("t1", "tumor"), ("t2", "tumor")):
        _link(synth_slides[kind], slides / f"{name}.tif")
    ann.mkdir()
    labels = tmp_path / "labels.csv"
    labels.write_text("n1,0\nn2,0\nt1,1\nt2,1\n")
    with zipfile.ZipFile(ann / "batch.zip", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("t1.xml", _xml(1))
        z.writestr("t2.xml", _xml(2))
    (ann / "batch.zip").write_bytes((ann / "batch.zip").read_bytes()[:100])
    with pytest.raises(ConfigError, match=r"batch\.zip: cannot be read"):
        prepare_folder(slides, labels, tmp_path / "out", annotations_dir=ann, test_fraction=0.5, seed=0)
    assert not (tmp_path / "out").exists()
