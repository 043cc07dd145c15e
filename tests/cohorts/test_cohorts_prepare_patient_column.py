"""Which labels column keeps patients whole in ``prepare folder`` (review AQ, finding B): a column named ``case``
was always taken for the patient, though datasets use it for other things (tumour/normal), so all tumour slides
became one 'patient' and the split failed with a message that did not say how to go on. Only columns that say
patient count (``patient``, ``patient_id``, TCGA's ``case_id`` and ``case_submitter_id``), ``--patient-column``
names another or turns grouping off, and prepare's output says which column grouped the split."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
from prepare_trees import distinct_copy

from wsi_milssl.cli import main
from wsi_milssl.cohorts import prepare_folder, read_label_groups
from wsi_milssl.errors import LabelsError


def _cohort(root: Path, synth_slides: dict[str, Path], header: str, cells: list[str]) -> Path:
    """s0..s7 (real generated slides, each its own bytes; s0-s3 tumour and annotated, s4-s7 normal) and
    labels.csv with ``header`` ('slide,<column>,label') and the middle cell of each row from ``cells``."""
    lines = [header]
    for k in range(8):
        label = 1 if k < 4 else 0
        source = synth_slides["tumor" if label else "normal"]
        distinct_copy(source, root / f"s{k}.tif")
        if label:
            (root / f"s{k}.xml").write_bytes(source.with_suffix(".xml").read_bytes())
        lines.append(f"s{k},{cells[k]},{label}")
    (root / "labels.csv").write_text("\n".join(lines) + "\n")
    return root / "labels.csv"


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="") as fh:
        return list(csv.reader(fh))


def _header(path: Path) -> list[str]:
    return _rows(path)[0]


def test_a_case_column_of_tumour_and_normal_is_not_a_patient_column(tmp_path, synth_slides):
    labels = _cohort(tmp_path / "c", synth_slides, "slide,case,label", ["tumor"] * 4 + ["normal"] * 4)
    assert read_label_groups(labels) is None
    result = prepare_folder(tmp_path / "c", labels, tmp_path / "out")
    train, test = result.sets["train"], result.sets["test"]
    assert {0, 1} <= set(test.labels.values()) and {0, 1} <= set(train.labels.values())
    assert result.split.startswith(f"split slide by slide: {labels} has no patient column (patient, patient_id, "
                                   "case_id, case_submitter_id")
    assert _header(train.labels_csv) == ["slide", "label"]


def test_tcga_patient_columns_are_read(tmp_path):
    (tmp_path / "tcga.csv").write_text("slide_id,case_submitter_id,label\nTCGA-A1-01Z,TCGA-A1,1\nTCGA-A1-02Z,TCGA-A1,0\n")
    assert read_label_groups(tmp_path / "tcga.csv") == ("case_submitter_id", {"TCGA-A1-01Z": "TCGA-A1",
                                                                             "TCGA-A1-02Z": "TCGA-A1"})


def test_the_output_says_which_column_kept_patients_whole(tmp_path, synth_slides, capsys):
    labels = _cohort(tmp_path / "c", synth_slides, "slide,Patient,label", ["a", "a", "b", "c", "a", "d", "e", "f"])
    code = main(["prepare", "folder", "--slides", str(tmp_path / "c"), "--labels", str(labels),
                 "--out", str(tmp_path / "out"), "--test-fraction", "0.34"])
    assert code == 0
    out = capsys.readouterr().out
    # patients: a (s0, s1, s4: tumour), b, c (tumour), d, e, f (normal): 6 patients, 3 with tumour slides
    assert (f"split: kept patients whole by column 'Patient' of {labels}: 6 patient(s) (3 with tumour slides) of 8 "
            "slides") in out
    test_patients = {r[2] for r in _rows(tmp_path / "out" / "cohort" / "test_labels.csv")[1:]}
    train_patients = {r[2] for r in _rows(tmp_path / "out" / "cohort" / "train_labels.csv")[1:]}
    assert test_patients and train_patients and not test_patients & train_patients


def test_a_split_that_patients_make_impossible_is_one_error_with_the_ways_on(tmp_path, synth_slides):
    """A column that does not name patients (here one 'patient' per label): one error naming the file, the column
    and how to go on; --patient-column none (patient_column='none') then splits slide by slide."""
    labels = _cohort(tmp_path / "c", synth_slides, "slide,patient,label", ["T"] * 4 + ["N"] * 4)
    with pytest.raises(LabelsError) as info:
        prepare_folder(tmp_path / "c", labels, tmp_path / "out")
    message = str(info.value)
    assert message.startswith(f"{labels}: cannot keep each patient's slides in one set and have tumour and normal "
                              "slides in both the training and the test set: its column 'patient'")
    assert "puts the 8 slides into 2 patient(s), 1 with tumour slides and 1 with normal slides only" in message
    assert re.search(r"Fix: if that column does not name patients, rename it in labels\.csv or prepare with "
                     r"--patient-column none .*; if it does, add slides of more patients, or give a test set with "
                     r"--test-slides and --test-labels\.$", message)
    assert message.count("cannot keep") == 1
    assert not (tmp_path / "out").exists()

    result = prepare_folder(tmp_path / "c", labels, tmp_path / "out", patient_column="none")
    assert {0, 1} <= set(result.sets["test"].labels.values())
    assert result.split.startswith("split slide by slide (--patient-column none")
    assert _header(result.sets["train"].labels_csv) == ["slide", "label"]
    assert "--patient-column none" in json.loads(result.summary_json.read_text())["command"]


def test_patient_column_names_another_column(tmp_path, synth_slides):
    labels = _cohort(tmp_path / "c", synth_slides, "slide,Subject,label", ["a", "a", "b", "c", "a", "d", "e", "f"])
    assert read_label_groups(labels) is None  # not one of GROUP_COLUMNS
    result = prepare_folder(tmp_path / "c", labels, tmp_path / "out", patient_column="subject", test_fraction=0.34)
    assert result.split.startswith(f"kept patients whole by column 'Subject' of {labels}")
    train, test = result.sets["train"].slides, result.sets["test"].slides
    a = {"s0", "s1", "s4"}
    assert a <= set(train) or a <= set(test)
    with pytest.raises(LabelsError, match=rf"^{re.escape(str(labels))}: no patient column 'donor' \(its columns: "
                                          r"'slide', 'Subject', 'label'.*Fix: name the header column"):
        prepare_folder(tmp_path / "c", labels, tmp_path / "out2", patient_column="donor")
