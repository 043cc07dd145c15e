"""prepare --exclude: slides left out of every set by name, from a read-only download (review AO, finding 6)."""

from __future__ import annotations

import json
import shlex

import pytest
from prepare_trees import distinct_copy, gigadb_tree

from wsi_milssl.cli import main
from wsi_milssl.cohorts import prepare_camelyon16, prepare_folder
from wsi_milssl.errors import LabelsError


def test_exclude_leaves_a_test_slide_out_of_a_read_only_download(tmp_path, capsys, synth_slides):
    """Papers leave out Test_114 (not exhaustively annotated); there was no way short of copying the download."""
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    out = tmp_path / "out"
    assert main(["prepare", "camelyon16", str(root), "--exclude", "TEST_003.tif", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "excluded: 1 slide(s) left out of every set (--exclude): Test_003" in printed
    assert "note:" not in printed  # its reference.csv line is not 'not downloaded'
    record = json.loads((out / "cohort" / "prepare.json").read_text())
    assert record["excluded"] == ["Test_003"]
    assert "Test_003" not in (out / "cohort" / "test_slides.csv").read_text()
    assert "Test_003" not in (out / "cohort" / "test_labels.csv").read_text()
    words = shlex.split(record["command"])
    assert words[words.index("--exclude") + 1] == "TEST_003.tif"
    # the recorded command prepares the same cohort again
    assert main(words[1:]) == 0
    assert json.loads((out / "cohort" / "prepare.json").read_text())["excluded"] == ["Test_003"]


def test_an_excluded_slide_needs_no_reference_line(tmp_path, synth_slides):
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    reference = tmp_path / "reference_without_003.csv"
    reference.write_text("Test_001,Tumor,Macro,\nTest_002,Normal,,\n")
    result = prepare_camelyon16(root, tmp_path / "out", reference=reference, exclude=["test_003"])
    assert sorted(result.sets["test"].slides) == ["Test_001", "Test_002"]
    assert result.excluded == ("Test_003",)


def test_an_exclude_name_of_no_slide_is_an_error_naming_it(tmp_path, synth_slides):
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    with pytest.raises(LabelsError, match=r"--exclude names 1 slide\(s\) that are not below .*: Test_114 "):
        prepare_camelyon16(root, tmp_path / "out", exclude=["Test_114", "Test_003"])
    root2 = tmp_path / "cohort"
    for k, label in enumerate((0, 0, 1, 1)):
        distinct_copy(synth_slides["tumor" if label else "normal"], root2 / f"s{k}.tif")
    (root2 / "labels.csv").write_text("slide,label\ns0,0\ns1,0\ns2,1\ns3,1\n")
    with pytest.raises(LabelsError, match=r"--exclude names 1 slide\(s\) that are not below .*: nope ") as err:
        prepare_folder(root2, root2 / "labels.csv", tmp_path / "out2", exclude=["nope"])
    # the fix is this problem's, not the layout's list of every fix (it asked to add label lines and annotations)
    assert str(err.value).endswith("Fix: check the names given to --exclude against the slide files.")


def test_the_slides_the_organisers_removed_are_notes_not_missing_downloads_or_unknown_excludes(tmp_path, capsys,
                                                                                                synth_slides):
    """Review CR: papers leave out Test_049 (a duplicate slide), but the release no longer holds it: `--exclude
    Test_049` stopped prepare as a name of no slide, and a reference.csv that lists it asked to download it."""
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    with (root / "testing" / "reference.csv").open("a") as f:
        f.write("Test_049,Normal,,\nTest_077,Normal,,\n")
    out = tmp_path / "out"
    assert main(["prepare", "camelyon16", str(root), "--exclude", "test_049", "Test_003", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "--exclude names 1 slide(s) the organisers removed from the release, so there is nothing to leave " \
           "out: Test_049 (a duplicate slide)" in printed
    assert json.loads((out / "cohort" / "prepare.json").read_text())["excluded"] == ["Test_003"]
    # the reference line of a removed slide is said so; another slide not below the folder is a download
    result = prepare_camelyon16(root, tmp_path / "out2")
    notes = "\n".join(result.notes)
    assert "lists 1 slide(s) the organisers removed from the release, so the test set leaves them out: " \
           "Test_049 (a duplicate slide)" in notes
    assert "1 test slide(s) of" in notes and ": Test_077 (not downloaded" in notes
    assert "Test_049 (not downloaded" not in notes
    # a name of no slide that the organisers did not remove is still an error
    with pytest.raises(LabelsError, match=r"--exclude names 1 slide\(s\) that are not below .*: Test_048 "):
        prepare_camelyon16(root, tmp_path / "out3", exclude=["Test_049", "Test_048"])


def test_the_command_shows_each_note_once_and_the_log_file_keeps_it(tmp_path, capsys, caplog, synth_slides):
    """Review CS: `prepare` printed every note twice on a terminal: a `note:` line on stdout and the same text as a
    WARNING on stderr. The library still warns (PreparedCohort.notes and a warning), the command prints it once."""
    import logging

    from wsi_milssl.cohorts import write

    root = gigadb_tree(tmp_path / "C16", synth_slides)
    with (root / "testing" / "reference.csv").open("a") as f:
        f.write("Test_077,Normal,,\n")
    log = tmp_path / "prepare.log"
    assert main(["prepare", "camelyon16", str(root), "--out", str(tmp_path / "out"), "--log-file", str(log)]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("Test_077 (not downloaded") == 1 and "note: 1 test slide(s) of" in captured.out
    assert "Test_077" not in captured.err
    assert log.read_text().count("Test_077 (not downloaded") == 1
    assert not write.logger.filters  # the command's filter is gone after it
    with caplog.at_level(logging.WARNING):
        prepare_camelyon16(root, tmp_path / "out2")
    assert any("Test_077 (not downloaded" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
