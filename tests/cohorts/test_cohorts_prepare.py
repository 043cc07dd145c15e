"""``wsi-milssl prepare``: a cohort folder as downloaded -> slide lists, labels, annotations, a ready pipeline.

The slide files here are empty placeholders: prepare matches names and never opens a slide (the
end-to-end test with real generated slides is tests/pipeline/test_pipeline_camelyon16.py)."""

from __future__ import annotations

import csv
import shlex
import zipfile
from pathlib import Path

import pytest

from wsi_milssl.cli import main
from wsi_milssl.cohorts import prepare_camelyon16, prepare_folder
from wsi_milssl.config import load_toml
from wsi_milssl.errors import LabelsError
from wsi_milssl.pipeline import load_pipeline

XML = "<ASAP_Annotations><Annotations /></ASAP_Annotations>\n"


def _touch(path: Path, text: str | None = None) -> Path:
    """``path`` holding ``text``; by default a placeholder slide: not empty (prepare refuses an empty slide file,
    review EC B3) and distinct from every other (identical slide files are one slide)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"placeholder slide {path}" if text is None else text)
    return path


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="") as fh:
        return list(csv.reader(fh))


def camelyon16_tree(root: Path) -> Path:
    """CAMELYON16 as downloaded (GigaDB layout), names in the mixed case of the real files."""
    _touch(root / "training" / "normal" / "normal_001.tif")
    _touch(root / "training" / "normal" / "Normal_002.tif")
    _touch(root / "training" / "tumor" / "tumor_001.tif")
    _touch(root / "training" / "tumor" / "Tumor_002.tif")
    _touch(root / "training" / "lesion_annotations" / "Tumor_001.xml", XML)
    with zipfile.ZipFile(_touch(root / "training" / "lesion_annotations.zip").parent / "lesion_annotations.zip",
                         "w") as archive:
        archive.writestr("lesion_annotations/TUMOR_002.xml", XML.replace("<Annotations />", "<Annotations/>"))
    _touch(root / "training" / "masks" / "Tumor_001_Mask.tif")  # a mask, not a slide
    _touch(root / "testing" / "images" / "test_001.tif")
    _touch(root / "testing" / "images" / "Test_002.tif")
    _touch(root / "testing" / "lesion_annotations" / "Test_001.xml", XML)
    _touch(root / "testing" / "reference.csv",
           "Test_001,Tumor,Macro,Yes\r\nTest_002,Normal,,\r\nTest_003,Tumor,Micro,No\r\n")  # Test_003 not downloaded
    return root


def test_camelyon16_as_downloaded_becomes_a_ready_pipeline(tmp_path):
    root = camelyon16_tree(tmp_path / "CAMELYON16")
    out = tmp_path / "prepared"
    result = prepare_camelyon16(root, out)
    train, test = result.sets["train"], result.sets["test"]
    assert _rows(train.labels_csv) == [["slide", "label"], ["normal_001", "0"], ["Normal_002", "0"],
                                       ["tumor_001", "1"], ["Tumor_002", "1"]]
    assert _rows(test.labels_csv) == [["slide", "label"], ["test_001", "1"], ["Test_002", "0"]]
    paths = dict(_rows(train.slides_csv)[1:])
    assert paths["tumor_001"] == str((root / "training" / "tumor" / "tumor_001.tif").resolve())
    # annotations found by name in any case, loose or zipped, written under the slide's own name
    assert sorted(p.name for p in train.annotations_dir.iterdir()) == ["Tumor_002.xml", "tumor_001.xml"]
    assert (train.annotations_dir / "Tumor_002.xml").read_text() == XML.replace("<Annotations />", "<Annotations/>")
    assert [p.name for p in test.annotations_dir.iterdir()] == ["test_001.xml"]
    # the pipeline: template settings kept, [data] pointing at these files, outputs in OUT/run
    spec = load_pipeline(result.pipeline_toml)
    assert spec.out_dir == (out / "run").resolve()
    assert spec.sets["train"].slides == train.slides_csv.resolve()
    assert spec.sets["test"].labels == test.labels_csv.resolve()
    assert spec.sets["test"].annotations == test.annotations_dir.resolve()
    assert spec.val_fraction == 0.2
    raw = load_toml(result.pipeline_toml)
    template = load_toml(Path(__file__).resolve().parents[2] / "pipelines" / "camelyon16.toml")
    for table in ("tile", "label", "train", "heatmap", "evaluate"):
        assert raw[table] == template[table], table
    # the FROC of the challenge's own script (margin and ITC limit at 0.243 µm/px on every slide)
    assert spec.section("evaluate")["froc_mpp"] == 0.243
    # tile reads the slide list as it is
    from wsi_milssl.tiling import find_slides

    assert [p.name for p in find_slides([spec.sets["train"].slides])] == [
        "normal_001.tif", "Normal_002.tif", "tumor_001.tif", "Tumor_002.tif"]


def test_test_slides_of_reference_csv_that_are_not_there_are_a_warning_and_a_note(tmp_path, caplog):
    """An interrupted download leaves ``test_003.tif.part`` (no slide): the test set leaves Test_003 out,
    which used to be said only with -v. Now it is a warning and a note in prepare.json, as for prepare folder."""
    import json
    import logging

    root = camelyon16_tree(tmp_path / "c16")
    _touch(root / "testing" / "images" / "test_003.tif.part")
    with caplog.at_level(logging.WARNING):
        result = prepare_camelyon16(root, tmp_path / "out")
    assert sorted(result.sets["test"].slides) == ["Test_002", "test_001"]
    ref = root / "testing" / "reference.csv"
    note = next(n for n in result.notes if "reference.csv" in n)
    assert note == (f"1 test slide(s) of {ref} are not below {root}, so the test set leaves them out: Test_003 (not "
                    "downloaded, or the download stopped: a partial file such as Test_NNN.tif.part is no slide; "
                    "download them and prepare again)")
    assert note in [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert note in json.loads(result.summary_json.read_text())["notes"]


def test_every_problem_is_listed_in_one_error(tmp_path):
    root = camelyon16_tree(tmp_path / "c16")
    _touch(root / "testing" / "images" / "Test_004.tif")             # not in reference.csv
    _touch(root / "testing" / "images" / "Test_003.tif")             # a tumour test slide without annotation
    _touch(root / "extra" / "slide_x.svs")                           # not a CAMELYON16 name
    with pytest.raises(LabelsError) as info:
        prepare_camelyon16(root, tmp_path / "out")
    message = str(info.value)
    assert "1 test slide(s) have no line in" in message and "Test_004" in message
    assert "not named as in CAMELYON16" in message and "slide_x.svs" in message
    assert "1 tumour test slide(s) have no annotation" in message and "Test_003" in message
    assert "Fix:" in message
    assert not (tmp_path / "out" / "pipeline.toml").exists()


def test_cli_prepare_camelyon16_then_a_clear_error(tmp_path, capsys):
    root = camelyon16_tree(tmp_path / "c16")
    assert main(["prepare", "camelyon16", str(root), "--out", str(tmp_path / "out"), "--val-fraction", "0.5"]) == 0
    printed = capsys.readouterr().out
    assert "train: 4 slides (2 tumour, 2 normal), 2 annotated" in printed
    assert f"wsi-milssl run {shlex.quote(str(tmp_path / 'out' / 'pipeline.toml'))}" in printed
    assert load_pipeline(tmp_path / "out" / "pipeline.toml").val_fraction == 0.5
    (root / "testing" / "reference.csv").unlink()
    assert main(["prepare", "camelyon16", str(root), "--out", str(tmp_path / "out2")]) == 1
    assert "reference.csv" in capsys.readouterr().err


def test_prepare_folder_holds_out_a_stratified_test_set(tmp_path):
    slides = tmp_path / "cohort"
    for i in range(8):
        _touch(slides / ("pos" if i % 2 else "neg") / f"case_{i:02d}.svs")
        if i % 2:
            _touch(tmp_path / "ann" / "nested" / f"CASE_{i:02d}.geojson", '{"type": "FeatureCollection", "features": []}')
    labels = _touch(tmp_path / "labels.csv",
                    "\ufeffslide,label\r\n" + "".join(f"Case_{i:02d},{'Tumor' if i % 2 else 'Normal'}\r\n"
                                                      for i in range(8)) + "case_99,1\r\n")
    result = prepare_folder(slides, labels, tmp_path / "out", annotations_dir=tmp_path / "ann", test_fraction=0.25,
                            seed=3)
    train, test = result.sets["train"], result.sets["test"]
    assert len(test.slides) == 2 and test.n_tumor == 1  # one of each class
    assert len(train.slides) == 6 and not set(train.slides) & set(test.slides)
    again = prepare_folder(slides, labels, tmp_path / "out2", annotations_dir=tmp_path / "ann", test_fraction=0.25,
                           seed=3)
    assert set(again.sets["test"].slides) == set(test.slides)  # seeded
    tumour_test = next(s for s, v in test.labels.items() if v == 1)
    assert (test.annotations_dir / f"{tumour_test}.geojson").is_file()
    assert load_pipeline(result.pipeline_toml).name == "out"

    # review EV, C2: a second prepare (or a run) into a folder another holds was not refused; the last won file by file
    from processes import hold_lock, release

    from wsi_milssl.errors import FolderLockedError

    holder = hold_lock(tmp_path / "out2")
    try:
        with pytest.raises(FolderLockedError, match=rf"{tmp_path / 'out2'}: another wsi-milssl run \(pid {holder.pid}"):
            prepare_folder(slides, labels, tmp_path / "out2", annotations_dir=tmp_path / "ann", test_fraction=0.25,
                           seed=3)
    finally:
        release(holder)

    unlabelled = _touch(tmp_path / "few.csv", "case_00,0\ncase_01,1\n")
    with pytest.raises(LabelsError, match=r"6 slide\(s\) have no label in .*few\.csv: case_02, case_03"):
        prepare_folder(slides, unlabelled, tmp_path / "out3", annotations_dir=tmp_path / "ann")


def test_the_recorded_command_prepares_the_same_cohort_again_from_another_folder(tmp_path, monkeypatch, capsys):
    """prepare.json's command (which tile quotes as the fix for slides gone from the lists) once held only
    --slides, --labels and --out, as typed: run again it changed the pipeline's name, val_fraction and the
    test split, and its relative paths did not resolve from another folder."""
    import json
    import shlex

    work = tmp_path / "work"
    for i in range(8):
        _touch(work / "fo" / f"case {i:02d}.svs")  # a space: the command is quoted
        if i % 2:
            _touch(work / "ann" / f"case {i:02d}.xml", XML)
    _touch(work / "fo" / "labels.csv", "".join(f"case {i:02d},{i % 2}\n" for i in range(8)))
    template = _touch(work / "t.toml", "[data]\nval_fraction = 0.2\n\n[tile]\npatch_size_px = 32\n")
    monkeypatch.chdir(work)
    assert main(["prepare", "folder", "--slides", "fo", "--labels", "fo/labels.csv", "--annotations", "ann",
                 "--test-fraction", "0.5", "--seed", "7", "--val-fraction", "0.3", "--name", "mycohort",
                 "--template", "t.toml", "--out", "pf"]) == 0
    command = json.loads((work / "pf" / "cohort" / "prepare.json").read_text())["command"]
    words = shlex.split(command)
    assert words[:3] == ["wsi-milssl", "prepare", "folder"]
    for flag, value in (("--slides", work / "fo"), ("--labels", work / "fo" / "labels.csv"), ("--annotations", work / "ann"),
                        ("--template", template), ("--out", work / "pf")):
        assert Path(words[words.index(flag) + 1]) == value
    for flag, value in (("--test-fraction", "0.5"), ("--seed", "7"), ("--val-fraction", "0.3"), ("--name", "mycohort")):
        assert words[words.index(flag) + 1] == value
    assert f"# Written by `{command}`" in (work / "pf" / "pipeline.toml").read_text()
    before = {p.name: p.read_bytes() for p in (work / "pf" / "cohort").glob("*.csv")}
    pipeline = load_pipeline(work / "pf" / "pipeline.toml")
    monkeypatch.chdir(tmp_path)
    assert main(words[1:]) == 0  # the command as recorded, from another folder
    assert {p.name: p.read_bytes() for p in (work / "pf" / "cohort").glob("*.csv")} == before
    again = load_pipeline(work / "pf" / "pipeline.toml")
    assert (again.name, again.val_fraction) == (pipeline.name, pipeline.val_fraction) == ("mycohort", 0.3)


def test_the_recorded_camelyon16_command_keeps_its_options(tmp_path, monkeypatch):
    import json
    import shlex

    root = camelyon16_tree(tmp_path / "c16")
    reference = _touch(tmp_path / "ref.csv", "Test_001,Tumor\nTest_002,Normal\n")
    monkeypatch.chdir(tmp_path)
    prepare_camelyon16(Path("c16"), Path("out"), reference=Path("ref.csv"), val_fraction=0.4)
    words = shlex.split(json.loads((tmp_path / "out" / "cohort" / "prepare.json").read_text())["command"])
    assert words[:4] == ["wsi-milssl", "prepare", "camelyon16", str(root)]
    assert Path(words[words.index("--out") + 1]) == tmp_path / "out"
    assert Path(words[words.index("--reference") + 1]) == reference
    assert words[words.index("--val-fraction") + 1] == "0.4"
    assert "--template" not in words  # not given: the packaged default
